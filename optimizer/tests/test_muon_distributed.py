"""Distributed Muon on 2 and 4 gloo CPU ranks with FSDP2 (`fully_shard`) parameters vs single-process Muon.

One spawn per world size runs every case (spawning dominates the cost): row-sharded 2-D matrices with
uneven shards (13 rows, and 3 rows on 4 ranks => one empty shard; same-shape and transposed matrices that
an owner orthogonalises in one batch; a 2-D row-split matrix) go through the owner all-to-all path;
expert stacks sharded on the expert dim (uneven, 3 experts on 4 ranks) and a row-split gate_up stack take the
local path. NS runs in fp32 and the all-to-all in fp32, so each owner orthogonalises exactly the matrix the
single process sees: the results agree to fp32 rounding (atol 1e-6 after 3 steps).
"""

import os

import pytest
import torch
import torch._dynamo  # noqa: F401 - fully_shard imports it lazily (~200 modules); load once before forking
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

import optimizer  # noqa: F401 - imported in the parent so forked ranks start warm

SHAPES = {
    "w_a": (13, 10),
    "w_b": (3, 8),
    "w_c": (16, 24),
    "w_d": (9, 9),
    "w_a_again": (13, 10),  # same shape as w_a, and w_a_wide transposed: one batched NS per owner
    "w_a_wide": (10, 13),
    "w_split": (10, 8),  # 2-D with row_split 2: on 4 ranks the 3-row shards straddle the two blocks
    "experts": (3, 10, 6),
    "gate_up": (5, 8, 6),
}
ROW_SPLIT = {"gate_up": 2, "w_split": 2}
STEPS = 3


def _init_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}


def _grads(step):
    gen = torch.Generator().manual_seed(100 + step)
    return {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}


def _muon(params_by_name, **kw):
    from optimizer import Muon

    groups = [
        {"params": [p for k, p in params_by_name.items() if ROW_SPLIT.get(k, 1) == 1]},
        {"params": [p for k, p in params_by_name.items() if ROW_SPLIT.get(k, 1) == 2], "row_split": 2},
    ]
    return Muon(groups, lr=0.03, weight_decay=0.1, ns_dtype=torch.float32, **kw)


class _Holder(nn.Module):
    def __init__(self, init):
        super().__init__()
        for k, v in init.items():
            self.register_parameter(k, nn.Parameter(v.clone()))


def _worker(rank, world, port, expected):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = _Holder(_init_params())
        fully_shard(model, mesh=mesh)
        params = dict(model.named_parameters())
        opt = _muon(params, comm_dtype=torch.float32)
        for step in range(STEPS):
            for k, g in _grads(step).items():
                params[k].grad = distribute_tensor(g, mesh, [Shard(0)])
            opt.step()
        for k, p in params.items():
            torch.testing.assert_close(p.full_tensor(), expected[k], rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")
            buf = opt.state[p]["momentum_buffer"]
            assert type(buf).__name__ == "DTensor" and buf.placements == p.placements, k
        # bf16 all-to-all (the CUDA default) runs and stays close (bf16 rounding of the NS input/output)
        opt_bf16 = _muon(params, comm_dtype=torch.bfloat16)
        before = {k: p.full_tensor() for k, p in params.items()}
        for k, g in _grads(0).items():
            params[k].grad = distribute_tensor(g, mesh, [Shard(0)])
        opt_bf16.step()
        assert all(torch.isfinite(p.full_tensor()).all() for p in params.values())
        assert any((params[k].full_tensor() - before[k]).abs().max() > 0 for k in params)
    finally:
        dist.destroy_process_group()


def _single_process_result() -> dict[str, torch.Tensor]:
    """The reference: the same steps with plain tensors in one process (local NS of each full matrix)."""
    params = {k: v.clone().requires_grad_() for k, v in _init_params().items()}
    opt = _muon(params)
    for step in range(STEPS):
        for k, g in _grads(step).items():
            params[k].grad = g
        opt.step()
    return {k: p.detach() for k, p in params.items()}


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_muon_matches_single_process(world, free_port):
    expected = _single_process_result()
    # fork (CPU only, no CUDA touched): ranks inherit the imported modules, so the test takes seconds
    mp.start_processes(_worker, args=(world, free_port, expected), nprocs=world, join=True, start_method="fork")


def _state_dict_worker(rank, world, port):
    """OptimizersContainer on an FSDP2 model: the flat state dict holds DTensor momentum with the parameter's
    placement (what DCP saves sharded), and loading it into a fresh container resumes identically."""
    import copy

    from optimizer import GroupRule, build_optimizers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (world,))
        init = _init_params()
        init["norm"] = torch.ones(7)
        init["norm_sharded"] = torch.ones(6)
        rules = [
            GroupRule(r"^gate_up$", "muon", expert=True, row_split=2),
            GroupRule(r"^experts$", "muon", expert=True),
            GroupRule(r"^w_", "muon"),
            GroupRule(r"^norm", "adamw_no_decay"),
        ]
        models, opts = [], []
        for _ in range(2):
            model = _Holder(init)
            # `norm` stays a plain replicated tensor (like the model's fp32 params): AdamW must not mix it
            # with DTensors in one foreach call
            fully_shard(model, mesh=mesh, ignored_params={model.norm})
            models.append(model)
            opts.append(build_optimizers(model, rules, lr=0.01, weight_decay=0.1, ns_dtype=torch.float32, log=None))

        def step(model, opt, seed):
            grads = _grads(seed)
            grads["norm"] = torch.full((7,), 0.5)
            grads["norm_sharded"] = torch.full((6,), 0.25)
            for k, p in model.named_parameters():
                p.grad = distribute_tensor(grads[k], mesh, [Shard(0)]) if k != "norm" else grads[k]
            opt.step()

        for seed in range(2):
            step(models[0], opts[0], seed)
        sd = opts[0].state_dict()
        buf = sd["state.w_a.momentum_buffer"]
        assert type(buf).__name__ == "DTensor" and buf.placements == (Shard(0),)
        assert "state.norm.exp_avg" in sd and sd["param_groups.gate_up.row_split"] == 2
        assert type(sd["state.norm.exp_avg"]).__name__ == "Tensor"
        with torch.no_grad():
            for a, b in zip(models[0].parameters(), models[1].parameters()):
                b.copy_(a)
        opts[1].load_state_dict(copy.deepcopy(sd))
        for model, opt in zip(models, opts):
            step(model, opt, 7)
        for (k, a), b in zip(models[0].named_parameters(), models[1].parameters()):
            if k == "norm":
                assert not torch.equal(a, torch.ones(7))  # AdamW did step it
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            else:
                torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
    finally:
        dist.destroy_process_group()


