"""Resuming the data loader on another number of data-parallel ranks: every record is trained exactly once
per epoch across any chain of layout changes (mid-epoch, across epoch ends, with rows left half-packed), and
the same layout still resumes to the exact uninterrupted batches."""

import json

import pytest
import torch
from data_helpers import chat, make_loader, numbered_samples, write_jsonl

import llm_training.data.dataloader as dataloader_module

NUM_RECORDS = 23


@pytest.fixture
def data_path(tmp_path):
    samples = numbered_samples(NUM_RECORDS)
    for i in (3, 9, 16):  # long ones: rows close at different times on different ranks
        samples[i] = chat(("user", "context " * 12), ("assistant", f"answer {i}"))
    return write_jsonl(tmp_path / "d.jsonl", samples)


@pytest.fixture
def trained_log(monkeypatch):
    """(epoch, record index) of every document in every batch returned, in order."""
    log = []
    real = dataloader_module.collate_rows

    def recording(rows, seq_len, pad_id):
        log.extend(doc.source for row in rows for doc in row)
        return real(rows, seq_len, pad_id)

    monkeypatch.setattr(dataloader_module, "collate_rows", recording)
    return log


def _loaders(path, hf_tokenizer, world):
    return [
        make_loader(path, hf_tokenizer, seq_len=48, local_batch_size=1, shuffle=True, shuffle_seed=5, dp_rank=r,
                    dp_world_size=world)
        for r in range(world)
    ]  # fmt: skip


def _saved(loaders):
    return json.loads(json.dumps([loader.rank_state() for loader in loaders]))  # as the checkpoint stores them


def _records(log, loader):
    return [(epoch, int(loader._order(epoch)[position])) for epoch, position in log]


def train_past_epoch_1(loaders) -> None:
    """Train every rank's loader on until each is in epoch 2 with nothing of epochs 0 and 1 left in its rows."""
    while any(s["epoch"] < 2 or any(src[0] < 2 for row in s["open_rows"] + s["ready_rows"] for src in row)
              for s in (loader.state_dict() for loader in loaders)):  # fmt: skip
        for loader in loaders:
            loader.next_batch()


@pytest.mark.parametrize("chain", [(1, 2), (2, 1), (2, 4), (3, 2, 5, 1)])
def test_every_record_once_per_epoch_across_layout_changes(chain, data_path, hf_tokenizer, trained_log):
    loaders = _loaders(data_path, hf_tokenizer, chain[0])
    for new_world in chain[1:]:
        for _ in range(3):
            for loader in loaders:
                loader.next_batch()
        saved = _saved(loaders)
        loaders = _loaders(data_path, hf_tokenizer, new_world)
        for loader in loaders:
            loader.load_rank_states(saved)
    train_past_epoch_1(loaders)
    trained = _records(trained_log, loaders[0])
    for epoch in (0, 1):
        records = sorted(r for e, r in trained if e == epoch)
        assert records == list(range(NUM_RECORDS)), (epoch, records)  # none repeated, none skipped
    later = [r for e, r in trained if e == 2]
    assert len(later) == len(set(later))


def test_same_layout_resumes_exactly(data_path, hf_tokenizer):
    loaders = _loaders(data_path, hf_tokenizer, 2)
    for _ in range(4):
        for loader in loaders:
            loader.next_batch()
    saved = _saved(loaders)
    expected = [[loader.next_batch() for _ in range(5)] for loader in loaders]
    resumed = _loaders(data_path, hf_tokenizer, 2)
    for loader in resumed:
        loader.load_rank_states(list(reversed(saved)))  # the order of the states does not matter
    for loader, batches in zip(resumed, expected):
        for batch in batches:
            got = loader.next_batch()
            assert all(torch.equal(got[k], batch[k]) for k in batch)


def test_elastic_resume_keeps_the_counter_totals(data_path, hf_tokenizer):
    loaders = _loaders(data_path, hf_tokenizer, 3)
    for _ in range(3):
        for loader in loaders:
            loader.next_batch()
    before = {k: sum(loader.stats[k] for loader in loaders) for k in ("records_seen", "documents", "rows")}
    saved = _saved(loaders)
    resumed = _loaders(data_path, hf_tokenizer, 2)
    for loader in resumed:
        loader.load_rank_states(saved)
    assert {k: sum(loader.stats[k] for loader in resumed) for k in before} == before


def test_other_shuffle_seed_is_refused(data_path, hf_tokenizer):
    loaders = _loaders(data_path, hf_tokenizer, 2)
    loaders[0].next_batch()
    loaders[1].next_batch()
    other = make_loader(data_path, hf_tokenizer, seq_len=48, local_batch_size=1, shuffle=True, shuffle_seed=6)
    with pytest.raises(ValueError, match="shuffle_seed was 5 in the checkpoint and is 6 now"):
        other.load_rank_states(_saved(loaders))


def test_incomplete_rank_states_are_refused(data_path, hf_tokenizer):
    loaders = _loaders(data_path, hf_tokenizer, 2)
    with pytest.raises(ValueError, match=r"data-parallel ranks \[0\] of 2"):
        loaders[0].load_rank_states(_saved(loaders)[:1])
