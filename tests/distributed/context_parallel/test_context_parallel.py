"""Context parallelism: the plan and its validation, and on 2 and 4 gloo ranks the outputs, q/k/v gradients
and max_logits of Ulysses, ring and halo attention equal reference_attention on the full sequence, with
packed documents crossing the shard boundaries and windows reaching across them; a GDLA layer (lambda,
gate, differential combination) under both plans equals the single-process layer."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llm_training.distributed.context_parallel import (
    ContextParallelAttention,
    apply_context_parallel,
    check_context_parallel,
    plan_context_parallel,
)
from llm_training.distributed.context_parallel.block_attention import reference_block_attention
from llm_training.distributed.context_parallel.sharding import SequenceLayout, cp_shard
from llm_training.distributed.context_parallel.ring import ring_attention
from llm_training.layers.attention.backends import AttentionMetadata, reference_attention
from llm_training.motif import get_flavor
from llm_training.distributed.utils import destroy_process_group

DEBUG = get_flavor("motif3_debug")  # 10 q heads = 2 x [4 signal + 1 noise], 2 KV heads, window 16
WIDE = DEBUG.replace(num_attention_heads=20, num_key_value_heads=4, num_noise_heads=4)  # 4 x [4 + 1]
ATOL, RTOL = 2e-5, 1e-4  # fp32: the ring merges partial softmaxes, a different summation order


# ------------------------------------------------------------------------------------------ plan, validation
def test_ulysses_when_heads_allow_else_ring_with_halo():
    plan = plan_context_parallel(DEBUG, 2, "ulysses")
    assert (plan.full_attention, plan.sliding_attention, plan.layout.kind) == ("ulysses", "ulysses", "contiguous")
    plan = plan_context_parallel(DEBUG, 4, "ulysses")  # 2 KV heads cannot be split 4 ways
    assert (plan.full_attention, plan.sliding_attention, plan.layout.kind) == ("ring", "halo", "zigzag")
    assert "num_key_value_heads = 2" in plan.reason and "num_noise_heads = 2" in plan.reason
    plan = plan_context_parallel(DEBUG, 2, "ring")
    assert (plan.strategy(None), plan.strategy(16), plan.reason) == ("ring", "halo", "")


def test_check_rejects_what_cannot_run():
    assert check_context_parallel(DEBUG, 2, "ring", 64).layout.num_chunks == 4
    with pytest.raises(ValueError, match=r"seq_len = 66 is not divisible by 4 .*context_parallel_degree = 2"):
        check_context_parallel(DEBUG, 2, "ring", 66)
    with pytest.raises(ValueError, match=r"seq_len = 50 is not divisible by 4 .*Ulysses"):
        check_context_parallel(WIDE, 4, "ulysses", 50)
    with pytest.raises(ValueError, match=r"W = 16 .*sliding_window.* <= the chunk length .* = 8"):
        check_context_parallel(DEBUG, 4, "ulysses", 64)  # falls back to ring; chunks of 64 / 8
    with pytest.raises(ValueError, match="context_parallel_mode = 'stripes'"):
        check_context_parallel(DEBUG, 2, "stripes", 64)
    assert check_context_parallel(DEBUG, 1, "ring", 7).cp == 1  # nothing to split


# ------------------------------------------------------------------------------------------ multi-process
def _document_ids(B: int, S: int) -> torch.Tensor:
    """Packed documents whose boundaries fall off the chunk grid: with S = 16 x 2cp, documents cross every
    cp boundary, and some start less than W = 16 tokens after a chunk start (the halo sees two docs)."""
    starts = [[0, 3 * S // 16 + 1, 9 * S // 16 - 3, 12 * S // 16 + 2], [0, S // 2 - 5, S // 2 + 7]]
    positions = torch.arange(S)
    return torch.stack([(positions[:, None] >= torch.tensor(s)[None]).sum(1) - 1 for s in starts[:B]])


def _attention_case(group, rank, cp, args, strategy, window, packed, dtype=torch.float32):
    """One kernel-level comparison on this rank; raises with the case in the message. bf16: the same bf16
    inputs; outputs and gradients within a few bf16 ulps (both compute in fp32 and round once)."""
    B, S = 2, 32 * cp
    Hq, Hkv, D, E = args.num_attention_heads, args.num_key_value_heads, args.head_dim, args.v_head_dim
    gen = torch.Generator().manual_seed(1234)
    q, k, v = (torch.randn(B, S, h, d, generator=gen).to(dtype) for h, d in ((Hq, D), (Hkv, D), (Hkv, E)))
    weight = torch.randn(B, S, Hq, E, generator=gen)  # a loss that weighs every output element differently
    docs = _document_ids(B, S) if packed else None
    scale = D**-0.5

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    metadata = AttentionMetadata(document_ids=docs)  # the full sequence's, on every cp rank
    ref_out, ref_max = reference_attention(*full, scale=scale, window=window, metadata=metadata, record_max_logits=True)
    (ref_out * weight).sum().backward()

    layout = SequenceLayout("contiguous" if strategy == "ulysses" else "zigzag", cp)
    local = [cp_shard(t, layout, rank).requires_grad_() for t in (q, k, v)]
    kernel = ContextParallelAttention(reference_attention, strategy, layout, group)
    out, max_logits = kernel(*local, scale=scale, window=window, metadata=metadata, record_max_logits=True)
    (out * cp_shard(weight, layout, rank)).sum().backward()

    case = f"cp={cp} heads={Hq}/{Hkv} {strategy} window={window} packed={packed} {dtype} rank={rank}"
    atol, rtol = (ATOL, RTOL) if dtype == torch.float32 else (3e-2, 2e-2)
    assert out.dtype == dtype and all(t.grad.dtype == dtype for t in local), case
    torch.testing.assert_close(out, cp_shard(ref_out, layout, rank), atol=atol, rtol=rtol, msg=f"out {case}")
    for name, mine, ref in zip("qkv", local, full):
        torch.testing.assert_close(
            mine.grad, cp_shard(ref.grad, layout, rank), atol=atol, rtol=rtol, msg=f"d{name} {case}"
        )
    dist.all_reduce(max_logits, op=dist.ReduceOp.MAX, group=group)
    torch.testing.assert_close(max_logits, ref_max, atol=ATOL, rtol=RTOL, msg=f"max_logits {case}")


class _TwoLayers(torch.nn.Module):
    """A full and a sliding GDLA layer of the debug flavor, reference kernel."""

    def __init__(self, args):
        from llm_training.layers.attention.gdla import GDLAttention
        from llm_training.layers.attention.rope import build_rotary_embeddings

        super().__init__()
        full_rope, sliding_rope = build_rotary_embeddings(args)
        self.full = GDLAttention(args, sliding=False, softmax_scale=0.2, rope=full_rope, attention_backend="reference")
        self.sliding = GDLAttention(
            args, sliding=True, softmax_scale=0.2, rope=sliding_rope, attention_backend="reference"
        )
        torch.manual_seed(7)
        self.full.init_weights()
        self.sliding.init_weights()
        with torch.no_grad():  # lambda and gate start at zero: give them values so their shards matter
            for m in (self.full, self.sliding):
                m.lambda_proj.weight.normal_(0, 0.3)
                m.wq_b_gate.weight.normal_(0, 0.3)

    def forward(self, x, positions, docs):
        metadata = AttentionMetadata(document_ids=docs)
        return self.sliding(self.full(x, positions, metadata)[0], positions, metadata)[0]


def _layer_case(group, rank, cp, mode):
    """GDLA layers with lambda, gate and the differential combination on sequence shards equal the full run;
    parameter gradients summed over the cp ranks equal the single-process ones."""
    B, S = 2, 32 * cp
    docs = _document_ids(B, S)
    positions = torch.cat([torch.arange((docs[b] == d).sum()) for b in range(B) for d in docs[b].unique()]).view(B, S)
    x = torch.randn(B, S, DEBUG.hidden_size, generator=torch.Generator().manual_seed(3))
    reference = _TwoLayers(DEBUG)
    (reference(x, positions, docs) ** 2).sum().backward()

    plan = plan_context_parallel(DEBUG, cp, mode)
    model = _TwoLayers(DEBUG)
    apply_context_parallel(model, plan, group)
    layout = plan.layout
    out = model(cp_shard(x, layout, rank), cp_shard(positions, layout, rank), docs)
    (out**2).sum().backward()
    case = f"layers cp={cp} mode={mode} rank={rank}"
    torch.testing.assert_close(
        out, cp_shard(reference(x, positions, docs), layout, rank), atol=ATOL, rtol=RTOL, msg=case
    )
    for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
        dist.all_reduce(p.grad, group=group)
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-4, rtol=RTOL, msg=f"{name} {case}")


def _model_case(group, rank, cp, mode):
    """The motif3_debug trunk (mHC, dense + MoE, full + sliding layers) on cp_shard-ed input_ids and
    position_ids, with the full document_ids for attention, equals the single-process trunk; summed parameter gradients
    too. (MTP is left out: today's forward shifts input_ids itself, which needs the whole sequence.)"""
    from llm_training.motif.model import Motif3Model

    B, S = 1, 32 * cp
    docs = _document_ids(2, S)[:1]
    positions = torch.cat([torch.arange((docs[0] == d).sum()) for d in docs[0].unique()])[None]
    ids = torch.randint(0, DEBUG.vocab_size, (B, S), generator=torch.Generator().manual_seed(5))

    def build():
        torch.manual_seed(11)
        model = Motif3Model(DEBUG, attention_backend="reference")
        model.init_weights()
        return model

    reference = build()
    ref_hidden = reference(ids, position_ids=positions, document_ids=docs, return_hidden=True).hidden
    (ref_hidden**2).sum().backward()
    plan = plan_context_parallel(DEBUG, cp, mode)
    model = build()
    apply_context_parallel(model, plan, group)
    layout = plan.layout
    local_ids, local_positions = cp_shard(ids, layout, rank), cp_shard(positions, layout, rank)
    hidden = model(
        local_ids,
        position_ids=local_positions,
        document_ids=cp_shard(docs, layout, rank),
        return_hidden=True,
        attention_document_ids=docs,
    ).hidden
    (hidden**2).sum().backward()
    case = f"model cp={cp} mode={mode} rank={rank}"
    torch.testing.assert_close(hidden, cp_shard(ref_hidden, layout, rank), atol=1e-4, rtol=RTOL, msg=case)
    checked = 0
    for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
        if p_ref.grad is None:  # MTP
            continue
        dist.all_reduce(p.grad, group=group)
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-3, rtol=1e-3, msg=f"{name} {case}")
        checked += 1
    assert checked > 50, checked


