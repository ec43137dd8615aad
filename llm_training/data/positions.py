"""Global positions of an epoch's sample order: which are trained already, and which ones each rank reads.

Epoch e of a data source orders its records (a seeded permutation, the file order, or the order a stream yields
them); position g = 0, 1, ... names the g-th record of that order. The epoch's *pool* is its positions not trained
before: all of them in an epoch started afresh; after a resume on another number of data-parallel ranks, those
the saving run had not trained yet. Rank r of W reads pool[r], pool[r + W], pool[r + 2W], ... (its *shard*).

`TrainedSet` holds trained positions compactly: every position below `prefix`, plus the sorted `beyond` ones (in
practice a few rows' worth around the ranks' frontier). The pool is then the `holes` between `prefix` and the last
trained position, followed by every position from `base` on, so `shard_positions` finds a rank's positions without
materialising the pool, and needs the number of records only to stop at the end: the same arithmetic serves data
sets of known size and streams whose length is known only once their end has been read.
"""

from __future__ import annotations

import numpy as np

_NONE = np.zeros(0, dtype=np.int64)


class TrainedSet:
    """Trained positions of one epoch: all of [0, prefix) plus `beyond` (sorted, unique, each > prefix)."""

    def __init__(self, prefix: int = 0, beyond: np.ndarray = _NONE):
        self.prefix = int(prefix)
        self.beyond = np.asarray(beyond, dtype=np.int64)
        self.base = int(self.beyond[-1]) + 1 if len(self.beyond) else self.prefix  # every position >= base is untrained
        self.holes = np.setdiff1d(np.arange(self.prefix, self.base, dtype=np.int64), self.beyond, assume_unique=True)

    @classmethod
    def of(cls, positions) -> TrainedSet:
        """The set of `positions` (any order, repeats allowed)."""
        return cls().union(positions)

    def to_json(self) -> dict:
        return {"prefix": self.prefix, "beyond": self.beyond.tolist()}

    @classmethod
    def from_json(cls, encoded: dict) -> TrainedSet:
        return cls(encoded["prefix"], np.asarray(encoded["beyond"], dtype=np.int64))

    def __len__(self) -> int:
        return self.prefix + len(self.beyond)

    def union(self, positions) -> TrainedSet:
        """This set plus `positions`."""
        positions = np.asarray(positions, dtype=np.int64)
        explicit = np.union1d(self.beyond, positions[positions >= self.prefix])
        run = np.flatnonzero(explicit != self.prefix + np.arange(len(explicit)))  # where the prefix stops growing
        grow = int(run[0]) if len(run) else len(explicit)
        return TrainedSet(self.prefix + grow, explicit[grow:])

    def without(self, positions) -> TrainedSet:
        """This set minus `positions`."""
        positions = np.unique(np.asarray(positions, dtype=np.int64))
        below = positions[positions < self.prefix]
        if not len(below):
            return TrainedSet(self.prefix, np.setdiff1d(self.beyond, positions, assume_unique=True))
        cut = int(below[0])  # the prefix now ends there; the rest of the old prefix becomes explicit
        kept = np.setdiff1d(np.arange(cut + 1, self.prefix, dtype=np.int64), below, assume_unique=True)
        return TrainedSet(cut, np.union1d(kept, np.setdiff1d(self.beyond, positions, assume_unique=True)))

    def pool_positions(self, pool_indices: np.ndarray) -> np.ndarray:
        """The untrained positions at `pool_indices` of the pool (ascending indices give ascending positions)."""
        idx = np.asarray(pool_indices, dtype=np.int64)
        n_holes = len(self.holes)
        if n_holes == 0:
            return self.base + idx
        return np.where(idx < n_holes, self.holes[np.minimum(idx, n_holes - 1)], self.base + idx - n_holes)

    def pool_size(self, num_records: int) -> int:
        """Untrained positions of an epoch of `num_records` records."""
        return int(np.searchsorted(self.holes, num_records)) + max(0, num_records - self.base)

    def with_pool_prefix(self, count: int) -> TrainedSet:
        """This set plus the first `count` positions of its pool."""
        if count >= len(self.holes):
            return TrainedSet(self.base + count - len(self.holes))
        return self.union(self.holes[:count])


def shard_positions(
    trained: TrainedSet, rank: int, world: int, start: int, stop: int, num_records: int | None
) -> np.ndarray:
    """Positions `start` to `stop` (exclusive) of rank `rank`'s shard (of `world`), cut at the end of an epoch of
    `num_records` records when that is known."""
    idx = rank + world * np.arange(start, stop, dtype=np.int64)
    if num_records is not None:
        idx = idx[idx < trained.pool_size(num_records)]
    return trained.pool_positions(idx)


def shard_size(trained: TrainedSet, rank: int, world: int, num_records: int) -> int:
    """Positions in rank `rank`'s shard of an epoch of `num_records` records."""
    return max(0, -(-(trained.pool_size(num_records) - rank) // world))


def merge_trained_positions(states: list[dict], num_records: int | None) -> tuple[int, dict[int, TrainedSet]]:
    """From the loader states of data-parallel ranks 0..W-1 of a saved run: (first epoch not fully trained, {epoch:
    trained positions} for that epoch and those after it some rank had started). A rank trained its shard of every
    epoch it has left and the first `position` records of its current one; documents in its open or ready rows
    were read but not trained. `num_records` is None for a stream: its length is then taken from a state whose
    rank has seen the end of an epoch (needed only for the epochs some rank has finished)."""
    world = len(states)
    before = {int(e): TrainedSet.from_json(t) for e, t in states[0]["trained_before"].items()}
    if num_records is None:
        num_records = next((s["stream_records"] for s in states if s.get("stream_records") is not None), None)
    pending: dict[int, list[int]] = {}
    for state in states:
        for row in state["open_rows"] + state["ready_rows"]:
            for epoch, position in row:
                pending.setdefault(epoch, []).append(position)
    first = min([s["epoch"] for s in states] + list(pending))
    last = max([s["epoch"] for s in states] + list(before))
    trained = {}
    for epoch in range(first, last + 1):
        old = before.get(epoch, TrainedSet())
        counts = []  # shard positions trained by each old rank
        for j, state in enumerate(states):
            if state["epoch"] > epoch:
                counts.append(shard_size(old, j, world, num_records))
            else:
                counts.append(state["position"] if state["epoch"] == epoch else 0)
        common = min(counts)  # pool indices below common x world are trained by every rank's count
        extra = [j + world * np.arange(common, count, dtype=np.int64) for j, count in enumerate(counts)]
        done = old.with_pool_prefix(common * world).union(old.pool_positions(np.concatenate(extra)))
        trained[epoch] = done.without(pending.get(epoch, []))
    return first, trained


__all__ = ["TrainedSet", "merge_trained_positions", "shard_positions", "shard_size"]
