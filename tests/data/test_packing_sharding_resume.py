"""Packing boundaries, DP sharding (no record lost or duplicated) and exact resumption of the loader."""

from __future__ import annotations

import json
import re

import pytest
import torch

from data_helpers import IGNORE, chat, make_loader, numbered_samples, reference_document, split_documents, write_jsonl


def _check_row_structure(batch: dict, pad_id: int) -> None:
    """Independent per-row checks: positions restart per document, labels -100 at every document's last token
    and on padding, MTP targets never cross documents."""
    ids_BS, labels_BS, pos_BS, doc_BS = (
        batch["input_ids"],
        batch["labels"],
        batch["position_ids"],
        batch["document_ids"],
    )
    assert ids_BS.dtype == labels_BS.dtype == pos_BS.dtype == torch.long
    B, S = ids_BS.shape
    for b in range(B):
        docs = doc_BS[b].tolist()
        assert docs[0] == 0 and all(d1 - d0 in (0, 1) for d0, d1 in zip(docs, docs[1:]))
        for t in range(S):
            new_doc = t == 0 or docs[t] != docs[t - 1]
            assert pos_BS[b, t] == (0 if new_doc else pos_BS[b, t - 1] + 1)
            last_of_doc = t == S - 1 or docs[t + 1] != docs[t]
            if last_of_doc or ids_BS[b, t] == pad_id:
                assert labels_BS[b, t] == IGNORE
            elif labels_BS[b, t] != IGNORE:
                assert labels_BS[b, t] == ids_BS[b, t + 1]
        # MTP targets: labels shifted by one more position stay inside the document of position t
        mtp = labels_BS[b, 1:].tolist() + [IGNORE]
        for t in range(S - 1):
            if mtp[t] != IGNORE:
                assert docs[t + 2] == docs[t]


def test_pack_rows_hold_whole_documents_first_fit(tmp_path, hf_tokenizer, raw_tokenizer):
    samples = numbered_samples(40)
    path = write_jsonl(tmp_path / "d.jsonl", samples)
    loader = make_loader(path, hf_tokenizer, seq_len=64, local_batch_size=3)
    emitted = []
    for _ in range(4):
        batch = loader.next_batch()
        _check_row_structure(batch, hf_tokenizer.pad_token_id)
        emitted += split_documents(batch)
    waiting = [(d.input_ids, d.labels) for row in [*loader.packer.open_rows, *loader.ready_rows] for d in row]
    # every document consumed so far is in an emitted row or still waiting, whole, exactly once
    consumed = [
        reference_document(raw_tokenizer, samples[i % 40]["conversations"])
        for i in range(loader.counters["records_seen"])
    ]
    assert sorted(emitted + waiting) == sorted(consumed)
    # first-fit fills the rows well: little padding in the emitted rows
    assert sum(len(ids) for ids, _ in emitted) / (12 * 64) > 0.8
    # each batch counts its rows' document tokens (the true throughput's numerator)
    batch = loader.next_batch()
    assert batch["real_tokens"].tolist() == [
        sum(len(ids) for ids, _ in split_documents({k: v[r : r + 1] for k, v in batch.items()})) for r in range(3)
    ]
    assert len(loader.packer.open_rows) <= 8


def _docs_of_rank(path, hf_tokenizer, rank, world, count, shuffle):
    # "pad" keeps the stream order in the rows, so the first `count` documents are epoch 0's shard
    loader = make_loader(
        path,
        hf_tokenizer,
        seq_len=96,
        local_batch_size=2,
        shuffle=shuffle,
        shuffle_seed=7,
        dp_rank=rank,
        dp_world_size=world,
        packing="pad",
    )
    docs = []
    while len(docs) < count:
        docs += split_documents(loader.next_batch())
    return docs[:count]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("shuffle", [False, True])
def test_ranks_cover_every_record_once_per_epoch(world, shuffle, tmp_path, hf_tokenizer, raw_tokenizer):
    n = 37  # not a multiple of the world size
    samples = numbered_samples(n)
    path = write_jsonl(tmp_path / "d.jsonl", samples)
    seen = []
    for rank in range(world):
        shard_size = len(range(rank, n, world))
        for ids, labels in _docs_of_rank(path, hf_tokenizer, rank, world, shard_size, shuffle):
            text = raw_tokenizer.decode([x for x in labels if x != IGNORE], skip_special_tokens=False)
            index = int(re.fullmatch(r"answer (\d+)<\|im_end\|>", text).group(1))
            assert (ids, labels) == reference_document(raw_tokenizer, samples[index]["conversations"])
            seen.append(index)
    assert sorted(seen) == list(range(n))


def test_epochs_reshuffle(tmp_path, hf_tokenizer, raw_tokenizer):
    n = 20
    path = write_jsonl(tmp_path / "d.jsonl", numbered_samples(n))
    docs = _docs_of_rank(path, hf_tokenizer, 0, 1, 2 * n, shuffle=True)
    order = [int(re.search(r"answer (\d+)", raw_tokenizer.decode(ids)).group(1)) for ids, _ in docs]
    assert sorted(order[:n]) == sorted(order[n:]) == list(range(n))
    assert order[:n] != order[n:] and order[:n] != list(range(n))


def _long_and_short_samples():
    # long samples are truncated to exactly seq_len, so the packer sometimes closes two rows at once
    samples = numbered_samples(13)
    for i in (2, 7, 11):
        samples[i] = chat(("user", "context " * 40), ("assistant", f"answer {i}"))
    return samples


