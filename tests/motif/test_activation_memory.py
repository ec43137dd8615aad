"""The activation estimate of motif/activation_memory.py: each block kind's formula against the storages a real
bf16 CPU forward saves for backward, and the activation-checkpointing modes."""

from __future__ import annotations

import torch

from llm_training.distributed.activation_checkpoint import LONG_CONTEXT_MOE_CHUNK_TOKENS
from llm_training.layers.attention.gdla import GDLAttention
from llm_training.layers.attention.backends import reference_attention
from llm_training.motif import get_flavor
from llm_training.motif.activation_memory import estimate_activation_memory, mtp_block_terms, trunk_block_terms
from llm_training.motif.model import Motif3Model
from llm_training.motif.state_dict_adapter import is_fp32_key
from llm_training.saved_tensors import saved_bytes


class _FusedKernelSaves(torch.autograd.Function):
    """Attention whose saved set is a fused (flash-style) kernel's: q, k, v, the output, fp32 log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, scale, window, metadata):
        out, _ = reference_attention(q, k, v, scale=scale, window=window, metadata=metadata, record_max_logits=False)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, torch.empty(q.shape[0], q.shape[2], q.shape[1]))
        return out


def _fused_kernel(q, k, v, *, scale, window, metadata, record_max_logits):
    """As the fa4 backend saves for its backward: the KV-head K/V (it repeats them for its kernel calls only)."""
    return _FusedKernelSaves.apply(q, k, v, scale, window, metadata), None


def module_saved_bytes(model: torch.nn.Module, module: torch.nn.Module, *args) -> int:
    """Bytes autograd saves for backward during `module(*args)`, `model`'s parameters excluded."""
    return saved_bytes(lambda: module(*args), exclude=model.parameters())[1]


def test_activation_formula_matches_what_a_bf16_forward_saves():
    """Each block kind's estimate (AC none) within 3% of the storages a real bf16 CPU forward keeps (the small
    per-token terms the formula leaves out: norm rstd, rotary tables)."""
    a = get_flavor("motif3_debug")
    torch.manual_seed(0)
    model = Motif3Model(a, attention_backend="reference")
    model.init_weights()
    for module in model.modules():
        if isinstance(module, GDLAttention):
            module.kernel = _fused_kernel
    model.to(torch.bfloat16)
    for name, p in model.named_parameters():
        if is_fp32_key(name):
            p.data = p.data.float()  # as under FSDP2: the fp32 parameters stay fp32
    B, S, H, n = 2, 256, a.hidden_size, a.mhc_expansion_rate
    pos = torch.arange(S).expand(B, S)
    cases = {
        "dense layer": (model.layers[0], trunk_block_terms(a, moe=False), (torch.randn(B, S, n, H),)),
        "MoE layer": (model.layers[2], trunk_block_terms(a, moe=True), (torch.randn(B, S, n, H),)),
        "MTP module": (model.mtp_layers[0], mtp_block_terms(a), (torch.randn(B, S, H), torch.randn(B, S, H))),
    }
    for kind, (block, terms, inputs) in cases.items():
        inputs = [x.to(torch.bfloat16).requires_grad_() for x in inputs]
        got = module_saved_bytes(model, block, *inputs, pos, None)
        estimate = B * S * terms.all.bytes(2)
        assert abs(estimate - got) <= 0.03 * got, (kind, estimate, got)
    # the routed-expert share (what long_context AC holds for one chunk only): with the routed experts in
    # checkpointed chunks the MoE block saves all but it
    block, terms, inputs = cases["MoE layer"]
    block.moe.sequence_chunk_tokens = 64
    got = module_saved_bytes(model, block, *[x.to(torch.bfloat16).requires_grad_() for x in inputs], pos, None)
    estimate = B * S * (terms.all.bytes(2) - terms.routed.bytes(2))
    assert terms.routed.bytes(2) > 0.3 * terms.all.bytes(2) and abs(estimate - got) <= 0.03 * got, (estimate, got)


