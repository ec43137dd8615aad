"""distributed/activation_checkpoint.py: under long_context, full-attention layers keep flash-attn-4's forward
result for their block's recompute (emulated kernel on the CPU), eager and compiled in pieces as training runs
them."""

import copy
import functools
import sys

import pytest
import torch

from llm_training.distributed.activation_checkpoint import apply_ac
from llm_training.distributed.compile import compile_in_pieces, compile_stats, reset_compile_stats
from llm_training.layers.attention import fa4
from llm_training.motif import get_flavor, is_sliding_layer
from llm_training.motif.model import Motif3Model
from llm_training.motif.parallelize import block_kind, blocks
from tests.fa4_emulation import install_emulated_fa4

# 6 layers (0 and 4 full attention, the rest sliding; 0-1 dense, 2-5 MoE) and one MTP module (sliding)
ARGS = get_flavor("motif3_debug")
N_FULL = sum(not is_sliding_layer(i, ARGS) for i in range(ARGS.num_hidden_layers))
N_ATTENTION = ARGS.num_hidden_layers + ARGS.num_nextn_predict_layers


def _count_forward_launches(monkeypatch, interface) -> list:
    """Wrap flash-attn-4's forward kernel function in `interface` (its `flash_attn.cute.interface`, real or
    emulated); returns the list each launch appends its left window to. The wrapper shares the function's
    attributes: flash-attn-4 reads its compile cache from them."""
    calls = []
    inner = interface._flash_attn_fwd

    @functools.wraps(inner)
    def counted(*args, **kwargs):
        calls.append(kwargs["window_size_left"])
        return inner(*args, **kwargs)

    monkeypatch.setattr(interface, "_flash_attn_fwd", counted)
    return calls


@pytest.fixture
def forward_kernel_calls(monkeypatch):
    """The emulated flash-attn-4, with a count of its forward kernel's launches."""
    install_emulated_fa4(monkeypatch)
    yield _count_forward_launches(monkeypatch, sys.modules["flash_attn.cute.interface"])
    fa4._KEPT.clear()


def _models(compiled: bool):
    """(recomputes everything, keeps full attention): long_context checkpointing of the same weights."""
    torch.manual_seed(0)
    recompute = Motif3Model(ARGS, attention_backend="fa4")
    recompute.init_weights()
    keep = copy.deepcopy(recompute)
    if compiled:  # as parallelize_motif compiles long_context blocks: in pieces, the checkpoint outside dynamo
        reset_compile_stats()
        for model in (recompute, keep):
            compile_in_pieces(blocks(model), block_kind, backend="aot_eager")
    apply_ac(blocks(recompute), "long_context")
    apply_ac(blocks(keep), "long_context", keep_full_attention=True)
    return recompute, keep


def _step(model, ids, calls):
    """Forward + backward of a logits loss; returns (launches of the forward kernel, logits)."""
    calls.clear()
    out = model(ids)
    out.logits.float().logsumexp(-1).mean().backward()
    return len(calls), out.logits.detach()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled_in_pieces"])
def test_long_context_keeps_full_attention_across_the_recompute(forward_kernel_calls, compiled):
    """An attention layer's forward kernel runs twice per step under long_context (forward, recompute), a
    full-attention layer's once when it keeps: same logits and gradients bit for bit (the kept result is what the
    recompute would compute), each layer its own slot, nothing left kept after the backward."""
    recompute, keep = _models(compiled)
    assert [int(m.keep_slot) for m in keep.modules() if hasattr(m, "keep_slot")] == [0, -1, -1, -1, 1, -1, -1]
    ids = torch.randint(0, ARGS.vocab_size, (2, 32))
    n_recompute, logits_recompute = _step(recompute, ids, forward_kernel_calls)
    n_keep, logits_keep = _step(keep, ids, forward_kernel_calls)
    # the forward runs every layer's kernel, the backward recomputes the trunk's (the loss reads no MTP output)
    assert n_recompute == N_ATTENTION + ARGS.num_hidden_layers and n_keep == n_recompute - N_FULL
    assert fa4.kept_slots() == []
    assert torch.equal(logits_keep, logits_recompute)
    for (name, p_keep), (_, p_ref) in zip(keep.named_parameters(), recompute.named_parameters(), strict=True):
        assert (p_keep.grad is None) == (p_ref.grad is None), name
        if p_ref.grad is not None:
            assert torch.equal(p_keep.grad, p_ref.grad), name
    if compiled:
        stats = compile_stats()
        assert stats["unique_graphs"] > 0 and not any("fa4" in r for r in stats["graph_break_reasons"]), stats


