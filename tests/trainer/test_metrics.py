"""MetricsLogger: one JSONL record per log_freq steps with throughput / TFLOP/s computed from the FLOP
counter, window means, skipped / QK-clip totals, MFU n/a on CPU; expert-load imbalance."""

import json

import pytest
import torch

from llm_training.motif import get_flavor, training_flops_per_token
from llm_training.trainer.metrics import (
    MFU_CONVENTIONS,
    MetricsLogger,
    StepRecord,
    format_eta,
    peak_bf16_flops,
)

ARGS = get_flavor("motif3_debug")


def flops_by_convention(seq_len):
    """The per-convention FLOPs/token the trainer hands the logger (through ModelSpec.flops_per_token)."""
    return {c: training_flops_per_token(ARGS, seq_len, c) for c in MFU_CONVENTIONS}


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
        flops_by_convention(64),
        total_steps=4,
        log_freq=2,
        run_folder=tmp_path,
        device=torch.device("cpu"),
        world_size=2,
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


def _strict_json(line: str):
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(line, parse_constant=refuse)


def test_jsonl_is_strict_json_with_null_for_non_finite(tmp_path):
    log = MetricsLogger(
        flops_by_convention(64), total_steps=2, log_freq=1, run_folder=tmp_path, device=torch.device("cpu")
    )
    log.record(_rec(1, float("nan"), skipped=True))
    bad = _rec(2, float("inf"), skipped=True)
    bad.grad_norm = float("-inf")
    log.record(bad)
    log.close()
    lines = [_strict_json(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in lines] == [(1, None, 2.0), (2, None, None)]


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0, "0d 00:00:00"),
        (59.6, "0d 00:01:00"),
        (86399, "0d 23:59:59"),
        (3 * 86400 + 5, "3d 00:00:05"),
        (float("inf"), "n/a"),
    ],
)
def test_eta_does_not_wrap_at_a_day(seconds, text):
    assert format_eta(seconds) == text


def test_resumed_logger_drops_the_records_after_its_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    log = MetricsLogger(
        flops_by_convention(64),
        total_steps=5,
        log_freq=1,
        run_folder=tmp_path,
        device=torch.device("cpu"),
        start_step=3,
    )
    for step in (4, 5):
        log.record(_rec(step, 2.0))
    log.close()
    lines = [_strict_json(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5] and [r["loss"] for r in lines] == [1.0] * 3 + [2.0] * 2


class _Crash(Exception):
    pass


def test_trainer_metrics_one_record_per_step_across_a_crash_and_lr_of_the_step(make_config):
    from llm_training.distributed import ParallelDims
    from llm_training.trainer import Trainer, train

    dims = ParallelDims(1, -1, 1, 1, 1)
    config = ("--training.steps=4", "--checkpoint.interval=2", "--optimizer.name=adamw", "--optimizer.lr=3e-3")
    crashed = Trainer(make_config(*config), dims, torch.device("cpu"))

    def crash_at_step_4(module, args):
        if crashed.train_state.step == 4:
            raise _Crash

    crashed.model.register_forward_pre_hook(crash_at_step_4)
    with pytest.raises(_Crash):
        crashed.fit()
    metrics = crashed.run_folder / "metrics.jsonl"
    assert [_strict_json(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2, 3]
    train(make_config(*config), dims, torch.device("cpu"))  # resumes from step 2
    lines = [_strict_json(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    # warmup over 2 steps, then cosine down to 0.1 x at the last step: the rates steps 1..4 trained with
    assert [r["lr"] for r in lines] == pytest.approx([1.5e-3, 3e-3, 1.65e-3, 3e-4])


def test_true_throughput_counts_only_real_tokens_and_reports_packing(tmp_path, monkeypatch):
    """tokens/s counts every position of the rows; the real figure and its MFU only the documents' tokens, and the
    packing efficiency is their share over the logging interval (a record without the count reports n/a)."""
    from llm_training.trainer import metrics as metrics_module

    monkeypatch.setattr(metrics_module, "peak_bf16_flops", lambda device: 1e12)  # an MFU to scale
    log = MetricsLogger(
        flops_by_convention(64), total_steps=3, log_freq=2, run_folder=tmp_path, device=torch.device("cpu")
    )
    for step, real in ((1, 900), (2, 600), (3, None)):
        rec = _rec(step, 2.0)
        rec.real_tokens = real
        log.record(rec)
    log.close()
    first, second = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert first["tokens_per_s"] == 2000.0 and first["packing_efficiency"] == pytest.approx(0.75)  # 1500 / 2000
    assert first["real_tokens_per_s"] == pytest.approx(1500.0)
    assert first["real_mfu_megatron"] == pytest.approx(0.75 * first["mfu_megatron"])
    assert second["packing_efficiency"] is None and second["real_tokens_per_s"] is None
