"""jsonl vs save_to_disk inputs, build_dataloader from a JobConfig, the bundled tokenizer and demo data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm_training.data import (
    BUNDLED_TOKENIZER_PATH,
    DEMO_DATA_PATH,
    ChatTokenizer,
    build_dataloader,
    open_records,
    validate_conversation,
)

from data_helpers import chat, make_loader, numbered_samples, write_jsonl

REPO = Path(__file__).resolve().parents[2]


def _samples():
    samples = numbered_samples(23)
    samples[4] = chat(("system", "sys"), ("user", "ünï 😀"), ("assistant", ""), ("user", "again"), ("assistant", "ok"))
    samples[9] = {"conversations": [{"role": "user", "content": "no answer"}]}  # bad: no assistant turn
    return samples


def _batches(loader, n):
    return [loader.next_batch() for _ in range(n)]


def test_jsonl_and_save_to_disk_give_the_same_batches(tmp_path, hf_tokenizer):
    datasets = pytest.importorskip("datasets")
    samples = _samples()
    jsonl = write_jsonl(tmp_path / "d.jsonl", samples)
    datasets.Dataset.from_list(samples).save_to_disk(str(tmp_path / "ds"))
    splits = {"train": datasets.Dataset.from_list(samples[:5]), "validation": datasets.Dataset.from_list(samples)}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dsd"))
    kwargs = dict(
        seq_len=64, local_batch_size=2, shuffle=True, shuffle_seed=5, dp_rank=1, dp_world_size=2, max_bad_fraction=1.0
    )
    reference = _batches(make_loader(jsonl, hf_tokenizer, **kwargs), 12)
    for path, split in ((tmp_path / "ds", "train"), (tmp_path / "dsd", "validation")):
        loader = make_loader(path, hf_tokenizer, split=split, **kwargs)
        for expected, got in zip(reference, _batches(loader, 12)):
            for key in expected:
                assert torch.equal(expected[key], got[key]), (path, key)
        assert loader.counters["bad_records"] >= 1
        assert any(f"row 9: no assistant turn" in m for m in loader.bad_examples)
    with pytest.raises(KeyError, match=r"split: 'test' is not in .*\['train', 'validation'\]"):
        open_records(tmp_path / "dsd", "conversations", "test")
    with pytest.raises(KeyError, match="conversations_field: 'messages' is not a column"):
        open_records(tmp_path / "ds", "messages", "train")


def test_build_dataloader_from_job_config(hf_tokenizer):
    config = pytest.importorskip("llm_training.config")
    job = config.JobConfig()
    job.training.dataset_path = str(DEMO_DATA_PATH)
    job.training.seq_len = 128
    job.training.local_batch_size = 3
    loaders = [build_dataloader(job, hf_tokenizer, rank, 2) for rank in range(2)]
    batches = [loader.next_batch() for loader in loaders]
    for batch in batches:
        assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids", "real_tokens"}
        assert all(v.shape == (3, 128) for k, v in batch.items() if k != "real_tokens")
        assert batch["real_tokens"].shape == (3,) and (batch["real_tokens"] <= 128).all()
    assert not torch.equal(batches[0]["input_ids"], batches[1]["input_ids"])
    job.training.dataset = "c4"
    with pytest.raises(ValueError, match="dataset = 'c4'"):
        build_dataloader(job, hf_tokenizer, 0, 1)


def test_bundled_tokenizer(hf_tokenizer, raw_tokenizer):
    assert len(hf_tokenizer) <= 2048 and raw_tokenizer.get_vocab_size() <= 2048
    assert hf_tokenizer.chat_template
    assert (hf_tokenizer.bos_token, hf_tokenizer.eos_token, hf_tokenizer.pad_token) == (
        "<|bos|>",
        "<|im_end|>",
        "<|pad|>",
    )
    text = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|bos|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # special tokens are single ids; byte-level BPE round-trips arbitrary unicode
    assert raw_tokenizer.encode("<|im_start|><|im_end|>", add_special_tokens=False).ids == [2, 3]
    for s in ("ünï 😀 猫", "12 + 7 = 19.", " spaces  and\ttabs\n"):
        assert hf_tokenizer.decode(hf_tokenizer(s, add_special_tokens=False)["input_ids"]) == s
    # digits are one token each (the arithmetic demo tasks rely on it)
    assert len(raw_tokenizer.encode("1234567890", add_special_tokens=False).ids) == 10
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (BUNDLED_TOKENIZER_PATH / name).is_file()


def test_demo_data_is_valid_and_reproducible(tmp_path, hf_tokenizer):
    assert DEMO_DATA_PATH.stat().st_size < 2_000_000
    lines = DEMO_DATA_PATH.read_text(encoding="utf-8").splitlines()
    assert 2000 <= len(lines) <= 10000
    conversations = [validate_conversation(json.loads(line)["conversations"]) for line in lines]
    assert any(c[0]["role"] == "system" for c in conversations)
    assert any(sum(m["role"] == "assistant" for m in c) > 1 for c in conversations)
    assert any(len(c) == 1 and c[0]["role"] == "assistant" for c in conversations)
    chat_tok = ChatTokenizer(hf_tokenizer)
    lengths = [len(t.ids) for t in chat_tok.tokenize([chat_tok.split(c) for c in conversations[:300]])]
    assert max(lengths) < 256  # every sample fits the default seq_len
    out = tmp_path / "demo.jsonl"
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_demo_data.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    assert out.read_bytes() == DEMO_DATA_PATH.read_bytes()
