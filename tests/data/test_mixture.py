"""Data mixtures (data/mixture.py): rows drawn by weight, deterministic given the seed, exact resume on the same
layout, every record of every source once per epoch across a change of layout, the per-source epochs policy, and
streamed / parquet sources."""

import json

import pytest
import torch
from data_helpers import chat, make_loader, numbered_samples, write_jsonl

from llm_training.data import ChatDocumentSource, ChatTokenizer, MixtureLoader, MixtureSpent, PackedDataLoader
from llm_training.data.records import open_records
from tests.data.test_elastic_data_position import train_past_epoch_1

SIZES = {"a": 17, "b": 9}


@pytest.fixture
def paths(tmp_path):
    out = {}
    for name, n in SIZES.items():
        samples = [
            chat(("user", f"{name} question {i} " + "y" * (i % 5)), ("assistant", f"{name} {i}")) for i in range(n)
        ]
        samples[2] = chat(("user", "context " * 10), ("assistant", f"{name} long"))  # rows close unevenly
        out[name] = write_jsonl(tmp_path / f"{name}.jsonl", samples)
    return out


def mixture(paths, hf_tokenizer, weights=(3.0, 1.0), *, epochs=(0, 0), world=1, rank=0, seed=7, prefetch=0):
    loaders = [
        make_loader(path, hf_tokenizer, seq_len=48, local_batch_size=2, shuffle=True, shuffle_seed=seed, dp_rank=rank,
                    dp_world_size=world, prefetch_batches=0, max_epochs=e)
        for path, e in zip(paths.values(), epochs)
    ]  # fmt: skip
    return MixtureLoader(loaders, list(paths), list(weights), seed=seed, local_batch_size=2, prefetch_batches=prefetch)


@pytest.fixture
def trained_log(monkeypatch):
    """(source file stem, epoch, record index) of every document of every row the source loaders return."""
    log, real = [], PackedDataLoader.next_row

    def recording(self):
        row = real(self)
        log.extend(
            (self.source.records.files[0].stem, e, int(self._order(e)[g])) for doc in row for e, g in [doc.source]
        )
        return row

    monkeypatch.setattr(PackedDataLoader, "next_row", recording)
    return log


def _saved(loaders):
    return json.loads(json.dumps([loader.rank_state() for loader in loaders]))  # as the checkpoint stores them


def _source_ids(loader, batches=150):
    return torch.cat([loader.next_batch()["source_ids"] for _ in range(batches)])


def test_rows_follow_the_weights_and_the_seed(paths, hf_tokenizer):
    ids = _source_ids(mixture(paths, hf_tokenizer))
    assert 0.68 < (ids == 0).float().mean().item() < 0.82  # weight 3 of 4
    assert torch.equal(ids, _source_ids(mixture(paths, hf_tokenizer)))
    assert not torch.equal(ids, _source_ids(mixture(paths, hf_tokenizer, seed=8)))
    batch = mixture(paths, hf_tokenizer, weights=(1.0, 1e-9)).next_batch()
    assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids", "real_tokens", "source_ids"}
    assert batch["source_ids"].tolist() == [0, 0]


def test_resume_gives_the_uninterrupted_batches(paths, hf_tokenizer):
    """Prefetched iteration, a checkpoint between batches (states of both ranks), a restart: the same batches."""
    loaders = [mixture(paths, hf_tokenizer, world=2, rank=r, prefetch=2) for r in range(2)]
    for _ in range(7):
        for loader in loaders:
            next(loader)
    saved = _saved(loaders)
    expected = [[next(loader) for _ in range(12)] for loader in loaders]  # crosses epochs of both sources
    for rank, batches in enumerate(expected):
        resumed = mixture(paths, hf_tokenizer, world=2, rank=rank, prefetch=2)
        resumed.load_rank_states(list(reversed(saved)))
        for batch in batches:
            got = next(resumed)
            assert all(torch.equal(got[k], batch[k]) for k in batch)


@pytest.mark.parametrize("chain", [(2, 3), (3, 1, 2)])
def test_every_record_of_every_source_once_per_epoch_across_layouts(chain, paths, hf_tokenizer, trained_log):
    loaders = [mixture(paths, hf_tokenizer, world=chain[0], rank=r) for r in range(chain[0])]
    for new_world in chain[1:]:
        for _ in range(3):
            for loader in loaders:
                loader.next_batch()
        saved = _saved(loaders)
        loaders = [mixture(paths, hf_tokenizer, world=new_world, rank=r) for r in range(new_world)]
        for loader in loaders:
            loader.load_rank_states(saved)

    def pending_before_epoch_2(loader):
        return any(
            s["epoch"] < 2 or any(src[0] < 2 for row in s["open_rows"] + s["ready_rows"] for src in row)
            for s in loader.state_dict()["sources"]
        )

    while any(pending_before_epoch_2(loader) for loader in loaders):
        for loader in loaders:
            loader.next_batch()
    for name, n in SIZES.items():
        for epoch in (0, 1):
            records = sorted(r for s, e, r in trained_log if s == name and e == epoch)
            assert records == list(range(n)), (name, epoch, records)  # none repeated, none skipped


