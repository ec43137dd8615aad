"""distributed/fsdp.py on one gloo CPU rank: `reduce_on_compute_stream` moves FSDP2's gradient reduction onto the
compute stream and leaves the gradients as they were."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from llm_training.distributed import ParallelDims
from llm_training.distributed.fsdp import REDUCE_STREAMS, apply_fsdp, reduce_on_compute_stream
from llm_training.distributed.utils import destroy_process_group


def _grads(mesh, on_compute_stream: bool):
    """Gradients of a two-block FSDP2 model over `mesh` after one forward + backward, and its comm context."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    apply_fsdp(model, [model[0], model[2]], mesh, MixedPrecisionPolicy(), [])
    if on_compute_stream:
        reduce_on_compute_stream(model)
    torch.manual_seed(1)
    model(torch.randn(5, 16)).square().sum().backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    return grads, model._get_fsdp_state()._comm_ctx


def test_reduction_runs_on_the_compute_stream_with_the_same_gradients():
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank, as on one GPU
    dims.build_mesh("cpu")
    try:
        mesh = dims.world_mesh["dp_shard_cp"]
        side, side_ctx = _grads(mesh, on_compute_stream=False)
        compute, ctx = _grads(mesh, on_compute_stream=True)
        current = ctx.device_handle.current_stream()
        assert all(getattr(ctx, name) == current for name in REDUCE_STREAMS)
        assert side_ctx.reduce_scatter_stream != side_ctx.device_handle.current_stream()  # FSDP2's own side stream
        assert ctx.all_gather_stream != current  # the parameter gathers keep theirs
        assert side.keys() == compute.keys() and all(torch.equal(side[n], compute[n]) for n in side)
    finally:
        destroy_process_group()


def test_a_model_past_its_first_forward_moves_at_once():
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dims.build_mesh("cpu")
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        apply_fsdp(model, [model[0]], dims.world_mesh["dp_shard_cp"], MixedPrecisionPolicy(), [])
        model(torch.randn(2, 4)).sum().backward()
        ctx = model._get_fsdp_state()._comm_ctx
        assert ctx.reduce_scatter_stream != ctx.device_handle.current_stream()
        reduce_on_compute_stream(model)
        assert all(getattr(ctx, name) == ctx.device_handle.current_stream() for name in REDUCE_STREAMS)
        model(torch.randn(2, 4)).sum().backward()  # and the next step runs
    finally:
        destroy_process_group()


def test_a_model_without_fsdp2_is_refused_by_name():
    with pytest.raises(ValueError, match="Linear is not an FSDP2 module"):
        reduce_on_compute_stream(nn.Linear(2, 2))
