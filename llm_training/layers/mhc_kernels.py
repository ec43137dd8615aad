"""Triton kernels of mHC's stream-wide backward (`layers.mhc`), imported only where triton is.

Used where `[model] mhc_backward` is "auto" (the default) or "fused" and the stream is on CUDA ("tensor_ops":
inductor compiles the Functions' tensor ops instead).
Status: correct (tests/layers/test_mhc_kernels.py and test_mhc_gpu.py pass on the H200 and in the Triton
interpreter; bench/bench_mhc_kernels.py also checks the outputs against fp32 tensor ops). Measured on the H200
(16K tokens, n 4, H 4096, each Function forward + backward compiled, tensor_ops vs fused in the same run): mix 3.76 -> 2.88 ms (1.31x), collapse 1.55 ->
1.49 ms (1.04x); the step (bench_vs_torchtitan ours_nomtp+adamw@accum, 64K tokens) 1981.6 -> 1958.6 ms (1.012x)
with the projection kernel that was then still fused (0.83x on its own; so it was removed and the norm +
projection backward stays tensor ops). History: the first version's [n, n, BLOCK_H] broadcasts and per-step
reductions took mix 4.0 ms per launch and made the step slower (2054 vs 2006 ms); the second's per-token
products as tf32x3 dots on tiles padded to 16 rows took mix 206 ms.

Each kernel reads the n-wide stream once and does every stream-wide piece of one autograd Function's backward
in that pass, with the per-token reductions in registers (the mHC paper's fused kernels with recompute,
arXiv 2512.24880):

  mix_backward       X' = H X + p y:   dX = H^T g, dH = g X^T, dp = g . y, dy = p . g
  collapse_backward  u = h . X:        dX = h gu, dh = X . gu

One program per token; the stream width H is stepped through in BLOCK_H columns (any H: the last step is masked).
The stream X is either given or rebuilt in registers from its source (X = mix(X0, H0, p0, y0), `StreamSource`),
rounded to X's dtype as the forward stored it, so the mid-block stream never exists in memory in backward.
Reductions over H and over n are fp32; their order differs from the torch path (tests/layers/test_mhc_kernels.py
holds both to fp32 rounding). H is a compile-time constant (one specialisation per model width, and the Triton
interpreter's loops need constant bounds). The tilings (block_h, num_warps) are arguments; the defaults were the
fastest of bench/bench_mhc_kernels.py's on the H200 for mix (smaller blocks were faster: 1.39 ms at 128 columns,
2.23 ms at 256); collapse is within 15% across them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_H = 128  # stream columns per step of the per-token kernels
_NUM_WARPS = 4  # warps per program of the per-token kernels


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
    """fp32 [len(rows), BLOCK_H] tile of X[t, rows, c] (rows may repeat; invalid rows are 0): loaded, or rebuilt
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


