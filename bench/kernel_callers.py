"""Which code launches a profile's GPU kernels, and when the GPU waits for the host.

`kernel_groups.py` answers "which kind of kernel takes the time"; this module answers "which line launched it" and
"how long did the GPU sit idle", from the same `prof.events()` (a torch.profiler run with CPU and CUDA activity).

`kernel_callers(events, steps, n)` charges every GPU kernel to the CPU op that launched it (the profiler links a
kernel to that op by correlation id) and labels the op with:
- `context`: the nearest enclosing ranges that say what the op is part of: the backward node it runs in
  (`autograd::engine::evaluate_function: MulBackward0` -> `bwd MulBackward0`), FSDP2's ranges (`FSDP::...`), an
  optimizer's step (`Optimizer.step#Muon.step`), a compiled graph's call;
- `frame`: the innermost function of our own code (llm_training, the optimizer and activation packages) above the
  op, as `file:line name` with the line where the function starts, when the profile was taken `with_stack=True`
  (the Python calls are then the op's ancestors). An op inside a backward node has no frame of its own below the
  node; it gets the frame of the forward op that created the node (same sequence number), written `bwd of <frame>`.
Rows (group, op, context, frame, input shapes) with ms and launches per step, largest first: enough to tell which
of our lines launches, say, a 2 ms fp32 multiply per micro-batch.

`gpu_idle(events, steps, n)`: the time inside the profiled span during which no kernel, copy or memset runs on any
stream, per step, with the n longest gaps: how long, the kernel that ends each gap, and the op (with its context)
that launched that kernel, i.e. what the GPU was waiting for the host to issue.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

from kernel_groups import charged_kernel_events, classify_kernel

FRAME = re.compile(r"^(?P<path>.+?\.py)\((?P<line>\d+)\): (?P<func>.+)$")
# the packages whose frames name a caller (innermost first wins); the harness's own frames are never the answer
OUR_CODE = ("llm_training/", "optimizer/optimizer/", "activations/activation/")
BACKWARD_NODE = re.compile(r"^autograd::engine::evaluate_function: (\S+)")
CONTEXT_RANGE = re.compile(r"^(FSDP::|Optimizer\.step#|## Call CompiledFxGraph|CompiledFunction|Torch-Compiled Region)")
CONTEXT_DEPTH = 2  # ranges kept per op, innermost first
OPTIMIZER_CONTEXT = re.compile(r"Optimizer\.step#(\w+)\.step")


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


def _label(op) -> tuple[str, str | None, object | None]:
    """(context, own frame, enclosing backward-node event or None) of a CPU op: ranges and our innermost frame
    are read from its ancestors up to (and including) the backward node it runs in, if any."""
    context, frame, node = [], None, None
    for q in _ancestors(op):
        m = BACKWARD_NODE.match(q.name)
        if m:
            node = q
            if len(context) < CONTEXT_DEPTH:
                context.append(f"bwd {m[1]}")
            break  # above the node: the engine and whoever called backward(), not this op's caller
        if CONTEXT_RANGE.match(q.name) and len(context) < CONTEXT_DEPTH:
            context.append(q.name.strip("# ")[:60])
        if frame is None:
            frame = our_frame(q.name)
    for q in _ancestors(node) if node is not None else ():  # ranges around the backward (FSDP's, the optimizer's)
        if CONTEXT_RANGE.match(q.name) and len(context) < CONTEXT_DEPTH:
            context.append(q.name.strip("# ")[:60])
    return " < ".join(context), frame, node


class _Launchers:
    """The CPU op behind each kernel (by correlation id) and its label, with the forward frames by sequence
    number for ops inside backward nodes."""

    def __init__(self, events: list):
        cpu = [e for e in events if not str(getattr(e, "device_type", "")).endswith(("CUDA", "PrivateUse1"))]
        # the ops a kernel can name: frontend events (no link of their own; the CUDA runtime's launch events link to
        # an op and carry CUPTI's correlation ids, another numbering that must not shadow the ops' ids)
        self.by_id = {e.id: e for e in cpu if getattr(e, "id", 0) and not getattr(e, "linked_correlation_id", 0)}
        self.forward_frame: dict[tuple, str] = {}
        # Every op records the sequence number the next autograd node will take, and the node's creator is the
        # last op to start before the number moves on: in time order, later ops overwrite earlier ones.
        for e in sorted(cpu, key=lambda e: e.time_range.start):
            seq = getattr(e, "sequence_nr", -1)
            if seq is None or seq < 0 or e.name.startswith("autograd::"):
                continue
            _, frame, node = _label(e)
            if node is None and frame is not None:
                self.forward_frame[(seq, getattr(e, "thread", None))] = frame
        self._labels: dict[int, tuple[str, str, str]] = {}  # by the op event's identity

    def op_of(self, kernel):
        linked = getattr(kernel, "linked_correlation_id", 0)
        return self.by_id.get(linked) if linked else None

    def label(self, op) -> tuple[str, str, str]:
        """(op name, context, frame) of a launching op ("" where unknown)."""
        if id(op) not in self._labels:
            context, frame, node = _label(op)
            if frame is None and node is not None:
                fwd = self.forward_frame.get((getattr(node, "sequence_nr", -1), getattr(node, "fwd_thread", None)))
                frame = f"bwd of {fwd}" if fwd else None
            self._labels[id(op)] = (op.name, context, frame or "")
        return self._labels[id(op)]


def _shapes(op) -> str:
    shapes = getattr(op, "input_shapes", None) or []
    return str(shapes)[:80] if any(shapes) else ""


def kernel_callers(events: Iterable, steps: int, n: int = 60) -> list[dict]:
    """The n (group, op, context, frame, shapes) rows with the most kernel time per step, largest first; kernels
    whose launching op the profile does not link are one row per group with op `?`. Where no kernel event carries
    a link (a profiler without `linked_correlation_id`), each op's own `kernels` list is charged instead (its
    group from the kernel's name, or the optimizer whose step range encloses the op)."""
    events = list(events)
    launchers = _Launchers(events)
    totals: dict[tuple, list] = defaultdict(lambda: [0.0, 0])
    charged = charged_kernel_events(events)
    if any(getattr(k, "linked_correlation_id", 0) for k, _ in charged):
        for kernel, group in charged:
            op = launchers.op_of(kernel)
            key = (group, *launchers.label(op), _shapes(op)) if op is not None else (group, "?", "", "", "")
            entry = totals[key]
            entry[0] += (kernel.time_range.end - kernel.time_range.start) / 1e3
            entry[1] += 1
    else:  # a profiler whose kernel events carry no link: each op's own list of the kernels it launched
        for op in launchers.by_id.values():
            for k in getattr(op, "kernels", None) or ():
                label = launchers.label(op)
                in_optimizer = OPTIMIZER_CONTEXT.search(label[1])
                group = f"optimizer: {in_optimizer[1]}" if in_optimizer else classify_kernel(k.name)
                entry = totals[(group, *label, _shapes(op))]
                entry[0] += k.duration / 1e3
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
