"""Process-level distributed setup, done once per process, and the collectives helpers the trainer uses.

Setup order (the entrypoint calls `setup_distributed` once, after the config is validated):
    device = resolve_device(job_config.training.device)    # the GPU of LOCAL_RANK, or the CPU
    init_process_group(device)                              # torchrun: nccl on CUDA, gloo on CPU;
                                                            # one CUDA process: a 1-rank nccl group (FSDP2 needs one)
    parallel_dims.build_mesh(device.type)                   # once a process group exists
The trainer receives the device and the ParallelDims (with its mesh); nothing below re-derives them.

Also here: the gradient norm (`grad_norm`) over parameters that live on different device meshes (FSDP mesh, expert
mesh, replicated) and the clipping coefficient it gives (`clip_coefficient`, which the optimizers apply),
`to_device_async` (a small host tensor to the GPU without waiting for its queue), `all_reduce_` (a no-op without a
process group) and `destroy_process_group` (the one way to end a group).
"""

from __future__ import annotations

import gc
import logging
import math
import os
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from llm_training.errors import ConfigError

logger = logging.getLogger(__name__)


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_distributed() -> bool:
    """True under torchrun (or any launcher that sets RANK / WORLD_SIZE > 1)."""
    return "RANK" in os.environ or env_world_size() > 1


# the environment variables the CUDA caching allocator reads its settings from (torch >= 2.9 reads the first, and
# the second as its older name)
ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def apply_cuda_allocator_settings(settings: str) -> str | None:
    """Hand the CUDA caching allocator `settings` ([training] cuda_allocator) through PYTORCH_ALLOC_CONF, which it
    reads when CUDA starts in this process (and which child processes inherit). Returns the settings the allocator
    will use: the environment's own when it sets one of `ALLOC_CONF_VARIABLES` (they win), else `settings`; None for
    PyTorch's defaults (empty settings, or CUDA already started: then nothing can change them, and a warning says
    so)."""
    for name in ALLOC_CONF_VARIABLES:
        if os.environ.get(name):
            return os.environ[name]
    if not settings.strip():
        return None
    if torch.cuda.is_initialized():
        logger.warning(
            "[training] cuda_allocator = %r not applied: CUDA started before the trainer could set it; set "
            "PYTORCH_ALLOC_CONF in the environment instead",
            settings,
        )
        return None
    os.environ[ALLOC_CONF_VARIABLES[0]] = settings
    return settings


def resolve_device(wanted: str) -> torch.device:
    """The training device for `[training] device` ("auto" | "cpu" | "cuda"); on CUDA, the GPU of LOCAL_RANK
    (made the current device)."""
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError("[training] device = 'cuda' but no CUDA GPU is visible; use device = 'auto' or 'cpu'")
    if wanted == "cpu" or (wanted == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_process_group(device: torch.device) -> bool:
    """Initialise the default process group unless one exists; True when this call created it.

    Launched by torchrun: nccl on CUDA, gloo on CPU (rendezvous from the environment). A single CUDA process
    gets a 1-rank nccl group over an in-memory store, because FSDP2 (bf16 parameters with fp32 master
    weights, even on one GPU) needs one. A single CPU process gets none."""
    if dist.is_initialized():
        return False
    if launched_distributed():
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
        return True
    if device.type == "cuda":
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
        return True
    return False


def destroy_process_group() -> None:
    """Destroy the default process group, then run a garbage collection before the process goes on to exit.

    Why: after a gloo group had carried functional collectives (the expert-parallel all-to-alls), a process sometimes
    aborted at interpreter shutdown, after a run that had succeeded (SIGABRT, "terminate called without an active
    exception", no Python frame: CI's failure of tests/bench/test_bench_ep_dispatch.py). Two-rank gloo runs of the
    bench ended that way 9 times in 160 with `dist.destroy_process_group()` alone, 0 in 120 with the collection (and 0
    in 40 with a 50 ms pause instead). The group object keeps 10 Python references after the destroy once functional
    collectives ran (2 without), none from a garbage-collected container, so the collection does not free it; what it
    changes is not established, and the measured effect is why it is here. It lowers the rate, it does not end it: CI
    aborted that way once more on 2026-12-06 (the bench test now ends its ranks with `os._exit` once they pass)."""
    dist.destroy_process_group()
    gc.collect()


def setup_distributed(training_device: str, parallel_dims) -> tuple[torch.device, bool]:
    """Resolve the device, initialise the process group and build `parallel_dims`' mesh, each once.
    Returns (device, whether this call created the process group: the caller then destroys it at exit)."""
    device = resolve_device(training_device)
    created = init_process_group(device)
    if dist.is_initialized() and parallel_dims.world_mesh is None:
        parallel_dims.build_mesh(device.type)
    return device, created


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (a micro-batch's ids, a step's counts) on `device` without the host waiting for the device's
    queue. A plain `.to("cuda")` of a host tensor synchronizes the stream (torch copies pageable memory and then
    waits), which, called while the GPU still runs queued work (the optimizer step, a backward), leaves the GPU idle
    once it is done until the host launches more: pinned first, the copy is asynchronous (torch's caching host
    allocator keeps the pinned block until the copy has run)."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def all_reduce_(t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """In-place all-reduce over `group` (default: the world); a no-op without a process group."""
    if dist.is_initialized():
        dist.all_reduce(t, op=op, group=group)
    return t


# ---------------------------------------------------------------------------------------- gradient clipping
def _mesh_key(grad: torch.Tensor):
    """Grads that can share one foreach norm: plain tensors together, DTensors per (mesh, placements)."""
    if isinstance(grad, DTensor):
        return (grad.device_mesh, grad.placements)
    return None


def grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of the gradients of `params` (fp32 0-dim, on the device), launched without reading it (the
    caller reads it with the step's other numbers, in one wait for the device).

    Grads may live on different device meshes (FSDP2's, an expert-parallel mesh) or be plain tensors
    (parameters replicated on every rank, identical after their all-reduce). Each group of grads on the same
    mesh and placements gets one foreach norm; a DTensor group's norm is reduced over its own mesh
    (`full_tensor()` of the Partial result), a plain group's is local. The group norms combine as
    sqrt(sum of squares). (Design follows torchtitan's clip_grad_norm_; see THIRD_PARTY_NOTICES.md.)"""
    by_mesh: dict = defaultdict(list)
    for p in params:
        if p.grad is not None:
            by_mesh[_mesh_key(p.grad)].append(p.grad)
    if not by_mesh:
        return torch.zeros(())
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norms.append(norm.float())
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))


def clip_coefficient(norm_value: float, max_norm: float) -> float:
    """The factor that brings gradients of global norm `norm_value` (read on the host) to at most `max_norm`:
    torch's `max_norm / (norm + 1e-6)`, clamped at 1; 1 when `max_norm` is 0 (no clipping) or the norm is not finite.
    The optimizers apply it in their own passes over the gradients (`OptimizersContainer.step(grad_scale=)`), so
    clipping costs no pass of its own: torch's `clip_grads_with_norm_` multiplied every gradient in place, 8.5 ms
    of the 849 ms proxy_16e step on one H100 (session 40's profile), and by 1 on steps within the norm."""
    if max_norm > 0 and math.isfinite(norm_value):
        return min(1.0, max_norm / (norm_value + 1e-6))
    return 1.0
