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


def segment_sum_rows(values_NK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """[E, K] in the dtype of `values_NK`: per expert, the sum of its rows (rows >= offs[-1] ignored).

    Deterministic (no atomics): an fp64 prefix sum read at the segment boundaries; fp64 keeps the
    boundary differences accurate for hundreds of thousands of rows."""
    cumsum = values_NK.double().cumsum(dim=0)
    prefix = torch.cat([cumsum.new_zeros(1, values_NK.shape[1]), cumsum])  # prefix[i] = sum of rows < i
    ends_E = offs_E.long()
    starts_E = torch.cat([ends_E.new_zeros(1), ends_E[:-1]])
    return (prefix[ends_E] - prefix[starts_E]).to(values_NK.dtype)
