"""Helpers for the data tests: jsonl writers, sample builders and an independent ChatML reference.

The reference builds the ChatML text by hand (not through the chat template) and tokenizes it with the raw
`tokenizers.Tokenizer` from tokenizer.json, so it shares no code path with `llm_training.data.chat`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from llm_training.data import ChatDocumentSource, ChatTokenizer, PackedDataLoader, open_records

IGNORE = -100


def write_jsonl(path: Path, records: list) -> Path:
    """Write records (dicts are JSON-encoded, strings written verbatim) one per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record, ensure_ascii=False)) + "\n")
    return path


def chat(*turns: tuple[str, str]) -> dict:
    return {"conversations": [{"role": role, "content": content} for role, content in turns]}


def numbered_samples(n: int) -> list[dict]:
    """Samples whose trained answer names their index, with varied lengths."""
    return [chat(("user", f"question {i} " + "x" * (i % 7)), ("assistant", f"answer {i}")) for i in range(n)]


def reference_document(raw: Tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one conversation: ChatML written by hand, labels = next token of the last
    assistant turn (content + <|im_end|>) only."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")

    def turn(m):
        return f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"

    prompt = "<|bos|>" + "".join(turn(m) for m in messages[:last]) + "<|im_start|>assistant\n"
    target = messages[last]["content"] + "<|im_end|>"
    trailer = "\n" + "".join(turn(m) for m in messages[last + 1 :])
    pieces = [raw.encode(text, add_special_tokens=False).ids for text in (prompt, target, trailer)]
    ids = pieces[0] + pieces[1] + pieces[2]
    is_target = [len(pieces[0]) <= j < len(pieces[0]) + len(pieces[1]) for j in range(len(ids))]
    labels = [ids[t + 1] if t + 1 < len(ids) and is_target[t + 1] else IGNORE for t in range(len(ids))]
    return ids, labels


def make_loader(path, hf_tokenizer, **kwargs) -> PackedDataLoader:
    kwargs.setdefault("seq_len", 64)
    kwargs.setdefault("local_batch_size", 2)
    kwargs.setdefault("shuffle", False)
    records = open_records(path, kwargs.pop("conversations_field", "conversations"), kwargs.pop("split", "train"))
    source = ChatDocumentSource(
        records, ChatTokenizer(hf_tokenizer), seq_len=kwargs["seq_len"], overlong=kwargs.pop("overlong", "truncate")
    )
    return PackedDataLoader(source, **kwargs)


def split_documents(batch: dict) -> list[tuple[list[int], list[int]]]:
    """Non-padding documents (input_ids, labels) of a batch, in order, cut at document_ids changes."""
    docs = []
    for b in range(batch["input_ids"].shape[0]):
        ids, labels, doc_ids = (batch[k][b].tolist() for k in ("input_ids", "labels", "document_ids"))
        start = 0
        for t in range(1, len(ids) + 1):
            if t == len(ids) or doc_ids[t] != doc_ids[start]:
                segment = ids[start:t]
                if segment[0] != 0:  # padding documents are made of pad id 0 only
                    docs.append((segment, labels[start:t]))
                start = t
    return docs
