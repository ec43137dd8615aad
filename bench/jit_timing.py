"""Where a first (compiling) step's time goes outside torch.compile's own phases: a context manager that times every
just-in-time kernel build and first-call autotuning that runs in this process while it is open.

    with jit_time_breakdown() as jit:
        first_step()
    jit.summary()  # {"triton_compile_s": ..., "triton_compile_calls": n, ..., "slowest": [the 12 slowest calls]}

What it times (wall seconds spent inside each call, summed; nested calls are counted once, at the outermost):
  triton_compile   `triton.compile` in this process: our own Triton kernels (mHC, loss, max logits, PolyNorm,
                   Sinkhorn, Muon's Gram) and torchao's on their first launch, and inductor's kernels where they are
                   loaded or built in-process (inductor builds most of them in its worker pool, inside the
                   "kernel_compile_wait" phase that `compile_time_breakdown` reports)
  cute_compile     `cutlass.cute.compile`: flash-attn-4's CuTe DSL kernels (forward, backward, their pre/post passes)
                   for each new shape / mask kind
  inductor_autotune
                   inductor's first-launch benchmarking of a kernel's candidate configs
                   (`CachingAutotuner.benchmark_all_configs`), which runs outside the compile phases
Each is patched only if its library imports (a label whose library is missing is left out of the summary); with
Triton >= 3.4 its compile listener also counts the builds (`triton_builds`) and the on-disk cache hits
(`triton_cache_hits`). The patches are undone on exit.

A Triton kernel compiled under more than one specialization (Triton specialises a launch on its arguments' dtypes,
on integers equal to 1 or divisible by 16, on pointers aligned to 16 bytes, on the constexprs and launch options) is
built once per specialization: `rebuilt` in the summary names each such kernel, how many specializations it had and
the arguments whose specialization differed, e.g. a weight pointer 16-byte aligned in one chunk and not in the next.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

# (label, module, owner attribute path inside the module or "" for the module itself, function name)
_TARGETS = (
    # the name `triton.compile` is bound under in each module that calls it (patching one binding does not reach
    # the others): the JIT launcher's module first
    ("triton_compile", "triton.runtime.jit", "", "compile"),
    ("triton_compile", "triton.compiler.compiler", "", "compile"),
    ("triton_compile", "triton.compiler", "", "compile"),
    ("triton_compile", "triton", "", "compile"),
    ("cute_compile", "cutlass.cute", "", "compile"),
    ("inductor_autotune", "torch._inductor.runtime.triton_heuristics", "CachingAutotuner", "benchmark_all_configs"),
)


@dataclass
class JitTimes:
    """Seconds and calls per label, filled while `jit_time_breakdown` is open."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    patched: list[str] = field(default_factory=list)
    each: list[tuple[float, str, str]] = field(default_factory=list)  # (seconds, label, kernel name) per call
    # Triton kernel name -> the distinct specializations it was compiled under (`_specialization`), in order
    specializations: dict[str, list[dict[str, str]]] = field(default_factory=dict)

    def add(self, label: str, seconds: float, name: str = "", specialization: dict[str, str] | None = None) -> None:
        self.seconds[label] = self.seconds.get(label, 0.0) + seconds
        self.calls[label] = self.calls.get(label, 0) + 1
        self.each.append((seconds, label, name))
        if specialization is not None:
            seen = self.specializations.setdefault(name, [])
            if specialization not in seen:
                seen.append(specialization)

    def rebuilt(self) -> list[dict]:
        """Each kernel compiled under more than one specialization: {"kernel", "specializations": n, "differs":
        {argument: [its specialization in each, in order]}}, most specializations first."""
        out = []
        for name, specs in self.specializations.items():
            if len(specs) < 2:
                continue
            keys = list(dict.fromkeys(k for spec in specs for k in spec))
            differs = {
                k: [spec.get(k, "-") for spec in specs] for k in keys if len({spec.get(k) for spec in specs}) > 1
            }
            out.append({"kernel": name, "specializations": len(specs), "differs": differs})
        return sorted(out, key=lambda r: -r["specializations"])

    def summary(self) -> dict:
        """{label_s: seconds, label_calls: n} for every label that was patched (0 when nothing ran)."""
        out: dict = {}
        for label in dict.fromkeys(label for label, *_ in _TARGETS):
            if label in self.patched:
                out[f"{label}_s"] = round(self.seconds.get(label, 0.0), 2)
                out[f"{label}_calls"] = self.calls.get(label, 0)
        for counted in ("triton_builds", "triton_cache_hits"):
            if counted in self.calls:
                out[counted] = self.calls[counted]
        out["slowest"] = [
            {"s": round(sec, 2), "what": label, "kernel": name[:160]}
            for sec, label, name in sorted(self.each)[::-1][:12]
        ]
        if self.specializations:
            out["rebuilt"] = self.rebuilt()
        return out


