"""Triton kernels of mHC's stream-wide backward (`layers.mhc`), imported only where triton is.

Selected by `[model] mhc_backward = "fused"` (default "tensor_ops": inductor compiles the Functions' tensor ops).
Status: correct (tests/layers/test_mhc_kernels.py, Triton interpreter; the first version also on the H200). The
first version was SLOWER than inductor's code on the H200 (bench_vs_torchtitan ours_nomtp+adamw@accum,
motif3_proxy, 64K tokens per step: 2054 vs 2006 ms per step; per launch at 16K tokens, n 4, H 4096:
mix 4.0 ms, projection 2.2 ms, collapse 0.6 ms, against ~0.3-0.5 ms of DRAM traffic each; compile time fell,
first step 113 -> 98 s). Its [n, n, BLOCK_H] broadcasts and per-step reductions were the suspects, so the per-token
products are now tensor-core dots on tiles padded to 16 rows. This version has NOT run on a GPU:
bench/bench_mhc_kernels.py times each kernel (inductor's code for the same work took ~5.3 ms per sub-layer, all
three together), and `bench_vs_torchtitan.py --mhc-backward fused` the step.

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
def _source_coefficients(sh_ptr, sp_ptr, t, ri, ci, n: tl.constexpr):
    """[R, R] fp32: [H0 | p0] of the source, row j = (H0[j, 0..n-1], p0[j]), zero padded; times [X0; y0] it gives
    the stream rows."""
    c0 = tl.load(sh_ptr + t * n * n + ri * n + ci, mask=(ri < n) & (ci < n), other=0.0)
    return c0 + tl.load(sp_ptr + t * n + ri + 0 * ci, mask=(ri < n) & (ci == n), other=0.0)


@triton.jit
def _stream_tile(x_ptr, c0, sy_ptr, t, ri, c, cvalid, n: tl.constexpr, H: tl.constexpr, FROM_SOURCE: tl.constexpr):
    """fp32 [R, BLOCK_H] tile of X[t, :, c] (rows >= n zero): loaded, or rebuilt from the source as
    [H0 | p0] [X0; y0] (3xTF32 dot, about fp32) and rounded to X's dtype as the forward stored it."""
    rows = (ri < n) & cvalid[None, :]
    if FROM_SOURCE:
        src = tl.load(x_ptr + t * n * H + ri * H + c[None, :], mask=rows, other=0.0).to(tl.float32)
        src += tl.load(sy_ptr + t * H + c[None, :] + 0 * ri, mask=(ri == n) & cvalid[None, :], other=0.0).to(tl.float32)
        return _round_like(tl.dot(c0, src, input_precision="tf32x3"), x_ptr.dtype.element_ty)
    return tl.load(x_ptr + t * n * H + ri * H + c[None, :], mask=rows, other=0.0).to(tl.float32)


