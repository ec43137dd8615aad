"""Expert parallelism: the row permutation and dispatcher selection on one process; on 2 and 4 gloo ranks
the counts exchange, and an EP MoE (motif3_debug: 16 experts top-4, each rank its own tokens) against one
process running the same MoE over the union of the tokens: outputs and the gradients of the input,
router, shared expert, expert stacks and grouped PolyNorm, with natural (uneven) routing and with every
token routed to the experts of rank 0 (the other ranks receive nothing), and under activation
checkpointing; on 4 ranks EP 2 x FSDP2 2 on the experts (FSDP2 4 on the rest), a Muon step, and a DCP
checkpoint of that layout loaded on one process.

Tolerances: float64 (per-expert loop path) 1e-10 absolute/relative (the summation order of the gradients
differs), except the balance loss and the gradients of the router gate and the PolyNorm weights, which the
model computes in fp32 whatever its dtype: 2e-5 like every float32 check (torch._grouped_mm path)."""

from __future__ import annotations

import copy
import datetime
import importlib.util
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llm_training.config import ConfigError
from llm_training.distributed.expert_parallel import (
    check_dispatcher_available,
    exchange_counts,
    inverse_permutation,
    source_to_expert_order,
)
from llm_training.distributed.utils import destroy_process_group

BATCH_PER_RANK, SEQ = 2, 5
TOLERANCES = {torch.float64: {"atol": 1e-10, "rtol": 1e-10}, torch.float32: {"atol": 2e-5, "rtol": 2e-5}}
FP32_MATH = ("router.gate.", "act_fn.")  # parameters the model computes with in fp32 whatever its dtype


def _tolerance(param_name: str, dtype: torch.dtype) -> dict:
    return TOLERANCES[torch.float32 if any(p in param_name for p in FP32_MATH) else dtype]


def test_received_rows_are_regrouped_by_local_expert_then_source_rank():
    counts_PL = torch.tensor([[2, 0, 1, 3], [0, 0, 4, 1], [1, 2, 0, 0]])  # [source rank, local expert]
    labels = [(s, l, j) for s in range(3) for l in range(4) for j in range(int(counts_PL[s, l]))]
    index = source_to_expert_order(counts_PL, len(labels))
    assert [labels[i] for i in index.tolist()] == sorted(labels, key=lambda t: (t[1], t[0], t[2]))
    x = torch.randn(len(labels), 3)
    assert torch.equal(x[index][inverse_permutation(index)], x)


def test_dispatcher_names_are_checked():
    check_dispatcher_available("all_to_all")
    with pytest.raises(ConfigError, match=r"expert_parallel_dispatcher must be one of \['all_to_all', 'deepep'\]"):
        check_dispatcher_available("nccl")
    if importlib.util.find_spec("deep_ep") is None:
        with pytest.raises(ConfigError, match="needs DeepEP, which cannot be imported here"):
            check_dispatcher_available("deepep")


def _reference_moe(args, dtype):
    from llm_training.layers.moe import MoE

    torch.manual_seed(0)
    moe = MoE(args)
    moe.init_weights(0.3)
    with torch.no_grad():
        moe.experts.act_fn.weight.normal_()
        moe.experts.act_fn.bias.uniform_(-1.0, 1.0)  # some beyond the +-0.5 clamp
        moe.expert_bias.normal_(0, 0.05)
    return moe.to(dtype)


def _run(moe, x_BSH, grad_out_BSH, balance_weight, checkpointed=False):
    """Forward (optionally under non-reentrant activation checkpointing: the EP all-to-alls then run again
    in the backward's recompute), backward of sum(out * grad_out) + balance_weight * balance loss."""
    x = x_BSH.clone().requires_grad_(True)
    out, stats = torch.utils.checkpoint.checkpoint(moe, x, use_reentrant=False) if checkpointed else moe(x)
    ((out * grad_out_BSH).sum() + balance_weight * stats.balance_loss).backward()
    grads = {n: p.grad for n, p in moe.named_parameters()}
    return out.detach(), x.grad, grads, stats


def _check_counts_exchange(rank, world, group):
    E = 16
    L = E // world
    send = torch.arange(E) + 100 * rank  # rows this rank sends to global expert e
    recv = exchange_counts(send, group)
    want = torch.tensor([[100 * s + rank * L + l for l in range(L)] for s in range(world)])
    assert torch.equal(recv, want), (recv, want)


