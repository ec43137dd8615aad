"""layers/mhc/sinkhorn.py: the fused Triton kernels (run by the Triton interpreter on the CPU, TRITON_INTERPRET=1, or
on CUDA) match the reference projection and its autograd gradient, including clamped logits and n = 3 (padded to
the next power of two); the reference is what every CPU path runs."""

import pytest
import torch

from llm_training.layers.mhc import sinkhorn as S
from tests.triton_kernels import HAS_TRITON, KERNEL_DEVICE, needs_triton_kernels


def test_only_fp32_cuda_inputs_take_the_kernels():
    z = torch.randn(5, 4, 4)
    assert not S.uses_kernels(z) and not S.uses_kernels(z.double())
    if torch.cuda.is_available():
        assert S.uses_kernels(z.cuda()) == HAS_TRITON and not S.uses_kernels(z.cuda().double())


@pytest.mark.gpu
@needs_triton_kernels
@pytest.mark.parametrize("n,iters", [(4, 20), (3, 5), (4, 1)])
def test_kernels_match_the_reference_and_its_gradient(n, iters):
    device = KERNEL_DEVICE
    torch.manual_seed(0)
    T = 150  # not a multiple of the kernels' 64-token block
    z = torch.randn(T, n, n, device=device) * 3
    z[0, 0, 0], z[1, 1, 0] = 30.0, -30.0  # outside the +-20 clamp: no gradient there
    g = torch.randn(T, n, n, device=device)
    z_ref = z.double().cpu().requires_grad_()
    want = S.sinkhorn_reference(z_ref, iters)
    want.backward(g.double().cpu())
    z_k = z.clone().requires_grad_()
    got = S._sinkhorn_op(z_k, iters)
    got.backward(g)
    torch.testing.assert_close(got.double().cpu(), want.detach(), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(z_k.grad.double().cpu(), z_ref.grad, atol=1e-5, rtol=1e-4)
    assert z_k.grad[0, 0, 0] == 0 and z_k.grad[1, 1, 0] == 0


@pytest.mark.gpu
@needs_triton_kernels
def test_kernel_op_traces_as_one_opaque_node_under_torch_compile():
    device = KERNEL_DEVICE
    torch.manual_seed(0)
    z0 = torch.randn(70, 4, 4, device=device)

    def f(z):
        return (S._sinkhorn_op(z * 2.0, 20) ** 2).sum()

    grads = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        z = z0.clone().requires_grad_()
        fn(z).backward()
        grads.append(z.grad)
    torch.testing.assert_close(grads[1], grads[0])
