"""A converted model through the real trainer on 2 gloo ranks, FSDP2 x EP 2 (experts DTensor Shard(0) on the ep
mesh, FSDP2 over the rest), fp8_rowwise emulated: the first step's loss equals the single-process converted run
(the forward's scales are per token and per weight row, so splitting the batch over ranks does not change them),
and the next steps stay close (the weight-gradient scales run over each rank's own tokens)."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llm_training.config import ConfigManager
from llm_training.config.job_config import PACKAGE_DIR
from llm_training.distributed import ParallelDims
from llm_training.distributed.utils import destroy_process_group

STEPS = 3


def _config(dump_folder, run_name, ep):
    return ConfigManager().parse_args([
        "--job.config_file", str(PACKAGE_DIR / "motif" / "train_configs" / "debug_cpu.toml"),
        f"--job.dump_folder={dump_folder}", f"--job.run_name={run_name}", "--training.device=cpu",
        "--training.local_batch_size=1", "--training.global_batch_size=2", "--training.seq_len=32",
        f"--training.steps={STEPS}", "--training.deterministic", "--lr_scheduler.warmup_steps=1",
        "--checkpoint.enable=false", "--metrics.log_freq=1", f"--parallelism.expert_parallel_degree={ep}",
        "--quantize.recipe=fp8_rowwise",
    ])  # fmt: skip


def _worker(rank, world, port, dump_folder):
    from llm_training.distributed.utils import setup_distributed
    from llm_training.quantization.modules import LowPrecisionGroupedExperts, LowPrecisionLinear
    from llm_training.trainer import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=world, world_size=world)
        device, _ = setup_distributed("cpu", dims)
        trainer = Trainer(_config(dump_folder, "dist", world), dims, device)
        assert trainer.parallel.fsdp and trainer.converters
        modules = list(trainer.model.modules())  # FSDP2 subclasses the converted classes (FSDP<name>)
        assert any(isinstance(m, LowPrecisionLinear) for m in modules)
        assert any(isinstance(m, LowPrecisionGroupedExperts) for m in modules)
        result = trainer.fit()
        if rank == 0:
            torch.save(result.losses, os.path.join(dump_folder, "dist_losses.pt"))
    finally:
        destroy_process_group()


@pytest.mark.slow  # two trainer set-ups on 2 ranks plus a single-process run: ~40 s on an idle core
def test_fsdp2_and_expert_parallel_over_a_converted_model(free_port, tmp_path):
    from llm_training.trainer import train

    mp.spawn(_worker, args=(2, free_port, str(tmp_path)), nprocs=2, join=True)
    dist_losses = torch.load(tmp_path / "dist_losses.pt")
    single = train(
        _config(tmp_path, "single", 1), ParallelDims(1, -1, 1, 1, 1), torch.device("cpu")
    ).losses  # fmt: skip
    assert abs(dist_losses[1] - single[1]) < 1e-5, (dist_losses, single)
    for step in range(2, STEPS + 1):
        assert abs(dist_losses[step] - single[step]) < 2e-2, (step, dist_losses, single)
