"""Triton kernels of mHC's stream-wide backward (`layers.mhc`), imported only where triton is.

Each kernel reads the n-wide stream once and does every stream-wide piece of one autograd Function's backward
in that pass, with the per-token reductions in registers (the mHC paper's fused kernels with recompute,
arXiv 2512.24880):

  mix_backward       X' = H X + p y:   dX = H^T g, dH = g X^T, dp = g . y, dy = p . g
  collapse_backward  u = h . X:        dX = h gu, dh = X . gu
  projection_backward  pqr = rstd * (vec(X) W~^T):  dX = draw W~ + c X (fp32 inside, one rounding), and the
                     weight gradient draw^T vec(X) as per-token-group partial sums (added by the caller, so the
                     result does not depend on scheduling); K = 2n + n^2 is tiny, so the "GEMMs" are rank-K
                     products done with tl.dot in 3xTF32 (about fp32 accuracy) on the tile in registers.

The stream X is either given or rebuilt in registers from its source (X = mix(X0, H0, p0, y0), `StreamSource`),
rounded to X's dtype as the forward stored it, so the mid-block stream never exists in memory in backward.
Reductions over H and over n are fp32; their order differs from the torch path (tests/layers/test_mhc_kernels.py
holds both to fp32 rounding). The stream width H is a compile-time constant (one specialisation per model width,
and the Triton interpreter's loops need constant bounds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_H = 256  # stream columns per step of the per-token kernels
_BLOCK_T = 32  # tokens per tile of the projection kernel (tl.dot needs >= 16)
_TOKENS_PER_GROUP = 1024  # tokens whose weight-gradient partials one program of the projection kernel sums


@triton.jit
def _round_like(x, dtype: tl.constexpr):
    """fp32 x rounded to `dtype` (round to nearest even) and back to fp32: the value the forward stored. bf16 is
    rounded on the bits (the Triton interpreter's cast truncates)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)


@triton.jit
def _store(ptr, x, mask):
    """Store fp32 x in ptr's dtype, rounded to nearest even (`_round_like`)."""
    tl.store(ptr, _round_like(x, ptr.dtype.element_ty).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _stream_rows(
    x_ptr, sh_ptr, sp_ptr, sy_ptr, t, rows, cols, mask, n: tl.constexpr, H: tl.constexpr, FROM_SOURCE: tl.constexpr
):
    """fp32 values of X[t, rows, cols] (rows [R, 1], cols [1, C] index tensors): loaded, or rebuilt from the
    source as sum_l H0[t, row, l] X0[t, l, col] + p0[t, row] y0[t, col] in fp32 (the forward's term order) and
    rounded to X's dtype."""
    if FROM_SOURCE:
        acc = tl.load(sp_ptr + t * n + rows, mask=mask, other=0.0) * tl.load(
            sy_ptr + t * H + cols, mask=mask, other=0.0
        ).to(tl.float32)
        x = tl.zeros_like(acc)
        for l in tl.static_range(n):
            hl = tl.load(sh_ptr + t * n * n + rows * n + l, mask=mask, other=0.0)
            x += hl * tl.load(x_ptr + t * n * H + l * H + cols, mask=mask, other=0.0).to(tl.float32)
        return _round_like(x + acc, x_ptr.dtype.element_ty)
    return tl.load(x_ptr + t * n * H + rows * H + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _mix_backward_kernel(
    g_ptr, x_ptr, sh_ptr, sp_ptr, sy_ptr, h_ptr, p_ptr, y_ptr,
    dx_ptr, dh_ptr, dp_ptr, dy_ptr,
    H: tl.constexpr, n: tl.constexpr, NP: tl.constexpr, BLOCK_H: tl.constexpr, FROM_SOURCE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    ivalid = i < n
    hij_mask = ivalid[:, None] & ivalid[None, :]
    # H[t] [NP(i), NP(j)] and p[t] [NP]
    h = tl.load(h_ptr + t * n * n + i[:, None] * n + i[None, :], mask=hij_mask, other=0.0)
    p = tl.load(p_ptr + t * n + i, mask=ivalid, other=0.0)
    acc_h = tl.zeros((NP, NP), dtype=tl.float32)
    acc_p = tl.zeros((NP,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        c = h0 + tl.arange(0, BLOCK_H)
        cvalid = c < H
        mask = ivalid[:, None] & cvalid[None, :]
        g = tl.load(g_ptr + t * n * H + i[:, None] * H + c[None, :], mask=mask, other=0.0).to(tl.float32)
        x = _stream_rows(x_ptr, sh_ptr, sp_ptr, sy_ptr, t, i[:, None], c[None, :], mask, n, H, FROM_SOURCE)
        y = tl.load(y_ptr + t * H + c, mask=cvalid, other=0.0).to(tl.float32)
        dx = tl.sum(h[:, :, None] * g[:, None, :], axis=0)  # dX[j] = sum_i H[i, j] g[i]
        _store(dx_ptr + t * n * H + i[:, None] * H + c[None, :], dx, mask)
        dy = tl.sum(p[:, None] * g, axis=0)  # dy = sum_i p[i] g[i]
        _store(dy_ptr + t * H + c, dy, cvalid)
        acc_h += tl.sum(g[:, None, :] * x[None, :, :], axis=2)  # dH[i, j] = sum_c g[i] X[j]
        acc_p += tl.sum(g * y[None, :], axis=1)  # dp[i] = sum_c g[i] y
    tl.store(dh_ptr + t * n * n + i[:, None] * n + i[None, :], acc_h, mask=hij_mask)
    tl.store(dp_ptr + t * n + i, acc_p, mask=ivalid)


@triton.jit
def _collapse_backward_kernel(
    gu_ptr, x_ptr, sh_ptr, sp_ptr, sy_ptr, h_ptr, dx_ptr, dh_ptr,
    H: tl.constexpr, n: tl.constexpr, NP: tl.constexpr, BLOCK_H: tl.constexpr, FROM_SOURCE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    ivalid = i < n
    h = tl.load(h_ptr + t * n + i, mask=ivalid, other=0.0)
    acc = tl.zeros((NP,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        c = h0 + tl.arange(0, BLOCK_H)
        cvalid = c < H
        mask = ivalid[:, None] & cvalid[None, :]
        gu = tl.load(gu_ptr + t * H + c, mask=cvalid, other=0.0).to(tl.float32)
        x = _stream_rows(x_ptr, sh_ptr, sp_ptr, sy_ptr, t, i[:, None], c[None, :], mask, n, H, FROM_SOURCE)
        _store(dx_ptr + t * n * H + i[:, None] * H + c[None, :], h[:, None] * gu[None, :], mask)
        acc += tl.sum(x * gu[None, :], axis=1)  # dh[i] = sum_c X[i] gu
    tl.store(dh_ptr + t * n + i, acc, mask=ivalid)


@triton.jit
def _projection_backward_kernel(
    draw_ptr, coef_ptr, w_ptr, x_ptr, sh_ptr, sp_ptr, sy_ptr, dx_ptr, dw_part_ptr,
    T, H: tl.constexpr, K: tl.constexpr, n: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    TOKENS_PER_GROUP: tl.constexpr, FROM_SOURCE: tl.constexpr,
):  # fmt: skip
    D = n * H
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)  # columns of vec(X), all in stream d // H (H % BLOCK_D == 0)
    group = tl.program_id(1)
    stream = (tl.program_id(0) * BLOCK_D) // H
    col = d - stream * H
    k = tl.arange(0, KP)
    kvalid = k < K
    w = tl.load(w_ptr + k[:, None] * D + d[None, :], mask=kvalid[:, None], other=0.0)  # W~ [KP, BLOCK_D]
    acc_w = tl.zeros((KP, BLOCK_D), dtype=tl.float32)
    for t0 in range(0, TOKENS_PER_GROUP, BLOCK_T):
        t = group * TOKENS_PER_GROUP + t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        tvalid = t < T
        mask = tvalid[:, None] & (col[None, :] >= 0)
        draw = tl.load(draw_ptr + t[:, None] * K + k[None, :], mask=tvalid[:, None] & kvalid[None, :], other=0.0)
        coef = tl.load(coef_ptr + t, mask=tvalid, other=0.0)
        if FROM_SOURCE:
            x = tl.load(sp_ptr + t[:, None] * n + stream, mask=tvalid[:, None], other=0.0) * tl.load(
                sy_ptr + t[:, None] * H + col[None, :], mask=mask, other=0.0
            ).to(tl.float32)
            xs = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
            for l in tl.static_range(n):
                hl = tl.load(sh_ptr + t[:, None] * n * n + stream * n + l, mask=tvalid[:, None], other=0.0)
                xs += hl * tl.load(x_ptr + t[:, None] * D + l * H + col[None, :], mask=mask, other=0.0).to(tl.float32)
            x = _round_like(xs + x, x_ptr.dtype.element_ty)
        else:
            x = tl.load(x_ptr + t[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
        dx = tl.dot(draw, w, input_precision="tf32x3") + coef[:, None] * x
        _store(dx_ptr + t[:, None] * D + d[None, :], dx, mask)
        acc_w += tl.dot(tl.trans(draw), x, input_precision="tf32x3")
    tl.store(dw_part_ptr + group * K * D + k[:, None] * D + d[None, :], acc_w, mask=kvalid[:, None])


def _source_args(x: torch.Tensor, source: tuple) -> tuple:
    """(stream or X0, H0, p0, y0, FROM_SOURCE) as kernel arguments; the unused pointers get the stream."""
    if source[0] is None:
        return x.contiguous(), x, x, x, False
    x0, h0, p0, y0 = source
    return x0.contiguous(), h0.contiguous(), p0.contiguous(), y0.contiguous(), True


def mix_backward(g_TnH, x_TnH, h_Tnn, p_Tn, y_TH, source=(None,) * 4):
    """(dX [T, n, H] in X's dtype, dH [T, n, n] fp32, dp [T, n] fp32, dy [T, H] in y's dtype) of
    X' = H X + p y, from g = dX'; X given, or rebuilt from `source` (X0, H0, p0, y0)."""
    T, n, H = g_TnH.shape
    xs, sh, sp, sy, from_source = _source_args(x_TnH, source)
    dtype = (source[0] if from_source else x_TnH).dtype
    dx = torch.empty(T, n, H, dtype=dtype, device=g_TnH.device)
    dh = torch.empty(T, n, n, dtype=torch.float32, device=g_TnH.device)
    dp = torch.empty(T, n, dtype=torch.float32, device=g_TnH.device)
    dy = torch.empty(T, H, dtype=y_TH.dtype, device=g_TnH.device)
    _mix_backward_kernel[(T,)](
        g_TnH.contiguous(), xs, sh, sp, sy, h_Tnn.contiguous(), p_Tn.contiguous(), y_TH.contiguous(),
        dx, dh, dp, dy, H, n, triton.next_power_of_2(n), _BLOCK_H, from_source,
    )  # fmt: skip
    return dx, dh, dp, dy


def collapse_backward(gu_TH, x_TnH, h_Tn, source=(None,) * 4):
    """(dX [T, n, H] in X's dtype, dh [T, n] fp32) of u = sum_i h[i] X[i], from gu = du."""
    T, H = gu_TH.shape
    xs, sh, sp, sy, from_source = _source_args(x_TnH, source)
    n = h_Tn.shape[1]
    dtype = (source[0] if from_source else x_TnH).dtype
    dx = torch.empty(T, n, H, dtype=dtype, device=gu_TH.device)
    dh = torch.empty(T, n, dtype=torch.float32, device=gu_TH.device)
    _collapse_backward_kernel[(T,)](
        gu_TH.contiguous(), xs, sh, sp, sy, h_Tn.contiguous(), dx, dh, H, n, triton.next_power_of_2(n), _BLOCK_H,
        from_source,
    )  # fmt: skip
    return dx, dh


def projection_block(H: int) -> int | None:
    """Columns per program of `projection_backward` for stream width H (a power of two <= 128 dividing H, at least
    16 for tl.dot), or None when H has no such divisor."""
    for b in (128, 64, 32, 16):
        if H % b == 0:
            return b
    return None


def projection_backward(draw_TK, coef_T, folded_KD, x_TnH, source=(None,) * 4):
    """(dX [T, n, H] in X's dtype, dW~ [K, D] fp32) of pqr = rstd * (vec(X) W~^T) given draw = dpqr * rstd and
    c = (2 / D) d(mean sq): dX = draw W~ + c X, dW~ = draw^T vec(X)."""
    T, K = draw_TK.shape
    xs, sh, sp, sy, from_source = _source_args(x_TnH, source)
    n, H = xs.shape[-2:]
    D = n * H
    block_d = projection_block(H)
    dtype = xs.dtype
    dx = torch.empty(T, n, H, dtype=dtype, device=draw_TK.device)
    groups = triton.cdiv(T, _TOKENS_PER_GROUP)
    dw_parts = torch.empty(groups, K, D, dtype=torch.float32, device=draw_TK.device)
    _projection_backward_kernel[(D // block_d, groups)](
        draw_TK.float().contiguous(), coef_T.float().contiguous(), folded_KD.float().contiguous(), xs, sh, sp, sy,
        dx, dw_parts, T, H, K, n, max(16, triton.next_power_of_2(K)), _BLOCK_T, block_d, _TOKENS_PER_GROUP,
        from_source,
    )  # fmt: skip
    return dx, dw_parts.sum(0)


__all__ = ["collapse_backward", "mix_backward", "projection_backward", "projection_block"]
