"""The trained-positions arithmetic (data/positions.py) against brute force: sets, pools and shards, with and
without a known number of records, and the merge of saved rank states."""

from hypothesis import given, settings
from hypothesis import strategies as st

from llm_training.data.positions import TrainedSet, merge_trained_positions, shard_positions, shard_size

N = 60
position_sets = st.sets(st.integers(0, N - 1), max_size=N)


def as_set(trained: TrainedSet) -> set[int]:
    return set(range(trained.prefix)) | set(trained.beyond.tolist())


@settings(max_examples=200, deadline=None)
@given(position_sets, position_sets, position_sets)
def test_union_and_without_are_the_set_operations(a, b, c):
    trained = TrainedSet.of(sorted(a)).union(sorted(b)).without(sorted(c))
    assert as_set(trained) == (a | b) - c
    assert all(p > trained.prefix for p in trained.beyond) and list(trained.beyond) == sorted(trained.beyond)
    assert as_set(TrainedSet.from_json(trained.to_json())) == as_set(trained)


@settings(max_examples=200, deadline=None)
@given(position_sets, st.integers(1, 5), st.data())
def test_shards_split_the_untrained_positions(trained_positions, world, data):
    trained = TrainedSet.of(sorted(trained_positions))
    pool = [p for p in range(N) if p not in trained_positions]
    assert trained.pool_size(N) == len(pool)
    for rank in range(world):
        shard = pool[rank::world]
        assert shard_size(trained, rank, world, N) == len(shard)
        assert shard_positions(trained, rank, world, 0, len(shard) + 3, N).tolist() == shard
        start = data.draw(st.integers(0, len(shard)))
        # a stream's length is unknown: the positions go on past N in the same pattern
        unbounded = shard_positions(trained, rank, world, start, start + 4, None).tolist()
        assert unbounded[: max(0, len(shard) - start)] == shard[start : start + 4]
    with_prefix = trained.with_pool_prefix(7)
    assert as_set(with_prefix) == set(trained_positions) | set(pool[:7]) | set(range(N, N + max(0, 7 - len(pool))))


def test_merge_counts_finished_shards_and_frees_pending_documents():
    """Two old ranks on 10 records: rank 0 finished epoch 0 (its 5 positions) and holds position 1 of epoch 1 in a
    row; rank 1 read 3 positions of epoch 0 and holds position 3 in a row."""
    states = [
        {"epoch": 1, "position": 1, "trained_before": {}, "open_rows": [[[1, 0]]], "ready_rows": []},
        {"epoch": 0, "position": 3, "trained_before": None, "open_rows": [[[0, 3]]], "ready_rows": []},
    ]
    first, trained = merge_trained_positions(states, 10)
    assert first == 0
    assert as_set(trained[0]) == {0, 2, 4, 6, 8} | {1, 5}  # rank 1's positions 1, 3, 5 minus the pending 3
    assert as_set(trained[1]) == set()  # rank 0's only epoch-1 record is still in a row
    # a stream: the length comes from a state that has read an epoch's end
    states[0]["stream_records"] = 10
    assert {e: as_set(t) for e, t in merge_trained_positions(states, None)[1].items()} == {
        e: as_set(t) for e, t in trained.items()
    }
    assert trained[0].prefix == 3 and trained[0].holes.tolist() == [3, 7]  # compact: a prefix and the gaps after it