def _moe_balance_loss_case(group, rank, cp, mode):
    """The sequence-wise balance loss of an MoE on sequence shards (apply_context_parallel installs the cp-group
    sum): the shards' losses add up to the single-sequence loss, and the router gradient summed over the cp
    ranks equals the single-process one (f from the whole sequence's counts, P split over the shards)."""
    from llm_training.layers.moe import MoE

    args = DEBUG.replace(router_aux_loss_coef=0.01)
    B, S = 2, 32 * cp
    x = torch.randn(B, S, args.hidden_size, generator=torch.Generator().manual_seed(9))

    def build():
        torch.manual_seed(13)
        moe = MoE(args)
        moe.init_weights(0.02)
        return moe

    reference = build()
    _, ref_stats = reference(x)
    ref_stats.balance_loss.backward()
    moe = build()
    plan = plan_context_parallel(DEBUG, cp, mode)
    split = apply_context_parallel(moe, plan, group)
    _, stats = moe(split.shard(x))
    stats.balance_loss.backward()
    total = stats.balance_loss.detach().clone()
    dist.all_reduce(total, group=group)
    case = f"balance loss cp={cp} mode={mode} rank={rank}"
    torch.testing.assert_close(total, ref_stats.balance_loss.detach(), atol=1e-7, rtol=1e-5, msg=case)
    grad = moe.router.gate.weight.grad.clone()
    dist.all_reduce(grad, group=group)
    torch.testing.assert_close(grad, reference.router.gate.weight.grad, atol=1e-7, rtol=1e-4, msg=case)


