"""Build Triton kernels in worker processes before their first launch, from the shapes torch.compile traces.

Triton builds a kernel in the process that launches it, the first time it is launched under a new specialization
(argument dtypes, 16-byte pointer alignment, integers equal to 1 or divisible by 16, constexprs, launch options):
0.2-0.5 s per build on the GPU machines, one after another, and a launcher (a C module per set of argument types,
about 0.2 s of gcc) at the first launch. Our kernels (RMSNorm / PolyNorm, mHC's Sinkhorn and stream backward, the
loss's CE chunk) are custom ops that torch.compile treats as opaque, so their builds came on top of the compile, in
the first step's main thread (5.9 s of the first step at bench_vs_torchtitan's proxy_16e on an H100).

While torch.compile traces a graph, it calls each custom op's fake implementation with fake tensors of exactly the
shapes, strides and dtypes of the real call, seconds before the compiled graph first runs.
`capture_launches(launch)` (called from those fake implementations) runs the op's real launching code on the fake
tensors with every Triton launch intercepted: no kernel runs; each new specialization, in Triton's own serialized
form, goes to a worker process that builds it (and its launcher) into Triton's on-disk cache, under the key this
process will look up (each build carries this process's Triton environment and ptxas version:
`_process_build_state`). When the graph later launches the kernel, Triton loads it from the cache instead of
building it; if a worker is still building it, the launch waits for that build (a hook on Triton's compile) rather
than starting a second one. The loss, which is not compiled, submits its kernel from meta tensors of its chunk shape
at start-up (same call).

Best effort, never a change in what runs: a launch whose specialization the fake tensors cannot predict (a pointer
that inductor's buffer planning places off 16 bytes: a fake tensor's storage offset is all that is known; a value
read from a tensor) builds in process as before, and so does everything when no prebuild is active (CPU, eager,
`[compile] prebuild_workers = 0`). Autotuned kernels are never captured (their tuning would time launches that do
not run). A worker's failure is logged once and the kernel builds in process.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor

import torch

logger = logging.getLogger(__name__)

# how long a launch waits for a worker still building its kernel before building it itself
WAIT_FOR_WORKER_S = 120.0

_ACTIVE: TritonPrebuild | None = None
_CAPTURING = threading.local()  # .prebuild: the TritonPrebuild capturing in this thread, if any


class TritonPrebuild:
    """The worker pool and the kernels submitted to it; `start_triton_prebuild` makes one the process's active
    prebuild (what `capture_launches` submits to), `close()` undoes that."""

    def __init__(self, workers: int, preload: tuple[str, ...] = ()):
        import triton
        from triton import knobs

        self._triton = triton
        self._knobs = knobs
        self.workers = workers
        # the workers build into this process's Triton cache; pinned where nothing chose it yet, since inductor
        # otherwise points TRITON_CACHE_DIR at its own folder when it first compiles, after the workers started
        os.environ.setdefault("TRITON_CACHE_DIR", knobs.cache.dir)
        self.pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_init,
            initargs=(knobs.cache.dir, tuple(preload)),
        )
        # the pool starts its processes at the first submit: now, so they start (and import Triton and `preload`,
        # the modules of the kernels to come) while the model is built, not when the first kernel is submitted
        self.started = [self.pool.submit(_ready, tuple(preload)) for _ in range(workers)]
        self.futures: dict[tuple[str, str, str], Future] = {}  # (module, kernel, Triton's cache key) -> its build
        self.skipped: list[str] = []  # launches that could not be captured, why (a line each)
        self.captured: dict[tuple[str, str], str] = {}  # (module, kernel) -> the last specialization submitted
        # launches of a submitted kernel under a specialization no capture predicted: what differed (a line each)
        self.unpredicted: list[str] = []
        self._lock = threading.Lock()
        self._warned = False
        self._previous_hook = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._compile_hook

    # ------------------------------------------------------------------------------------------- capture
    @contextlib.contextmanager
    def _capturing(self) -> Iterator[None]:
        from triton.runtime.jit import JITFunction

        original_run = JITFunction.run

        def run(kernel, *args, grid, warmup, **kwargs):
            if getattr(_CAPTURING, "prebuild", None) is not self:  # another thread's real launch
                return original_run(kernel, *args, grid=grid, warmup=warmup, **kwargs)
            args = tuple(_as_spec_arg(a) for a in args)
            kwargs = {k: _as_spec_arg(v) for k, v in kwargs.items()}
            original_run(kernel, *args, grid=grid, warmup=True, **kwargs)  # `_compile_hook` takes the build
            return None

        with self._lock:
            JITFunction.run = run
            _CAPTURING.prebuild = self
            try:
                yield
            finally:
                _CAPTURING.prebuild = None
                JITFunction.run = original_run

    def capture(self, launch: Callable[[], object], what: str) -> None:
        """Run `launch` (code that launches Triton kernels, on fake or meta tensors) with its launches submitted to
        the workers instead of run; a launch it cannot trace (data read from a tensor) is skipped and logged."""
        try:
            with self._capturing():
                launch()
        except Exception as e:  # noqa: BLE001 - best effort: that kernel builds in process at its launch
            self.skipped.append(f"{what}: {type(e).__name__}: {str(e)[:200]}")
            logger.debug("Triton prebuild: %s not captured (%s)", what, e)

    def _compile_hook(self, *, key, fn, compile, **kwargs) -> bool | None:
        """Triton's `jit_cache_hook`, called before every in-process build. Capturing: submit the build and skip it
        (True). Otherwise: wait for a worker still building the same kernel, then let Triton build, which loads
        the worker's result from the cache."""
        if getattr(_CAPTURING, "prebuild", None) is self:
            self._submit(fn, str(key), compile["specialization_data"])
            return True
        future = self.futures.get((fn.module, fn.name, str(key)))
        predicted = self.captured.get((fn.module, fn.name))
        if future is None and predicted is not None:
            self.unpredicted.append(f"{fn.name}: {_differences(predicted, compile['specialization_data'])}")
        if future is not None and not future.done():
            try:
                future.result(timeout=WAIT_FOR_WORKER_S)
            except Exception:  # noqa: BLE001, S110 - reported by the future's callback; Triton builds it here
                pass
        if self._previous_hook is not None:
            return self._previous_hook(key=key, fn=fn, compile=compile, **kwargs)
        return None

    def _submit(self, fn, key: str, specialization_data: str) -> None:
        ident = (fn.module, fn.name, key)
        if ident in self.futures:
            return
        if _resolve(fn.module, fn.name) is not fn.jit_function:  # e.g. a kernel defined inside a function
            self.skipped.append(f"{fn.module}.{fn.name}: not importable by name from its module")
            return
        target = self._triton.runtime.driver.active.get_current_target()
        keyed_by = _process_build_state(fn.jit_function, specialization_data, target)
        future = self.pool.submit(_build, fn.module, fn.name, specialization_data, target, keyed_by)
        future.add_done_callback(self._report_failure)
        self.futures[ident] = future
        self.captured[(fn.module, fn.name)] = specialization_data

    def _report_failure(self, future: Future) -> None:
        error = future.exception()
        if error is not None and not self._warned:
            self._warned = True
            logger.warning("Triton prebuild: a worker failed (%s); such kernels build in the training process", error)

    # ------------------------------------------------------------------------------------------ lifecycle
    def wait(self, timeout: float | None = None) -> list[tuple[str, float]]:
        """(kernel, build seconds in the worker, its launcher's included) of every submitted build, once all have
        ended."""
        return [(name, future.result(timeout=timeout)[0]) for (_module, name, _key), future in self.futures.items()]

    def summary(self) -> str:
        """One line: the builds handed to the workers (done / failed / still running) and what was not captured."""
        done = [f for f in self.futures.values() if f.done()]
        failed = sum(1 for f in done if f.exception() is not None)
        line = (
            f"{len(self.futures)} kernel builds handed to {self.workers} workers "
            f"({len(done) - failed} done, {failed} failed, {len(self.futures) - len(done)} still running)"
        )
        launchers = [f.result()[1] for f in done if f.exception() is None and f.result()[1] is not None]
        for label, items in (
            ("not captured", self.skipped),
            ("launched unpredicted", self.unpredicted),
            ("launchers not built by the workers", launchers),
        ):
            if items:
                line += f"; {label} (built in process): {'; '.join(items[:4])}"
                line += f" and {len(items) - 4} more" if len(items) > 4 else ""
        return line

    def close(self) -> None:
        """Stop submitting (the process's prebuild is none), restore Triton's hook, let the workers finish."""
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
        if self._knobs.runtime.jit_cache_hook == self._compile_hook:
            self._knobs.runtime.jit_cache_hook = self._previous_hook
        self.pool.shutdown(wait=False, cancel_futures=False)


