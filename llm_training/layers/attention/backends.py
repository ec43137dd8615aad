"""Attention kernels behind one interface, the per-forward attention metadata, and the registry keyed by
`[kernels] attention` (the config's choices are exactly this registry's names).

Every kernel has the signature

    kernel(q_BSHD, k_BSKD, v_BSKE, *, scale, window, metadata, record_max_logits)
        -> (out_BSHE, max_logits_H or None)

q: [B, S, Hq, Dqk]; k: [B, S, Hkv, Dqk]; v: [B, S, Hkv, Dv] with Hq a multiple of Hkv (query head h uses
KV head h // (Hq / Hkv)). Attention is causal; with `window = W` key j is visible to query i iff
i - W <= j <= i (W + 1 keys including self); with `metadata.document_ids` [B, S], a key is visible only inside
the query's document. `max_logits` is the fp32 per-query-head max over batch and positions of the scaled
pre-softmax logit q.k * scale over visible pairs (for QK-clip), or None when not requested. The kernels that run
flash-attn-4 (fa4, and auto when it picks fa4: `runs_fa4`) take one more keyword, `keep_slot`: keep the forward's
result for the recompute of a checkpointed block (`fa4.py`, "kept across a recompute").

`AttentionMetadata` is built ONCE per model forward from the batch's document ids (`build_attention_metadata`,
outside any compiled region) and passed down to every layer: the document ids and whatever the backend
precomputes from them (FlexAttention block masks, one per window the model uses). Nothing is cached in
module globals, so torch.compile and context parallelism see every input of the attention call.

Adding a backend = a kernel with that signature + an `AttentionBackend` entry in `ATTENTION_BACKENDS` saying
which (window, documents, device) cases use FlexAttention block masks and which read varlen cu_seqlens.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from llm_training.layers.attention.masks import attention_max_logits, repeat_kv, visibility_mask

logger = logging.getLogger(__name__)

_FA4_DTYPES = (torch.bfloat16, torch.float16)  # flash-attn-4 runs half dtypes only

AttentionKernel = Callable[..., tuple[torch.Tensor, Optional[torch.Tensor]]]


@dataclass(frozen=True)
class AttentionMetadata:
    """What all attention layers of one forward share: `document_ids` [B, S] (None: every row is one
    document) and the FlexAttention block masks the backend needs, keyed by window (None = full causal)."""

    document_ids: Optional[torch.Tensor] = None
    flex_block_masks: dict = field(default_factory=dict)
    # varlen kernels (fa4) with documents: cumulative document lengths over the B*S flattened tokens, int32
    # [N + 1] (fa4_attention.document_cu_seqlens), and a bound on every document's length: the row length S
    # (static across batches, so compiled code does not specialise on the longest document); both None without
    # documents or for other backends
    cu_seqlens: Optional[torch.Tensor] = None
    max_seqlen: Optional[int] = None
    # backend "auto": whether this forward's device runs flash-attn-4 (decided here, eagerly, not in the layers)
    auto_picks_fa4: bool = False
    # context parallel (distributed/context_parallel/block_attention.py): FlexAttention masks of (query block, key block) pairs,
    # built on first use within this forward and shared by its layers and the backward's recompute
    block_pair_masks: dict = field(default_factory=dict)

    def flex_block_mask(self, window: Optional[int]):
        try:
            return self.flex_block_masks[window]
        except KeyError:
            raise RuntimeError(
                f"no FlexAttention block mask for window {window} in this forward's AttentionMetadata (built for "
                f"windows {sorted(self.flex_block_masks, key=str)}); build it with build_attention_metadata(...) "
                "for every window the model uses"
            ) from None


# ---------------------------------------------------------------------------------------- kernels
def reference_attention(q_BSHD, k_BSKD, v_BSKE, *, scale, window, metadata, record_max_logits):
    """Explicit-mask softmax attention in fp32 (CPU or GPU); the ground truth for the other kernels."""
    document_ids = metadata.document_ids
    Hq, Hkv = q_BSHD.shape[2], k_BSKD.shape[2]
    q = q_BSHD.float().transpose(1, 2)
    k = repeat_kv(k_BSKD, Hq // Hkv).float().transpose(1, 2)
    v = repeat_kv(v_BSKE, Hq // Hkv).float().transpose(1, 2)
    S = q.shape[2]
    mask = visibility_mask(range(S), range(S), q.device, window=window, document_ids_BS=document_ids)
    logits = (q @ k.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    max_logits = logits.detach().amax(dim=(0, 2, 3)) if record_max_logits else None
    out = torch.softmax(logits, dim=-1) @ v
    return out.transpose(1, 2).to(q_BSHD.dtype), max_logits


def _fused_sdpa_only():
    """SDPA restricted to the fused CUDA kernels. torch's priority order is flash, efficient, math, cuDNN:
    flash/efficient have no kernel for qk 192 / v 128, so without this the math kernel (materialised
    [S, S] scores) would win over cuDNN (docs/dependencies.md). No `set_priority`, which torch.compile may
    not trace; excluding MATH is enough for cuDNN to be picked."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def sdpa_attention(q_BSHD, k_BSKD, v_BSKE, *, scale, window, metadata, record_max_logits):
    """torch SDPA: `is_causal` when there is neither a window nor documents (fused kernels only on CUDA:
    cuDNN for the GDLA shape), else an explicit boolean mask (whatever kernel torch picks).
    GQA through `enable_gqa` (torch >= 2.5; our floor is 2.11). On CPU, v narrower than q / k (GDLA: 128 vs 192)
    gets zero columns up to their width and the output loses them again: torch's CPU flash kernel, which needs
    one head dim and never materialises the [S, S] scores, then runs instead of the math kernel (the attention
    weights do not depend on v, so the first columns are the same attention; fwd+bwd at the motif3_debug shape:
    18 ms instead of 28-38 ms per layer on 2 cores)."""
    document_ids = metadata.document_ids
    q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BSKD, v_BSKE))
    v_width = v.shape[-1]
    if not q.is_cuda and v_width < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - v_width))
    if window is None and document_ids is None:
        # The fused kernels take bf16/fp16 only; fp32 on CUDA (mixed_precision_param = "float32") keeps
        # torch's full choice, which includes the math kernel.
        fused_only = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
        with _fused_sdpa_only() if fused_only else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        S = q.shape[2]
        mask = visibility_mask(range(S), range(S), q.device, window=window, document_ids_BS=document_ids)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    max_logits = None
    if record_max_logits:
        max_logits = attention_max_logits(q_BSHD, k_BSKD, scale=scale, window=window, document_ids=document_ids)
    return out[..., :v_width].transpose(1, 2), max_logits