def _balance_case(group, rank, cp):
    """Zigzag + causal skipping: every rank computes the same 2 cp + 1 block pairs (3 at the diagonal step,
    of which 2 half-masked, then 2 per step), instead of 1..2cp-1 blocks for a contiguous split."""
    calls = []

    def counting_kernel(*args, **kwargs):
        calls.append((kwargs["queries"].start, kwargs["keys"].start))
        return reference_block_attention(*args, **kwargs)

    layout = SequenceLayout("zigzag", cp)
    q, k, v = torch.randn(1, 4, 2, 3), torch.randn(1, 4, 1, 3), torch.randn(1, 4, 1, 2)
    ring_attention(
        q,
        k,
        v,
        scale=1.0,
        document_ids=None,
        record_max_logits=False,
        layout=layout,
        group=group,
        block_kernel=counting_kernel,
    )
    assert len(calls) == 2 * cp + 1, (rank, calls)
    assert all(key <= query for query, key in calls), (rank, calls)


def _worker(rank, cp, port, cases):
    torch.set_num_threads(1)  # spawned ranks do not run the root conftest
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp, timeout=datetime.timedelta(seconds=60))
    try:
        for case in cases:
            if case[0] == "layers":
                _layer_case(dist.group.WORLD, rank, cp, case[1])
            elif case[0] == "model":
                _model_case(dist.group.WORLD, rank, cp, case[1])
            elif case[0] == "moe_balance_loss":
                _moe_balance_loss_case(dist.group.WORLD, rank, cp, case[1])
            elif case[0] == "balance":
                _balance_case(dist.group.WORLD, rank, cp)
            else:
                _attention_case(dist.group.WORLD, rank, cp, *case)
    finally:
        destroy_process_group()