def _check_against_single_process(rank, world, group, mesh, dtype, bias_to_rank0, checkpointed):
    from torch.distributed.tensor import DTensor, Shard

    from llm_training.distributed.expert_parallel import apply_expert_parallel
    from llm_training.motif import get_flavor

    args = get_flavor("motif3_debug").replace(router_aux_loss_coef=0.01)
    L, H = args.num_experts // world, args.hidden_size
    reference = _reference_moe(args, dtype)
    if bias_to_rank0:
        with torch.no_grad():
            reference.expert_bias[:L] += 10.0  # every token picks experts of rank 0 only (top-4 <= L)
    reference.experts.use_grouped_mm = dtype == torch.float32
    moe = copy.deepcopy(reference)
    plan = apply_expert_parallel(moe, group if bias_to_rank0 else mesh)  # a process group works too
    assert plan.expert_param_names == [
        "experts.gate_up_proj",
        "experts.down_proj",
        "experts.act_fn.weight",
        "experts.act_fn.bias",
    ]
    for name in plan.expert_param_names:
        p = moe.get_parameter(name)
        assert isinstance(p, DTensor) and p.placements == (Shard(0),) and p.to_local().shape[0] == L
        assert torch.equal(p.full_tensor(), reference.get_parameter(name).detach()), name

    gen = torch.Generator().manual_seed(1)
    x_all = torch.randn(world * BATCH_PER_RANK, SEQ, H, generator=gen).to(dtype)
    g_all = torch.randn(world * BATCH_PER_RANK, SEQ, H, generator=gen).to(dtype)
    mine = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    # union loss = sum(out * g) + balance (a mean over all sequences) = sum over ranks of the local losses
    # with the balance term divided by the number of ranks
    out_ref, dx_ref, grads_ref, stats_ref = _run(reference, x_all, g_all, 1.0)
    out, dx, grads, stats = _run(moe, x_all[mine], g_all[mine], 1.0 / world, checkpointed)

    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out, out_ref[mine], **tol)
    torch.testing.assert_close(dx, dx_ref[mine], **tol)
    # counts before dispatch over all E experts: their SUM over ranks is the union's (the expert-bias input)
    counts_RE = [torch.empty_like(stats.tokens_per_expert) for _ in range(world)]
    dist.all_gather(counts_RE, stats.tokens_per_expert, group=group)
    counts_RE = torch.stack(counts_RE)
    torch.testing.assert_close(counts_RE.sum(0), stats_ref.tokens_per_expert, rtol=0, atol=0)
    if bias_to_rank0:
        assert counts_RE[:, L:].sum() == 0  # ranks > 0 receive no rows at all
    else:
        assert (counts_RE == 0).any() and (counts_RE.sum(0) > 0).all()  # uneven: some expert idle on some rank
    balance = stats.balance_loss.detach().clone()
    dist.all_reduce(balance, group=group)
    torch.testing.assert_close(balance / world, stats_ref.balance_loss, **TOLERANCES[torch.float32])  # fp32 scores
    for name, grad in grads.items():
        if name in plan.expert_param_names:  # the reverse all-to-all already summed every rank's tokens
            want = grads_ref[name][rank * L : (rank + 1) * L]
            torch.testing.assert_close(grad.to_local(), want, **_tolerance(name, dtype), msg=name)
        else:  # router, shared expert: each rank holds the gradient of its own tokens
            summed = grad.clone()
            dist.all_reduce(summed, group=group)
            torch.testing.assert_close(summed, grads_ref[name], **_tolerance(name, dtype), msg=name)
    assert grads["experts.gate_up_proj"].to_local().abs().sum() > 0 or (bias_to_rank0 and rank > 0)


def _check_expert_count_must_divide(world, mesh):
    from llm_training.distributed.expert_parallel import apply_expert_parallel
    from llm_training.layers.moe import MoE
    from llm_training.motif import get_flavor

    moe = MoE(get_flavor("motif3_debug").replace(num_experts=2 * world + 1, experts_top_k=2))
    with pytest.raises(
        ConfigError, match=rf"expert_parallel_degree = {world} must divide num_experts = {2 * world + 1}"
    ):
        apply_expert_parallel(moe, mesh)


def _worker(rank, world, port):
    from torch.distributed.device_mesh import init_device_mesh

    from llm_training.distributed import ParallelDims
    from llm_training.distributed.expert_parallel import expert_grad_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        group = mesh.get_group()
        _check_counts_exchange(rank, world, group)
        for dtype, bias_to_rank0, checkpointed in (
            (torch.float64, False, False),
            (torch.float64, True, False),
            (torch.float32, False, True),
        ):
            _check_against_single_process(rank, world, group, mesh, dtype, bias_to_rank0, checkpointed)
        _check_expert_count_must_divide(world, mesh)
        dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=world, world_size=world)
        dims.build_mesh("cpu")
        assert expert_grad_mesh(dims).size() == 1  # one EP group holds every expert once: nothing to sum
    finally:
        destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_moe_equals_single_process(world, free_port):
    mp.spawn(_worker, args=(world, free_port), nprocs=world, join=True)


