"""Fp32Projection and matmul_fp32: exact fp32 on the CPU; the CUDA split-bf16 scheme's error (emulated here in
float64) and what it does to top-k routing decisions on a realistic router."""

import math

import pytest
import torch
import torch.nn.functional as F

from llm_training.layers import projection
from llm_training.layers.projection import Fp32Projection, _bf16_parts, matmul_fp32


def test_cpu_projection_is_exact_fp32_with_fp32_gradients():
    torch.manual_seed(0)
    proj = Fp32Projection(64, 8)
    torch.nn.init.normal_(proj.weight, std=0.02)
    x = torch.randn(5, 64).bfloat16().requires_grad_()
    y = proj(x)
    assert y.dtype == torch.float32
    assert torch.equal(y, F.linear(x.float(), proj.weight))
    y.square().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and proj.weight.grad.dtype == torch.float32


def test_matmul_fp32_cpu_is_exact_in_the_wider_dtype():
    a, b = torch.randn(7, 33).bfloat16(), torch.randn(33, 5)
    assert torch.equal(matmul_fp32(a, b), a.float() @ b)
    assert torch.equal(matmul_fp32(a.double(), b, out_dtype=torch.float64), a.double() @ b.double())
    assert matmul_fp32(a, b, out_dtype=torch.bfloat16).dtype == torch.bfloat16


def test_bf16_split_carries_16_mantissa_bits():
    t = torch.randn(10000) * torch.logspace(-3, 3, 10000)
    parts = _bf16_parts(t)
    assert len(parts) == 2 and all(p.dtype == torch.bfloat16 for p in parts)
    rel = ((parts[0].double() + parts[1].double()) - t.double()).abs() / t.double().abs()
    assert rel.max() <= 2.0**-16, rel.max()
    assert _bf16_parts(t.bfloat16())[0].dtype == torch.bfloat16 and len(_bf16_parts(t.bfloat16())) == 1


def _round_mantissa(t: torch.Tensor, bits: int) -> torch.Tensor:
    """Round fp32 to `bits` explicit mantissa bits (nearest, ties away): TF32 = 10, bf16 = 7."""
    i = t.float().view(torch.int32)
    drop = 23 - bits
    i = (i + (1 << (drop - 1))) & ~((1 << drop) - 1)
    return i.view(torch.float32)


