"""bench/bench_long_context.py's logic on CPU: the dry-run estimate and a few real training steps per length,
side by side in its JSON (motif3_debug at tiny lengths; the GPU run is the lead's)."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_long_context  # noqa: E402


def test_long_context_bench_trains_and_estimates_on_cpu(tmp_path):
    out = tmp_path / "long.json"
    argv = ["--flavor=motif3_debug", "--device=cpu", "--seq-lens=32", "--steps=1", "--warmup=0"]
    assert bench_long_context.main([*argv, f"--dump={tmp_path}", f"--out={out}"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["seq_len"] for r in rows] == [32]
    for r in rows:
        assert r["status"] == "ok" and r["ac"] == "long_context", r
        assert r["compile"] is False and "graph_breaks" not in r, r  # the CPU logic test runs eagerly by default
        assert r["tokens_per_s"] > 0 and len(r["ce_losses"]) == 1 and r["peak_gib"] is None
        assert r["build_s"] > 0 and r["first_step_s"] == r["step_s"]  # one step: the timed one
        assert 0 < r["estimate_activation_peak_gib"] < r["estimate_total_gib"] and r["estimate_fits"]
    assert not dist.is_initialized()  # the bench's process group is gone: later dry runs in this process work


def test_long_context_bench_compiles_as_the_sft_example_does_when_asked(tmp_path):
    args = ("motif3_debug", 64, "long_context", "cpu", "auto", 2, tmp_path, 139.0)
    assert bench_long_context.job_config(*args, compiled=True).compile.enable
    assert not bench_long_context.job_config(*args).compile.enable


def _cp_rank(rank, port, tmp):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))  # fmt: skip
    argv = ["--flavor=motif3_debug", "--device=cpu", "--seq-lens=64", "--steps=1", "--warmup=0", "--cp=2",
            "--cp-mode=ring", f"--dump={tmp}", f"--out={tmp}/long_cp.json"]  # fmt: skip
    assert bench_long_context.main(argv) == 0


def test_long_context_bench_splits_the_sequence_over_two_context_parallel_ranks(tmp_path, free_port):
    import torch.multiprocessing as mp

    mp.spawn(_cp_rank, args=(free_port, str(tmp_path)), nprocs=2, join=True)
    report = json.loads((tmp_path / "long_cp.json").read_text())
    (row,) = report["rows"]
    assert report["cp"] == 2 and row["cp"] == 2 and row["cp_mode"] == "ring"
    assert row["status"] == "ok" and row["tokens_per_s"] > 0 and len(row["ce_losses"]) == 1
    assert 0 < row["estimate_activation_peak_gib"] < row["estimate_total_gib"]


def test_long_context_bench_refuses_a_cp_degree_without_its_processes(tmp_path):
    import pytest

    with pytest.raises(SystemExit):
        bench_long_context.main(["--device=cpu", "--cp=2", f"--dump={tmp_path}", f"--out={tmp_path}/x.json"])
