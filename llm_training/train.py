"""Entrypoint: `python -m llm_training.train --job.config_file X.toml [--section.key=value ...]`.

Also runs under torchrun (`torchrun --nproc_per_node N -m llm_training.train ...`). Order of work:
parse + validate the config (no torch.distributed, no GPU yet) -> the compiled-kernel caches into the run folder
(`[compile] cache_folder`; before anything imports flash-attn-4) -> set up logging -> the CUDA allocator's settings
(`[training] cuda_allocator`, before CUDA starts) -> `setup_distributed` (once:
device, process group (nccl on CUDA, gloo on CPU), device mesh) -> write the resolved config to
<dump_folder>/<run_name>/config.toml -> run() -> the trainer.
`--job.dry_run` replaces everything after validation with the dry run (llm_training/dry_run.py): the setup of
every rank on this one CPU process under a fake process group, and a memory report against the GPU's memory.
Exit codes: 0 success (dry run: fits), 2 configuration error, 3 dry run: does not fit.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from llm_training.config import (
    ConfigError,
    ConfigManager,
    JobConfig,
    to_toml,
    validate_environment,
    validate_for_world_size,
)
from llm_training.distributed import ParallelDims
from llm_training.distributed.compile import use_kernel_caches
from llm_training.distributed.utils import (
    apply_cuda_allocator_settings,
    destroy_process_group,
    env_rank,
    env_world_size,
    setup_distributed,
)

logger = logging.getLogger("llm_training")


def init_logging(rank: int) -> None:
    """INFO on rank 0, WARNING elsewhere (LOG_ALL_RANKS=1 shows INFO from every rank)."""
    level = logging.INFO if rank == 0 or os.environ.get("LOG_ALL_RANKS") == "1" else logging.WARNING
    logging.basicConfig(
        level=level,
        format=f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
        force=True,
    )


def write_resolved_config(job_config: JobConfig) -> Path:
    """Write the resolved config to <dump_folder>/<run_name>/config.toml (it loads back as the same config)."""
    path = job_config.run_folder / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(job_config), encoding="utf-8")
    return path


def run(job_config: JobConfig, parallel_dims: ParallelDims, device: torch.device) -> None:
    """The training job proper, after setup (llm_training.trainer; it logs the batch layout)."""
    from llm_training.trainer import train  # heavy imports (model, data, optimizer) only once config is valid

    train(job_config, parallel_dims, device)


def main(argv: list[str] | None = None) -> int:
    rank = env_rank()
    try:
        job_config = ConfigManager().parse_args(argv)
        if job_config.job.print_config:
            job_config.job.print_config = False  # the printed TOML is itself a usable config file
            if rank == 0:
                print(to_toml(job_config), end="")
            return 0
        if job_config.job.dry_run:  # set up every rank on this CPU, report the memory, exit 0 / 3 (fits / not)
            from llm_training.dry_run import dry_run

            return dry_run(job_config)
        parallel_dims = validate_for_world_size(job_config, env_world_size())
        c = job_config.compile  # the caches before validate_environment, which may import flash-attn-4
        caches = use_kernel_caches(job_config.run_folder / c.cache_folder if c.cache_folder else None)
        validate_environment(job_config)  # data, tokenizer, optional packages: exit 2, before any setup
        init_logging(rank)
        logger.info("compiled-kernel caches: %s", ", ".join(f"{k}={v}" for k, v in caches.items()) or "the defaults")
        allocator = apply_cuda_allocator_settings(job_config.training.cuda_allocator)  # before CUDA starts
        logger.info("CUDA caching allocator: %s", allocator or "PyTorch's defaults")
        device, _ = setup_distributed(job_config.training.device, parallel_dims)
    except ConfigError as e:
        if rank == 0:
            print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        if job_config.job.description:
            logger.info("run %s: %s", job_config.job.run_name, job_config.job.description)
        if rank == 0:
            logger.info("resolved config written to %s", write_resolved_config(job_config))
        run(job_config, parallel_dims, device)
    finally:
        if dist.is_initialized():
            destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
