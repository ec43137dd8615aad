"""llm_training.layers.embedding: the lookup as nn.Embedding by default; with `accumulate_grad_in_place`, rows in the
compute dtype and the micro-batches' gradients added into the table's fp32 `.grad` by the backward itself."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from llm_training.layers.embedding import Embedding

V, H = 50, 16


def _tables(seed: int = 0) -> tuple[Embedding, nn.Embedding]:
    torch.manual_seed(seed)
    ours, ref = Embedding(V, H), nn.Embedding(V, H)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def _micro_batches(device="cpu") -> list[torch.Tensor]:
    """Three micro-batches of ids with repeats inside each and across them (token 7 in all three)."""
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, V, (2, 24), generator=g) for _ in range(3)]
    for x in ids:
        x[0, :3] = 7
    return [x.to(device) for x in ids]


def _upstream(ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(ids.sum()))
    return torch.randn(*ids.shape, H, generator=g).to(device=ids.device, dtype=dtype)


def test_default_is_nn_embedding():
    """Same parameter name, rows and gradient as nn.Embedding (autograd's own path)."""
    ours, ref = _tables()
    assert list(ours.state_dict()) == ["weight"]
    ids = _micro_batches()[0]
    up = _upstream(ids, torch.float32)
    (ours(ids) * up).sum().backward()
    (ref(ids) * up).sum().backward()
    assert torch.equal(ours(ids), ref(ids))
    assert torch.equal(ours.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("output_dtype", [None, torch.bfloat16])
def test_grad_in_place_sums_the_micro_batches_into_the_fp32_grad(output_dtype):
    """Three micro-batches: the rows come in `output_dtype` (the table's when None), and `.grad` ends up the sum of
    autograd's per-micro-batch gradients of the same rows (fp32, the upstream gradients cast back to fp32 as the
    cast's backward does): equal to fp32 summation order, the rows of one token summed in another order (at most 6
    terms of size ~1 here: |difference| <= 6 * 2^-24 * 6 ~ 2e-6; bound 1e-5)."""
    ours, ref = _tables()
    ours.accumulate_grad_in_place(output_dtype)
    dtype = output_dtype or torch.float32
    for ids in _micro_batches():
        up = _upstream(ids, dtype)
        rows = ours(ids)
        assert rows.dtype == dtype and torch.equal(rows, ref(ids).to(dtype))
        (rows.float() * up.float()).sum().backward()
        (ref(ids).to(dtype).float() * up.float()).sum().backward()
    assert ours.weight.grad.dtype == torch.float32
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=0, atol=1e-5)
    untouched = torch.ones(V, dtype=torch.bool)
    for ids in _micro_batches():
        untouched[ids.reshape(-1)] = False
    assert untouched.any() and not ours.weight.grad[untouched].any()


def test_grad_in_place_adds_to_a_kept_grad_and_starts_anew_after_zero_grad():
    """`zero_grad(set_to_none=False)` keeps the buffer (added into, not replaced); set to None, the next backward
    makes a zero one."""
    ours, ref = _tables()
    ours.accumulate_grad_in_place(None)
    ids = _micro_batches()[0]
    ours.weight.grad = torch.full_like(ours.weight, 0.5)
    kept = ours.weight.grad
    ours(ids).sum().backward()
    ref(ids).sum().backward()
    assert ours.weight.grad is kept
    torch.testing.assert_close(kept, ref.weight.grad + 0.5, rtol=0, atol=1e-6)
    ours.weight.grad = None
    ours(ids).sum().backward()
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=0, atol=1e-6)


def test_no_grad_lookup_leaves_the_grad_alone():
    ours, _ = _tables()
    ours.accumulate_grad_in_place(torch.bfloat16)
    with torch.no_grad():
        rows = ours(_micro_batches()[0])
    assert rows.dtype == torch.bfloat16 and not rows.requires_grad and ours.weight.grad is None


def test_grad_in_place_refuses_a_dtensor_table():
    """A table FSDP2 / DTensor holds gets its gradient through autograd: turning the in-place path on names why."""
    from torch.distributed.tensor import DeviceMesh, distribute_tensor

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ours, _ = _tables()
        mesh = DeviceMesh("cpu", [0])
        ours.weight = nn.Parameter(distribute_tensor(ours.weight.detach(), mesh))
        with pytest.raises(TypeError, match="plain tensor table, got DTensor"):
            ours.accumulate_grad_in_place(torch.bfloat16)
        assert not ours.grad_in_place
    finally:
        if created:
            dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grad_in_place_on_cuda_is_deterministic_and_matches_autograd():
    """On CUDA `index_put_(accumulate=True)` sorts the ids (no atomics): two identical runs give bitwise equal
    gradients, which match autograd's to fp32 summation order (bound as in the CPU test)."""
    grads = []
    for _ in range(2):
        ours, ref = _tables()
        ours, ref = ours.cuda(), ref.cuda()
        ours.accumulate_grad_in_place(torch.bfloat16)
        for ids in _micro_batches("cuda"):
            up = _upstream(ids, torch.bfloat16)
            (ours(ids).float() * up.float()).sum().backward()
            (ref(ids).to(torch.bfloat16).float() * up.float()).sum().backward()
        torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=0, atol=1e-5)
        grads.append(ours.weight.grad)
    assert torch.equal(grads[0], grads[1])