_compiled_flex = None


@torch.compiler.disable  # mask building stays eager, outside any compiled block
def flex_block_mask(
    document_ids: Optional[torch.Tensor], window: Optional[int], batch: int, queries: range, keys: range, device
):
    """The FlexAttention BlockMask of causal + sliding-window (`window`) + document (`document_ids`, [B, S] over
    the whole sequence) attention for the query rows at absolute positions `queries` against the keys at
    `keys` (both step-1 ranges: the whole sequence for a layer's own attention, one block pair for
    context-parallel ring / halo attention)."""
    from torch.nn.attention.flex_attention import create_block_mask

    q0, k0 = queries.start, keys.start

    def mask_mod(b, h, q_idx, kv_idx):
        qi, kj = q_idx + q0, kv_idx + k0
        visible = kj <= qi
        if window is not None:
            visible = visible & (kj >= qi - window)
        if document_ids is not None:
            visible = visible & (document_ids[b, qi] == document_ids[b, kj])
        return visible

    # Large CUDA masks: build them with torch.compile instead of materialising [B, Q, K] booleans.
    compile_mask = torch.device(device).type == "cuda" and len(queries) * len(keys) >= 1 << 30
    return create_block_mask(
        mask_mod,
        batch if document_ids is not None else None,
        None,
        len(queries),
        len(keys),
        device=device,
        _compile=compile_mask,
    )


