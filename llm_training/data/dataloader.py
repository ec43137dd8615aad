"""The stateful chat data loader: shard by data-parallel rank, shuffle per epoch, tokenize lazily, pack, resume.

Order of records: epoch e visits a permutation of all records (seeded by `shuffle_seed + e`, or file order
without `shuffle`); rank r takes positions r, r + W, r + 2W, ... of it (W = dp world size), so the ranks read
disjoint shards that together cover every record once per epoch. Iteration never ends: after its shard, a
rank logs a summary and starts the next epoch (a fresh permutation).

Records are read, validated, rendered and tokenized a small chunk ahead of the packer; the state counts only
records the packer has consumed, so `state_dict()` taken between batches, restored with `load_state_dict()`,
continues with exactly the batches the uninterrupted run would have produced. The state holds epoch,
position, counters and, for the rows being packed and rows closed but not yet emitted, the (epoch, position)
of each document, which are re-read and re-tokenized on load (small state even at 256K seq_len).

Iterating the loader (`next(loader)`) prepares `prefetch_batches` batches ahead in a background thread (the
tokenizer releases the GIL) and keeps, with each batch, a snapshot of the state after it, so `state_dict()`
still describes the last batch returned. `next_batch()` computes one batch in the calling thread.

Bad records (malformed JSON, missing conversations, unknown role, non-string content, no assistant turn, a
conversation the chat template rejects):
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

import numpy as np
import torch

from llm_training.data.chat import BadRecord, ChatTokenizer, validate_conversation
from llm_training.data.packing import Document, RowPacker, collate_rows, fit_document
from llm_training.data.records import open_records

logger = logging.getLogger(__name__)

MIN_RECORDS_FOR_BAD_FRACTION = 100  # the bad-record fraction is checked from this many records on (and at epoch end)
BAD_RECORDS_SHOWN = 5  # bad records logged one by one (per rank) before only counting them
READ_AHEAD_RECORDS = 64  # records read + tokenized per batched tokenizer call
STATE_VERSION = 1

PACKING_MODES = ("pack", "pad")
OVERLONG_MODES = ("truncate", "drop")
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


class ChatDataLoader:
    """Infinite iterable of packed batches for one data-parallel rank (see module doc)."""

    def __init__(
        self,
        records,
        chat_tokenizer: ChatTokenizer,
        *,
        seq_len: int,
        local_batch_size: int,
        packing: str = "pack",
        overlong: str = "truncate",
        shuffle: bool = True,
        shuffle_seed: int = 0,
        bad_record_policy: str = "skip",
        max_bad_fraction: float = 0.01,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        prefetch_batches: int = 2,
    ):
        _check_choice("[huggingface_dataset] packing", packing, PACKING_MODES)
        _check_choice("[huggingface_dataset] overlong", overlong, OVERLONG_MODES)
        _check_choice("[huggingface_dataset] bad_record_policy", bad_record_policy, BAD_RECORD_POLICIES)
        if not 0.0 <= max_bad_fraction <= 1.0:
            raise ValueError(f"[huggingface_dataset] max_bad_fraction must be in [0, 1], got {max_bad_fraction}")
        if seq_len < 2 or local_batch_size < 1:
            raise ValueError(
                f"[training] seq_len must be >= 2 and local_batch_size >= 1, got {seq_len}, {local_batch_size}"
            )
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_world_size={dp_world_size})")
        self.records = records
        self.chat = chat_tokenizer
        self.seq_len = seq_len
        self.batch_size = local_batch_size
        self.packing = packing
        self.overlong = overlong
        self.shuffle = shuffle
        self.shuffle_seed = shuffle_seed
        self.policy = bad_record_policy
        self.max_bad_fraction = max_bad_fraction
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self._check_sizes()

        self.epoch = 0
        self.position = 0  # records of this epoch's shard consumed by the packer
        self.counters = dict.fromkeys(COUNTER_NAMES, 0)
        self.epoch_documents = 0
        self.bad_examples: list[str] = []
        self.packer = RowPacker(seq_len, pack=packing == "pack")
        self.ready_rows: deque[list[Document]] = deque()
        self._shards: dict[int, np.ndarray] = {}
        self._ahead: deque[tuple] = deque()  # processed records for positions [position, position + len)
        self.prefetch_batches = prefetch_batches
        self._prefetcher: _Prefetcher | None = None
        self._delivered_state: dict = {}

    def _check_sizes(self) -> None:
        for file in self.records.empty_files:
            if self.policy == "fail":
                raise BadRecordError(f"{file}: empty file (no records); bad_record_policy='fail'")
            logger.warning("data: %s is empty (no records); skipping it", file)
        if len(self.records) == 0:
            raise BadRecordError("[training] dataset_path: the data set has no records (every file is empty)")
        if len(self.records) < self.dp_world_size:
            raise ValueError(
                f"the data set has {len(self.records)} records, fewer than the {self.dp_world_size} data-parallel "
                "ranks: every rank needs at least one record"
            )

    # ---- record order -------------------------------------------------------------------------------------
    def _shard(self, epoch: int) -> np.ndarray:
        """Record indices this rank visits in `epoch` (the last two epochs asked for are cached)."""
        if epoch not in self._shards:
            n = len(self.records)
            if self.shuffle:
                order = torch.randperm(n, generator=torch.Generator().manual_seed(self.shuffle_seed + epoch)).numpy()
            else:
                order = np.arange(n)
            while len(self._shards) >= 2:
                del self._shards[min(self._shards)]
            self._shards[epoch] = order[self.dp_rank :: self.dp_world_size]
        return self._shards[epoch]

    # ---- reading ------------------------------------------------------------------------------------------
    def _process(self, epoch: int, positions) -> list[tuple]:
        """Read, validate, render, tokenize and fit the records at `positions` of `epoch`'s shard.
        Each outcome is ("bad", location, reason) or ("doc", location, Document or None if dropped, truncated)."""
        positions = list(positions)
        fetched = self.records.fetch(self._shard(epoch)[positions])
        outcomes: list[tuple] = []
        pieces, slots = [], []
        for location, conversation in fetched:
            try:
                pieces.append(self.chat.split(validate_conversation(conversation)))
                slots.append(len(outcomes))
                outcomes.append(("doc", location))
            except BadRecord as bad:
                outcomes.append(("bad", location, bad.reason))
        for slot, chat in zip(slots, self.chat.tokenize(pieces)):
            doc, truncated = fit_document(chat, self.seq_len, self.overlong)
            location = outcomes[slot][1]
            if doc is None and not truncated:
                outcomes[slot] = ("bad", location, "no trained token (the target is the first token of the render)")
                continue
            if doc is not None:
                doc.source = (epoch, positions[slot])
            outcomes[slot] = ("doc", location, doc, truncated)
        return outcomes

    def _read_ahead(self) -> None:
        begin = self.position + len(self._ahead)
        stop = min(begin + READ_AHEAD_RECORDS, len(self._shard(self.epoch)))
        self._ahead.extend(self._process(self.epoch, range(begin, stop)))

    def _documents_at(self, sources: list[tuple[int, int]]) -> list[Document]:
        """Re-create documents from their (epoch, position) sources (used when loading a state)."""
        docs = []
        for epoch, position in sources:
            [outcome] = self._process(epoch, [position])
            if outcome[0] != "doc" or outcome[2] is None:
                raise ValueError(
                    f"cannot resume the data loader: the record at {outcome[1]} no longer gives the document it "
                    "gave when the state was saved (did the data change?)"
                )
            docs.append(outcome[2])
        return docs

    # ---- consuming ----------------------------------------------------------------------------------------
    def _next_document(self) -> Document:
        while True:
            if self.position == len(self._shard(self.epoch)):
                self._end_epoch()
            if not self._ahead:
                self._read_ahead()
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
        if len(self.bad_examples) < BAD_RECORDS_SHOWN:
            self.bad_examples.append(message)
            logger.warning("data rank %d: skipping bad record %s", self.dp_rank, message)
        if self.counters["records_seen"] >= MIN_RECORDS_FOR_BAD_FRACTION:
            self._check_bad_fraction()

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
            "dropped, %d documents; starting epoch %d",
            self.dp_rank,
            self.epoch,
            len(self._shard(self.epoch)),
            c["bad_records"],
            c["overlong_truncated"],
            c["overlong_dropped"],
            c["documents"],
            self.epoch + 1,
        )
        if c["bad_records"]:
            logger.warning(
                "data rank %d: bad records skipped so far: %d; first: %s",
                self.dp_rank,
                c["bad_records"],
                "; ".join(self.bad_examples),
            )
        self._check_bad_fraction()
        if self.epoch_documents == 0:
            raise BadRecordError(
                f"nothing trainable: a whole epoch of data rank {self.dp_rank}'s shard "
                f"({len(self._shard(self.epoch))} records) "
                f"gave no sample ({c['bad_records']} bad, {c['overlong_dropped']} over-long dropped so far); "
                "check the data, [training] seq_len and [huggingface_dataset] overlong"
            )
        self.epoch += 1
        self.position = 0
        self.epoch_documents = 0
        c["epochs_completed"] += 1

    def _next_batch_now(self) -> dict[str, torch.Tensor]:
        while len(self.ready_rows) < self.batch_size:
            self.ready_rows.extend(self.packer.add(self._next_document()))
        rows = [self.ready_rows.popleft() for _ in range(self.batch_size)]
        self.counters["rows"] += len(rows)
        return collate_rows(rows, self.seq_len, self.chat.pad_id)

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

    def close(self) -> None:
        """Stop the prefetch thread (iteration restarts it); the state stays that of the last batch returned."""
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
            self.load_state_dict(self._delivered_state)

    @property
    def stats(self) -> dict[str, int]:
        """Cumulative counters of this rank up to the last batch returned (records seen, bad, over-long, ...)."""
        state = self.state_dict()
        return dict(state["counters"], epoch=state["epoch"])

    # ---- state --------------------------------------------------------------------------------------------
    def _fingerprint(self) -> dict:
        return {
            "num_records": len(self.records),
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            "seq_len": self.seq_len,
            "local_batch_size": self.batch_size,
            "packing": self.packing,
            "overlong": self.overlong,
            "shuffle": self.shuffle,
            "shuffle_seed": self.shuffle_seed,
        }

    def state_dict(self) -> dict:
        """Plain-Python (picklable, JSON-serializable) state after the last batch returned."""
        if self._prefetcher is not None:
            return copy.deepcopy(self._delivered_state)
        return self._state_now()

    def _state_now(self) -> dict:
        return {
            "version": STATE_VERSION,
            "fingerprint": self._fingerprint(),
            "epoch": self.epoch,
            "position": self.position,
            "epoch_documents": self.epoch_documents,
            "counters": dict(self.counters),
            "bad_examples": list(self.bad_examples),
            "open_rows": [[list(doc.source) for doc in row] for row in self.packer.open_rows],
            "ready_rows": [[list(doc.source) for doc in row] for row in self.ready_rows],
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data loader state version {state.get('version')} != {STATE_VERSION}")
        if self._prefetcher is not None:  # batches prepared ahead belong to the old position
            self._prefetcher.close()
            self._prefetcher = None
        mine = self._fingerprint()
        for key, value in state["fingerprint"].items():
            if mine.get(key) != value:
                raise ValueError(
                    f"cannot resume the data loader: {key} was {value!r} in the checkpoint and is {mine.get(key)!r} "
                    "now; resuming needs the same data set, data-parallel size and data settings"
                )
        self.epoch = state["epoch"]
        self.position = state["position"]
        self.epoch_documents = state["epoch_documents"]
        self.counters = dict.fromkeys(COUNTER_NAMES, 0) | state["counters"]
        self.bad_examples = list(state["bad_examples"])
        self._ahead.clear()
        self.packer.load_open_rows([self._documents_at(row) for row in state["open_rows"]])
        self.ready_rows = deque(self._documents_at(row) for row in state["ready_rows"])


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


def build_dataloader(job_config, tokenizer, dp_rank: int, dp_world_size: int) -> ChatDataLoader:
    """The data loader of one data-parallel rank from the `[training]` and `[huggingface_dataset]` config."""
    training, hf = job_config.training, job_config.huggingface_dataset
    if training.dataset != "huggingface":
        raise ValueError(f"[training] dataset = {training.dataset!r}; the only data set type is 'huggingface'")
    # Records are always read lazily from disk (jsonl through a line-offset index, save_to_disk as
    # memory-mapped arrow) and tokenized on the fly, so there is no separate streaming mode.
    records = open_records(training.dataset_path, hf.conversations_field, hf.split)
    return ChatDataLoader(
        records,
        ChatTokenizer(tokenizer),
        seq_len=training.seq_len,
        local_batch_size=training.local_batch_size,
        packing=hf.packing,
        overlong=hf.overlong,
        shuffle=hf.shuffle,
        shuffle_seed=hf.shuffle_seed,
        bad_record_policy=hf.bad_record_policy,
        max_bad_fraction=hf.max_bad_fraction,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
    )