def _fsdp_worker(rank, world, port, checkpoint):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    from llm_training.distributed import ParallelDims
    from llm_training.distributed.expert_parallel import apply_expert_parallel, expert_grad_mesh, sum_expert_grads
    from llm_training.motif import get_flavor
    from optimizer import Muon

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=2, world_size=world)
        dims.build_mesh("cpu")
        args = get_flavor("motif3_debug").replace(router_aux_loss_coef=0.01)
        L, H = args.num_experts // dims.ep, args.hidden_size
        reference = _reference_moe(args, torch.float32)
        moe = copy.deepcopy(reference)
        plan = apply_expert_parallel(moe, dims.ep_mesh["ep"])
        grad_mesh = expert_grad_mesh(dims)  # dp_shard_mod_ep: ranks {0, 2} and {1, 3} hold the same experts
        assert grad_mesh.mesh.tolist() == [rank % 2, rank % 2 + 2] and dims.ep_mesh["ep"].mesh.tolist() == [
            rank // 2 * 2,
            rank // 2 * 2 + 1,
        ]
        # as motif/parallelize.py does: fp32 parameters stay outside FSDP2, their grads summed separately
        fp32_names = [n for n, _ in moe.named_parameters() if any(p in n for p in FP32_MATH)]
        expert_fp32 = [n for n in fp32_names if n in plan.expert_param_names]
        ignored = {moe.get_parameter(n) for n in fp32_names}
        fully_shard(moe.experts, mesh=grad_mesh, ignored_params=ignored & set(moe.experts.parameters()))
        fully_shard(moe, mesh=dims.world_mesh["dp_shard_cp"], ignored_params=ignored)
        for module in (moe, moe.experts):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)

        gen = torch.Generator().manual_seed(1)
        x_all = torch.randn(world * BATCH_PER_RANK, SEQ, H, generator=gen)
        g_all = torch.randn(world * BATCH_PER_RANK, SEQ, H, generator=gen)
        mine = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
        out_ref, _, grads_ref, _ = _run(reference, x_all, g_all, 1.0)
        out, _, _, _ = _run(moe, x_all[mine], g_all[mine], 1.0 / world)
        sum_expert_grads(moe, expert_fp32, grad_mesh)
        for name in fp32_names:
            if name not in expert_fp32:  # replicated plain tensors: summed over every data rank
                dist.all_reduce(moe.get_parameter(name).grad)
        tol = TOLERANCES[torch.float32]
        torch.testing.assert_close(out, out_ref[mine], **tol)
        for name, p in moe.named_parameters():
            grad = p.grad.full_tensor() if name in plan.expert_param_names or name not in fp32_names else p.grad
            torch.testing.assert_close(grad, grads_ref[name], **tol, msg=name)

        dcp.save(moe.state_dict(), checkpoint_id=checkpoint)  # global shapes, loaded on one process below

        # Muon on the EP x FSDP2 expert stacks (whole experts on every rank): the same step as on one process
        stacks = ["experts.gate_up_proj", "experts.down_proj"]
        for model in (reference, moe):
            Muon([model.get_parameter(n) for n in stacks], lr=0.05, weight_decay=0.1).step()
        for name in stacks:
            full = moe.get_parameter(name).full_tensor()
            torch.testing.assert_close(full, reference.get_parameter(name).detach(), **tol, msg=name)
        assert moe.get_parameter(stacks[0]).to_local().shape[0] == L // grad_mesh.size()
    finally:
        destroy_process_group()


def test_fsdp2_over_expert_parallel_and_muon_equal_single_process(free_port, tmp_path):
    """4 ranks: EP 2 x FSDP2 2 (dp_shard_mod_ep) on the experts, FSDP2 4 on the rest; the DCP checkpoint
    they save loads into a one-process MoE with the single-process weights."""
    import torch.distributed.checkpoint as dcp

    from llm_training.layers.moe import MoE
    from llm_training.motif import get_flavor

    checkpoint = str(tmp_path / "ckpt")
    mp.spawn(_fsdp_worker, args=(4, free_port, checkpoint), nprocs=4, join=True)
    args = get_flavor("motif3_debug").replace(router_aux_loss_coef=0.01)
    loaded = MoE(args)
    torch.manual_seed(5)
    loaded.init_weights(0.1)
    state = loaded.state_dict()
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)  # a one-process load
    loaded.load_state_dict(state)
    reference = _reference_moe(args, torch.float32).state_dict()
    assert state.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0, msg=name)
