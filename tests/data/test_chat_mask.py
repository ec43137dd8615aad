"""Last-assistant-turn labels against a hand-written ChatML reference, through the whole loader (pad mode)."""

from __future__ import annotations

import pytest

from llm_training.data import ChatTokenizer, fit_document, validate_conversation

from data_helpers import IGNORE, chat, make_loader, reference_document, split_documents, write_jsonl

CASES = {
    "single_turn": chat(("user", "What is 2 + 3?"), ("assistant", "2 + 3 = 5.")),
    "system_prompt": chat(("system", "Answer in upper case."), ("user", "Say hi."), ("assistant", "HI.")),
    "multi_turn": chat(
        ("user", "Count from 1 to 3."), ("assistant", "1, 2, 3."), ("user", "And back?"), ("assistant", "3, 2, 1.")
    ),
    "three_assistant_turns_with_system": chat(
        ("system", "Be brief."),
        ("user", "a"),
        ("assistant", "first"),
        ("user", "b"),
        ("assistant", "second"),
        ("user", "c"),
        ("assistant", "third and last"),
    ),
    "unicode": chat(("user", "Übersetze: 猫 🐈"), ("assistant", "Katze — ñandú ✓ 😀")),
    "empty_user_content": chat(("user", ""), ("assistant", "nothing was asked")),
    "empty_assistant_content": chat(("user", "say nothing"), ("assistant", "")),
    "user_turn_after_last_assistant": chat(("user", "q1"), ("assistant", "a1"), ("user", "q2 left unanswered")),
    "raw_text": chat(("assistant", "Plain pretraining text, trained on in full.\nSecond line.")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_labels_are_last_assistant_turn_only(name, tmp_path, hf_tokenizer, raw_tokenizer):
    sample = CASES[name]
    path = write_jsonl(tmp_path / "d.jsonl", [sample])
    batch = make_loader(path, hf_tokenizer, seq_len=128, local_batch_size=1, packing="pad").next_batch()
    [(ids, labels)] = split_documents(batch)
    ref_ids, ref_labels = reference_document(raw_tokenizer, sample["conversations"])
    assert ids == ref_ids
    assert labels == ref_labels
    # text-level check: the trained tokens decode to exactly the last assistant content + end of turn
    last_content = [m["content"] for m in sample["conversations"] if m["role"] == "assistant"][-1]
    trained = [label for label in labels if label != IGNORE]
    assert raw_tokenizer.decode(trained, skip_special_tokens=False) == last_content + "<|im_end|>"
    assert labels[-1] == IGNORE
    # padding after the document: pad id, no labels, its own document id, positions from 0
    n = len(ids)
    assert batch["input_ids"][0, n:].eq(hf_tokenizer.pad_token_id).all()
    assert batch["labels"][0, n:].eq(IGNORE).all()
    assert batch["document_ids"][0, n:].eq(1).all() and batch["document_ids"][0, :n].eq(0).all()
    assert batch["position_ids"][0].tolist() == list(range(n)) + list(range(128 - n))


def test_truncation_keeps_target_and_cuts_prompt_start(hf_tokenizer, raw_tokenizer):
    messages = validate_conversation(
        chat(("user", "long context " * 40), ("assistant", "short answer"))["conversations"]
    )
    chat_tok = ChatTokenizer(hf_tokenizer)
    [tokenized] = chat_tok.tokenize([chat_tok.split(messages)])
    ref_ids, ref_labels = reference_document(raw_tokenizer, messages)
    seq_len = 32
    doc, truncated = fit_document(tokenized, seq_len, "truncate")
    assert truncated and len(doc) == seq_len
    # the full target + trailer ends the window: the window is the tail of the reference
    target_end = max(t for t, label in enumerate(ref_labels) if label != IGNORE) + 2
    start = max(target_end, seq_len) - seq_len
    assert doc.input_ids == ref_ids[start : start + seq_len]
    expected = ref_labels[start : start + seq_len]
    expected[-1] = IGNORE
    assert doc.labels == expected
    assert (
        raw_tokenizer.decode([x for x in doc.labels if x != IGNORE], skip_special_tokens=False)
        == "short answer<|im_end|>"
    )
    assert fit_document(tokenized, seq_len, "drop") == (None, True)


def test_truncation_of_long_target_keeps_the_start(hf_tokenizer, raw_tokenizer):
    messages = validate_conversation(chat(("assistant", "word " * 100))["conversations"])
    chat_tok = ChatTokenizer(hf_tokenizer)
    [tokenized] = chat_tok.tokenize([chat_tok.split(messages)])
    ref_ids, ref_labels = reference_document(raw_tokenizer, messages)
    doc, truncated = fit_document(tokenized, 20, "truncate")
    assert truncated
    assert doc.input_ids == ref_ids[:20]
    assert doc.labels == ref_labels[:19] + [IGNORE]


def test_truncation_that_leaves_no_target_drops(hf_tokenizer):
    messages = validate_conversation(chat(("user", "p " * 60), ("assistant", "a " * 60))["conversations"])
    chat_tok = ChatTokenizer(hf_tokenizer)
    [tokenized] = chat_tok.tokenize([chat_tok.split(messages)])
    assert tokenized.target_start > 20  # target too long to fit, and the first 20 tokens are prompt only
    assert fit_document(tokenized, 20, "truncate") == (None, True)
