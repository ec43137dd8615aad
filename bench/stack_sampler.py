"""Where a stretch of wall time goes in the calling thread, by sampling its Python stack.

    with sample_stack(interval_s=0.01) as samples:
        first_step()
    samples.summary()  # {"wall_s", "samples", "by_phase_s": {"inductor": s, ...}, "other_frames", "callers"}

A daemon thread reads that thread's current frame (`sys._current_frames`) every `interval_s` and files the
sample under a phase: the innermost frame whose file belongs to a known library decides (`PHASES`, first match
walking outwards), so a sympy call made by inductor's lowering counts as inductor and a Triton build started by a
kernel launch counts as the build. A sample in none of them is "other" (our code, the autograd engine running
kernels, a CUDA synchronize waiting for the GPU). Each "other" sample also counts its innermost frame in our own
packages (`OWN_PACKAGES`), or its innermost frame when no frame of ours is on the stack: `other_frames` names the
lines that time was spent under, which the phase totals cannot say. A sample in a phase counts the frame that
called into the phase's library (`callers`): whose Triton builds the "triton_build" seconds were.

It samples the thread that opened it (the training loop's), except while that thread waits in the autograd engine
(`loss.backward()`): the backward's Python code (a compiled backward's lazy compile, custom autograd functions) runs
on the engine's device threads, C++ threads whose Python stack has no `threading.py` bootstrap frame at its bottom;
a sample then takes such a thread's stack where one is running Python. Work in other processes (inductor's compile
workers, flash-attn-4's prebuild) shows as a thread waiting for it. The sampling thread takes the GIL for a few
microseconds per sample: at 10 ms the overhead is well under 1%.

Sampling changes memory: reading a running function's frame makes Python keep a frame object for it, and such
frames end up in reference cycles with what they hold (tensors too) that only the cyclic garbage collector frees
(measured on the CPU with motif3_debug_nomtp's compiled first step: 3.9 MB of tensors, half again the live
tensors, outlived the step until `gc.collect()`; one H100 at proxy_16e, session 22: +10 GiB allocated in the
steps after a sampled first step). So the sampler collects garbage when it closes, and the memory peak of a
sampled stretch is not the program's own.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

# (phase, path fragments of its files), tried in this order for each frame, innermost frame first
PHASES = (
    ("triton_build", ("/triton/compiler/", "/triton/backends/")),
    ("cute_build", ("/cutlass/", "/flash_attn/cute/")),
    ("inductor", ("/torch/_inductor/",)),
    ("aot_autograd", ("/torch/_functorch/",)),
    ("dynamo", ("/torch/_dynamo/", "/torch/fx/", "/torch/_subclasses/", "/torch/_guards")),
    ("fsdp", ("/torch/distributed/fsdp/",)),
)
OWN_PACKAGES = ("/llm_training/", "/activations/", "/optimizer/", "/bench/")


def _phase_of_file(filename: str) -> str | None:
    path = filename.replace("\\", "/")
    return next((phase for phase, fragments in PHASES if any(f in path for f in fragments)), None)


def phase_of(filenames: list[str]) -> str:
    """The phase of a stack given innermost-first file names: the first frame that belongs to a phase decides."""
    return next((p for p in map(_phase_of_file, filenames) if p is not None), "other")


def _describe(frame) -> str:
    """`path:line function` of `frame`, the path from our package or the library's folder on."""
    path = frame.f_code.co_filename.replace("\\", "/")
    for marker in OWN_PACKAGES + ("/site-packages/", "/dist-packages/", "/lib/python"):
        cut = path.rfind(marker)
        if cut >= 0:
            path = path[cut + 1 :]
            break
    return f"{path}:{frame.f_lineno} {frame.f_code.co_name}"


