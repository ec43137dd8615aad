"""The visibility rule every attention backend implements (causal, optional sliding window, optional packed
documents) as an explicit boolean mask, and the exact max-logit side pass for QK-clip that the fused kernels
which do not return their logits (cuDNN SDPA, flash-attn-4; FlexAttention on the CPU) share:
`attention_max_logits`, a Triton kernel on CUDA (`max_logits_kernels`, a custom op opaque to torch.compile),
`chunked_max_logits` (torch tensor ops) elsewhere.

A leaf module: the backends (`attention_backends`, `fa4_attention`) import it; it imports none of them. (No
`from __future__ import annotations`: the custom op's schema is inferred from its annotations.)
"""

import os
from typing import Optional

import torch
from activation.backend import TRITON_AVAILABLE  # probed once, never in compiled code

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# A layer's sliding window reaches the kernels in one of two forms. As a Python value (an int W, None = full
# causal), which code traced by torch.compile specialises on: each value is its own compiled graph. Or, for the
# kernels that are opaque custom ops (flash-attn-4, the max-logit side pass), as a CPU int64 scalar tensor (-1 =
# full causal), which the op reads when it runs: full and sliding attention layers then share one compiled graph
# (GDLAttention passes this form to them; `window_value` / `window_tensor` convert).
FULL_CAUSAL = -1


def window_tensor(window) -> torch.Tensor:
    """The tensor form of `window` (an int, None or already a tensor): CPU int64 scalar, FULL_CAUSAL for None."""
    if isinstance(window, torch.Tensor):
        return window
    return torch.tensor(FULL_CAUSAL if window is None else int(window), dtype=torch.int64, device="cpu")


def window_value(window) -> Optional[int]:
    """The Python form of `window` (an int, None or the tensor form): None = full causal. Reads the tensor: call
    it where the code runs (an op's body, eager code), never in code torch.compile traces."""
    if isinstance(window, torch.Tensor):
        value = int(window)
        return None if value == FULL_CAUSAL else value
    return window


def visibility_mask(
    queries: range,
    keys: range,
    device: torch.device,
    *,
    window: Optional[int],
    document_ids_BS: Optional[torch.Tensor],
) -> torch.Tensor:
    """Boolean [B or 1, 1, len(queries), len(keys)] mask (True = visible) for absolute query positions
    `queries` and key positions `keys` (both step-1 ranges)."""
    qi = torch.arange(queries.start, queries.stop, device=device)[:, None]
    kj = torch.arange(keys.start, keys.stop, device=device)[None, :]
    mask = kj <= qi
    if window is not None:
        mask = mask & (kj >= qi - window)
    mask = mask[None, None]
    if document_ids_BS is not None:
        dq = document_ids_BS[:, queries.start : queries.stop]
        dk = document_ids_BS[:, keys.start : keys.stop]
        mask = mask & (dq[:, None, :, None] == dk[:, None, None, :])
    return mask


def document_starts(document_ids_BS: torch.Tensor) -> torch.Tensor:
    """int32 [B, S]: the position in its row where each token's document starts (documents are contiguous runs of
    one id; a row start is a document start)."""
    B, S = document_ids_BS.shape
    pos = torch.arange(S, device=document_ids_BS.device).expand(B, S)
    is_start = torch.ones_like(document_ids_BS, dtype=torch.bool)
    is_start[:, 1:] = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]
    return torch.where(is_start, pos, torch.zeros_like(pos)).cummax(dim=1).values.to(torch.int32)


def repeat_kv(x_BSKD: torch.Tensor, n_rep: int) -> torch.Tensor:
    """KV heads repeated `n_rep` times along the head dim (-2: [B, S, K, D], or varlen [T, K, D]), query head h
    reading KV head h // n_rep (GQA -> one KV head per query head)."""
    return x_BSKD if n_rep == 1 else x_BSKD.repeat_interleave(n_rep, dim=-2)


