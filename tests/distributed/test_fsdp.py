"""distributed/fsdp.py on one gloo CPU rank: `reduce_on_compute_stream` moves FSDP2's gradient reduction onto the
compute stream and leaves the gradients as they were; `apply_fsdp` gathers the input embedding for its forward only."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from llm_training.distributed import ParallelDims
from llm_training.distributed.fsdp import REDUCE_STREAMS, apply_fsdp, reduce_on_compute_stream
from llm_training.distributed.utils import destroy_process_group


@pytest.fixture
def one_rank_mesh():
    """The FSDP mesh of one rank, as on one GPU (gloo here)."""
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dims.build_mesh("cpu")
    yield dims.world_mesh["dp_shard_cp"]
    destroy_process_group()


def _fsdp_model(mesh) -> nn.Module:
    """Two FSDP2 groups (the first linear, then the root) over `mesh`, seeded."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    apply_fsdp(model, [model[0]], mesh, MixedPrecisionPolicy(), [])
    return model


def _step(model) -> dict:
    torch.manual_seed(1)
    model(torch.randn(5, 16)).square().sum().backward()
    return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}


def _on_compute_stream(ctx) -> bool:
    return all(getattr(ctx, name) == ctx.device_handle.current_stream() for name in REDUCE_STREAMS)


def test_reduction_runs_on_the_compute_stream_with_the_same_gradients(one_rank_mesh):
    side_model = _fsdp_model(one_rank_mesh)
    side = _step(side_model)
    assert not _on_compute_stream(side_model._get_fsdp_state()._comm_ctx)  # FSDP2's own side streams
    model = _fsdp_model(one_rank_mesh)
    reduce_on_compute_stream(model)  # before the first forward: applied at FSDP2's lazy init
    compute = _step(model)
    ctx = model._get_fsdp_state()._comm_ctx
    assert _on_compute_stream(ctx) and ctx.all_gather_stream != ctx.device_handle.current_stream()
    assert side.keys() == compute.keys() and all(torch.equal(side[n], compute[n]) for n in side)


def test_a_model_past_its_first_forward_moves_at_once(one_rank_mesh):
    model = _fsdp_model(one_rank_mesh)
    first = _step(model)
    reduce_on_compute_stream(model)
    assert _on_compute_stream(model._get_fsdp_state()._comm_ctx)
    model.zero_grad(set_to_none=True)
    assert all(torch.equal(first[n], g) for n, g in _step(model).items())  # the next step runs, same gradients


def test_a_model_without_fsdp2_is_refused_by_name():
    with pytest.raises(ValueError, match="Linear is not an FSDP2 module"):
        reduce_on_compute_stream(nn.Linear(2, 2))


class _Embedded(nn.Module):
    """An input embedding, then a linear head: the embedding's backward needs only the ids."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_the_embedding_is_gathered_for_its_forward_only(one_rank_mesh, monkeypatch):
    """apply_fsdp's embedding group is gathered (an all-gather, or over one rank the cast into the compute dtype) for
    its forward only, not for its backward, with the gradients of the same model without FSDP2."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    torch.manual_seed(0)
    plain = _Embedded()
    model = _Embedded()
    model.load_state_dict(plain.state_dict())
    apply_fsdp(model, [], one_rank_mesh, MixedPrecisionPolicy(), [], embedding=model.embed)
    gathered = []
    real_to_unsharded = FSDPParam.to_unsharded

    def counting_to_unsharded(self):
        gathered.append(self._param_fqn)
        return real_to_unsharded(self)

    monkeypatch.setattr(FSDPParam, "to_unsharded", counting_to_unsharded)
    ids = torch.tensor([[1, 4, 4, 9], [0, 2, 7, 4]])
    model(ids).square().sum().backward()
    plain(ids).square().sum().backward()
    assert gathered.count("embed.weight") == 1, gathered
    assert torch.equal(model.embed.weight.grad.full_tensor(), plain.embed.weight.grad)
    assert torch.equal(model.head.weight.grad.full_tensor(), plain.head.weight.grad)


def test_one_rank_reduction_divides_nothing(one_rank_mesh):
    """Over one rank the summed gradient is the gradient: FSDP2's reduction copies it, with no division (given a
    divide factor it would divide into a temporary of the group's size), and the gradients are the plain model's."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    model = _fsdp_model(one_rank_mesh)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        grads = _step(model)
    names = {e.name for e in prof.events()}
    assert any(name.startswith("FSDP::post_backward_reduce") for name in names), sorted(names)
    assert not {"aten::div", "aten::div_"} & names
    torch.manual_seed(1)
    plain(torch.randn(5, 16)).square().sum().backward()
    assert all(torch.equal(grads[n], p.grad) for n, p in plain.named_parameters())


def test_one_gpu_setup_bf16_deferred_reduction_matches_plain_fp32(one_rank_mesh):
    """The one-GPU training setup on gloo: bf16 parameters, fp32 reduction, the embedding resharded after its
    forward and not gathered for its backward, the root kept gathered, gradients reduced at the last of three
    micro-batches only. The summed gradients match the fp32 model's to bf16 rounding: weights, activations and each
    micro-batch's gradient are rounded to bf16 (2^-8 relative each, compounding over about four roundings per path
    and three micro-batches), bounded here by 8 x 2^-8 = 3e-2 of the largest gradient."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    plain = _Embedded()
    model = _Embedded()
    model.load_state_dict(plain.state_dict())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    apply_fsdp(model, [], one_rank_mesh, mp, [], embedding=model.embed)
    model.set_reshard_after_forward(False)
    model.embed.set_reshard_after_forward(True, recurse=False)
    g = torch.Generator().manual_seed(2)
    micro_batches = [torch.randint(0, 10, (2, 6), generator=g) for _ in range(3)]
    for k, ids in enumerate(micro_batches):
        last = k == len(micro_batches) - 1
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
        model(ids).float().square().sum().backward()
        plain(ids).square().sum().backward()
    for name, p in plain.named_parameters():
        got = model.get_parameter(name).grad
        assert got.dtype == torch.float32, name
        torch.testing.assert_close(got.full_tensor(), p.grad, rtol=3e-2, atol=3e-2 * p.grad.abs().max().item())
