"""Build flash-attn-4's kernels in side processes while the first step compiles.

flash-attn-4 compiles each CuTe DSL kernel it runs (per attention kind: the forward, the backward and the backward's
pre- and post-passes) the first time it is called: six builds and 13-15 s of motif3_proxy's first compiled step on
the H200 (bench_vs_torchtitan's first-step split, session 17), spent in the training process after torch.compile
has built the graph that calls attention, i.e. on top of the graph compile. Its persistent cache
(FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED / _DIR, which `[compile] cache_folder` switches on) is shared by processes:
a reader checks memory, then the disk, under a file lock; a writer exports under an exclusive lock with an atomic
rename.

So, when the step is compiled, the trainer's local rank 0 starts `python -m
llm_training.layers.attention.fa4_prebuild PLAN` as soon as the model is built on the meta device
(`build_components`' `on_model_built`), before it is parallelized, materialised and given its optimizer state: those
seconds count towards the side processes' head start (one H100, session 22: started after them, the side process
lost the race for the forward kernel of one of two harness cases, 2.5 s of CuTe build in the training process). One
process per group of kinds with the same kernels (`side_process_plans`: full causal and sliding layers are two), so
the forwards the first step needs build side by side. Each runs its kinds of attention once, forward and backward,
through the same `fa4_attention` the layers call, and exits; the kernels land in the cache while the training
process traces and compiles its graphs, and its first attention call loads them (no build) instead of compiling. A
kernel no side process has finished when training needs it is built by the training process too (the first export
wins, the second is skipped), unless a side process is building that very kernel at that moment: `fa4`'s ops tell a
watcher (`fa4.watch_kernel_calls`) of every flash-attn-4 call's start and end, with the call's compile key
(`fa4.kernel_key`); the side processes' watchers announce them on their output, and the training process's
(`Fa4Prebuild`, while side processes run) waits for a kernel a side process has started
(`Fa4Prebuild.wait_for_kernel`), since the rest of a build already under way takes less than a build of its own.
(Before the wait, on the H200 of session 27, the training process lost that race for one or two forward kernels in
three of four harness runs and built them itself: 3.1-8.2 s of the first step.) A kernel no side process has
started, or one it failed, the training process builds at once; a failure only costs the time it would have saved
(a warning says why). Only the process that started the side processes (local rank 0) hears them; the node's other
ranks load what the cache holds when they get there and build the rest.

The prebuild runs small shapes: flash-attn-4 4.0.0b36's compile keys (`flash_attn/cute/interface.py`) hold the
dtype, head dims, query heads per KV head, causal / window, varlen, the GPU arch and the kernel's tile config, which
follow from the head dims, not the token count. The exceptions are covered: more than 256 documents in a varlen call
(FA4's `BIN_BATCH_SEARCH_THRESH`: a batch-lookup aid changes the key; built second, and only for micro-batches of at
least `MANY_DOCUMENTS_MIN_TOKENS`, where packed chats reach that count) and a sequence of one tile (the backward's
`single_q_block`; the prebuild's rows span several tiles, as training rows do). The training data always carries
document ids, so attention always runs FA4's varlen kernels (`backends.build_attention_metadata`), and so does the
prebuild.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace

import torch

from llm_training.layers.attention import fa4
from llm_training.layers.attention.fa4 import FA4_MANY_DOCUMENTS

logger = logging.getLogger(__name__)

# rows x tokens of the prebuild's batches: several 128-token tiles per document, a few MiB of activations
PREBUILD_ROWS = 2
PREBUILD_MAX_ROW_TOKENS = 2048
# micro-batches from this many tokens (B x S) may pack more than FA4_MANY_DOCUMENTS documents (an average of 256
# tokens or less, e.g. short chats in a 256K SFT row): their kernels are prebuilt too, after the common ones
MANY_DOCUMENTS_MIN_TOKENS = 65536
# The most a training process waits for a kernel the side process has started: a CuTe DSL build takes 3-15 s
KERNEL_WAIT_S = 120.0
# the side process's lines around each flash-attn-4 kernel call (followed by the call's `fa4.kernel_key`)
KERNEL_START, KERNEL_DONE = "kernel start: ", "kernel done: "


@dataclass(frozen=True)
class Fa4AttentionKind:
    """One kind of attention call of the model (heads, head dims, window). Its flash-attn-4 compile keys hold the head
    dims, the query heads per KV head and whether there is a window, not the window's width (measured on an H100:
    window 64 loaded window 128's kernels), so two windows of other widths share kernels and the second one builds
    nothing in the side process."""

    n_heads: int
    n_kv_heads: int
    d_qk: int
    d_v: int
    window: int | None  # None = full causal
    softmax_scale: float


@dataclass
class PrebuildPlan:
    """What a side process builds: every kind, forward then backward, over `row_tokens`-token rows; then, when
    `many_documents`, the same kinds over more than FA4_MANY_DOCUMENTS documents. (QK-clip's max-logit kernel, which
    runs beside flash-attn-4, is Triton's: the trainer hands it to the Triton prebuild,
    `masks.prebuild_max_logits_kernels`.)"""

    device: str
    dtype: str
    row_tokens: int
    kinds: list[Fa4AttentionKind]
    many_documents: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PrebuildPlan:
        raw = json.loads(text)
        raw["kinds"] = [Fa4AttentionKind(**k) for k in raw["kinds"]]
        return cls(**raw)


def side_process_plans(plan: PrebuildPlan) -> list[PrebuildPlan]:
    """`plan` split into one plan per side process, in model order: kinds whose compile keys agree (heads, head dims,
    whether there is a window, not its width: `Fa4AttentionKind`) stay in one process, which builds their kernels
    once; kinds that differ get processes of their own, which build side by side (a CuTe DSL build is one CPU
    thread): the first step calls the forward of every kind within seconds, where one process built one after
    another (H100, session 33: the training process waited 1.3-3.8 s for forwards, and in the MTP + Muon case built
    one itself, 5.8 s; session 34, two processes: no build in the training process, 0.9-4.0 s of wait for the first
    forward only)."""
    groups: dict[tuple, list[Fa4AttentionKind]] = {}
    for kind in plan.kinds:
        groups.setdefault((kind.n_heads, kind.n_kv_heads, kind.d_qk, kind.d_v, kind.window is None), []).append(kind)
    return [replace(plan, kinds=kinds) for kinds in groups.values()]


def fa4_attention_kinds(model: torch.nn.Module, device: torch.device) -> list[Fa4AttentionKind]:
    """The distinct kinds of attention `model`'s GDLA layers (trunk and MTP) run through flash-attn-4 on `device`:
    backend fa4, or auto where auto picks fa4 for the layer's head dims (`backends._auto_picks_fa4`), in model
    order."""
    from llm_training.layers.attention.backends import _auto_picks_fa4
    from llm_training.layers.attention.gdla import GDLAttention

    kinds: dict[tuple, Fa4AttentionKind] = {}
    for module in model.modules():
        if not isinstance(module, GDLAttention):
            continue
        d_qk = module.d_nope + module.d_rope
        backend = module.attention_backend
        if backend != "fa4" and not (backend == "auto" and _auto_picks_fa4(device, (d_qk, module.d_v))):
            continue
        kind = Fa4AttentionKind(
            module.n_heads, module.n_kv_heads, d_qk, module.d_v, module.window, float(module.softmax_scale)
        )
        kinds.setdefault((kind.n_heads, kind.n_kv_heads, kind.d_qk, kind.d_v, kind.window), kind)
    return list(kinds.values())


def prebuild_skip_reason(job_config, parallel_dims, device: torch.device) -> str | None:
    """Why this rank starts no prebuild (None: it starts one): the step is not compiled (the first attention call
    then comes at once, with nothing to overlap), not on CUDA, a half dtype not trained, flash-attn-4's persistent
    cache off (the side process's kernels would not reach the training process), context parallelism (its attention
    wrappers call other kernel variants), or not the node's first rank (one side process per node: ranks share
    the cache folder)."""
    if not job_config.compile.enable:
        return "the step is not compiled ([compile] enable = false)"
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    if job_config.training.mixed_precision_param not in ("bfloat16", "float16"):
        return f"[training] mixed_precision_param = {job_config.training.mixed_precision_param!r} (flash-attn-4 runs bf16 / fp16)"
    if os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") != "1":
        return "flash-attn-4's persistent kernel cache is off (set [compile] cache_folder)"
    if parallel_dims.cp_enabled:
        return "context parallelism wraps attention in other kernel calls"
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return "local rank 0 builds them for the node"
    return None


def _announce(event: str, key: str) -> None:
    """The side process's kernel-call watcher (`fa4.watch_kernel_calls`): one line per call's start and end."""
    print((KERNEL_START if event == "start" else KERNEL_DONE) + key, flush=True)


class Fa4Prebuild:
    """The running side processes, one per group of kinds that share kernels (`side_process_plans`): their output is
    logged line by line (`[fa4 prebuild] ...`) from a reader thread each, which also follows the kernels they announce
    (building / built). Until they have all ended, this process's flash-attn-4 calls are watched
    (`fa4.watch_kernel_calls`): one whose kernel a side process is building waits for it. `close()` (also at
    interpreter exit) stops those that still run."""

    def __init__(self, plan: PrebuildPlan):
        self.plan = plan
        self.processes = [
            subprocess.Popen(
                [sys.executable, "-m", __name__, part.to_json()],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=dict(os.environ),
            )
            for part in side_process_plans(plan)
        ]
        self.lines: list[str] = []  # their output, less the kernel announcements
        self.kernels: dict[str, str] = {}  # compile key -> "building" | "built", as the side processes announce them
        self.waited: dict[str, float] = {}  # compile key -> seconds the training process waited for it
        # compile keys the training process called before a side process had built them (from a cold cache it then
        # builds them itself), in the order of their first call
        self.unbuilt_at_first_call: dict[str, None] = {}
        self._builder: dict[str, int] = {}  # compile key -> the index of the side process that announced it
        self._ended: set[int] = set()  # indices of the side processes that have exited
        self._changed = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read, args=(i,), name=f"fa4-prebuild-log-{i}", daemon=True)
            for i in range(len(self.processes))
        ]
        for reader in self._readers:
            reader.start()
        fa4.watch_kernel_calls(self._on_kernel_call)
        atexit.register(self.close)

    def _on_kernel_call(self, event: str, key: str) -> None:
        if event == "start" and not self.wait_for_kernel(key):
            with self._changed:
                self.unbuilt_at_first_call.setdefault(key, None)

    def _stop_watching(self) -> None:
        """Stop watching this process's kernel calls (nothing is being built any more), if this prebuild still does."""
        previous = fa4.watch_kernel_calls(None)
        if previous != self._on_kernel_call:  # another watcher's: put it back
            fa4.watch_kernel_calls(previous)

    def _read(self, index: int) -> None:
        process = self.processes[index]
        tag = "[fa4 prebuild]" if len(self.processes) == 1 else f"[fa4 prebuild {index + 1}/{len(self.processes)}]"
        own: list[str] = []  # this process's lines (`lines` interleaves every process's)
        for line in process.stdout:
            line = line.rstrip()
            for marker, state in ((KERNEL_START, "building"), (KERNEL_DONE, "built")):
                if line.startswith(marker):
                    key = line[len(marker) :]
                    with self._changed:
                        self.kernels[key] = state
                        self._builder[key] = index
                        self._changed.notify_all()
                    break
            else:
                own.append(line)
                with self._changed:
                    self.lines.append(line)
                logger.info("%s %s", tag, line)
        code = process.wait()
        with self._changed:
            self._ended.add(index)
            all_ended = len(self._ended) == len(self.processes)
            self._changed.notify_all()
        if all_ended:
            self._stop_watching()
        if code not in (0, -15):  # -15: close() stopped it
            tail = " | ".join(own[-3:])
            logger.warning(
                "%s the side process exited with %d (%s); training builds its flash-attn-4 kernels itself (3-15 s "
                "each in the first step)",
                tag,
                code,
                tail or "no output",
            )

    def wait_for_kernel(self, key: str, timeout: float = KERNEL_WAIT_S) -> bool:
        """If a side process is building the kernel of compile key `key` now, wait until it has (or that process has
        ended, or `timeout` seconds): whether the kernel is built. A kernel no side process has started, or one
        built, is not waited for (False / True at once). The wait is logged, and kept in `waited`."""
        with self._changed:
            if self.kernels.get(key) != "building":
                return self.kernels.get(key) == "built"
            start = time.perf_counter()
            builder = self._builder[key]
            self._changed.wait_for(lambda: self.kernels.get(key) != "building" or builder in self._ended, timeout)
            built = self.kernels.get(key) == "built"
        self.waited[key] = time.perf_counter() - start
        outcome = "it is built" if built else "it is not built; the training process builds it"
        logger.info("flash-attn-4: waited %.1f s for the side process's %s kernel: %s", self.waited[key], key, outcome)
        return built

    def summary(self) -> str:
        """One line: the kernels the side processes announced (built / still building) and how each process is (still
        running / its exit code), those the training process waited for, with the seconds it waited, and those it
        called before a side process had built them (from a cold cache it builds those itself): each either
        announced by a side process (a race: it started the kernel after that call, or did not finish it) or never
        (a call the plan does not cover: its compile key differs from every kind's)."""
        with self._changed:
            states = list(self.kernels.values())
            own = [(key, key in self.kernels) for key in self.unbuilt_at_first_call]
        running = ["still running" if p.poll() is None else f"exited {p.returncode}" for p in self.processes]
        processes = (
            f"side process {running[0]}"
            if len(running) == 1
            else f"{len(running)} side processes: {', '.join(running)}"
        )
        built = states.count("built")
        building = len(states) - built
        line = f"{len(states)} kernels announced ({built} built, {building} building; {processes})"
        if self.waited:
            waits = ", ".join(f"{s:.1f} s for {key}" for key, s in self.waited.items())
            line += f"; the training process waited {waits}"
        if own:
            why = {
                True: "announced by a side process, not yet built by it",
                False: "never announced: not in the plan",
            }
            line += "; called before a side process built it: " + ", ".join(f"{k} ({why[a]})" for k, a in own)
        return line

    def wait(self, timeout: float | None = None) -> list[int]:
        """The side processes' exit codes, after they end (or `subprocess.TimeoutExpired`), their output all
        logged."""
        codes = [process.wait(timeout) for process in self.processes]
        for reader in self._readers:
            reader.join(timeout)
        return codes

    def close(self) -> None:
        self._stop_watching()
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


