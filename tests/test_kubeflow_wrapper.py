"""run_train_kubeflow.sh: env handling, argument pass-through and errors (DRY_RUN prints the command).
The TrainJob manifest that calls it is tested in tests/deploy/test_kubeflow_trainjob.py."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "run_train_kubeflow.sh"
CONFIG = "llm_training/motif/train_configs/debug_cpu.toml"


def fake_nvidia_smi(folder: Path, n_gpus: int) -> str:
    """A PATH entry whose nvidia-smi -L lists n_gpus GPUs (0: fails like a machine without a driver)."""
    folder.mkdir(parents=True, exist_ok=True)
    fake = folder / "nvidia-smi"
    lines = "".join(f'echo "GPU {i}: NVIDIA H200 (UUID: GPU-{i})"\n' for i in range(n_gpus))
    fake.write_text("#!/bin/sh\n" + (lines if n_gpus else "exit 9\n"))
    fake.chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


def run_wrapper(env_extra: dict[str, str], *args: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_") and k not in ("CONFIG_FILE", "DRY_RUN")}
    env.update(env_extra)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=30)


def parse_cmd(stdout: str) -> list[str]:
    return shlex.split(stdout.strip())


def test_single_node_defaults(tmp_path):
    proc = run_wrapper({"CONFIG_FILE": CONFIG, "DRY_RUN": "1", "PATH": fake_nvidia_smi(tmp_path, 0)})
    assert proc.returncode == 0, proc.stderr
    cmd = parse_cmd(proc.stdout)
    opts = dict(zip(cmd[1:11:2], cmd[2:11:2]))
    assert cmd[0] == "torchrun"
    assert opts == {
        "--nnodes": "1",
        "--nproc_per_node": "1",
        "--node_rank": "0",
        "--master_addr": "127.0.0.1",
        "--master_port": "29500",
    }
    assert cmd[11:] == ["-m", "llm_training.train", "--job.config_file", CONFIG]


def test_kubeflow_env_and_overrides_pass_through():
    env = {
        "CONFIG_FILE": CONFIG,
        "DRY_RUN": "1",
        "PET_NNODES": "4",
        "PET_NPROC_PER_NODE": "8",
        "PET_NODE_RANK": "3",
        "PET_MASTER_ADDR": "job-node-0-0.job",
        "PET_MASTER_PORT": "29400",
    }
    proc = run_wrapper(env, "--training.steps=10", "--job.description", "two words")
    assert proc.returncode == 0, proc.stderr
    cmd = parse_cmd(proc.stdout)
    opts = dict(zip(cmd[1:11:2], cmd[2:11:2]))
    assert opts == {
        "--nnodes": "4",
        "--nproc_per_node": "8",
        "--node_rank": "3",
        "--master_addr": "job-node-0-0.job",
        "--master_port": "29400",
    }
    assert cmd[-3:] == ["--training.steps=10", "--job.description", "two words"]


def test_gpu_count_from_nvidia_smi(tmp_path):
    env = {"CONFIG_FILE": CONFIG, "DRY_RUN": "1", "PATH": fake_nvidia_smi(tmp_path, 3)}
    proc = run_wrapper(env)
    cmd = parse_cmd(proc.stdout)
    assert cmd[cmd.index("--nproc_per_node") + 1] == "3"
    env["PET_NPROC_PER_NODE"] = "auto"  # non-numeric: counted as well
    cmd = parse_cmd(run_wrapper(env).stdout)
    assert cmd[cmd.index("--nproc_per_node") + 1] == "3"


def test_missing_config_file_variable():
    proc = run_wrapper({"DRY_RUN": "1"})
    assert proc.returncode == 2 and "CONFIG_FILE is not set" in proc.stderr and proc.stdout == ""


def test_config_file_that_does_not_exist():
    proc = run_wrapper({"DRY_RUN": "1", "CONFIG_FILE": "nope.toml"})
    assert proc.returncode == 2 and "nope.toml does not exist" in proc.stderr
    assert "debug_cpu.toml" in proc.stderr  # lists the shipped configs
