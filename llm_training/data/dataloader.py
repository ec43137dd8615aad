"""The stateful packed data loader: shard by data-parallel rank, shuffle per epoch, read ahead, pack, resume.

It is generic over its document source (`DocumentSource`: how many records there are and, for a list of record
indices, the trainable documents or the bad-record reasons they give; or, for a stream, the same for positions of
an epoch's order); the chat data sets' source is `data.chat_source.ChatDocumentSource` (validate, render with the
chat template, tokenize, fit to seq_len). A data mixture (`data.mixture.MixtureLoader`) draws rows from one
loader per source (`next_row`).

Order of records: epoch e visits a permutation of all records (seeded by `shuffle_seed + e`, or file order
without `shuffle`; a stream is its own order, shuffled in a buffer with the same seed): the global sample order,
whose positions g = 0..n-1 name the records of the epoch. Rank r takes positions r, r + W, r + 2W, ... of it
(W = dp world size; `data.positions`), so the ranks read disjoint shards that together cover every record once per
epoch (a streamed source is read whole by every rank, which keeps its positions). Iteration never ends: after its
shard, a rank logs a summary and starts the next epoch (a fresh permutation) -- unless `max_epochs` epochs are
done: the loader is then spent, its rows still being packed are closed and returned, and `next_row` raises
`SourceSpent`.

Records are read, validated, rendered and tokenized a small chunk ahead of the packer; the state counts only
records the packer has consumed, so `state_dict()` taken between batches, restored with `load_state_dict()`,
continues with exactly the batches the uninterrupted run would have produced. The state holds epoch,
position, counters and, for the rows being packed and rows closed but not yet emitted, the (epoch, position)
of each document, which are re-read and re-tokenized on load (small state even at 256K seq_len; a stream is read
again from the start of the epoch up to them, without tokenizing what lies between).

Resuming on another layout (`load_rank_states`, given the states of every rank of the saving run). With the same
data-parallel size and data settings each rank restores its own state exactly (the same batches as an
uninterrupted run). Otherwise the states are merged into the rank-independent position: per epoch in progress,
the set of global positions already trained (a consumed-prefix count plus the positions trained beyond it;
documents that were packed into rows but not yet returned in a batch count as not trained), and the new ranks
share what is left of that epoch in global order (rank r of M takes every M-th remaining position from r), then
continue with whole epochs. Every record is therefore trained exactly once per epoch across the change, but
the batches differ from an uninterrupted run (other rows, other ranks).

Iterating the loader (`next(loader)`) prepares `prefetch_batches` batches ahead in a background thread (the
tokenizer releases the GIL) and keeps, with each batch, a snapshot of the state after it, so `state_dict()`
still describes the last batch returned (`PrefetchingLoader`, shared with the mixture). `next_batch()` computes one
batch in the calling thread.

Bad records (for chat data: malformed JSON, missing conversations, unknown role, non-string content, no assistant
turn, a conversation the chat template rejects):
`bad_record_policy="fail"` raises `BadRecordError` naming file:line and the reason; "skip" counts them, logs
the first few with file:line and a summary per epoch. Either way the loader raises when more than
`max_bad_fraction` of the records seen are bad (checked from 100 records on, and at every epoch end) or when a
whole epoch of a rank's shard yields nothing trainable.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
from collections import deque
from typing import Protocol

import numpy as np
import torch

from llm_training.data.chat_source import SourceOutcome
from llm_training.data.packing import Document, RowPacker, collate_rows
from llm_training.data.positions import TrainedSet, merge_trained_positions, shard_positions, shard_size

logger = logging.getLogger(__name__)

MIN_RECORDS_FOR_BAD_FRACTION = 100  # the bad-record fraction is checked from this many records on (and at epoch end)
BAD_RECORDS_SHOWN = 5  # bad records logged one by one (per rank) before only counting them
READ_AHEAD_RECORDS = 64  # records read + tokenized per batched tokenizer call
STATE_VERSION = 2
_FRESH_EPOCH = TrainedSet()  # nothing trained before

PACKING_MODES = ("pack", "pad")
BAD_RECORD_POLICIES = ("skip", "fail")
COUNTER_NAMES = (
    "records_seen",
    "bad_records",
    "overlong_truncated",
    "overlong_dropped",
    "documents",
    "rows",
    "tokens",
    "target_tokens",
    "epochs_completed",
)


class BadRecordError(ValueError):
    """Bad input the loader refuses to train on (names the file:line or the threshold that was crossed)."""


class SourceSpent(Exception):
    """`PackedDataLoader.next_row` of a loader whose `max_epochs` are done and whose rows are all returned."""


class DocumentSource(Protocol):
    """What the loader reads documents from (e.g. `ChatDocumentSource`)."""

    empty_files: list  # files of the data set that hold no record (reported, or refused under policy 'fail')
    pad_id: int  # the token id that fills a row's unused tail
    streamed: bool  # a stream: no len() / documents(), but stream_documents() and stream_length

    def __len__(self) -> int: ...  # number of records

    def documents(self, record_indices) -> list[SourceOutcome]: ...  # one outcome per record, in order

    def stream_documents(self, epoch: int, positions, seed: int | None) -> list[SourceOutcome]: ...

    @property
    def stream_length(self) -> int | None: ...  # a stream's records, once its end has been read

    def fingerprint(self) -> dict: ...  # the source settings a saved loader state must match


class PrefetchingLoader:
    """An infinite iterator of batches that can prepare them in a background thread (`prefetch_batches` ahead),
    keeping with each batch the state after it. Subclasses compute one batch (`_next_batch_now`), their state
    (`_state_now`) and restore it (`load_state_dict`, which calls `_stop_prefetch` first)."""

    def __init__(self, prefetch_batches: int):
        self.prefetch_batches = prefetch_batches
        self._prefetcher: _Prefetcher | None = None
        self._delivered_state: dict = {}

    def _next_batch_now(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _state_now(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next batch, computed in the calling thread (do not mix with iterating the loader)."""
        if self._prefetcher is not None:
            raise RuntimeError("next_batch() while the loader is being iterated with prefetching; use next(loader)")
        return self._next_batch_now()

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        """The next batch; with `prefetch_batches` > 0 a background thread prepares batches ahead."""
        if self.prefetch_batches == 0:
            return self._next_batch_now()
        if self._prefetcher is None:
            self._delivered_state = self._state_now()
            self._prefetcher = _Prefetcher(self._produce, self.prefetch_batches)
        batch, self._delivered_state = self._prefetcher.get()
        return batch

    def _produce(self) -> tuple[dict[str, torch.Tensor], dict]:
        batch = self._next_batch_now()
        return batch, self._state_now()

    def _stop_prefetch(self) -> None:
        """Stop the prefetch thread (the batches it prepared ahead belong to the old position)."""
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def close(self) -> None:
        """Stop the prefetch thread (iteration restarts it); the state stays that of the last batch returned."""
        if self._prefetcher is not None:
            self._stop_prefetch()
            self.load_state_dict(self._delivered_state)

    def state_dict(self) -> dict:
        """Plain-Python (JSON-serializable) state after the last batch returned."""
        if self._prefetcher is not None:
            return copy.deepcopy(self._delivered_state)
        return self._state_now()


