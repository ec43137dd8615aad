"""Fit tokenized chats to `seq_len` and pack them into fixed-length rows with document boundaries.

Labels follow the CONTRACTS convention: `labels[t]` is the next token when that token is trained, else -100.
The last token of a document never has a label, so MTP targets (labels shifted by one more position) never
cross documents. Documents are never split across rows (an SFT sample cut in two would lose its prompt); the
space a row has left is padding (its own document id, positions from 0, labels -100).

Over-long samples (`overlong`):
- "truncate": keep the whole target and as much of the context right before it as fits (the start of the
  prompt is cut); when the target alone does not fit, keep the first seq_len tokens (the end of the target is
  cut). A sample left with no trained token is dropped.
- "drop": drop every sample longer than seq_len.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm_training.data.chat import TokenizedChat

IGNORE_INDEX = -100
PACK_OPEN_ROWS = 8  # rows filled at the same time by the "pack" mode (first-fit)


@dataclass
class Document:
    """One sample ready to pack: `labels[t]` = input_ids[t+1] if trained, else -100; `source` is the
    (epoch, global position in that epoch's sample order) it was read from: all the loader state keeps of it."""

    input_ids: list[int]
    labels: list[int]
    source: tuple[int, int] = (0, 0)

    def __len__(self) -> int:
        return len(self.input_ids)


def fit_document(chat: TokenizedChat, seq_len: int, overlong: str) -> tuple[Document | None, bool]:
    """(document or None when dropped, whether it was truncated) for one tokenized chat."""
    ids, start, end = chat.ids, chat.target_start, chat.target_end
    truncated = len(ids) > seq_len
    if truncated and overlong == "drop":
        return None, True
    if not truncated:
        window_start = 0
    elif end - start <= seq_len - 1:  # the whole target plus at least one token of context fits
        window_start = max(end, seq_len) - seq_len
    else:
        window_start = 0
    window = ids[window_start : window_start + seq_len]
    labels = [IGNORE_INDEX] * len(window)
    first = max(start - window_start, 1)  # a token at position 0 has nothing before it to predict it
    stop = min(end - window_start, len(window))
    if stop <= first:
        return None, truncated
    labels[first - 1 : stop - 1] = window[first:stop]
    return Document(window, labels), truncated


class RowPacker:
    """Packs documents into rows ("pack") or gives each its own row ("pad").

    "pack" is first-fit over at most `open_rows` rows being filled: a document goes into the oldest open row
    with room for it; when none has room and all slots are taken, the fullest open row is closed (padded) to
    make room. A row that becomes exactly full is closed at once. Deterministic, and it fills rows far better
    than closing a row at the first document that does not fit, when documents are long next to seq_len.
    """

    def __init__(self, seq_len: int, pack: bool, open_rows: int = PACK_OPEN_ROWS):
        self.seq_len = seq_len
        self.pack = pack
        self.open_rows_max = open_rows
        self.open_rows: list[list[Document]] = []
        self._used: list[int] = []

    def add(self, doc: Document) -> list[list[Document]]:
        """Add a document (len <= seq_len); return the rows this closed (0, 1 or 2)."""
        if not self.pack:
            return [[doc]]
        closed = []
        slot = next((k for k, used in enumerate(self._used) if used + len(doc) <= self.seq_len), None)
        if slot is None:
            if len(self.open_rows) == self.open_rows_max:
                closed.append(self._close(max(range(len(self._used)), key=self._used.__getitem__)))
            self.open_rows.append([])
            self._used.append(0)
            slot = len(self.open_rows) - 1
        self.open_rows[slot].append(doc)
        self._used[slot] += len(doc)
        if self._used[slot] == self.seq_len:
            closed.append(self._close(slot))
        return closed

    def _close(self, slot: int) -> list[Document]:
        self._used.pop(slot)
        return self.open_rows.pop(slot)

    def close_all(self) -> list[list[Document]]:
        """Close every open row (oldest first) and return them: the source has no more documents."""
        rows, self.open_rows, self._used = self.open_rows, [], []
        return rows

    def load_open_rows(self, rows: list[list[Document]]) -> None:
        self.open_rows = rows
        self._used = [sum(len(doc) for doc in row) for row in rows]


def collate_rows(rows: list[list[Document]], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Rows of documents -> the batch dict of [len(rows), seq_len] tensors (see CONTRACTS "Data batches"), plus
    `real_tokens` [len(rows)]: each row's tokens that belong to a document (the rest is padding)."""
    input_ids, labels, position_ids, document_ids, real_tokens = [], [], [], [], []
    for row in rows:
        row_ids, row_labels, row_pos, row_doc = [], [], [], []
        for k, doc in enumerate(row):
            row_ids += doc.input_ids
            row_labels += doc.labels
            row_pos += range(len(doc))
            row_doc += [k] * len(doc)
        pad = seq_len - len(row_ids)
        real_tokens.append(len(row_ids))
        row_ids += [pad_id] * pad
        row_labels += [IGNORE_INDEX] * pad
        row_pos += range(pad)
        row_doc += [len(row)] * pad
        input_ids.append(row_ids)
        labels.append(row_labels)
        position_ids.append(row_pos)
        document_ids.append(row_doc)
    return {
        "input_ids": torch.tensor(input_ids, dtype=torch.long),
        "labels": torch.tensor(labels, dtype=torch.long),
        "position_ids": torch.tensor(position_ids, dtype=torch.long),
        "document_ids": torch.tensor(document_ids, dtype=torch.int32),
        "real_tokens": torch.tensor(real_tokens, dtype=torch.long),
    }