def flex_attention_kernel(q_BSHD, k_BSKD, v_BSKE, *, scale, window, metadata, record_max_logits):
    """FlexAttention with the metadata's causal + sliding-window + document block mask for `window` (compiled
    on CUDA; on CPU torch runs it unfused and forward-only, which is enough for the tests).

    max_logits on CUDA come from the kernel itself (`AuxRequest(max_scores=True)`: each query row's max of the
    scaled logits over its visible keys, which the online softmax tracks anyway, accumulated in fp32), so QK-clip
    costs no side pass; torch's CPU flex returns no max, so there `attention_max_logits` computes it."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    block_mask = metadata.flex_block_mask(window)
    fn = flex_attention
    # Inside a compiled block dynamo fuses flex_attention itself. Eager CUDA calls go through one compiled wrapper;
    # the wrapper is never touched while compiling (a module global read there would be guarded, and creating it
    # after the first block compiled would recompile that block).
    if q_BSHD.is_cuda and not torch.compiler.is_compiling():
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BSKD, v_BSKE))
    max_logits = None
    if record_max_logits and q_BSHD.is_cuda:
        out, aux = fn(
            q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, return_aux=AuxRequest(max_scores=True)
        )
        max_logits = aux.max_scores.detach().amax(dim=(0, 2)).float()  # [B, Hq, S] -> [Hq]
    else:
        out = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
        if record_max_logits:
            max_logits = attention_max_logits(
                q_BSHD, k_BSKD, scale=scale, window=window, document_ids=metadata.document_ids
            )
    return out.transpose(1, 2), max_logits


def _auto_picks_fa4(device: torch.device, head_dims: Optional[tuple[int, int]]) -> bool:
    """Whether backend auto runs flash-attn-4 on `device` for attention of (qk, v) `head_dims` (None: the caller
    did not say; the GDLA dims are assumed)."""
    from llm_training.layers.attention.fa4 import fa4_head_dims_problem, fa4_usable

    if not fa4_usable(device):
        _warn_auto_without_fa4(torch.device(device))
        return False
    return head_dims is None or fa4_head_dims_problem(*head_dims) is None


@functools.cache
def _warn_auto_without_fa4(device: torch.device) -> None:
    """Once per device: a warning when flash-attn-4 has kernels for this GPU but does not import, so backend auto
    runs FlexAttention / SDPA instead (slower, and FlexAttention's masks cost memory at long context)."""
    from llm_training.layers.attention.fa4 import fa4_missing_reason

    error = fa4_missing_reason(device)
    if error is not None:
        logger.warning(
            "[kernels] attention = 'auto': flash-attn-4 has kernels for this GPU but does not import (%s), so "
            "attention runs FlexAttention / SDPA, up to 2.6x slower on the H200 (bench/README.md); install "
            "flash-attn-4==4.0.0b36 (it and its CuTe DSL libraries are in the repo's CUDA image), or set "
            "attention = 'flex' to silence this",
            error,
        )


def _auto_uses_flex(window: Optional[int], has_documents: bool, device: torch.device) -> bool:
    """Backend auto without flash-attn-4: FlexAttention for windows and documents on CUDA (with flash-attn-4,
    `build_attention_metadata` applies the fa4 backend's rules instead)."""
    return device.type == "cuda" and (window is not None or has_documents)


def runs_fa4(backend: str, metadata: AttentionMetadata, dtype: torch.dtype) -> bool:
    """Whether `backend`'s kernel runs flash-attn-4 in this forward for inputs of `dtype`: fa4, or auto where the
    metadata says the device runs it and the dtype is a half one. Such a kernel takes the tensor form of the window
    (`masks.window_tensor`): one compiled graph for full and sliding layers."""
    return backend == "fa4" or (backend == "auto" and metadata.auto_picks_fa4 and dtype in _FA4_DTYPES)


def auto_attention(q_BSHD, k_BSKD, v_BSKE, *, scale, window, metadata, record_max_logits, keep_slot=None):
    """The fastest kernel measured for the device and case:
    - CUDA SM90 / SM100 with flash-attn-4 installed, bf16 / fp16 -> fa4 for every case. Measured on the H200
      by bench/bench_attention.py (bench/results/fa4_h200.log) at the GDLA shape (80 / 16 heads, qk 192 / v 128),
      fwd+bwd over 131072 tokens: full causal fa4 / cuDNN SDPA / Flex 114.4 / 111.6 / 300.3 ms at S = 4K,
      397.5 / 395.9 ms at 16K, 1488 / 1564 ms at 64K, 2953 / 3153 ms at 128K; window 128 fa4 34.9 ms vs Flex
      61.8 ms (masked SDPA 408 ms). cuDNN is within 3% at 4K-16K plain causal only, cannot mask documents or
      windows, and fa4 is 5-7% ahead from 64K on: one kernel for every case. In fp32 (a debug setting) -> sdpa.
    - other CUDA with a window or documents -> FlexAttention (SDPA would fall back to its math kernel for
      qk 192 / v 128 with a mask); plain causal -> SDPA (cuDNN);
    - CPU -> SDPA (CPU kernels).
    `keep_slot` (flash-attn-4's keep across a recompute, `fa4.keep_slot_tensor`) is for calls that run fa4
    (`runs_fa4`), the only kernel that keeps."""
    kw = dict(scale=scale, window=window, metadata=metadata, record_max_logits=record_max_logits)
    if metadata.auto_picks_fa4:
        if runs_fa4("auto", metadata, q_BSHD.dtype):
            from llm_training.layers.attention.fa4 import fa4_attention

            return fa4_attention(q_BSHD, k_BSKD, v_BSKE, **kw, keep_slot=keep_slot)
        return sdpa_attention(q_BSHD, k_BSKD, v_BSKE, **kw)
    uses_flex = _auto_uses_flex(window, metadata.document_ids is not None, q_BSHD.device)
    kernel = flex_attention_kernel if uses_flex else sdpa_attention
    return kernel(q_BSHD, k_BSKD, v_BSKE, **kw)


def fa4_attention_kernel(q_BSHD, k_BSKD, v_BSKE, *, scale, window, metadata, record_max_logits, keep_slot=None):
    """flash-attn-4 (layers/attention/fa4.py, imported on first call); `keep_slot` as in `auto_attention`."""
    from llm_training.layers.attention.fa4 import fa4_attention

    return fa4_attention(
        q_BSHD, k_BSKD, v_BSKE, scale=scale, window=window, metadata=metadata, record_max_logits=record_max_logits,
        keep_slot=keep_slot,
    )  # fmt: skip


@dataclass(frozen=True)
class AttentionBackend:
    """A registered backend: its kernel, which (window, has_documents, device) cases read a FlexAttention block
    mask from the metadata, and which (has_documents, device) cases read the varlen cu_seqlens (both built once
    per forward by `build_attention_metadata`)."""

    kernel: AttentionKernel
    uses_flex: Callable[[Optional[int], bool, torch.device], bool] = lambda window, has_documents, device: False
    uses_varlen: Callable[[bool, torch.device], bool] = lambda has_documents, device: False


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {
    "reference": AttentionBackend(reference_attention),
    "sdpa": AttentionBackend(sdpa_attention),
    "flex": AttentionBackend(flex_attention_kernel, lambda window, has_documents, device: True),
    "fa4": AttentionBackend(fa4_attention_kernel, uses_varlen=lambda has_documents, device: has_documents),
    "auto": AttentionBackend(auto_attention, _auto_uses_flex),
}


def get_attention_backend(name: str) -> AttentionBackend:
    """Look up a backend by its `[kernels] attention` name; the error lists what exists."""
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention_backend {name!r}; available: {', '.join(sorted(ATTENTION_BACKENDS))} "
            "(set [kernels] attention)"
        ) from None


