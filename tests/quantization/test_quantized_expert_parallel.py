"""Converted experts under expert parallelism (2 gloo ranks): the EP MoE with low-precision experts (their
stacks DTensor Shard(0) on the ep mesh, the quantized grouped GEMM on each rank's local experts) equals one
process running the same converted MoE over the union of the tokens, output and gradients, also under
activation checkpointing. The received rows of an expert arrive in the union's order (source rank, then token),
so even the per-group scales along the tokens (wgrad) see the same rows: fp32 roundoff only."""

from __future__ import annotations

import copy
import datetime
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from llm_training.distributed.utils import destroy_process_group

WORLD, BATCH_PER_RANK, SEQ = 2, 2, 8
TOL = {"atol": 2e-5, "rtol": 2e-5}


def _check(rank, mesh, recipe, checkpointed):
    from llm_training.distributed.expert_parallel import apply_expert_parallel
    from llm_training.layers.moe import MoE
    from llm_training.motif import get_flavor
    from llm_training.quantization.kernels import RecipeKernels
    from llm_training.quantization.modules import LowPrecisionGroupedExperts, to_low_precision

    args = get_flavor("motif3_debug")
    torch.manual_seed(0)
    reference = MoE(args)
    reference.init_weights(0.3)
    to_low_precision(reference.experts, RecipeKernels(recipe, hp_weight_grad=False, cuda=False))
    moe = copy.deepcopy(reference)
    plan = apply_expert_parallel(moe, mesh)
    assert isinstance(moe.experts, LowPrecisionGroupedExperts)

    gen = torch.Generator().manual_seed(1)
    x_all = torch.randn(WORLD * BATCH_PER_RANK, SEQ, args.hidden_size, generator=gen)
    g_all = torch.randn(WORLD * BATCH_PER_RANK, SEQ, args.hidden_size, generator=gen)
    mine = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)

    def run(module, x, g, ckpt):
        x = x.clone().requires_grad_(True)
        out, _ = torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False) if ckpt else module(x)
        (out * g).sum().backward()
        return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}

    out_ref, dx_ref, grads_ref = run(reference, x_all, g_all, False)
    out, dx, grads = run(moe, x_all[mine], g_all[mine], checkpointed)
    torch.testing.assert_close(out, out_ref[mine], **TOL)
    torch.testing.assert_close(dx, dx_ref[mine], **TOL)
    L = args.num_experts // WORLD
    for name in plan.expert_param_names:
        want = grads_ref[name][rank * L : (rank + 1) * L]
        torch.testing.assert_close(grads[name].to_local(), want, **TOL, msg=name)
    assert grads["experts.gate_up_proj"].to_local().abs().sum() > 0


def _worker(rank, port):
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
        for recipe, checkpointed in (("fp8_rowwise", False), ("mxfp8", True)):
            _check(rank, mesh, recipe, checkpointed)
    finally:
        destroy_process_group()


def test_converted_experts_under_expert_parallel_equal_one_process(free_port):
    mp.spawn(_worker, args=(free_port,), nprocs=WORLD, join=True)