def _selected(logits: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sigmoid(logits).add(bias).topk(k, dim=-1).indices.sort(dim=-1).values


def test_router_top_k_is_stable_under_the_split_bf16_gemm():
    """Motif-3 router (E = 384, K = 8, sigmoid scores + expert bias), normed bf16 tokens, gate N(0, 0.02^2):
    the split-bf16 GEMM (what CUDA runs, emulated in float64: bf16 input exact, weight = hi + lo) changes the
    selected set of at most 0.1% of tokens vs exact math (expected ~1e-4, module docstring of projection.py),
    several times fewer than TF32 or bf16 weights would, and every change is a near-tie of the scores."""
    torch.manual_seed(0)
    T, H, E, K = 2048, 2048, 384, 8
    x = F.rms_norm(torch.randn(T, H), (H,)).bfloat16()
    w = torch.randn(E, H) * 0.02
    bias = torch.randn(E) * 1e-3
    exact = x.double() @ w.double().t()
    hi, lo = _bf16_parts(w)
    split = x.double() @ (hi.double() + lo.double()).t()
    tf32 = x.double() @ _round_mantissa(w, 10).double().t()
    bf16 = x.double() @ w.bfloat16().double().t()
    want = _selected(exact, bias.double(), K)
    flips = {
        name: (_selected(z, bias.double(), K) != want).any(-1).float().mean().item()
        for name, z in (("split", split), ("tf32", tf32), ("bf16", bf16))
    }
    err = (split - exact).abs().max().item() / exact.std().item()
    assert err < 1e-4, err
    assert flips["split"] <= 1e-3, flips
    assert flips["split"] * 4 <= max(flips["tf32"], 1e-3) and flips["tf32"] < flips["bf16"], flips
    # a changed token swaps experts whose scores were within the error of a tie
    scores = torch.sigmoid(exact) + bias.double()
    top = scores.topk(K + 1, dim=-1).values
    changed = (_selected(split, bias.double(), K) != want).any(-1)
    gap = (top[:, K - 1] - top[:, K])[changed]
    assert (gap <= 1e-4).all(), gap


@pytest.fixture
def emulated_tensor_cores(monkeypatch):
    """Run the CUDA code paths on the CPU: every tensor takes them, and the fp32-output bf16 products (CUDA-only
    in torch) are emulated by exact fp32 products of the (checked) bf16 operands."""

    def product(op):
        def run(a, b):
            assert a.dtype == b.dtype == torch.bfloat16, (a.dtype, b.dtype)
            return op(a.float(), b.float())

        return run

    monkeypatch.setattr(projection, "on_tensor_cores", lambda t: True)
    monkeypatch.setattr(projection, "mm_fp32_out", product(torch.mm))
    monkeypatch.setattr(projection, "bmm_fp32_out", product(torch.bmm))


@pytest.mark.parametrize(
    "a_dtype,b_dtype,out_dtype",
    [("bf16", "fp32", "fp32"), ("fp32", "bf16", "fp32"), ("bf16", "bf16", "fp32"), ("fp32", "fp32", "bf16")],
)
def test_split_bf16_path_error_vs_float64(emulated_tensor_cores, a_dtype, b_dtype, out_dtype):
    """The split-bf16 path's error (what CUDA computes, up to fp32 summation order) within its derived bound
    (`split_bf16_error_bound`): the split pieces, the dropped lo x lo term, fp32 accumulation, a bf16 result's
    rounding."""
    check_split_bf16_error(a_dtype, b_dtype, out_dtype, "cpu", (512, 1024, 48))


def test_split_fp32_pair_runs_two_fp32_operands_on_the_split_path(emulated_tensor_cores, monkeypatch):
    """Two fp32 operands for an fp32 result: exact fp32 by default; `split_fp32_pair` puts them on the tensor-core
    path (both split, 3 bf16 products) within the split path's derived bound."""
    calls = []
    mm = projection.mm_fp32_out
    monkeypatch.setattr(projection, "mm_fp32_out", lambda a, b: calls.append(1) or mm(a, b))
    check_split_bf16_error("fp32", "fp32", "fp32", "cpu", (512, 1024, 48))
    assert not calls  # the default stays exact fp32 (no bf16 product)
    check_split_bf16_error("fp32", "fp32", "fp32", "cpu", (512, 1024, 48), split_fp32_pair=True)
    assert calls


# The error bound of the split-bf16 product, per output element (used here and on CUDA by tests/layers/mhc/test_mhc_gpu.py).
# Derivation, for c = sum_k a_k b_k with u = 2^-24 (fp32) and u16 = 2^-8 (bf16, 8 significant bits):
#   * splitting an fp32 operand: hi = bf16(t), lo = bf16(t - hi), so |t - hi - lo| <= u16^2 |t| = 2^-16 |t|
#     (tests/layers/test_projection.py::test_bf16_split_carries_16_mantissa_bits); with both operands split the
#     dropped lo x lo term adds at most u16 |a| u16 |b| = 2^-16 |a b|. Representation error of each product:
#     <= (splits + [both split]) 2^-16 |a_k b_k|, summed deterministically over k (any order).
#   * every bf16 x bf16 piece product is exact in fp32 (8 + 8 significant bits), so what remains is the fp32
#     accumulation of n = K (1 + splits) exact terms (+ one add of the two halves with one split operand). Its
#     worst case over every summation order, (n - 1) u sum|terms|, is too loose to tell the split path from plain
#     bf16, so the bound is the probabilistic one of Higham & Mary (SIAM J. Sci. Comput. 41(5), 2019, Thm 3.1),
#     valid for any order and blocking (any BLAS, tensor cores): lambda sqrt(n) u sum|terms| with probability at
#     least 1 - 2 n exp(-lambda^2 / 2) per element; lambda = 9 makes that < 1e-9 over all the outputs of a test.
#   * a bf16 result adds its own rounding, u16 |c|.
# The bound is ~1e-3 of the output's spread at these shapes, 10x under the error of dropping the lo pieces (plain
# bf16 operands: ~1.4e-2 of the spread), and several times over what any BLAS measured (2e-5).
_LAMBDA = 9.0


def split_bf16_error_bound(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Elementwise bound (float64 [M, N]) on |matmul_fp32(a, b, out_dtype) - a @ b| on the split-bf16 path
    (derivation above)."""
    splits = int(a.dtype == torch.float32) + int(b.dtype == torch.float32)
    representation = (splits + (splits == 2)) * 2.0**-16
    n = a.shape[1] * (1 + splits) + (splits == 1)
    accumulation = _LAMBDA * math.sqrt(n) * 2.0**-24
    abs_sum = a.double().abs() @ b.double().abs()
    bound = (representation + accumulation) * abs_sum * (1 + 2.0**-7)  # margin: second-order terms, |lo| <= |t - hi|
    if out_dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * (a.double() @ b.double()).abs() * (1 + 2.0**-7)
    return bound


def check_split_bf16_error(
    a_dtype: str, b_dtype: str, out_dtype: str, device: str, shape_MKN: tuple, split_fp32_pair: bool = False
) -> None:
    """matmul_fp32 of random [M, K] x [K, N] operands in the given dtypes against float64: every element within
    `split_bf16_error_bound` (also run on CUDA by tests/layers/mhc/test_mhc_gpu.py with the real tensor-core
    kernels)."""
    torch.manual_seed(0)
    M, K, N = shape_MKN
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}
    a = (torch.randn(M, K, device=device) + 1e-3).to(dt[a_dtype])
    b = (torch.randn(K, N, device=device) * 0.02).to(dt[b_dtype])
    want = a.double() @ b.double()
    got = matmul_fp32(a, b, out_dtype=dt[out_dtype], split_fp32_pair=split_fp32_pair)
    assert got.dtype == dt[out_dtype]
    err = (got.double() - want).abs()
    ratio = (err / split_bf16_error_bound(a, b, dt[out_dtype])).max().item()
    assert ratio <= 1.0, (
        f"error {ratio:.2f}x the derived bound (max error {err.max().item() / want.std().item():.2e} of the spread)"
    )


def test_projection_on_the_split_path_matches_exact_fp32(emulated_tensor_cores):
    torch.manual_seed(0)
    proj = Fp32Projection(256, 24)
    torch.nn.init.normal_(proj.weight, std=0.05)
    x = torch.randn(2, 64, 256).bfloat16().requires_grad_()
    g = torch.randn(2, 64, 24)
    y = proj(x)
    y.backward(g)
    want = x.detach().double() @ proj.weight.detach().double().t()
    assert y.dtype == torch.float32 and x.grad.dtype == torch.bfloat16 and proj.weight.grad.dtype == torch.float32
    assert (
        (y.double() - want).abs()
        <= split_bf16_error_bound(x.detach().reshape(-1, 256), proj.weight.detach().t(), torch.float32).view_as(want)
    ).all()
    dx = g.double() @ proj.weight.detach().double()
    torch.testing.assert_close(x.grad.double(), dx, atol=1e-2 * dx.std().item(), rtol=1e-2)
    dw = g.double().reshape(-1, 24).t() @ x.detach().double().reshape(-1, 256)
    g_split = g.reshape(-1, 24).t()  # dW = g^T x: the fp32 g split, x exact
    assert (
        (proj.weight.grad.double() - dw).abs()
        <= split_bf16_error_bound(g_split, x.detach().reshape(-1, 256), torch.float32)
    ).all()
