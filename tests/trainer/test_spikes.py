"""Loss spikes ([loss_spike]): the detector (warmup, detection, noise, consecutive count, state round-trip), the
config checks, and CPU runs with an injected spike: policy skip leaves the weights of a skipped step, policy
rollback reloads the last checkpoint and does not read the spike's batches again; the checkpoint keeps the
detector's state."""

import dataclasses
import json
import random

import pytest
import torch

import llm_training.trainer.losses as losses_module
from llm_training.config import ConfigError
from llm_training.distributed import ParallelDims
from llm_training.trainer import LossSpikeError, Trainer
from llm_training.trainer.checkpoint import complete_steps
from llm_training.trainer.spikes import LossSpikeDetector

DIMS = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=1)
CPU = torch.device("cpu")
SPIKE_ON = (
    "--loss_spike.enable",
    "--loss_spike.loss_factor=2.0",
    "--loss_spike.window=2",
    "--loss_spike.warmup_steps=2",
    "--optimizer.name=adamw",
)


# ------------------------------------------------------------------------------ the detector
def _detector(warmup=3, window=4, grad_norm_factor=0.0):
    return LossSpikeDetector(loss_factor=2.0, grad_norm_factor=grad_norm_factor, window=window, warmup_steps=warmup)


def test_no_detection_during_warmup():
    d = _detector(warmup=3)
    assert [d.check(s, loss, 1.0) for s, loss in ((1, 10.0), (2, 100.0), (3, 1000.0))] == [None, None, None]
    assert d.total == 0 and d.good_steps == 3


def test_spike_detected_and_kept_out_of_the_average():
    d = _detector(warmup=3)
    for s in (1, 2, 3):
        d.check(s, 10.0, 1.0)
    reason = d.check(4, 25.0, 1.0)
    assert reason is not None and "loss 25" in reason and "moving average 10" in reason
    assert d.averages() == (10.0, 1.0) and d.total == 1 and d.consecutive == 1
    assert d.check(5, 19.0, 1.0) is None and d.consecutive == 0  # below 2 x 10


def test_normal_noise_is_not_a_spike():
    rng = random.Random(0)
    d = _detector(warmup=5, window=50, grad_norm_factor=5.0)
    verdicts = [d.check(s, 3.0 + rng.uniform(-0.5, 0.5), 1.0 + rng.uniform(-0.3, 0.3)) for s in range(1, 500)]
    assert verdicts == [None] * len(verdicts)


def test_grad_norm_test_only_when_its_factor_is_set():
    off, on = _detector(warmup=1), _detector(warmup=1, grad_norm_factor=5.0)
    for d in (off, on):
        d.check(1, 10.0, 1.0)
    assert off.check(2, 10.0, 50.0) is None
    assert "grad norm 50" in on.check(2, 10.0, 50.0)


def test_consecutive_count_resets_only_past_the_last_spike():
    d = _detector(warmup=1)
    d.check(1, 10.0, 1.0)
    d.check(2, 100.0, 1.0)
    d.check(3, 100.0, 1.0)
    assert d.consecutive == 2 and d.last_spike_step == 3
    d.check(2, 10.0, 1.0)  # a step trained again after a rollback: not past the spike
    assert d.consecutive == 2
    d.check(4, 10.0, 1.0)
    assert d.consecutive == 0 and d.total == 2


def test_state_round_trip_detects_the_same():
    a = _detector(warmup=2, window=3)
    for s, loss in enumerate((10.0, 11.0, 9.0, 10.5, 50.0), start=1):
        a.check(s, loss, 1.0)
    b = _detector(warmup=2, window=3)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict()
    for s, loss in ((6, 21.0), (7, 19.0), (8, 40.0)):
        assert a.check(s, loss, 1.0) == b.check(s, loss, 1.0)
    assert b.state_dict() == a.state_dict()


# ------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "overrides, named",
    [
        (("--loss_spike.policy=rollback", "--checkpoint.enable=false"), "[checkpoint] enable"),
        (("--loss_spike.loss_factor=1.0",), "loss_factor"),
        (("--loss_spike.grad_norm_factor=0.5",), "grad_norm_factor"),
        (("--loss_spike.window=0",), "window"),
        (("--loss_spike.max_consecutive=0",), "max_consecutive"),
    ],
)
def test_bad_loss_spike_settings_are_config_errors(make_config, overrides, named):
    with pytest.raises(ConfigError, match="loss_spike") as e:
        make_config("--loss_spike.enable", *overrides)
    assert named in str(e.value)


def test_rollback_without_checkpoints_exits_2(capsys):
    from llm_training.config.manager import TRAIN_CONFIGS_DIR
    from llm_training.train import main

    argv = [
        "--job.config_file",
        str(TRAIN_CONFIGS_DIR / "debug_cpu.toml"),
        "--loss_spike.enable",
        "--loss_spike.policy=rollback",
    ]
    assert main([*argv, "--checkpoint.enable=false"]) == 2
    assert "policy = 'rollback'" in capsys.readouterr().err


# ------------------------------------------------------------------------------ training runs
def _spiked(loss, factor: float):
    """`loss` with its value (total and CE) `factor` times larger. The backward still sees upstream gradient 1, as
    the trainer's head-gradient accumulation requires (trainer/losses.py `HeadGradAccumulator`); the detector reads
    the loss value."""
    total = loss.total + (factor - 1.0) * loss.total.detach()
    return dataclasses.replace(loss, total=total, ce=loss.ce * factor)


