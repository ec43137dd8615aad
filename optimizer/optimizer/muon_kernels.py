"""Muon's two elementwise passes as Triton kernels on CUDA (docs/model-spec.md §8.1; `muon.py` steps 2 and 4).

Per parameter seen as `count` matrices [R, K] (row-major, contiguous):

  * `momentum_nesterov_(out, grad, buf, mu, nesterov, grad_scale)`: with G = grad_scale * grad (the step's
    gradient-clipping coefficient, applied here instead of in a pass of its own), M <- G + mu M (stored in M's
    dtype), then out <- G + mu M (Nesterov, with the stored M) or M, in out's dtype: ONE pass that reads G and M
    once (fp32 arithmetic), where torch needs two kernels that read both twice.
  * `decay_update_(w, delta, decay)`: W <- delta + decay W (fp32 arithmetic), one pass.

`out` and `delta` are the parameter's slots in Muon's NS stack: the same [count, R, K] layout, or, for a tall
parameter (R > K), the transposed view of a contiguous [count, K, R] block. torch's elementwise kernels walk such a
pair in the output's order and read (or write) the other side with a stride of R elements: about 1 TB/s on an H100 in
the session-38 profile, a third of its memory bandwidth. Here every program owns one [BLOCK_R, BLOCK_K] tile, reads
the row-major side along K and the transposed side along R, and Triton exchanges the tile through shared memory in
between, so both sides are read and written in whole lines. On one H100 (bench/bench_optimizer.py, proxy_16e's 50 Muon
tensors, 1.35B parameters) the step beyond its NS (the elementwise passes) took 24.2 ms with torch's kernels and takes
10.4.

`TRANSPOSED` is a constexpr and the strides follow from (R, K), so each kernel has two variants per dtype set
(plus Triton's divisibility specialisations of R and K), few enough to build in the first step or ahead of it
(the trainer hands them to its Triton prebuild: `Muon.kernel_launches`). This module imports triton: `muon.py` imports
it only for CUDA tensors where triton is installed, asks `supported()` whether a call's layouts fit, and falls back
to torch's kernels otherwise (CPU, no triton, another layout).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# One program's tile: 64 x 64 elements (16 KiB of fp32 per operand), 4 warps.
_BLOCK_R, _BLOCK_K, _NUM_WARPS = 64, 64, 4
_MAX_MATRICES = 65535  # CUDA's limit on grid dimension 1, which walks the matrices


@triton.jit
def _tile(R, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's matrix offset (int64), its tile's row-major offsets, the transposed layout's offsets of the same
    elements, and the tile's mask."""
    n_k = tl.cdiv(K, BLOCK_K)
    tile_r, tile_k = tl.program_id(0) // n_k, tl.program_id(0) % n_k
    rows = tile_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    matrix = tl.program_id(1).to(tl.int64) * R * K
    row_major = rows[:, None] * K + cols[None, :]
    col_major = cols[None, :] * R + rows[:, None]
    mask = (rows[:, None] < R) & (cols[None, :] < K)
    return matrix, row_major, col_major, mask


@triton.jit
def _momentum_nesterov_kernel(
    grad_ptr, buf_ptr, out_ptr, R, K, mu, grad_scale,
    NESTEROV: tl.constexpr, TRANSPOSED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    matrix, row_major, col_major, mask = _tile(R, K, BLOCK_R, BLOCK_K)
    g = tl.load(grad_ptr + matrix + row_major, mask=mask).to(tl.float32) * grad_scale
    m = tl.load(buf_ptr + matrix + row_major, mask=mask).to(tl.float32)
    m_stored = (g + mu * m).to(buf_ptr.dtype.element_ty)
    tl.store(buf_ptr + matrix + row_major, m_stored, mask=mask)
    u = m_stored.to(tl.float32)  # what torch's second kernel reads back from M
    if NESTEROV:
        u = g + mu * u
    out_offsets = col_major if TRANSPOSED else row_major
    tl.store(out_ptr + matrix + out_offsets, u.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decay_update_kernel(
    w_ptr, delta_ptr, R, K, decay, TRANSPOSED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr
):
    matrix, row_major, col_major, mask = _tile(R, K, BLOCK_R, BLOCK_K)
    delta_offsets = col_major if TRANSPOSED else row_major
    d = tl.load(delta_ptr + matrix + delta_offsets, mask=mask).to(tl.float32)
    w = tl.load(w_ptr + matrix + row_major, mask=mask).to(tl.float32)
    tl.store(w_ptr + matrix + row_major, (d + decay * w).to(w_ptr.dtype.element_ty), mask=mask)


def _transposed(t: torch.Tensor, shape: tuple[int, int, int]) -> bool | None:
    """False for a contiguous [count, R, K] tensor, True for the transposed view of a contiguous [count, K, R] one,
    None for any other layout or shape."""
    if tuple(t.shape) != shape:
        return None
    if t.is_contiguous():
        return False
    return True if t.mT.is_contiguous() else None


def supported(strided: torch.Tensor, *contiguous: torch.Tensor) -> bool:
    """Whether the kernels take the call: tensors on one CUDA (or meta) device, `contiguous` each a contiguous
    [count, R, K] tensor and `strided` that or the transposed view of a contiguous [count, K, R] one."""
    shape = tuple(strided.shape)
    if len(shape) != 3 or shape[0] > _MAX_MATRICES or strided.device.type not in ("cuda", "meta"):
        return False
    if any(_transposed(t, shape) is not False or t.device != strided.device for t in contiguous):
        return False
    return _transposed(strided, shape) is not None


def _grid(shape: tuple[int, int, int]) -> tuple[int, int]:
    count, R, K = shape
    return -(-R // _BLOCK_R) * -(-K // _BLOCK_K), count


def momentum_nesterov_(
    out: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, mu: float, nesterov: bool, grad_scale: float = 1.0
) -> None:
    """With g = grad_scale * grad: buf <- g + mu buf; out <- g + mu buf (nesterov) or buf. grad and buf contiguous
    [count, R, K]; out that or a transposed view (`supported(out, grad, buf)`)."""
    shape = tuple(out.shape)
    if 0 in shape:
        return
    _momentum_nesterov_kernel[_grid(shape)](
        grad, buf, out, shape[1], shape[2], float(mu), float(grad_scale),
        NESTEROV=bool(nesterov), TRANSPOSED=_transposed(out, shape), BLOCK_R=_BLOCK_R, BLOCK_K=_BLOCK_K,
        num_warps=_NUM_WARPS,
    )  # fmt: skip


def decay_update_(w: torch.Tensor, delta: torch.Tensor, decay: float) -> None:
    """w <- delta + decay w. w contiguous [count, R, K]; delta that or a transposed view (`supported(delta, w)`)."""
    shape = tuple(w.shape)
    if 0 in shape:
        return
    _decay_update_kernel[_grid(shape)](
        w, delta, shape[1], shape[2], float(decay),
        TRANSPOSED=_transposed(delta, shape), BLOCK_R=_BLOCK_R, BLOCK_K=_BLOCK_K, num_warps=_NUM_WARPS,
    )  # fmt: skip
