"""The emulated low-precision GEMMs (`quantization.emulation`): each quantizer's scaling rule, the stated error
bounds, and agreement with torchao 0.18's own CPU-runnable paths (float8 rowwise with emulate=True, MXFP8
with the EMULATED kernel preference), which use the same rules.

Expected error: E4M3 keeps 3 mantissa bits, so a normal number rounds with relative error <= 2^-4 (half an
ulp); for Gaussian data the RMS element error is ~0.026, and a GEMM whose two operands are quantized has an
output relative Frobenius error ~sqrt(2) x 0.026 ~ 0.037. The tests bound single GEMMs at 0.05."""

import pytest
import torch

from llm_training.quantization.emulation import (
    E4M3_MAX,
    emulated_grouped_mm,
    emulated_linear,
    quantize_blocks_2d,
    quantize_mx,
    quantize_rowwise,
    quantize_tiles,
    relative_error,
)

RECIPES = ("fp8_rowwise", "mxfp8", "fp8_blockwise")
GEMM_BOUND = 0.05


def _data(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


@pytest.mark.parametrize(
    "quantize",
    [lambda x: quantize_rowwise(x, 1), lambda x: quantize_mx(x, 1), lambda x: quantize_tiles(x, 1), quantize_blocks_2d],
)
def test_every_element_within_half_an_e4m3_ulp(quantize):
    x = _data(256, 256) * torch.logspace(-6, 6, 2)[:, None].repeat_interleave(128, 0)  # 12 decades between blocks
    q = quantize(x)
    assert q.shape == x.shape and torch.isfinite(q).all()
    rel = ((q - x).abs() / x.abs()).flatten()
    # normal E4M3 numbers round within 2^-4; the rare Gaussian elements far below their block's amax (< 2^-6 of
    # the block's scale) land in the subnormals
    assert (rel <= 2**-4 + 1e-7).float().mean() > 0.99
    assert relative_error(q, x) < 2**-4


def test_rowwise_scales_are_powers_of_two_per_row():
    x = _data(8, 64)
    x[3] *= 1000.0
    q = quantize_rowwise(x, 1)
    assert torch.equal(quantize_rowwise(x[:3], 1), q[:3])  # a row's scale ignores the other rows
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / x.abs().amax(1, keepdim=True))))
    assert torch.equal(q, (x * scale).to(torch.float8_e4m3fn).float() / scale)


def test_mx_blocks_of_32_have_their_own_e8m0_scale():
    x = _data(4, 96)
    x[:, 32:64] *= 2.0**20  # a huge middle block must not change its neighbours
    q = quantize_mx(x, 1)
    assert torch.equal(q[:, :32], quantize_mx(x[:, :32], 1)) and torch.equal(q[:, 64:], quantize_mx(x[:, 64:], 1))
    e = torch.ceil(torch.log2(x[:, 32:64].abs().amax(1, keepdim=True) / E4M3_MAX))
    assert (q[:, 32:64] / torch.exp2(e)).abs().max() <= E4M3_MAX  # elements fit E4M3 after the 2^e scale
    assert torch.equal(quantize_mx(torch.zeros(2, 32), 1), torch.zeros(2, 32))  # amax 0: no NaN
    assert torch.equal(quantize_mx(x, 0).t(), quantize_mx(x.t(), 1))  # the block runs along the given dim


def test_blockwise_tiles_are_1x128_and_weight_blocks_128x128():
    x = _data(4, 256)
    x[:, 128:] *= 1e4
    assert torch.equal(quantize_tiles(x, 1)[:, :128], quantize_tiles(x[:, :128], 1))
    w = _data(256, 256)
    w[:128, :128] *= 1e4
    qw = quantize_blocks_2d(w)
    assert torch.equal(qw[128:, :128], quantize_blocks_2d(w[128:, :128]))
    assert torch.equal(qw[:128, 128:], quantize_blocks_2d(w[:128, 128:]))
    # partial blocks (dims that are not multiples of 128, emulation only) are scaled from their real elements
    assert relative_error(quantize_tiles(x[:, :100], 1), x[:, :100]) < 2**-4
    assert relative_error(quantize_blocks_2d(w[:100, :70]), w[:100, :70]) < 2**-4


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("hp_weight_grad", [False, True])
def test_emulated_linear_matches_fp32_within_the_bound_in_all_three_gemms(recipe, hp_weight_grad):
    x, w, g = _data(256, 256, seed=1), _data(384, 256, seed=2) * 0.02, _data(256, 384, seed=3)
    xq, wq = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = emulated_linear(xq, wq, recipe, hp_weight_grad)
    y.backward(g)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (xr @ wr.t()).backward(g)
    assert relative_error(y, x @ w.t()) < GEMM_BOUND
    assert relative_error(xq.grad, xr.grad) < GEMM_BOUND
    assert relative_error(wq.grad, wr.grad) < (1e-6 if hp_weight_grad else GEMM_BOUND)
    assert relative_error(y, x @ w.t()) > 1e-3  # it does quantize


