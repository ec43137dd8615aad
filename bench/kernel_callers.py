"""Which code launches a profile's GPU kernels, and when the GPU waits for the host.

`kernel_groups.py` answers "which kind of kernel takes the time"; this module answers "which line launched it" and
"how long did the GPU sit idle", from the same `prof.events()` (a torch.profiler run with CPU and CUDA activity)
and, for the Python frames, the run's Chrome trace (`prof.export_chrome_trace`, `python_frames`).

`kernel_callers(events, steps, n)` charges every GPU kernel to the CPU op that launched it and labels the op with:
- `context`: the nearest enclosing ranges that say what the op is part of: the backward node it runs in
  (`autograd::engine::evaluate_function: MulBackward0` -> `bwd MulBackward0`), FSDP2's ranges (`FSDP::...`), an
  optimizer's step (`Optimizer.step#Muon.step`), a compiled graph's call;
- `frame`: the innermost function of our own code (llm_training, the optimizer and activation packages) above the
  op, as `file:line name` (the line where the function starts), from a profile taken `with_stack=True`. An op
  inside a backward node has no frame of its own below the node; it gets the frame of the forward op that created
  the node (same sequence number), written `bwd of <frame>`.
The kernel -> op link comes in two forms (both met on our machines):
- torch >= 2.13 (the CPU machines): a kernel event carries `linked_correlation_id`, the id of its op.
- torch 2.11 (the GPU machines): no link on the kernel event. Its `id` is CUPTI's correlation id, which the CUDA
  runtime's (or driver's) launch call on the CPU carries too, and that call runs inside the op that launched the
  kernel: kernel -> launch call -> its parent (or, for a call the profiler left without one, the op whose time
  range holds it: `_Launchers._enclosing_op`).
The Python frames are read from the Chrome trace in both: torch 2.11 keeps them out of `prof.events()` (and leaves
each op's `stack` empty) and exports them only there, as `python_function` events on the op's thread.
Rows (group, op, context, frame, input shapes) with ms and launches per step, largest first: enough to tell which
of our lines launches, say, a 2 ms fp32 multiply per micro-batch.

`gpu_idle(events, steps, n)`: the time inside the profiled span during which no kernel, copy or memset runs on any
stream, per step, with the n longest gaps: how long, the kernel that ends each gap, and the op (with its context)
that launched that kernel, i.e. what the GPU was waiting for the host to issue.
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from collections.abc import Iterable

from kernel_groups import charged_kernel_events

FRAME = re.compile(r"^(?P<path>.+?\.py)\((?P<line>\d+)\): (?P<func>.+)$")
# the packages whose frames name a caller (innermost first wins); the harness's own frames are never the answer
OUR_CODE = ("llm_training/", "optimizer/optimizer/", "activations/activation/")
BACKWARD_NODE = re.compile(r"^autograd::engine::evaluate_function: (\S+)")
CONTEXT_RANGE = re.compile(r"^(FSDP::|Optimizer\.step#|## Call CompiledFxGraph|CompiledFunction|Torch-Compiled Region)")
# the CUDA runtime's and driver's calls (cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, ...)
RUNTIME_CALL = re.compile(r"^cu(da)?[A-Z]\w*$")
CONTEXT_DEPTH = 2  # ranges kept per op, innermost first
_ENCLOSING_SEARCH = 4096  # ops looked at, latest start first, for a launch call without a parent


def our_frame(name: str) -> str | None:
    """`llm_training/layers/moe.py:226 _looped_matmul` for a Python-call event named
    `/any/prefix/llm_training/layers/moe.py(226): _looped_matmul` (226: the line where the function starts); None
    for other events and other code."""
    m = FRAME.match(name)
    if m is None:
        return None
    path = m["path"].replace("\\", "/")
    for marker in OUR_CODE:
        at = path.rfind(marker)
        if at >= 0:
            return f"{path[at:]}:{m['line']} {m['func']}"
    return None


def _ancestors(evt):
    q = getattr(evt, "cpu_parent", None)
    while q is not None:
        yield q
        q = getattr(q, "cpu_parent", None)


def python_frames(trace: dict) -> dict[int, str]:
    """Op id -> our innermost Python frame above the op and below the backward node it runs in, if any (above the
    node: the engine and whoever called backward(), not the op's caller), from a Chrome trace of a profile taken
    `with_stack=True`: its `python_function` events and ops (`External id`: the op event's id) nested by time on
    each thread. A call whose return the tracer missed names nothing after it: one of ours still open when the
    profiler stopped (which closes it there) is left out, and a call ends no later than its caller (torch 2.11 on
    the GPU machine charged the whole optimizer step to the MTP block's compiled forward, session 38)."""
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in trace.get("traceEvents", ()):
        if e.get("ph") == "X" and e.get("cat") in ("python_function", "cpu_op", "user_annotation"):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    stopped_at = max((_end(e) for es in by_thread.values() for e in es), default=0.0)  # the profiler's stop
    frames: dict[int, str] = {}
    for events in by_thread.values():
        events.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        enclosing: list[tuple[dict, float]] = []  # (event, end), outermost first
        for e in events:
            while enclosing and enclosing[-1][1] <= e["ts"]:
                enclosing.pop()
            op_id = (e.get("args") or {}).get("External id")
            if e["cat"] == "cpu_op" and op_id:
                for q, _ in reversed(enclosing):
                    if BACKWARD_NODE.match(q["name"]):
                        break
                    frame = our_frame(q["name"]) if q["cat"] == "python_function" else None
                    if frame:
                        frames[op_id] = frame
                        break
            if e["cat"] == "python_function" and _end(e) >= stopped_at and our_frame(e["name"]):
                continue  # open when the profiler stopped (it closes such calls there): its return was never seen
            # a call ends no later than what encloses it: a callee whose return the tracer missed (closed late)
            # must not hold the ops its caller's caller runs next
            enclosing.append((e, min(_end(e), enclosing[-1][1]) if enclosing else _end(e)))
    return frames


def _end(event: dict) -> float:
    return event["ts"] + event.get("dur", 0)


def _label(op) -> tuple[str, object | None]:
    """(context, enclosing backward-node event or None) of a CPU op: the ranges read from its ancestors up to (and
    including) the backward node it runs in, then those around the node."""
    context, node = [], None
    for q in _ancestors(op):
        m = BACKWARD_NODE.match(q.name)
        if m:
            node = q
            if len(context) < CONTEXT_DEPTH:
                context.append(f"bwd {m[1]}")
            break
        if CONTEXT_RANGE.match(q.name) and len(context) < CONTEXT_DEPTH:
            context.append(q.name.strip("# ")[:60])
    for q in _ancestors(node) if node is not None else ():  # ranges around the backward (FSDP's, the optimizer's)
        if CONTEXT_RANGE.match(q.name) and len(context) < CONTEXT_DEPTH:
            context.append(q.name.strip("# ")[:60])
    return " < ".join(context), node


class _Launchers:
    """The CPU op behind each kernel (its link, or its launch call's parent: the module docstring's two forms) and
    its label; `frames`: `python_frames` of the profile's trace (none: no frames), with the forward frames by
    sequence number for ops inside backward nodes."""

    def __init__(self, events: list, frames: dict[int, str] | None = None):
        cpu = [e for e in events if not str(getattr(e, "device_type", "")).endswith(("CUDA", "PrivateUse1"))]
        # the ops a link can name: frontend events, neither linked themselves nor runtime calls (those carry CUPTI's
        # correlation ids, another numbering that must not shadow the ops' ids)
        self.by_id = {
            e.id: e
            for e in cpu
            if getattr(e, "id", 0) and not getattr(e, "linked_correlation_id", 0) and not RUNTIME_CALL.match(e.name)
        }
        self.launch_by_id = {e.id: e for e in cpu if getattr(e, "id", 0) and RUNTIME_CALL.match(e.name)}
        self.frames = frames or {}
        self.forward_frame: dict[tuple, str] = {}
        # Every op records the sequence number the next autograd node will take, and the node's creator is the
        # last op to start before the number moves on: in time order, later ops overwrite earlier ones.
        for e in sorted(self.by_id.values(), key=lambda e: e.time_range.start):
            seq = getattr(e, "sequence_nr", -1)
            if seq is None or seq < 0 or e.name.startswith("autograd::") or e.id not in self.frames:
                continue
            if _label(e)[1] is None:
                self.forward_frame[(seq, getattr(e, "thread", None))] = self.frames[e.id]
        self._labels: dict[int, tuple[str, str, str]] = {}  # by the op event's identity
        # the ops sorted by start and their start times (`_enclosing_op`; built when first needed)
        self._ops_by_start: list = []
        self._starts: list | None = None

    def op_of(self, kernel):
        linked = getattr(kernel, "linked_correlation_id", 0)
        if linked:
            return self.by_id.get(linked)
        launch = self.launch_by_id.get(getattr(kernel, "id", 0) or 0)
        if launch is None:
            return None
        parent = getattr(launch, "cpu_parent", None)
        return parent if parent is not None else self._enclosing_op(launch)

    def _enclosing_op(self, launch):
        """The op whose time range holds a launch call the profiler left without a parent: the one that started
        last before it (the innermost, ops being nested). torch 2.11 gives the launch calls made in the autograd
        engine's AccumulateGrad (`aten::add_` of a leaf's gradient) another thread number than the op's, so its
        tree has no parent for them (one H100, session 37)."""
        if self._starts is None:
            self._ops_by_start = sorted(self.by_id.values(), key=lambda e: e.time_range.start)
            self._starts = [e.time_range.start for e in self._ops_by_start]
        t0, t1 = launch.time_range.start, launch.time_range.end
        at = bisect.bisect_right(self._starts, t0)
        for e in reversed(self._ops_by_start[max(0, at - _ENCLOSING_SEARCH) : at]):
            if e.time_range.end >= t1:
                return e
        return None

    def label(self, op) -> tuple[str, str, str]:
        """(op name, context, frame) of a launching op ("" where unknown)."""
        if id(op) not in self._labels:
            context, node = _label(op)
            frame = self.frames.get(op.id)
            if frame is None and node is not None:
                fwd = self.forward_frame.get((getattr(node, "sequence_nr", -1), getattr(node, "fwd_thread", None)))
                frame = f"bwd of {fwd}" if fwd else None
            self._labels[id(op)] = (op.name, context, frame or "")
        return self._labels[id(op)]


def _shapes(op) -> str:
    shapes = getattr(op, "input_shapes", None) or []
    return str(shapes)[:80] if any(shapes) else ""


def kernel_callers(events: Iterable, steps: int, n: int = 60, frames: dict[int, str] | None = None) -> list[dict]:
    """The n (group, op, context, frame, shapes) rows with the most kernel time per step, largest first; kernels
    whose launching op the profile does not name are one row per group with op `?`. `frames`: `python_frames` of
    the profile's Chrome trace (none: every frame is empty)."""
    events = list(events)
    launchers = _Launchers(events, frames)
    totals: dict[tuple, list] = defaultdict(lambda: [0.0, 0])
    for kernel, group in charged_kernel_events(events):
        op = launchers.op_of(kernel)
        key = (group, *launchers.label(op), _shapes(op)) if op is not None else (group, "?", "", "", "")
        entry = totals[key]
        entry[0] += (kernel.time_range.end - kernel.time_range.start) / 1e3
        entry[1] += 1
    rows = [
        {
            "group": g, "op": op, "context": ctx, "frame": frame, "shapes": shapes,
            "ms_per_step": ms / steps, "launches_per_step": calls / steps,
        }
        for (g, op, ctx, frame, shapes), (ms, calls) in totals.items()
    ]  # fmt: skip
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:n]


def gpu_idle(events: Iterable, steps: int, n: int = 15) -> dict:
    """GPU idle time per step inside the profiled span (first kernel start to last kernel end; every stream counts
    as busy), and the n longest gaps with the kernel that ends each and its launching op."""
    events = list(events)
    kernels = sorted((k for k, _ in charged_kernel_events(events)), key=lambda k: k.time_range.start)
    if not kernels:
        return {"span_ms_per_step": 0.0, "busy_ms_per_step": 0.0, "idle_ms_per_step": 0.0, "gaps": []}
    launchers = _Launchers(events)
    gaps, busy = [], 0.0
    start, end, before = kernels[0].time_range.start, kernels[0].time_range.end, kernels[0]
    for k in kernels[1:]:
        if k.time_range.start > end:
            gaps.append((k.time_range.start - end, before, k))
            busy += end - start
            start = k.time_range.start
        if k.time_range.end >= end:
            end, before = k.time_range.end, k
    busy += end - start
    span = end - kernels[0].time_range.start  # `end`: the latest kernel end
    top = []
    for gap_us, prev, nxt in sorted(gaps, key=lambda g: -g[0])[:n]:
        op = launchers.op_of(nxt)
        name, context, frame = launchers.label(op) if op is not None else ("?", "", "")
        top.append(
            {
                "gap_ms": gap_us / 1e3, "after_kernel": prev.name[:120], "next_kernel": nxt.name[:120],
                "next_op": name, "next_context": context, "next_frame": frame,
            }
        )  # fmt: skip
    return {
        "span_ms_per_step": span / 1e3 / steps,
        "busy_ms_per_step": busy / 1e3 / steps,
        "idle_ms_per_step": (span - busy) / 1e3 / steps,
        "gaps": top,
    }


def format_callers(rows: list[dict], min_ms: float = 0.5) -> str:
    """The rows over `min_ms` per step, one line each."""
    lines = [f"{'ms/step':>8} {'launch':>6}  {'group':<18} op  [context]  frame  shapes"]
    for r in (r for r in rows if r["ms_per_step"] >= min_ms):
        lines.append(
            f"{r['ms_per_step']:8.2f} {r['launches_per_step']:6.0f}  {r['group']:<18} {r['op']}  [{r['context']}]  "
            f"{r['frame']}  {r['shapes']}"
        )
    return "\n".join(lines)


def format_idle(idle: dict) -> str:
    """The idle summary and its longest gaps."""
    lines = [
        (
            f"GPU busy {idle['busy_ms_per_step']:.1f} of {idle['span_ms_per_step']:.1f} ms per step; idle "
            f"{idle['idle_ms_per_step']:.1f} ms; longest gaps (ms, the kernel that ends the gap and who launched it):"
        )
    ]
    for g in idle["gaps"]:
        lines.append(
            f"{g['gap_ms']:8.2f}  {g['next_kernel'][:60]}  <- {g['next_op']} [{g['next_context']}] {g['next_frame']}"
        )
    return "\n".join(lines)