def test_fsdp2_optimizer_state_dict_round_trip(free_port):
    mp.start_processes(_state_dict_worker, args=(2, free_port), nprocs=2, join=True, start_method="fork")


def _hsdp_worker(rank, world, port, expected):
    """HSDP layout: 2 replicas x 2 shards, placements (Replicate(), Shard(0)); the owner pipeline runs inside
    each shard group and both replicas end with the single-process result."""
    from torch.distributed.tensor import Replicate

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        placements = [Replicate(), Shard(0)]
        params = {k: nn.Parameter(distribute_tensor(v, mesh, placements)) for k, v in _init_params().items()}
        opt = _muon(params, comm_dtype=torch.float32)
        for step in range(STEPS):
            for k, g in _grads(step).items():
                params[k].grad = distribute_tensor(g, mesh, placements)
            opt.step()
        for k, p in params.items():
            torch.testing.assert_close(p.full_tensor(), expected[k], rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")
    finally:
        dist.destroy_process_group()


def test_hsdp_muon_matches_single_process(free_port):
    expected = _single_process_result()
    mp.start_processes(_hsdp_worker, args=(4, free_port, expected), nprocs=4, join=True, start_method="fork")


def _strided_experts_worker(rank, world, port):
    """Expert stack under expert parallel + FSDP2: placements (_StridedShard(0), Shard(0)) on an (ep, dp) mesh;
    each rank holds two whole experts. Muon orthogonalises them locally: no collective runs (all-to-all is
    patched to fail) and each rank's experts get exactly the single-process update of those experts."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from optimizer import Muon

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ep", "dp"))
        placements = (_StridedShard(0, split_factor=world // 2), Shard(0))
        full_w = torch.randn(2 * world, 10, 6, generator=torch.Generator().manual_seed(11))
        full_grads = [torch.randn(2 * world, 10, 6, generator=torch.Generator().manual_seed(12 + s)) for s in range(2)]
        mine = slice(2 * rank, 2 * rank + 2)  # which experts this rank holds does not matter to Muon

        def as_dtensor(t):
            return DTensor.from_local(
                t[mine].clone(), mesh, placements, run_check=False, shape=t.shape, stride=t.stride()
            )

        p = nn.Parameter(as_dtensor(full_w))
        ref = full_w.clone().requires_grad_()
        opt, ref_opt = Muon([p], lr=0.03, ns_dtype=torch.float32), Muon([ref], lr=0.03, ns_dtype=torch.float32)

        def no_collective(*args, **kwargs):
            raise AssertionError("expert stacks sharded on dim 0 must not communicate")

        dist.all_to_all_single = no_collective
        for g in full_grads:
            p.grad, ref.grad = as_dtensor(g), g.clone()
            opt.step()
            ref_opt.step()
        torch.testing.assert_close(p.to_local(), ref.detach()[mine], rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


def test_strided_shard_expert_stack_is_local(free_port):
    mp.start_processes(_strided_experts_worker, args=(4, free_port), nprocs=4, join=True, start_method="fork")
