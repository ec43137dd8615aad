"""bench/kernel_callers.py: kernels charged to the op and code that launched them; the GPU's idle gaps."""

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(_BENCH))  # kernel_callers imports kernel_groups as the harness does
_spec = importlib.util.spec_from_file_location("kernel_callers", _BENCH / "kernel_callers.py")
kernel_callers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_callers)


def _cpu(name, start, end, parent=None, id=None, seq=-1, thread=1, fwd_thread=None, shapes=()):
    return SimpleNamespace(
        name=name, device_type="DeviceType.CPU", id=id, cpu_parent=parent, sequence_nr=seq, thread=thread,
        fwd_thread=fwd_thread, input_shapes=list(shapes), time_range=SimpleNamespace(start=start, end=end),
    )  # fmt: skip


def _kernel(name, start, end, launched_by=None, annotation=False):
    return SimpleNamespace(
        name=name, device_type="DeviceType.CUDA", is_user_annotation=annotation,
        linked_correlation_id=launched_by.id if launched_by is not None else 0,
        time_range=SimpleNamespace(start=start, end=end),
    )  # fmt: skip


def _chrome(*events, python=()) -> dict:
    """A Chrome trace of the ops (`cpu_op`, External id = the op's id) and Python calls (name, start, end) on one
    thread, as `prof.export_chrome_trace` writes it."""
    ops = [
        {"ph": "X", "cat": "cpu_op", "name": e.name, "pid": 1, "tid": 1, "ts": e.time_range.start,
         "dur": e.time_range.end - e.time_range.start, "args": {"External id": e.id or 0}}
        for e in events
    ]  # fmt: skip
    calls = [
        {"ph": "X", "cat": "python_function", "name": name, "pid": 1, "tid": 1, "ts": t0, "dur": t1 - t0, "args": {}}
        for name, t0, t1 in python
    ]
    return {"traceEvents": ops + calls}


def _trace():
    """(events, frames): a forward op in our loss, the backward node it created running a 2 ms fp32 multiply (no
    frame of its own), an FSDP range with a copy, and a Muon step; the Python calls around them in the Chrome
    trace."""
    trainer = _cpu("ProfilerStep#1", 0, 100_000)
    mm = _cpu("aten::mm", 0, 1_000, trainer, id=1, seq=7, thread=1, shapes=[[8, 4], [4, 16]])
    node = _cpu("autograd::engine::evaluate_function: MulBackward0", 20_000, 30_000, trainer, seq=7, fwd_thread=1)
    mul = _cpu("aten::mul", 20_000, 21_000, node, id=2, seq=-1, thread=2, shapes=[[220160, 4096], []])
    fsdp = _cpu("FSDP::post_backward_reduce", 30_000, 40_000, trainer)
    cat = _cpu("aten::_chunk_cat", 30_000, 31_000, fsdp, id=3)
    opt = _cpu("Optimizer.step#Muon.step", 50_000, 60_000, trainer)
    bmm = _cpu("aten::bmm", 50_000, 51_000, opt, id=4)
    # the CUDA runtime's launch event of the mm: CUPTI's correlation id 3 (the _chunk_cat's op id too), linked to op 1
    launch = _cpu("cudaLaunchKernel", 100, 120, mm, id=3)
    launch.linked_correlation_id = 1
    cpu = [trainer, mm, node, mul, fsdp, cat, opt, bmm, launch]
    gpu = [
        _kernel("nvjet_sm90_tst_fwd", 1_000, 4_000, mm),  # 3 ms
        _kernel("elementwise_kernel<MulFunctor<float>>", 22_000, 24_000, mul),  # 2 ms, after an 18 ms gap
        _kernel("elementwise_kernel<MulFunctor<float>>", 24_000, 26_000, mul),  # again: same row
        _kernel("chunk_cat_cuda_kernel", 31_000, 32_000, cat),  # after a 5 ms gap
        _kernel("Optimizer.step#Muon.step", 52_000, 58_000, annotation=True),
        _kernel("nvjet_sm90_tst_ns", 52_000, 57_000, bmm),  # inside Muon's GPU range; after a 20 ms gap
        _kernel("nvjet_sm90_tst_ns_overlap", 53_000, 56_000, bmm),  # another stream, inside the busy interval
        _kernel("Memcpy DtoD (Device -> Device)", 58_000, 59_000),  # no linked op; right after Muon's range
    ]
    trace = _chrome(
        mm, node, mul, cat, bmm,
        python=[
            ("/work/bench/bench_train.py(157): train_step_on_random_data", 0, 100_000),  # the harness: never named
            ("/x/llm_training/trainer/trainer.py(398): train_step", 0, 99_000),  # called backward(): above the node
            ("/x/llm_training/trainer/losses.py(124): forward", 0, 10_000),
            ("/x/optimizer/optimizer/newton_schulz.py(83): orthogonalise_wide_", 50_000, 60_000),
        ],
    )  # fmt: skip
    return cpu + gpu, kernel_callers.python_frames(trace)


