"""Training on a data mixture: each source's real tokens are counted (metrics.jsonl `tokens/<source>`, the log
line), kept in the checkpoint, and a resumed run continues both the counts and the exact loss curve."""

import json
import logging

import torch
from conftest import DEBUG_CPU_TOML

from llm_training.data import DEMO_DATA_PATH
from llm_training.distributed import ParallelDims
from llm_training.trainer import Trainer, train

DIMS = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=1)
CPU = torch.device("cpu")


def mixture_toml(tmp_path) -> str:
    """debug_cpu.toml with two sources cut from the demo data: 'arith' (weight 3) and 'rest'."""
    lines = DEMO_DATA_PATH.read_text().splitlines()
    (tmp_path / "arith.jsonl").write_text("\n".join(lines[:200]) + "\n")
    (tmp_path / "rest.jsonl").write_text("\n".join(lines[200:300]) + "\n")
    tables = (
        f'[[training.sources]]\npath = "{tmp_path / "arith.jsonl"}"\nweight = 3\n\n'
        f'[[training.sources]]\npath = "{tmp_path / "rest.jsonl"}"\n'
    )
    (tmp_path / "mix.toml").write_text(DEBUG_CPU_TOML.read_text() + "\n" + tables)
    return str(tmp_path / "mix.toml")


def test_tokens_per_source_are_counted_checkpointed_and_resumed(make_config, tmp_path, caplog):
    toml = mixture_toml(tmp_path)
    full = train(make_config(f"--job.config_file={toml}", "--job.run_name=full"), DIMS, CPU)

    crashed = Trainer(make_config(f"--job.config_file={toml}", "--job.run_name=resumed"), DIMS, CPU)
    real = {}
    crashed_step = crashed.train_step

    def record(mbs):
        rec = crashed_step(mbs)
        real[rec.step] = {
            name: int(sum(mb["real_tokens"][mb["source_ids"] == i].sum() for mb in mbs))
            for i, name in enumerate(["arith", "rest"])
        }
        if rec.step == 4:
            raise KeyboardInterrupt  # a crash after step 4 (the checkpoint of step 3 survives)
        return rec

    crashed.train_step = record
    try:
        crashed.fit()
    except KeyboardInterrupt:
        pass
    with caplog.at_level(logging.INFO, logger="llm_training.trainer.metrics"):
        resumed = train(make_config(f"--job.config_file={toml}", "--job.run_name=resumed"), DIMS, CPU)

    assert resumed.start_step == 3
    assert [resumed.losses[s] for s in (4, 5, 6)] == [full.losses[s] for s in (4, 5, 6)]
    records = {r["step"]: r for r in map(json.loads, resumed.metrics_path.read_text().splitlines())}
    full_records = {r["step"]: r for r in map(json.loads, full.metrics_path.read_text().splitlines())}
    for step in range(1, 7):  # one record per step (log_freq 1), the same counts as the uninterrupted run
        assert {k: v for k, v in records[step].items() if k.startswith("tokens/")} == {
            k: v for k, v in full_records[step].items() if k.startswith("tokens/")
        }
    for step in (1, 2, 3):  # cumulative: the real tokens of each source's rows so far
        for name in ("arith", "rest"):
            assert records[step][f"tokens/{name}"] == sum(real[s][name] for s in range(1, step + 1))
    assert records[6]["tokens/arith"] > 2 * records[6]["tokens/rest"] > 0  # weights 3 : 1
    assert "tokens arith " in caplog.text and " rest " in caplog.text
