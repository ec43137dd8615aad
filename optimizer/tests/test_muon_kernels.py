"""Muon's Triton elementwise kernels (`optimizer.muon_kernels`) against torch's kernels, and a CUDA Muon step with them
against one without them; CUDA + triton only.

Bounds: both sides compute in fp32 from the same inputs, so an fp32 result may differ by the contraction of
`g + mu * m` (or `delta + decay * w`) into one FMA: one rounding of the product, at most one fp32 ulp of it. With
operands of magnitude below 8 (randn) that is 2^-21 absolute (atol 1e-6, which also covers results that cancel to
near zero) and 2 ulp relative (rtol 2^-22) elsewhere. A bf16 result rounds that fp32 value; where the two straddle a
bf16 rounding boundary the stored values are one bf16 ulp apart: rtol 2^-7 (one ulp of the smallest mantissa).
The Nesterov output is compared with torch's arithmetic on the kernel's own stored momentum, so a bf16 momentum that
rounded the other way in one element does not show up twice.
"""

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
muon_kernels = pytest.importorskip("optimizer.muon_kernels", reason="needs triton")

FP32_RTOL, BF16_RTOL, ATOL = 2.0**-22, 2.0**-7, 1e-6


def _rtol(dtype: torch.dtype) -> float:
    return FP32_RTOL if dtype == torch.float32 else BF16_RTOL


def _stack_slots(shape, transposed, dtype):
    """A [count, R, K] destination like Muon's stack slots: contiguous, or the transposed view of [count, K, R]."""
    count, rows, cols = shape
    if transposed:
        return torch.full((count, cols, rows), float("nan"), device="cuda", dtype=dtype).mT
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


