"""Cross-field validation (with and without the world size) and the shipped train configs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from llm_training.config import ConfigError, ConfigManager, grad_accumulation_steps, validate_for_world_size
from llm_training.config.manager import TRAIN_CONFIGS_DIR
from llm_training.distributed import ParallelDims


def parse(*argv: str):
    return ConfigManager().parse_args(list(argv))


def test_unknown_flavor_lists_valid_flavors():
    with pytest.raises(ConfigError) as e:
        parse("--model.flavor=motif3_huge")
    msg = str(e.value)
    assert "'motif3_huge'" in msg
    for name in ("motif3_seq", "motif3_small", "motif3_debug", "motif3_proxy", "motif3_seq_256k_mtp1_sft"):
        assert name in msg


def test_warmup_longer_than_training():
    with pytest.raises(ConfigError) as e:
        parse("--training.steps=10", "--lr_scheduler.warmup_steps=20")
    assert "warmup_steps = 20" in str(e.value) and "steps = 10" in str(e.value)


def test_sublayer_compile_needs_no_activation_checkpointing():
    parse("--compile.enable", "--compile.granularity=sublayer", "--activation_checkpoint.mode=none")
    parse("--compile.enable", "--activation_checkpoint.mode=full")  # the default, auto, fits every mode
    with pytest.raises(ConfigError) as e:
        parse("--compile.enable", "--compile.granularity=sublayer", "--activation_checkpoint.mode=full")
    msg = str(e.value)
    assert "[compile] granularity = 'sublayer'" in msg and "[activation_checkpoint] mode = 'none'" in msg
    assert "'full'" in msg


def test_prebuild_workers_must_not_be_negative():
    assert parse("--compile.prebuild_workers=0").compile.prebuild_workers == 0
    with pytest.raises(ConfigError) as e:
        parse("--compile.prebuild_workers=-1")
    assert "[compile] prebuild_workers must be >= 0" in str(e.value) and "got -1" in str(e.value)


def test_seq_len_beyond_flavor_context():
    with pytest.raises(ConfigError) as e:
        parse("--training.seq_len=512")  # motif3_debug has max_seq_len 256
    assert "seq_len = 512" in str(e.value) and "max_seq_len 256" in str(e.value)


def test_seq_len_not_divisible_by_context_parallel():
    with pytest.raises(ConfigError) as e:
        parse("--training.seq_len=250", "--parallelism.context_parallel_degree=4")
    assert "seq_len = 250" in str(e.value) and "context_parallel_degree = 4" in str(e.value)


def test_context_parallel_plan_checks_name_the_keys():
    """Ulysses falls back to ring when the heads do not split (motif3_debug: 2 KV heads, 2 noise groups), and ring's
    halo needs sliding_window <= seq_len / (2 cp): check_context_parallel's rules, as ConfigErrors."""
    c = parse("--training.seq_len=128", "--parallelism.context_parallel_degree=4")  # -> ring: 128 / 8 = 16 = W
    assert c.parallelism.context_parallel_degree == 4
    with pytest.raises(ConfigError) as e:  # ring at cp 4: chunks of 64 / 8 = 8 < W = 16
        parse("--training.seq_len=64", "--parallelism.context_parallel_degree=4")
    assert "sliding_window" in str(e.value) and "context_parallel_degree = 4" in str(e.value)
    parse("--training.seq_len=64", "--parallelism.context_parallel_degree=2")  # Ulysses: 2 KV heads, 2 groups
    with pytest.raises(ConfigError) as e:
        parse(
            "--training.seq_len=66",
            "--parallelism.context_parallel_degree=2",
            "--parallelism.context_parallel_mode=ring",
        )
    assert "seq_len = 66" in str(e.value) and "zigzag" in str(e.value)


def test_ep_must_divide_experts():
    with pytest.raises(ConfigError) as e:
        parse("--parallelism.expert_parallel_degree=3")  # 16 experts
    assert "expert_parallel_degree = 3" in str(e.value) and "16 experts" in str(e.value)


def test_global_batch_not_multiple_of_local():
    with pytest.raises(ConfigError) as e:
        parse("--training.global_batch_size=12")  # local 8
    assert "global_batch_size = 12" in str(e.value) and "local_batch_size = 8" in str(e.value)


