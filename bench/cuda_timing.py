"""Shared timing helper of the GPU benchmarks: CUDA events around each call, after warm-up.

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