@pytest.mark.parametrize("shape", [(3, 100, 70), (1, 130, 260), (2, 64, 64), (1, 1, 33)])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("buf_dtype,out_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])  # 0.37: a clipping step's coefficient, applied in the kernel
def test_momentum_nesterov_matches_torch(shape, transposed, buf_dtype, out_dtype, nesterov, grad_scale):
    gen = torch.Generator("cuda").manual_seed(0)
    grad = torch.randn(shape, device="cuda", generator=gen)
    buf = torch.randn(shape, device="cuda", generator=gen).to(buf_dtype)
    out = _stack_slots(shape, transposed, out_dtype)
    assert muon_kernels.supported(out, grad, buf)
    grad_before = grad.clone()
    scaled = grad * grad_scale  # fp32, as the kernel scales it before the FMA
    ref_buf = torch.add(scaled, buf, alpha=0.95).to(buf_dtype)  # what muon.py runs without the kernels
    muon_kernels.momentum_nesterov_(out, grad, buf, 0.95, nesterov, grad_scale)
    assert torch.equal(grad, grad_before)  # the gradient itself is not scaled
    torch.testing.assert_close(buf, ref_buf, rtol=_rtol(buf_dtype), atol=ATOL)
    ref_out = torch.add(scaled, buf, alpha=0.95) if nesterov else buf  # from the momentum as the kernel stored it
    torch.testing.assert_close(out, ref_out.to(out_dtype), rtol=_rtol(out_dtype), atol=ATOL)  # NaN-filled: all written


@pytest.mark.parametrize("shape", [(3, 100, 70), (1, 130, 260), (1, 1, 33)])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("delta_dtype", [torch.bfloat16, torch.float32])
def test_decay_update_matches_torch(shape, transposed, delta_dtype):
    gen = torch.Generator("cuda").manual_seed(1)
    w = torch.randn(shape, device="cuda", generator=gen)
    delta = _stack_slots(shape, transposed, delta_dtype)
    delta.copy_(torch.randn(shape, device="cuda", generator=gen) * 1e-2)
    assert muon_kernels.supported(delta, w)
    ref = torch.add(delta, w, alpha=1 - 0.02 * 0.1)
    muon_kernels.decay_update_(w, delta, 1 - 0.02 * 0.1)
    torch.testing.assert_close(w, ref, rtol=FP32_RTOL, atol=ATOL)


def test_supported_layouts():
    """The kernels take contiguous [count, R, K] operands and a contiguous or transposed destination / delta; anything
    else (another layout, CPU tensors, 2-D tensors) goes to torch's kernels."""
    g = torch.zeros(2, 8, 4, device="cuda")
    assert muon_kernels.supported(torch.zeros(2, 4, 8, device="cuda").mT, g, g)
    assert not muon_kernels.supported(torch.zeros(4, 2, 8, device="cuda").permute(1, 2, 0), g, g)  # other layout
    assert not muon_kernels.supported(g, g.mT.contiguous().mT)  # a strided operand that must be contiguous
    assert not muon_kernels.supported(g.cpu(), g.cpu())
    assert not muon_kernels.supported(g[0], g[0])


def test_cuda_muon_step_with_and_without_kernels(monkeypatch):
    """A bucket mixing wide, tall and square matrices and an expert stack: the Muon step with the Triton kernels
    gives the momentum buffers torch's kernels give (fp32, 2 ulp) and the same update up to the bf16 NS of inputs
    that may differ by one bf16 ulp in a few elements (relative Frobenius difference < 1e-2; bf16 NS itself is only
    good to ~1.5e-2 against fp32, test_muon_cuda)."""
    import optimizer.muon as muon_module
    from optimizer import Muon

    shapes = [(64, 256), (256, 64), (128, 128), (4, 96, 48)]
    gen = torch.Generator("cuda").manual_seed(2)
    init = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
    grads = [[torch.randn(s, device="cuda", generator=gen) for s in shapes] for _ in range(2)]

    def run():
        params = [t.clone().requires_grad_() for t in init]
        opt = Muon(params, lr=0.02, weight_decay=0.1)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        return [p.detach() - t for p, t in zip(params, init)], [opt.state[p]["momentum_buffer"] for p in params]

    taken = []  # what each elementwise call of the step got: the kernels module, or None (torch's kernels)
    real = muon_module._fused_kernels
    monkeypatch.setattr(muon_module, "_fused_kernels", lambda *a: taken.append(real(*a)) or taken[-1])
    fused_updates, fused_bufs = run()
    assert taken and all(k is muon_kernels for k in taken)  # 2 calls per parameter and step, all through Triton
    assert len(taken) == 2 * len(shapes) * len(grads)
    monkeypatch.setattr(muon_module, "_fused_kernels", lambda *a: None)
    torch_updates, torch_bufs = run()
    for a, b in zip(fused_bufs, torch_bufs):
        torch.testing.assert_close(a, b, rtol=FP32_RTOL, atol=ATOL)
    for a, b in zip(fused_updates, torch_updates):
        assert float((a - b).norm() / b.norm()) < 1e-2
        assert math.isfinite(float(a.norm()))


def test_the_prebuild_builds_what_the_step_launches(triton_prebuild_stub):
    """`Muon.kernel_launches` announces each specialisation of the elementwise kernels the step will launch (wide, tall
    and square matrices, an expert stack, a row-split stack, a size not a multiple of 16; fp32 parameters and
    momentum, bf16 stack): once the prebuild's worker has built them, the step builds nothing in this process."""
    from activation.triton_prebuild import capture_launches

    from optimizer import Muon

    pb, events = triton_prebuild_stub
    shapes = [(64, 256), (256, 64), (128, 128), (4, 96, 48), (2, 64, 32), (100, 70)]
    params = [torch.zeros(s, device="cuda", requires_grad=True) for s in shapes]
    opt = Muon([{"params": params[:4] + params[5:]}, {"params": [params[4]], "row_split": 2}], lr=0.02)
    launches = opt.kernel_launches()
    for what, launch in launches:
        capture_launches(launch, torch.empty(0, device="meta"), what=what)
    assert pb.skipped == [] and len(pb.futures) == 2 * len(launches)  # two kernels per announced layout
    assert all(seconds > 0 for _name, seconds in pb.wait(timeout=300)) and events == []
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step(grad_scale=0.5)  # a clipping step: the coefficient is a runtime float, no specialisation of its own
    assert events and "build" not in events, events  # every launch found the worker's build in the cache
    assert pb.unpredicted == []