# The per-token kernels pad the n streams (plus one row for y) to R = 16 rows, the least tl.dot takes, and do the
# per-token products as tensor-core dots (3xTF32: about fp32) accumulated over the column steps: no per-step
# reductions and no 3D broadcasts (the first version's [n, n, BLOCK_H] products ran at ~0.5 TB/s on the H200).
@triton.jit
def _mix_backward_kernel(
    g_ptr, x_ptr, sh_ptr, sp_ptr, sy_ptr, h_ptr, p_ptr, y_ptr,
    dx_ptr, dh_ptr, dp_ptr, dy_ptr,
    H: tl.constexpr, n: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, FROM_SOURCE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, R)
    ri, ci = r[:, None], r[None, :]
    # [R(j), R(i)]: row j < n is column j of H (dX[j] = sum_i H[i, j] g[i]), row n is p (dy = sum_i p[i] g[i])
    coef = tl.load(h_ptr + t * n * n + ci * n + ri, mask=(ri < n) & (ci < n), other=0.0)
    coef += tl.load(p_ptr + t * n + ci + 0 * ri, mask=(ri == n) & (ci < n), other=0.0)
    c0 = _source_coefficients(sh_ptr, sp_ptr, t, ri, ci, n) if FROM_SOURCE else coef
    acc = tl.zeros((R, R), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        c = h0 + tl.arange(0, BLOCK_H)
        cvalid = c < H
        g = tl.load(g_ptr + t * n * H + ri * H + c[None, :], mask=(ri < n) & cvalid[None, :], other=0.0)
        g = g.to(tl.float32)
        out = tl.dot(coef, g, input_precision="tf32x3")
        _store(dx_ptr + t * n * H + ri * H + c[None, :], out, (ri < n) & cvalid[None, :])
        _store(dy_ptr + t * H + c[None, :] + 0 * ri, out, (ri == n) & cvalid[None, :])
        xy = _stream_tile(x_ptr, c0, sy_ptr, t, ri, c, cvalid, n, H, FROM_SOURCE)
        xy += tl.load(y_ptr + t * H + c[None, :] + 0 * ri, mask=(ri == n) & cvalid[None, :], other=0.0).to(tl.float32)
        # [R(i), R(j)]: dH[i, j] = sum_c g[i] X[j] (j < n), dp[i] = sum_c g[i] y (j = n)
        acc += tl.dot(g, tl.trans(xy), input_precision="tf32x3")
    tl.store(dh_ptr + t * n * n + ri * n + ci, acc, mask=(ri < n) & (ci < n))
    tl.store(dp_ptr + t * n + ri + 0 * ci, acc, mask=(ri < n) & (ci == n))


@triton.jit
def _collapse_backward_kernel(
    gu_ptr, x_ptr, sh_ptr, sp_ptr, sy_ptr, h_ptr, dx_ptr, dh_ptr,
    H: tl.constexpr, n: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, FROM_SOURCE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, R)
    ri, ci = r[:, None], r[None, :]
    h = tl.load(h_ptr + t * n + ri, mask=ri < n, other=0.0)  # [R, 1]
    c0 = _source_coefficients(sh_ptr, sp_ptr, t, ri, ci, n) if FROM_SOURCE else tl.zeros((R, R), dtype=tl.float32)
    acc = tl.zeros((R, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        c = h0 + tl.arange(0, BLOCK_H)
        cvalid = c < H
        gu = tl.load(gu_ptr + t * H + c, mask=cvalid, other=0.0).to(tl.float32)[None, :]
        _store(dx_ptr + t * n * H + ri * H + c[None, :], h * gu, (ri < n) & cvalid[None, :])
        acc += _stream_tile(x_ptr, c0, sy_ptr, t, ri, c, cvalid, n, H, FROM_SOURCE) * gu  # dh[i] = sum_c X[i] gu
    tl.store(dh_ptr + t * n + r, tl.sum(acc, axis=1), mask=r < n)


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


def _rows_padded(n: int) -> int:
    """R: the n streams and one more row (y, or p), padded to a power of two of at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(n + 1))


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
        dx, dh, dp, dy, H, n, _rows_padded(n), _BLOCK_H, from_source,
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
        gu_TH.contiguous(), xs, sh, sp, sy, h_Tn.contiguous(), dx, dh, H, n, _rows_padded(n), _BLOCK_H, from_source,
    )  # fmt: skip
    return dx, dh


def projection_block(H: int) -> int | None:
    """Columns per program of `projection_backward` for stream width H (a power of two <= 128 dividing H, at least
    16 for tl.dot), or None when H has no such divisor."""
    for b in (128, 64, 32, 16):
        if H % b == 0:
            return b
    return None


def projection_backward(
    draw_TK, coef_T, folded_KD, x_TnH, source=(None,) * 4, block_t=_BLOCK_T, tokens_per_group=_TOKENS_PER_GROUP,
    num_warps=4,
):  # fmt: skip
    """(dX [T, n, H] in X's dtype, dW~ [K, D] fp32) of pqr = rstd * (vec(X) W~^T) given draw = dpqr * rstd and
    c = (2 / D) d(mean sq): dX = draw W~ + c X, dW~ = draw^T vec(X). block_t, tokens_per_group, num_warps: the
    tiling (bench/bench_mhc_kernels.py compares some)."""
    T, K = draw_TK.shape
    xs, sh, sp, sy, from_source = _source_args(x_TnH, source)
    n, H = xs.shape[-2:]
    D = n * H
    block_d = projection_block(H)
    dtype = xs.dtype
    dx = torch.empty(T, n, H, dtype=dtype, device=draw_TK.device)
    groups = triton.cdiv(T, tokens_per_group)
    dw_parts = torch.empty(groups, K, D, dtype=torch.float32, device=draw_TK.device)
    _projection_backward_kernel[(D // block_d, groups)](
        draw_TK.float().contiguous(), coef_T.float().contiguous(), folded_KD.float().contiguous(), xs, sh, sp, sy,
        dx, dw_parts, T, H, K, n, max(16, triton.next_power_of_2(K)), block_t, block_d, tokens_per_group,
        from_source, num_warps=num_warps,
    )  # fmt: skip
    return dx, dw_parts.sum(0)


__all__ = ["collapse_backward", "mix_backward", "projection_backward", "projection_block"]