def _cases(ulysses_args, sliding_window):
    cases = []
    for packed in (True, False):
        cases += [
            (ulysses_args, "ulysses", None, packed),
            (ulysses_args, "ulysses", sliding_window, packed),
            (DEBUG, "ring", None, packed),
            (DEBUG, "halo", sliding_window, packed),
        ]
    return cases


def test_two_ranks_equal_the_full_sequence(free_port):
    bf16 = [(DEBUG, strategy, window, True, torch.bfloat16) for strategy, window in (("ring", None), ("halo", 16))]
    cases = _cases(DEBUG, DEBUG.sliding_window) + bf16 + [("layers", "ulysses"), ("layers", "ring"), ("balance",)]
    cases += [(WIDE, "ulysses", None, True), (WIDE, "ulysses", 16, True)]  # 2 KV heads (2 groups) per rank
    cases += [("model", "ulysses"), ("model", "ring"), ("moe_balance_loss", "ulysses"), ("moe_balance_loss", "ring")]
    mp.spawn(_worker, args=(2, free_port, cases), nprocs=2, join=True)


def test_four_ranks_equal_the_full_sequence(free_port):
    # Ulysses at cp 4 needs 4 KV heads (WIDE); W = 16 = the zigzag chunk length at S = 128 (halo = one chunk)
    cases = _cases(WIDE, DEBUG.sliding_window) + [(DEBUG, "halo", 5, True), ("layers", "ulysses"), ("balance",)]
    mp.spawn(_worker, args=(4, free_port, cases), nprocs=4, join=True)


def test_ulysses_hands_the_keep_slot_to_its_kernel_and_ring_keeps_nothing():
    """flash-attn-4's keep slot (long_context keep_full_attention) reaches the kernel Ulysses wraps, which then
    runs the full sequence for this rank's heads; ring attention takes the argument and keeps nothing (one process
    playing rank 0 of 2 over the fake backend: shapes and arguments only)."""
    from llm_training.dry_run import fake_process_group
    from llm_training.layers.attention.fa4 import keep_slot_tensor

    seen = []

    def kernel(q, k, v, *, scale, window, metadata, record_max_logits, **options):
        seen.append((q.shape, options))
        return q.new_zeros(*q.shape[:-1], v.shape[-1]), None

    slot = keep_slot_tensor(3)
    q, k, v = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8), torch.randn(1, 8, 2, 4)
    with fake_process_group(0, 2):
        group = dist.group.WORLD
        meta = AttentionMetadata(document_ids=None)
        kw = dict(scale=1.0, window=None, metadata=meta, record_max_logits=False)
        ulysses = ContextParallelAttention(kernel, "ulysses", SequenceLayout("contiguous", 2), group)
        out, _ = ulysses(q, k, v, **kw, keep_slot=slot)
        assert out.shape == (1, 8, 4, 4)
        ulysses(q, k, v, **kw)
        assert seen == [((1, 16, 2, 8), {"keep_slot": slot}), ((1, 16, 2, 8), {})]
        ring = ContextParallelAttention(kernel, "ring", SequenceLayout("zigzag", 2), group)
        ring(q, k, v, **kw, keep_slot=slot)  # accepted; ring attention runs its own block kernel
        assert len(seen) == 2