def test_python_frames_stop_at_the_backward_node():
    _, frames = _trace()
    assert frames == {
        1: "llm_training/trainer/losses.py:124 forward",
        3: "llm_training/trainer/trainer.py:398 train_step",  # the FSDP copy: no frame nearer than the step
        4: "optimizer/optimizer/newton_schulz.py:83 orthogonalise_wide_",
    }  # 2 (the mul, inside MulBackward0) has none: trainer.py is above its node


def test_python_frames_drop_calls_whose_return_the_tracer_missed():
    """A compiled block's frame whose return the Python tracer did not see (the GPU machine's torch 2.11 charged
    Muon's step to the MTP block's forward): one left open until the profiler stopped, which closes it there, and
    one closed late, after its caller returned. Neither names the ops that run after it."""
    mm = _cpu("aten::mm", 1_000, 2_000, id=1)
    bmm = _cpu("aten::bmm", 50_000, 51_000, id=2)
    add = _cpu("aten::add", 70_000, 71_000, id=3)
    trace = _chrome(
        mm, bmm, add,
        python=[
            ("/work/bench/bench_vs_torchtitan.py(600): profile_step", 0, 100_000),  # open at the stop: the harness
            ("/x/llm_training/trainer/trainer.py(398): train_step", 0, 60_000),
            ("/x/llm_training/motif/mtp.py(56): forward", 500, 100_000),  # never returned: closed at the stop
            ("/x/optimizer/optimizer/muon.py(200): step", 49_000, 52_000),
            ("/x/llm_training/trainer/trainer.py(500): log_step", 65_000, 80_000),
            ("/x/llm_training/motif/model.py(219): forward", 65_500, 66_000),
            ("/x/llm_training/layers/moe.py(100): forward", 65_600, 90_000),  # closed after its caller returned
        ],
    )  # fmt: skip
    assert kernel_callers.python_frames(trace) == {
        1: "llm_training/trainer/trainer.py:398 train_step",
        2: "optimizer/optimizer/muon.py:200 step",
        3: "llm_training/trainer/trainer.py:500 log_step",
    }


def test_kernels_are_charged_to_their_op_context_and_our_frame():
    events, frames = _trace()
    rows = kernel_callers.kernel_callers(events, steps=2, frames=frames)
    by_op = {r["op"]: r for r in rows}
    mul = by_op["aten::mul"]
    assert mul["group"] == "elementwise/fused"
    assert mul["ms_per_step"] == pytest.approx(2.0) and mul["launches_per_step"] == 1.0
    assert mul["context"] == "bwd MulBackward0"
    # no frame of its own below the node: the forward op with the node's sequence number names it
    assert mul["frame"] == "bwd of llm_training/trainer/losses.py:124 forward"
    assert mul["shapes"] == "[[220160, 4096], []]"
    mm = by_op["aten::mm"]
    assert (mm["group"], mm["frame"], mm["context"]) == ("bf16 GEMM", "llm_training/trainer/losses.py:124 forward", "")
    assert by_op["aten::_chunk_cat"]["context"] == "FSDP::post_backward_reduce"
    bmm = by_op["aten::bmm"]
    assert bmm["group"] == "optimizer: Muon" and bmm["ms_per_step"] == pytest.approx(4.0)
    assert bmm["frame"] == "optimizer/optimizer/newton_schulz.py:83 orthogonalise_wide_"
    assert by_op["?"]["group"] == "copies/casts"  # the memcpy no op is linked to
    assert [r["ms_per_step"] for r in rows] == sorted((r["ms_per_step"] for r in rows), reverse=True)
    table = kernel_callers.format_callers(rows, min_ms=1.0)
    assert "aten::mul  [bwd MulBackward0]  bwd of llm_training/trainer/losses.py:124 forward" in table
    assert "aten::_chunk_cat" not in table  # 0.5 ms per step: under the cut
    assert all(r["frame"] == "" for r in kernel_callers.kernel_callers(events, steps=2))  # no trace, no frames