def build_attention_metadata(
    backend: str,
    document_ids_BS: Optional[torch.Tensor],
    windows,
    batch_size: int,
    seq_len: int,
    device: torch.device,
    head_dims: Optional[tuple[int, int]] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> AttentionMetadata:
    """The metadata of one forward: the document ids plus, for each window in `windows` (None = full causal)
    that `backend` runs through FlexAttention on `device`, its block mask, and the documents' cu_seqlens when
    `backend` runs varlen there. `head_dims`: the layers' (qk, v) head dims, which decide whether backend auto can
    run flash-attn-4 (`fa4_head_dims_problem`). `cu_seqlens`: those cu_seqlens, on `device`, when the caller has
    them (`fa4.document_cu_seqlens` of its host copy of the ids, moved without waiting: the trainer's micro-batches);
    else they are computed here from the device's ids, a host sync (torch.nonzero), here and not in the layers."""
    spec = get_attention_backend(backend)
    device = torch.device(device)
    auto_picks_fa4 = backend == "auto" and device.type == "cuda" and _auto_picks_fa4(device, head_dims)
    rules = get_attention_backend("fa4") if auto_picks_fa4 else spec  # auto with fa4: fa4's masks and cu_seqlens
    has_documents = document_ids_BS is not None
    masks = {
        window: flex_block_mask(document_ids_BS, window, batch_size, range(seq_len), range(seq_len), device)
        for window in windows
        if rules.uses_flex(window, has_documents, device)
    }
    max_seqlen = None
    if not rules.uses_varlen(has_documents, device):
        cu_seqlens = None
    else:
        from llm_training.layers.attention.fa4 import document_cu_seqlens

        if cu_seqlens is None:
            cu_seqlens = document_cu_seqlens(document_ids_BS)
        max_seqlen = document_ids_BS.shape[1]
        # The document count N changes from batch to batch: a size compiled code must not specialise on (it only
        # reaches the opaque kernel ops), else each compiled block recompiles at the first batch of another N
        torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
    return AttentionMetadata(
        document_ids=document_ids_BS,
        flex_block_masks=masks,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        auto_picks_fa4=auto_picks_fa4,
    )
