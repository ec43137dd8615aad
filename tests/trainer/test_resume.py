"""Resume semantics: the first resumed step uses the current LR schedule (a finished 3-step run extended to 6
steps reproduces a fresh 6-step run bitwise), and a resumed run warns once with the config keys that changed
since the checkpoint."""

import logging

import torch

from llm_training.distributed import ParallelDims
from llm_training.trainer import train
from llm_training.trainer.resume import changed_config_keys

DIMS = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=1)
COMMON = ("--lr_scheduler.warmup_steps=3", "--checkpoint.interval=100", "--optimizer.name=adamw")


def test_extending_a_finished_run_matches_a_fresh_longer_run(make_config, caplog):
    fresh = train(make_config("--job.run_name=fresh", "--training.steps=6", *COMMON), DIMS, torch.device("cpu"))
    first = train(make_config("--job.run_name=extended", "--training.steps=3", *COMMON), DIMS, torch.device("cpu"))
    assert sorted(first.losses) == [1, 2, 3]
    with caplog.at_level(logging.WARNING):
        extended = train(
            make_config("--job.run_name=extended", "--training.steps=6", *COMMON), DIMS, torch.device("cpu")
        )
    assert extended.start_step == 3 and sorted(extended.losses) == [4, 5, 6]
    for step in (4, 5, 6):  # step 5 is the first whose loss depends on the lr of a resumed step
        assert extended.losses[step] == fresh.losses[step], (step, extended.losses[step], fresh.losses[step])
    changed = [r.getMessage() for r in caplog.records if "differs from the checkpoint's" in r.getMessage()]
    assert changed == ["resumed with a config that differs from the checkpoint's in 1 key(s): training.steps: 3 -> 6"]


def test_changed_config_keys_lists_every_difference():
    saved = "[training]\nsteps = 3\nseed = 1\n\n[metrics]\nlog_freq = 10\n"
    current = "[training]\nsteps = 6\nseed = 1\n\n[metrics]\nlog_freq = 10\nsave_jsonl = true\n"
    assert changed_config_keys(saved, current) == [("metrics.save_jsonl", None, True), ("training.steps", 3, 6)]
    tables = "[training]\n[[training.sources]]\npath = 'a'\nweight = {}\n[[training.sources]]\npath = 'b'\n"
    assert changed_config_keys(tables.format(1.0), tables.format(2.0)) == [("training.sources.0.weight", 1.0, 2.0)]
