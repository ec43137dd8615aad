"""What the config points at is checked up front: a missing data set or tokenizer, an empty data set, a
split that is not there and a missing optional package each exit 2 from the entrypoint with one message
naming the key and the fix, before any process-group, mesh or model work."""

from __future__ import annotations

import pytest

import llm_training.train as train_module
from llm_training.config.manager import TRAIN_CONFIGS_DIR

DEBUG_TOML = str(TRAIN_CONFIGS_DIR / "debug_cpu.toml")

pytestmark = pytest.mark.usefixtures("entrypoint_without_setup")  # tests/config/conftest.py


def _error(capsys, *overrides) -> str:
    assert train_module.main(["--job.config_file", DEBUG_TOML, *overrides]) == 2
    err = capsys.readouterr().err
    assert err.count("config error") == 1
    return err


def test_missing_dataset_path(tmp_path, capsys):
    err = _error(capsys, f"--training.dataset_path={tmp_path / 'nope.jsonl'}")
    assert "[training] dataset_path" in err and "nope.jsonl' does not exist" in err


def test_missing_tokenizer_path(tmp_path, capsys):
    err = _error(capsys, f"--model.tokenizer_path={tmp_path / 'no_tokenizer'}")
    assert "[model] tokenizer_path" in err and "is not a directory" in err and "bundled" in err


def test_empty_dataset(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "b.jsonl").write_text("\n  \n")
    err = _error(capsys, f"--training.dataset_path={tmp_path}")
    assert "[training] dataset_path" in err and "has no records (2 jsonl file(s), all empty)" in err


def test_split_not_in_the_dataset(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    turns = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"conversations": turns})}).save_to_disk(tmp_path)
    err = _error(capsys, f"--training.dataset_path={tmp_path}", "--huggingface_dataset.split=validation")
    assert "[huggingface_dataset] split: 'validation' is not in" in err and "available splits: ['train']" in err


def test_validation_enabled_without_dataset_path(capsys):
    err = _error(capsys, "--validation.enable")
    assert "[validation] enable = true needs [validation] dataset_path" in err


def test_missing_validation_dataset_path(tmp_path, capsys):
    err = _error(capsys, "--validation.enable", f"--validation.dataset_path={tmp_path / 'held_out.jsonl'}")
    assert "[validation] dataset_path" in err and "held_out.jsonl' does not exist" in err
    assert "[training] dataset_path" not in err


def test_validation_split_not_in_the_dataset(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    turns = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"conversations": turns})}).save_to_disk(tmp_path)
    err = _error(
        capsys, "--validation.enable", f"--validation.dataset_path={tmp_path}", "--validation.split=validation"
    )
    assert "[validation] split: 'validation' is not in" in err and "available splits: ['train']" in err


@pytest.mark.parametrize("flag, package", [("enable_tensorboard", "tensorboard"), ("enable_wandb", "wandb")])
def test_missing_optional_package(flag, package, capsys, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == package else real_find_spec(name, *a)
    )
    err = _error(capsys, f"--metrics.{flag}")
    assert f"[metrics] {flag} = true needs the {package} package" in err and f"pip install {package}" in err


def test_fused_mhc_backward_needs_cuda_and_triton(capsys, monkeypatch):
    """On the CPU (or without triton) `mhc_backward = 'fused'` exits 2 naming the key and the alternative."""
    monkeypatch.setattr("activation.backend.TRITON_AVAILABLE", True)  # the device alone decides here
    err = _error(capsys, "--kernels.mhc_backward=fused")  # debug_cpu.toml: device = "cpu"
    assert "[kernels] mhc_backward = 'fused'" in err and "needs a CUDA device" in err and "'tensor_ops'" in err


@pytest.mark.parametrize("key,fallback", [("activations", "auto"), ("muon_gram", "torch")])
def test_triton_kernel_choices_need_cuda_and_triton(capsys, key, fallback):
    err = _error(capsys, f"--kernels.{key}=triton")  # debug_cpu.toml: device = "cpu"
    assert f"[kernels] {key} = 'triton'" in err and "needs a CUDA device" in err and f"'{fallback}'" in err
