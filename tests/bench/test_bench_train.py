"""bench/bench_train.py's multi-rank logic on 2 gloo CPU ranks (the GPU run is the scaling measurement): data and
expert parallel over torchrun's ranks, per-GPU throughput, the weak-scaling efficiency against a 1-rank JSON."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_train  # noqa: E402

ARGV = ["--device=cpu", "--flavor=motif3_debug", "--seq-len=32", "--batch=2", "--steps=1", "--warmup=1"]


def test_weak_scaling_divides_tokens_per_gpu_by_the_matching_baseline_row(tmp_path):
    base = tmp_path / "one.json"
    row = {"flavor": "f", "seq_len": 64, "batch": 2, "ac": "none"}
    base.write_text(json.dumps({"rows": [{**row, "tokens_per_s": 100.0}, {**row, "ac": "full", "tokens_per_s": 10.0}]}))
    rows = [{**row, "tokens_per_s": 90.0}, {**row, "batch": 4, "tokens_per_s": 50.0}, {**row, "error": "OOM"}]
    bench_train.weak_scaling(rows, str(base))
    assert rows[0]["scaling_efficiency"] == pytest.approx(0.9)
    assert rows[1]["scaling_efficiency"] is None and rows[2]["scaling_efficiency"] is None


def test_random_batches_pack_a_changing_number_of_documents():
    """The benchmark's micro-batches pack 1 to 3 documents per row, drawn per row, so the micro-batch's document
    count changes as packed chat data changes it (a compiled step that specialised on it would compile again: the
    harness's later_compiled_frames). Positions restart per document; no label crosses a document boundary."""
    import torch

    gen = torch.Generator().manual_seed(0)
    counts = []
    for _ in range(8):
        b = bench_train.random_batch(4, 64, 100, gen)
        doc, pos, ids, labels = b["document_ids"], b["position_ids"], b["input_ids"], b["labels"]
        per_row = doc[:, -1] + 1
        assert ((per_row >= 1) & (per_row <= 3)).all() and (doc[:, 0] == 0).all()
        assert (doc[:, 1:] - doc[:, :-1]).ge(0).all() and (doc[:, 1:] - doc[:, :-1]).le(1).all()
        starts = torch.ones_like(doc, dtype=torch.bool)
        starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
        assert (pos[starts] == 0).all() and (pos[:, 1:][~starts[:, 1:]] == pos[:, :-1][~starts[:, 1:]] + 1).all()
        lengths = torch.cat([torch.bincount(row) for row in doc])
        assert lengths.min() >= 2
        same_doc = ~starts[:, 1:]
        assert torch.equal(labels[:, :-1][same_doc], ids[:, 1:][same_doc])
        assert (labels[:, :-1][~same_doc] == -100).all() and (labels[:, -1] == -100).all()
        counts.append(int(per_row.sum()))
    assert len(set(counts)) > 1, counts


def test_segments_by_stream_sums_each_streams_segments_largest_first():
    gib = 2**30
    snapshot = [
        {"stream": 0, "total_size": 4 * gib, "allocated_size": 3 * gib},
        {"stream": 93824, "total_size": 7 * gib, "allocated_size": 0},
        {"stream": 0, "total_size": 2 * gib, "allocated_size": 1 * gib},
        {"stream": 71168, "total_size": 1 * gib, "allocated_size": gib // 2},
    ]
    rows = bench_train.segments_by_stream(snapshot)
    assert [(r["stream"], r["segments"], r["reserved_gib"], r["allocated_gib"]) for r in rows] == [
        ("side 1", 1, 7.0, 0.0), ("default", 2, 6.0, 4.0), ("side 2", 1, 1.0, 0.5)
    ]  # fmt: skip


def _rank(rank, port, tmp):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))  # fmt: skip
    argv = [*ARGV, "--ep=2", f"--baseline={tmp}/one.json", f"--dump={tmp}/ep", f"--out={tmp}/ep2.json"]
    assert bench_train.main(argv) == 0


def test_two_rank_expert_parallel_run_reports_per_gpu_throughput_and_scaling(tmp_path, free_port):
    # a 1-GPU row of the same case (its tok/s made up: the division is what is checked here)
    one = {"flavor": "motif3_debug", "seq_len": 32, "batch": 2, "ac": "none", "tokens_per_s": 1000.0}
    (tmp_path / "one.json").write_text(json.dumps({"rows": [one]}))
    mp.spawn(_rank, args=(free_port, str(tmp_path)), nprocs=2, join=True)
    (row,) = json.loads((tmp_path / "ep2.json").read_text())["rows"]
    assert (row["gpus"], row["dp"], row["ep"], row["cp"]) == (2, 2, 2, 1)
    # per GPU: 2 data ranks x 2 sequences x 32 tokens over 2 GPUs per step
    assert row["tokens_per_s"] == pytest.approx(2 * 32 / (row["step_ms_median"] / 1e3))
    assert row["scaling_efficiency"] == pytest.approx(row["tokens_per_s"] / 1000.0)
    assert abs(row["first_ce"] - row["ln_vocab"]) < 1.5
