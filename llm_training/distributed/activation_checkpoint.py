"""Activation checkpointing of repeated blocks: `apply_ac(blocks, mode)`.

"full" recomputes a block's whole forward in backward; "selective" keeps the outputs of matmuls and attention
kernels (the expensive ops) and recomputes everything else (norms, PolyNorm, mHC Sinkhorn, routing arithmetic,
elementwise ops). "long_context" (64K-256K tokens per GPU) is "full" plus, inside each MoE layer, the routed
experts run over token chunks of LONG_CONTEXT_MOE_CHUNK_TOKENS, each checkpointed on its own: during a block's
backward only one chunk's routed rows, expert activations and fp32 combine buffers (which scale with
tokens x top-k, ~130 KB per token for motif3_small, most of a recomputed MoE block) exist, at the price of one
more forward of the routed experts. With `keep_full_attention` (the default of `[activation_checkpoint]`), its
full-attention layers also keep flash-attn-4's forward result (out, lse) for the block's recompute, which then
skips the quadratic kernel (layers/attention/fa4.py, "kept across a recompute"). The block's `forward` is wrapped
in place, so the module tree and parameter FQNs stay the same.
"""

from __future__ import annotations

import functools

from torch import nn

AC_MODES = ("none", "full", "selective", "long_context")
# tokens per routed-expert chunk in "long_context": big enough for efficient grouped GEMMs (16K tokens x top-8 =
# 128K rows, ~2K rows per expert at 64 experts), small enough to bound the routed buffers at 256K tokens
LONG_CONTEXT_MOE_CHUNK_TOKENS = 16384

# ops whose outputs "selective" activation checkpointing keeps (the expensive ones)
_SAVE_OPS = {
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default", "aten.linear.default",
    "aten._grouped_mm.default", "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default", "aten._flash_attention_forward.default",
    "aten._efficient_attention_forward.default",
    "llm_training.fa4_fwd.default",  # flash-attn-4 (layers/attention/fa4.py): out and lse
    "_c10d_functional.all_to_all_single.default",  # expert / Ulysses all-to-alls: not re-run in the backward
}  # fmt: skip


def _selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if str(op) in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpoint_block(block: nn.Module, mode: str) -> None:
    from torch.utils.checkpoint import checkpoint

    inner = block.forward
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = _selective_context

    @functools.wraps(inner)
    def forward(*args, **kw):
        return checkpoint(inner, *args, **kwargs, **kw)

    block.forward = forward


def apply_ac(blocks: list[nn.Module], mode: str, keep_full_attention: bool = False) -> None:
    """Wrap each block's forward for activation checkpointing in `mode` (one of AC_MODES; "none" does nothing).
    `keep_full_attention`: under "long_context", the full-attention layers keep their flash-attn-4 result for the
    recompute (module docstring); each gets its own slot."""
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode must be one of {AC_MODES}, got {mode!r}")
    if mode == "none":
        return
    slot = 0
    for block in blocks:
        _checkpoint_block(block, "full" if mode == "long_context" else mode)
        if mode != "long_context":
            continue
        for module in block.modules():
            if hasattr(module, "sequence_chunk_tokens"):  # layers/moe.py MoE
                module.sequence_chunk_tokens = LONG_CONTEXT_MOE_CHUNK_TOKENS
            full_attention = hasattr(module, "keep_output_across_recompute") and module.window is None
            if keep_full_attention and full_attention:  # layers/attention/gdla.py GDLAttention
                module.keep_output_across_recompute(slot)
                slot += 1