def start_fa4_prebuild(model: torch.nn.Module, job_config, parallel_dims, device: torch.device) -> Fa4Prebuild | None:
    """Start the side process for `model` (module docstring) on this rank, or log why not and return None."""
    reason = prebuild_skip_reason(job_config, parallel_dims, device)
    kinds = fa4_attention_kinds(model, device) if reason is None else []
    if reason is None and not kinds:
        reason = "no attention layer runs flash-attn-4"
    if reason is not None:  # said where it could have mattered: a compiled step on CUDA
        level = logging.INFO if job_config.compile.enable and device.type == "cuda" else logging.DEBUG
        logger.log(level, "flash-attn-4 kernels not prebuilt: %s", reason)
        return None
    t = job_config.training
    plan = PrebuildPlan(
        device=str(device),
        dtype=t.mixed_precision_param,
        row_tokens=min(t.seq_len, PREBUILD_MAX_ROW_TOKENS),
        kinds=kinds,
        many_documents=t.local_batch_size * t.seq_len >= MANY_DOCUMENTS_MIN_TOKENS,
    )
    prebuild = Fa4Prebuild(plan)
    logger.info(
        "flash-attn-4: building the kernels of %d attention kind(s) in %d side process(es) while the step compiles",
        len(kinds),
        len(prebuild.processes),
    )
    return prebuild