def _specialization(args: tuple, kwargs: dict) -> dict[str, str] | None:
    """What a `triton.compile(src, target, options)` call specialised its kernel on, per argument name ("*fp32 D16":
    a pointer 16-byte aligned; "constexpr =4096" a constexpr's value) plus the launch options that key a build
    ("options.num_warps"); None for a source that is not a Triton function's (`ASTSource`: fn, signature,
    constants, attrs)."""
    src = args[0] if args else kwargs.get("src")
    fn, signature = getattr(src, "fn", None), getattr(src, "signature", None)
    if fn is None or not isinstance(signature, dict):
        return None
    constants = getattr(src, "constants", None) or {}
    attrs = getattr(src, "attrs", None) or {}
    spec = {}
    for i, name in enumerate(getattr(fn, "arg_names", None) or list(signature)):
        parts = [str(signature.get(name, "?"))]
        if (i,) in constants:
            parts.append(f"={constants[(i,)]}")
        for attr, value in attrs.get((i,), ()):
            parts.append("D16" if (attr, value) == ("tt.divisibility", 16) else f"{attr}={value}")
        spec[name] = " ".join(parts)
    options = kwargs.get("options", args[2] if len(args) > 2 else None)
    if isinstance(options, dict):
        for key in ("num_warps", "num_stages", "num_ctas"):
            if key in options:
                spec[f"options.{key}"] = str(options[key])
    return spec


def _kernel_name(args: tuple) -> str:
    """A readable name of what a compile call builds: a Triton source's function name, an autotuner's kernel name,
    else the first argument's qualified name (a CuTe DSL kernel object or function)."""
    if not args:
        return ""
    first = args[0]
    for attr in ("fn", "fn_name", "kernel_name", "name"):
        value = getattr(first, attr, None)
        if isinstance(value, str):
            return value
        if value is not None and hasattr(value, "__name__"):
            return value.__name__
    target = getattr(first, "__func__", first)
    return getattr(target, "__qualname__", None) or type(first).__qualname__


def _timed(fn: Callable, label: str, times: JitTimes, depth: threading.local) -> Callable:
    def wrapper(*args, **kwargs):
        outer = not getattr(depth, label, 0)
        setattr(depth, label, getattr(depth, label, 0) + 1)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(depth, label, getattr(depth, label) - 1)
            if outer:
                spec = _specialization(args, kwargs) if label == "triton_compile" else None
                times.add(label, time.perf_counter() - start, _kernel_name(args), spec)

    wrapper.__wrapped__ = fn
    return wrapper


@contextlib.contextmanager
def jit_time_breakdown() -> Iterator[JitTimes]:
    """Time the JIT builds of `_TARGETS` while open (module docstring); yields the `JitTimes` being filled."""
    times, depth, undo = JitTimes(), threading.local(), []
    for label, module_name, owner_name, fn_name in _TARGETS:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001, S112 - an optional library that is absent or broken: nothing to time
            continue
        owner = getattr(module, owner_name) if owner_name else module
        fn = getattr(owner, fn_name, None)
        if fn is None or getattr(fn, "_jit_timing", False):
            continue
        wrapper = _timed(fn, label, times, depth)
        wrapper._jit_timing = True
        setattr(owner, fn_name, wrapper)
        undo.append((owner, fn_name, fn))
        if label not in times.patched:
            times.patched.append(label)
    knobs = _triton_compilation_knobs()
    previous_listener = knobs.listener if knobs is not None else None
    if knobs is not None:  # Triton says which compiles were built and which came from its cache

        def listener(*args, **kwargs):
            hit = kwargs.get("cache_hit", args[-1] if args else False)
            times.calls["triton_cache_hits" if hit else "triton_builds"] = (
                times.calls.get("triton_cache_hits" if hit else "triton_builds", 0) + 1
            )
            if previous_listener is not None:
                previous_listener(*args, **kwargs)

        knobs.listener = listener
    try:
        yield times
    finally:
        if knobs is not None:
            knobs.listener = previous_listener
        for owner, fn_name, fn in reversed(undo):
            setattr(owner, fn_name, fn)


def _triton_compilation_knobs():
    """`triton.knobs.compilation` where it has a compile `listener` (Triton >= 3.4), else None."""
    try:
        from triton import knobs
    except Exception:  # noqa: BLE001 - no Triton (CPU machine) or an older one
        return None
    compilation = getattr(knobs, "compilation", None)
    return compilation if compilation is not None and hasattr(compilation, "listener") else None