class PackedDataLoader(PrefetchingLoader):
    """Infinite iterable of packed batches (or rows, `next_row`) for one data-parallel rank (see module doc)."""

    def __init__(
        self,
        source: DocumentSource,
        *,
        seq_len: int,
        local_batch_size: int,
        packing: str = "pack",
        shuffle: bool = True,
        shuffle_seed: int = 0,
        bad_record_policy: str = "skip",
        max_bad_fraction: float = 0.01,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        prefetch_batches: int = 2,
        max_epochs: int = 0,
    ):
        _check_choice("[huggingface_dataset] packing", packing, PACKING_MODES)
        _check_choice("[huggingface_dataset] bad_record_policy", bad_record_policy, BAD_RECORD_POLICIES)
        if not 0.0 <= max_bad_fraction <= 1.0:
            raise ValueError(f"[huggingface_dataset] max_bad_fraction must be in [0, 1], got {max_bad_fraction}")
        if seq_len < 2 or local_batch_size < 1:
            raise ValueError(
                f"[training] seq_len must be >= 2 and local_batch_size >= 1, got {seq_len}, {local_batch_size}"
            )
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_world_size={dp_world_size})")
        super().__init__(prefetch_batches)
        self.source = source
        self.seq_len = seq_len
        self.batch_size = local_batch_size
        self.packing = packing
        self.shuffle = shuffle
        self.shuffle_seed = shuffle_seed
        self.policy = bad_record_policy
        self.max_bad_fraction = max_bad_fraction
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.max_epochs = max_epochs  # 0: no end
        self._check_sizes()

        self.epoch = 0
        self.position = 0  # records of this epoch's shard consumed by the packer
        # epoch -> global positions trained before a resume on another layout (their records are not in this
        # rank's shard of that epoch); absent for an epoch started afresh
        self.trained_before: dict[int, TrainedSet] = {}
        self.stream_records: int | None = None  # a stream's length, once an epoch end was read
        self.counters = dict.fromkeys(COUNTER_NAMES, 0)
        self.epoch_documents = 0
        self.bad_examples: list[str] = []
        self._bad_locations: set[str] = set()  # reported already (this process; not part of the state)
        self._new_bad_in_epoch = 0
        self.packer = RowPacker(seq_len, pack=packing == "pack")
        self.ready_rows: deque[list[Document]] = deque()
        self._orders: dict[int, np.ndarray] = {}
        self._ahead: deque[tuple] = deque()  # processed records for positions [position, position + len)

    def _check_sizes(self) -> None:
        for file in self.source.empty_files:
            if self.policy == "fail":
                raise BadRecordError(f"{file}: empty file (no records); bad_record_policy='fail'")
            logger.warning("data: %s is empty (no records); skipping it", file)
        if self.source.streamed:
            return  # its length is known once read (a stream without records fails as "nothing trainable")
        if len(self.source) == 0:
            raise BadRecordError("[training] dataset_path: the data set has no records (every file is empty)")
        if len(self.source) < self.dp_world_size:
            raise ValueError(
                f"the data set has {len(self.source)} records, fewer than the {self.dp_world_size} data-parallel "
                "ranks: every rank needs at least one record"
            )

    # ---- record order -------------------------------------------------------------------------------------
    def _order(self, epoch: int) -> np.ndarray:
        """The global sample order of `epoch`: record index at each global position (last two cached)."""
        if epoch not in self._orders:
            n = len(self.source)
            if self.shuffle:
                order = torch.randperm(n, generator=torch.Generator().manual_seed(self.shuffle_seed + epoch)).numpy()
            else:
                order = np.arange(n)
            while len(self._orders) >= 2:
                del self._orders[min(self._orders)]
            self._orders[epoch] = order
        return self._orders[epoch]

    def _num_records(self) -> int | None:
        """Records per epoch (a stream's: None until its end has been read)."""
        return self.stream_records if self.source.streamed else len(self.source)

    def _trained(self, epoch: int) -> TrainedSet:
        return self.trained_before.get(epoch, _FRESH_EPOCH)

    def _shard_len(self, epoch: int) -> int | None:
        """Positions this rank visits in `epoch` (None: a stream whose end has not been read yet)."""
        n = self._num_records()
        return None if n is None else shard_size(self._trained(epoch), self.dp_rank, self.dp_world_size, n)

    def _positions(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Global positions `start` to `stop` (exclusive) of this rank's shard of `epoch`."""
        trained = self._trained(epoch)
        return shard_positions(trained, self.dp_rank, self.dp_world_size, start, stop, self._num_records())

    # ---- reading ------------------------------------------------------------------------------------------
    def _process(self, epoch: int, positions) -> list[SourceOutcome]:
        """The source's outcomes for the records at global `positions` of `epoch`, each document tagged with its
        (epoch, position): ("bad", location, reason) or ("doc", location, Document or None if dropped, truncated).
        A stream gives fewer at its end."""
        positions = [int(g) for g in positions]
        if self.source.streamed:
            outcomes = self.source.stream_documents(epoch, positions, self.shuffle_seed if self.shuffle else None)
            if self.source.stream_length is not None:
                self.stream_records = self.source.stream_length
        else:
            outcomes = self.source.documents(self._order(epoch)[positions])
        for position, outcome in zip(positions, outcomes):
            if outcome[0] == "doc" and outcome[2] is not None:
                outcome[2].source = (epoch, position)
        return outcomes

    def _read_ahead(self) -> None:
        begin = self.position + len(self._ahead)
        stop = begin + READ_AHEAD_RECORDS
        size = self._shard_len(self.epoch)
        if size is not None:
            stop = min(stop, size)
        self._ahead.extend(self._process(self.epoch, self._positions(self.epoch, begin, stop)))

    def _rows_at(self, rows: list[list[list[int]]]) -> list[list[Document]]:
        """Re-create rows of documents from their (epoch, global position) sources (used when loading a state):
        one read per epoch, in position order (a stream is read once)."""
        wanted = sorted({(epoch, position) for row in rows for epoch, position in row})
        docs: dict[tuple[int, int], Document] = {}
        for epoch in sorted({epoch for epoch, _ in wanted}):
            positions = [position for e, position in wanted if e == epoch]
            for position, outcome in zip(positions, self._process(epoch, positions)):
                if outcome[0] != "doc" or outcome[2] is None:
                    raise ValueError(
                        f"cannot resume the data loader: the record at {outcome[1]} no longer gives the document it "
                        "gave when the state was saved (did the data change?)"
                    )
                docs[(epoch, position)] = outcome[2]
        missing = [source for source in wanted if source not in docs]
        if missing:
            raise ValueError(
                f"cannot resume the data loader: the stream ended before position {missing[0][1]} of epoch "
                f"{missing[0][0]}, which held a document when the state was saved (did the data change?)"
            )
        return [[docs[(epoch, position)] for epoch, position in row] for row in rows]

    # ---- consuming ----------------------------------------------------------------------------------------
    @property
    def spent(self) -> bool:
        """Whether `max_epochs` epochs are done (rows may still be waiting in the packer)."""
        return self.max_epochs > 0 and self.epoch >= self.max_epochs

    @property
    def exhausted(self) -> bool:
        """Whether `max_epochs` epochs are done and every row has been returned (`next_row` raises SourceSpent)."""
        return self.spent and not self.packer.open_rows and not self.ready_rows

    def _next_document(self) -> Document | None:
        """The next trainable document of this rank's shard; None when the epoch that ended was the last one."""
        while True:
            if self.position == self._shard_len(self.epoch):
                self._end_epoch()
                if self.spent:
                    return None
            if not self._ahead:
                self._read_ahead()
                if not self._ahead:  # a stream ended: its length is known now, and with it the epoch's end
                    continue
            outcome = self._ahead.popleft()
            self.position += 1
            self.counters["records_seen"] += 1
            if outcome[0] == "bad":
                self._on_bad_record(outcome[1], outcome[2])
                continue
            _, location, doc, truncated = outcome
            if truncated:
                self.counters["overlong_dropped" if doc is None else "overlong_truncated"] += 1
            if doc is None:
                continue
            self.epoch_documents += 1
            self.counters["documents"] += 1
            self.counters["tokens"] += len(doc)
            self.counters["target_tokens"] += sum(label != -100 for label in doc.labels)
            return doc

    def _on_bad_record(self, location: str, reason: str) -> None:
        self.counters["bad_records"] += 1
        message = f"{location}: {reason}"
        if self.policy == "fail":
            raise BadRecordError(f"bad record at {message} (bad_record_policy='fail'; use 'skip' to skip and count)")
        if self.counters["records_seen"] >= MIN_RECORDS_FOR_BAD_FRACTION:
            self._check_bad_fraction()
        if location in self._bad_locations:
            return  # seen in an earlier epoch: counted again, not reported again
        self._bad_locations.add(location)
        self._new_bad_in_epoch += 1
        if len(self.bad_examples) >= BAD_RECORDS_SHOWN:
            return  # the first few bad records are logged one by one, the rest only counted
        self.bad_examples.append(message)
        logger.warning("data rank %d: skipping bad record %s", self.dp_rank, message)
        if len(self.bad_examples) == BAD_RECORDS_SHOWN:
            logger.warning("data rank %d: further bad records are counted, not logged", self.dp_rank)

    def _check_bad_fraction(self) -> None:
        bad, seen = self.counters["bad_records"], self.counters["records_seen"]
        if seen and bad / seen > self.max_bad_fraction:
            raise BadRecordError(
                f"{bad} of {seen} records seen on data rank {self.dp_rank} are bad ({bad / seen:.1%} > "
                f"[huggingface_dataset] max_bad_fraction={self.max_bad_fraction}); first ones: "
                + "; ".join(self.bad_examples)
            )

    def _end_epoch(self) -> None:
        c = self.counters
        logger.info(
            "data rank %d: epoch %d done (%d records in shard); totals: %d bad, %d overlong truncated, %d overlong "
            "dropped, %d documents; %s",
            self.dp_rank,
            self.epoch,
            self.position,
            c["bad_records"],
            c["overlong_truncated"],
            c["overlong_dropped"],
            c["documents"],
            f"the last of max_epochs = {self.max_epochs}"
            if self.epoch + 1 == self.max_epochs
            else f"starting epoch {self.epoch + 1}",
        )
        if self._new_bad_in_epoch:
            logger.warning(
                "data rank %d: bad records skipped so far: %d (%d not seen before in this epoch)",
                self.dp_rank,
                c["bad_records"],
                self._new_bad_in_epoch,
            )
        self._new_bad_in_epoch = 0
        self._check_bad_fraction()
        if self.epoch_documents == 0 and self.epoch not in self.trained_before:  # a resumed epoch may be empty
            raise BadRecordError(
                f"nothing trainable: a whole epoch of data rank {self.dp_rank}'s shard ({self.position} records) "
                f"gave no sample ({c['bad_records']} bad, {c['overlong_dropped']} over-long dropped so far); "
                "check the data, [training] seq_len and [huggingface_dataset] overlong"
            )
        self.epoch += 1
        self.position = 0
        self.epoch_documents = 0
        c["epochs_completed"] += 1

    def next_row(self) -> list[Document]:
        """The next packed row (its documents); raises `SourceSpent` once `max_epochs` are done and every row
        has been returned (the rows being packed when the last epoch ended are closed, padded, and returned first)."""
        while not self.ready_rows:
            if not self.spent:
                doc = self._next_document()
                if doc is not None:
                    self.ready_rows.extend(self.packer.add(doc))
            elif self.packer.open_rows:
                self.ready_rows.extend(self.packer.close_all())
            else:
                raise SourceSpent(f"data rank {self.dp_rank}: all {self.max_epochs} epoch(s) are done")
        self.counters["rows"] += 1
        return self.ready_rows.popleft()

    def _next_batch_now(self) -> dict[str, torch.Tensor]:
        rows = [self.next_row() for _ in range(self.batch_size)]
        return collate_rows(rows, self.seq_len, self.source.pad_id)

    @property
    def stats(self) -> dict[str, int]:
        """Cumulative counters of this rank up to the last batch returned (records seen, bad, over-long, ...)."""
        state = self.state_dict()
        return dict(state["counters"], epoch=state["epoch"])

    # ---- state --------------------------------------------------------------------------------------------
    def _fingerprint(self) -> dict:
        return {
            "num_records": None if self.source.streamed else len(self.source),
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            "seq_len": self.seq_len,
            "local_batch_size": self.batch_size,
            "packing": self.packing,
            **self.source.fingerprint(),
            "shuffle": self.shuffle,
            "shuffle_seed": self.shuffle_seed,
        }

    def rank_state(self) -> dict:
        """This rank's part of the global data position, for `load_rank_states` (the trained-before sets,
        the same on every rank, travel only with data-parallel rank 0's state)."""
        state = self.state_dict()
        if self.dp_rank != 0:
            state["trained_before"] = None
        return state

    def _state_now(self) -> dict:
        return {
            "version": STATE_VERSION,
            "fingerprint": self._fingerprint(),
            "epoch": self.epoch,
            "position": self.position,
            "trained_before": {str(e): t.to_json() for e, t in sorted(self.trained_before.items())},
            "stream_records": self.stream_records,
            "epoch_documents": self.epoch_documents,
            "counters": dict(self.counters),
            "bad_examples": list(self.bad_examples),
            "open_rows": [[list(doc.source) for doc in row] for row in self.packer.open_rows],
            "ready_rows": [[list(doc.source) for doc in row] for row in self.ready_rows],
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data loader state version {state.get('version')} != {STATE_VERSION}")
        self._stop_prefetch()
        mine = self._fingerprint()
        for key, value in state["fingerprint"].items():
            if mine.get(key) != value:
                raise ValueError(
                    f"cannot resume the data loader: {key} was {value!r} in the checkpoint and is {mine.get(key)!r} "
                    "now; resuming needs the same data set, data-parallel size and data settings"
                )
        self.trained_before = {int(e): TrainedSet.from_json(t) for e, t in state["trained_before"].items()}
        self.stream_records = state.get("stream_records")
        self.epoch = state["epoch"]
        self.position = state["position"]
        self.epoch_documents = state["epoch_documents"]
        self.counters = dict.fromkeys(COUNTER_NAMES, 0) | state["counters"]
        self.bad_examples = list(state["bad_examples"])
        self._ahead.clear()
        rows = self._rows_at(state["open_rows"] + state["ready_rows"])
        self.packer.load_open_rows(rows[: len(state["open_rows"])])
        self.ready_rows = deque(rows[len(state["open_rows"]) :])

    def load_rank_states(self, states: list[dict]) -> None:
        """Continue from the `rank_state()` of every rank of a saved run (any order; ranks that share a
        data-parallel rank may repeat it): exactly when the data-parallel size and data settings are unchanged,
        otherwise from the merged rank-independent position (see the module doc)."""
        by_rank = {s["fingerprint"]["dp_rank"]: s for s in states}
        saved_world = states[0]["fingerprint"]["dp_world_size"]
        if sorted(by_rank) != list(range(saved_world)) or any(s.get("version") != STATE_VERSION for s in states):
            raise ValueError(
                f"cannot resume the data loader: the checkpoint holds the states of data-parallel ranks "
                f"{sorted(by_rank)} of {saved_world} (state version {states[0].get('version')}, expected "
                f"{STATE_VERSION}); it is incomplete or was written by another version"
            )
        ordered = [by_rank[r] for r in range(saved_world)]
        trained_before = ordered[0]["trained_before"]
        mine = self._fingerprint()
        saved = ordered[0]["fingerprint"]
        if all(saved[k] == mine[k] for k in mine if k != "dp_rank"):
            self.load_state_dict(dict(ordered[self.dp_rank], trained_before=trained_before))
            return
        for key in ("num_records", "shuffle", "shuffle_seed"):  # these define the global sample order
            if saved[key] != mine[key]:
                raise ValueError(
                    f"cannot resume the data loader: {key} was {saved[key]!r} in the checkpoint and is "
                    f"{mine[key]!r} now; the global sample order needs the same data set and shuffle settings"
                )
        self._stop_prefetch()
        changed = [k for k in mine if k != "dp_rank" and saved[k] != mine[k]]
        epoch, self.trained_before = merge_trained_positions(ordered, mine["num_records"])
        self.stream_records = next((s["stream_records"] for s in ordered if s.get("stream_records") is not None), None)
        self.epoch, self.position, self.epoch_documents = epoch, 0, 0
        self.counters = dict.fromkeys(COUNTER_NAMES, 0)
        self.bad_examples = []
        for j, state in enumerate(ordered):  # old rank j's counts go to new rank j % M: the totals are kept
            if j % self.dp_world_size == self.dp_rank:
                for name, value in state["counters"].items():
                    self.counters[name] = self.counters.get(name, 0) + value
                self.bad_examples += [m for m in state["bad_examples"] if m not in self.bad_examples]
        self.bad_examples = self.bad_examples[:BAD_RECORDS_SHOWN]
        self._ahead.clear()
        self.packer.load_open_rows([])
        self.ready_rows = deque()
        if self.dp_rank == 0:
            n = self._num_records()
            left = "all" if n is None else str(self._trained(epoch).pool_size(n))
            logger.info(
                "data: resuming on a new layout (%s changed): epoch %d continues with the %s records not yet "
                "trained, shared by %d data-parallel ranks",
                ", ".join(changed),
                epoch,
                left,
                self.dp_world_size,
            )


class _Prefetcher:
    """Calls `produce()` in a daemon thread, up to `depth` results ahead; `get()` returns them in order and
    re-raises an exception of `produce()` where it happened in the sequence (and on every later call)."""

    def __init__(self, produce, depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(produce,), daemon=True, name="chat-data-prefetch")
        self._thread.start()

    def _run(self, produce) -> None:
        while not self._stop.is_set():
            try:
                item = (produce(), None)
            except BaseException as exc:  # handed to the consumer, raised there
                item = (None, exc)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue
            if item[1] is not None:
                return

    def get(self):
        if self._error is not None:
            raise self._error
        value, error = self._queue.get()
        if error is not None:
            self._error = error
            raise error
        return value

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{key} = {value!r}; expected one of {list(choices)}")