@pytest.mark.parametrize(
    "arg, key",
    [
        ("--training.local_batch_size=0", "local_batch_size"),
        ("--optimizer.lr=0", "lr"),
        ("--optimizer.adamw_betas=0.9", "adamw_betas"),
        ("--lr_scheduler.min_lr_factor=1.5", "min_lr_factor"),
        ("--checkpoint.interval=0", "interval"),
        ("--metrics.log_freq=0", "log_freq"),
        ("--job.run_name=a/b", "run_name"),
        ("--parallelism.data_parallel_shard_degree=0", "data_parallel_shard_degree"),
        ("--validation.freq=0", "[validation] freq"),
        ("--validation.steps=-1", "[validation] steps"),
    ],
)
def test_out_of_range_values_name_the_key(arg, key):
    with pytest.raises(ConfigError) as e:
        parse(arg)
    assert key in str(e.value)


@pytest.mark.parametrize("value", ["expandable_segments", "expandable_segments:True,", ":True", "a:b:c"])
def test_cuda_allocator_that_is_not_key_value_pairs_names_the_key(value):
    with pytest.raises(ConfigError, match=r"\[training\] cuda_allocator = .* is not key:value"):
        parse(f"--training.cuda_allocator={value}")


def test_cuda_allocator_defaults_to_expandable_segments_and_takes_pairs_or_nothing():
    assert parse().training.cuda_allocator == "expandable_segments:True"
    for value in ("", "expandable_segments:True,garbage_collection_threshold:0.8",
                  "roundup_power2_divisions:[256:1,512:2,>:8],expandable_segments:False"):  # fmt: skip
        assert parse(f"--training.cuda_allocator={value}").training.cuda_allocator == value


def test_validation_enabled_without_dataset_path_names_the_key():
    with pytest.raises(ConfigError) as e:
        parse("--validation.enable")
    assert "[validation] dataset_path" in str(e.value) and "enable = false" in str(e.value)


def test_choice_sets_are_the_registries():
    """The config accepts exactly what is implemented: flavors, attention backends, quantization recipes and
    activation-checkpoint modes come from the registries that implement them."""
    from activation.backend import BACKENDS as ACTIVATION_BACKENDS
    from optimizer.newton_schulz import GRAM_BACKENDS

    from llm_training.config.job_config import ActivationCheckpoint, Kernels, Model, Parallelism, Quantize
    from llm_training.distributed.activation_checkpoint import AC_MODES
    from llm_training.distributed.context_parallel import CP_MODES
    from llm_training.distributed.expert_parallel import DISPATCHERS
    from llm_training.layers.attention.backends import ATTENTION_BACKENDS
    from llm_training.motif import MODEL_FLAVORS
    from llm_training.quantization import MODULE_KINDS, RECIPES

    def choices(cls, name):
        return next(f.metadata["choices"] for f in dataclasses.fields(cls) if f.name == name)

    assert choices(Kernels, "attention") == tuple(ATTENTION_BACKENDS)
    assert choices(Kernels, "activations") == ACTIVATION_BACKENDS and choices(Kernels, "muon_gram") == GRAM_BACKENDS
    assert choices(Model, "flavor") == tuple(MODEL_FLAVORS)
    assert choices(Quantize, "recipe") == RECIPES
    assert choices(Quantize, "convert") == MODULE_KINDS
    assert choices(ActivationCheckpoint, "mode") == AC_MODES
    assert choices(Parallelism, "expert_parallel_dispatcher") == tuple(DISPATCHERS)
    assert choices(Parallelism, "context_parallel_mode") == CP_MODES
    for bad in ("--kernels.attention=varlen", "--quantize.recipe=fp8"):
        with pytest.raises(ConfigError) as e:
            parse(bad)
        key, value = bad[2:].split("=")
        assert f"{key.split('.')[1]}: {value!r}" in str(e.value) and "is not one of" in str(e.value)


def test_expert_parallel_dispatcher_availability():
    assert parse("--parallelism.expert_parallel_degree=2").parallelism.expert_parallel_dispatcher == "all_to_all"
    with pytest.raises(ConfigError) as e:  # rejected up front, whether or not DeepEP is installed
        parse("--parallelism.expert_parallel_dispatcher=deepep", "--training.deterministic")
    assert "deepep" in str(e.value) and "deterministic" in str(e.value)
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError) as e:
            parse("--parallelism.expert_parallel_dispatcher=deepep")
        assert "needs DeepEP, which cannot be imported" in str(e.value)


def test_world_size_layout_errors():
    c = parse("--parallelism.data_parallel_replicate_degree=2", "--parallelism.data_parallel_shard_degree=2")
    with pytest.raises(ConfigError) as e:
        validate_for_world_size(c, 8)
    assert "= 4 must equal the world size 8" in str(e.value)
    c = parse("--parallelism.data_parallel_replicate_degree=3")
    with pytest.raises(ConfigError) as e:
        validate_for_world_size(c, 8)
    assert "not divisible" in str(e.value) and "= 3" in str(e.value)
    with pytest.raises(ConfigError) as e:  # the layout arithmetic of ParallelDims itself
        ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=4, world_size=2)
    assert "expert_parallel_degree = 4" in str(e.value)


