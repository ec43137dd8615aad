"""Regional torch.compile: `apply_compile(blocks)` compiles each repeated block in place (`Module.compile()`), so
parameter FQNs never change, and `compile_stats()` reports what dynamo compiled.

Graph reuse: dynamo caches compiled code on the code object it compiled (here `TransformerBlock.forward` /
`MTPModule.forward`, shared by every instance), guarded on what the trace depended on: tensor shapes, dtypes
and requires_grad, and the blocks' Python attributes that steer the trace (dense vs MoE, the attention window
where the kernel takes it as an int, ...). Identical blocks therefore share ONE compiled graph; each distinct
kind of block (for motif3_proxy with sdpa / flex attention: the full-attention dense layer 0, the sliding dense
layer 1, the sliding MoE layers 2-3, and the MTP block) is one more entry, reported as a recompile of the same
code with the guard that failed (`TORCH_LOGS=recompiles` prints them as they happen). flash-attn-4 reads the
window from a tensor when it runs (`layers.attention.masks.window_tensor`), so with it full and sliding
attention are one kind: one attention graph instead of two. `recompile_limit` is raised to cover every kind of
block of a flavor, so a deep model never falls back to eager silently.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

# Distinct block kinds a flavor can have: {full, sliding} x {dense, MoE} trunk blocks + the MTP block, with
# head room for the first block's input (embedding output) differing from the later ones.
_RECOMPILE_LIMIT = 16


def apply_compile(
    blocks: list[nn.Module], backend: str = "inductor", sublayers: bool = False, kernel_tuning: str = "benchmark"
) -> None:
    """torch.compile every block's call in place with `backend` (tests use "aot_eager"): applied AFTER activation
    checkpointing, so dynamo traces the checkpoint as one higher-order op and the partitioner plans the recompute
    inside the block's graph. A block must then trace without a graph break: a break inside a checkpoint makes dynamo
    run that block's whole forward eagerly (blocks that cannot: `compile_in_pieces`).

    `sublayers` ([compile] granularity = "sublayer", or "auto" without activation checkpointing): a block with
    `compile_regions()` (Motif-3's TransformerBlock: its attention half, and its feed-forward half or, with mHC, that
    half's mHC-in, MLP / MoE and mHC-out steps) gets each of those methods compiled apart instead. Each is then one
    graph per kind of ITS region, so a trunk of {full, sliding} x {dense, MoE} blocks compiles 2 + 2 halves instead
    of 4 blocks, and the mHC steps once for dense and MoE blocks alike; inductor no longer fuses across regions. H200,
    motif3_proxy_nomtp, 64K tokens per step (bench_vs_torchtitan, 2026-12-05), halves against whole blocks: first
    step 82.7 -> 70.0 s, reserved 117.0 -> 111.2 GiB, step 1646.4 -> 1653.8 ms (0.996x). Other blocks (MTP) compile
    whole. `kernel_tuning`: [compile] kernel_tuning (`inductor_options`; the default here is inductor's own, the
    trainer passes the config's, heuristic by default)."""
    _raise_recompile_limit()
    options = inductor_options(backend, kernel_tuning)
    for block in blocks:
        if sublayers and hasattr(block, "compile_regions"):
            for name in block.compile_regions():
                setattr(block, name, torch.compile(getattr(block, name), backend=backend, **options))
        else:
            block.compile(backend=backend, **options)


def compile_in_pieces(
    blocks: list[nn.Module],
    kind: Callable[[nn.Module], str],
    backend: str = "inductor",
    kernel_tuning: str = "benchmark",
) -> None:
    """torch.compile each block's own forward in place with `backend`, BEFORE activation checkpointing wraps it: for
    blocks holding a part dynamo cannot trace, which breaks their graph. With expert parallelism that is the experts,
    their own FSDP2 group (FSDP2's hooks are dynamo-disabled) fed by the all-to-all dispatcher (a host copy of the
    split sizes); with ring / halo context parallelism the attention (`torch.compiler.disable`). The checkpoint then
    stays outside dynamo, so dynamo splits the forward at each break and compiles the pieces between (attention, mHC,
    router, shared expert, ...), where `apply_compile`'s order would run these blocks wholly eagerly. What runs
    between the pieces runs eagerly: the expert-parallel experts whole (dispatch, expert GEMMs, combine:
    `expert_parallel`, whose row counts change every step), the ring / halo attention, the routed experts' token
    chunks of "long_context" recompute (`MoE._routed_in_chunks`, each its own checkpoint). The cost: the recompute
    is the compiled forward run again, and "selective" checkpointing cannot see into compiled pieces
    (parallelize_motif keeps it on `apply_compile`'s order).

    A checkpoint's recompute must run the very graphs its forward ran, or the tensors it saves differ
    (CheckpointError). Two rules make it so:
      * static shapes only (`dynamic=False`): automatic dynamic shapes would compile a dynamic graph on a frame's
        second shape and hand later calls, a recompute among them, to it, while the forward had run the static one;
      * one copy of the forward's code per `kind(block)` (blocks of one kind share it): dynamo caches compiled code
        per code object, and the graph before a block's first break guards only on what it traced, so that entry of
        a MoE block (the attention half, cut at the experts) also matches a dense block of the same attention kind;
        dynamo's most-recently-used ordering of the entries could then run a dense block's recompute through it.

    (torchtitan 0.2.2 meets the experts' hooks by compiling a MoE block's submodules one by one, the experts and
    dispatch left out; splitting at the breaks keeps our mHC and routing arithmetic, which live in the block's and
    the MoE's own forward, compiled too.) `kernel_tuning`: as in `apply_compile`."""
    _raise_recompile_limit()
    options = inductor_options(backend, kernel_tuning)
    forwards: dict[str, types.FunctionType] = {}
    for block in blocks:
        if "forward" in vars(block):
            raise ValueError(f"compile_in_pieces: {type(block).__name__}.forward is already wrapped; compile first")
        key = kind(block)
        if key not in forwards:
            forwards[key] = _function_with_own_code(type(block).forward, key)
        own = types.MethodType(forwards[key], block)
        block.forward = torch.compile(own, backend=backend, dynamic=False, **options)


KERNEL_TUNINGS = ("benchmark", "heuristic")


def inductor_options(backend: str, kernel_tuning: str) -> dict:
    """torch.compile keyword arguments for [compile] kernel_tuning (inductor only; other backends get none).

    "benchmark" (inductor's defaults): each generated Triton kernel is built in every launch configuration its
    heuristics list (two for a 1-D pointwise kernel, six for a 2-D tiled one, several for a reduction), and each
    is timed at the kernel's first launch, which picks the fastest. "heuristic": the one configuration the
    heuristics rank first (pointwise autotuning off; reduction configurations filtered to one as inductor's
    deterministic mode filters them, through `test_configs.force_filter_reduction_configs` where this torch has
    it): fewer builds and no timing in the first step, at the cost of whatever the timing would have won."""
    if kernel_tuning not in KERNEL_TUNINGS:
        raise ValueError(f"[compile] kernel_tuning = {kernel_tuning!r}: expected one of {', '.join(KERNEL_TUNINGS)}")
    if backend != "inductor" or kernel_tuning == "benchmark":
        return {}
    import torch._inductor.config as inductor_config

    options = {"triton.autotune_pointwise": False}
    if hasattr(inductor_config.test_configs, "force_filter_reduction_configs"):
        options["test_configs.force_filter_reduction_configs"] = True
    return {"options": options}


def _function_with_own_code(fn: types.FunctionType, suffix: str) -> types.FunctionType:
    """A copy of `fn` whose code object is its own (named `<name>_<suffix>`), so dynamo caches its graphs apart."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{suffix}", co_qualname=f"{fn.__qualname__}_{suffix}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def _raise_recompile_limit() -> None:
    dynamo_config = torch._dynamo.config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, _RECOMPILE_LIMIT)


# The on-disk caches of compiled kernels that `use_kernel_caches` points into one folder: environment variable and
# the sub-folder it gets ("" = the folder itself).
KERNEL_CACHE_VARIABLES = (
    ("TORCHINDUCTOR_CACHE_DIR", ""),  # torch.compile: FX-graph and AOTAutograd caches, inductor's Triton kernels
    ("TRITON_CACHE_DIR", "triton"),  # our own Triton kernels (mHC, loss, max logits, PolyNorm, Sinkhorn)
    ("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "flash_attn_cute"),  # flash-attn-4's CuTe DSL kernels
)


# Persistent caches that are off by default, switched on beside the folders (an environment value, "0" say, wins):
CACHE_SWITCHES = (
    "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED",  # flash-attn-4's compiled CuTe DSL kernels
    # Triton's autotuning results, in TRITON_CACHE_DIR: torchao's FP8 kernels are @triton.autotune'd (its blockwise
    # quantization kernels over 45 configs per shape, minutes of a first fp8_blockwise step on the H200); Triton
    # reads the switch when a kernel is defined, i.e. when torchao's kernels are imported, after this runs
    "TRITON_CACHE_AUTOTUNING",
)


def use_kernel_caches(folder: Path | None) -> dict[str, str]:
    """Point the on-disk caches of compiled kernels (`KERNEL_CACHE_VARIABLES`) at `folder` and its sub-folders, and
    turn the persistent caches of `CACHE_SWITCHES` on (flash-attn-4's kernels, Triton's autotuning results), so that
    a run restarted in the same run folder loads its compiled blocks, kernels and tuned configs instead of compiling
    and tuning them again (the caches are keyed on the code, the library versions and the device: a changed model or
    config compiles anew; ranks may share the folder). A variable the environment sets already (non-empty) wins: a
    switch set to 0 keeps its cache off; `folder` None changes nothing (each library's default, under /tmp or ~,
    lost with the container). The libraries create the folders as they write. flash-attn-4 reads its variables once, when
    `flash_attn.cute` is first imported, so this runs before anything imports it (train.py: before validating the
    environment). Returns {variable: folder} of the caches set, by this call or the environment."""
    if folder is not None:
        root = folder.resolve()
        for name, sub in KERNEL_CACHE_VARIABLES:
            if not os.environ.get(name):  # unset or empty
                os.environ[name] = str(root / sub) if sub else str(root)
        for switch in CACHE_SWITCHES:
            if not os.environ.get(switch):
                os.environ[switch] = "1"
    return {name: os.environ[name] for name, _ in KERNEL_CACHE_VARIABLES if os.environ.get(name)}


def start_compile_workers() -> bool:
    """Start inductor's pool of compile worker processes now, at build time, rather than when the first graph reaches
    inductor (torch's default). Until the pool's workers have started (each imports torch and Triton: seconds),
    inductor builds every Triton kernel in this process, one after another, which is the first graphs' kernels of a
    first step. Only with Triton installed (without it inductor has no pool); torch's own switch TORCH_WARM_POOL=0
    turns it off here too. Returns whether the pool was asked to start."""
    from torch._inductor.async_compile import maybe_warm_pool
    from torch.utils._triton import has_triton_package

    if not has_triton_package():
        return False
    maybe_warm_pool()
    return True


def reset_compile_stats() -> None:
    """Forget everything dynamo compiled and counted (`torch._dynamo.reset()`): the start of a measurement."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch._dynamo.utils.clear_compilation_metrics()


# compile phases of `torch._dynamo.utils.compilation_time_metrics` worth reporting, as (label, metric name): the
# forward (dynamo trace + AOT + inductor, all inside `_compile.compile_inner`) and the backward (compiled lazily at
# the first backward), and the parts that dominate them. The parts nest, so they do not add up to the totals.
_COMPILE_PHASES = (
    ("total_forward_s", "_compile.compile_inner"),
    ("total_backward_s", "backward._backward_impl"),
    ("dynamo_trace_s", "bytecode_tracing"),
    ("aot_joint_trace_s", "aot_trace_joint_graph"),
    ("aot_partition_s", "min_cut_rematerialization_partition"),
    ("inductor_lowering_s", "GraphLowering.run"),
    ("inductor_scheduler_s", "Scheduler.__init__"),
    ("inductor_codegen_s", "Scheduler.codegen"),
    ("kernel_compile_wait_s", "async_compile.wait"),
)


def compile_time_breakdown() -> dict[str, float]:
    """Seconds spent so far in each of `_COMPILE_PHASES` (phases finished so far; a phase still running is not
    counted yet), summed over every compiled graph since the last `reset_compile_stats`."""
    from torch._dynamo.utils import compilation_time_metrics

    return {label: round(sum(compilation_time_metrics.get(name, ())), 2) for label, name in _COMPILE_PHASES}


def compile_by_frame() -> list[dict]:
    """Each frame compile since the last `reset_compile_stats` (dynamo's compilation metrics), slowest first: the
    function (`frame`: name, file:line, dynamo's compile id "frame/recompile"), its FX ops, the forward compile's
    seconds (`forward_s`) split into dynamo's own tracing (`dynamo_s`) and the backend's AOT autograd + inductor
    (`backend_s`), the backward graph's compile (`backward_s`, done at the first backward; 0 where AOT autograd's
    cache served both graphs), the Triton kernels those compiles built (`kernels`; `triton_s`, torch's Triton
    compile seconds, which on the CPU count a few ms with no kernel), and what torch records at the graphs' first
    runs rather than at their compiles (`first_run_s`, forward and backward: Triton autotuning). Which block kind
    the compile time goes to, where the phase totals (`compile_time_breakdown`) only sum over all of them."""
    from torch._dynamo.utils import get_compilation_metrics

    frames: dict[str, dict] = {}
    for m in get_compilation_metrics():
        if m.compile_id is None:
            continue
        entry = frames.setdefault(
            m.compile_id, {"frame": None, "ops": None, "forward_s": 0.0, "dynamo_s": 0.0, "backend_s": 0.0,
                           "backward_s": 0.0, "kernels": 0, "triton_s": 0.0, "first_run_s": 0.0},
        )  # fmt: skip
        seconds = (m.duration_us or 0) / 1e6
        entry["triton_s"] += (m.triton_compile_time_us or 0) / 1e6
        entry["kernels"] += len(json.loads(m.triton_kernel_compile_times_us or "[]"))  # [[name, us], ...]
        if m.is_runtime:  # a compiled graph's first run
            entry["first_run_s"] += seconds
        elif m.is_forward is False:  # the backward graph's compile, under its forward's compile id
            entry["backward_s"] += seconds
        else:  # the frame: dynamo's tracing and, inside it, the backend's compile of the forward graph
            where = f"{os.path.basename(m.co_filename or '?')}:{m.co_firstlineno}"
            entry["frame"] = f"{m.co_name} ({where}) {m.compile_id}"
            entry["ops"] = m.graph_op_count
            entry["forward_s"] += m.entire_frame_compile_time_s or 0.0
            entry["backend_s"] += m.backend_compile_time_s or 0.0
            entry["dynamo_s"] += (m.entire_frame_compile_time_s or 0.0) - (m.backend_compile_time_s or 0.0)
    # Microseconds kept: a backward served from inductor's cache compiles in milliseconds, not zero.
    rows = [{k: round(v, 6) if isinstance(v, float) else v for k, v in e.items()} for e in frames.values()]
    return sorted((r for r in rows if r["frame"] is not None), key=lambda r: -(r["forward_s"] + r["backward_s"]))


def format_compile_by_frame(frames: list[dict], limit: int = 4) -> str:
    """`compile_by_frame()`'s `limit` slowest frames on one line (the rest summed)."""
    parts = [
        f"{f['frame']} {f['forward_s']:.1f} + {f['backward_s']:.1f} s ({f['ops']} ops; dynamo {f['dynamo_s']:.1f}, "
        f"AOT + inductor {f['backend_s']:.1f}; {f['kernels']} Triton kernels {f['triton_s']:.1f} s; first runs "
        f"{f['first_run_s']:.1f} s)"
        for f in frames[:limit]
    ]
    rest = frames[limit:]
    if rest:
        parts.append(f"{len(rest)} more {sum(f['forward_s'] + f['backward_s'] for f in rest):.1f} s")
    return "; ".join(parts)


@contextlib.contextmanager
def compile_progress(log: Callable[[str], None], interval_s: float = 30.0) -> Iterator[None]:
    """While the body runs (a first, compiling step), every `interval_s` seconds `log` one line: seconds so far and
    the compile phases finished so far, so a long compile shows where it is instead of looking hung."""
    done = threading.Event()
    start = time.perf_counter()

    def report() -> None:
        while not done.wait(interval_s):
            phases = ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in compile_time_breakdown().items() if v)
            log(f"[compile] {time.perf_counter() - start:.0f} s into the first step; finished so far: {phases or '-'}")

    thread = threading.Thread(target=report, name="compile-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def compile_stats(max_reasons: int = 8) -> dict:
    """What dynamo compiled since the last `reset_compile_stats`: frames compiled, unique graphs (FX graphs handed
    to the backend; a graph break makes more than one per frame), graph breaks, recompiles (compiles of a frame
    that already had compiled code: a guard of every earlier entry failed), the first line of up to
    `max_reasons` distinct guard failures, as "function: compile id: guard", and of up to `max_reasons`
    graph-break reasons with their counts, most frequent first (`TORCH_LOGS=graph_breaks` prints where)."""
    from torch._dynamo import convert_frame, utils

    compiles_per_frame = getattr(convert_frame, "FRAME_COMPILE_COUNTER", {})
    reasons: list[str] = []
    for code, failures in utils.guard_failures.items():
        for failure in failures:
            line = f"{getattr(code, 'co_name', code)}: {failure.strip().splitlines()[0][:200]}"
            if line not in reasons:
                reasons.append(line)
    return {
        "compiled_frames": int(utils.counters["frames"]["ok"]),
        "unique_graphs": int(utils.counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(utils.counters["graph_break"].values())),
        "recompiles": int(sum(max(n - 1, 0) for n in compiles_per_frame.values())),
        "guard_failures": reasons[:max_reasons],
        "compile_time_s": compile_time_breakdown(),
        "compile_by_frame": compile_by_frame(),
        "graph_break_reasons": [
            f"{n}x {' '.join(reason.split())[:300]}"
            for reason, n in utils.counters["graph_break"].most_common(max_reasons)
        ],
    }


def compiled_since(seen: dict, now: dict) -> str | None:
    """What dynamo compiled between two `compile_stats()` snapshots, as the end of a log line (None: nothing): the
    frames and the guard failures that are new in `now`. After the first step a compiled step should compile
    nothing; each recompile costs that graph's compile again (seconds to minutes) and, past dynamo's recompile limit,
    runs the frame eagerly."""
    frames = now["compiled_frames"] - seen["compiled_frames"]
    if frames <= 0:
        return None
    new = [r for r in now["guard_failures"] if r not in seen["guard_failures"]]
    return (
        f"compiled {frames} more frame(s) ({now['recompiles']} recompiles in all); guard failures new since then: "
        f"{'; '.join(new) or 'none recorded'} (TORCH_LOGS=recompiles prints them as they happen)"
    )


def compile_report(stats: dict, blocks_in_pieces: int = 0) -> tuple[str, str | None]:
    """(one line of what dynamo compiled, a warning or None) from `compile_stats()`, for the log after a run's first
    step. The warning: no graph at all (compile is on, but the blocks ran eagerly) or any graph break (a break splits
    a block's graph, and one inside an activation-checkpointed block makes dynamo run that block's whole forward
    eagerly), with the reasons. `blocks_in_pieces` blocks were compiled in pieces (`compile_in_pieces`: the
    expert-parallel MoE blocks, ring / halo context parallelism, long_context recompute), their breaks by design:
    the line then names the breaks and their reasons, without a warning."""
    times = stats["compile_time_s"]
    line = (
        f"[compile] first step: {stats['unique_graphs']} graphs from {stats['compiled_frames']} frames "
        f"({stats['recompiles']} recompiles), {stats['graph_breaks']} graph breaks; forward compile "
        f"{times['total_forward_s']:.1f} s, backward {times['total_backward_s']:.1f} s"
    )
    if stats.get("compile_by_frame"):
        line += f"; by frame, forward + backward: {format_compile_by_frame(stats['compile_by_frame'])}"
    reasons = "; ".join(stats["graph_break_reasons"]) or "none recorded"
    if stats["unique_graphs"] == 0:
        problem = "compiled no graph: the blocks ran eagerly"
    elif stats["graph_breaks"] and blocks_in_pieces:
        return f"{line}; {blocks_in_pieces} blocks compile in pieces around what dynamo cannot trace: {reasons}", None
    elif stats["graph_breaks"]:
        problem = f"broke a graph {stats['graph_breaks']} times (a break in a checkpointed block runs it eagerly)"
    else:
        return line, None
    return line, f"[compile] torch.compile {problem}; reasons: {reasons} (TORCH_LOGS=graph_breaks shows where)"
