"""Bad input never crashes silently: skip counts and names file:line, fail raises, thresholds, start-up errors."""

from __future__ import annotations

import logging
import shutil

import pytest

from llm_training.data import BUNDLED_TOKENIZER_PATH, BadRecordError, build_tokenizer, open_records

from data_helpers import chat, make_loader, numbered_samples, write_jsonl

GOOD = chat(("user", "hi"), ("assistant", "hello"))
BAD_LINES = {  # line content -> words the reason must contain
    '{"conversations": [{"role": "user", "content": "cut in ha': "malformed JSON",
    '{"messages": []}': "no 'conversations' field",
    '{"conversations": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}': "unknown role 'wizard'",
    '{"conversations": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]}': "content is int",
    '{"conversations": [{"role": "user", "content": "only a question"}]}': "no assistant turn",
    '{"conversations": "not a list"}': "expected a list",
    "[1, 2]": "expected an object",
    '{"conversations": []}': "conversations is empty",
}


def _mixed_file(tmp_path):
    """GOOD, then each bad line followed by GOOD; returns (path, {line number: reason words})."""
    lines, expected = [GOOD], {}
    for bad, words in BAD_LINES.items():
        lines.append(bad)
        expected[len(lines)] = words
        lines.append(GOOD)
    return write_jsonl(tmp_path / "mixed.jsonl", lines), expected


def _drain_epoch(loader):
    while loader.epoch == 0:
        loader.next_batch()


def test_skip_counts_and_names_file_and_line(tmp_path, hf_tokenizer, caplog):
    path, expected = _mixed_file(tmp_path)
    loader = make_loader(path, hf_tokenizer, max_bad_fraction=1.0, local_batch_size=1, packing="pad")
    with caplog.at_level(logging.WARNING, logger="llm_training.data.dataloader"):
        _drain_epoch(loader)
    assert loader.counters["bad_records"] == len(BAD_LINES)
    assert loader.counters["records_seen"] >= 2 * len(BAD_LINES) + 1
    shown = list(expected.items())[:5]
    assert len(loader.bad_examples) == 5
    for (line, words), message in zip(shown, loader.bad_examples):
        assert message.startswith(f"{path}:{line}: ") and words in message
    assert f"{path}:{shown[0][0]}" in caplog.text and "bad records skipped so far: 8" in caplog.text


def test_each_bad_record_is_reported_once_then_counted(tmp_path, hf_tokenizer, caplog):
    lines = [GOOD, '{"messages": []}', GOOD, '{"conversations": []}', GOOD]
    path = write_jsonl(tmp_path / "two_bad.jsonl", lines)
    loader = make_loader(path, hf_tokenizer, max_bad_fraction=1.0, local_batch_size=1, packing="pad", shuffle=True)
    with caplog.at_level(logging.WARNING, logger="llm_training.data.dataloader"):
        while loader.epoch < 3:  # three passes over the same two bad records
            loader.next_batch()
    assert loader.counters["bad_records"] >= 6  # counted on every pass
    reports = [r.getMessage() for r in caplog.records if "skipping bad record" in r.getMessage()]
    assert sorted(reports) == [
        f"data rank 0: skipping bad record {path}:2: no 'conversations' field (keys: ['messages'])",
        f"data rank 0: skipping bad record {path}:4: conversations is empty",
    ]
    summaries = [r.getMessage() for r in caplog.records if "bad records skipped so far" in r.getMessage()]
    assert summaries == ["data rank 0: bad records skipped so far: 2 (2 not seen before in this epoch)"]


@pytest.mark.parametrize("line_index", range(len(BAD_LINES)))
def test_fail_policy_raises_with_file_line_and_reason(line_index, tmp_path, hf_tokenizer):
    bad, words = list(BAD_LINES.items())[line_index]
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, bad, GOOD])
    loader = make_loader(path, hf_tokenizer, bad_record_policy="fail", local_batch_size=4)
    with pytest.raises(BadRecordError, match=rf"{path}:3: .*{words}"):
        loader.next_batch()


def test_bad_fraction_threshold(tmp_path, hf_tokenizer):
    # 100 records, every 10th bad: 10% bad
    lines = ["{broken" if i % 10 == 9 else GOOD for i in range(100)]
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    with pytest.raises(BadRecordError, match=r"10 of 100 records .* max_bad_fraction=0.05"):
        _drain_epoch(make_loader(path, hf_tokenizer, max_bad_fraction=0.05, local_batch_size=4))
    loader = make_loader(path, hf_tokenizer, max_bad_fraction=0.1, local_batch_size=4)
    _drain_epoch(loader)  # exactly at the threshold passes
    assert loader.counters["bad_records"] == 10


