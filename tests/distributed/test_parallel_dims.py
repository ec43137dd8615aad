"""ParallelDims: degree resolution and checks, rank arithmetic, and real meshes on 2 gloo processes."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llm_training.config import ConfigError
from llm_training.distributed import ParallelDims
from llm_training.distributed.utils import destroy_process_group


def test_minus_one_takes_the_rest():
    d = ParallelDims(dp_replicate=2, dp_shard=-1, cp=2, ep=1, world_size=16)
    assert d.dp_shard == 4 and d.dp_size == 8
    assert d.dp_enabled and d.fsdp_enabled and d.cp_enabled and not d.ep_enabled and d.dp_replicate_enabled


def test_single_process_has_nothing_enabled():
    d = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=1)
    assert (d.dp_shard, d.dp_size) == (1, 1)
    assert not (d.dp_enabled or d.fsdp_enabled or d.cp_enabled or d.ep_enabled)


def test_cp_alone_still_shards_parameters():
    d = ParallelDims(dp_replicate=1, dp_shard=1, cp=2, ep=1, world_size=2)
    assert d.fsdp_enabled and not d.dp_enabled and d.dp_size == 1


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(dp_replicate=1, dp_shard=3, cp=1, ep=1, world_size=4), "must equal the world size 4"),
        (dict(dp_replicate=3, dp_shard=-1, cp=1, ep=1, world_size=4), "not divisible"),
        (dict(dp_replicate=1, dp_shard=2, cp=2, ep=8, world_size=4), "expert_parallel_degree = 8 must divide"),
        (dict(dp_replicate=1, dp_shard=2, cp=1, ep=0, world_size=2), "expert_parallel_degree must be >= 1"),
        (dict(dp_replicate=1, dp_shard=0, cp=1, ep=1, world_size=2), "data_parallel_shard_degree must be -1"),
    ],
)
def test_bad_layouts(kwargs, needle):
    with pytest.raises(ConfigError) as e:
        ParallelDims(**kwargs)
    assert needle in str(e.value)


def test_rank_arithmetic_matches_enumeration():
    d = ParallelDims(dp_replicate=2, dp_shard=4, cp=2, ep=4, world_size=16)
    # independent reference: enumerate ranks in row-major (replicate, shard, cp) order
    for rank, (r, s, c) in enumerate(itertools.product(range(2), range(4), range(2))):
        assert d.coords(rank) == (r, s, c)
        assert d.dp_rank(rank) == r * 4 + s
        assert d.cp_rank(rank) == c
        assert d.ep_rank(rank) == (s * 2 + c) % 4
    # the ranks of one EP group are consecutive and share a replica
    assert [d.ep_rank(r) for r in range(4)] == [0, 1, 2, 3]


# ---------------------------------------------------------------------- real meshes (2 gloo ranks)
LAYOUTS = [
    dict(dp_replicate=1, dp_shard=-1, cp=1, ep=2),
    dict(dp_replicate=1, dp_shard=1, cp=2, ep=2),
    dict(dp_replicate=2, dp_shard=1, cp=1, ep=1),
]


def _worker(rank: int, world_size: int, port: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        out = []
        for layout in LAYOUTS:
            d = ParallelDims(world_size=world_size, **layout)
            mesh = d.build_mesh("cpu")
            sizes = {n: mesh[n].size() for n in ("dp_replicate", "dp_shard", "cp", "dp", "dp_shard_cp")}
            local = {n: mesh[n].get_local_rank() for n in ("dp", "cp")}
            # sum of global ranks over the dp group, through a real collective on that dim's group
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=mesh["dp"].get_group())
            hsdp_shape = tuple(mesh["dp_replicate", "dp_shard_cp"].mesh.shape)  # the 2-D mesh HSDP uses
            # the EP mesh exists only with ep > 1; its "ep" ranks are the ones ep_rank() numbers
            ep = None if d.ep_mesh is None else (d.ep_mesh.mesh_dim_names, d.ep_mesh["ep"].get_local_rank())
            out.append((sizes, local, t.item(), hsdp_shape, ep))
        results[rank] = out
    finally:
        destroy_process_group()


def test_meshes_on_two_gloo_ranks(free_port):
    world_size = 2
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(world_size, free_port, results), nprocs=world_size, join=True)
    for rank in range(world_size):
        for layout, (sizes, local, dp_sum, hsdp_shape, ep) in zip(LAYOUTS, results[rank]):
            d = ParallelDims(world_size=world_size, **layout)
            assert sizes == {
                "dp_replicate": d.dp_replicate,
                "dp_shard": d.dp_shard,
                "cp": d.cp,
                "dp": d.dp_replicate * d.dp_shard,
                "dp_shard_cp": d.dp_shard * d.cp,
            }
            assert local == {"dp": d.dp_rank(rank), "cp": d.cp_rank(rank)}
            expected_sum = sum(r for r in range(world_size) if d.coords(r)[2] == d.coords(rank)[2])
            assert dp_sum == expected_sum
            assert hsdp_shape == (d.dp_replicate, d.dp_shard * d.cp)
            if d.ep == 1:
                assert ep is None
            else:
                assert ep == (("dp_replicate", "dp_shard_mod_ep", "ep"), d.ep_rank(rank))
