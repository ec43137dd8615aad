"""Recipe selection (`auto` per GPU generation) and the `[quantize]` validation: a recipe the GPU cannot run,
or torchao missing on a CUDA run, fails at config time with the reason and the alternative."""

import pytest

from llm_training.config import ConfigError, ConfigManager
from llm_training.quantization import kernels, recipes
from llm_training.quantization.recipes import recipe_problem, resolve_recipe

SM100, SM90, SM89 = (10, 0), (9, 0), (8, 9)


def parse(*argv):
    return ConfigManager().parse_args(list(argv))


@pytest.mark.parametrize(
    "capability,expected", [(SM100, "mxfp8"), ((12, 0), "mxfp8"), (SM90, "fp8_rowwise"), (SM89, "none"), (None, "none")]
)
def test_auto_picks_mxfp8_on_blackwell_fp8_rowwise_on_hopper_none_elsewhere(capability, expected):
    assert resolve_recipe("auto", capability) == expected
    assert recipe_problem("auto", capability) is None


@pytest.mark.parametrize("recipe", ["none", "mxfp8", "fp8_rowwise", "fp8_blockwise"])
def test_explicit_recipes_are_kept_and_run_on_cpu(recipe):
    assert resolve_recipe(recipe, SM90) == recipe and resolve_recipe(recipe, None) == recipe
    assert recipe_problem(recipe, None) is None  # CPU: emulated


def test_which_gpu_runs_which_recipe():
    assert recipe_problem("mxfp8", SM100) is None
    assert recipe_problem("fp8_rowwise", SM100) is None and recipe_problem("fp8_blockwise", SM90) is None
    msg = recipe_problem("mxfp8", SM90)
    assert "SM90" in msg and "Blackwell" in msg and "'fp8_rowwise' or 'auto'" in msg
    msg = recipe_problem("fp8_rowwise", SM89)
    assert "SM89" in msg and "'none' or 'auto'" in msg


@pytest.fixture
def on_gpu(monkeypatch):
    """Pretend the job runs on a CUDA GPU of the given capability."""

    def set_capability(capability):
        monkeypatch.setattr("torch.cuda.is_available", lambda: True)
        monkeypatch.setattr(recipes, "cuda_capability", lambda: capability)

    return set_capability


def test_validation_rejects_mxfp8_on_sm90_naming_the_alternative(on_gpu, monkeypatch):
    monkeypatch.setattr(kernels, "torchao_problem", lambda: None)
    on_gpu(SM90)
    with pytest.raises(ConfigError, match=r"\[quantize\] recipe = 'mxfp8' needs .* SM90: use recipe = 'fp8_rowwise'"):
        parse("--quantize.recipe=mxfp8")
    assert parse("--quantize.recipe=fp8_rowwise").quantize.recipe == "fp8_rowwise"
    assert parse("--quantize.recipe=auto").quantize.recipe == "auto"
    on_gpu(SM100)
    assert parse("--quantize.recipe=mxfp8").quantize.recipe == "mxfp8"


def test_validation_names_the_torchao_install_on_a_cuda_run(on_gpu, monkeypatch):
    on_gpu(SM90)
    monkeypatch.setattr(
        kernels, "torchao_problem", lambda: f"torchao is not importable; install it: {kernels.TORCHAO_INSTALL}"
    )
    with pytest.raises(
        ConfigError, match=r"recipe = 'auto' on CUDA: torchao is not importable.*pip install torchao==0\.18\.0"
    ):
        parse("--quantize.recipe=auto")
    parse("--quantize.recipe=none")  # no conversion, no torchao needed
    parse("--quantize.recipe=fp8_rowwise", "--training.device=cpu")  # CPU: the emulation needs no torchao
    on_gpu(SM89)
    parse("--quantize.recipe=auto")  # auto is none there


def test_cpu_runs_accept_every_recipe_and_reject_an_empty_module_list():
    for recipe in ("mxfp8", "fp8_rowwise", "fp8_blockwise", "auto"):
        assert parse(f"--quantize.recipe={recipe}", "--training.device=cpu").quantize.recipe == recipe
    with pytest.raises(ConfigError, match=r"\[quantize\] convert is empty"):
        parse("--quantize.recipe=mxfp8", "--training.device=cpu", "--quantize.convert=")
    with pytest.raises(ConfigError, match="convert"):
        parse("--quantize.convert=router")


def test_torchao_018_is_importable_here():
    """The repo's CPU install (dev extra) brings torchao 0.18, so CI cross-checks the emulation against it."""
    import torchao

    assert torchao.__version__.startswith("0.18") and kernels.torchao_problem() is None