def test_world_size_global_batch():
    c = parse("--training.global_batch_size=48")  # 48 = 8 x 6
    with pytest.raises(ConfigError) as e:
        validate_for_world_size(c, 4)  # 8 x 4 = 32 does not divide 48
    assert "global_batch_size = 48" in str(e.value) and "32" in str(e.value)
    c = parse("--training.global_batch_size=64")
    dims = validate_for_world_size(c, 4)
    assert dims.dp_size == 4 and grad_accumulation_steps(c, dims.dp_size) == 2


SHIPPED = {  # config -> the world size it is written for
    "debug_cpu.toml": 1,
    "h200_small.toml": 1,
    "example_c4_pretrain.toml": 32,
    "example_c4_sft.toml": 32,
}


def test_every_shipped_config_is_covered():
    assert sorted(p.name for p in TRAIN_CONFIGS_DIR.glob("*.toml")) == sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_configs_validate(name):
    world = SHIPPED[name]
    dims = validate_for_world_size(parse("--job.config_file", str(TRAIN_CONFIGS_DIR / name)), world)
    assert dims.dp_shard * dims.dp_replicate * dims.cp == world


def test_example_layouts():
    """The layouts the two production examples describe at 32 ranks: pretrain FSDP 32 x EP 8 (MXFP8, which
    validates off a GPU: on CPU it runs emulated), SFT EP 8 x CP 16 at 256K tokens."""
    pre = parse("--job.config_file", str(TRAIN_CONFIGS_DIR / "example_c4_pretrain.toml"))
    d = validate_for_world_size(pre, 32)
    assert (d.dp_shard, d.cp, d.ep, pre.training.seq_len) == (32, 1, 8, 4096)
    assert grad_accumulation_steps(pre, d.dp_size) * pre.training.local_batch_size * d.dp_size == 256
    sft = parse("--job.config_file", str(TRAIN_CONFIGS_DIR / "example_c4_sft.toml"))
    d = validate_for_world_size(sft, 32)
    assert (d.dp_shard, d.cp, d.ep, sft.training.seq_len) == (2, 16, 8, 262144)


def test_pretrain_and_sft_examples_comment_every_key():
    """The two production examples document each key on its own line (a trailing # comment)."""
    for name in ("example_c4_pretrain.toml", "example_c4_sft.toml"):
        for lineno, line in enumerate((TRAIN_CONFIGS_DIR / name).read_text().splitlines(), 1):
            if "=" in line and not line.lstrip().startswith("#"):
                assert "#" in line.split("=", 1)[1], f"{name}:{lineno} has no comment: {line!r}"


def test_docs_config_md_is_up_to_date():
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("gen_config_docs", root / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (root / "docs" / "config.md").read_text() == module.render(), (
        "docs/config.md is stale: run `python scripts/gen_config_docs.py`"
    )


def test_a_key_that_moved_to_kernels_names_its_new_place(tmp_path):
    with pytest.raises(ConfigError, match=r"\[model\] attention_backend .* moved to \[kernels\] attention"):
        parse("--model.attention_backend=sdpa")
    toml = tmp_path / "old.toml"
    toml.write_text('[model]\nmhc_backward = "fused"\n')
    with pytest.raises(ConfigError, match=r"old.toml:2\) moved to \[kernels\] mhc_backward"):
        ConfigManager().parse_args(["--job.config_file", str(toml), "--training.device=cpu"])


def test_kernel_choices_reach_the_activation_and_optimizer_packages(monkeypatch):
    """build_components applies [kernels] activations / muon_gram process-wide; the environment variables, when
    set, still win (the documented override)."""
    import importlib

    import torch
    from activation import backend

    from llm_training.distributed import ParallelDims
    from llm_training.motif.spec import MOTIF3_SPEC
    from llm_training.trainer.components import build_components

    monkeypatch.delenv("ACTIVATION_BACKEND", raising=False)
    monkeypatch.delenv("MUON_GRAM_BACKEND", raising=False)
    monkeypatch.setattr(backend, "_configured", "auto")
    newton_schulz = importlib.import_module("optimizer.newton_schulz")  # the package exports a function of that name
    monkeypatch.setattr(newton_schulz, "_gram_backend", "torch")
    c = parse("--kernels.activations=torch")
    build_components(MOTIF3_SPEC, c, ParallelDims(1, -1, 1, 1, 1), torch.device("cpu"))
    assert backend.requested_backend() == "torch" and newton_schulz._gram_backend == "torch"
    monkeypatch.setenv("ACTIVATION_BACKEND", "auto")
    assert backend.requested_backend() == "auto"
