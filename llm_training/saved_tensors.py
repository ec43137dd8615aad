"""Measure what autograd keeps for backward: the distinct storages a forward saves (the ground truth that the
activation-memory estimate of `motif/activation_memory.py` and the memory benches are checked against)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch


class SavedStorage(NamedTuple):
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]  # of the first tensor saved on this storage


def saved_storages(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> tuple[object, dict]:
    """(fn(), {storage pointer: SavedStorage}) for every distinct storage autograd saves for backward while
    `fn` runs, the storages of `exclude` (e.g. the parameters) left out. Views of one storage count once."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, SavedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            storages.setdefault(ptr, SavedStorage(t.untyped_storage().nbytes(), t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, storages


def saved_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> tuple[object, int]:
    """(fn(), total bytes of the storages `saved_storages` finds)."""
    out, storages = saved_storages(fn, exclude)
    return out, sum(s.nbytes for s in storages.values())