def _scale_loss_once(monkeypatch, trainer, step, factor=50.0):
    """Multiply every micro-batch loss of the first pass through `step` by `factor` (a finite spike)."""
    real = losses_module.micro_batch_loss
    fired = set()

    def scaled(*args, **kwargs):
        loss = real(*args, **kwargs)
        if trainer.train_state.step != step or step in fired:
            return loss
        return _spiked(loss, factor)

    monkeypatch.setattr(losses_module, "micro_batch_loss", scaled)
    original_step = trainer.train_step

    def step_then_mark(micro_batches):
        rec = original_step(micro_batches)
        if trainer.train_state.step == step:
            fired.add(step)
        return rec

    trainer.train_step = step_then_mark


def _record_batches(trainer):
    """The input ids of the micro-batches of every train_step call, in call order."""
    seen, original_step = [], trainer.train_step

    def record(micro_batches):
        seen.append([mb["input_ids"].clone() for mb in micro_batches])
        return original_step(micro_batches)

    trainer.train_step = record
    return seen


def test_skip_policy_leaves_the_weights_of_a_skipped_step(make_config, monkeypatch):
    """A spike at step 3 is not applied: the weights equal those of a run whose step 3 was skipped as non-finite."""
    common = ("--training.steps=5", "--checkpoint.enable=false", "--optimizer.name=adamw")
    reference = Trainer(make_config("--job.run_name=nan", *common), DIMS, CPU)

    def nan_at_3(module, args, out):
        if reference.train_state.step == 3:
            return out * float("nan")

    reference.model.norm.register_forward_hook(nan_at_3)
    reference.fit()

    spiked = Trainer(make_config("--job.run_name=spike", *common, *SPIKE_ON), DIMS, CPU)
    _scale_loss_once(monkeypatch, spiked, 3)
    result = spiked.fit()
    assert result.spikes == 1 and result.skipped_steps == 0
    assert spiked.lr_scheduler.last_step == reference.lr_scheduler.last_step == 4
    want = reference.model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in spiked.model.state_dict().items())
    last = json.loads(result.metrics_path.read_text().splitlines()[-1])
    assert last["loss_spikes"] == 1 and last["skipped_steps"] == 0


def test_consecutive_spikes_stop_the_run(make_config, monkeypatch):
    trainer = Trainer(
        make_config("--training.steps=6", "--checkpoint.enable=false", *SPIKE_ON, "--loss_spike.max_consecutive=2"),
        DIMS,
        CPU,
    )
    real = losses_module.micro_batch_loss

    def spike_from_3(*args, **kwargs):
        loss = real(*args, **kwargs)
        return _spiked(loss, 50.0) if trainer.train_state.step >= 3 else loss

    monkeypatch.setattr(losses_module, "micro_batch_loss", spike_from_3)
    with pytest.raises(LossSpikeError, match=r"2 loss spikes in a row \(last: step 4; \[loss_spike\] max_consecutive"):
        trainer.fit()


def test_rollback_reloads_the_checkpoint_and_skips_the_spike_batches(make_config, monkeypatch, caplog):
    """Checkpoints at 2 and 4, a spike at 5: the run goes back to step 4 and trains steps 5 and 6 on the batches
    an uninterrupted run would read at steps 6 and 7 (those of the spike step and before are not read again)."""
    reference = Trainer(make_config("--job.run_name=ref", "--training.steps=7", "--checkpoint.enable=false"), DIMS, CPU)
    reference_batches = _record_batches(reference)
    reference.fit()

    opts = ("--job.run_name=rb", "--training.steps=6", "--checkpoint.interval=2", "--loss_spike.policy=rollback")
    trainer = Trainer(make_config(*opts, *SPIKE_ON), DIMS, CPU)
    _scale_loss_once(monkeypatch, trainer, 5)
    batches = _record_batches(trainer)
    with caplog.at_level("WARNING"):
        result = trainer.fit()

    assert "step 5: loss spike" in caplog.text and "rolling back" in caplog.text
    assert "rolled back from step 5 to the checkpoint of step 4" in caplog.text
    assert len(batches) == 7  # steps 1-5, then 5 and 6 again
    for call, reference_step in enumerate((1, 2, 3, 4, 5, 6, 7)):
        assert all(torch.equal(a, b) for a, b in zip(batches[call], reference_batches[reference_step - 1])), call
    assert result.last_step == 6 and result.spikes == 1
    assert complete_steps(result.checkpoint_folder) == [2, 4, 6]
    records = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # the rolled-back records replaced
    assert records[-1]["loss_spikes"] == 1


def test_checkpoint_keeps_the_detector_state(make_config):
    """A resumed run continues with the detector's statistics; a checkpoint saved without detection resumes too."""
    opts = ("--training.steps=3", "--checkpoint.interval=3")
    first = Trainer(make_config("--job.run_name=d", *opts, *SPIKE_ON), DIMS, CPU)
    first.fit()
    resumed = Trainer(make_config("--job.run_name=d", *opts, *SPIKE_ON), DIMS, CPU)
    resumed._resume_or_initial_load()
    assert resumed.spike_detector.state_dict() == first.spike_detector.state_dict()
    assert resumed.spike_detector.good_steps == 3

    Trainer(make_config("--job.run_name=plain", *opts, "--optimizer.name=adamw"), DIMS, CPU).fit()
    switched_on = Trainer(make_config("--job.run_name=plain", *opts, *SPIKE_ON), DIMS, CPU)
    switched_on._resume_or_initial_load()
    assert switched_on.train_state.step == 3 and switched_on.spike_detector.good_steps == 0
