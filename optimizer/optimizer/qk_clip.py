r"""QK-clip (MuonClip, docs/model-spec.md §8.3) for MLA-style attention with shared KV heads (GDLA).

Weights (rows = output features):
    wq_b  [n_h * (d_nope + d_rope), q_lora]    per query head h: d_nope nope rows, then d_rope rope rows
    wkv_b [n_kv * (d_nope + d_v), kv_lora]     per KV head g: d_nope nope-key rows, then d_v value rows
Query head h reads KV head g(h) = h // (n_h / n_kv) (contiguous groups). The rope key comes from the
shared `wkv_a` rows and is never touched; value rows are never touched.

With S_h the recorded max logit of head h and tau the threshold:
    gamma_h = min(1, tau / S_h)                         (1 for heads at or below tau)
    For each KV group g with gmin_g = min_{h in g} gamma_h < 1:
        nope-key rows of g           *= sqrt(gmin_g)
        nope-query rows of h in g    *= gamma_h / sqrt(gmin_g)
        rope-query rows of h in g    *= gamma_h
Why: the logit of head h is  q_nope.k_nope + q_rope.k_rope,  linear in each weight block. The nope term
scales by (gamma_h / sqrt(gmin)) * sqrt(gmin) = gamma_h and the rope term by gamma_h, so EVERY logit of
head h scales by exactly gamma_h: a clipped head's max becomes exactly tau, and a head at or below tau
(gamma_h = 1) keeps all its logits unchanged even though its group's keys shrank. Groups with no head
over tau are not touched. (This is the spec's PROPOSAL; the per-head sqrt(gamma) split of MHA is
ill-defined when a key is shared by several query heads.)

DTensor weights sharded along rows (Shard(0)) are scaled in place: the full per-row scale vector is
built on every rank and sliced to the rows this rank holds — no communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optimizer._dtensor import local, local_row_range


@dataclass(frozen=True)
class QKLayout:
    """Head layout of one attention layer (see module doc for the row order)."""

    n_heads: int
    n_kv_heads: int
    d_nope: int
    d_rope: int
    d_v: int

    def __post_init__(self) -> None:
        if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"QKLayout: n_heads={self.n_heads} must be a positive multiple of n_kv_heads={self.n_kv_heads}"
            )


@dataclass
class QKClipStats:
    """Per-layer result for logging."""

    num_clipped_heads: int
    max_logit: float


def qk_row_scales(max_logits: torch.Tensor, layout: QKLayout, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Full per-row scale vectors (float64, CPU) for wq_b [n_h*(d_nope+d_rope)] and wkv_b [n_kv*(d_nope+d_v)]."""
    L = layout
    s = max_logits.detach().double().cpu()
    if s.shape != (L.n_heads,):
        raise ValueError(f"qk_clip: max_logits has shape {tuple(s.shape)}, expected [n_heads={L.n_heads}]")
    gamma = torch.where(s > threshold, threshold / s, torch.ones_like(s))  # [n_h]
    gmin = gamma.view(L.n_kv_heads, -1).amin(dim=1)  # [n_kv]
    gmin_per_head = gmin.repeat_interleave(L.n_heads // L.n_kv_heads)  # [n_h]
    q_nope = gamma / gmin_per_head.sqrt()
    q_scale = torch.cat([q_nope[:, None].expand(-1, L.d_nope), gamma[:, None].expand(-1, L.d_rope)], dim=1).reshape(-1)
    k_scale = torch.cat(
        [gmin.sqrt()[:, None].expand(-1, L.d_nope), torch.ones(L.n_kv_heads, L.d_v, dtype=torch.float64)], dim=1
    ).reshape(-1)
    return q_scale, k_scale


def _scale_rows_(weight: torch.Tensor, row_scale: torch.Tensor) -> None:
    start, stop = local_row_range(weight)
    w = local(weight)
    compute = torch.promote_types(w.dtype, torch.float32)  # bf16 weights are scaled in fp32, rounded once
    scale = row_scale[start:stop].to(compute)[:, None]  # on the host (qk_row_scales)
    # to a GPU pinned: the copy then does not wait for the work queued before it (the optimizer step)
    scale = scale.pin_memory().to(w.device, non_blocking=True) if w.is_cuda else scale.to(w.device)
    if w.dtype == compute:
        w.mul_(scale)
    else:
        w.copy_(w.to(compute) * scale)


@torch.no_grad()
def qk_clip_(
    wq_b: torch.Tensor, wkv_b: torch.Tensor, max_logits: torch.Tensor, layout: QKLayout, threshold: float
) -> QKClipStats:
    """Rescale `wq_b` and `wkv_b` in place so no head's max logit exceeds `threshold` (see module doc).
    `max_logits` [n_h] must already be reduced (MAX) over all data-parallel ranks."""
    L = layout
    if wq_b.shape[0] != L.n_heads * (L.d_nope + L.d_rope) or wkv_b.shape[0] != L.n_kv_heads * (L.d_nope + L.d_v):
        raise ValueError(f"qk_clip: wq_b {tuple(wq_b.shape)} / wkv_b {tuple(wkv_b.shape)} do not match layout {L}")
    if not threshold > 0:
        raise ValueError(f"qk_clip: threshold must be > 0, got {threshold}")
    logits = max_logits.detach().float()
    if not bool(torch.isfinite(logits).all()):
        raise FloatingPointError(
            f"qk_clip: non-finite max logits {logits.tolist()} (clipping would zero the weights); "
            "skip QK-clip on steps whose forward was not finite"
        )
    stats = QKClipStats(num_clipped_heads=int((logits > threshold).sum()), max_logit=float(logits.max()))
    if stats.num_clipped_heads == 0:
        return stats
    q_scale, k_scale = qk_row_scales(max_logits, L, threshold)
    _scale_rows_(wq_b, q_scale)
    _scale_rows_(wkv_b, k_scale)
    return stats