def test_gpu_idle_counts_time_no_stream_is_busy_and_names_who_ends_each_gap():
    events, _ = _trace()
    idle = kernel_callers.gpu_idle(events, steps=2, n=2)
    # kernels cover [1, 4] + [22, 26] + [31, 32] + [52, 57] + [58, 59] ms of the span [1, 59] (the annotation
    # range [52, 58] is not a kernel)
    assert idle["span_ms_per_step"] == pytest.approx(58 / 2)
    assert idle["busy_ms_per_step"] == pytest.approx(14 / 2)
    assert idle["idle_ms_per_step"] == pytest.approx(44 / 2)
    first, second = idle["gaps"]
    assert first["gap_ms"] == pytest.approx(20.0) and first["next_op"] == "aten::bmm"
    assert first["after_kernel"] == "chunk_cat_cuda_kernel"
    assert first["next_context"] == "Optimizer.step#Muon.step"
    assert second["gap_ms"] == pytest.approx(18.0) and second["next_context"] == "bwd MulBackward0"
    assert "20.00" in kernel_callers.format_idle(idle)


def test_gpu_idle_without_kernels_is_zero():
    assert kernel_callers.gpu_idle([_cpu("aten::mm", 0, 1, id=1)], steps=1)["idle_ms_per_step"] == 0.0


@pytest.mark.parametrize(
    "name, frame",
    [
        ("/usr/lib/python3.12/site-packages/llm_training/layers/moe.py(230): _looped_matmul",
         "llm_training/layers/moe.py:230 _looped_matmul"),
        ("activations/activation/poly_norm.py(12): forward", "activations/activation/poly_norm.py:12 forward"),
        ("torch/nn/modules/module.py(1775): _call_impl", None),
        ("aten::mm", None),
    ],
)  # fmt: skip
def test_our_frame(name, frame):
    assert kernel_callers.our_frame(name) == frame


def test_without_kernel_links_each_kernel_is_charged_through_its_launch_call():
    """torch 2.11's form: kernel events carry no link; a kernel's id is CUPTI's correlation id, which its launch
    call (a CPU event inside the op) carries too, and which may equal an unrelated op's id. The rows are those of
    the linked form."""
    events, frames = _trace()
    by_name = {e.name: e for e in events if not str(e.device_type).endswith("CUDA")}
    del events[events.index(by_name["cudaLaunchKernel"])]
    cupti_ids = iter([3, 4, 1, 2, 5, 6, 7])  # 1-4: also op ids, of other ops
    for kernel in (e for e in events if str(e.device_type).endswith("CUDA") and not e.is_user_annotation):
        op = next((o for o in by_name.values() if o.id == kernel.linked_correlation_id), None)
        del kernel.linked_correlation_id
        kernel.id = next(cupti_ids)
        if op is not None:
            events.append(
                _cpu("cuLaunchKernelEx", kernel.time_range.start - 10, kernel.time_range.start - 5, op, id=kernel.id)
            )
    for e in events:
        if hasattr(e, "linked_correlation_id"):
            del e.linked_correlation_id
    linked_events, _ = _trace()
    linked = kernel_callers.kernel_callers(linked_events, steps=2, frames=frames)
    assert kernel_callers.kernel_callers(events, steps=2, frames=frames) == linked
    assert kernel_callers.gpu_idle(events, steps=2) == kernel_callers.gpu_idle(linked_events, steps=2)


def _frames_of(prof, tmp_path) -> dict[int, str]:
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    return kernel_callers.python_frames(json.loads(path.read_text()))


