"""Attention of one block of queries against one block of keys, with the log-sum-exp: the unit that ring
and halo attention (context parallel) are assembled from.

    block_kernel(q_BQHD, k_BKKD, v_BKKE, *, scale, queries, keys, window, document_ids, record_max_logits)
        -> (out_BQHE fp32 (or wider), lse_BHQ fp32 (or wider), max_logits_H fp32 or None)

`queries` / `keys` are the absolute sequence positions (step-1 ranges) of the rows of q and k; visibility is
that of attention_backends (causal, optional window W, documents from the FULL-sequence document_ids
[B, S]). GQA as there: query head h uses KV head h // (Hq / Hkv). A query row with no visible key gets
out = 0 and lse = -inf. Both out and lse are differentiable: the ring's backward recomputes each block and
backpropagates through both (see ring.py).

Kernels: `reference_block_attention` (explicit mask, fp32 math, any device: the tests' ground truth) and
`flex_block_attention` (FlexAttention with `return_aux` lse / max_scores, CUDA; imported lazily; the CPU
tests check its forward only: torch has no CPU flex backward, and its CUDA run is not verified here).
`block_attention_kernel(device, mask_cache)` picks flex on CUDA, the reference elsewhere. Flex masks come from
`attention_backends.flex_block_mask` and live in the forward's AttentionMetadata, never in a module global.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from llm_training.layers.attention.backends import flex_block_mask
from llm_training.layers.attention.masks import visibility_mask

BlockKernel = Callable[..., tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]


def reference_block_attention(q_BQHD, k_BKKD, v_BKKE, *, scale, queries, keys, window, document_ids, record_max_logits):
    """Explicit-mask block attention in fp32 (float64 inputs stay float64); rows without a visible key give
    out 0, lse -inf (no NaN in forward or backward)."""
    Hq, Hkv = q_BQHD.shape[2], k_BKKD.shape[2]
    ct = torch.promote_types(q_BQHD.dtype, torch.float32)
    q = q_BQHD.to(ct).transpose(1, 2)
    k = k_BKKD.to(ct).repeat_interleave(Hq // Hkv, dim=2).transpose(1, 2)
    v = v_BKKE.to(ct).repeat_interleave(Hq // Hkv, dim=2).transpose(1, 2)
    mask = visibility_mask(queries, keys, q.device, window=window, document_ids_BS=document_ids)
    logits = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~mask, float("-inf"))  # [B, H, Q, K]
    row_max = logits.detach().amax(dim=-1, keepdim=True)  # lse does not depend on the shift: no gradient
    visible = torch.isfinite(row_max)
    row_max = torch.where(visible, row_max, 0.0)
    p = torch.exp(logits - row_max)
    denom = torch.where(visible, p.sum(dim=-1, keepdim=True), 1.0)  # 1 where nothing is visible: no 0/0
    out = (p @ v) / denom
    lse = torch.where(visible, row_max + denom.log(), float("-inf")).squeeze(-1)
    max_logits = logits.detach().amax(dim=(0, 2, 3)).float() if record_max_logits else None
    return out.transpose(1, 2), lse, max_logits


@functools.cache
def _flex_attention(device_type: str):
    """torch.compile'd FlexAttention on CUDA (the fused kernel); eager elsewhere (CPU: forward only, used
    by the tests to check the mask and the lse against the reference)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention


def flex_block_attention(
    q_BQHD, k_BKKD, v_BKKE, *, scale, queries, keys, window, document_ids, record_max_logits, mask_cache=None
):
    """FlexAttention on one block pair (CUDA; on CPU torch supports neither its backward nor max_scores).
    `max_scores` (the scaled pre-softmax max per query row) gives max_logits. `mask_cache`: the forward's
    `AttentionMetadata.block_pair_masks`, where the pair's mask is built once and shared (None: no sharing)."""
    from torch.nn.attention.flex_attention import AuxRequest

    key = (queries.start, queries.stop, keys.start, keys.stop, window)
    block_mask = None if mask_cache is None else mask_cache.get(key)
    if block_mask is None:
        block_mask = flex_block_mask(document_ids, window, q_BQHD.shape[0], queries, keys, q_BQHD.device)
        if mask_cache is not None:
            mask_cache[key] = block_mask
    q, k, v = (t.transpose(1, 2) for t in (q_BQHD, k_BKKD, v_BKKE))
    out, aux = _flex_attention(q.device.type)(
        q,
        k,
        v,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=True,
        return_aux=AuxRequest(lse=True, max_scores=record_max_logits),
    )
    max_logits = aux.max_scores.detach().float().amax(dim=(0, 2)) if record_max_logits else None
    return out.transpose(1, 2).float(), aux.lse.float(), max_logits


def block_attention_kernel(device: torch.device, mask_cache: Optional[dict] = None) -> BlockKernel:
    """FlexAttention on CUDA (its block-pair masks kept in `mask_cache`, the forward's
    `AttentionMetadata.block_pair_masks`), the fp32 reference elsewhere (CPU tests)."""
    if torch.device(device).type == "cuda":
        return functools.partial(flex_block_attention, mask_cache=mask_cache)
    return reference_block_attention


@torch.no_grad()
def merge_partials(
    acc: Optional[tuple[torch.Tensor, torch.Tensor]], out_BQHE: torch.Tensor, lse_BHQ: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of two partial attentions over disjoint key sets, fp32:
    o = (e^{lse_a} o_a + e^{lse_b} o_b) / (e^{lse_a} + e^{lse_b}); rows empty on both sides stay (0, -inf)."""
    if acc is None:
        return out_BQHE.float(), lse_BHQ.float()
    out_a, lse_a = acc
    lse = torch.logaddexp(lse_a, lse_BHQ)
    base = torch.where(torch.isfinite(lse), lse, 0.0)
    w_a = torch.exp(lse_a - base).transpose(1, 2).unsqueeze(-1)  # [B, Q, H, 1]
    w_b = torch.exp(lse_BHQ - base).transpose(1, 2).unsqueeze(-1)
    return out_a * w_a + out_BQHE.float() * w_b, lse
