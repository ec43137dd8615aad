"""CUDA checks of the low-precision kernels (torchao 0.18) against the emulation (`quantization.emulation`,
the same scaling rules in fp32) and against bf16: fp8_rowwise linear and grouped GEMM (SM90+), fp8_blockwise
(SM90+), mxfp8 (SM100 only: skipped on the H200), and a converted MoE layer."""

import pytest
import torch

from llm_training.layers.moe import MoE
from llm_training.motif import get_flavor
from llm_training.quantization.emulation import emulated_grouped_mm, emulated_linear, relative_error
from llm_training.quantization.kernels import RecipeKernels, zero_past_last_group
from llm_training.quantization.modules import to_low_precision
from llm_training.quantization.recipes import cuda_capability, recipe_problem

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("torchao")

BF16 = {"device": "cuda", "dtype": torch.bfloat16}
VS_EMULATION = 2e-2  # same quantized operands; fp32 vs tensor-core accumulation (fast accum) and bf16 outputs
VS_BF16 = 0.05  # two E4M3-quantized operands: ~0.037 (tests/quantization/test_emulation.py)


def needs(recipe):
    problem = recipe_problem(recipe, cuda_capability())
    return pytest.mark.skipif(problem is not None, reason=str(problem))


# every recipe's GEMMs; those this GPU cannot run skip with the reason
GEMM_RECIPES = [
    "fp8_rowwise",
    pytest.param("fp8_blockwise", marks=needs("fp8_blockwise")),
    pytest.param("mxfp8", marks=needs("mxfp8")),
]


def _check(run, ref_bf16, ref_emulated, tensors):
    """Forward and both gradients of `run` vs bf16 and vs the emulation, from the same upstream gradient."""
    outs = {}
    for name, fn in (("kernel", run), ("bf16", ref_bf16), ("emulated", ref_emulated)):
        leaves = [t.detach().clone().requires_grad_() for t in tensors[:2]]
        y = fn(*leaves, *tensors[2:])
        torch.manual_seed(1)
        y.backward(torch.randn_like(y))
        outs[name] = (y, *(t.grad for t in leaves))
    for i, what in enumerate(("output", "grad_x", "grad_w")):
        k, b, e = outs["kernel"][i], outs["bf16"][i], outs["emulated"][i]
        assert torch.isfinite(k).all(), what
        assert relative_error(k, e) < VS_EMULATION, (what, relative_error(k, e))
        assert relative_error(k, b) < VS_BF16 * (1 if i == 0 else 1.5), (what, relative_error(k, b))


@pytest.mark.parametrize("recipe", GEMM_RECIPES)
@pytest.mark.parametrize("hp_weight_grad", [False, True])
def test_linear_kernel_matches_emulation_and_bf16(recipe, hp_weight_grad):
    torch.manual_seed(0)
    x, w = torch.randn(2048, 1024, **BF16), torch.randn(1536, 1024, **BF16) * 0.02
    kernels = RecipeKernels(recipe, hp_weight_grad, cuda=True)
    _check(
        kernels.linear,
        lambda a, b: a @ b.t(),
        lambda a, b: emulated_linear(a.float(), b.float(), recipe, hp_weight_grad).to(torch.bfloat16),
        (x, w),
    )


@pytest.mark.parametrize("recipe", GEMM_RECIPES)
@pytest.mark.parametrize("hp_weight_grad", [False, True])
def test_grouped_mm_kernel_matches_emulation_and_bf16(recipe, hp_weight_grad):
    torch.manual_seed(0)
    E, K, O = 8, 1024, 512
    kernels = RecipeKernels(recipe, hp_weight_grad, cuda=True)
    m = kernels.group_multiple
    counts = torch.tensor([3, 0, 5, 2, 7, 1, 4, 2]) * m  # one empty expert; groups aligned as the module pads them
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    x = torch.randn(int(counts.sum()) + m, K, **BF16)  # m slack rows past the last group, as after padding
    w = torch.randn(E, O, K, **BF16) * 0.02
    slack = torch.arange(x.shape[0], device="cuda") >= offs[-1]

    def bf16_ref(a, b, offs):
        # torch._grouped_mm leaves the rows past offs[-1] of its output AND of dX unwritten (uninitialised memory:
        # comparing them compared garbage, which failed at random); give them 0 in both directions, as ours does
        a = torch.where(slack[:, None], 0.0, a)
        return zero_past_last_group(torch._grouped_mm(a, b.transpose(-2, -1), offs=offs), offs)

    _check(
        kernels.grouped_mm,
        bf16_ref,
        lambda a, b, offs: emulated_grouped_mm(a.float(), b.float(), offs.cpu(), recipe, hp_weight_grad).to(
            torch.bfloat16
        ),
        (x, w, offs),
    )
    # the contract itself, on memory that held garbage: slack rows give exactly 0 and get exactly 0 gradient
    junk = [torch.full_like(x, float("nan")) for _ in range(8)]  # freed at once: the next [N, K] blocks hold NaN
    del junk
    xk = x.detach().clone().requires_grad_()
    y = kernels.grouped_mm(xk, w, offs)
    y.backward(torch.randn_like(y))
    assert (y[slack] == 0).all() and (xk.grad[slack] == 0).all() and torch.isfinite(xk.grad).all()


