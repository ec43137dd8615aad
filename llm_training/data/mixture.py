"""A data mixture: packed rows drawn from several sources by weight, deterministic and exactly resumable.

Each source (a `[[training.sources]]` table) has its own `PackedDataLoader`, used row by row (`next_row`): its
record order, data-parallel shards, epochs, packing, bad-record accounting and resume on another layout are that
loader's. Row k of data-parallel rank r comes from the source picked by a uniform number drawn from (seed, r, k) --
a counter-based draw, so the state needs no generator -- against the weights of the sources still in the mixture.
A source with `epochs` > 0 leaves the mixture when its epochs are done (its last, partly filled rows are returned
first); the weights of the others then share its part. When every source has left, `MixtureSpent` is raised.

A batch is the single-source loader's batch plus `source_ids` (long [B]: the source index of each row), so the
trainer can count each source's tokens (`real_tokens` of its rows).

State: the number of rows drawn and every source loader's state. On the same data-parallel layout the mixture
continues exactly (the same batches as an uninterrupted run). On another one each source merges the saved ranks'
positions (every record of a source is trained once per epoch across the change) and each new rank r of M continues
its draws from the sum of the counters of the old ranks j with j mod M = r.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from llm_training.data.dataloader import PackedDataLoader, PrefetchingLoader, SourceSpent
from llm_training.data.packing import collate_rows

logger = logging.getLogger(__name__)

MIXTURE_STATE_VERSION = 1


class MixtureSpent(RuntimeError):
    """Every source of the mixture has done its `epochs`."""


def draw_uniform(seed: int, dp_rank: int, row: int) -> float:
    """The uniform number in [0, 1) that picks the source of row `row` of data-parallel rank `dp_rank`."""
    return float(np.random.default_rng([seed % (1 << 64), dp_rank, row]).random())


def pick_source(u: float, weights: list[float], live: list[int]) -> int:
    """The source among `live` (indices into `weights`) whose share of the cumulative weights holds `u`."""
    cumulative = np.cumsum([weights[i] for i in live])
    return live[min(int(np.searchsorted(cumulative, u * cumulative[-1], side="right")), len(live) - 1)]


class MixtureLoader(PrefetchingLoader):
    """Infinite iterable of packed batches whose rows come from `loaders` (one `PackedDataLoader` per source, each
    built with `prefetch_batches=0`), drawn by `weights` with `seed`; `names` name the sources in states and
    messages (module docstring)."""

    def __init__(
        self,
        loaders: list[PackedDataLoader],
        names: list[str],
        weights: list[float],
        *,
        seed: int,
        local_batch_size: int,
        prefetch_batches: int = 2,
    ):
        super().__init__(prefetch_batches)
        self.loaders, self.names, self.weights = loaders, names, weights
        self.seed, self.batch_size = seed, local_batch_size
        self.dp_rank, self.dp_world_size = loaders[0].dp_rank, loaders[0].dp_world_size
        self.seq_len, self.pad_id = loaders[0].seq_len, loaders[0].source.pad_id
        self.rows_drawn = 0

    def _next_row(self) -> tuple[int, list]:
        """(source index, row) of the next row."""
        u = draw_uniform(self.seed, self.dp_rank, self.rows_drawn)
        while True:
            live = [i for i, loader in enumerate(self.loaders) if not loader.exhausted]
            if not live:
                raise MixtureSpent(
                    f"data rank {self.dp_rank}: every data source has done its epochs ("
                    + ", ".join(f"{name}: {loader.max_epochs}" for name, loader in zip(self.names, self.loaders))
                    + f") after {self.rows_drawn} rows; raise [[training.sources]] epochs (0 repeats a source "
                    "without end) or lower [training] steps"
                )
            i = pick_source(u, self.weights, live)
            try:
                row = self.loaders[i].next_row()
            except SourceSpent:
                logger.info(
                    "data rank %d: source %s has done its epochs and leaves the mixture", self.dp_rank, self.names[i]
                )
                continue  # the same draw picks among the sources left
            self.rows_drawn += 1
            return i, row

    def _next_batch_now(self) -> dict[str, torch.Tensor]:
        picked = [self._next_row() for _ in range(self.batch_size)]
        batch = collate_rows([row for _, row in picked], self.seq_len, self.pad_id)
        batch["source_ids"] = torch.tensor([i for i, _ in picked], dtype=torch.long)
        return batch

    # ---- state --------------------------------------------------------------------------------------------
    def _fingerprint(self) -> dict:
        return {
            "sources": list(self.names),
            "weights": list(self.weights),
            "seed": self.seed,
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            "local_batch_size": self.batch_size,
        }

    def _state_now(self) -> dict:
        return {
            "version": MIXTURE_STATE_VERSION,
            "fingerprint": self._fingerprint(),
            "rows_drawn": self.rows_drawn,
            "sources": [loader.state_dict() for loader in self.loaders],
        }

    def rank_state(self) -> dict:
        """This rank's part of the mixture's position, for `load_rank_states` (each source's trained-before sets
        travel only with data-parallel rank 0's state, as in `PackedDataLoader.rank_state`)."""
        state = self.state_dict()
        if self.dp_rank != 0:
            for source_state in state["sources"]:
                source_state["trained_before"] = None
        return state

    def _check_saved(self, state: dict) -> None:
        if state.get("version") != MIXTURE_STATE_VERSION:
            raise ValueError(
                f"cannot resume the data mixture: its state has version {state.get('version')}, expected "
                f"{MIXTURE_STATE_VERSION} (a checkpoint of a single-source run cannot continue as a mixture)"
            )
        saved = state["fingerprint"]
        if saved["sources"] != self.names:
            raise ValueError(
                f"cannot resume the data mixture: the checkpoint's sources are {saved['sources']} and the config's "
                f"are {self.names}; resuming needs the same [[training.sources]] names in the same order"
            )
        if saved["weights"] != self.weights or saved["seed"] != self.seed:
            logger.warning(
                "data: the mixture's weights / seed changed since the checkpoint (%s, seed %s -> %s, seed %s): the "
                "draws continue with the new ones",
                saved["weights"], saved["seed"], self.weights, self.seed,
            )  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self._check_saved(state)
        self._stop_prefetch()
        for loader, source_state in zip(self.loaders, state["sources"]):
            loader.load_state_dict(source_state)
        self.rows_drawn = state["rows_drawn"]

    def load_rank_states(self, states: list[dict]) -> None:
        """Continue from the `rank_state()` of every rank of a saved run (any order, repeats allowed): each source
        as `PackedDataLoader.load_rank_states` does, the draws from this rank's counter (module docstring)."""
        self._check_saved(states[0])  # the fingerprints of the saved ranks differ only in dp_rank
        self._stop_prefetch()
        by_rank = {s["fingerprint"]["dp_rank"]: s for s in states}
        for i, loader in enumerate(self.loaders):
            loader.load_rank_states([s["sources"][i] for s in by_rank.values()])
        saved_world = states[0]["fingerprint"]["dp_world_size"]
        if saved_world == self.dp_world_size:
            self.rows_drawn = by_rank[self.dp_rank]["rows_drawn"]
        else:
            self.rows_drawn = sum(s["rows_drawn"] for j, s in by_rank.items() if j % self.dp_world_size == self.dp_rank)


__all__ = ["MixtureLoader", "MixtureSpent", "draw_uniform", "pick_source"]
