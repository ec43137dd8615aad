"""Triton alpha X X^T + beta C (upper-triangle blocks, mirrored) vs PyTorch; CUDA + triton only."""

import pytest
import torch

from optimizer import newton_schulz, triton_gram

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not triton_gram.available(), reason="needs triton"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(70, 150), (3, 130, 40), (2, 2, 257, 512), (1024, 4096), (1, 1)])
def test_gram_matches_torch(shape, dtype):
    x = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0)).to(dtype)
    got = triton_gram.gram_triton(x)
    ref = x.double() @ x.double().mT
    assert got.dtype == dtype and got.shape == ref.shape
    assert torch.equal(got, got.mT)  # mirrored exactly
    k = shape[-1]
    # fp32: IEEE dot products, error ~ sqrt(k) ulp; bf16: output rounding (2^-8 relative) dominates
    tol = 1e-5 * k**0.5 if dtype == torch.float32 else 8e-3
    scale = ref.abs().amax(dim=(-2, -1), keepdim=True).clamp(min=1e-6)
    assert ((got.double() - ref).abs() / scale).max() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gram_with_fused_axpy(dtype):
    gen = torch.Generator("cuda").manual_seed(2)
    x = torch.randn(3, 300, 200, device="cuda", generator=gen).to(dtype)
    c = torch.randn(3, 300, 300, device="cuda", generator=gen)
    c = (c + c.mT).to(dtype)
    got = triton_gram.gram_triton(x, c, alpha=2.0315, beta=-4.7750)
    ref = 2.0315 * (x.double() @ x.double().mT) - 4.7750 * c.double()
    assert torch.equal(got, got.mT)
    tol = 1e-5 * 200**0.5 if dtype == torch.float32 else 8e-3
    assert ((got.double() - ref).abs() / ref.abs().max()).max() < tol


def test_newton_schulz_triton_vs_torch_backend(monkeypatch):
    m = torch.randn(4, 512, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    monkeypatch.setenv("MUON_GRAM_BACKEND", "triton")
    with_triton = newton_schulz(m, dtype=torch.bfloat16)
    monkeypatch.setenv("MUON_GRAM_BACKEND", "torch")
    with_torch = newton_schulz(m, dtype=torch.bfloat16)
    rel = (with_triton.float() - with_torch.float()).norm() / with_torch.float().norm()
    assert rel < 2e-2  # both bf16; NS amplifies rounding differences a little over 5 steps
