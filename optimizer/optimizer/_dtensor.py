"""DTensor helpers shared by Muon and QK-clip: local views and the row range a rank holds.

Only `Replicate()` and `Shard(0)` placements are supported (what FSDP2 / HSDP produce); anything else
raises with the tensor's placements in the message. Exception, on request (`allow_strided`): the
`_StridedShard(0)` that FSDP2 puts on dim 0 of expert stacks already sharded over expert-parallel ranks;
each rank still holds whole experts, but not one contiguous row range.
"""

from __future__ import annotations

import torch

try:  # torch >= 2.5 public path
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - older layouts are below our floor (torch >= 2.11)
    DTensor = None  # type: ignore[assignment]
    Replicate = Shard = _StridedShard = None  # type: ignore[assignment]


def is_dtensor(t: torch.Tensor) -> bool:
    """True when `t` is a DTensor (the check works when torch.distributed is unavailable)."""
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: `t` itself for plain tensors, the local shard of a DTensor.
    In-place updates on the returned tensor update the DTensor."""
    return t._local_tensor if is_dtensor(t) else t  # noqa: SLF001 - to_local() may wrap in autograd


def shard0_mesh_dims(t: torch.Tensor, what: str = "tensor", allow_strided: bool = False) -> list[int]:
    """Mesh dims over which DTensor `t` is sharded along tensor dim 0 (empty: replicated/plain).
    `allow_strided`: also count `_StridedShard(0)` (FSDP2 over expert-parallel expert stacks)."""
    if not is_dtensor(t):
        return []
    split_types = (Shard, _StridedShard) if allow_strided else (Shard,)
    dims = []
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, split_types) and placement.dim == 0:
            dims.append(mesh_dim)
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"{what}: unsupported DTensor placement {placement} in {tuple(t.placements)}; "
                "only Replicate() and Shard(0) (FSDP2 / HSDP) are supported"
            )
    return dims


def chunk_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) that `rank` gets when `n` rows are split with torch.chunk semantics
    (ceil-sized chunks, trailing ranks possibly short or empty) — DTensor's Shard layout."""
    size = -(-n // world) if n else 0
    start = min(rank * size, n)
    return start, min(start + size, n)


def local_row_range(t: torch.Tensor) -> tuple[int, int]:
    """Global rows [start, stop) of dim 0 that this rank stores (whole range for plain tensors)."""
    n = t.shape[0]
    start, stop = 0, n
    for mesh_dim in shard0_mesh_dims(t):
        mesh = t.device_mesh
        coord = mesh.get_local_rank(mesh_dim)
        s, e = chunk_range(stop - start, mesh.size(mesh_dim), coord)
        start, stop = start + s, start + e
    return start, stop
