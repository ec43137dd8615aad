"""Triton kernels of mHC's stream-wide backward (`layers.mhc`), imported only where triton is.

Used where `[kernels] mhc_backward` is "auto" (the default) or "fused" and the stream is on CUDA ("tensor_ops":
inductor compiles the Functions' tensor ops instead).
Status: correct (tests/layers/mhc/test_mhc_kernels.py and test_mhc_gpu.py pass on the H200 and in the Triton
interpreter; bench/bench_mhc_kernels.py also checks the outputs against fp32 tensor ops). Measured on the H200
(16K tokens, n 4, H 4096, each Function forward + backward compiled, tensor_ops vs fused in the same run): mix 3.76 ->
2.88 ms (1.31x), collapse 1.55 -> 1.49 ms (1.04x), session 6. History of the mix kernel: the first version's
[n, n, BLOCK_H] broadcasts with per-step reductions took 4.0 ms per launch; the second's per-token products as tf32x3
dots on tiles padded to 16 rows took 206 ms; the third built (stream, stream) pair rows, n (n + 1) of them padded to
32 (dp's rows with y among them), each rebuilding its X row: 1.38 ms with X given, 2.14 ms with X rebuilt from its
source (session 9, bench_mhc_kernels.py). The current one (X rebuilt once per column step as n rows, dH as an
[n, n, BLOCK_H] product tile with one reduction at the end, dp on its own) took 1.08 and 1.40 ms in the same run
(1.28x and 1.53x; a pair-row variant without the padding rows: 1.04 and 1.49 ms), and the step's mix kernel time
went 62.1 -> 42.9 ms per 64K-token step (bench_vs_torchtitan ours_nomtp+adamw@accum, profile, session 9).

Each kernel reads the n-wide stream once and does every stream-wide piece of one autograd Function's backward
in that pass, with the per-token reductions in registers (the mHC paper's fused kernels with recompute,
arXiv 2512.24880):

  mix_backward       X' = H X + p y:   dX = H^T g, dH = g X^T, dp = g . y, dy = p . g
  collapse_backward  u = h . X:        dX = h gu, dh = X . gu

One program per token; the stream width H is stepped through in BLOCK_H columns (any H: the last step is masked).
The stream X is either given or rebuilt in registers from its source (X = mix(X0, H0, p0, y0), `StreamSource`),
rounded to X's dtype as the forward stored it, so the mid-block stream never exists in memory in backward.
Reductions over H and over n are fp32; their order differs from the torch path (tests/layers/mhc/test_mhc_kernels.py
holds both to fp32 rounding). H is a compile-time constant (one specialisation per model width, and the Triton
interpreter's loops need constant bounds). The tilings (block_h, num_warps) are arguments; the defaults were the
fastest of bench/bench_mhc_kernels.py's on the H200: mix 64 columns x 2 warps (summed over both stream modes; 128 x 4
within 1%, 256 and 512 columns 22-85% slower), collapse 128 x 4 (within 15% across them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_H = 128  # stream columns per step of the collapse kernel
_NUM_WARPS = 4  # warps per program of the collapse kernel
_MIX_BLOCK_H = 64  # stream columns per step of the mix kernel
_MIX_NUM_WARPS = 2  # warps per program of the mix kernel


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
def _stream_rows(x_ptr, sh_ptr, sp_ptr, sy_ptr, t, rows, rvalid, c, cvalid, n: tl.constexpr, H: tl.constexpr,
                 FROM_SOURCE: tl.constexpr):  # fmt: skip
    """fp32 [len(rows), BLOCK_H] tile of X[t, rows, c] (invalid rows are 0): loaded, or rebuilt
    from the source as X[j] = sum_l H0[j, l] X0[l] + p0[j] y0 (fp32 FMAs over the n source rows, each read once
    per tile and broadcast to every row) and rounded to X's dtype as the forward stored it."""
    if FROM_SOURCE:
        acc = (
            tl.load(sp_ptr + t * n + rows, mask=rvalid, other=0.0)[:, None]
            * tl.load(sy_ptr + t * H + c, mask=cvalid, other=0.0).to(tl.float32)[None, :]
        )
        for l in tl.static_range(n):
            hl = tl.load(sh_ptr + t * n * n + rows * n + l, mask=rvalid, other=0.0)
            acc += hl[:, None] * tl.load(x_ptr + t * n * H + l * H + c, mask=cvalid, other=0.0).to(tl.float32)[None, :]
        return _round_like(acc, x_ptr.dtype.element_ty)  # 0 where masked: every load above gives 0 there
    mask = rvalid[:, None] & cvalid[None, :]
    return tl.load(x_ptr + t * n * H + rows[:, None] * H + c[None, :], mask=mask, other=0.0).to(tl.float32)


