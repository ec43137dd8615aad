"""The converter on motif3_debug: which modules convert (and which never do), converted layers within the
quantisation error of the unconverted ones with gradients flowing, a DCP checkpoint saved under one recipe
loading under another, and short CPU trainings (emulated) whose loss falls under every recipe."""

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from llm_training.config import ConfigManager
from llm_training.layers.moe import GroupedExperts, MoE
from llm_training.motif import get_flavor
from llm_training.motif.model import Motif3Model
from llm_training.quantization import apply_converters, build_converter
from llm_training.quantization.converter import LowPrecisionConverter, convertible_modules
from llm_training.errors import ConfigError
from llm_training.quantization.emulation import emulated_linear, relative_error
from llm_training.quantization.kernels import RecipeKernels, _NoGradPastLastGroup
from llm_training.quantization.modules import LowPrecisionGroupedExperts, LowPrecisionLinear

RECIPES = ("fp8_rowwise", "mxfp8", "fp8_blockwise")
KINDS = ("attention", "dense_mlp", "routed_experts", "shared_expert")


def parse(*argv):
    return ConfigManager().parse_args(["--training.device=cpu", *argv])


def debug_model(seed=0, device="cpu"):
    torch.manual_seed(seed)
    with torch.device(device):
        model = Motif3Model(get_flavor("motif3_debug"))
    if device != "meta":
        model.init_weights()
    return model


def converted_names(model):
    return {n for n, m in model.named_modules() if isinstance(m, (LowPrecisionLinear, LowPrecisionGroupedExperts))}


