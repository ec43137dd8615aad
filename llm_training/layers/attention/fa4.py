"""flash-attn-4 (`flash_attn.cute`, CuTe DSL kernels for SM90 / SM100) as an attention kernel of
`attention_backends.py`, called directly (never through torch's `activate_flash_attention_impl("FA4")` shim,
which breaks SDPA and varlen on torch 2.11 / 2.13: docs/dependencies.md).

    fa4_attention(q_BSHD, k_BSKD, v_BSKE, *, scale, window, metadata, record_max_logits)
        -> (out_BSHE, max_logits_H or None)

- causal: `causal=True`; sliding window W: `window_size=(W, 0)`, i.e. key j visible iff i - W <= j <= i
  (W + 1 keys, our convention); FA4 skips key blocks that are fully outside the window, so a W = 128 layer
  costs O(S * W), not O(S^2). The window may come as an int / None or as its CPU scalar tensor form
  (`masks.window_tensor`, what GDLAttention passes): the ops read it when they run, so a compiled attention graph
  serves full and sliding layers alike.
- packed documents: FA4's varlen kernels over the B*S flattened tokens with the cumulative sequence
  lengths of the documents (`document_cu_seqlens`, built once per forward into the AttentionMetadata); a
  row boundary is a document boundary too. The causal / window mask is then relative to each document.
- GQA with qk head dim != v head dim (GDLA: 192 / 128): FA4's forward kernels take the KV heads as they are
  (pack_gqa), but its SM90 backward asserts equal head dims for GQA (`flash_bwd_sm90.py`, "GQA backward requires
  head_dim == head_dim_v", in 4.0.0b36 and still in b40), so the backward gets the KV heads laid out for it
  (`GQA_LAYOUTS`): "expand_kv" repeats K and V to the query heads (plain MHA) for the backward's kernel call only
  and sums dK/dV back over the copies; "pad_v" keeps the KV heads and zero-pads V to the qk head dim in both passes
  (output sliced back). Measured on the H200 at the GDLA shape, B2 S4096, fwd+bwd, both passes then on the
  repeated K/V: expand_kv 6.90 ms vs pad_v 7.88 ms (full causal) and 2.50 ms vs 2.97 ms (window 128);
  bench/bench_attention.py re-measures both. Default: expand_kv. The custom op `llm_training::fa4_fwd` saves the
  KV-head K/V for its backward (`fa4_bwd`; n_kv * (d_qk + d_v) per token saved instead of n_h * (d_qk + d_v): 5x
  less at GDLA's 80 / 16 heads). Measured on the H200 (session 14): motif3_proxy's peak allocated 107.5 -> 105.0
  GiB per 64K-token step at the same step time; at 256K tokens a recomputed block keeps 10.7 GB less and the peak,
  then set by the loss, fell 80.3 -> 77.8 GiB. Until session 42 the forward ran on repeated K/V too: its copies
  wrote n_h * (d_qk + d_v) bf16 per token (420 MB per call at B2 S4096) and took 7.4 ms of the 849 ms proxy_16e
  step without MTP (one H100, session 40's profile). Measured fwd+bwd at B2 S4096 on one H100 (bench_attention.py,
  session 42): full causal 7.35 and 7.45 ms against 7.46 before, window 3.01 and 3.32 against 3.27, i.e. within
  the runs' spread, so no time saving is claimed for it; it takes the copies and their transient memory away.
  Equal head dims use FA4's native GQA (pack_gqa) in both passes, with no copy.
- log-sum-exp: `fa4_attention_lse` returns it too (natural log, fp32 [B, Hq, S]), differentiable (FA4's
  backward takes dlse), which is what ring attention merges.
- max_logits (QK-clip): FA4 returns no row max. The LSE only bounds it (max <= lse <= max + log(#visible
  keys), i.e. up to log(262144) = 12.5 too high at 256K), which would clip too often, so the exact value
  comes from `attention_masks.attention_max_logits`, a no-grad side pass of the q.k products only (a Triton
  kernel on CUDA that keeps its tiles on chip: `max_logits_kernels`; at most the attention forward's q.k
  share, ~60% of its FLOPs at d_qk 192 / d_v 128; only on steps that record).

- head dims: FA4 4.0.0b36's SM90 backward lays the dO tile [128, d_v] out with the swizzle of the qk head dim
  (flash_bwd_sm90.py), which fails to compile ("expected top-level shape equivalence between the SMEM layout and
  the CTA V-map") when the two padded head dims take different swizzles: motif3_debug's 24 / 16 did on the H200
  (2026-12-04), the GDLA 192 / 128 runs. `fa4_head_dims_problem` accepts equal head dims or both >= 64 (one
  128-byte swizzle for each); `auto` does not pick FA4 for other shapes, the fa4 backend raises for them.

- torch.compile: the kernels are the custom ops `llm_training::fa4_fwd` / `fa4_bwd`, one opaque node each in a
  compiled block's graph, so a block compiles without a graph break. That matters most under activation
  checkpointing: a graph break inside a checkpointed block makes dynamo run the whole block eagerly. Before the
  custom ops (a torch.compiler.disable call, up to session 15), every compile + AC + fa4 run, i.e. the production
  configs on the H200 and B200, trained with eager blocks (CPU, emulated kernel: 0 graphs compiled vs 2;
  tests/distributed/test_compile.py). Selective AC keeps fa4_fwd's outputs, as it keeps the other attention
  kernels' (`activation_checkpoint._SAVE_OPS`).
- kept across a recompute: under "long_context" checkpointing (64K-256K tokens) a full-attention layer's forward
  kernel is the quadratic part of its block, and the block's recompute in the backward would run it a second
  time. Such a layer passes a keep slot (`keep_slot_tensor`; `[activation_checkpoint] keep_full_attention`): the
  op's forward stores a copy of its (out, lse) under the slot, and when it runs again inside the backward (the
  checkpoint's recompute) it hands that copy back instead of launching the kernel. A "selective" policy cannot do
  this here, since long_context blocks compile in pieces under an eager checkpoint and a policy does not see into
  compiled pieces (`distributed.compile.compile_in_pieces`). Costs n_h * d_v compute-dtype elements and n_h fp32
  per token per full-attention layer from the forward to that layer's backward (the dry run counts them).

Only bf16 / fp16 on CUDA; anything else raises with the alternative named. The package is imported lazily.
"""

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Optional

