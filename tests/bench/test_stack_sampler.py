"""bench/stack_sampler.py: the innermost known library decides a sample's phase; time outside every phase is
named by the line of ours it ran under; a wait in the autograd engine samples the engine thread's Python instead."""

import _thread
import importlib.util
import sys
import time
import weakref
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


def test_garbage_cycles_made_while_sampling_do_not_outlive_it():
    class Node:
        pass

    with stack_sampler.sample_stack(interval_s=0.005):
        node = Node()
        node.itself, node.data = node, bytearray(1 << 20)  # a cycle holding a MiB, as sampled frames form
        alive = weakref.ref(node)
        del node
        _spin(0.05)
    assert alive() is None


def test_a_phase_counts_the_frame_that_called_into_its_library(tmp_path):
    # a stand-in "triton/compiler" module whose compile spins, called from this file's launcher
    compiler = tmp_path / "triton" / "compiler" / "compiler.py"
    compiler.parent.mkdir(parents=True)
    compiler.write_text("import time\n\ndef compile(seconds):\n    end = time.perf_counter() + seconds\n"
                        "    while time.perf_counter() < end:\n        pass\n")  # fmt: skip
    namespace = {}
    exec(compile(compiler.read_text(), str(compiler), "exec"), namespace)

    def launch_kernel():
        namespace["compile"](0.3)

    with stack_sampler.sample_stack(interval_s=0.005) as samples:
        launch_kernel()
    summary = samples.summary()
    assert max(summary["by_phase_s"], key=summary["by_phase_s"].get) == "triton_build"
    top = summary["callers"]["triton_build"][0]
    assert top["where"].startswith("bench/test_stack_sampler.py:") and top["where"].endswith(" launch_kernel")


def test_format_samples_gives_the_phases_the_lines_and_the_callers():
    summary = {"wall_s": 3.0, "by_phase_s": {"inductor": 1.5, "triton_build": 0.5, "other": 1.0},
               "other_frames": [{"s": 1.0, "where": "llm_training/trainer/trainer.py:10 step"}],
               "callers": {"triton_build": [{"s": 0.5, "where": "llm_training/layers/mhc/kernels.py:9 mix"}]}}  # fmt: skip
    phases, lines, callers = stack_sampler.format_samples(summary)
    assert phases == "sampled 3.0 s = inductor 1.5 + triton_build 0.5 + other 1.0"
    assert lines == "other, under: 1.0 s llm_training/trainer/trainer.py:10 step"
    assert callers == "triton_build, called from: 0.5 s llm_training/layers/mhc/kernels.py:9 mix"
