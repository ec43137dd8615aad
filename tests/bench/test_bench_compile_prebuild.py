"""bench/bench_compile_prebuild.py's logic on the CPU (the GPU run is the measurement): the kinds of block of a
flavor, the two runs' caches, the side processes, and the table."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_compile_prebuild as bcp  # noqa: E402


def test_block_kinds_are_the_first_layer_of_each_kind():
    # motif3_debug: layer 0 full dense, 1 sliding dense, 2-3 sliding MoE, 4 full MoE
    kinds = bcp.block_kinds("motif3_debug_nomtp")
    assert list(kinds.values()) == [0, 1, 2, 4], kinds
    assert all(k.startswith("TransformerBlock_") for k in kinds)


def test_side_processes_fill_the_prebuilt_runs_cache_and_not_the_cold_one(monkeypatch, tmp_path):
    """Each worker stands in with a line naming its layer and whether it ran over the prebuilt cache; one kind's
    side process fails and becomes an error row."""
    worker = (
        "import json, os, sys; layer = {layer}; prebuilt = 'prebuilt' in os.environ['TORCHINDUCTOR_CACHE_DIR']\n"
        "if layer == 2: sys.exit('no memory')\n"
        "print(json.dumps({{'layer': layer, 'first_step_s': 1.5, 'fxgraph_cache_hit': int(prebuilt),"
        " 'fxgraph_cache_miss': int(not prebuilt), 'compiled_frames': 1}}))"
    )
    monkeypatch.setattr(
        bcp, "_worker_command", lambda flavor, layer, batch, seq: [sys.executable, "-c", worker.format(layer=layer)]
    )
    result = bcp.measure("motif3_debug_nomtp", 2, 64, timeout_s=60)
    assert result["cold"]["fxgraph_cache_miss"] == 1 and result["prebuilt"]["fxgraph_cache_hit"] == 1
    assert [r.get("layer") for r in result["sides"].values()] == [0, 1, None, 4]
    failed = [r for r in result["sides"].values() if "error" in r]
    assert len(failed) == 1 and "no memory" in failed[0]["error"]
    table = bcp.format_table(result)
    assert "FAIL exit 1: no memory" in table and "prebuilt (whole model)" in table
    assert bcp.main(["--flavor", "motif3_debug_nomtp", "--out", str(tmp_path / "r.json")]) == 1  # a failed side
