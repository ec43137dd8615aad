"""bench/bench_compile_start.py: the one-time start and the prepaid compile's gain from each mode's compile times,
the table, and FAIL rows for a mode whose process fails or runs too long."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_compile_start as bcs


def test_one_time_start_and_prepaid_gain_come_from_the_compile_times():
    rows = [
        {"mode": "cold", "device": "cpu", "size": 8, "compile_s": [12.0, 1.8, 1.6]},
        {"mode": "prepaid", "device": "cpu", "size": 8, "prepay_s": 10.5, "compile_s": [1.9, 1.8, 1.7]},
    ]
    totals = bcs.summary(rows)
    assert totals["one_time_start_s"] == pytest.approx(12.0 - 1.7)  # the median of the later cold compiles
    assert totals["prepaid_saves_s"] == pytest.approx(12.0 - 1.9)
    table = bcs.format_table(rows, totals)
    assert "prepaid      10.50    1.90    1.80    1.70  cpu" in table
    assert table.endswith("one-time start 10.30 s; a prepaid compile takes 10.10 s off the first compile")


def test_a_failed_mode_is_a_fail_row_and_leaves_the_figures_unknown(monkeypatch):
    def fake_run(cmd, **kwargs):
        if cmd[cmd.index("--worker") + 1] == "prepaid":
            raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="Traceback ...\nRuntimeError: no compiler\n")

    monkeypatch.setattr(bcs.subprocess, "run", fake_run)
    rows = [bcs.run_mode(mode, 8, 5.0) for mode in bcs.MODES]
    assert rows == [
        {"mode": "cold", "error": "exit 1: RuntimeError: no compiler"},
        {"mode": "prepaid", "error": "timed out after 5 s"},
    ]
    totals = bcs.summary(rows)
    assert totals == {"one_time_start_s": None, "prepaid_saves_s": None}
    assert "cold     FAIL exit 1: RuntimeError: no compiler" in bcs.format_table(rows, totals)
    assert "one-time start n/a" in bcs.format_table(rows, totals)