@dataclass
class StackSamples:
    """Counts per phase and per frame, filled by the sampling thread while `sample_stack` is open."""

    interval_s: float
    wall_s: float = 0.0
    samples: int = 0
    by_phase: Counter = field(default_factory=Counter)
    other_frames: Counter = field(default_factory=Counter)
    callers: dict[str, Counter] = field(default_factory=dict)  # per phase: the frame that called into it

    def add(self, frame) -> None:
        """File one sample of the stack whose innermost frame is `frame`: its phase; for "other" its innermost
        frame of ours (or its innermost frame), for a phase the frame just outside the phase's library that called
        into it (e.g. our kernel's launcher, or inductor's loader, for a Triton build)."""
        frames, own = [], None
        while frame is not None:
            frames.append(frame)
            if own is None and any(p in frame.f_code.co_filename.replace("\\", "/") for p in OWN_PACKAGES):
                own = frame
            frame = frame.f_back
        phases = [_phase_of_file(f.f_code.co_filename) for f in frames]
        at = next((i for i, p in enumerate(phases) if p is not None), None)
        phase = "other" if at is None else phases[at]
        self.samples += 1
        self.by_phase[phase] += 1
        if at is None:
            self.other_frames[_describe(own if own is not None else frames[0])] += 1
            return
        while at + 1 < len(frames) and phases[at + 1] == phase:
            at += 1
        self.callers.setdefault(phase, Counter())[_describe(frames[min(at + 1, len(frames) - 1)])] += 1

    def summary(self, top: int = 15) -> dict:
        """Seconds per phase (samples scaled to the measured wall time, largest first), the `top` frames of the
        "other" samples, and per phase the `top` frames that called into it."""
        scale = self.wall_s / self.samples if self.samples else 0.0
        return {
            "wall_s": round(self.wall_s, 2),
            "samples": self.samples,
            "by_phase_s": {k: round(n * scale, 2) for k, n in self.by_phase.most_common()},
            "other_frames": [{"s": round(n * scale, 2), "where": w} for w, n in self.other_frames.most_common(top)],
            "callers": {
                phase: [{"s": round(n * scale, 2), "where": w} for w, n in counts.most_common(top)]
                for phase, counts in self.callers.items()
            },
        }


# the function of torch.autograd in which the calling thread waits for the autograd engine's threads
_AUTOGRAD_WAIT = "_engine_run_backward"


def _engine_thread(frame) -> bool:
    """Whether `frame` is the innermost frame of a thread started outside Python's `threading` (an autograd engine
    thread running Python): its outermost frame is not threading.py's bootstrap."""
    while frame.f_back is not None:
        frame = frame.f_back
    return not frame.f_code.co_filename.replace("\\", "/").endswith("/threading.py")


class sample_stack:
    """Sample the calling thread's stack every `interval_s` seconds while open (see the module docstring)."""

    def __init__(self, interval_s: float = 0.01):
        self.result = StackSamples(interval_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StackSamples:
        target, main = threading.get_ident(), threading.main_thread().ident
        self._start = time.perf_counter()

        def run() -> None:
            while not self._stop.wait(self.result.interval_s):
                frames = sys._current_frames()
                frame = frames.get(target)
                if frame is not None and frame.f_code.co_name == _AUTOGRAD_WAIT:
                    others = (f for t, f in frames.items() if t not in (target, main) and _engine_thread(f))
                    frame = next(others, frame)
                if frame is not None:
                    self.result.add(frame)

        self._thread = threading.Thread(target=run, name="stack-sampler", daemon=True)
        self._thread.start()
        return self.result

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.result.wall_s = time.perf_counter() - self._start
        gc.collect()  # the cycles that sampled frames formed (module docstring) do not outlive the stretch


def format_samples(summary: dict, top: int = 8, callers_of: tuple[str, ...] = ("triton_build",)) -> list[str]:
    """Seconds by phase; the `top` frames the "other" time was spent under; and for each phase of `callers_of`
    that was sampled, the `top` frames that called into it."""
    phases = " + ".join(f"{k} {v:.1f}" for k, v in summary["by_phase_s"].items())

    def listing(frames: list[dict]) -> str:
        return ", ".join(f"{f['s']:.1f} s {f['where']}" for f in frames[:top])

    lines = [f"sampled {summary['wall_s']:.1f} s = {phases}", f"other, under: {listing(summary['other_frames'])}"]
    for phase in callers_of:
        if summary.get("callers", {}).get(phase):
            lines.append(f"{phase}, called from: {listing(summary['callers'][phase])}")
    return lines
