"""bench/jit_timing.py: the JIT-build timer patches a compile function for as long as it is open, counts a nested
call once, and puts the original back; bench_vs_torchtitan's first-step line adds its parts up to the first step."""

import importlib.util
import sys
import time
import types
from pathlib import Path

_BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


jit_timing = _load("jit_timing")


def test_times_each_outermost_call_and_restores_the_function(monkeypatch):
    fake = types.ModuleType("fake_dsl")
    calls = []

    def compile(kernel, depth=0):  # a compile that calls itself once, as a nested build would
        calls.append((kernel.__name__, depth))
        time.sleep(0.02)
        if depth == 0:
            fake.compile(kernel, depth + 1)
        return "kernel"

    def attention_fwd():
        pass

    def attention_bwd():
        pass

    fake.compile = compile
    monkeypatch.setitem(sys.modules, "fake_dsl", fake)
    monkeypatch.setattr(jit_timing, "_TARGETS", (("cute_compile", "fake_dsl", "", "compile"),
                                                 ("absent", "no_such_module_here", "", "compile")))  # fmt: skip
    with jit_timing.jit_time_breakdown() as jit:
        assert fake.compile(attention_fwd) == "kernel"
        assert fake.compile is not compile
        fake.compile(attention_bwd, 1)
    assert fake.compile is compile
    assert calls == [("attention_fwd", 0), ("attention_fwd", 1), ("attention_bwd", 1)]
    summary = jit.summary()
    assert summary["cute_compile_calls"] == 2  # the nested call is inside the first one's time
    assert 0.06 <= summary["cute_compile_s"] < 1.0
    assert "absent_s" not in summary  # its module does not import: left out, not reported as 0
    # slowest first: the outer call that contains the nested one
    assert [(e["what"], e["kernel"].rsplit(".", 1)[-1]) for e in summary["slowest"]] == [
        ("cute_compile", "attention_fwd"), ("cute_compile", "attention_bwd")
    ]  # fmt: skip


def test_first_step_line_adds_up_to_the_first_step():
    bvt = _load("bench_vs_torchtitan")
    row = {
        "first_step_s": 80.0,
        "compile_time_s": {"total_forward_s": 30.0, "total_backward_s": 15.0},
        "first_step_jit": {"triton_compile_s": 10.0, "triton_compile_calls": 12, "cute_compile_s": 8.0,
                           "cute_compile_calls": 4, "inductor_autotune_s": 2.0, "inductor_autotune_calls": 0},
    }  # fmt: skip
    line = bvt.first_step_breakdown(row)
    assert line == ("80.0 s = compile fwd 30.0 + bwd 15.0 + triton 10.0 (12x) + cute 8.0 (4x) + autotune 2.0"
                    " + rest 15.0; inductor's compile workers at its start: not started")  # fmt: skip
    row["compile_pool_ready_at_first_step"] = False
    assert bvt.first_step_breakdown(row).endswith("; inductor's compile workers at its start: still starting")


def test_compile_pool_readiness_is_read_without_starting_a_pool(monkeypatch):
    from concurrent.futures import Future

    from torch._inductor.async_compile import AsyncCompile

    bvt = _load("bench_vs_torchtitan")
    monkeypatch.setattr(AsyncCompile, "_ready_future", None)
    assert bvt.compile_pool_ready() is None and AsyncCompile._ready_future is None  # asked for nothing
    pending = Future()
    monkeypatch.setattr(AsyncCompile, "_ready_future", pending)
    assert bvt.compile_pool_ready() is False
    pending.set_result("ready")
    assert bvt.compile_pool_ready() is True


class _Fn:  # what `_specialization` reads of a Triton JITFunction: its name and argument names
    def __init__(self, name, *arg_names):
        self.__name__, self.arg_names = name, list(arg_names)


class _Source:  # what it reads of Triton's ASTSource: fn, signature, constants, attrs
    def __init__(self, fn, signature, constants, attrs):
        self.fn, self.signature, self.constants, self.attrs = fn, signature, constants, attrs


def test_a_kernel_built_under_two_specializations_names_the_argument_that_differed(monkeypatch):
    fake = types.ModuleType("fake_triton")
    fake.compile = lambda src, target=None, options=None: "kernel"
    monkeypatch.setitem(sys.modules, "fake_triton", fake)
    monkeypatch.setattr(jit_timing, "_TARGETS", (("triton_compile", "fake_triton", "", "compile"),))
    fn = _Fn("_ce_chunk_kernel", "logits_ptr", "weight_ptr", "V")
    signature = {"logits_ptr": "*fp32", "weight_ptr": "*fp32", "V": "constexpr"}
    aligned = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
    with jit_timing.jit_time_breakdown() as jit:
        for attrs in (aligned, {(0,): [["tt.divisibility", 16]]}, aligned):  # chunk 0, chunk 1, chunk 2
            fake.compile(_Source(fn, signature, {(2,): 220160}, attrs), None, options={"num_warps": 8})
        fake.compile(
            _Source(_Fn("_poly_fwd_kernel", "x"), {"x": "*bf16"}, {}, {}), options={"num_warps": 4}
        )  # one specialization
    summary = jit.summary()
    assert summary["triton_compile_calls"] == 4
    assert summary["rebuilt"] == [
        {"kernel": "_ce_chunk_kernel", "specializations": 2, "differs": {"weight_ptr": ["*fp32 D16", "*fp32"]}}
    ]
    assert jit.specializations["_ce_chunk_kernel"][0] == {
        "logits_ptr": "*fp32 D16", "weight_ptr": "*fp32 D16", "V": "constexpr =220160", "options.num_warps": "8"
    }  # fmt: skip
    bvt = _load("bench_vs_torchtitan")
    assert bvt.format_rebuilt(summary["rebuilt"]) == "_ce_chunk_kernel x2 (weight_ptr: *fp32 D16 | *fp32)"
    assert bvt.format_rebuilt([]) == ""


def test_a_compile_of_something_else_than_a_triton_function_records_no_specialization():
    assert jit_timing._specialization(("ttir text",), {}) is None
    src = _Source(_Fn("k", "x"), {"x": "i32"}, {}, {(0,): [["tt.equal_to", 1]]})
    assert jit_timing._specialization((), {"src": src}) == {"x": "i32 tt.equal_to=1"}