@pytest.mark.parametrize("recipe", ["fp8_rowwise", pytest.param("mxfp8", marks=needs("mxfp8"))])
def test_converted_moe_layer_tracks_bf16(recipe):
    """motif3_small's MoE (64 experts, top-8, shared expert): routed experts and shared expert converted, output
    within 0.1 of the bf16 layer (two quantized GEMMs in a row), every weight gradient finite and within 0.15."""
    args = get_flavor("motif3_small")
    torch.manual_seed(0)
    ref = MoE(args).to(**BF16)
    with torch.no_grad():
        ref.init_weights(0.02, buffer_device="cuda")
    moe = MoE(args).to(**BF16)
    moe.load_state_dict(ref.state_dict())
    kernels = RecipeKernels(recipe, False, cuda=True)
    to_low_precision(moe.experts, kernels)
    for lin in (moe.shared_experts.gate_proj, moe.shared_experts.up_proj, moe.shared_experts.down_proj):
        to_low_precision(lin, kernels)
    x = torch.randn(2, 1024, args.hidden_size, **BF16)
    y_ref, _ = ref(x)
    y, _ = moe(x)
    assert 1e-3 < relative_error(y, y_ref) < 0.1
    g = torch.randn_like(y)
    y_ref.backward(g)
    y.backward(g)
    for (name, p_ref), p in zip(ref.named_parameters(), moe.parameters()):
        if name.endswith(("gate_up_proj", "down_proj", "gate_proj.weight", "up_proj.weight")):
            assert torch.isfinite(p.grad).all() and relative_error(p.grad, p_ref.grad) < 0.15, name


@pytest.mark.parametrize("recipe", GEMM_RECIPES)
@pytest.mark.parametrize("hp_weight_grad", [False, True])
def test_compiled_converted_experts_match_eager(recipe, hp_weight_grad):
    """torch.compile over a converted GroupedExperts (the trainer compiles per block) gives the eager output and
    gradients (input, both expert weights, PolyNorm), in every recipe this GPU runs and both weight-gradient
    modes: torchao's ops trace, the group padding is static. 512 routed rows over 8 experts padded to 16 rows
    used to make a 632-row buffer, which dynamo rejected (the FP8 wgrad's 632-byte row stride)."""
    from llm_training.layers.moe import GroupedExperts

    args = get_flavor("motif3_small").replace(num_experts=8)
    torch.manual_seed(0)
    experts = GroupedExperts(args).to(**BF16)
    with torch.no_grad():
        experts.init_weights(0.02)
    to_low_precision(experts, RecipeKernels(recipe, hp_weight_grad, cuda=True))
    counts = torch.tensor([100, 0, 37, 250, 3, 64, 9, 49], device="cuda")
    x = torch.randn(int(counts.sum()), args.hidden_size, **BF16)
    g = torch.randn_like(x)
    compiled = torch.compile(experts)
    results = []
    for fn in (experts, compiled):
        experts.zero_grad()
        xi = x.clone().requires_grad_()
        y = fn(xi, counts)
        y.backward(g)
        results.append([y, xi.grad] + [p.grad.clone() for p in experts.parameters()])
    names = ["output", "grad_x"] + [n for n, _ in experts.named_parameters()]
    for name, e, c in zip(names, *results):
        assert torch.isfinite(c).all(), name
        # the same quantized operands either way; compiled and eager differ by the fusion of the elementwise
        # work around the GEMMs (bf16 roundings), an FP8 scale changing at an element near a power of two
        assert relative_error(c, e) < VS_EMULATION, (name, relative_error(c, e))


@needs("fp8_blockwise")
def test_blockwise_kernels_autotune_over_the_kept_configs_only():
    """Binding fp8_blockwise trims torchao's 45-config activation-quantization autotune to BLOCKWISE_QUANT_CONFIGS
    (a first step otherwise compiles and times all 45 per K), and the trimmed kernels still quantize exactly as the
    emulation does."""
    from torchao.prototype.blockwise_fp8_training import kernels as blockwise

    from llm_training.quantization.kernels import BLOCKWISE_QUANT_CONFIGS, BLOCKWISE_QUANT_KERNELS

    RecipeKernels("fp8_blockwise", hp_weight_grad=True, cuda=True)
    for name in BLOCKWISE_QUANT_KERNELS:
        kept = [(c.kwargs["NUM_GROUPS"], c.num_warps) for c in getattr(blockwise, name).configs]
        assert kept == list(BLOCKWISE_QUANT_CONFIGS), name
    x = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    y, s = blockwise.triton_fp8_blockwise_act_quant_lhs(x, 128)
    x_tiles, s_tiles = x.float().view(256, 3, 128), s[:, :, None]  # s: one reciprocal scale per 1x128 tile
    error = (y.float().view(256, 3, 128) * s_tiles - x_tiles).abs()
    # e4m3 rounds to 3 mantissa bits: at most 2^-4 of each value (x 1.01 for the scale's own fp32 rounding), and
    # below its smallest normal (2^-6) to steps of 2^-9, half a step being 2^-10 in the tile's scaled units
    assert error.le(x_tiles.abs() * 2**-4 * 1.01 + s_tiles * 2**-10).all()
