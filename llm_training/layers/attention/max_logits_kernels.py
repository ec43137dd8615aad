"""Triton kernel of QK-clip's exact max-logit side pass (`attention_masks.attention_max_logits`), imported only
where triton is.

    max_logits(q_BSHD, k_BSKD, *, scale, window, document_ids, document_starts) -> fp32 [Hq]

The per-query-head max of scale * q.k over the visible pairs (causal, optional sliding window W: key j visible
iff i - W <= j <= i, optional packed documents: same id in the same row), flash-attention style: one program per
(query block, batch row, head) walks the key blocks of its causal / window / document range, the q.k tile in
fp32 on the tensor cores (bf16 / fp16 inputs; fp32 inputs as exact fp32 dots), the mask from the positions and
document ids, a running row max in registers; nothing [S, S]-sized is written. Each program stores one partial
max; the host reduces them (deterministic, no atomics) and scales in fp32 (scale > 0, so max then scale is
scale then max).

Why: the fused attention kernels that return no logits (flash-attn-4, cuDNN SDPA) needed a side pass of torch
tensor ops (`chunked_max_logits`): bf16 tiles of [B, Hq, 1024, 1024] logits written, masked and reduced, 25.3 ms
per full-attention layer and 12.3 ms per window layer per micro-batch at the motif3_proxy shape (B 4, S 4096, 80
heads) on the H200 (bench/bench_max_logits.py); with flash-attn-4 that side pass cost as much as the attention
kernels saved over FlexAttention (bench/results, session 9). This kernel reads q and k once per key block (from L2)
and writes 4 bytes per program.

The KV head of query head h is h // (Hq // Hkv) (GQA, read through the strides: no repeated K). Key blocks
before the document start of a query block's first row (`document_starts`) or before its window are skipped.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

# (block_m, block_n, num_warps), the fastest of bench/bench_max_logits.py's tilings on the H200 at the motif3_proxy
# shape (B 4, S 4096, 80 / 16 heads, d 192, two documents per row), session 9: full causal 2.09 ms at 128 x 128 with
# 8 warps (64 x 64, 4 warps: 3.03 ms); window 128 0.73 ms at 64 x 64 with 4 warps (128 x 128, 8 warps: 0.77 ms)
_FULL_TILING = (128, 128, 8)
_WINDOW_TILING = (64, 64, 4)
_MAX_BLOCK_D = 64  # head-dim columns per dot (192 = 3 dots of 64)


@triton.jit
def _key_block_max(best, q_base, k_base, doc_ptr, b, S, i, ivalid, doc_i, j0, stride_qs, stride_ks,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr,
                   IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """best (the running max of rows i) updated with key block [j0, j0 + BLOCK_N): the q.k tile over D in BLOCK_D
    dots, masked to the visible pairs."""
    j = j0 + tl.arange(0, BLOCK_N)
    jvalid = j < S
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for d0 in tl.static_range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dvalid = d < D
        q_rows = q_base + i.to(tl.int64)[:, None] * stride_qs  # int64: S x stride passes 2^31 at 256K tokens
        k_cols = k_base + j.to(tl.int64)[None, :] * stride_ks
        q = tl.load(q_rows + d[None, :], mask=ivalid[:, None] & dvalid[None, :], other=0.0)
        kT = tl.load(k_cols + d[:, None], mask=dvalid[:, None] & jvalid[None, :], other=0.0)
        if IEEE:  # fp32 inputs, or the interpreter (whose dot misreads bf16): exact fp32 products
            acc = tl.dot(q.to(tl.float32), kT.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(q, kT, acc)
    visible = (j[None, :] <= i[:, None]) & jvalid[None, :]
    if WINDOW >= 0:
        visible = visible & (j[None, :] >= i[:, None] - WINDOW)
    if HAS_DOCS:
        doc_j = tl.load(doc_ptr + b * S + j, mask=jvalid, other=-2)
        visible = visible & (doc_j[None, :] == doc_i[:, None])
    return tl.maximum(best, tl.max(tl.where(visible, acc, float("-inf")), axis=1))


@triton.jit
def _max_logits_kernel(
    q_ptr, k_ptr, doc_ptr, start_ptr, out_ptr,
    S, Hq,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    N_REP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr,
    IEEE: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)
    h = bh % Hq
    i0 = pid_m * BLOCK_M
    i = i0 + tl.arange(0, BLOCK_M)
    ivalid = i < S
    lo = 0  # the first key block any row of this query block sees
    if WINDOW >= 0:
        lo = tl.maximum(i0 - WINDOW, 0)
    doc_i = i  # unused without documents
    if HAS_DOCS:
        lo = tl.maximum(lo, tl.load(start_ptr + b * S + i0))
        doc_i = tl.load(doc_ptr + b * S + i, mask=ivalid, other=-1)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.minimum(i0 + BLOCK_M, S)
    h64 = h.to(tl.int64)  # head-major views have head strides of S x D: h x stride passes 2^31 at 256K tokens
    q_base = q_ptr + b * stride_qb + h64 * stride_qh
    k_base = k_ptr + b * stride_kb + (h64 // N_REP) * stride_kh
    best = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    if not INTERPRETED:  # compiled: a for loop, which Triton software-pipelines (the next key block's loads overlap)
        for j0 in range(lo, hi, BLOCK_N):
            best = _key_block_max(best, q_base, k_base, doc_ptr, b, S, i, ivalid, doc_i, j0, stride_qs, stride_ks,
                                  D, BLOCK_D, WINDOW, HAS_DOCS, IEEE, BLOCK_M, BLOCK_N)  # fmt: skip
    else:  # the Triton interpreter (under numpy >= 2.4 its computed loop bounds do not convert to a range)
        j0 = lo
        while j0 < hi:
            best = _key_block_max(best, q_base, k_base, doc_ptr, b, S, i, ivalid, doc_i, j0, stride_qs, stride_ks,
                                  D, BLOCK_D, WINDOW, HAS_DOCS, IEEE, BLOCK_M, BLOCK_N)  # fmt: skip
            j0 += BLOCK_N
    best = tl.where(ivalid, best, float("-inf"))
    tl.store(out_ptr + bh * tl.num_programs(0) + pid_m, tl.max(best, axis=0))


def max_logits(
    q_BSHD: torch.Tensor,
    k_BSKD: torch.Tensor,
    *,
    scale: float,
    window: Optional[int],
    document_ids: Optional[torch.Tensor],
    document_starts: Optional[torch.Tensor] = None,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
) -> torch.Tensor:
    """fp32 [Hq]: the per-query-head max of scale * q.k over visible pairs (module docstring). With `document_ids`,
    `document_starts` are `attention_masks.document_starts(document_ids)` (this module imports none of ours). block_m,
    block_n, num_warps: the tiling (default: the measured best for full-causal or windowed layers)."""
    default = _FULL_TILING if window is None else _WINDOW_TILING
    block_m, block_n, num_warps = (v if v is not None else d for v, d in zip((block_m, block_n, num_warps), default))
    B, S, Hq, D = q_BSHD.shape
    Hkv = k_BSKD.shape[2]
    if Hq % Hkv:
        raise ValueError(f"max_logits: {Hq} query heads are not a multiple of {Hkv} KV heads")
    q = q_BSHD if q_BSHD.stride(-1) == 1 else q_BSHD.contiguous()
    k = k_BSKD if k_BSKD.stride(-1) == 1 else k_BSKD.contiguous()
    has_docs = document_ids is not None
    if has_docs and tuple(document_ids.shape) != (B, S):
        raise ValueError(f"max_logits: document_ids must be [B, S] = {[B, S]}, got {list(document_ids.shape)}")
    if has_docs and document_starts is None:
        raise ValueError("max_logits with document_ids needs their document_starts (attention_masks.document_starts)")
    docs = document_ids.to(torch.int32).contiguous() if has_docs else q  # unused pointer without documents
    starts = document_starts.to(torch.int32).contiguous() if has_docs else q
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    block_d = max(16, min(_MAX_BLOCK_D, triton.next_power_of_2(D)))
    grid = (triton.cdiv(S, block_m), B * Hq)
    partial = torch.empty(B, Hq, grid[0], dtype=torch.float32, device=q.device)
    _max_logits_kernel[grid](
        q, k, docs, starts, partial, S, Hq,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        Hq // Hkv, D, block_d, -1 if window is None else int(window), has_docs,
        q.dtype == torch.float32 or interpreted, interpreted, block_m, block_n, num_warps=num_warps,
    )  # fmt: skip
    return partial.amax(dim=(0, 2)) * scale


__all__ = ["max_logits"]
