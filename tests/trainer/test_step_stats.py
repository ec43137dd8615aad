"""The trainer's once-per-step reduction of the model family's statistics: micro-batch accumulation by each
stat's op, then one SUM and one MAX all-reduce over the ranks (2 gloo processes), dtypes preserved."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llm_training.model_spec import StepStat
from llm_training.trainer.trainer import accumulate_stats, all_reduce_step
from llm_training.distributed.utils import destroy_process_group


def test_accumulate_sums_and_maxes_by_op():
    total = {}
    accumulate_stats(total, {"c": StepStat(torch.tensor([1.0, 2.0]), "sum"), "m": StepStat(torch.tensor([3.0]), "max")})
    accumulate_stats(total, {"c": StepStat(torch.tensor([4.0, 0.0]), "sum"), "m": StepStat(torch.tensor([1.0]), "max")})
    assert total["c"].value.tolist() == [5.0, 2.0] and total["m"].value.tolist() == [3.0]


def test_single_process_reduction_is_identity():
    sums, stats = all_reduce_step(torch.tensor([1.5, 0.0], dtype=torch.float64), {"m": StepStat(torch.ones(2), "max")})
    assert sums.tolist() == [1.5, 0.0] and stats["m"].tolist() == [1.0, 1.0] and stats["m"].dtype == torch.float32


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        counts = torch.tensor([[1.0, 2.0], [3.0, 4.0]]) * (rank + 1)  # [L, E] per rank
        logits = torch.tensor([10.0, -5.0, 0.25]) if rank == 0 else torch.tensor([2.0, 7.0, 0.5])
        stats = {"tokens_per_expert": StepStat(counts, "sum"), "max_logits": StepStat(logits, "max")}
        sums, reduced = all_reduce_step(torch.tensor([0.5, float(rank)], dtype=torch.float64), stats)
        out[rank] = (sums, reduced["tokens_per_expert"], reduced["max_logits"])
    finally:
        destroy_process_group()


def test_two_ranks_sum_and_max(free_port):
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(2, free_port, out), nprocs=2, join=True)
    for rank in range(2):
        sums, counts, logits = out[rank]
        assert sums.tolist() == [1.0, 1.0] and sums.dtype == torch.float64
        assert counts.tolist() == [[3.0, 6.0], [9.0, 12.0]] and counts.dtype == torch.float32
        assert logits.tolist() == [10.0, 7.0, 0.5] and logits.dtype == torch.float32
