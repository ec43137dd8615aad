"""Motif-3's optimizer grouping rules: which parameters Muon orthogonalises and which AdamW updates (with or
without weight decay). The one source of that rule; the model spec hands it to the trainer's generic
`build_optimizers`.

Grouping (docs/model-spec.md §8.1; the three `*_in_muon` flags flip their rule to Muon):
  Muon:            self_attn.{wq_a, wq_b, wq_b_gate, wkv_a, wkv_b, wo}; dense and shared-expert
                   mlp {gate,up,down}_proj; routed experts gate_up_proj (3-D, gate/up halves orthogonalised
                   separately) and down_proj (3-D); MTP input_proj (MTP block matrices match the rules above)
  AdamW + decay:   embed_tokens, lm_head, moe.router.gate (router_in_muon), mhc proj_{pre,post,res}
                   (mhc_proj_in_muon), self_attn.lambda_proj (lambda_in_muon)
  AdamW, no decay: every norm weight, PolyNorm act_fn weight/bias, mHC alpha_* / bias_* / norm
  Never:           moe.expert_bias (a buffer; a parameter of that name is an error)
"""

from __future__ import annotations

from optimizer import GroupRule

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


def motif_optimizer_rules(optimizer_config) -> tuple[list[GroupRule], tuple[str, ...]]:
    """(group rules, forbidden parameter names) for an `[optimizer]` config section."""
    o = optimizer_config
    return motif_group_rules(o.router_in_muon, o.mhc_proj_in_muon, o.lambda_in_muon), FORBIDDEN
