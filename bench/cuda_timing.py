"""Shared timing helpers of the GPU benchmarks: CUDA events around each call, after warm-up; the slowest rank's
value under torchrun.

The bench scripts run as `python bench/<script>.py`, which puts this folder on sys.path.
"""

from __future__ import annotations

import torch


def cuda_time_ms(fn, warmup: int, repeats: int) -> list[float]:
    """Milliseconds of each of `repeats` calls of `fn` (after `warmup` untimed calls), timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def slowest_over_ranks(value: float, device: torch.device, group=None) -> float:
    """The largest `value` over the ranks of `group` (default: the world): what a multi-rank benchmark reports, since
    the step waits for its slowest rank. `value` itself without a process group."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())