def test_labels_of_a_real_cpu_profile(tmp_path):
    """The profiler's own events (CPU, shapes and stacks) for our chunked loss, forward and backward: forward ops
    name our function; ops of our autograd Function's backward name that backward; ops of a C++ backward node
    (the reshape's ViewBackward0) name the forward function that created the node."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from llm_training.trainer.losses import linear_cross_entropy_sum

    g = torch.Generator().manual_seed(0)
    h = torch.randn(12, 8, generator=g, requires_grad=True)
    w = torch.randn(20, 8, generator=g, requires_grad=True)
    y = torch.randint(0, 20, (12,), generator=g)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
        linear_cross_entropy_sum(h.view(3, 4, 8), w, y.view(3, 4), chunk_tokens=4).backward()
    events = list(prof.events())
    launchers = kernel_callers._Launchers(events, _frames_of(prof, tmp_path))
    labels = {launchers.label(e) for e in events if e.name.startswith("aten::")}
    assert any(
        op == "aten::mm" and not ctx and frame.startswith("llm_training/trainer/losses.py:")
        for op, ctx, frame in labels
    )
    assert any(
        op == "aten::mul" and ctx == "bwd _ChunkedLinearCrossEntropyBackward" and frame.endswith(" backward")
        for op, ctx, frame in labels
    ), sorted(labels)
    assert any(
        ctx == "bwd ViewBackward0" and frame.startswith("bwd of llm_training/trainer/losses.py:")
        for _, ctx, frame in labels
    ), sorted(labels)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_a_real_cuda_profile_charges_kernels_to_our_ops(tmp_path):
    """On the GPU machine's torch (2.11: kernels carry no link, only their launch call's id; the Python frames are
    in the Chrome trace only) as on newer ones: our loss's GEMM kernels are charged to `aten::mm` with our frame, its
    backward's to our backward, and every idle gap names the op that ended it (the leaves' AccumulateGrad adds too,
    whose launch calls torch 2.11 leaves without a parent)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from llm_training.trainer.losses import linear_cross_entropy_sum

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(512, 256, device="cuda", generator=g, requires_grad=True)
    w = torch.randn(4096, 256, device="cuda", generator=g, requires_grad=True)
    y = torch.randint(0, 4096, (512,), device="cuda", generator=g)

    def loss():
        return linear_cross_entropy_sum(h.view(4, 128, 256), w, y.view(4, 128), chunk_tokens=128)

    loss().backward()  # warm-up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True) as p:
        loss().backward()
        torch.cuda.synchronize()
    rows = kernel_callers.kernel_callers(p.events(), steps=1, n=200, frames=_frames_of(p, tmp_path))
    assert any(r["op"] == "aten::mm" and r["frame"].startswith("llm_training/trainer/losses.py:") for r in rows), rows
    assert any(r["context"] == "bwd _ChunkedLinearCrossEntropyBackward" for r in rows), rows
    charged = sum(r["ms_per_step"] for r in rows if r["op"] != "?")
    assert charged >= 0.9 * sum(r["ms_per_step"] for r in rows), rows  # nearly every kernel has its op
    idle = kernel_callers.gpu_idle(p.events(), steps=1)
    assert idle["gaps"] and all(gap["next_op"] != "?" for gap in idle["gaps"]), idle["gaps"]


def test_a_launch_call_without_a_parent_is_charged_to_the_op_holding_it_in_time():
    """torch 2.11 files the launch calls of the autograd engine's AccumulateGrad under another thread number than
    the `aten::add_` they run in, and leaves them without a parent: the kernel goes to the op that started last
    before the call and ends after it, not to `?` and not to an op that ended before it."""
    node = _cpu("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 100, 900, thread=2)
    add = _cpu("aten::add_", 200, 800, node, id=11, thread=2)
    earlier = _cpu("aten::mul", 150, 190, node, id=12, thread=2)  # started before the call, ended before it
    launch = _cpu("cudaLaunchKernel", 300, 310, None, id=11, thread=1)  # CUPTI's id: the add_'s op id by chance
    kernel = SimpleNamespace(
        name="vectorized_elementwise_kernel<CUDAFunctor_add<float>>", device_type="DeviceType.CUDA", id=11,
        is_user_annotation=False, time_range=SimpleNamespace(start=2_000, end=3_000),
    )  # fmt: skip
    first = SimpleNamespace(
        name="nvjet_sm90_tst_fwd", device_type="DeviceType.CUDA", id=99, is_user_annotation=False,
        time_range=SimpleNamespace(start=0, end=1_000),
    )  # fmt: skip
    events = [node, add, earlier, launch, kernel, first]
    rows = kernel_callers.kernel_callers(events, steps=1)
    assert {r["op"]: r["context"] for r in rows} == {"aten::add_": "bwd torch::autograd::AccumulateGrad", "?": ""}
    (gap,) = kernel_callers.gpu_idle(events, steps=1)["gaps"]
    assert gap["gap_ms"] == pytest.approx(1.0) and gap["next_op"] == "aten::add_"
