"""bench/stack_sampler.py: the innermost known library decides a sample's phase; time outside every phase is
named by the line of ours it ran under; a wait in the autograd engine samples the engine thread's Python instead."""

import _thread
import importlib.util
import sys
import time
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "bench" / "stack_sampler.py"
_spec = importlib.util.spec_from_file_location("stack_sampler", _PATH)
stack_sampler = importlib.util.module_from_spec(_spec)
sys.modules["stack_sampler"] = stack_sampler
_spec.loader.exec_module(stack_sampler)


def test_the_innermost_known_library_decides_the_phase():
    site = "/usr/lib/python3.12/site-packages"
    inductor_calls_sympy = [f"{site}/sympy/core/add.py", f"{site}/torch/_inductor/lowering.py",
                            f"{site}/torch/_dynamo/convert_frame.py", "/repo/llm_training/trainer/trainer.py"]  # fmt: skip
    assert stack_sampler.phase_of(inductor_calls_sympy) == "inductor"
    launch_builds = [f"{site}/triton/compiler/compiler.py", f"{site}/triton/runtime/jit.py",
                     f"{site}/torch/_inductor/runtime/triton_heuristics.py"]  # fmt: skip
    assert stack_sampler.phase_of(launch_builds) == "triton_build"
    assert stack_sampler.phase_of([f"{site}/torch/_functorch/aot_autograd.py"]) == "aot_autograd"
    assert stack_sampler.phase_of([f"{site}/torch/nn/modules/module.py", "/repo/bench/x.py"]) == "other"


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_other_time_is_named_by_the_line_it_ran_under():
    with stack_sampler.sample_stack(interval_s=0.005) as samples:
        _spin(0.3)
    summary = samples.summary()
    assert summary["samples"] >= 20
    assert abs(sum(summary["by_phase_s"].values()) - summary["wall_s"]) < 0.02  # samples scaled to the wall time
    assert list(summary["by_phase_s"]) == ["other"]
    top = summary["other_frames"][0]
    assert top["where"].startswith("bench/test_stack_sampler.py:") and top["where"].endswith(" _spin")
    assert top["s"] > 0.8 * summary["wall_s"]


def _backward_on_an_engine_thread(seconds: float) -> None:
    _spin(seconds)


def test_a_wait_in_the_autograd_engine_samples_the_engine_thread():
    done = _thread.allocate_lock()
    done.acquire()

    def engine_thread():  # started by _thread, as the autograd engine's C++ threads: no threading.py frame
        _backward_on_an_engine_thread(0.3)
        done.release()

    def _engine_run_backward():  # torch.autograd's wait for the engine: it blocks in C, as this acquire does
        _thread.start_new_thread(engine_thread, ())
        done.acquire()

    with stack_sampler.sample_stack(interval_s=0.005) as samples:
        _engine_run_backward()
    frames = {f["where"].split(" ")[-1]: f["s"] for f in samples.summary()["other_frames"]}
    assert frames.get("_spin", 0.0) > frames.get("_engine_run_backward", 0.0)


def test_format_samples_gives_the_phases_then_the_lines():
    summary = {"wall_s": 3.0, "by_phase_s": {"inductor": 2.0, "other": 1.0},
               "other_frames": [{"s": 1.0, "where": "llm_training/trainer/trainer.py:10 step"}]}  # fmt: skip
    phases, lines = stack_sampler.format_samples(summary)
    assert phases == "sampled 3.0 s = inductor 2.0 + other 1.0"
    assert lines == "other, under: 1.0 s llm_training/trainer/trainer.py:10 step"
