"""Triton kernel of one loss chunk (trainer/losses.py), imported only where triton is.

From a chunk's fp32 logits [C, V] (straight out of the fp32-output head GEMM) one program per token row computes,
in two passes over its row: (1) an online max / sum-of-exponentials, giving lse = log sum_v exp(l_v) and the token's
CE = (lse - l_y) [y != -100]; (2) the weighted logit gradient w (softmax - onehot(y)), written in the GEMMs'
dtype (bf16). So the chunk costs two fp32 reads and one bf16 write of [C, V], in one launch, where the eager /
inductor chunk code took three passes and fp32 intermediates. Same arithmetic as `losses._chunk_ce_and_grad`,
up to fp32 summation order over the vocabulary.

The bf16 gradient is written over the logits' own storage: row t's [V] gradient takes the first half of row t's
fp32 bytes, so a chunk needs no second [C, V] buffer (1 GiB at the loss's default 2 GiB chunk, and the loss's
chunk loop is where a training step's memory peaks: bench_vs_torchtitan --memory-snapshot). It is safe because
pass 2 walks the row in order: the store of block k covers the fp32 elements [kB / 2, (k + 1) B / 2), all of which
blocks 0..k have already read, and no later block reads them; within block 0, whose store overlaps its own loads,
a barrier after the gradient is computed (its loads consumed) and before the store keeps every warp's reads ahead
of any warp's writes (warps are not otherwise in step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_V = 4096


@triton.jit
def _ce_chunk_kernel(
    logits_ptr, labels_ptr, weight_ptr, ce_ptr, grad_ptr, stride_l, stride_g, V: tl.constexpr,
    IGNORE: tl.constexpr, BLOCK: tl.constexpr, IN_PLACE: tl.constexpr,
):  # fmt: skip
    # V is a compile-time constant (one vocabulary per run): the loops have fixed trip counts
    row = tl.program_id(0).to(tl.int64)
    row_logits = logits_ptr + row * stride_l
    row_grad = grad_ptr + row * stride_g
    y = tl.load(labels_ptr + row)
    valid = y != IGNORE
    cols = tl.arange(0, BLOCK)
    # pass 1: running max m and running sum s of exp(l - m), per lane, merged at the end
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(row_logits + start + cols, mask=start + cols < V, other=float("-inf"))
        m_new = tl.maximum(m, x)
        # lanes that have seen only padding keep m = -inf: exp(-inf - -inf) would be nan, they add 0 instead
        s = tl.where(m_new == float("-inf"), 0.0, s * tl.exp(m - m_new) + tl.exp(x - m_new))
        m = m_new
    m_row = tl.max(m, axis=0)
    s_row = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - m_row)), axis=0)
    lse = m_row + tl.log(s_row)
    safe_y = tl.where(valid, y, 0)
    target = tl.load(row_logits + safe_y)
    tl.store(ce_ptr + row, tl.where(valid, lse - target, 0.0))
    # pass 2: w (softmax - onehot), zero on an ignored row
    scale = tl.where(valid, tl.load(weight_ptr + row), 0.0)
    for start in range(0, V, BLOCK):
        idx = start + cols
        inside = idx < V
        x = tl.load(row_logits + idx, mask=inside, other=0.0)
        g = (tl.exp(x - lse) - tl.where(idx == safe_y, 1.0, 0.0)) * scale
        if IN_PLACE:  # every warp has read block `start` before any warp overwrites its first half (docstring)
            tl.debug_barrier()
        tl.store(row_grad + idx, g.to(grad_ptr.dtype.element_ty), mask=inside)


def ce_chunk_and_grad(
    logits_CV: torch.Tensor, y_C: torch.Tensor, w_C: torch.Tensor, grad_dtype: torch.dtype, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 CE per token [C], zero on ignored rows; w_t (softmax - onehot) [C, V] in `grad_dtype`) from fp32
    logits [C, V] (rows contiguous), long labels [C] and fp32 token weights [C]. The logits are consumed: a 2-byte
    `grad_dtype` (bf16, fp16) is written over their storage (module docstring) and comes back as a [C, V] view of
    it with row stride 2 x the logits' (the GEMMs that read it take that stride as their leading dimension); other
    dtypes get a buffer of their own."""
    C, V = logits_CV.shape
    if logits_CV.stride(1) != 1:
        logits_CV = logits_CV.contiguous()
    ce_C = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    in_place = logits_CV.dtype == torch.float32 and grad_dtype.itemsize == 2
    if in_place:
        grad_CV = logits_CV.view(grad_dtype)[:, :V]  # row t: the first half of logits row t's bytes
    else:
        grad_CV = torch.empty((C, V), dtype=grad_dtype, device=logits_CV.device)
    if C:
        _ce_chunk_kernel[(C,)](
            logits_CV, y_C.contiguous(), w_C.to(torch.float32).contiguous(), ce_C, grad_CV,
            logits_CV.stride(0), grad_CV.stride(0), V=V, IGNORE=ignore_index, BLOCK=_BLOCK_V, IN_PLACE=in_place,
            num_warps=8,
        )  # fmt: skip
    return ce_C, grad_CV