import torch
from torch import Tensor

from llm_training.layers.attention.masks import repeat_kv, window_tensor, window_value

GQA_LAYOUTS = ("expand_kv", "pad_v")
# measured default (module docstring): expanding KV heads beats padding V by 13-16% at the GDLA shape
DEFAULT_GQA_LAYOUT = "expand_kv"

# FA4 4.0.0b36 ships SM90 (Hopper) and SM100 (Blackwell) kernels for the GDLA head dims (192 / 128)
SUPPORTED_MAJOR_CAPABILITIES = (9, 10)
_HALF_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def fa4_import_error() -> Optional[str]:
    """None when `flash_attn.cute` imports with the kernel functions the fa4 custom ops call, else why not (cached:
    the import is tried once per process)."""
    try:
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd  # noqa: F401
    except Exception as e:  # ImportError, or a CUDA / DSL initialisation error of the package
        return f"{type(e).__name__}: {e}"
    return None


def fa4_unavailable_reason(device) -> Optional[str]:
    """None when FA4 can run on `device`, else a one-line reason (no CUDA, unsupported GPU, not installed)."""
    return _unavailable_reason(torch.device(device))


@functools.cache
def _unavailable_reason(device: torch.device) -> Optional[str]:
    reason = _hardware_reason(device)
    if reason is not None:
        return reason
    error = fa4_import_error()
    if error is not None:
        return f"flash_attn.cute (pip install flash-attn-4==4.0.0b36) does not import: {error}"
    return None


def _hardware_reason(device: torch.device) -> Optional[str]:
    """Why `device` is not a GPU flash-attn-4 has kernels for (no CUDA, not SM90 / SM100), or None."""
    if device.type != "cuda":
        return f"flash-attn-4 needs a CUDA device, got {device.type}"
    if not torch.cuda.is_available():
        return "flash-attn-4 needs CUDA, which is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in SUPPORTED_MAJOR_CAPABILITIES:
        return f"flash-attn-4 has kernels for SM90 / SM100, this GPU is SM{major}{minor}"
    return None