def test_forwards_without_grad_keep_nothing_and_a_stale_result_is_not_taken(forward_kernel_calls):
    """An evaluation forward (no grad: no recompute will come) keeps nothing. A kept result whose backward never
    ran (a failed step) is replaced by the layer's next forward, so the recompute takes that forward's own result
    and the gradients equal those of a model that recomputes."""
    recompute, keep = _models(compiled=False)
    ids = torch.randint(0, ARGS.vocab_size, (2, 32))
    with torch.no_grad():
        keep(ids)
    assert fa4.kept_slots() == []
    keep(torch.randint(0, ARGS.vocab_size, (2, 16)))  # a forward whose backward never runs
    assert fa4.kept_slots() == list(range(N_FULL))
    _step(recompute, ids, forward_kernel_calls)
    _step(keep, ids, forward_kernel_calls)
    assert fa4.kept_slots() == []
    for (name, p_keep), (_, p_ref) in zip(keep.named_parameters(), recompute.named_parameters(), strict=True):
        if p_ref.grad is not None:
            assert torch.equal(p_keep.grad, p_ref.grad), name


def test_other_modes_keep_nothing():
    """keep_full_attention applies to long_context only (full and selective checkpointing keep no slot)."""
    for mode in ("full", "selective"):
        model = Motif3Model(ARGS, attention_backend="fa4")
        apply_ac(blocks(model), mode, keep_full_attention=True)
        assert all(int(m.keep_slot) == fa4.NO_KEEP for m in model.modules() if hasattr(m, "keep_slot"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_long_context_keeps_full_attention_on_cuda(monkeypatch):
    """The compiled test above on the GPU path: real flash-attn-4, inductor, bf16, blocks compiled in pieces. The
    kept model launches the forward kernel once less per full-attention layer and gives the recomputing model's
    logits bit for bit (same compiled graphs, and the kept result is the forward's own); the gradients agree up
    to flash-attn-4's backward, which accumulates dQ with atomics in a run-dependent order: fp32 differences that
    flip some bf16 gradients by one rounding (2^-9 relative), so the whole vector within 1e-2."""
    reason = fa4.fa4_unavailable_reason("cuda")
    if reason is not None:
        pytest.skip(reason)
    import flash_attn.cute.interface as interface

    calls = _count_forward_launches(monkeypatch, interface)
    args = ARGS.replace(head_dim=96, qk_rope_head_dim=32, v_head_dim=64)  # head dims FA4's SM90 backward compiles
    torch.manual_seed(0)
    recompute = Motif3Model(args, attention_backend="fa4")
    recompute.init_weights()
    recompute = recompute.to(device="cuda", dtype=torch.bfloat16)
    keep = copy.deepcopy(recompute)
    for model, kept in ((recompute, False), (keep, True)):
        compile_in_pieces(blocks(model), block_kind)
        apply_ac(blocks(model), "long_context", keep_full_attention=kept)
    ids = torch.randint(0, args.vocab_size, (2, 256), device="cuda")
    n_recompute, logits_recompute = _step(recompute, ids, calls)
    n_keep, logits_keep = _step(keep, ids, calls)
    fa4._KEPT.clear()
    assert n_recompute == N_ATTENTION + args.num_hidden_layers and n_keep == n_recompute - N_FULL
    assert torch.equal(logits_keep, logits_recompute)
    grads = [
        torch.cat([p.grad.float().flatten() for p in m.parameters() if p.grad is not None]) for m in (keep, recompute)
    ]
    assert ((grads[0] - grads[1]).norm() / grads[1].norm()).item() < 1e-2
