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
        assert r["tokens_per_s"] > 0 and len(r["ce_losses"]) == 1 and r["peak_gib"] is None
        assert 0 < r["estimate_activation_peak_gib"] < r["estimate_total_gib"] and r["estimate_fits"]
    assert not dist.is_initialized()  # the bench's process group is gone: later dry runs in this process work
