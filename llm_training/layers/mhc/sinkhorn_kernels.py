"""Triton kernels of mHC's Sinkhorn projection (docs/model-spec.md §4.2), imported only where triton is.

One program normalises BLOCK tokens' n x n matrices in registers: forward m = exp(clamp(Z, +-20)), then `iters` x
{rows / max(rowsum, 1e-8); columns / max(colsum, 1e-8)}. The backward keeps nothing but Z: it walks the
iterations from the last to the first and recomputes the matrix entering each one from Z (O(iters^2) work on
n^2 values per token, all in registers), the mHC paper's recompute remedy (arXiv 2512.24880). Same arithmetic
as `layers.sinkhorn.sinkhorn_reference`, up to fp32 summation order over n values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load(z_ptr, N, n: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    tok = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)[:, None, None]
    i = tl.arange(0, NP)[None, :, None]
    j = tl.arange(0, NP)[None, None, :]
    mask = (tok < N) & (i < n) & (j < n)
    offs = tok * (n * n) + i * n + j
    return offs, mask, tl.load(z_ptr + offs, mask=mask, other=0.0)


@triton.jit
def _start(z, mask):
    """exp(clamp(z, +-20)) on the valid entries, 0 on the padding."""
    return tl.where(mask, tl.exp(tl.minimum(tl.maximum(z, -20.0), 20.0)), 0.0)


@triton.jit
def _rows(m):
    return m / tl.maximum(tl.sum(m, axis=2), 1e-8)[:, :, None]


@triton.jit
def _cols(m):
    return m / tl.maximum(tl.sum(m, axis=1), 1e-8)[:, None, :]


@triton.jit
def _sinkhorn_fwd_kernel(
    z_ptr, out_ptr, N, ITERS: tl.constexpr, n: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr
):
    offs, mask, z = _load(z_ptr, N, n, NP, BLOCK)
    m = _start(z, mask)
    for _ in range(ITERS):
        m = _cols(_rows(m))
    tl.store(out_ptr + offs, m, mask=mask)


@triton.jit
def _sinkhorn_bwd_kernel(
    z_ptr, g_ptr, dz_ptr, N, ITERS: tl.constexpr, n: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr
):
    offs, mask, z = _load(z_ptr, N, n, NP, BLOCK)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    m0 = _start(z, mask)
    for back in range(ITERS):
        a = m0  # the matrix entering iteration k = ITERS - 1 - back, recomputed from Z
        for _ in range(ITERS - 1 - back):
            a = _cols(_rows(a))
        # b = rows(a), c = cols(b); y = m / s with s = max(sum m, eps): dm = (g - sum(g y) [sum m >= eps]) / s
        row_raw = tl.sum(a, axis=2)
        row_s = tl.maximum(row_raw, 1e-8)[:, :, None]
        b = a / row_s
        col_raw = tl.sum(b, axis=1)
        col_s = tl.maximum(col_raw, 1e-8)[:, None, :]
        c = b / col_s
        g_cols = tl.where(col_raw >= 1e-8, tl.sum(g * c, axis=1), 0.0)[:, None, :]
        g = (g - g_cols) / col_s
        g_rows = tl.where(row_raw >= 1e-8, tl.sum(g * b, axis=2), 0.0)[:, :, None]
        g = (g - g_rows) / row_s
    inside = (z >= -20.0) & (z <= 20.0)  # clamp passes the gradient where the input is within its bounds
    tl.store(dz_ptr + offs, tl.where(inside, g * m0, 0.0), mask=mask)


def _launch(kernel, z_Tnn: torch.Tensor, *tensors: torch.Tensor, iters: int) -> torch.Tensor:
    T, n = z_Tnn.shape[0], z_Tnn.shape[-1]
    out = torch.empty_like(z_Tnn)
    block = 64
    grid = (triton.cdiv(T, block),)
    kernel[grid](z_Tnn, *tensors, out, T, ITERS=iters, n=n, NP=triton.next_power_of_2(n), BLOCK=block)
    return out


def sinkhorn_fwd(z_Tnn: torch.Tensor, iters: int) -> torch.Tensor:
    """Doubly stochastic [T, n, n] fp32 from contiguous fp32 logits [T, n, n]."""
    return _launch(_sinkhorn_fwd_kernel, z_Tnn, iters=iters)


def sinkhorn_bwd(z_Tnn: torch.Tensor, grad_Tnn: torch.Tensor, iters: int) -> torch.Tensor:
    """dL/dZ [T, n, n] fp32 from the logits and dL/dout (both contiguous fp32 [T, n, n])."""
    return _launch(_sinkhorn_bwd_kernel, z_Tnn, grad_Tnn, iters=iters)
