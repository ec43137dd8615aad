"""`ChatDocumentSource`: the documents of a chat data set, for the packed loader (`data.dataloader`).

For a list of record indices (or, from a stream, of positions in an epoch's order) it reads the records
(`data.records`: local jsonl or parquet, a `save_to_disk` folder, a Hub dataset through `data.hub`), checks
each conversation (`chat.validate_conversation`), renders it with the tokenizer's chat template and tokenizes the
batch in one call (`chat.ChatTokenizer`: loss on the last assistant turn only), and fits each document to
`seq_len` (`packing.fit_document`: truncate or drop an over-long one). Each record gives one outcome:

    ("bad", location, reason)                  the record cannot be trained on (file:line and why)
    ("doc", location, Document | None, truncated)   the document (None when dropped as over-long)
"""

from __future__ import annotations

from typing import Union

from llm_training.data.chat import BadRecord, ChatTokenizer, validate_conversation
from llm_training.data.packing import Document, fit_document

OVERLONG_MODES = ("truncate", "drop")

SourceOutcome = Union[tuple[str, str, str], tuple[str, str, Union[Document, None], bool]]


class ChatDocumentSource:
    """Chat records -> trainable documents (module docstring)."""

    def __init__(self, records, chat_tokenizer: ChatTokenizer, *, seq_len: int, overlong: str = "truncate"):
        if overlong not in OVERLONG_MODES:
            raise ValueError(f"[huggingface_dataset] overlong = {overlong!r}; expected one of {list(OVERLONG_MODES)}")
        self.records, self.chat, self.seq_len, self.overlong = records, chat_tokenizer, seq_len, overlong

    @property
    def streamed(self) -> bool:
        """Whether the records are a stream (no length, no random access: `stream_documents`)."""
        return self.records.streamed

    @property
    def stream_length(self) -> int | None:
        """Records in the stream, once its end has been read."""
        return self.records.length

    def __len__(self) -> int:
        return len(self.records)

    @property
    def empty_files(self) -> list:
        return self.records.empty_files

    @property
    def pad_id(self) -> int:
        return self.chat.pad_id

    def fingerprint(self) -> dict:
        return {"overlong": self.overlong}

    def documents(self, record_indices) -> list[SourceOutcome]:
        """One outcome per record of `record_indices`, in order (module docstring)."""
        return self._outcomes(self.records.fetch(record_indices))

    def stream_documents(self, epoch: int, positions, seed: int | None) -> list[SourceOutcome]:
        """One outcome per record at the ascending `positions` of a stream's epoch `epoch` (shuffled with `seed`
        unless None); fewer when the stream ends first."""
        return self._outcomes(self.records.read(epoch, positions, seed))

    def _outcomes(self, fetched) -> list[SourceOutcome]:
        outcomes: list = []
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
            outcomes[slot] = ("doc", location, doc, truncated)
        return outcomes


__all__ = ["OVERLONG_MODES", "ChatDocumentSource", "SourceOutcome"]