# One program per token; the per-token products are fp32 FMAs on 2D tiles whose rows are (stream, stream) pairs,
# accumulated over the column steps and reduced once at the end: no tensor-core dots on padded tiles (the second
# version's 16-row tf32x3 dots took 206 ms per launch on the H200), no 3D broadcasts and no per-step reductions
# (the first version's [n, n, BLOCK_H] products took 4.0 ms).
@triton.jit
def _mix_backward_kernel(
    g_ptr, x_ptr, sh_ptr, sp_ptr, sy_ptr, h_ptr, p_ptr, y_ptr,
    dx_ptr, dh_ptr, dp_ptr, dy_ptr,
    H: tl.constexpr, n: tl.constexpr, NO: tl.constexpr, NPAIR: tl.constexpr, BLOCK_H: tl.constexpr,
    FROM_SOURCE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, NO)  # output rows: o < n is dX[o], o == n is dy
    # pair rows q = i * (n + 1) + j: dH[i, j] = sum_c g[i] X[j] (j < n), dp[i] = sum_c g[i] y (j == n)
    q = tl.arange(0, NPAIR)
    qi, qj = q // (n + 1), q % (n + 1)
    qvalid = qi < n
    acc = tl.zeros((NPAIR, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        c = h0 + tl.arange(0, BLOCK_H)
        cvalid = c < H
        out = tl.zeros((NO, BLOCK_H), dtype=tl.float32)  # dX[j] = sum_i H[i, j] g[i], dy = sum_i p[i] g[i]
        for i in tl.static_range(n):
            gi = tl.load(g_ptr + t * n * H + i * H + c, mask=cvalid, other=0.0).to(tl.float32)
            coef = tl.load(h_ptr + t * n * n + i * n + o, mask=o < n, other=0.0)
            coef += tl.load(p_ptr + t * n + i + 0 * o, mask=o == n, other=0.0)
            out += coef[:, None] * gi[None, :]
        _store(dx_ptr + t * n * H + o[:, None] * H + c[None, :], out, (o < n)[:, None] & cvalid[None, :])
        _store(dy_ptr + t * H + c[None, :] + 0 * o[:, None], out, (o == n)[:, None] & cvalid[None, :])
        g = tl.load(g_ptr + t * n * H + qi[:, None] * H + c[None, :], mask=qvalid[:, None] & cvalid[None, :], other=0.0)
        xy = _stream_rows(x_ptr, sh_ptr, sp_ptr, sy_ptr, t, qj, qvalid & (qj < n), c, cvalid, n, H, FROM_SOURCE)
        yrow = (qvalid & (qj == n))[:, None] & cvalid[None, :]
        xy += tl.load(y_ptr + t * H + c[None, :] + 0 * q[:, None], mask=yrow, other=0.0).to(tl.float32)
        acc += g.to(tl.float32) * xy
    pair = tl.sum(acc, axis=1)
    tl.store(dh_ptr + t * n * n + qi * n + qj, pair, mask=qvalid & (qj < n))
    tl.store(dp_ptr + t * n + qi, pair, mask=qvalid & (qj == n))


# Candidate layouts of the same backward (session 9, measured against "pairs20" by bench/bench_mhc_kernels.py):
# "pairs16" keeps the pair rows but only the n x n (stream, stream) ones (16 rows at n = 4, no padding rows), dp from
# the n g rows times y on their own; "grid3d" rebuilds X once per column step as n rows and accumulates dH as an
# [n, n, BLOCK_H] tile of g[i] X[j] products (broadcasts only, no per-step reduction).
@triton.jit
def _mix_backward_v2_kernel(
    g_ptr, x_ptr, sh_ptr, sp_ptr, sy_ptr, h_ptr, p_ptr, y_ptr,
    dx_ptr, dh_ptr, dp_ptr, dy_ptr,
    H: tl.constexpr, n: tl.constexpr, NP: tl.constexpr, BLOCK_H: tl.constexpr, FROM_SOURCE: tl.constexpr,
    GRID3D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, NP)  # stream rows (NP = n rounded up to a power of two)
    rvalid = r < n
    q = tl.arange(0, NP * NP)  # pair rows q = i * NP + j (pairs16)
    qi, qj = q // NP, q % NP
    qvalid = (qi < n) & (qj < n)
    if GRID3D:
        acc_gx = tl.zeros((NP, NP, BLOCK_H), dtype=tl.float32)  # [i, j, c]: g[i] X[j]
    else:
        acc_gx = tl.zeros((NP * NP, BLOCK_H), dtype=tl.float32)  # [i * NP + j, c]: g[i] X[j]
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
        if GRID3D:
            x = _stream_rows(x_ptr, sh_ptr, sp_ptr, sy_ptr, t, r, rvalid, c, cvalid, n, H, FROM_SOURCE)
            acc_gx += g[:, None, :] * x[None, :, :]
        else:
            gq = tl.load(g_ptr + t * n * H + qi[:, None] * H + c[None, :], mask=qvalid[:, None] & cvalid[None, :],
                         other=0.0)  # fmt: skip
            xq = _stream_rows(x_ptr, sh_ptr, sp_ptr, sy_ptr, t, qj, qvalid, c, cvalid, n, H, FROM_SOURCE)
            acc_gx += gq.to(tl.float32) * xq
    if GRID3D:
        pair = tl.sum(acc_gx, axis=2)  # [NP, NP]
        tl.store(dh_ptr + t * n * n + r[:, None] * n + r[None, :], pair, mask=rvalid[:, None] & rvalid[None, :])
    else:
        pair = tl.sum(acc_gx, axis=1)  # [NP * NP]
        tl.store(dh_ptr + t * n * n + qi * n + qj, pair, mask=qvalid)
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


MIX_LAYOUTS = ("pairs20", "pairs16", "grid3d")
_MIX_TILING = ("pairs20", 128, 4)  # (layout, block_h, num_warps) of mix_backward


def mix_backward(g_TnH, x_TnH, h_Tnn, p_Tn, y_TH, source=(None,) * 4, block_h=None, num_warps=None, layout=None):
    """(dX [T, n, H] in X's dtype, dH [T, n, n] fp32, dp [T, n] fp32, dy [T, H] in y's dtype) of
    X' = H X + p y, from g = dX'; X given, or rebuilt from `source` (X0, H0, p0, y0). block_h, num_warps: the
    tiling (bench/bench_mhc_kernels.py compares some)."""
    layout = _MIX_TILING[0] if layout is None else layout
    block_h = _MIX_TILING[1] if block_h is None else block_h
    num_warps = _MIX_TILING[2] if num_warps is None else num_warps
    T, n, H = g_TnH.shape
    xs, sh, sp, sy, from_source = _source_args(x_TnH, source)
    dtype = (source[0] if from_source else x_TnH).dtype
    dx = torch.empty(T, n, H, dtype=dtype, device=g_TnH.device)
    dh = torch.empty(T, n, n, dtype=torch.float32, device=g_TnH.device)
    dp = torch.empty(T, n, dtype=torch.float32, device=g_TnH.device)
    dy = torch.empty(T, H, dtype=y_TH.dtype, device=g_TnH.device)
    args = (
        g_TnH.contiguous(),
        xs,
        sh,
        sp,
        sy,
        h_Tnn.contiguous(),
        p_Tn.contiguous(),
        y_TH.contiguous(),
        dx,
        dh,
        dp,
        dy,
    )
    if layout == "pairs20":
        _mix_backward_kernel[(T,)](
            *args, H, n, triton.next_power_of_2(n + 1), triton.next_power_of_2(n * (n + 1)), block_h, from_source,
            num_warps=num_warps,
        )  # fmt: skip
    elif layout in MIX_LAYOUTS:
        _mix_backward_v2_kernel[(T,)](
            *args, H, n, triton.next_power_of_2(n), block_h, from_source, layout == "grid3d", num_warps=num_warps
        )
    else:
        raise ValueError(f"mix_backward: unknown layout {layout!r}; one of {MIX_LAYOUTS}")
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
