"""The one DTensor helper model code uses: read this rank's part of a parameter that a parallelizer may
have turned into a DTensor (expert parallelism shards the expert stacks on dim 0). It lives outside both
`layers/` (model math, which imports nothing of `distributed/`) and `distributed/` (which applies parallelism
to the model), since both use it; it does no communication."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t.to_local()` for a DTensor (a differentiable view: its gradient comes back as a DTensor with the
    same placements), `t` itself otherwise. No communication."""
    return t.to_local() if isinstance(t, DTensor) else t