def test_bad_fraction_checked_at_epoch_end_for_small_data(tmp_path, hf_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, "{broken", GOOD, GOOD])
    with pytest.raises(BadRecordError, match=r"1 of 4 records"):
        _drain_epoch(make_loader(path, hf_tokenizer, max_bad_fraction=0.2, local_batch_size=1))


def test_nothing_trainable(tmp_path, hf_tokenizer):
    path = write_jsonl(tmp_path / "bad.jsonl", ["{broken", '{"conversations": []}'])
    with pytest.raises(BadRecordError, match="nothing trainable"):
        make_loader(path, hf_tokenizer, max_bad_fraction=1.0).next_batch()
    long_path = write_jsonl(tmp_path / "long.jsonl", [chat(("user", "q " * 50), ("assistant", "a"))])
    with pytest.raises(BadRecordError, match="nothing trainable.*1 over-long dropped"):
        make_loader(long_path, hf_tokenizer, seq_len=16, overlong="drop").next_batch()


def test_empty_files(tmp_path, hf_tokenizer, caplog):
    folder = tmp_path / "data"
    write_jsonl(folder / "a.jsonl", numbered_samples(3))
    (folder / "b.jsonl").write_text("")
    write_jsonl(folder / "sub" / "c.jsonl", numbered_samples(2))
    with caplog.at_level(logging.WARNING, logger="llm_training.data.dataloader"):
        loader = make_loader(folder, hf_tokenizer)
    assert f"{folder / 'b.jsonl'} is empty" in caplog.text
    assert len(loader.source) == 5
    with pytest.raises(BadRecordError, match=rf"{folder / 'b.jsonl'}: empty file"):
        make_loader(folder, hf_tokenizer, bad_record_policy="fail")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(BadRecordError, match="no records"):
        make_loader(empty, hf_tokenizer)


@pytest.mark.parametrize("scan_chunk", [3, 1 << 26])
def test_blank_and_crlf_lines_keep_true_line_numbers(scan_chunk, tmp_path, monkeypatch):
    monkeypatch.setattr("llm_training.data.records.SCAN_CHUNK_BYTES", scan_chunk)
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\n{"conversations": []}\r\n\r\n{broken\n[1]')
    records = open_records(path, "conversations", "train")
    fetched = records.fetch(range(len(records)))
    assert [loc for loc, _ in fetched] == [f"{path}:2", f"{path}:4", f"{path}:5"]
    assert fetched[0][1] == [] and "malformed JSON" in fetched[1][1].reason and "JSON list" in fetched[2][1].reason


def test_missing_paths_fail_at_start_up(tmp_path, hf_tokenizer):
    with pytest.raises(FileNotFoundError, match=r"dataset_path: .*nope.jsonl' does not exist"):
        open_records(tmp_path / "nope.jsonl", "conversations", "train")
    (tmp_path / "folder").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.jsonl files"):
        open_records(tmp_path / "folder", "conversations", "train")
    with pytest.raises(FileNotFoundError, match="tokenizer_path: .*is not a directory"):
        build_tokenizer(tmp_path / "no_tokenizer")


@pytest.mark.parametrize(("key", "message"), [("chat_template", "has no chat template"), ("pad_token", "no pad_token")])
def test_tokenizer_without_chat_template_or_pad_fails(key, message, tmp_path):
    import json

    copy = shutil.copytree(BUNDLED_TOKENIZER_PATH, tmp_path / "tok")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = json.loads((copy / name).read_text())
        config.pop(key, None)
        (copy / name).write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        build_tokenizer(copy)


def test_template_errors_are_bad_records(tmp_path, hf_tokenizer):
    """A template that rejects some conversations (raise_exception) makes them bad records with file:line."""
    import copy

    from llm_training.data import ChatTokenizer

    strict = copy.deepcopy(hf_tokenizer)
    strict.chat_template = (
        "{%- for m in messages %}{%- if m['role'] == 'system' %}{{ raise_exception('no system turns') }}{%- endif %}"
        "{%- endfor %}" + hf_tokenizer.chat_template
    )
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, chat(("system", "s"), ("user", "u"), ("assistant", "a")), GOOD])
    loader = make_loader(path, strict, max_bad_fraction=1.0, local_batch_size=1, packing="pad")
    _drain_epoch(loader)
    assert loader.counters["bad_records"] == 1
    assert loader.bad_examples[0].startswith(f"{path}:2: the chat template rejected the conversation")
    assert "no system turns" in loader.bad_examples[0]
    broken = copy.deepcopy(hf_tokenizer)
    broken.chat_template = "{{ raise_exception('always') }}"
    with pytest.raises(ValueError, match="cannot be used for chat training.*always"):
        ChatTokenizer(broken)
