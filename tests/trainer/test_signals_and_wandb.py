"""SIGTERM in the middle of a run saves a checkpoint at the end of the current step and exits cleanly;
wandb (offline) receives the logged metrics, and a resumed run continues the same wandb run (the run files
are read once wandb has finished writing them, so the check does not depend on timing)."""

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time

from llm_training.distributed import ParallelDims
from llm_training.trainer import train
from llm_training.trainer.checkpoint import complete_steps

DIMS = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=1)

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests_dir!r})
    from conftest import tiny_config
    from llm_training.distributed import ParallelDims
    from llm_training.train import init_logging
    from llm_training.trainer import train
    init_logging(0)
    cfg = tiny_config({dump!r}, "--training.steps=200", "--checkpoint.interval=1000", "--optimizer.name=adamw")
    r = train(cfg, ParallelDims(1, -1, 1, 1, 1))
    print("RESULT", json.dumps({{"last_step": r.last_step, "stopped": r.stopped_by_signal}}))
    """
)


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    tests_dir = os.path.dirname(__file__)
    script = _SCRIPT.format(tests_dir=tests_dir, dump=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "t" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "training did not start"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    result = json.loads(out.split("RESULT", 1)[1])
    assert result["stopped"] and 1 <= result["last_step"] < 200
    assert complete_steps(tmp_path / "t" / "checkpoint") == [result["last_step"]]
    assert "SIGTERM" in out and "saving a checkpoint" in out


def _wandb_history(run_file):
    """Metrics logged in an offline wandb run file, read independently of wandb's writer: the file is a
    LevelDB-style log (7-byte file header, 32 KiB blocks, records with a 7-byte crc/length/type header)
    of protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunk, rows, run_ids, exited = run_file.read_bytes(), 7, b"", [], [], False
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
            elif record.WhichOneof("record_type") == "run":
                run_ids.append(record.run.run_id)
            exited |= record.WhichOneof("record_type") == "exit"
    return rows, run_ids, exited


def _finished_history(run_file, timeout_s=120.0):
    """`_wandb_history` of a run file once wandb's service has written all of it (its `exit` record): the
    service may still be flushing the file when `wandb.finish()` returns, most visibly under load."""
    deadline = time.time() + timeout_s
    while True:
        rows, run_ids, exited = _wandb_history(run_file)
        if exited or time.time() > deadline:
            return rows, run_ids
        time.sleep(0.1)


def _newest_run_file(wandb_dir):
    """The .wandb file written last (by modification time, not by the second-resolution folder names)."""
    return max(wandb_dir.glob("offline-run-*/run-*.wandb"), key=lambda f: f.stat().st_mtime_ns)


def test_wandb_offline_logs_metrics_and_resumes_same_run(make_config, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "llm-training-test")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # under parallel test load the wandb-core service can take longer than its 30 s / 90 s defaults to start
    monkeypatch.setenv("WANDB__SERVICE_WAIT", "600")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "600")
    for name in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_NAME", "WANDB_DIR", "WANDB_ENTITY"):  # from the environment
        monkeypatch.delenv(name, raising=False)
    first = train(
        make_config(
            "--training.steps=2", "--checkpoint.interval=1", "--metrics.enable_wandb", "--optimizer.name=adamw"
        ),
        DIMS,
    )
    runs = sorted((first.run_folder / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    run_id = runs[0].name.rsplit("-", 1)[1]
    rows, ids = _finished_history(next(runs[0].glob("run-*.wandb")))
    assert ids == [run_id]
    assert [r["_step"] for r in rows] == [1, 2]
    assert [r["loss"] for r in rows] == [first.losses[1], first.losses[2]]
    assert "tokens_per_s" in rows[0] and "grad_norm" in rows[0] and "mfu_megatron" not in rows[0]  # n/a on CPU

    second = train(
        make_config(
            "--training.steps=3", "--checkpoint.interval=1", "--metrics.enable_wandb", "--optimizer.name=adamw"
        ),
        DIMS,
    )
    assert second.start_step == 2
    runs = sorted((first.run_folder / "wandb").glob("offline-run-*"))
    assert {r.name.rsplit("-", 1)[1] for r in runs} == {run_id}  # the same wandb run id continues
    rows, ids = _finished_history(_newest_run_file(first.run_folder / "wandb"))
    assert set(ids) == {run_id} and rows[-1]["_step"] == 3 and rows[-1]["loss"] == second.losses[3]
