"""SequenceLayout / cp_shard / cp_unshard: which positions each cp rank holds, and the round trip."""

import pytest
import torch

from llm_training.distributed.context_parallel.sharding import SequenceLayout, cp_shard, cp_unshard


def test_zigzag_rank_holds_chunk_c_and_its_mirror():
    positions = torch.arange(16).expand(2, 16)  # cp 2: 4 chunks of 4
    layout = SequenceLayout("zigzag", 2)
    assert cp_shard(positions, layout, 0)[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_shard(positions, layout, 1)[0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert [layout.owner(c) for c in range(4)] == [(0, 0), (1, 0), (1, 1), (0, 1)]


def test_contiguous_rank_holds_one_block():
    positions = torch.arange(12)[None]
    assert cp_shard(positions, SequenceLayout("contiguous", 3), 1)[0].tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_unshard_round_trip_on_every_per_token_tensor(kind, cp):
    layout = SequenceLayout(kind, cp)
    batch = {
        "input_ids": torch.randint(0, 100, (2, 32)),
        "document_ids": torch.randint(0, 3, (2, 32)).cumsum(1),
        "mtp_labels": torch.randint(0, 100, (2, 32)),
        "hidden": torch.randn(2, 32, 5),
    }
    for name, full in batch.items():
        shards = [cp_shard(full, layout, r) for r in range(cp)]
        assert all(s.shape[1] == 32 // cp for s in shards), name
        assert torch.equal(cp_unshard(shards, layout), full), name


def test_indivisible_sequence_is_rejected():
    with pytest.raises(ValueError, match="not divisible by the 8 chunks of the zigzag layout"):
        cp_shard(torch.zeros(1, 12), SequenceLayout("zigzag", 4), 0)


def test_shard_batch_keeps_this_ranks_tokens_and_the_whole_document_ids():
    from types import SimpleNamespace

    from llm_training.distributed.context_parallel import ContextParallelSplit, shard_batch
    from llm_training.motif.mtp import mtp_inputs
    from llm_training.trainer.batch import prepare_batch

    ids = torch.arange(16).view(2, 8)
    raw = {"input_ids": ids, "labels": ids + 100, "position_ids": ids % 8, "document_ids": ids // 5}
    batch = prepare_batch(raw, 1, mtp_inputs)
    assert shard_batch(None, batch) == (batch, None)
    split = ContextParallelSplit(SequenceLayout("zigzag", 2), 1, SimpleNamespace())
    local, docs = shard_batch(split, batch)
    assert torch.equal(docs, batch.document_ids)
    want = cp_shard(ids, SequenceLayout("zigzag", 2), 1)
    assert torch.equal(local.input_ids, want) and torch.equal(local.labels, want + 100)
    assert torch.equal(local.mtp_input_ids[0], cp_shard(batch.mtp_input_ids[0], SequenceLayout("zigzag", 2), 1))