def test_activation_checkpoint_modes():
    """full keeps each block's input ([B, S, n, H] bf16 with mHC) and recomputes one block; selective in between."""
    a, tokens = get_flavor("motif3_debug"), 2048
    est = {m: estimate_activation_memory(a, tokens, m, torch.bfloat16) for m in ("none", "selective", "full")}
    assert est["full"].block_bytes == {
        "dense layer": (2, tokens * 4 * 64 * 2),
        "MoE layer": (4, tokens * 4 * 64 * 2),
        "MTP module": (1, tokens * 64 * 2),  # its embedding input
    }
    moe_all = tokens * trunk_block_terms(a, moe=True).all.bytes(2)
    assert est["none"].block_bytes["MoE layer"] == (4, moe_all) and est["none"].recompute_bytes == 0
    assert est["full"].recompute_bytes == moe_all - tokens * 4 * 64 * 2  # the largest block, its input kept
    assert est["none"].saved_bytes > est["selective"].saved_bytes > est["full"].saved_bytes
    assert est["full"].outside_blocks_bytes == tokens * 2 * 64 * 2  # final norm input + final hidden


def test_long_context_mode_bounds_the_routed_recomputation():
    """long_context keeps what full keeps; its one-block recomputation holds the routed-expert terms for one
    chunk only, so it grows slower with tokens than full's."""
    a = get_flavor("motif3_small")
    tokens = 8 * LONG_CONTEXT_MOE_CHUNK_TOKENS
    full = estimate_activation_memory(a, tokens, "full", torch.bfloat16)
    long = estimate_activation_memory(a, tokens, "long_context", torch.bfloat16)
    moe = trunk_block_terms(a, moe=True)
    assert long.block_bytes == full.block_bytes
    saved_by_chunking = (tokens - LONG_CONTEXT_MOE_CHUNK_TOKENS) * moe.routed.bytes(2)
    dense, mtp = trunk_block_terms(a, moe=False), mtp_block_terms(a)
    moe_chunked = tokens * (moe.all.bytes(2) - moe.input.bytes(2)) - saved_by_chunking
    others = [tokens * (t.all.bytes(2) - t.input.bytes(2)) for t in (dense, mtp)]  # recomputed whole
    assert long.recompute_bytes == max(moe_chunked, *others)
    # chunking takes 7/8 of the routed terms (8 chunks) off an MoE block's recomputation (about half of it: the
    # routed terms are ~56% of an MoE block); the largest block recomputed whole (here the MTP module) then bounds
    # the mode, still about half of full's
    assert moe_chunked < 0.55 * tokens * (moe.all.bytes(2) - moe.input.bytes(2))
    assert long.recompute_bytes < 0.55 * full.recompute_bytes
    short = LONG_CONTEXT_MOE_CHUNK_TOKENS // 2  # below one chunk: the same as full
    assert (
        estimate_activation_memory(a, short, "long_context", torch.bfloat16).recompute_bytes
        == estimate_activation_memory(a, short, "full", torch.bfloat16).recompute_bytes
    )


def test_long_context_counts_the_kept_full_attention_outputs():
    """With keep_full_attention, each full-attention trunk layer keeps its kernel's output (n_h * d_v bf16) and
    log-sum-exp (n_h fp32) per token until its backward: motif3_small, 16 layers of which 4 full, 20 heads, d_v
    128, at 131072 tokens: 4 x 131072 x (20 * 128 * 2 + 20 * 4) bytes = 2.5 GiB more kept, the recompute
    unchanged; other modes ignore the switch."""
    a = get_flavor("motif3_small")
    tokens = 131072
    plain = estimate_activation_memory(a, tokens, "long_context", torch.bfloat16)
    kept = estimate_activation_memory(a, tokens, "long_context", torch.bfloat16, keep_full_attention=True)
    assert kept.block_bytes["kept full attention"] == (4, tokens * (20 * 128 * 2 + 20 * 4))
    assert kept.saved_bytes - plain.saved_bytes == 4 * tokens * 5200
    assert kept.recompute_bytes == plain.recompute_bytes
    full = estimate_activation_memory(a, tokens, "full", torch.bfloat16)
    assert estimate_activation_memory(a, tokens, "full", torch.bfloat16, keep_full_attention=True) == full