def start_triton_prebuild(workers: int, preload: tuple[str, ...] = ()) -> TritonPrebuild | None:
    """Make a prebuild with `workers` processes, which import the modules `preload` as they start (those of the
    kernels to come), the process's active one (replacing any); None (and nothing active) when `workers` is 0 or
    Triton does not import."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.close()
    if workers <= 0:
        return None
    try:
        prebuild = TritonPrebuild(workers, preload)
    except ImportError:
        return None
    _ACTIVE = prebuild
    return prebuild


def active_prebuild() -> TritonPrebuild | None:
    return _ACTIVE


def capture_launches(launch: Callable[[], object], *tensors: torch.Tensor | None, what: str = "") -> None:
    """Submit the Triton launches of `launch()` to the active prebuild, if there is one and `tensors` (the op's
    inputs, fake or meta) are for a CUDA device; a no-op otherwise. Inputs with symbolic sizes (dynamic shapes) are
    not captured. Called from custom ops' fake implementations."""
    prebuild = _ACTIVE
    if prebuild is None or getattr(_CAPTURING, "prebuild", None) is not None:
        return
    present = [t for t in tensors if t is not None]
    if not present or not (present[0].device.type == "cuda" or present[0].is_meta):
        return
    if any(_symbolic(t) for t in present):  # dynamic shapes: running the launch code on symbols could add guards
        prebuild.skipped.append(f"{what or 'launch'}: symbolic shapes")
        return
    prebuild.capture(launch, what or getattr(launch, "__qualname__", "launch"))