@torch.no_grad()
def chunked_max_logits(
    q_BSHD: torch.Tensor,
    k_BSKD: torch.Tensor,
    *,
    scale: float,
    window: Optional[int],
    document_ids: Optional[torch.Tensor],
    block_elems: int = 1 << 27,
    query_chunk: int = 1024,
) -> torch.Tensor:
    """Per-query-head max of the scaled logits over visible pairs, fp32 [Hq], as a side computation:
    query chunks x key chunks of at most `block_elems` logits each (never [B, H, S, S] at once), keys
    limited to the causal / window range of each query chunk. Matmul in the input dtype; the max of a tile
    is taken in that dtype and scaled in fp32 after (the same value as scaling first: scale > 0 and the
    conversion is exact); only tiles that cross the causal / window edge or hold documents are masked."""
    B, S, Hq, _ = q_BSHD.shape
    k_BHSD = repeat_kv(k_BSKD, Hq // k_BSKD.shape[2]).transpose(1, 2)
    q_BHSD = q_BSHD.transpose(1, 2)
    best = torch.full((Hq,), float("-inf"), device=q_BSHD.device, dtype=torch.float32)
    cq = min(S, query_chunk)
    ck = max(cq, block_elems // max(1, B * Hq * cq))
    for i0 in range(0, S, cq):
        i1 = min(S, i0 + cq)
        k_lo = 0 if window is None else max(0, i0 - window)
        for j0 in range(k_lo, i1, ck):
            j1 = min(i1, j0 + ck)
            tile = q_BHSD[:, :, i0:i1] @ k_BHSD[:, :, j0:j1].transpose(-1, -2)
            inside = j1 - 1 <= i0 and (window is None or j0 >= i1 - 1 - window)
            if document_ids is not None or not inside:
                mask = visibility_mask(
                    range(i0, i1), range(j0, j1), q_BSHD.device, window=window, document_ids_BS=document_ids
                )
                tile = tile.masked_fill(~mask, float("-inf"))
            # the key dimension first (contiguous rows), then batch and queries: a single amax over (0, 2, 3) keeps
            # the head dimension in the middle and reduced across strides (5 ms per 1024-query chunk on the H200)
            best = torch.maximum(best, tile.amax(dim=-1).amax(dim=(0, 2)).float() * scale)
    return best


@torch.library.custom_op("llm_training::attention_max_logits", mutates_args=())
def _max_logits_op(
    q: torch.Tensor, k: torch.Tensor, document_ids: Optional[torch.Tensor], scale: float, window: torch.Tensor
) -> torch.Tensor:
    """The side pass as one opaque op (`window` in its tensor form): the Triton kernel on CUDA (or under the Triton
    interpreter), else the chunked torch ops."""
    if TRITON_AVAILABLE and (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and q.dtype in _KERNEL_DTYPES:
        from llm_training.layers.attention import max_logits_kernels  # imports triton

        starts = None if document_ids is None else document_starts(document_ids)
        return max_logits_kernels.max_logits(
            q, k, scale=scale, window=window_value(window), document_ids=document_ids, document_starts=starts
        )
    return chunked_max_logits(q, k, scale=scale, window=window_value(window), document_ids=document_ids)


@_max_logits_op.register_fake
def _(q, k, document_ids, scale, window):
    return q.new_empty(q.shape[2], dtype=torch.float32)


def prebuild_max_logits_kernels(kinds, batch_size: int, seq_len: int, dtype: torch.dtype) -> None:
    """Hand the Triton max-logit kernel's launches at the training shape to the active Triton prebuild
    (`activation.triton_prebuild`), one per distinct (query heads, KV heads, qk head dim, window) of `kinds` (objects
    with those attributes: `fa4_prebuild.Fa4AttentionKind`), from meta tensors of [batch_size, seq_len] rows with
    packed documents (the training data always has document ids). The kernel runs inside an opaque custom op whose
    window is a tensor read at launch, so its fake implementation cannot announce it (the window is a constexpr of the
    kernel); the trainer calls this at start-up instead, and the workers build every variant while the model is
    built. A no-op without triton, an active prebuild, or for a dtype the kernel does not take."""
    if not TRITON_AVAILABLE or dtype not in _KERNEL_DTYPES:
        return
    from activation.triton_prebuild import active_prebuild, capture_launches

    if active_prebuild() is None:
        return
    from llm_training.layers.attention import max_logits_kernels  # imports triton

    B, S = batch_size, seq_len
    document_ids_BS = torch.empty(B, S, dtype=torch.long, device="meta")
    starts_BS = document_starts(document_ids_BS)
    variants = sorted({(k.n_heads, k.n_kv_heads, k.d_qk, k.window) for k in kinds}, key=str)
    for n_heads, n_kv_heads, d_qk, window in variants:
        q_BSHD = torch.empty(B, S, n_heads, d_qk, dtype=dtype, device="meta")
        k_BSKD = torch.empty(B, S, n_kv_heads, d_qk, dtype=dtype, device="meta")

        def launch(q_BSHD=q_BSHD, k_BSKD=k_BSKD, window=window):
            max_logits_kernels.max_logits(
                q_BSHD, k_BSKD, scale=1.0, window=window, document_ids=document_ids_BS, document_starts=starts_BS
            )

        attention = "full causal" if window is None else f"window {window}"
        capture_launches(launch, q_BSHD, what=f"attention max logits ({attention}, {n_heads}/{n_kv_heads} heads)")


def attention_max_logits(
    q_BSHD: torch.Tensor,
    k_BSKD: torch.Tensor,
    *,
    scale: float,
    window,
    document_ids: Optional[torch.Tensor],
) -> torch.Tensor:
    """Per-query-head max of the scaled logits over visible pairs, fp32 [Hq], no gradient: the Triton kernel on
    CUDA when triton is installed, else `chunked_max_logits`. `window` in either form (module docstring); the
    tensor form always goes through the opaque op (one graph for every window under torch.compile)."""
    q, k = q_BSHD.detach(), k_BSKD.detach()
    if isinstance(window, torch.Tensor) or (TRITON_AVAILABLE and q.is_cuda and q.dtype in _KERNEL_DTYPES):
        return _max_logits_op(q, k, document_ids, float(scale), window_tensor(window))
    return chunked_max_logits(q, k, scale=scale, window=window, document_ids=document_ids)