def fa4_missing_reason(device) -> Optional[str]:
    """Why flash_attn.cute does not import, when `device` is a GPU it has kernels for (SM90 / SM100); else None
    (also when it imports). The case where backend auto quietly loses its fastest kernel."""
    return None if _hardware_reason(torch.device(device)) is not None else fa4_import_error()


def fa4_head_dims_problem(d_qk: int, d_v: int) -> Optional[str]:
    """None when FA4's kernels compile for these head dims (module docstring), else why not."""
    if d_qk == d_v or (d_qk >= 64 and d_v >= 64):
        return None
    return (
        f"flash-attn-4 4.0.0b36's backward does not compile for qk head dim {d_qk} with v head dim {d_v} (equal "
        f"head dims, or both >= 64, do)"
    )


def fa4_usable(device) -> bool:
    """Whether the fa4 backend can run on `device` (`fa4_unavailable_reason` is None; cached per device)."""
    return fa4_unavailable_reason(device) is None


def document_cu_seqlens(document_ids_BS: torch.Tensor) -> torch.Tensor:
    """cu_seqlens, int32 [N + 1], of the N contiguous documents of the B*S flattened tokens: a document starts at
    every row start and wherever the id changes within a row. N is data-dependent: on a device that is a host
    sync, so call it on the host's ids (the trainer's `forward_loss`), or once per forward outside compiled code
    (build_attention_metadata)."""
    B, S = document_ids_BS.shape
    flat = document_ids_BS.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::S] = True
    positions = torch.nonzero(starts).flatten()
    total = torch.tensor([B * S], device=flat.device, dtype=positions.dtype)
    return torch.cat([positions, total]).to(torch.int32)


def _check_inputs(q_BSHD: torch.Tensor, v_BSKE: torch.Tensor) -> None:
    reason = fa4_unavailable_reason(q_BSHD.device) or fa4_head_dims_problem(q_BSHD.shape[-1], v_BSKE.shape[-1])
    if reason is not None:
        raise RuntimeError(f"[kernels] attention = 'fa4': {reason}; use attention = 'auto' or 'flex'")
    if q_BSHD.dtype not in _HALF_DTYPES:
        raise RuntimeError(
            f"[kernels] attention = 'fa4' runs bf16 / fp16 only, got {q_BSHD.dtype}; set [training] "
            "mixed_precision_param = 'bfloat16' or use attention = 'sdpa'"
        )


def _layout_kv(k_BSKD, v_BSKE, n_heads: int, gqa_layout: str):
    """K/V in the layout FA4 can differentiate (module docstring): (k, v, the v head dim to slice back to, how many
    times the kernel call repeats each KV head: n_heads // n_kv for expand_kv, else 1)."""
    n_kv, d_qk, d_v = k_BSKD.shape[2], k_BSKD.shape[3], v_BSKE.shape[3]
    if n_kv == n_heads or d_qk == d_v:
        return k_BSKD, v_BSKE, d_v, 1
    if gqa_layout == "expand_kv":
        return k_BSKD, v_BSKE, d_v, n_heads // n_kv
    if gqa_layout == "pad_v":
        return k_BSKD, torch.nn.functional.pad(v_BSKE, (0, d_qk - d_v)), d_v, 1
    raise ValueError(f"unknown FA4 GQA layout {gqa_layout!r}; one of {GQA_LAYOUTS}")


