"""bench/bench_vs_torchtitan.py: case selection, the ratio and table logic, FAIL rows (crash, timeout), and one
end-to-end run of ours and torchtitan's DeepSeek-V3 at the tiny CPU shape."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "bench_vs_torchtitan.py"
_spec = importlib.util.spec_from_file_location("bench_vs_torchtitan", _PATH)
bvt = importlib.util.module_from_spec(_spec)
sys.modules["bench_vs_torchtitan"] = bvt  # its dataclasses look their module up there
_spec.loader.exec_module(bvt)

HAS_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None


def test_case_selection_by_group_and_name():
    cases = bvt.build_cases("all", "proxy", 6, 2, ["adamw"])
    assert [c.name for c in cases[:3]] == ["ours@eager", "ours_nomtp+adamw@eager", "torchtitan@eager"]
    assert len(cases) == 9
    accum = [c for c in cases if c.group == "accum"]
    # 4 micro-batches of 4 x 4096 = 64K tokens per optimizer step, half the timed steps
    assert {(c.batch, c.accum, c.tokens_per_step, c.steps, c.compiled) for c in accum} == {(4, 4, 65536, 3, True)}
    assert {c.tokens_per_step for c in cases if c.group == "eager"} == {8192}
    picked = bvt.build_cases("compiled,torchtitan@eager,compiled", "proxy", 6, 2, ["adamw", "muon"])
    assert [c.name for c in picked] == [
        "ours@compiled", "ours_nomtp+adamw@compiled", "ours_nomtp+muon@compiled", "torchtitan@compiled",
        "torchtitan@eager",
    ]  # fmt: skip
    with pytest.raises(SystemExit, match="unknown case or group 'fast'"):
        bvt.build_cases("fast", "proxy", 6, 2, ["adamw"])


def test_quantize_recipes_add_our_systems_under_each_recipe():
    cases = bvt.build_cases("accum", "proxy", 6, 2, ["adamw"], recipes=("fp8_rowwise",))
    assert [c.name for c in cases] == [
        "ours@accum", "ours_nomtp+adamw@accum", "ours+fp8_rowwise@accum", "ours_nomtp+adamw+fp8_rowwise@accum",
        "torchtitan@accum",
    ]  # fmt: skip
    one = bvt.build_cases("ours_nomtp+adamw+fp8_rowwise@accum", "proxy", 6, 2, ["adamw"], recipes=("fp8_rowwise",))
    assert [(c.name, c.recipe) for c in one] == [("ours_nomtp+adamw+fp8_rowwise@accum", "fp8_rowwise")]


def test_low_precision_rows_are_also_compared_with_bf16():
    bf16 = _row("ours_nomtp", "accum", 20000.0, 200.0, 250.0, optimizer="adamw")
    fp8 = _row("ours_nomtp", "accum", 26000.0, 260.0, 325.0, optimizer="adamw", recipe="fp8_rowwise")
    fp8["case"] = "ours_nomtp+adamw+fp8_rowwise@accum"
    titan = _row("torchtitan", "accum", 40000.0, 400.0, 500.0, optimizer="adamw")
    by_pair = {(q["case"], q["vs"]): q["tokens_per_s"] for q in bvt.ratios([bf16, fp8, titan])}
    assert by_pair == {
        ("ours_nomtp@accum", "torchtitan@accum"): 0.5,
        ("ours_nomtp+adamw+fp8_rowwise@accum", "torchtitan@accum"): 0.65,
        ("ours_nomtp+adamw+fp8_rowwise@accum", "ours_nomtp@accum"): 1.3,
    }


def test_another_mhc_backward_adds_our_systems_compared_with_the_default():
    cases = bvt.build_cases(
        "ours_nomtp+adamw@accum,ours_nomtp+adamw+mhc_tensor_ops@accum", "proxy", 6, 2, ["adamw"],
        mhc_backwards=("tensor_ops",),
    )  # fmt: skip
    assert [(c.name, c.mhc_backward, c.recipe) for c in cases] == [
        ("ours_nomtp+adamw@accum", "auto", "none"), ("ours_nomtp+adamw+mhc_tensor_ops@accum", "tensor_ops", "none")
    ]  # fmt: skip
    plain = _row("ours_nomtp", "accum", 22000.0, 220.0, 275.0, optimizer="adamw", mhc_backward="auto")
    ops = _row("ours_nomtp", "accum", 20000.0, 200.0, 250.0, optimizer="adamw", mhc_backward="tensor_ops")
    ops["case"] = "ours_nomtp+adamw+mhc_tensor_ops@accum"
    by_pair = {(q["case"], q["vs"]): q["tokens_per_s"] for q in bvt.ratios([plain, ops])}
    assert by_pair == {("ours_nomtp+adamw+mhc_tensor_ops@accum", "ours_nomtp@accum"): pytest.approx(20 / 22)}


def test_block_granularity_adds_our_compiled_systems_compared_with_the_default():
    cases = bvt.build_cases("accum,eager", "proxy", 6, 2, ["adamw"], granularities=("block",))
    names = [c.name for c in cases]
    assert "ours+block@accum" in names and "ours_nomtp+adamw+block@accum" in names
    assert not any("block" in n for n in names if n.endswith("@eager"))  # nothing to compile there
    whole = next(c for c in cases if c.name == "ours_nomtp+adamw+block@accum")
    assert whole.granularity == "block" and whole.recipe == "none" and whole.mhc_backward == "auto"
    assert next(c for c in cases if c.name == "ours_nomtp+adamw@accum").granularity == "auto"
    plain = _row("ours_nomtp", "accum", 22000.0, 220.0, 275.0, optimizer="adamw", granularity="auto")
    blocks = _row("ours_nomtp", "accum", 21000.0, 210.0, 262.5, optimizer="adamw", granularity="block")
    blocks["case"] = "ours_nomtp+adamw+block@accum"
    by_pair = {(q["case"], q["vs"]): q["tokens_per_s"] for q in bvt.ratios([plain, blocks])}
    assert by_pair == {("ours_nomtp+adamw+block@accum", "ours_nomtp@accum"): pytest.approx(21 / 22)}


def test_kernel_tuning_adds_our_compiled_systems_compared_with_the_config_default():
    cases = bvt.build_cases("accum,eager", "proxy", 6, 2, ["adamw"], kernel_tunings=("heuristic", "benchmark"))
    names = [c.name for c in cases]
    assert "ours+heuristic@accum" in names and "ours_nomtp+adamw+benchmark@accum" in names
    assert not any("heuristic" in n for n in names if n.endswith("@eager"))
    tuned = next(c for c in cases if c.name == "ours_nomtp+adamw+heuristic@accum")
    assert tuned.kernel_tuning == "heuristic" and tuned.granularity == "auto"
    assert next(c for c in cases if c.name == "ours_nomtp+adamw@accum").kernel_tuning == ""  # the config's default
    plain = _row("ours_nomtp", "accum", 22000.0, 220.0, 275.0, optimizer="adamw", kernel_tuning="")
    heuristic = _row("ours_nomtp", "accum", 21780.0, 217.8, 272.25, optimizer="adamw", kernel_tuning="heuristic")
    heuristic["case"] = "ours_nomtp+adamw+heuristic@accum"
    by_pair = {(q["case"], q["vs"]): q["tokens_per_s"] for q in bvt.ratios([plain, heuristic])}
    assert by_pair == {("ours_nomtp+adamw+heuristic@accum", "ours_nomtp@accum"): pytest.approx(0.99)}


def _row(system, group, tok_s, tf_ours, tf_tt, **kw):
    return {"case": f"{system}@{group}", "system": system, "group": group, "tokens_per_step": 16384,
            "step_ms_median": 1e3 * 16384 / tok_s, "tokens_per_s": tok_s, "tflops_megatron": tf_ours,
            "mfu_megatron": tf_ours / 989, "tflops_torchtitan": tf_tt, "mfu_torchtitan": tf_tt / 989,
            "peak_reserved_gib": 98.0, "first_step_s": 61.0, "build_s": 7.5, "unique_graphs": 8, "recompiles": 3,
            "case_wall_s": 100.0, **kw}  # fmt: skip


def test_ratios_and_table_pair_each_of_our_rows_with_torchtitan_in_its_group():
    rows = [
        _row("ours", "compiled", 12000.0, 200.0, 150.0),
        _row("torchtitan", "compiled", 30000.0, 360.0, 400.0),
        _row("ours", "eager", 8000.0, 100.0, 90.0),
        {"case": "torchtitan@eager", "system": "torchtitan", "group": "eager", "error": "timeout after 5 s: x"},
    ]
    ratio_rows = bvt.ratios(rows)
    assert ratio_rows == [
        {
            "case": "ours@compiled",
            "vs": "torchtitan@compiled",
            "tokens_per_s": 0.4,
            "tflops_megatron": pytest.approx(200 / 360),
            "tflops_torchtitan": 0.375,
        }
    ]  # fmt: skip  (ours@eager has no peer: its torchtitan row failed)
    table = bvt.format_table(rows, ratio_rows)
    assert "torchtitan@eager" + " " * 20 + "FAIL timeout after 5 s: x" in table
    assert "ours / torchtitan" in table and "0.400" in table and "20.2%" in table  # 200 / 989


def test_the_table_splits_the_compile_by_frame_and_says_what_each_prebuild_did_after_the_first_step_line():
    triton, fa4 = "21 kernel builds handed to 4 workers", "6 kernels announced (6 built, 0 building; exited 0)"
    frame = {"frame": "ffn_sublayer (model.py:90) 1/0", "ops": 900, "forward_s": 9.0, "dynamo_s": 2.5,
             "backend_s": 6.5, "backward_s": 3.0, "kernels": 40, "triton_s": 1.25, "first_run_s": 0.75}  # fmt: skip
    row = _row("ours", "accum", 30000.0, 300.0, 350.0, compile_time_s={"total_forward_s": 20.0},
               triton_prebuild_summary=triton, fa4_prebuild_summary=fa4, compile_by_frame=[frame])  # fmt: skip
    lines = bvt.format_table([row], []).splitlines()
    case = "ours@accum" + " " * 26
    first = next(i for i, line in enumerate(lines) if line.startswith(case + "first step 61.0 s"))
    assert lines[first + 1 : first + 5] == [
        case + "build 7.5 s; build + first step 68.5 s",
        case + "compile by frame, forward + backward: ffn_sublayer (model.py:90) 1/0 9.0 + 3.0 s (900 ops; dynamo 2.5, "
        "AOT + inductor 6.5; 40 Triton kernels 1.2 s; first runs 0.8 s)",
        case + "Triton prebuild: " + triton,
        case + "flash-attn-4 prebuild: " + fa4,
    ]


def test_the_compile_by_graph_split_parts_each_compile_and_names_its_frame():
    """Torch's raw records (as `compile_records` keeps them) for one frame: its forward compile, the backward graph's
    compile and a first-run record. Each compile is one row, the backward named after its forward's frame; the parts
    are AOT autograd (backend less inductor), inductor's graph work (inductor less code generation), code generation
    and module load, autotuning, GC and the kernels built; first runs are not compiles."""
    blank = dict.fromkeys(bvt.COMPILE_RECORD_FIELDS)
    kernels = json.dumps([["triton_poi_fused_0", 300000], ["triton_red_fused_1", 200000]])
    forward = blank | {"compile_id": "1/0", "is_forward": True, "is_runtime": False, "co_name": "ffn_sublayer",
                       "entire_frame_compile_time_s": 6.0, "backend_compile_time_s": 5.0,
                       "inductor_cumulative_compile_time_us": 4_000_000,
                       "inductor_code_gen_cumulative_compile_time_us": 2_500_000, "gc_time_us": 100_000,
                       "triton_kernel_compile_times_us": kernels}  # fmt: skip
    backward = blank | {"compile_id": "1/0", "is_forward": False, "is_runtime": False, "duration_us": 4_200_000,
                        "inductor_cumulative_compile_time_us": 4_100_000,
                        "inductor_code_gen_cumulative_compile_time_us": 3_000_000,
                        "compile_time_autotune_time_us": 1_500_000}  # fmt: skip
    first_run = blank | {"compile_id": "1/0", "is_forward": False, "is_runtime": True, "duration_us": 50_000}
    fwd_row, bwd_row = bvt.compile_graph_split([forward, backward, first_run])
    assert fwd_row == {"graph": "ffn_sublayer 1/0 forward", "total_s": 6.0, "aot_s": 1.0, "inductor_graph_s": 1.5,
                       "codegen_and_load_s": 2.5, "kernels": 2, "autotune_s": 0.0, "gc_s": 0.1, "kernels_s": 0.5}  # fmt: skip
    assert bwd_row == {"graph": "ffn_sublayer 1/0 backward", "total_s": 4.2, "aot_s": 0.0, "inductor_graph_s": 1.1,
                       "codegen_and_load_s": 3.0, "kernels": 0, "autotune_s": 1.5, "gc_s": 0.0, "kernels_s": 0.0}  # fmt: skip
    line = bvt.format_compile_graph_split([fwd_row, bwd_row])
    assert line.startswith("ffn_sublayer 1/0 forward 6.0 s (AOT 1.0, inductor 1.5 + codegen and load 2.5, autotune")
    assert "; ffn_sublayer 1/0 backward 4.2 s (" in line and "autotune 1.5" in line


def test_torchtitan_real_work_halves_the_attention():
    flops = bvt.torchtitan_flops_per_token(1000, 2, 3, 4, 10)
    assert flops == {"torchtitan": 1000.0, "megatron": 1000 - 6 * 2 * 3 * 4 * 10 / 2}


def test_a_case_that_runs_too_long_is_killed_and_reported(tmp_path):
    case = bvt.Case("ours", "eager", "tiny", "muon", 1, 1)
    row = bvt.run_case_subprocess(case, timeout_s=0.5, log_dir=tmp_path)
    assert row["error"].startswith("timeout after 0 s") or row["error"].startswith("timeout after 1 s")
    assert row["case"] == "ours@eager" and row["case_wall_s"] < 30


def test_a_case_that_crashes_is_a_fail_row_with_its_last_line(tmp_path):
    case = bvt.Case("ours", "eager", "proxy", "muon", 1, 1)  # the proxy shape needs a GPU
    row = bvt.run_case_subprocess(case, timeout_s=120, log_dir=tmp_path)
    if "error" not in row:
        pytest.skip("a GPU is visible: the proxy case ran")
    assert row["error"].startswith("exit 1") and "CUDA" in row["error"]


@pytest.mark.slow
def test_tiny_end_to_end_run_writes_rows_and_ratios(tmp_path):
    cases = "ours@eager,torchtitan@eager" if HAS_TORCHTITAN else "ours_nomtp+adamw@accum"
    out = tmp_path / "bvt.json"
    logs = tmp_path / "logs"
    argv = [
        "--size",
        "tiny",
        "--cases",
        cases,
        "--steps",
        "1",
        "--warmup",
        "1",
        "--out",
        str(out),
        "--log-dir",
        str(logs),
        "--sample-first-step",
    ]
    rc = bvt.main(argv)
    result = json.loads(out.read_text())
    assert rc == 0, result
    # each case's result and log land in --log-dir as it ends; its compile cache does not
    assert sorted(p.suffix for p in logs.iterdir()) == sorted([".json", ".log"] * len(result["rows"]))
    for row in result["rows"]:
        assert row["tokens_per_s"] > 0 and abs(row["first_ce"] - row["ln_vocab"]) < 1.5
        assert row["later_compiled_frames"] == 0  # the second step, other documents, ran the first step's graphs
        assert row["gflop_per_token_megatron"] > 0 and row["gflop_per_token_torchtitan"] > 0
        samples = row["first_step_samples"]  # the first step's sampled seconds add up to the first step
        assert abs(sum(samples["by_phase_s"].values()) - samples["wall_s"]) < 0.05
        assert 0.9 * samples["wall_s"] < row["first_step_s"] < samples["wall_s"] + 5.0
        # torch's raw compilation records, one per compile: every frame of the split is among them, with its ops
        records = row["compile_records"]
        assert row["compile_by_frame"] or row["group"] == "eager", row["compile_by_frame"]
        assert records and all(set(r) == set(bvt.COMPILE_RECORD_FIELDS) for r in records)
        for frame in row["compile_by_frame"]:
            mine = [r for r in records if r["compile_id"] == frame["frame"].rsplit(" ", 1)[1]]
            assert any(r["is_forward"] and r["graph_op_count"] == frame["ops"] for r in mine), (frame, mine)
        graphs = bvt.compile_graph_split(records)  # each frame's forward is among the compiles, its time the frame's
        for frame in row["compile_by_frame"]:
            name, compile_id = frame["frame"].split(" ")[0], frame["frame"].rsplit(" ", 1)[1]
            (fwd,) = [g for g in graphs if g["graph"] == f"{name} {compile_id} forward"]
            assert fwd["total_s"] == pytest.approx(frame["forward_s"], abs=1e-3)
    table = bvt.format_table(result["rows"], result["ratios"])
    assert "first step sampled: its memory figures are not the program's own" in table
    for row in result["rows"]:  # each compiled case's compiles split by graph
        assert row["group"] == "eager" or f"{row['case']:<36}compile by graph: " in table, table
    assert "sampled " in table and "other, under: " in table
    if HAS_TORCHTITAN:
        ours, titan = result["rows"]
        assert ours["gflop_per_token_megatron"] > titan["gflop_per_token_megatron"]  # MTP block + head counted
        assert [q["case"] for q in result["ratios"]] == ["ours@eager"]


def test_warm_restart_reruns_a_compiled_case_over_the_caches_of_its_first_run(tmp_path, monkeypatch):
    calls = []

    def fake_worker(case, timeout_s, result, env):
        calls.append((case, result.name, env["TORCHINDUCTOR_CACHE_DIR"], env["TRITON_CACHE_DIR"],
                      env["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"]))  # fmt: skip
        first = 12.5 if "warm" in result.name else 95.0
        return {**_row(case.system, case.group, 30000.0, 300.0, 350.0), "first_step_s": first, "compile_time_s": {}}

    monkeypatch.setattr(bvt, "_run_worker_process", fake_worker)
    compiled = bvt.Case("ours_nomtp", "accum", "proxy", "adamw", 3, 2, profile_steps=1, memory_snapshot=True)
    row = bvt.run_case_subprocess(compiled, 100.0, tmp_path, warm_restart=True)
    (cold, cold_file, *cold_cache), (warm, warm_file, *warm_cache) = calls
    assert cold == compiled and cold_file == "ours_nomtp_adamw_accum.json"
    assert (warm.steps, warm.warmup, warm.profile_steps, warm.memory_snapshot) == (1, 0, 0, False)
    assert warm_file.endswith("_warm_restart.json")
    assert warm_cache == cold_cache  # the same inductor, triton and flash-attn-4 caches
    assert row["first_step_s"] == 95.0 and row["warm_restart"]["first_step_s"] == 12.5
    assert "restarted over its compile cache: first step 12.5 s (cold 95.0 s)" in bvt.format_table([row], [])
    row["reserved_by_stream"] = [
        {"stream": "default", "segments": 3, "reserved_gib": 100.0, "allocated_gib": 20.0},
        {"stream": "side 1", "segments": 1, "reserved_gib": 24.5, "allocated_gib": 0.0},
    ]
    assert "reserved GiB by stream (allocated at the end): default 100.0 (20.0), side 1 24.5 (0.0)" in bvt.format_table(
        [row], []
    )
    row["memory_peak"] = {
        "events": 3, "allocated_gib": {"start": 50.0, "peak": 90.0, "end": 50.0},
        "reserved_gib": {"start": 100.0, "peak": 110.0, "end": 110.0}, "unused_at_reserved_peak_gib": 8.0,
        "unused_at_allocated_peak_gib": 3.0,
        "at_allocated_peak": [{"site": "(allocated before the recording)", "gib": 50.0, "blocks": None},
                              {"site": "llm_training/layers/moe.py:88 dispatch", "gib": 40.0, "blocks": 7}],
        "other_sites_gib": 0.0,
        "reserve_growth": {"gib": 10.0, "growths": 2, "by_site": [
            {"site": "llm_training/trainer/losses.py:96 forward", "gib": 10.0, "growths": 2, "request_gib": 2.0,
             "free_gib": 6.5}]},
    }  # fmt: skip
    table = bvt.format_table([row], [])
    assert (
        "memory over one more step, from an emptied cache:" in table
        and "reserved but unused at the reserved peak 8.00 GiB" in table
    )
    assert "at the allocated peak 3.00 GiB" in table
    assert "40.00 GiB in 7 blocks  llm_training/layers/moe.py:88 dispatch" in table
    assert "reserve grew by 10.00 GiB in 2 growths" in table
    assert (
        "10.00 GiB in 2 growths  llm_training/trainer/losses.py:96 forward  (request 2.00 GiB, free 6.50 GiB)" in table
    )
    row["peak_alloc_gib_after_step"], row["peak_reserved_gib_after_step"] = [90.0, 95.5], [110.0, 112.25]
    assert "peak allocated/reserved GiB after each step: 90.0/110.0 95.5/112.2" in bvt.format_table([row], [])
    calls.clear()
    bvt.run_case_subprocess(bvt.Case("ours", "eager", "proxy", "muon", 1, 1), 100.0, tmp_path, warm_restart=True)
    assert len(calls) == 1  # an eager case compiles nothing: no restart
