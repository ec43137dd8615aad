"""Which tokens of a sequence each context-parallel rank holds, and the batch split that follows from it.

The sequence of length S is cut into `num_chunks` equal chunks; rank c holds `chunks(c)`, concatenated in
that order along the sequence dim:

- "contiguous" (Ulysses): cp chunks, rank c holds chunk c.
- "zigzag" (ring attention): 2*cp chunks, rank c holds chunks c and 2*cp-1-c, so that under causal
  attention every rank has the same amount of work (docs/model-spec.md §10).

`cp_shard` slices every per-token tensor of the batch (input_ids, labels, position_ids, document_ids, MTP
inputs/targets: [B, S, ...]) identically; `cp_unshard` is its inverse (tests, gathering outputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class SequenceLayout:
    """How a sequence is split over `cp` ranks (kind in LAYOUTS)."""

    kind: str
    cp: int

    def __post_init__(self) -> None:
        if self.kind not in LAYOUTS:
            raise ValueError(f"unknown sequence layout {self.kind!r}; expected one of {LAYOUTS}")
        if self.cp < 1:
            raise ValueError(f"context-parallel degree must be >= 1, got {self.cp}")

    @property
    def num_chunks(self) -> int:
        return self.cp if self.kind == "contiguous" else 2 * self.cp

    def chunks(self, cp_rank: int) -> tuple[int, ...]:
        """Global chunk indices held by `cp_rank`, in their local order."""
        if not 0 <= cp_rank < self.cp:
            raise ValueError(f"cp rank {cp_rank} out of range for context-parallel degree {self.cp}")
        if self.kind == "contiguous":
            return (cp_rank,)
        return (cp_rank, 2 * self.cp - 1 - cp_rank)

    def owner(self, chunk: int) -> tuple[int, int]:
        """(cp rank, local slot) holding global chunk `chunk`."""
        if self.kind == "contiguous":
            return chunk, 0
        return (chunk, 0) if chunk < self.cp else (2 * self.cp - 1 - chunk, 1)

    def chunk_len(self, seq_len: int) -> int:
        if seq_len % self.num_chunks != 0:
            raise ValueError(
                f"sequence length {seq_len} is not divisible by the {self.num_chunks} chunks of the {self.kind} "
                f"layout at context-parallel degree {self.cp}"
            )
        return seq_len // self.num_chunks


def cp_shard(x_BS: torch.Tensor, layout: SequenceLayout, cp_rank: int, *, seq_dim: int = 1) -> torch.Tensor:
    """The part of a per-token tensor ([B, S, ...] by default) that `cp_rank` holds: [B, S / cp, ...]."""
    chunk = layout.chunk_len(x_BS.shape[seq_dim])
    parts = x_BS.split(chunk, dim=seq_dim)
    return torch.cat([parts[c] for c in layout.chunks(cp_rank)], dim=seq_dim)


def cp_unshard(shards: Sequence[torch.Tensor], layout: SequenceLayout, *, seq_dim: int = 1) -> torch.Tensor:
    """Inverse of cp_shard: the full tensor from the shards of ranks 0..cp-1 (in rank order)."""
    if len(shards) != layout.cp:
        raise ValueError(f"expected {layout.cp} shards (one per cp rank), got {len(shards)}")
    per_rank = len(layout.chunks(0))
    by_chunk: dict[int, torch.Tensor] = {}
    for rank, shard in enumerate(shards):
        for part, c in zip(shard.split(shard.shape[seq_dim] // per_rank, dim=seq_dim), layout.chunks(rank)):
            by_chunk[c] = part
    return torch.cat([by_chunk[c] for c in range(layout.num_chunks)], dim=seq_dim)
