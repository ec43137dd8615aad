"""MetricsLogger: one JSONL record per log_freq steps with throughput / TFLOP/s computed from the FLOP
counter, window means, skipped / QK-clip totals, MFU n/a on CPU; expert-load imbalance."""

import json

import pytest
import torch

from llm_training.motif import get_flavor, training_flops_per_token
from llm_training.trainer.metrics import MetricsLogger, StepRecord, peak_bf16_flops

ARGS = get_flavor("motif3_debug")


def _rec(step, loss, skipped=False, qk=0):
    return StepRecord(
        step=step,
        loss=loss,
        ce_loss=loss - 1,
        mtp_loss=1.0,
        balance_loss=0.0,
        grad_norm=2.0,
        lr=1e-3 * step,
        tokens=1000,
        step_time_s=0.5,
        expert_imbalance=1.5 + step,
        qk_clip_events=qk,
        skipped=skipped,
    )


def test_jsonl_records_and_throughput(tmp_path):
    log = MetricsLogger(
        ARGS, seq_len=64, total_steps=4, log_freq=2, run_folder=tmp_path, device=torch.device("cpu"), world_size=2
    )
    for step, loss in ((1, 5.0), (2, 3.0), (3, float("nan")), (4, 2.0)):
        log.record(_rec(step, loss, skipped=step == 3, qk=1 if step == 4 else 0))
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [2, 4]
    first, second = lines
    assert first["loss"] == 4.0 and second["loss"] == 2.0  # the skipped step is left out of the mean
    assert first["tokens_per_s"] == 2000.0  # 2 x 1000 tokens in 2 x 0.5 s
    flops = training_flops_per_token(ARGS, 64, "megatron")
    assert first["tflops_per_gpu_megatron"] == pytest.approx(2000.0 * flops / 2 / 1e12)
    assert first["mfu_megatron"] is None and first["mfu_torchtitan"] is None  # CPU: no peak
    assert second["skipped_steps"] == 1 and second["qk_clip_events"] == 1 and second["lr"] == 4e-3
    assert second["expert_imbalance_max_over_mean"] == 5.5 and second["eta_s"] == 0.0


def test_peak_flops_cpu_is_none():
    assert peak_bf16_flops(torch.device("cpu")) is None
