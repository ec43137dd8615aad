"""Triton kernel for the symmetric product G = alpha X X^T + beta C (C symmetric, optional) used by
Newton-Schulz (docs/model-spec.md §8.1): X X^T, and b P + c P P^T with the axpy fused into the epilogue.

X is [..., m, k] (m <= k after NS's transpose). G is symmetric, so only the upper-triangle blocks
(block_row <= block_col) are computed — about half the FLOPs of a full matmul — and each off-diagonal block
is written twice: at (i, j) and transposed at (j, i). The grid is the full (n_blocks x n_blocks) square;
programs below the diagonal exit immediately (simpler than a triangle index map; they cost ~nothing).
fp32 accumulation; fp32 inputs use IEEE fp32 dot products (no TF32) so the result matches `x @ x.mT`.
Batched over the leading dims (one grid axis).

Triton is imported lazily: `available()` is False when it is missing, and `newton_schulz.gram` then uses
PyTorch (also the reference in the tests).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    configs = [
        triton.Config({"BLOCK": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK": 128, "BLOCK_K": 32}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),
    ]

    @triton.autotune(configs=configs, key=["M", "K", "HAS_C", "IEEE"])
    @triton.jit
    def gram_kernel(
        x_ptr, c_ptr, out_ptr,
        M, K, alpha, beta,
        stride_xb, stride_xm, stride_xk,
        stride_cb, stride_cm, stride_cn,
        stride_ob, stride_om, stride_on,
        HAS_C: tl.constexpr, IEEE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        block_row = tl.program_id(0)
        block_col = tl.program_id(1)
        if block_row > block_col:
            return
        batch = tl.program_id(2).to(tl.int64)
        rows = block_row * BLOCK + tl.arange(0, BLOCK)
        cols = block_col * BLOCK + tl.arange(0, BLOCK)
        ks = tl.arange(0, BLOCK_K)
        x_batch = x_ptr + batch * stride_xb
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for k_block in range(0, tl.cdiv(K, BLOCK_K)):
            k0 = k_block * BLOCK_K
            k_mask = (k0 + ks) < K
            a = tl.load(
                x_batch + rows[:, None] * stride_xm + (k0 + ks)[None, :] * stride_xk,
                mask=(rows[:, None] < M) & k_mask[None, :], other=0.0,
            )  # fmt: skip
            b = tl.load(
                x_batch + cols[:, None] * stride_xm + (k0 + ks)[None, :] * stride_xk,
                mask=(cols[:, None] < M) & k_mask[None, :], other=0.0,
            )  # fmt: skip
            if IEEE:
                acc += tl.dot(a, tl.trans(b), input_precision="ieee")
            else:
                acc += tl.dot(a, tl.trans(b))
        mask = (rows[:, None] < M) & (cols[None, :] < M)
        acc = acc * alpha
        if HAS_C:  # C symmetric: its (rows, cols) tile serves both stores
            c_tile = tl.load(c_ptr + batch * stride_cb + rows[:, None] * stride_cm + cols[None, :] * stride_cn,
                             mask=mask, other=0.0)  # fmt: skip
            acc += beta * c_tile.to(tl.float32)
        out = acc.to(out_ptr.dtype.element_ty)
        o_batch = out_ptr + batch * stride_ob
        tl.store(o_batch + rows[:, None] * stride_om + cols[None, :] * stride_on, out, mask=mask)
        if block_row != block_col:  # mirror into the lower triangle (transposed tile, row-major store)
            mirror = o_batch + cols[:, None] * stride_om + rows[None, :] * stride_on
            tl.store(mirror, tl.trans(out), mask=tl.trans(mask))

    return gram_kernel


def gram_triton(
    x: torch.Tensor, add: torch.Tensor | None = None, alpha: float = 1.0, beta: float = 0.0
) -> torch.Tensor:
    """alpha * X @ X^T (+ beta * add, add symmetric [..., m, m]) for x [..., m, k] (fp32 / bf16 / fp16, CUDA)
    -> [..., m, m] in x.dtype."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"gram_triton: unsupported dtype {x.dtype} (use fp32, bf16 or fp16)")
    m, k = x.shape[-2], x.shape[-1]
    x3 = x.reshape(-1, m, k)
    out = torch.empty(x3.shape[0], m, m, device=x.device, dtype=x.dtype)
    if x3.shape[0] == 0 or m == 0:
        return out.reshape(*x.shape[:-2], m, m)
    c3 = add.reshape(-1, m, m) if add is not None else out  # `out` is a dummy pointer when HAS_C is False
    kernel = _kernel()

    def grid(meta):
        n_blocks = triton_cdiv(m, meta["BLOCK"])
        return (n_blocks, n_blocks, x3.shape[0])

    kernel[grid](
        x3, c3, out,
        m, k, float(alpha), float(beta),
        x3.stride(0), x3.stride(1), x3.stride(2),
        c3.stride(0), c3.stride(1), c3.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        HAS_C=add is not None, IEEE=x.dtype == torch.float32,
    )  # fmt: skip
    return out.reshape(*x.shape[:-2], m, m)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