# One program per token. Per column step: dX and dy from the n rows of g (1D FMAs, no reduction); X rebuilt once, as
# n rows (from its source, or loaded); the per-token products g[i] X[j] and g[i] y accumulated as [n, n, BLOCK_H] and
# [n, BLOCK_H] fp32 tiles (broadcasts only), reduced over the columns once at the end. (Earlier layouts: module
# docstring.)
@triton.jit
def _mix_backward_kernel(
    g_ptr, x_ptr, sh_ptr, sp_ptr, sy_ptr, h_ptr, p_ptr, y_ptr,
    dx_ptr, dh_ptr, dp_ptr, dy_ptr,
    H: tl.constexpr, n: tl.constexpr, NP: tl.constexpr, BLOCK_H: tl.constexpr, FROM_SOURCE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, NP)  # stream rows (NP = n rounded up to a power of two)
    rvalid = r < n
    acc_gx = tl.zeros((NP, NP, BLOCK_H), dtype=tl.float32)  # [i, j, c]: g[i] X[j]
    acc_gy = tl.zeros((NP, BLOCK_H), dtype=tl.float32)  # [i, c]: g[i] y
    for h0 in range(0, H, BLOCK_H):
        c = h0 + tl.arange(0, BLOCK_H)
        cvalid = c < H
        dx = tl.zeros((NP, BLOCK_H), dtype=tl.float32)  # dX[j] = sum_i H[i, j] g[i]
        dy = tl.zeros((BLOCK_H,), dtype=tl.float32)  # dy = sum_i p[i] g[i]
        for i in tl.static_range(n):
            gi = tl.load(g_ptr + t * n * H + i * H + c, mask=cvalid, other=0.0).to(tl.float32)
            dx += tl.load(h_ptr + t * n * n + i * n + r, mask=rvalid, other=0.0)[:, None] * gi[None, :]
            dy += tl.load(p_ptr + t * n + i) * gi
        _store(dx_ptr + t * n * H + r[:, None] * H + c[None, :], dx, rvalid[:, None] & cvalid[None, :])
        _store(dy_ptr + t * H + c, dy, cvalid)
        g = tl.load(g_ptr + t * n * H + r[:, None] * H + c[None, :], mask=rvalid[:, None] & cvalid[None, :], other=0.0)
        g = g.to(tl.float32)
        y = tl.load(y_ptr + t * H + c, mask=cvalid, other=0.0).to(tl.float32)
        acc_gy += g * y[None, :]
        x = _stream_rows(x_ptr, sh_ptr, sp_ptr, sy_ptr, t, r, rvalid, c, cvalid, n, H, FROM_SOURCE)
        acc_gx += g[:, None, :] * x[None, :, :]
    dh = tl.sum(acc_gx, axis=2)  # [NP, NP]
    tl.store(dh_ptr + t * n * n + r[:, None] * n + r[None, :], dh, mask=rvalid[:, None] & rvalid[None, :])
    tl.store(dp_ptr + t * n + r, tl.sum(acc_gy, axis=1), mask=rvalid)