# ----------------------------------------------------------------------------------------------- helpers
def _symbolic(t: torch.Tensor) -> bool:
    return any(isinstance(v, torch.SymInt) for v in (*t.shape, *t.stride(), t.storage_offset()))


def _as_spec_arg(arg):
    """A tensor argument as what Triton's specialization reads of it: its dtype and a data pointer whose 16-byte
    alignment is the tensor's storage offset's (fake and meta tensors have no data; their storage's base, like any
    allocation of the caching allocator or inductor, is taken as aligned)."""
    if not isinstance(arg, torch.Tensor):
        return arg
    from triton.runtime.jit import MockTensor

    class _SpecTensor(MockTensor):
        def __init__(self, dtype, offset_bytes):
            super().__init__(dtype, list(arg.shape))
            self._offset_bytes = offset_bytes

        def data_ptr(self):
            return self._offset_bytes

    return _SpecTensor(arg.dtype, arg.storage_offset() * arg.element_size())


def _resolve(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _differences(predicted: str, launched: str) -> str:
    """What a launch's serialized specialization has that the captured one of the same kernel has not (Triton's
    `serialize_specialization_data` fields: argument types, constexprs, alignment attributes, options)."""
    a, b = json.loads(predicted), json.loads(launched)
    parts = []
    for field in ("signature", "constant_vals", "attrs_keys", "attrs_vals", "options"):
        x, y = a.get(field), b.get(field)
        if isinstance(x, dict) and isinstance(y, dict):
            diff = {k: (x.get(k), y.get(k)) for k in dict.fromkeys([*x, *y]) if x.get(k) != y.get(k)}
            if diff:
                parts.append(f"{field} {diff}")
        elif x != y:
            parts.append(f"{field} {x} -> {y}")
    return ", ".join(parts) or "the same specialization under another key"


def _worker_init(cache_dir: str, preload: tuple[str, ...]) -> None:
    """A worker's start: the training process's Triton cache (wherever its caller pointed it), then Triton's compiler
    and the kernel modules imported ahead of the first build (a module that fails to import is left to `_build`,
    which reports the error). Shared libraries load with lazy binding: Triton loads each launcher it builds, and a
    worker, which never launches, then needs no CUDA driver's symbols to do so."""
    import sys

    sys.setdlopenflags(os.RTLD_LAZY | os.RTLD_LOCAL)
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    importlib.import_module("triton.compiler")
    for module in preload:
        with contextlib.suppress(Exception):
            importlib.import_module(module)


def _ready(preload: tuple[str, ...]) -> list[str]:
    """A no-op job that starts the pool's processes; returns which of `preload` the worker has imported."""
    import sys

    return [m for m in preload if m in sys.modules]


def _process_build_state(jit_function, specialization_data: str, target) -> dict:
    """What, besides the specialization, keys this process's build of it in Triton's cache, for a worker to build
    under the same key: the environment variables Triton hashes, and on NVIDIA the ptxas version it hashes (read
    once per process and cached, while torch's inductor points TRITON_PTXAS_PATH at torch's own ptxas at its first
    compile: a worker started after that reads another version) and the ptxas this process would run. Reading the
    version here also fixes it for this process's later launch. `cache_key`: the key this process looks up."""
    from triton._C.libtriton import get_cache_invalidating_env_vars

    state = {"env_vars": dict(get_cache_invalidating_env_vars()), "ptxas": None}
    if target.backend == "cuda":
        from triton.backends.nvidia.compiler import get_ptxas, get_ptxas_version

        variable = "TRITON_PTXAS_BLACKWELL_PATH" if target.arch >= 100 else "TRITON_PTXAS_PATH"
        state["ptxas"] = (variable, get_ptxas(target.arch).path, get_ptxas_version(target.arch))
    source, options = _source(jit_function, json.loads(specialization_data))
    state["cache_key"] = _cache_key(source, options, target, state["env_vars"])
    return state


def _source(jit_function, data: dict):
    """Triton's source and launch options of a serialized specialization (as `JITFunction.preload` reads it)."""
    import triton.language as tl
    from triton.compiler import ASTSource

    constexprs = {
        tuple(k): tl.dtype(v)
        if tl.dtype.is_dtype(v)
        else tl.constexpr(v["constexpr"])
        if isinstance(v, dict) and "constexpr" in v
        else v
        for k, v in zip(data["constant_keys"], data["constant_vals"])
    }
    attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"])}
    signature = {k: tuple(v) if isinstance(v, list) else v for k, v in data["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()}
    return ASTSource(jit_function, signature, constexprs, attrs), options


def _cache_key(source, options: dict, target, env_vars: dict) -> str:
    """The cache key `triton.compile` derives for `source` (its hash of source, backend, options, environment)."""
    import hashlib

    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_key

    backend = make_backend(target)
    parsed = backend.parse_options(dict(options, **source.parse_options()))
    return hashlib.sha256(get_cache_key(source, backend, parsed, env_vars).encode("utf-8")).hexdigest()


def _build(module: str, qualname: str, specialization_data: str, target, keyed_by: dict) -> tuple[float, str | None]:
    """In a worker: build one serialized specialization (Triton's `serialize_specialization_data`) of the kernel
    `module.qualname` for `target` into the on-disk cache, under the key the training process looks up (`keyed_by`:
    `_process_build_state`), and its launcher; returns the seconds it took and why the launcher was not built (None
    when it was). Mirrors `JITFunction.preload`, without the GPU driver the worker does not need. Raises, naming both
    keys, where this worker would key it otherwise."""
    import triton

    start = time.perf_counter()
    if keyed_by["ptxas"] is not None:  # the training process's ptxas, and the version its Triton hashes
        from triton import knobs
        from triton.backends.nvidia.compiler import get_ptxas_version

        variable, path, version = keyed_by["ptxas"]
        os.environ[variable] = path
        knobs.nvidia.mock_ptx_version = version
        get_ptxas_version.cache_clear()
    source, options = _source(_resolve(module, qualname), json.loads(specialization_data))
    key = _cache_key(source, options, target, keyed_by["env_vars"])
    if key != keyed_by["cache_key"]:
        raise RuntimeError(
            f"{qualname}: a worker keys this build {key[:16]}, the training process {keyed_by['cache_key'][:16]} "
            "(a Triton setting differs between them); it builds in the training process"
        )
    kernel = triton.compile(source, target=target, options=options, _env_vars=keyed_by["env_vars"])
    return time.perf_counter() - start, _build_launcher(kernel, target)


def _build_launcher(kernel, target) -> str | None:
    """Triton launches a kernel through a small C module made for its argument types, compiled (gcc, about 0.2 s) at
    the kernel's first launch in the launching process and kept in the on-disk cache under a hash of its source;
    built here, the launch loads it. None when built (or not for CUDA), else why not: the launch builds it then."""
    if target.backend != "cuda":
        return None
    try:
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(kernel.src, kernel.metadata)
    except Exception as e:  # noqa: BLE001 - best effort: the first launch builds it, as without a prebuild
        return f"{kernel.name}: {type(e).__name__}: {str(e)[:200]}"
    return None