@pytest.mark.parametrize("recipe", RECIPES)
def test_emulated_grouped_mm_is_the_per_group_linear(recipe):
    E, K, O = 3, 128, 64
    x, w = _data(96, K, seed=4).requires_grad_(), _data(E, O, K, seed=5).requires_grad_()
    offs = torch.tensor([32, 32, 80], dtype=torch.int32)  # expert 1 empty, 16 padding rows past the last group
    y = emulated_grouped_mm(x, w, offs, recipe)
    y.backward(torch.ones_like(y))
    assert torch.equal(y[:32], emulated_linear(x[:32], w[0], recipe)) and torch.equal(
        y[32:80], emulated_linear(x[32:80], w[2], recipe)
    )
    assert torch.equal(y[80:], torch.zeros(16, O))
    assert torch.equal(w.grad[1], torch.zeros(O, K)) and torch.equal(x.grad[80:], torch.zeros(16, K))


# ------------------------------------------------------------------ agreement with torchao's CPU-runnable paths
torchao = pytest.importorskip("torchao")


def _torchao_float8_rowwise(x, w):
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    m = torch.nn.Sequential(torch.nn.Linear(w.shape[1], w.shape[0], bias=False))
    m[0].weight = torch.nn.Parameter(w.clone())
    convert_to_float8_training(
        m, config=dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=True)
    )
    return m, m[0].weight


def test_fp8_rowwise_matches_torchao_float8_rowwise_emulated():
    x, w, g = _data(64, 128, seed=6), _data(96, 128, seed=7) * 0.05, _data(64, 96, seed=8)
    m, wt = _torchao_float8_rowwise(x, w)
    xt = x.clone().requires_grad_()
    yt = m(xt)
    yt.backward(g)
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    ye = emulated_linear(xe, we, "fp8_rowwise")
    ye.backward(g)
    assert relative_error(ye, yt) < 1e-5 and relative_error(xe.grad, xt.grad) < 1e-5
    assert relative_error(we.grad, wt.grad) < 1e-5


def _mx_kernel_args():
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common import KernelPreference

    return KernelPreference.EMULATED, ScaleCalculationMode.RCEIL


def test_mx_quantizer_matches_torchao_to_mx_rceil():
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    x = _data(16, 128) * torch.logspace(-2, 2, 128)
    scale, data = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    ref = to_dtype(data, scale, torch.float8_e4m3fn, 32, torch.float32)
    assert torch.equal(quantize_mx(x, 1), ref)


def test_mxfp8_linear_and_grouped_mm_match_torchao_emulated():
    from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm
    from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm

    pref, mode = _mx_kernel_args()
    x, w, g = _data(64, 128, seed=9), _data(96, 128, seed=10) * 0.05, _data(64, 96, seed=11)
    xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
    yt = _to_mxfp8_then_scaled_mm(xt, wt, pref, mode, False)
    yt.backward(g)
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    ye = emulated_linear(xe, we, "mxfp8")
    ye.backward(g)
    for a, b in ((ye, yt), (xe.grad, xt.grad), (we.grad, wt.grad)):
        assert relative_error(a, b) < 1e-5

    # torchao's emulated grouped GEMM dequantizes to bf16 (exact: E4M3 x 2^e fits bf16) and runs a bf16
    # grouped GEMM, so inputs are bf16 and the outputs agree to bf16 rounding (2^-9)
    E, bf16 = 2, torch.bfloat16
    x, w, g = _data(64, 128, seed=12).to(bf16), (_data(E, 96, 128, seed=13) * 0.05).to(bf16), g.to(bf16)
    offs = torch.tensor([32, 64], dtype=torch.int32)
    xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
    yt = _to_mxfp8_then_scaled_grouped_mm(xt, wt.transpose(-2, -1), offs, out_dtype=bf16, kernel_preference=pref)
    yt.backward(g)
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    ye = emulated_grouped_mm(xe, we, offs, "mxfp8")
    ye.backward(g)
    for a, b in ((ye, yt), (xe.grad, xt.grad), (we.grad, wt.grad)):
        assert relative_error(a, b) < 2**-8
