"""Rotary position embedding (RoPE) with optional YaRN frequency interpolation (docs/model-spec.md §3.3, §5).

Layout: interleaved pairs, i.e. dims (2j, 2j+1) of a rope slice rotate together by angle
`pos * inv_freq[j]` (the layout of our training weights; the HF adapter permutes to half-split).
Rotation is done in fp32 and cast back to the input dtype.

Two tables exist per model: sliding-window layers use plain RoPE with `swa_rope_theta` (never YaRN);
full-attention layers use `rope_theta`, YaRN-interpolated when `args.yarn_active`. The YaRN mscale^2
softmax correction lives in `Motif3ModelArgs.softmax_scale`, not in the cos/sin tables
(mscale == mscale_all_dim, so the cos/sin factor cancels, as in DeepSeek-V3).
"""

from __future__ import annotations

import math

import torch


def plain_inv_freq(rope_dim: int, theta: float) -> torch.Tensor:
    """inv_freq[j] = theta^(-2j/rope_dim), j < rope_dim/2, float64 on CPU."""
    j = torch.arange(0, rope_dim, 2, dtype=torch.float64, device="cpu")
    return theta ** (-j / rope_dim)


def yarn_correction_dim(num_rotations: float, rope_dim: int, theta: float, original_seq_len: int) -> float:
    """The (fractional) pair index whose wavelength makes `num_rotations` turns over the original context."""
    return rope_dim * math.log(original_seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_inv_freq(
    rope_dim: int, theta: float, factor: float, beta_fast: float, beta_slow: float, original_seq_len: int
) -> torch.Tensor:
    """YaRN (DeepSeek-V3 form): ramp per pair between the original frequency (fast-rotating pairs,
    index below the beta_fast correction dim) and the interpolated frequency theta-freq / factor
    (slow pairs, index above the beta_slow correction dim), linear in the pair index in between."""
    base = plain_inv_freq(rope_dim, theta)
    low = math.floor(yarn_correction_dim(beta_fast, rope_dim, theta, original_seq_len))
    high = math.ceil(yarn_correction_dim(beta_slow, rope_dim, theta, original_seq_len))
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep_original = 1.0 - ramp  # 1 for the fast (high-frequency) pairs
    return base / factor * (1.0 - keep_original) + base * keep_original


class RotaryEmbedding:
    """cos/sin lookup for one inverse-frequency vector; tables cached per (device, length).

    Not an nn.Module on purpose: it holds no state that belongs in a checkpoint, and the cached tables
    are rebuilt on whatever device the positions live on (so meta-device construction is free).
    """

    def __init__(self, inv_freq: torch.Tensor, min_table_len: int):
        self.inv_freq = inv_freq.to(device="cpu", dtype=torch.float64)  # host copy, even under a meta context
        self.min_table_len = int(min_table_len)
        self._tables: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def prepare(self, device: torch.device, length: int) -> None:
        """Build the table for `length` positions on `device` now (eagerly). The model calls this before its
        blocks run: a table first built inside a compiled block would make that block's graph differ from the
        next identical block's (the cache lookup is traced), costing a recompile per table."""
        self._table(device, length)

    def _table(self, device: torch.device, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = max(self.min_table_len, length)
        n = 1 << (n - 1).bit_length()  # round up to a power of two: few distinct tables
        key = (device, n)
        if key not in self._tables:
            if device.type == "meta":
                empty = torch.empty(n, self.inv_freq.numel(), device=device)
                return empty, empty
            pos = torch.arange(n, dtype=torch.float64, device="cpu")
            angles = torch.outer(pos, self.inv_freq)  # [n, d/2], float64 for an exact table
            self._tables[key] = (angles.cos().float().to(device), angles.sin().float().to(device))
        return self._tables[key]

    def cos_sin(self, position_ids_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos, sin of shape [B, S, d/2] for the given positions.

        The table covers max(min_table_len, S) positions (no device sync to look at the values):
        positions must be < that, which holds when they restart per document and seq_len <= max_seq_len.
        """
        cos, sin = self._table(position_ids_BS.device, position_ids_BS.shape[-1])
        return cos[position_ids_BS], sin[position_ids_BS]


def apply_rope_interleaved(x_BShD: torch.Tensor, cos_BSd: torch.Tensor, sin_BSd: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2j, 2j+1) of the last dim by the angle whose cos/sin ([B, S, d/2]) are given; fp32 inside.

    Written as y = x cos + swap(x) (-1, +1) sin, swap exchanging the two members of each pair (a flip of the pair
    dim): y0 = x0 cos - x1 sin, y1 = x1 cos + x0 sin, the same products and sums as the rotation written out, so the
    same bits. Each output element is then one expression of two loads of x, where the written-out form's stack of
    its two results compiled to a select between both chains per element. Fused with the q / k assembly, inductor's
    kernels still take 1.5-1.6 s each to build on an H100 (session 32; the stack form's 1.0-1.75 s were measured on
    another H100, not side by side)."""
    xf = x_BShD.float().unflatten(-1, (-1, 2))  # [B, S, h, d/2, 2]
    cos, sin = cos_BSd[:, :, None, :, None], sin_BSd[:, :, None, :, None]  # broadcast over heads and the pair
    sign = torch.arange(2, device=xf.device, dtype=xf.dtype) * 2 - 1  # (-1, +1) for pair members (0, 1)
    out = xf * cos + xf.flip(-1) * sign * sin
    return out.flatten(-2).to(x_BShD.dtype)


def build_rotary_embeddings(args) -> tuple[RotaryEmbedding, RotaryEmbedding]:
    """(full-layer RoPE, sliding-layer RoPE) for a Motif3ModelArgs."""
    d = args.qk_rope_head_dim
    if args.yarn_active:
        full = yarn_inv_freq(
            d, args.rope_theta, args.rope_factor, args.beta_fast, args.beta_slow, args.original_seq_len
        )
    else:
        full = plain_inv_freq(d, args.rope_theta)
    sliding = plain_inv_freq(d, args.swa_rope_theta)
    return RotaryEmbedding(full, args.max_seq_len), RotaryEmbedding(sliding, args.max_seq_len)
