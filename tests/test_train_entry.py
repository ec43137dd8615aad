"""The entrypoint: config errors exit 2, --job.print_config, the resolved-config dump, python -m and torchrun."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llm_training.config import ConfigManager
from llm_training.config.manager import TRAIN_CONFIGS_DIR
from llm_training.motif import get_flavor, param_counts
from llm_training.train import main

DEBUG_TOML = str(TRAIN_CONFIGS_DIR / "debug_cpu.toml")
# keep runs short once run() trains: 2 steps, no checkpoints
SHORT = ["--training.steps=2", "--lr_scheduler.warmup_steps=1", "--checkpoint.enable=false"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def single_process_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    handlers, level = logging.root.handlers[:], logging.root.level
    yield
    logging.root.handlers[:] = handlers  # main() points logging at this test's captured stdout
    logging.root.setLevel(level)


def test_main_writes_resolved_config_that_loads_back(tmp_path, capsys):
    argv = ["--job.config_file", DEBUG_TOML, "--job.dump_folder", str(tmp_path), *SHORT]
    rc = main(argv)
    assert rc == 0
    out = capsys.readouterr().out
    counts = param_counts(get_flavor("motif3_debug"))
    assert f"total params {counts.total:,}" in out and f"active params/token {counts.active:,}" in out
    dumped = tmp_path / "debug_cpu" / "config.toml"
    assert dumped.is_file()
    original = ConfigManager().parse_args(argv)
    back = ConfigManager().parse_args(["--job.config_file", str(dumped)])
    back.job.config_file = original.job.config_file
    assert back == original


def test_config_error_exits_2_with_message(capsys):
    assert main(["--job.config_file", DEBUG_TOML, "--training.stesp=3"]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and "did you mean 'steps'" in err


def test_world_size_error_exits_2_before_distributed_init(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    assert main(["--job.config_file", DEBUG_TOML, "--parallelism.data_parallel_shard_degree=2"]) == 2
    assert "must equal the world size 3" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["example_c4_pretrain.toml", "example_c4_sft.toml"])
def test_bad_override_of_an_example_is_rejected_before_any_setup(name, monkeypatch, capsys):
    """A layout mistake on top of a production example (EP 5 does not divide 384 experts) exits 2 with the key and
    the fix, before any process group, device, tokenizer or data work (any of those would raise here)."""
    import llm_training.train as entry

    def forbidden(*args, **kwargs):
        raise AssertionError("setup work before the config was rejected")

    monkeypatch.setenv("WORLD_SIZE", "32")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(entry, "setup_distributed", forbidden)
    monkeypatch.setattr(entry, "run", forbidden)
    argv = ["--job.config_file", str(TRAIN_CONFIGS_DIR / name), "--parallelism.expert_parallel_degree=5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and "expert_parallel_degree = 5" in err and "Traceback" not in err
    assert "pick a divisor of 384" in err


def test_print_config_prints_toml_and_writes_nothing(tmp_path, capsys):
    import tomllib

    rc = main(["--job.config_file", DEBUG_TOML, "--job.print_config", "--job.dump_folder", str(tmp_path)])
    assert rc == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert printed["model"]["flavor"] == "motif3_debug" and printed["training"]["steps"] == 200
    assert printed["job"]["print_config"] is False  # the printed text is a usable config file
    assert not any(tmp_path.iterdir())


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_python_dash_m_on_the_demo_config(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llm_training.train",
            "--job.config_file",
            DEBUG_TOML,
            "--job.dump_folder",
            str(tmp_path),
            *SHORT,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "total params" in proc.stdout and "FLOPs/token" in proc.stdout
    assert (tmp_path / "debug_cpu" / "config.toml").is_file()


def test_torchrun_two_cpu_ranks(tmp_path, free_port):
    port = free_port
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        "-m",
        "llm_training.train",
        "--job.config_file",
        DEBUG_TOML,
        "--job.dump_folder",
        str(tmp_path),
        *SHORT,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dp_shard 2" in proc.stdout and "on 2 ranks" in proc.stdout
    assert not [line for line in proc.stdout.splitlines() if "[rank1]" in line and " INFO " in line]  # rank 0 only