@pytest.mark.parametrize("packing", ["pack", "pad"])
def test_resume_gives_the_uninterrupted_stream(packing, tmp_path, hf_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", _long_and_short_samples())
    kwargs = dict(
        seq_len=48, local_batch_size=1, packing=packing, shuffle=True, shuffle_seed=3, dp_rank=1, dp_world_size=2
    )
    loader = make_loader(path, hf_tokenizer, **kwargs)
    states, batches = [], []
    for _ in range(30):
        states.append(json.loads(json.dumps(loader.state_dict())))  # must survive a JSON round trip
        batches.append(loader.next_batch())
    assert loader.epoch >= 2  # the run wrapped epochs
    if packing == "pack":
        assert any(s["open_rows"] for s in states)
        assert any(s["ready_rows"] for s in states)
    for k in range(0, 30, 3):
        resumed = make_loader(path, hf_tokenizer, **kwargs)
        resumed.load_state_dict(states[k])
        for expected in batches[k : k + 4]:
            got = resumed.next_batch()
            for key in expected:
                assert torch.equal(got[key], expected[key]), (k, key)


def test_resume_rejects_a_different_setup(tmp_path, hf_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", numbered_samples(10))
    loader = make_loader(path, hf_tokenizer, dp_rank=0, dp_world_size=2)
    loader.next_batch()
    other = make_loader(path, hf_tokenizer, dp_rank=0, dp_world_size=1)
    with pytest.raises(ValueError, match="dp_world_size was 2 in the checkpoint and is 1 now"):
        other.load_state_dict(loader.state_dict())


def test_pad_mode_one_document_per_row(tmp_path, hf_tokenizer, raw_tokenizer):
    samples = numbered_samples(5)
    path = write_jsonl(tmp_path / "d.jsonl", samples)
    batch = make_loader(path, hf_tokenizer, seq_len=40, local_batch_size=5, packing="pad").next_batch()
    _check_row_structure(batch, hf_tokenizer.pad_token_id)
    for b in range(5):
        ids, labels = reference_document(raw_tokenizer, samples[b]["conversations"])
        assert batch["input_ids"][b, : len(ids)].tolist() == ids
        assert batch["labels"][b, : len(ids)].tolist() == labels
        assert set(batch["document_ids"][b].tolist()) == {0, 1}


def test_overlong_counters(tmp_path, hf_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", _long_and_short_samples())
    for overlong, key in (("truncate", "overlong_truncated"), ("drop", "overlong_dropped")):
        loader = make_loader(path, hf_tokenizer, seq_len=48, local_batch_size=1, packing="pad", overlong=overlong)
        while loader.counters["records_seen"] < 13:
            loader.next_batch()
        assert loader.counters[key] == 3
        assert loader.counters["documents"] == (13 if overlong == "truncate" else 10)


def test_first_fit_packer_rule():
    from llm_training.data import Document, RowPacker

    packer = RowPacker(seq_len=10, pack=True, open_rows=2)
    emitted = []
    for n, length in enumerate([6, 6, 3, 5, 4, 10, 2]):
        emitted += packer.add(Document([n] * length, [IGNORE] * length))
    # worked by hand: 6->A, 6->B, 3->A(9), 5: no room, close fullest A, ->C, 4->B full, 10->D full, 2->C
    assert [[doc.input_ids[0] for doc in row] for row in emitted] == [[0, 2], [1, 4], [5]]
    assert [[doc.input_ids[0] for doc in row] for row in packer.open_rows] == [[3, 6]]
    assert RowPacker(seq_len=10, pack=False).add(Document([1] * 3, [IGNORE] * 3))[0][0].input_ids == [1, 1, 1]


def test_prefetched_iteration_matches_and_checkpoints_exactly(tmp_path, hf_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", _long_and_short_samples())
    kwargs = dict(seq_len=48, local_batch_size=2, shuffle=True, shuffle_seed=1)
    sync = make_loader(path, hf_tokenizer, prefetch_batches=0, **kwargs)
    expected, expected_states = [], []
    for _ in range(12):
        expected.append(next(sync))
        expected_states.append(sync.state_dict())
    loader = make_loader(path, hf_tokenizer, prefetch_batches=3, **kwargs)
    for k in range(6):
        batch = next(loader)
        assert all(torch.equal(batch[key], expected[k][key]) for key in batch)
        assert loader.state_dict() == expected_states[k]  # the thread is ahead, the state is not
    with pytest.raises(RuntimeError, match="use next"):
        loader.next_batch()
    loader.close()
    for k in range(6, 9):
        batch = next(loader)  # restarts the thread from the state of the last batch returned
        assert all(torch.equal(batch[key], expected[k][key]) for key in batch)
    loader.load_state_dict(expected_states[2])
    batch = next(loader)
    assert all(torch.equal(batch[key], expected[3][key]) for key in batch)
    loader.close()


def test_prefetch_raises_errors_in_order(tmp_path, hf_tokenizer):
    from llm_training.data import BadRecordError

    lines = numbered_samples(12)
    lines[9] = "{broken"
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    loader = make_loader(
        path, hf_tokenizer, packing="pad", local_batch_size=1, bad_record_policy="fail", prefetch_batches=4
    )
    for _ in range(9):
        next(loader)
    for _ in range(2):  # raised where it happened, and again on a later call
        with pytest.raises(BadRecordError, match=rf"{path}:10: malformed JSON"):
            next(loader)
    loader.close()
