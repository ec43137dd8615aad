"""Entrypoint: `python -m llm_training.train --job.config_file X.toml [--section.key=value ...]`.

Also runs under torchrun (`torchrun --nproc_per_node N -m llm_training.train ...`). Order of work:
parse + validate the config (no torch.distributed, no GPU yet) -> set up logging -> init the process
group when launched by torchrun (nccl on CUDA, gloo on CPU) -> ParallelDims + device mesh -> report the
flavor's size and FLOPs -> write the resolved config to <dump_folder>/<run_name>/config.toml -> run().
Exit codes: 0 success, 2 configuration error.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch

from llm_training.config import (
    ConfigError,
    ConfigManager,
    JobConfig,
    grad_accumulation_steps,
    to_toml,
    validate_environment,
    validate_for_world_size,
)
from llm_training.distributed import ParallelDims
from llm_training.motif import get_flavor, param_counts, training_flops_per_token

logger = logging.getLogger("llm_training")


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_distributed() -> bool:
    """True under torchrun (or any launcher that sets RANK / WORLD_SIZE > 1)."""
    return "RANK" in os.environ or env_world_size() > 1


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


def resolve_device(job_config: JobConfig) -> torch.device:
    """The training device from [training] device; on CUDA, the GPU of LOCAL_RANK."""
    wanted = job_config.training.device
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError("[training] device = 'cuda' but no CUDA GPU is visible; use device = 'auto' or 'cpu'")
    if wanted == "cpu" or (wanted == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(device: torch.device) -> None:
    if launched_distributed() and not torch.distributed.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        torch.distributed.init_process_group(backend=backend, **kwargs)


def log_model_summary(job_config: JobConfig) -> None:
    """Parameter counts and training FLOPs/token of the flavor (from the args, nothing is built)."""
    args = get_flavor(job_config.model.flavor)
    counts = param_counts(args)
    seq = job_config.training.seq_len
    logger.info(
        "model %s: total params %s (+ MTP %s), active params/token %s; training FLOPs/token at seq %d: "
        "%.4g (megatron), %.4g (torchtitan)",
        job_config.model.flavor,
        f"{counts.total:,}",
        f"{counts.mtp:,}",
        f"{counts.active:,}",
        seq,
        training_flops_per_token(args, seq, "megatron"),
        training_flops_per_token(args, seq, "torchtitan"),
    )


def write_resolved_config(job_config: JobConfig) -> Path:
    """Write the resolved config to <dump_folder>/<run_name>/config.toml (it loads back as the same config)."""
    path = job_config.run_folder / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(job_config), encoding="utf-8")
    return path


def run(job_config: JobConfig, parallel_dims: ParallelDims) -> None:
    """The training job proper, after setup: log the batch layout, then train (llm_training.trainer)."""
    from llm_training.trainer import train  # heavy imports (model, data, optimizer) only once config is valid

    accum = grad_accumulation_steps(job_config, parallel_dims.dp_size)
    t = job_config.training
    tokens_per_step = t.local_batch_size * parallel_dims.dp_size * accum * t.seq_len
    logger.info(
        "layout: dp_replicate %d x dp_shard %d x cp %d (ep %d) on %d ranks; %d sequences/rank x %d accumulation "
        "steps -> %s tokens per optimizer step, %d steps",
        parallel_dims.dp_replicate,
        parallel_dims.dp_shard,
        parallel_dims.cp,
        parallel_dims.ep,
        parallel_dims.world_size,
        t.local_batch_size,
        accum,
        f"{tokens_per_step:,}",
        t.steps,
    )
    train(job_config, parallel_dims)


def main(argv: list[str] | None = None) -> int:
    rank = env_rank()
    try:
        job_config = ConfigManager().parse_args(argv)
        if job_config.job.print_config:
            job_config.job.print_config = False  # the printed TOML is itself a usable config file
            if rank == 0:
                print(to_toml(job_config), end="")
            return 0
        parallel_dims = validate_for_world_size(job_config, env_world_size())
        validate_environment(job_config)  # hardening: data, tokenizer, optional packages (exit 2, before dist)
        init_logging(rank)
        device = resolve_device(job_config)
    except ConfigError as e:
        if rank == 0:
            print(f"config error: {e}", file=sys.stderr)
        return 2
    init_distributed(device)
    try:
        if torch.distributed.is_initialized():
            parallel_dims.build_mesh(device.type)  # single process: no process group, world_mesh stays None
        if job_config.job.description:
            logger.info("run %s: %s", job_config.job.run_name, job_config.job.description)
        log_model_summary(job_config)
        if rank == 0:
            logger.info("resolved config written to %s", write_resolved_config(job_config))
        run(job_config, parallel_dims)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
