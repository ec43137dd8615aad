"""trainer/cross_entropy_kernels.py: the fused loss-chunk kernel (run by the Triton interpreter on the CPU,
TRITON_INTERPRET=1, or on CUDA) gives the torch chunk code's CE and weighted logit gradient, on ignored rows,
vocabularies that are not a multiple of its block, and extreme logits; the chunked loss picks it on CUDA only."""

import pytest
import torch

from llm_training.trainer import losses
from tests.triton_kernels import HAS_TRITON, KERNEL_DEVICE, needs_triton_kernels


def test_the_kernel_is_the_cuda_path_only():
    assert losses._chunk_function(torch.device("cpu"), compiled=False) is losses._chunk_ce_and_grad
    if torch.cuda.is_available() and HAS_TRITON:
        assert losses._chunk_function(torch.device("cuda"), compiled=False).func.__name__ == "ce_chunk_and_grad"


@pytest.mark.gpu
@needs_triton_kernels
@pytest.mark.parametrize("V", [5000, 4096, 130])
def test_kernel_matches_the_torch_chunk_code(V):
    from llm_training.trainer.cross_entropy_kernels import ce_chunk_and_grad

    device = KERNEL_DEVICE
    torch.manual_seed(0)
    C = 7
    logits = torch.randn(C, V, device=device) * 4
    logits[1, 3] = 80.0  # one dominant logit: softmax saturates
    logits[2] -= 1000.0  # a row far below zero: the online max must carry it
    y = torch.randint(0, V, (C,), device=device)
    y[1], y[4] = 5, losses.IGNORE_INDEX  # row 1's mass sits on a wrong class
    w = torch.rand(C, device=device) + 0.5
    ce_want, g_want = losses._chunk_ce_and_grad(logits.double().clone(), y, w.double(), torch.float64)
    storage = logits.untyped_storage().data_ptr()
    ce, g = ce_chunk_and_grad(logits, y, w, torch.bfloat16, losses.IGNORE_INDEX)
    assert ce.dtype == torch.float32 and g.dtype == torch.bfloat16 and g.shape == (C, V)
    # written over the logits: row t in the first half of logits row t's bytes, no [C, V] buffer of its own
    assert g.untyped_storage().data_ptr() == storage and g.stride() == (2 * V, 1)
    torch.testing.assert_close(ce.double().cpu(), ce_want.cpu(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(g.double().cpu(), g_want.cpu(), atol=2e-3 * g_want.abs().max().item(), rtol=1e-2)
    assert ce[4] == 0 and (g[4] == 0).all()  # the ignored row
    assert g[1, 3] > 0.99 * w[1] and g[1, 5] < -0.99 * w[1]  # saturated: +w on the argmax, -w on the label
    assert abs(g[0].double().sum().item()) < 1e-2 * w[0].item()  # softmax - onehot sums to ~0 per row


@pytest.mark.gpu
@needs_triton_kernels
def test_fp32_gradients_get_a_buffer_of_their_own():
    from llm_training.trainer.cross_entropy_kernels import ce_chunk_and_grad

    torch.manual_seed(0)
    logits = torch.randn(3, 300, device=KERNEL_DEVICE)
    want = losses._chunk_ce_and_grad(logits.clone(), torch.tensor([1, 2, 3], device=KERNEL_DEVICE),
                                     torch.ones(3, device=KERNEL_DEVICE), torch.float32)  # fmt: skip
    ce, g = ce_chunk_and_grad(logits, torch.tensor([1, 2, 3], device=KERNEL_DEVICE),
                              torch.ones(3, device=KERNEL_DEVICE), torch.float32, losses.IGNORE_INDEX)  # fmt: skip
    assert g.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr() and g.is_contiguous()
    torch.testing.assert_close((ce, g), want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@needs_triton_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_with_the_kernel_gives_the_torch_path_loss_and_gradients(monkeypatch, dtype):
    """The loss's chunk loop through the kernel (bf16: its gradient written over each logits chunk, read by the
    GEMMs with that row stride) against the torch chunk code, both in `dtype`: equal up to the rounding of the bf16
    gradient the two write in their own order (bf16: 2^-8 relative, a few ulps over the sums of 10-token chunks)."""
    import functools

    from llm_training.trainer.cross_entropy_kernels import ce_chunk_and_grad

    device = KERNEL_DEVICE
    torch.manual_seed(0)
    T, H, V = 37, 16, 300
    hidden = torch.randn(T, H, device=device).to(dtype)
    weight = (torch.randn(V, H, device=device) * 0.3).to(dtype)
    labels = torch.randint(0, V, (T,), device=device)
    labels[::5] = losses.IGNORE_INDEX

    def loss_and_grads():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        total = losses.linear_cross_entropy_sum(h, w, labels, chunk_tokens=10)
        total.backward()
        return total.detach(), h.grad.float(), w.grad.float()

    monkeypatch.setattr(losses, "_chunk_function", lambda device, compiled: losses._chunk_ce_and_grad)
    want = loss_and_grads()
    kernel = functools.partial(ce_chunk_and_grad, ignore_index=losses.IGNORE_INDEX)
    monkeypatch.setattr(losses, "_chunk_function", lambda device, compiled: kernel)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, ref in zip(loss_and_grads(), want):
        torch.testing.assert_close(got, ref, atol=tol * ref.abs().max().item(), rtol=tol)