def _sum_kv_copies(dx_THD: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The gradient of `masks.repeat_kv`: [..., n_kv * n_rep, D] summed back to [..., n_kv, D]."""
    return dx_THD if n_rep == 1 else dx_THD.unflatten(-2, (-1, n_rep)).sum(-2)


# FA4 4.0.0b36's BIN_BATCH_SEARCH_THRESH: a varlen call over more documents than this compiles other kernels
FA4_MANY_DOCUMENTS = 256

# Called as watcher(event, key) around every flash-attn-4 kernel call: event "start" before it, "done" after it, key
# the call's compile key (`kernel_key`). Set by the kernel prebuild (`fa4_prebuild`): its side process announces the
# calls; a training process waits for a kernel the side process is building. None: nothing watches (no cost).
_kernel_call_watcher: Optional[Callable[[str, str], None]] = None


def watch_kernel_calls(watcher: Optional[Callable[[str, str], None]]) -> Optional[Callable[[str, str], None]]:
    """Make `watcher` the function called around each flash-attn-4 kernel call (None: none); returns the one it
    replaces."""
    global _kernel_call_watcher
    previous, _kernel_call_watcher = _kernel_call_watcher, watcher
    return previous


@contextlib.contextmanager
def _watched_call(
    pass_: str, q: Tensor, kv_heads: int, d_v: int, cu_seqlens: Optional[Tensor], causal: bool
) -> Iterator[None]:
    """Around one kernel call: the watcher hears its start and end (the key is only computed when one listens)."""
    watcher = _kernel_call_watcher
    if watcher is None:
        yield
        return
    key = kernel_key(pass_, q, kv_heads, d_v, cu_seqlens, causal)
    watcher("start", key)
    yield
    watcher("done", key)


def kernel_key(pass_: str, q: Tensor, kv_heads: int, d_v: int, cu_seqlens: Optional[Tensor], causal: bool) -> str:
    """What tells flash-attn-4 4.0.0b36's kernels of one call apart (its compile keys, `flash_attn/cute/interface.py`,
    less the GPU, which the side process shares): the pass, dtype, query and (repeated) KV heads, head dims, causal
    or windowed (not the window's width), varlen, and more than `FA4_MANY_DOCUMENTS` documents. Token counts are not
    in it. The prebuild's side process and the training process name a kernel by it (`fa4_prebuild`)."""
    layout = "batched" if cu_seqlens is None else "varlen"
    if cu_seqlens is not None and cu_seqlens.numel() - 1 > FA4_MANY_DOCUMENTS:
        layout += f" over {FA4_MANY_DOCUMENTS} documents"
    heads = f"{q.shape[-2]}/{kv_heads} heads"
    dims = f"head dims {q.shape[-1]}/{d_v}"
    mask = "causal" if causal else "window"
    return f"{pass_} {str(q.dtype).removeprefix('torch.')} {heads} {dims} {mask} {layout}"


def _window_size(window: Optional[int]) -> tuple[Optional[int], Optional[int]]:
    """FA4's (left, right) for our window: None = causal over every earlier key, W = the W keys before and none
    after (W + 1 with the query's own)."""
    return (None, None) if window is None else (window, 0)


def _fa4_window(window_T: Tensor) -> tuple[bool, Optional[int], Optional[int]]:
    """(causal, left, right) of FA4's kernels for the tensor form of our window (`masks.window_tensor`)."""
    window = window_value(window_T)
    return (window is None, *_window_size(window))


# The keep slots' stored forward results (module docstring, "kept across a recompute"): slot -> (out, lse), from
# a layer's forward until the recompute of its block takes them back (the next forward of the layer replaces an
# entry its backward never took, e.g. after a failed step).
_KEPT: dict[int, tuple[Tensor, Tensor]] = {}
NO_KEEP = -1


def keep_slot_tensor(slot: Optional[int]) -> Tensor:
    """The CPU int64 scalar a layer passes as its keep slot (None: nothing kept). A tensor, read when the op runs,
    like the window (`masks.window_tensor`): an int would be a constant of the compiled graph, one graph per
    layer."""
    if slot is not None and slot < 0:
        raise ValueError(f"a keep slot is a non-negative layer index, got {slot}")
    return torch.tensor(NO_KEEP if slot is None else slot, dtype=torch.int64, device="cpu")


def kept_slots() -> list[int]:
    """The slots holding a forward result their recompute has not taken yet."""
    return sorted(_KEPT)


def _take_kept(slot: int, q: Tensor, v: Tensor) -> Optional[tuple[Tensor, Tensor]]:
    """The stored (out, lse) of `slot` when it fits this call (same batch of tokens: out's shape, dtype, device),
    removed from the store; None otherwise."""
    kept = _KEPT.pop(slot, None)
    if kept is None:
        return None
    out, _ = kept
    fits = out.shape == (*q.shape[:-1], v.shape[-1]) and out.dtype == q.dtype and out.device == q.device
    return kept if fits else None


# flash-attn-4's forward and backward kernel functions (`flash_attn.cute.interface`, the ones its own autograd
# Functions call) as the custom ops `llm_training::fa4_fwd` / `fa4_bwd`: torch.compile treats each as one opaque
# node, so a compiled block keeps attention inside its graph (no graph break, no dynamo trace into flash_attn.cute's
# Python), and the kernels run eagerly with the real tensors. K/V arrive with their KV heads. The forward kernel
# takes them as they are (FA4's forward does GQA at any head dims); `n_rep` is for the backward, which repeats them
# `n_rep` times for its kernel call only and sums dK/dV back over the copies (module docstring).
# cu_seqlens given: the varlen kernels over flattened [T, H, D] tokens. The window arrives as a CPU int64 scalar
# tensor (`masks.window_tensor`), read when the op runs: a compiled attention graph then serves full and sliding
# layers alike, where an int argument would be a constant of the graph, one graph per window. (No `from __future__
# import annotations` in this module: the op schemas are inferred from the annotations.) `keep_slot`, a CPU scalar
# too: the keep across a recompute (`keep_slot_tensor`).
@torch.library.custom_op("llm_training::fa4_fwd", mutates_args=())
def _fa4_fwd_op(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], max_seqlen: Optional[int], scale: float,
    window: Tensor, n_rep: int, keep_slot: Tensor,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    _check_inputs(q, v)
    slot = int(keep_slot)
    in_backward = torch._C._current_graph_task_id() != -1  # i.e. the recompute of a checkpointed block
    if slot != NO_KEEP and in_backward:
        kept = _take_kept(slot, q, v)
        if kept is not None:
            return kept
    from flash_attn.cute.interface import _flash_attn_fwd

    causal, left, right = _fa4_window(window)
    # a training process waits here for the kernel if the prebuild's side process is building it now
    with _watched_call("forward", q, k.shape[-2], v.shape[-1], cu_seqlens, causal):
        out, lse = _flash_attn_fwd(
            q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, softmax_scale=scale, causal=causal, softcap=0.0,
            window_size_left=left, window_size_right=right, return_lse=True,
        )[:2]  # fmt: skip
    out, lse = out.contiguous(), lse.contiguous()
    if slot != NO_KEEP and not in_backward:
        # a copy: the caller's graph owns `out` and may write a later intermediate into its buffer once `out` is
        # dead there (inductor reuses buffers), which must not reach the kept result
        _KEPT[slot] = (out.clone(), lse.clone())
    return out, lse


@_fa4_fwd_op.register_fake
def _fa4_fwd_fake(q, k, v, cu_seqlens, max_seqlen, scale, window, n_rep, keep_slot):
    """out [..., Hq, Dv] in q's dtype; lse fp32 [B, Hq, S], or [Hq, T] for varlen (FA4's layouts)."""
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse_shape = (q.shape[1], q.shape[0]) if cu_seqlens is not None else (q.shape[0], q.shape[2], q.shape[1])
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("llm_training::fa4_bwd", mutates_args=())
def _fa4_bwd_op(
    dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    cu_seqlens: Optional[Tensor], max_seqlen: Optional[int], scale: float, window: Tensor, n_rep: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    from flash_attn.cute.interface import _flash_attn_bwd

    causal, left, right = _fa4_window(window)
    with _watched_call("backward", q, k.shape[-2] * n_rep, v.shape[-1], cu_seqlens, causal):
        dq, dk, dv = _flash_attn_bwd(
            q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), out, dout, lse, scale, causal, 0.0,
            window_size_left=left, window_size_right=right, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, dlse=dlse,
        )[:3]  # fmt: skip
    return dq.contiguous(), _sum_kv_copies(dk, n_rep).contiguous(), _sum_kv_copies(dv, n_rep).contiguous()


@_fa4_bwd_op.register_fake
def _fa4_bwd_fake(dout, dlse, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, window, n_rep):
    return torch.empty_like(q, memory_format=torch.contiguous_format), k.new_empty(k.shape), v.new_empty(v.shape)


def _fa4_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, scale, window, n_rep, _ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.args = (max_seqlen, scale, window, n_rep)
    ctx.set_materialize_grads(False)  # an unused lse's gradient stays None: FA4's backward without the dlse term


def _fa4_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    dlse = None if dlse is None else dlse.contiguous()
    dq, dk, dv = _fa4_bwd_op(dout, dlse, q, k, v, out, lse, cu_seqlens, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_fa4_fwd_op.register_autograd(_fa4_backward, setup_context=_fa4_setup_context)


def _flash_attn(q, k, v, *, scale, window, cu_seqlens=None, max_seqlen=None, n_rep=1, keep_slot=None):
    """flash-attn-4's (out, lse) through `llm_training::fa4_fwd` (differentiable: `fa4_bwd`; module docstring,
    torch.compile). Before the custom ops, a torch.compiler.disable function broke each compiled block's graph here
    (9 breaks and 11 graphs for the compiled motif3_proxy_nomtp step on the H200, session 14); traced by dynamo
    instead, flash_attn.cute's Python had broken it 49 times (session 9). `keep_slot`: None or its tensor form
    (`keep_slot_tensor`)."""
    keep = keep_slot if isinstance(keep_slot, Tensor) else keep_slot_tensor(keep_slot)
    return _fa4_fwd_op(q, k, v, cu_seqlens, max_seqlen, float(scale), window_tensor(window), n_rep, keep)


def fa4_attention_lse(
    q_BSHD: torch.Tensor,
    k_BSKD: torch.Tensor,
    v_BSKE: torch.Tensor,
    *,
    scale: float,
    window,
    metadata,
    gqa_layout: str = DEFAULT_GQA_LAYOUT,
    keep_slot=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, S, Hq, Dv] in q's dtype, lse fp32 [B, Hq, S], natural log), both differentiable; the
    visibility of attention_backends (causal, window in either form of `masks.window_tensor`, metadata's documents
    via its cu_seqlens). `keep_slot` (an int, None or `keep_slot_tensor`'s form): the forward's result is kept
    for the recompute of a checkpointed block (module docstring)."""
    B, S, Hq, _ = q_BSHD.shape
    k, v, d_v, n_rep = _layout_kv(k_BSKD, v_BSKE, Hq, gqa_layout)
    if metadata.document_ids is None:
        out, lse = _flash_attn(q_BSHD, k, v, scale=scale, window=window, n_rep=n_rep, keep_slot=keep_slot)
    else:
        if metadata.cu_seqlens is None:
            raise RuntimeError(
                "attention_backend 'fa4' with documents needs the cu_seqlens of this forward's AttentionMetadata; "
                "build it with build_attention_metadata('fa4', document_ids, ...)"
            )
        out, lse = _flash_attn(
            q_BSHD.reshape(B * S, Hq, -1),
            k.reshape(B * S, k.shape[2], -1),
            v.reshape(B * S, v.shape[2], -1),
            scale=scale,
            window=window,
            cu_seqlens=metadata.cu_seqlens,
            max_seqlen=metadata.max_seqlen,
            n_rep=n_rep,
            keep_slot=keep_slot,
        )
        out = out.view(B, S, Hq, -1)
        lse = lse.view(Hq, B, S).transpose(0, 1)  # varlen lse is [Hq, total tokens]
    if out.shape[-1] != d_v:
        out = out[..., :d_v]
    return out, lse


def fa4_attention(q_BSHD, k_BSKD, v_BSKE, *, scale, window, metadata, record_max_logits, keep_slot=None):
    """The `fa4` backend kernel (attention_backends signature, + the keep slot of `fa4_attention_lse`)."""
    out, _ = fa4_attention_lse(
        q_BSHD, k_BSKD, v_BSKE, scale=scale, window=window, metadata=metadata, keep_slot=keep_slot
    )
    max_logits = None
    if record_max_logits:
        from llm_training.layers.attention.masks import attention_max_logits

        max_logits = attention_max_logits(
            q_BSHD, k_BSKD, scale=scale, window=window, document_ids=metadata.document_ids
        )
    return out, max_logits
