"""Tiny training configs for the trainer tests (motif3_debug, 2 x 32 tokens per step, CPU)."""

import pytest

from llm_training.config import ConfigManager
from llm_training.config.job_config import PACKAGE_DIR

DEBUG_CPU_TOML = PACKAGE_DIR / "motif" / "train_configs" / "debug_cpu.toml"


def tiny_config(dump_folder, *overrides):
    argv = [
        "--job.config_file", str(DEBUG_CPU_TOML),
        f"--job.dump_folder={dump_folder}", "--job.run_name=t",
        "--training.local_batch_size=2", "--training.seq_len=32", "--training.steps=6",
        "--training.deterministic", "--lr_scheduler.warmup_steps=2",
        "--checkpoint.interval=3", "--checkpoint.keep_latest_k=0", "--metrics.log_freq=1",
        *overrides,
    ]  # fmt: skip
    return ConfigManager().parse_args(argv)


@pytest.fixture
def make_config(tmp_path):
    return lambda *overrides: tiny_config(tmp_path, *overrides)