def document_layout(documents: int, row_tokens: int) -> tuple[int, torch.Tensor]:
    """(rows, int ids [rows, row_tokens]) of `documents` packed documents of about equal length, at least two tokens
    each and at least PREBUILD_ROWS rows (a row boundary is a document boundary too), on the CPU."""
    per_row = max(1, row_tokens // 2)
    rows = max(PREBUILD_ROWS, -(-documents // per_row))
    per_row = -(-documents // rows)
    length = row_tokens // per_row  # the last document of a row takes the remainder
    ids_BS = (torch.arange(row_tokens) // length).clamp(max=per_row - 1) + per_row * torch.arange(rows)[:, None]
    return rows, ids_BS.contiguous()


def _run(plan: PrebuildPlan) -> None:
    """The side process: every kind's forward, then every backward, per document layout (module docstring), each
    kernel call announced (`_announce`)."""
    previous = fa4.watch_kernel_calls(_announce)
    try:
        _run_plan(plan)
    finally:
        fa4.watch_kernel_calls(previous)


def _run_plan(plan: PrebuildPlan) -> None:
    from llm_training.layers.attention.backends import build_attention_metadata

    device = torch.device(plan.device)
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.set_device(device)
    dtype = getattr(torch, plan.dtype)
    S = plan.row_tokens
    layouts = [("few documents", 2 * PREBUILD_ROWS)]
    if plan.many_documents:
        layouts.append((f"over {FA4_MANY_DOCUMENTS} documents", FA4_MANY_DOCUMENTS + 2 * PREBUILD_ROWS))
    gen = torch.Generator(device=device).manual_seed(0)
    start = time.perf_counter()
    for layout, n_docs in layouts:
        B, docs_BS = document_layout(n_docs, S)
        metadata = build_attention_metadata("fa4", docs_BS.to(device), [k.window for k in plan.kinds], B, S, device)
        pending = []
        for kind in plan.kinds:  # every forward first: the training step needs them first
            t0 = time.perf_counter()
            q = torch.randn(B, S, kind.n_heads, kind.d_qk, device=device, dtype=dtype, generator=gen)
            k = torch.randn(B, S, kind.n_kv_heads, kind.d_qk, device=device, dtype=dtype, generator=gen)
            v = torch.randn(B, S, kind.n_kv_heads, kind.d_v, device=device, dtype=dtype, generator=gen)
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            out, _ = fa4.fa4_attention(
                q, k, v, scale=kind.softmax_scale, window=kind.window, metadata=metadata, record_max_logits=False
            )
            if on_cuda:
                torch.cuda.synchronize(device)
            pending.append((kind, out))
            print(f"{layout}, {_describe(kind)}: forward {time.perf_counter() - t0:.1f} s", flush=True)
        for kind, out in pending:
            t0 = time.perf_counter()
            out.backward(torch.randn(out.shape, device=device, dtype=out.dtype, generator=gen))
            if on_cuda:
                torch.cuda.synchronize(device)
            print(f"{layout}, {_describe(kind)}: backward {time.perf_counter() - t0:.1f} s", flush=True)
        del pending
    elapsed = time.perf_counter() - start
    print(f"done: {len(plan.kinds)} kind(s) x {len(layouts)} document layout(s) in {elapsed:.1f} s", flush=True)


def _describe(kind: Fa4AttentionKind) -> str:
    attention = "full causal" if kind.window is None else f"window {kind.window}"
    return f"{attention}, {kind.n_heads}/{kind.n_kv_heads} heads, head dims {kind.d_qk}/{kind.d_v}"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m llm_training.layers.attention.fa4_prebuild PLAN_JSON", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    _run(PrebuildPlan.from_json(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
