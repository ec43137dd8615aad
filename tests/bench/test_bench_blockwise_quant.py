"""bench/bench_blockwise_quant.py's CPU logic: the K values it times and how it scores the kept configs (the timing
itself is the GPU run's)."""

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


def test_kept_configs_are_among_torchaos_and_scored_against_the_best_of_all():
    every = bench_blockwise_quant.all_configs()
    assert len(every) == 45
    assert all((g, w, 2) in every for g, w in BLOCKWISE_QUANT_CONFIGS)
    times = {c: 1.0 + i for i, c in enumerate(every)}  # the first of all configs is the fastest
    best, ms = bench_blockwise_quant.best_within(times, every)
    assert (best, ms) == (every[0], 1.0)
    kept = [(g, w, 2) for g, w in BLOCKWISE_QUANT_CONFIGS]
    kept_best, kept_ms = bench_blockwise_quant.best_within(times, kept)
    assert kept_best in kept and kept_ms == min(times[c] for c in kept)
    rows = [{"best_ms": 1.0, "kept_best_ms": 1.1}, {"best_ms": 2.0, "kept_best_ms": 2.0}]
    cost = bench_blockwise_quant.trim_cost(rows)
    assert cost["worst_ratio"] == pytest.approx(1.1) and cost["mean_ratio"] == pytest.approx(1.05)
