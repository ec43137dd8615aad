"""Trainer regressions found in review: the mHC h_post schedule continues across a resume."""

import dataclasses

import pytest
import torch

import llm_training.trainer.trainer as trainer_module
from llm_training.distributed import ParallelDims
from llm_training.layers.mhc.hyper_connections import MHC
from llm_training.motif import get_flavor
from llm_training.trainer import Trainer

DIMS = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=1)
ALPHA_START, ALPHA_END = 0.5, 0.0


class _Crash(Exception):
    pass


def _alphas_seen(trainer, crash_at=None):
    """{step: h_post_alpha of the first mHC module when that step's forward starts}."""
    seen = {}
    mhc = next(m for m in trainer.model.modules() if isinstance(m, MHC))

    def hook(module, args):
        step = trainer.train_state.step
        if step == crash_at:
            raise _Crash(step)
        seen.setdefault(step, mhc.h_post_alpha)

    trainer.model.register_forward_pre_hook(hook)
    return seen


def _run(config, crash_at=None):
    trainer = Trainer(config, DIMS, torch.device("cpu"))
    seen = _alphas_seen(trainer, crash_at)
    if crash_at is None:
        trainer.fit()
    else:
        with pytest.raises(_Crash):
            trainer.fit()
    return seen


def test_mhc_progress_continues_after_resume(make_config, monkeypatch):
    args = get_flavor("motif3_debug").replace(mhc_h_post_alpha_start=ALPHA_START, mhc_h_post_alpha_end=ALPHA_END)
    assert args.mhc_enabled
    spec = dataclasses.replace(trainer_module.MOTIF3_SPEC, get_flavor=lambda name: args)  # the flavor, via the spec
    monkeypatch.setattr(trainer_module, "MOTIF3_SPEC", spec)
    steps = 4
    common = (f"--training.steps={steps}", "--checkpoint.interval=2", "--optimizer.name=adamw")
    full = _run(make_config("--job.run_name=full", *common))
    _run(make_config("--job.run_name=resumed", *common), crash_at=3)
    resumed = _run(make_config("--job.run_name=resumed", *common))
    # step s (1-based) runs after s - 1 optimizer steps: alpha = start + (end - start) * (s - 1) / steps
    expected = {s: ALPHA_START + (ALPHA_END - ALPHA_START) * (s - 1) / steps for s in range(1, steps + 1)}
    assert full == pytest.approx(expected)
    assert sorted(resumed) == [3, 4]
    for s in (3, 4):
        assert resumed[s] == pytest.approx(expected[s]), (s, resumed[s])