def test_the_listed_kinds_convert_and_the_forbidden_modules_never_do():
    model = debug_model(device="meta")
    names_before = [n for n, _ in model.named_parameters()]
    (conv,) = apply_converters(model, parse("--quantize.recipe=mxfp8"))
    got = converted_names(model)
    assert got == set(conv.converted)
    kinds = {kind for _, _, kind in convertible_modules(model)}
    assert kinds == set(KINDS)
    for name in got:
        leaf = name.rsplit(".", 1)[-1]
        assert leaf in {"wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "gate_proj", "up_proj", "down_proj", "experts"}, name
    args = get_flavor("motif3_debug")
    moe_layers = sum(isinstance(m, MoE) for m in model.modules())
    n_attn = args.num_hidden_layers + args.num_nextn_predict_layers
    dense_mlps = (args.num_hidden_layers - moe_layers) + args.num_nextn_predict_layers
    assert len(got) == 5 * n_attn + 3 * dense_mlps + moe_layers * (1 + 3)
    for name, module in model.named_modules():  # never: embedding, heads, router, norms, mHC, lambda, gates, MTP in
        if any(
            k in name for k in ("embed", "lm_head", "router", "norm", "mhc", "lambda_proj", "wq_b_gate", "input_proj")
        ):
            assert name not in got, name
        if type(module) is nn.Linear:
            assert name.endswith(("wq_b_gate", "input_proj")), name  # the only linears left in high precision
    assert [n for n, _ in model.named_parameters()] == names_before  # names (checkpoints, optimizer rules) kept
    assert all(p.is_meta for p in model.parameters())  # converted on meta, nothing allocated


def test_convert_selects_kinds_and_none_converts_nothing():
    model = debug_model(device="meta")
    apply_converters(model, parse("--quantize.recipe=fp8_rowwise", "--quantize.convert=routed_experts,shared_expert"))
    got = converted_names(model)
    assert got and all(".moe." in n for n in got)
    assert {type(m) for n, m in model.named_modules() if n.endswith(".experts")} == {LowPrecisionGroupedExperts}
    assert apply_converters(debug_model(device="meta"), parse("--quantize.recipe=none")) == []
    assert build_converter(parse("--quantize.recipe=auto")) is None  # CPU: auto is none


def test_on_cuda_misaligned_routed_experts_are_a_config_error_naming_the_layer_and_linears_all_convert():
    model = debug_model(device="meta")  # motif3_debug: hidden 64, kv_lora_rank 16, experts 64 x 32
    with pytest.raises(ConfigError, match=r"layers\.2\.moe\.experts.*multiples of 128.*fp8_rowwise: 16.*convert ="):
        LowPrecisionConverter("fp8_blockwise", KINDS, False, cuda=True).convert(model)
    pytest.importorskip("triton")  # binding the CUDA ops imports torchao and its triton kernels (no GPU needed)
    model = debug_model(device="meta")
    linears = ("attention", "dense_mlp", "shared_expert")
    conv = LowPrecisionConverter("fp8_blockwise", linears, False, cuda=True)
    conv.convert(model)  # nothing 128-aligned: every linear converts and runs on padded operands
    assert set(conv.converted) == {n for n, _, kind in convertible_modules(model) if kind in linears}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("hp_weight_grad", [False, True])
def test_a_linear_off_the_kernel_alignment_runs_padded_with_the_unpadded_numerics(recipe, hp_weight_grad):
    """Tokens, in and out features off the alignment (37 x 200 -> 72): `RecipeKernels.linear` zero-pads the
    operands, which changes no scale and adds only zero terms, so output and both gradients equal the emulation
    of the unpadded GEMM (fp32 summation order apart) and have the unpadded shapes."""
    torch.manual_seed(0)
    x = torch.randn(37, 200, requires_grad=True)
    w = (torch.randn(72, 200) * 0.05).requires_grad_()
    g = torch.randn(37, 72)
    y = RecipeKernels(recipe, hp_weight_grad, cuda=False).linear(x, w)
    y.backward(g)
    got = (y, x.grad, w.grad)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = emulated_linear(x2, w2, recipe, hp_weight_grad)
    y2.backward(g)
    for a, b in zip(got, (y2, x2.grad, w2.grad)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_past_the_last_group_rows_get_no_gradient():
    x = torch.randn(10, 4, requires_grad=True)
    offs = torch.tensor([3, 3, 7], dtype=torch.int32)
    _NoGradPastLastGroup.apply(x, offs).backward(torch.ones(10, 4))
    assert (x.grad[:7] == 1).all() and (x.grad[7:] == 0).all()


@pytest.mark.parametrize("recipe", RECIPES)
def test_converted_layers_match_within_the_quantisation_error_and_gradients_flow(recipe):
    """One attention block's projections and one MoE (experts + shared expert) against the same modules
    unconverted: a projection's output relative Frobenius error < 0.05 (two E4M3-quantized operands: ~0.037, see
    test_emulation); the MoE's < 0.1 (two quantized GEMMs in a row around PolyNorm: ~sqrt(2) x that), and the
    gradient of every converted weight < 0.15 (its GEMMs see the quantized upstream gradient as well)."""
    ref_model, model = debug_model(), debug_model()
    apply_converters(model, parse(f"--quantize.recipe={recipe}"))
    moe_ref, moe = ref_model.layers[2].moe, model.layers[2].moe
    x = torch.randn(2, 64, 64)
    y_ref, _ = moe_ref(x)
    y, _ = moe(x)
    assert isinstance(moe.experts, LowPrecisionGroupedExperts)
    assert 1e-3 < relative_error(y, y_ref) < 0.1
    g = torch.randn_like(y)
    y_ref.backward(g)
    y.backward(g)
    for (name, p_ref), p in zip(moe_ref.named_parameters(), moe.parameters()):
        if "router" in name or "act_fn" in name:
            continue
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert relative_error(p.grad, p_ref.grad) < 0.15, (name, relative_error(p.grad, p_ref.grad))
    lin_ref, lin = ref_model.layers[0].self_attn.wq_a, model.layers[0].self_attn.wq_a
    assert isinstance(lin, LowPrecisionLinear)
    x = torch.randn(4, 16, 64)
    assert 1e-3 < relative_error(lin(x), lin_ref(x)) < 0.05


def test_experts_pad_token_groups_to_the_kernel_alignment_inside_the_quantized_path():
    model = debug_model()
    apply_converters(model, parse("--quantize.recipe=mxfp8"))
    experts = model.layers[2].moe.experts
    seen = []
    real = experts.kernels.grouped_mm
    experts.kernels.grouped_mm = lambda x, w, offs: seen.append(offs.clone()) or real(x, w, offs)
    counts = torch.tensor([5, 0, 40] + [1] * 13)
    out = experts(torch.randn(int(counts.sum()), 64), counts)
    assert out.shape == (int(counts.sum()), 64)
    assert all((offs % 32 == 0).all() for offs in seen)  # every group starts and ends on a 32-row boundary
    assert GroupedExperts.forward.__qualname__ == "GroupedExperts.forward"  # moe.py unchanged: a subclass


@pytest.mark.parametrize(
    "save_recipe,load_recipe", [("fp8_rowwise", "mxfp8"), ("mxfp8", "none"), ("none", "fp8_blockwise")]
)
def test_a_dcp_checkpoint_saved_under_one_recipe_loads_under_another(tmp_path, save_recipe, load_recipe):
    saved = debug_model(seed=1)
    apply_converters(saved, parse(f"--quantize.recipe={save_recipe}"))
    dcp.save(saved.state_dict(), checkpoint_id=str(tmp_path / "ckpt"))
    loaded = debug_model(seed=2)
    apply_converters(loaded, parse(f"--quantize.recipe={load_recipe}"))
    state = loaded.state_dict()
    assert set(state) == set(saved.state_dict())
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    loaded.load_state_dict(state)
    for (name, a), b in zip(saved.state_dict().items(), loaded.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("recipe", RECIPES)
def test_motif3_debug_trains_with_a_falling_loss_under_every_recipe(tmp_path, recipe):
    from llm_training.config.job_config import PACKAGE_DIR
    from llm_training.distributed import ParallelDims
    from llm_training.trainer import train

    c = ConfigManager().parse_args(
        [
            "--job.config_file", str(PACKAGE_DIR / "motif" / "train_configs" / "debug_cpu.toml"),
            f"--job.dump_folder={tmp_path}", "--job.run_name=q", "--training.device=cpu",
            "--training.local_batch_size=2", "--training.seq_len=32", "--training.steps=20",
            "--lr_scheduler.warmup_steps=3", "--checkpoint.enable=false", "--metrics.log_freq=10",
            f"--quantize.recipe={recipe}",
        ]
    )  # fmt: skip
    result = train(c, ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=1), torch.device("cpu"))
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 1.0, (recipe, first, last)
