"""Optimizer glue for Motif-3: the Motif parameter-grouping rules, `build_optimizers(model, job_config)`
(Muon + AdamW + one LR scheduler from the `[optimizer]` / `[lr_scheduler]` config) and
`apply_qk_clip(model, threshold, dp_group)` (MuonClip on every GDLA layer, from `attn.max_logits`).

Everything generic (Muon, grouping engine, QK-clip math, schedules) lives in the `optimizer` package; this
module only knows Motif's parameter names (docs/CONTRACTS.md) and config fields.

Grouping (model-spec §8.1; the three `*_in_muon` flags flip their rule to Muon):
  Muon:            self_attn.{wq_a, wq_b, wq_b_gate, wkv_a, wkv_b, wo}; dense and shared-expert
                   mlp {gate,up,down}_proj; routed experts gate_up_proj (3-D, gate/up halves orthogonalised
                   separately) and down_proj (3-D); MTP input_proj (MTP block matrices match the rules above)
  AdamW + decay:   embed_tokens, lm_head, moe.router.gate (router_in_muon), mhc proj_{pre,post,res}
                   (mhc_proj_in_muon), self_attn.lambda_proj (lambda_in_muon)
  AdamW, no decay: every norm weight, PolyNorm act_fn weight/bias, mHC alpha_* / bias_* / norm
  Never:           moe.expert_bias (a buffer; a parameter of that name is an error)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from optimizer import GroupRule, LRScheduler, OptimizersContainer, QKClipStats, QKLayout, qk_clip_
from optimizer import build_optimizers as _build_generic

logger = logging.getLogger(__name__)

FORBIDDEN = (r"(^|\.)expert_bias$",)


def motif_group_rules(router_in_muon: bool = False, mhc_proj_in_muon: bool = False, lambda_in_muon: bool = False):
    """Motif-3's grouping rules, in priority order (first match wins)."""

    def muon_or_adamw(flag: bool) -> str:
        return "muon" if flag else "adamw_decay"

    return [
        GroupRule(r"moe\.experts\.gate_up_proj$", "muon", expert=True, row_split=2),
        GroupRule(r"moe\.experts\.down_proj$", "muon", expert=True),
        GroupRule(r"act_fn\.(weight|bias)$", "adamw_no_decay"),
        GroupRule(r"self_attn\.(wq_a|wq_b|wq_b_gate|wkv_a|wkv_b|wo)\.weight$", "muon"),
        GroupRule(r"self_attn\.lambda_proj\.weight$", muon_or_adamw(lambda_in_muon)),
        GroupRule(r"(mlp|shared_experts)\.(gate_proj|up_proj|down_proj)\.weight$", "muon"),
        GroupRule(r"mtp_layers\.\d+\.input_proj\.weight$", "muon"),
        GroupRule(r"moe\.router\.gate\.weight$", muon_or_adamw(router_in_muon)),
        GroupRule(r"mhc_(attn|ffn)\.proj_(pre|post|res)\.weight$", muon_or_adamw(mhc_proj_in_muon)),
        GroupRule(r"mhc_(attn|ffn)\.(alpha|bias)_(pre|post|res)$", "adamw_no_decay"),
        GroupRule(r"(^|\.)(embed_tokens|lm_head)\.weight$", "adamw_decay"),
        GroupRule(r"(norm|layernorm)\.weight$", "adamw_no_decay"),  # all RMSNorms incl. q/kv/mHC/embed/final
    ]


def build_optimizers(model: nn.Module, job_config) -> OptimizersContainer:
    """Muon + AdamW for `model` from `job_config.optimizer`, with `.lr_scheduler` (an `LRScheduler` over both
    optimizers, `job_config.lr_scheduler`, total steps = `job_config.training.steps`) attached.
    `[optimizer] name = "adamw"` puts every parameter in AdamW (matrices with decay)."""
    o, s = job_config.optimizer, job_config.lr_scheduler
    if o.name not in ("muon", "adamw"):
        raise ValueError(f"[optimizer] name {o.name!r} is not one of ('muon', 'adamw')")
    container = _build_generic(
        model,
        motif_group_rules(o.router_in_muon, o.mhc_proj_in_muon, o.lambda_in_muon),
        forbidden=FORBIDDEN,
        lr=o.lr,
        weight_decay=o.weight_decay,
        use_muon=o.name == "muon",
        momentum=o.momentum,
        nesterov=o.nesterov,
        ns_steps=o.ns_steps,
        adamw_betas=tuple(o.adamw_betas),
        adamw_eps=o.adamw_eps,
        log=logger.info,
    )
    container.lr_scheduler = LRScheduler(
        container.optimizers,
        warmup_steps=s.warmup_steps,
        total_steps=job_config.training.steps,
        decay_type=s.decay_type,
        min_lr_factor=s.min_lr_factor,
        wsd_decay_ratio=s.wsd_decay_ratio,
    )
    return container


@dataclass
class QKClipSummary:
    """QK-clip result of one step: totals plus the per-layer stats (module FQN -> QKClipStats)."""

    num_clipped_heads: int = 0
    max_logit: float = float("-inf")
    per_layer: dict[str, QKClipStats] = field(default_factory=dict)


def _attention_layers(model: nn.Module):
    """(fqn, module) of every attention module that recorded max logits in the last forward."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if getattr(m, "max_logits", None) is not None and hasattr(m, "wq_b") and hasattr(m, "wkv_b")
    ]


@torch.no_grad()
def apply_qk_clip(model: nn.Module, threshold: float, dp_group=None) -> QKClipSummary:
    """MuonClip after the optimizer step: MAX-reduce every layer's `attn.max_logits` [n_h] over `dp_group`
    (one collective for all layers), then `optimizer.qk_clip_` on its `wq_b` / `wkv_b` weights (plain or
    FSDP2 DTensor). Layers without recorded logits (recording off) are skipped."""
    layers = _attention_layers(model)
    summary = QKClipSummary()
    if not layers:
        return summary
    flat = torch.cat([m.max_logits.float().reshape(-1) for _, m in layers])  # every layer's [n_h], concatenated
    if dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=dp_group)
    per_layer = flat.split([m.max_logits.numel() for _, m in layers])
    for (name, m), layer_logits in zip(layers, per_layer):
        layout = QKLayout(m.n_heads, m.n_kv_heads, m.d_nope, m.d_rope, m.d_v)
        stats = qk_clip_(m.wq_b.weight, m.wkv_b.weight, layer_logits, layout, threshold)
        summary.per_layer[name] = stats
        summary.num_clipped_heads += stats.num_clipped_heads
        summary.max_logit = max(summary.max_logit, stats.max_logit)
    return summary
