"""End-to-end demo: the debug_cpu config (motif3_debug on the bundled chat data, Muon + QK-clip, MTP)
trains with a clearly falling loss, writes metrics and checkpoints, and a checkpoint exports to HF."""

import json

import pytest
import torch

from llm_training.config import ConfigManager
from llm_training.config.job_config import PACKAGE_DIR
from llm_training.convert import main as convert_main
from llm_training.distributed import ParallelDims
from llm_training.trainer import train


@pytest.mark.slow
def test_debug_cpu_demo_loss_falls_and_outputs_exist(tmp_path):
    cfg = ConfigManager().parse_args([
        "--job.config_file", str(PACKAGE_DIR / "motif" / "train_configs" / "debug_cpu.toml"),
        f"--job.dump_folder={tmp_path}", "--training.steps=30", "--training.local_batch_size=4",
        "--training.seq_len=64", "--lr_scheduler.warmup_steps=5", "--checkpoint.interval=15",
        "--metrics.log_freq=5",
    ])  # fmt: skip
    result = train(cfg, ParallelDims(1, -1, 1, 1, 1), torch.device("cpu"))
    losses = [result.losses[s] for s in sorted(result.losses)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, (first, last)  # from ~ln(2048)+0.3*ln(2048) ~ 9.9 down by well over 1 nat
    lines = [json.loads(x) for x in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in lines] == [5, 10, 15, 20, 25, 30]
    assert result.last_checkpoint.name == "step-30"
    assert convert_main(["dcp-to-hf", str(result.last_checkpoint), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
