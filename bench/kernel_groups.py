"""Groups a torch.profiler trace of training steps into the cost classes that issue 11 tracks.

Every GPU kernel is put in exactly one group. Kernels that run inside an optimizer's step (the GPU-side
`Optimizer.step#<Class>.step` ranges that `torch.optim.Optimizer` annotates) are charged to that optimizer
whatever they are (Newton-Schulz GEMMs included); every other kernel is classified by its name:

    bf16 GEMM           tensor-core GEMMs (cuBLAS nvjet / sm90 xmma / cutlass, bf16 or fp16 inputs)
    grouped GEMM        `torch._grouped_mm` (the experts)
    fp32 GEMM (FFMA)    single-precision GEMMs without tensor cores (sgemm, f32f32 xmma)
    tf32 GEMM           GEMMs on tensor cores with tf32 inputs
    attention           cuDNN SDPA, flash-attention, FlexAttention (triton templates named flex/attention)
    copies/casts        direct copies, dtype casts, cat/transpose copies, memcpy/memset
    norms               RMSNorm / PolyNorm / layer-norm kernels, ours or compiled
    communication       NCCL kernels
    elementwise/fused   everything else (pointwise, reductions, compiled Triton fusions, index ops)

`group_kernels(events)` takes `prof.events()` (the profiler's FunctionEvent list) and returns
`[(group, total_ms, share)]` sorted by time; `format_groups` prints it as a table. `top_kernels(events, n)`
lists the n kernels (by name) that take the most time, with their group and launch count, so a group's cost
can be traced to the ops behind it (compiled Triton kernels are named after the ops they fuse).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

# Ordered: the first matching rule wins.
_RULES: list[tuple[str, re.Pattern]] = [
    ("communication", re.compile(r"nccl", re.IGNORECASE)),
    ("attention", re.compile(r"fmha|flash|sdpa|attention|flex|cudnn_generated|fprop|bprop", re.IGNORECASE)),
    ("grouped GEMM", re.compile(r"group(ed)?_?(mm|gemm)|GroupProblemShape|grouped", re.IGNORECASE)),
    ("tf32 GEMM", re.compile(r"tf32", re.IGNORECASE)),
    ("fp32 GEMM (FFMA)", re.compile(r"sgemm|gemm_f32f32|f32f32_f32|gemv2T_kernel_val<float|simt_sgemm", re.IGNORECASE)),
    ("bf16 GEMM", re.compile(r"nvjet|xmma_gemm|gemm|cutlass|wgmma", re.IGNORECASE)),
    ("norms", re.compile(r"rms|norm", re.IGNORECASE)),
    (
        "copies/casts",
        re.compile(
            r"direct_copy|copy_kernel|CatArrayBatchedCopy|Memcpy|Memset|^(?!triton_).*transpose|"
            r"^triton_\w+_fused__to_copy_\d+$|unrolled_elementwise_kernel<.*copy",
            re.IGNORECASE,
        ),
    ),
]
OPTIMIZER_RANGE = re.compile(r"^Optimizer\.step#(\w+)\.step$")


def classify_kernel(name: str) -> str:
    """The cost group of one GPU kernel, by its name (see the module docstring)."""
    for group, pattern in _RULES:
        if pattern.search(name):
            return group
    return "elementwise/fused"


def _is_gpu(evt) -> bool:
    return str(getattr(evt, "device_type", "")).endswith(("CUDA", "PrivateUse1"))


def charged_kernel_events(events: Iterable) -> list[tuple[object, str]]:
    """(kernel event, group) of every GPU kernel in `events`, optimizer-range kernels charged to the optimizer."""
    gpu = [e for e in events if _is_gpu(e)]
    # GPU-side annotation ranges of the optimizer steps (gpu_user_annotation events carry the range name)
    opt_ranges = []
    for e in gpu:
        m = OPTIMIZER_RANGE.match(e.name)
        if m:
            opt_ranges.append((e.time_range.start, e.time_range.end, f"optimizer: {m.group(1)}"))
    charged = []
    for e in gpu:
        if OPTIMIZER_RANGE.match(e.name) or getattr(e, "is_user_annotation", False):
            continue
        start, end = e.time_range.start, e.time_range.end
        group = next((g for s, t, g in opt_ranges if s <= start and end <= t), None) or classify_kernel(e.name)
        charged.append((e, group))
    return charged


def _charged_kernels(events: Iterable) -> list[tuple[str, str, float]]:
    """(group, kernel name, ms) of every GPU kernel in `events` (`charged_kernel_events`)."""
    return [(g, e.name, (e.time_range.end - e.time_range.start) / 1e3) for e, g in charged_kernel_events(events)]


def group_kernels(events: Iterable) -> list[tuple[str, float, float]]:
    """[(group, ms, share of all kernel time)] for the GPU kernels in `events`, largest first."""
    totals: dict[str, float] = defaultdict(float)
    for group, _, ms in _charged_kernels(events):
        totals[group] += ms
    total = sum(totals.values()) or 1.0
    return sorted(((g, ms, ms / total) for g, ms in totals.items()), key=lambda r: -r[1])


def top_kernels(events: Iterable, n: int = 40) -> list[tuple[str, str, float, int]]:
    """[(group, kernel name, total ms, launches)] of the n kernel names with the most GPU time, largest first."""
    totals: dict[tuple[str, str], list] = defaultdict(lambda: [0.0, 0])
    for group, name, ms in _charged_kernels(events):
        entry = totals[(group, name)]
        entry[0] += ms
        entry[1] += 1
    rows = sorted(((g, k, ms, calls) for (g, k), (ms, calls) in totals.items()), key=lambda r: -r[2])
    return rows[:n]


def format_groups(rows: list[tuple[str, float, float]], steps: int) -> str:
    """A table of per-step kernel time by group."""
    lines = [f"{'group':<22}{'ms/step':>10}{'share':>8}"]
    lines += [f"{g:<22}{ms / steps:>10.1f}{100 * share:>7.1f}%" for g, ms, share in rows]
    lines.append(f"{'total kernel time':<22}{sum(r[1] for r in rows) / steps:>10.1f}")
    return "\n".join(lines)
