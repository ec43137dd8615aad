"""Row <-> expert bookkeeping for the grouped (per-expert) ops, in plain torch on the rows' device.

`offs_E` follows `torch._grouped_mm`: int cumulative row ENDS, so expert e owns rows
[offs[e-1], offs[e]) (offs[-1] := 0 for e = 0) and rows >= offs[E-1] belong to no expert (index E).
"""

from __future__ import annotations

import torch


def expert_of_row(offs_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int32 [num_rows]: the expert owning each row, E for rows at/after offs[-1] (no host sync)."""
    rows = torch.arange(num_rows, device=offs_E.device, dtype=offs_E.dtype)
    return torch.searchsorted(offs_E, rows, right=True).to(torch.int32)


def segment_sum_rows(values_NK: torch.Tensor, expert_N: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E, K] in the dtype of `values_NK`: per expert, the sum of its rows (rows with index E ignored).

    `index_add_` with fp64 accumulation: O(rows) work on any device and traceable by torch.compile (a
    prefix sum over the rows was a sequential scan on CUDA: ~40 ms for 262144 rows, and it broke
    inductor). On CUDA the adds are atomics, so the fp64 sum's order varies, but its rounding error
    (~1e-16 relative) almost never changes the value rounded to fp32; with
    `torch.use_deterministic_algorithms(True)` torch switches to its deterministic sort-based path."""
    sums = values_NK.new_zeros((num_experts + 1, values_NK.shape[1]), dtype=torch.float64)
    sums.index_add_(0, expert_N, values_NK.double())
    return sums[:num_experts].to(values_NK.dtype)
