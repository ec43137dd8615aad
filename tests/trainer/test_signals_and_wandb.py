"""SIGTERM in the middle of a run saves a checkpoint at the end of the current step and exits cleanly;
wandb (offline) receives the logged metrics under the team and run name users set, a resumed run (from a
checkpoint, or restarted before the first one) continues the same wandb run, and the API key is written
nowhere."""

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from llm_training.distributed import ParallelDims

from llm_training.trainer import train
from llm_training.trainer.checkpoint import complete_steps
from llm_training.trainer.metrics import WANDB_RUN_ID_FILE, MetricsLogger, wandb_init_kwargs

DIMS = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=1)

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    sys.path.insert(0, {tests_dir!r})
    from conftest import tiny_config
    from llm_training.distributed import ParallelDims
    from llm_training.train import init_logging
    from llm_training.trainer import train
    init_logging(0)
    cfg = tiny_config({dump!r}, "--training.steps=200", "--checkpoint.interval=1000", "--optimizer.name=adamw")
    r = train(cfg, ParallelDims(1, -1, 1, 1, 1), torch.device("cpu"))
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

    data, pos, chunk, rows, runs = run_file.read_bytes(), 7, b"", [], []
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
                runs.append(record.run)
    return rows, runs


def _written_wandb_history(run_dir, timeout_s=60.0):
    """`_wandb_history` of the run file in `run_dir` once it holds its run record: wandb's service process
    may still be flushing the file when `finish()` has returned (seen once on a loaded machine)."""
    deadline = time.time() + timeout_s
    while True:
        rows, runs = _wandb_history(next(run_dir.glob("run-*.wandb")))
        if runs or time.time() > deadline:
            return rows, runs
        time.sleep(0.5)


API_KEY = "0123456789abcdef0123456789abcdef01234567"  # a made-up key in wandb's 40-character format


def _offline_wandb_env(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "llm-training-test")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", API_KEY)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # wandb must not write ~/.netrc or settings with the key
    # under parallel test load the wandb-core service can take longer than its 30 s / 90 s defaults to start
    monkeypatch.setenv("WANDB__SERVICE_WAIT", "600")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "600")
    for name in ("WANDB_ENTITY", "WANDB_NAME", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)


def test_wandb_offline_logs_metrics_and_resumes_same_run(make_config, tmp_path, monkeypatch, capfd):
    _offline_wandb_env(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_TEAM", "motif-team")
    monkeypatch.setenv("WANDB_RUN_NAME", "motif3-debug-wandb")
    first = train(
        make_config(
            "--training.steps=2", "--checkpoint.interval=1", "--metrics.enable_wandb", "--optimizer.name=adamw"
        ),
        DIMS,
        torch.device("cpu"),
    )
    runs = sorted((first.run_folder / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    run_id = runs[0].name.rsplit("-", 1)[1]
    rows, run_records = _written_wandb_history(runs[0])
    assert [r.run_id for r in run_records] == [run_id]
    assert run_records[0].entity == "motif-team" and run_records[0].display_name == "motif3-debug-wandb"
    assert [r["_step"] for r in rows] == [1, 2]
    assert [r["loss"] for r in rows] == [first.losses[1], first.losses[2]]
    assert "tokens_per_s" in rows[0] and "grad_norm" in rows[0] and "mfu_megatron" not in rows[0]  # n/a on CPU

    second = train(
        make_config(
            "--training.steps=3", "--checkpoint.interval=1", "--metrics.enable_wandb", "--optimizer.name=adamw"
        ),
        DIMS,
        torch.device("cpu"),
    )
    assert second.start_step == 2
    runs = sorted((first.run_folder / "wandb").glob("offline-run-*"))
    assert {r.name.rsplit("-", 1)[1] for r in runs} == {run_id}  # the same wandb run id continues
    rows, run_records = _written_wandb_history(runs[-1])
    assert {r.run_id for r in run_records} == {run_id} and rows[-1]["_step"] == 3
    assert rows[-1]["loss"] == second.losses[3]

    printed = capfd.readouterr()
    assert API_KEY not in printed.out + printed.err
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert API_KEY.encode() not in path.read_bytes(), f"the API key was written to {path}"


def _logger(run_folder, run_id=None):
    return MetricsLogger(
        {"megatron": 1.0e6, "torchtitan": 1.0e6},
        total_steps=2,
        log_freq=1,
        run_folder=run_folder,
        device=torch.device("cpu"),
        enable_wandb=True,
        wandb_run_id=run_id,
    )


def test_restart_before_the_first_checkpoint_resumes_the_same_run(tmp_path, monkeypatch):
    _offline_wandb_env(monkeypatch, tmp_path)
    first = _logger(tmp_path / "run")
    first.close()  # the pod dies before any checkpoint stored the run id
    assert (tmp_path / "run" / WANDB_RUN_ID_FILE).read_text().strip() == first.wandb_run_id
    again = _logger(tmp_path / "run")
    again.close()
    assert again.wandb_run_id == first.wandb_run_id
    other = _logger(tmp_path / "other-run")  # another run folder starts another wandb run
    other.close()
    assert other.wandb_run_id != first.wandb_run_id


def test_wandb_variables_users_set_and_their_aliases(tmp_path):
    folder = tmp_path / "run-a"
    users = wandb_init_kwargs(folder, None, {"WANDB_TEAM": "team", "WANDB_RUN_NAME": "name", "WANDB_PROJECT": "p"})
    assert users == {"project": "p", "entity": "team", "name": "name", "dir": str(folder), "id": None, "resume": None}
    aliases = wandb_init_kwargs(folder, None, {"WANDB_ENTITY": "team", "WANDB_NAME": "name", "WANDB_PROJECT": "p"})
    assert aliases == users
    defaults = wandb_init_kwargs(folder, None, {})
    assert (defaults["project"], defaults["entity"], defaults["name"]) == ("llm_training", None, "run-a")
    assert wandb_init_kwargs(folder, None, {"WANDB_TEAM": "t", "WANDB_ENTITY": "t"})["entity"] == "t"
    with pytest.raises(ValueError, match="WANDB_TEAM='a' and WANDB_ENTITY='b' disagree; set only WANDB_TEAM"):
        wandb_init_kwargs(folder, None, {"WANDB_TEAM": "a", "WANDB_ENTITY": "b"})
    resumed = wandb_init_kwargs(folder, "ckpt-id", {"WANDB_RUN_ID": "env-id"})
    assert (resumed["id"], resumed["resume"]) == ("ckpt-id", "allow")  # the checkpoint's id wins
    assert wandb_init_kwargs(folder, None, {"WANDB_RUN_ID": "env-id"})["id"] == "env-id"
