"""Regional torch.compile: `apply_compile(blocks)` compiles each repeated block in place (`Module.compile()`), so
parameter FQNs never change, and `compile_stats()` reports what dynamo compiled.

Graph reuse: dynamo caches compiled code on the code object it compiled (here `TransformerBlock.forward` /
`MTPModule.forward`, shared by every instance), guarded on what the trace depended on: tensor shapes, dtypes
and requires_grad, and the blocks' Python attributes that steer the trace (attention window, dense vs MoE,
...). Identical blocks therefore share ONE compiled graph; each distinct kind of block (for motif3_proxy: the
full-attention dense layer 0, the sliding dense layer 1, the sliding MoE layers 2-3, and the MTP block) is one
more entry, reported as a recompile of the same code with the guard that failed (`TORCH_LOGS=recompiles`
prints them as they happen). `recompile_limit` is raised to cover every kind of block of a flavor, so a deep
model never falls back to eager silently.
"""

from __future__ import annotations

import torch
from torch import nn

# Distinct block kinds a flavor can have: {full, sliding} x {dense, MoE} trunk blocks + the MTP block, with
# head room for the first block's input (embedding output) differing from the later ones.
_RECOMPILE_LIMIT = 16


def apply_compile(blocks: list[nn.Module], backend: str = "inductor") -> None:
    """torch.compile every block's forward in place with `backend` (tests use "aot_eager")."""
    dynamo_config = torch._dynamo.config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, _RECOMPILE_LIMIT)
    for block in blocks:
        block.compile(backend=backend)


def reset_compile_stats() -> None:
    """Forget everything dynamo compiled and counted (`torch._dynamo.reset()`): the start of a measurement."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


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
        "graph_break_reasons": [
            f"{n}x {' '.join(reason.split())[:300]}"
            for reason, n in utils.counters["graph_break"].most_common(max_reasons)
        ],
    }