def test_a_source_leaves_after_its_epochs_and_the_mixture_ends(paths, hf_tokenizer, trained_log):
    loader = mixture(paths, hf_tokenizer, weights=(1.0, 5.0), epochs=(1, 2))
    batches = []
    with pytest.raises(MixtureSpent, match=r"a: 1, b: 2.*raise \[\[training.sources\]\] epochs"):
        while True:
            batches.append(loader.next_batch())
    for name, epochs in (("a", 1), ("b", 2)):
        for epoch in range(epochs):
            assert sorted(r for s, e, r in trained_log if s == name and e == epoch) == list(range(SIZES[name]))
        assert not [r for s, e, r in trained_log if s == name and e >= epochs]
    # b (weight 5) left first; then every row is a's
    ids = torch.cat([b["source_ids"] for b in batches]).tolist()
    last_b = max(k for k, i in enumerate(ids) if i == 1)
    assert set(ids[last_b + 1 :]) == {0} and ids[: last_b + 1].count(1) > ids[: last_b + 1].count(0)


def test_a_resume_needs_the_same_sources(paths, hf_tokenizer):
    loader = mixture(paths, hf_tokenizer)
    loader.next_batch()
    swapped = mixture(dict(reversed(paths.items())), hf_tokenizer)
    with pytest.raises(ValueError, match=r"sources are \['a', 'b'\] and the config's are \['b', 'a'\]"):
        swapped.load_rank_states(_saved([loader]))


def _stream_loader(path, hf_tokenizer, world, rank, prefetch=0):
    records = open_records(path, "conversations", "train", streaming=True, shuffle_buffer=4)
    source = ChatDocumentSource(records, ChatTokenizer(hf_tokenizer), seq_len=48)
    return PackedDataLoader(source, seq_len=48, local_batch_size=2, shuffle=True, shuffle_seed=3, dp_rank=rank,
                            dp_world_size=world, prefetch_batches=prefetch)  # fmt: skip


@pytest.fixture
def parquet_path(tmp_path, monkeypatch):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    # datasets sleeps 5 s whenever a parquet stream's iterator shuts down (apache/arrow#45214; harmless here), which
    # happens at every epoch end and restart of these tiny streams
    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)

    folder = tmp_path / "pq"
    folder.mkdir()
    samples = numbered_samples(23)
    for k, part in enumerate((samples[:10], samples[10:])):
        pq.write_table(pa.Table.from_pylist(part), folder / f"part-{k}.parquet")
    return folder


def _identity(hf_tokenizer, path):
    """Record index of each document's token ids (the records of a shuffled stream are known by their content)."""
    records = open_records(path, "conversations", "train")
    source = ChatDocumentSource(records, ChatTokenizer(hf_tokenizer), seq_len=48)
    return {tuple(o[2].input_ids): i for i, o in enumerate(source.documents(range(len(records))))}


def test_a_streamed_source_trains_every_record_once_per_epoch_and_resumes(parquet_path, hf_tokenizer, monkeypatch):
    """Parquet files read as a stream (buffer-shuffled, every rank keeping its positions): the same layout resumes
    to the same batches; three ranks continuing two ranks' position train the rest of the epoch, then whole epochs,
    every record once per epoch."""
    identity, log, real = _identity(hf_tokenizer, parquet_path), [], PackedDataLoader.next_row

    def recording(self):
        row = real(self)
        log.extend((doc.source[0], identity[tuple(doc.input_ids)]) for doc in row)
        return row

    monkeypatch.setattr(PackedDataLoader, "next_row", recording)
    loaders = [_stream_loader(parquet_path, hf_tokenizer, 2, r) for r in range(2)]
    for _ in range(3):
        for loader in loaders:
            loader.next_batch()
    saved, trained_before_save = _saved(loaders), len(log)
    expected = [[loader.next_batch() for _ in range(4)] for loader in loaders]
    for rank, batches in enumerate(expected):  # the stream is read again up to the saved position
        resumed = _stream_loader(parquet_path, hf_tokenizer, 2, rank, prefetch=2)
        resumed.load_rank_states(saved)
        for batch in batches:
            got = next(resumed)
            assert all(torch.equal(got[k], batch[k]) for k in batch)
        resumed.close()
    del log[trained_before_save:]
    loaders = [_stream_loader(parquet_path, hf_tokenizer, 3, r) for r in range(3)]
    for loader in loaders:
        loader.load_rank_states(saved)
    train_past_epoch_1(loaders)
    for epoch in (0, 1):
        assert sorted(r for e, r in log if e == epoch) == list(range(23)), epoch
    orders = [[r for e, r in log if e == epoch] for epoch in (0, 1)]
    assert orders[0] != orders[1]  # reshuffled per epoch
    assert loaders[0].state_dict()["stream_records"] == 23


def test_parquet_files_give_the_jsonl_batches(parquet_path, tmp_path, hf_tokenizer):
    jsonl = write_jsonl(tmp_path / "same.jsonl", numbered_samples(23))
    from_parquet = make_loader(parquet_path, hf_tokenizer, shuffle=True, shuffle_seed=2)
    from_jsonl = make_loader(jsonl, hf_tokenizer, shuffle=True, shuffle_seed=2)
    for _ in range(6):
        a, b = from_parquet.next_batch(), from_jsonl.next_batch()
        assert all(torch.equal(a[k], b[k]) for k in a)
    records = open_records(parquet_path, "conversations", "train")
    assert records.location(12) == f"{parquet_path / 'part-1.parquet'} row 2"
