"""Motif-3's per-step hooks (the `StepHooks` of `llm_training.model_spec`), the trainer's only way into the model
between optimizer steps:

  begin_step(progress)     mHC h_post schedule (`Motif3Model.set_mhc_progress`)
  forward_stats(out)       per micro-batch: routed-token counts per MoE layer ("tokens_per_expert", [L, E], sum)
                           and every attention layer's per-head max logit ("max_logits", [sum of n_h], max) when
                           QK-clip is on
  after_step(stats, ...)   with the step's globally reduced stats: QK-clip (MuonClip) on every GDLA layer, then the
                           aux-loss-free expert-bias update; returns the step's metrics (expert load imbalance,
                           heads rescaled by QK-clip)
The hooks issue no collective: the trainer reduces the stats once per step over all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from llm_training.distributed.utils import to_device_async
from llm_training.layers.attention.gdla import GDLAttention
from llm_training.layers.moe import MoE, update_expert_bias
from llm_training.model_spec import StepStat
from optimizer import QKClipStats, QKLayout, qk_clip_


@dataclass
class QKClipSummary:
    """QK-clip result of one step: totals plus the per-layer stats (module FQN -> QKClipStats)."""

    num_clipped_heads: int = 0
    max_logit: float = float("-inf")
    per_layer: dict[str, QKClipStats] = field(default_factory=dict)


def attention_layers(model: nn.Module) -> list[tuple[str, GDLAttention]]:
    """(FQN, module) of every GDLA layer in model order (trunk, then MTP): the order of `out.max_logits`."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, GDLAttention)]


@torch.no_grad()
def apply_qk_clip(layers: list[tuple[str, GDLAttention]], max_logits: torch.Tensor, threshold: float) -> QKClipSummary:
    """MuonClip after the optimizer step: `optimizer.qk_clip_` on each layer's `wq_b` / `wkv_b` weights (plain or
    FSDP2 DTensor) from its slice of `max_logits` (every layer's [n_h] concatenated in `layers` order, already
    MAX-reduced over all ranks and micro-batches)."""
    summary = QKClipSummary()
    per_layer = max_logits.float().split([m.n_heads for _, m in layers])
    for (name, m), layer_logits in zip(layers, per_layer, strict=True):
        layout = QKLayout(m.n_heads, m.n_kv_heads, m.d_nope, m.d_rope, m.d_v)
        stats = qk_clip_(m.wq_b.weight, m.wkv_b.weight, layer_logits, layout, threshold)
        summary.per_layer[name] = stats
        summary.num_clipped_heads += stats.num_clipped_heads
        summary.max_logit = max(summary.max_logit, stats.max_logit)
    return summary


def expert_load_imbalance(tokens_per_expert_LE: torch.Tensor) -> float | None:
    """max / mean tokens per expert of the worst MoE layer (1.0 = perfectly balanced); None without tokens."""
    worst = None
    for counts in tokens_per_expert_LE:
        c = counts.detach().double()
        if c.numel() == 0 or c.sum() <= 0:
            continue
        ratio = float(c.max() / c.mean())
        worst = ratio if worst is None else max(worst, ratio)
    return worst


class MotifStepHooks:
    """The per-step duties of a Motif3Model for one run (see the module docstring)."""

    def __init__(self, model: nn.Module, model_args, job_config):
        self.model = model
        self.qk_clip_threshold = job_config.optimizer.qk_clip_threshold
        self.bias_update_coeff = model_args.load_balance_coeff
        self.attention = attention_layers(model)
        self.first_moe = next((m for m in model.modules() if isinstance(m, MoE)), None)  # where the biases live
        model.set_record_max_logits(self.qk_clip_threshold > 0)

    def begin_step(self, progress: float) -> None:
        self.model.set_mhc_progress(progress)

    def forward_stats(self, out) -> dict[str, StepStat]:
        stats = {}
        if out.router_stats:
            stats["tokens_per_expert"] = StepStat(torch.stack([s.tokens_per_expert for s in out.router_stats]), "sum")
        if out.max_logits is not None:
            stats["max_logits"] = StepStat(torch.cat([m.reshape(-1) for m in out.max_logits]), "max")
        return stats

    def after_step(self, stats: dict[str, torch.Tensor], applied: bool) -> dict:
        tokens = stats.get("tokens_per_expert")
        metrics = {
            "expert_imbalance": expert_load_imbalance(tokens) if tokens is not None else None,
            "qk_clip_events": 0,
        }
        if not applied:
            return metrics
        if "max_logits" in stats:
            metrics["qk_clip_events"] = apply_qk_clip(
                self.attention, stats["max_logits"], self.qk_clip_threshold
            ).num_clipped_heads
        if tokens is not None:  # the host copy goes back to the biases' device without waiting for its queue
            device = self.first_moe.expert_bias.device
            update_expert_bias(self.model, to_device_async(tokens, device), self.bias_update_coeff)
        return metrics
