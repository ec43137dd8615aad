"""bench/bench_quantization.py's CPU-side logic: reusing a saved curve and the loss-gap summary (the benchmark
itself needs a CUDA GPU)."""

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_quantization  # noqa: E402


def test_baseline_curves_keep_only_runs_of_the_same_length_and_mhc_backward(tmp_path):
    saved = tmp_path / "curve.json"
    curves = {"none": {"losses": [3.0, 2.0, 1.0]}, "fp8_rowwise": {"losses": [3.0, 2.5]}}
    saved.write_text(json.dumps({"curves": curves}))
    got = bench_quantization.baseline_curves(str(saved), 3)
    assert list(got) == ["none"]
    assert got["none"]["losses"] == [3.0, 2.0, 1.0] and got["none"]["from"] == str(saved)
    assert bench_quantization.baseline_curves(str(saved), 5) == {}
    other = {"none": {"losses": [3.0, 2.0, 1.0], "mhc_backward": "fused"}}
    saved.write_text(json.dumps({"curves": other}))
    assert bench_quantization.baseline_curves(str(saved), 3) == {}  # another mHC backward: not comparable


def test_curve_summary_measures_the_gap_over_the_last_quarter():
    base = [4.0 - 0.1 * i for i in range(16)]
    quant = [b + 0.02 for b in base]
    summary = bench_quantization.curve_summary(base, quant)
    assert math.isclose(summary["mean_gap_last_quarter"], 0.02, abs_tol=1e-12)
    assert math.isclose(summary["mean_abs_gap_last_quarter"], 0.02, abs_tol=1e-12)
    assert math.isclose(summary["bf16_step_noise_last_quarter"], 0.0, abs_tol=1e-12)  # a straight line
    assert math.isclose(summary["final_fp8"] - summary["final_bf16"], 0.02, abs_tol=1e-12)


def test_curve_summary_compares_a_curve_cut_short_step_for_step():
    base = [4.0 - 0.1 * i for i in range(20)]
    quant = [b + 0.05 for b in base[:12]]  # stopped at step 12 of 20 (the device call's time limit)
    summary = bench_quantization.curve_summary(base, quant)
    assert summary["compared_steps"] == 12
    assert math.isclose(summary["mean_gap_last_quarter"], 0.05, abs_tol=1e-12)  # not base's later, lower steps
    assert math.isclose(summary["final_fp8"] - summary["final_bf16"], 0.05, abs_tol=1e-12)


def test_layers_filter_selects_the_mlp_and_expert_cases_by_name():
    names = [name for name, _, _ in bench_quantization.layer_cases(tiny=True)]
    picked = [n for n in names if bench_quantization.selected(n, ["mlp", "experts"])]
    assert picked and all("mlp" in n or "experts" in n for n in picked)
    assert any(n.endswith(".experts") for n in picked) and any(".mlp." in n for n in picked)
    assert len(picked) < len(names)  # the attention projections are left out
    assert [n for n in names if bench_quantization.selected(n, [])] == names


def test_curve_specs_and_the_verdict_against_the_bf16_run_to_run_gap():
    assert bench_quantization.parse_curve_spec("none") == ("none", 7)
    assert bench_quantization.parse_curve_spec("none@8") == ("none", 8)
    base = [4.0 - 0.1 * i for i in range(16)]
    curves = {
        "none": {"losses": base},
        "none@8": {"losses": [b + (0.03 if i % 2 else -0.03) for i, b in enumerate(base)]},  # run-to-run |gap| 0.03
        "none@9": {"losses": [b - 0.02 for b in base]},  # a second seed: run-to-run |gap| 0.02
        "fp8_rowwise": {"losses": [b + 0.01 for b in base]},
        "fp8_blockwise": {"losses": [b + 0.05 for b in base]},
        "mxfp8": {"losses": base[:-1] + [float("nan")]},
    }
    verdict = bench_quantization.curves_verdict(curves)
    assert set(verdict) == {"fp8_rowwise", "fp8_blockwise", "mxfp8"}  # bf16 runs are the reference, not judged
    assert verdict["fp8_rowwise"]["within_noise"] and not verdict["fp8_blockwise"]["within_noise"]
    # every other bf16 seed is one noise sample, in spec order; the largest is the bound (0.03, not 0.02)
    gaps = verdict["fp8_blockwise"]["bf16_run_to_run_mean_abs_gaps_last_quarter"]
    assert [round(g, 12) for g in gaps] == [0.03, 0.02]
    assert math.isclose(verdict["fp8_blockwise"]["max_abs_gap"], 0.05, abs_tol=1e-12)
    assert not verdict["mxfp8"]["finite"] and not verdict["mxfp8"]["within_noise"]
