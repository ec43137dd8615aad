"""bench/bench_blockwise_quant.py's CPU logic: the K values it times and how it scores the kept configs (the timing
itself is the GPU run's)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_blockwise_quant

from llm_training.quantization.kernels import BLOCKWISE_QUANT_CONFIGS


def test_ks_are_the_padded_gemm_dims_of_the_flavor():
    ks = bench_blockwise_quant.gemm_ks(["motif3_small"])
    assert ks == sorted(set(ks)) and all(k % 128 == 0 for k in ks)
    assert 384 in ks  # GDLA's 320-wide dim pads to 384, as RecipeKernels pads it
    assert 320 not in ks


def _row(kernel, k, ms_by_pair):
    """A saved row: every one of torchao's 45 configs, the stage counts of a pair timed alike but one outlier."""
    ms = {}
    for g, w, s in bench_blockwise_quant.all_configs():
        ms[str((g, w, s))] = ms_by_pair.get((g, w), 10.0) * (5.0 if s == 6 else 1.0)  # one stage count: noise
    return {"kernel": kernel, "K": k, "ms_by_config": ms}


def test_kept_configs_are_scored_by_their_median_over_stage_counts_against_the_best_pair():
    every = bench_blockwise_quant.all_configs()
    assert len(every) == 45 and all((g, w, 2) in every for g, w in BLOCKWISE_QUANT_CONFIGS)
    row = _row("lhs", 8192, {(2, 2): 1.0, (64, 2): 1.2})
    assert bench_blockwise_quant.pair_times(row["ms_by_config"])[(64, 2)] == pytest.approx(1.2)  # the outlier stage out
    assert bench_blockwise_quant.kept_ratio(row, [(64, 2), (128, 8)]) == ((2, 2), (64, 2), pytest.approx(1.2))
    small = _row("rhs", 256, {(2, 2): 1.0, (64, 2): 2.0})  # launch-bound: counted in "all" only
    cost = bench_blockwise_quant.trim_cost([row, small], [(64, 2), (128, 8)])
    assert cost["all"] == {"worst_ratio": pytest.approx(2.0), "mean_ratio": pytest.approx(1.6), "cases": 2}
    assert cost[f"K>={bench_blockwise_quant.KERNEL_BOUND_K}"]["worst_ratio"] == pytest.approx(1.2)


def test_rescore_writes_the_kept_configs_and_their_cost_into_a_saved_run(tmp_path):
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"rows": [_row("lhs", 8192, {BLOCKWISE_QUANT_CONFIGS[0]: 0.5})], "trim_cost": {}}))
    assert bench_blockwise_quant.main(["--rescore", str(saved)]) == 0
    result = json.loads(saved.read_text())
    assert [tuple(p) for p in result["kept_configs"]] == list(BLOCKWISE_QUANT_CONFIGS)
    assert result["trim_cost"]["all"]["worst_ratio"] == pytest.approx(1.0)