@triton.jit
def _collapse_backward_kernel(
    gu_ptr, x_ptr, sh_ptr, sp_ptr, sy_ptr, h_ptr, dx_ptr, dh_ptr,
    H: tl.constexpr, n: tl.constexpr, NP: tl.constexpr, BLOCK_H: tl.constexpr, FROM_SOURCE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, NP)
    h = tl.load(h_ptr + t * n + r, mask=r < n, other=0.0)[:, None]  # [NP, 1]
    acc = tl.zeros((NP, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        c = h0 + tl.arange(0, BLOCK_H)
        cvalid = c < H
        gu = tl.load(gu_ptr + t * H + c, mask=cvalid, other=0.0).to(tl.float32)[None, :]
        _store(dx_ptr + t * n * H + r[:, None] * H + c[None, :], h * gu, (r < n)[:, None] & cvalid[None, :])
        acc += _stream_rows(x_ptr, sh_ptr, sp_ptr, sy_ptr, t, r, r < n, c, cvalid, n, H, FROM_SOURCE) * gu
    tl.store(dh_ptr + t * n + r, tl.sum(acc, axis=1), mask=r < n)  # dh[i] = sum_c X[i] gu


def _source_args(x: torch.Tensor, source: tuple) -> tuple:
    """(stream or X0, H0, p0, y0, FROM_SOURCE) as kernel arguments; the unused pointers get the stream."""
    if source[0] is None:
        return x.contiguous(), x, x, x, False
    x0, h0, p0, y0 = source
    return x0.contiguous(), h0.contiguous(), p0.contiguous(), y0.contiguous(), True


def mix_backward(g_TnH, x_TnH, h_Tnn, p_Tn, y_TH, source=(None,) * 4, block_h=_MIX_BLOCK_H, num_warps=_MIX_NUM_WARPS):
    """(dX [T, n, H] in X's dtype, dH [T, n, n] fp32, dp [T, n] fp32, dy [T, H] in y's dtype) of
    X' = H X + p y, from g = dX'; X given, or rebuilt from `source` (X0, H0, p0, y0). block_h, num_warps: the
    tiling (bench/bench_mhc_kernels.py compares some)."""
    T, n, H = g_TnH.shape
    xs, sh, sp, sy, from_source = _source_args(x_TnH, source)
    dtype = (source[0] if from_source else x_TnH).dtype
    dx = torch.empty(T, n, H, dtype=dtype, device=g_TnH.device)
    dh = torch.empty(T, n, n, dtype=torch.float32, device=g_TnH.device)
    dp = torch.empty(T, n, dtype=torch.float32, device=g_TnH.device)
    dy = torch.empty(T, H, dtype=y_TH.dtype, device=g_TnH.device)
    _mix_backward_kernel[(T,)](
        g_TnH.contiguous(), xs, sh, sp, sy, h_Tnn.contiguous(), p_Tn.contiguous(), y_TH.contiguous(),
        dx, dh, dp, dy, H, n, triton.next_power_of_2(n), block_h, from_source, num_warps=num_warps,
    )  # fmt: skip
    return dx, dh, dp, dy


def collapse_backward(gu_TH, x_TnH, h_Tn, source=(None,) * 4, block_h=_BLOCK_H, num_warps=_NUM_WARPS):
    """(dX [T, n, H] in X's dtype, dh [T, n] fp32) of u = sum_i h[i] X[i], from gu = du (block_h, num_warps: as
    in `mix_backward`)."""
    T, H = gu_TH.shape
    xs, sh, sp, sy, from_source = _source_args(x_TnH, source)
    n = h_Tn.shape[1]
    dtype = (source[0] if from_source else x_TnH).dtype
    dx = torch.empty(T, n, H, dtype=dtype, device=gu_TH.device)
    dh = torch.empty(T, n, dtype=torch.float32, device=gu_TH.device)
    _collapse_backward_kernel[(T,)](
        gu_TH.contiguous(), xs, sh, sp, sy, h_Tn.contiguous(), dx, dh, H, n, triton.next_power_of_2(n), block_h,
        from_source, num_warps=num_warps,
    )  # fmt: skip
    return dx, dh


__all__ = ["collapse_backward", "mix_backward"]
