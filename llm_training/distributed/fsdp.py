"""FSDP2 with summed gradients, and the gradient all-reduce of the parameters kept out of it.

`apply_fsdp(model, blocks, mesh, mp_policy, replicated_param_names, expert_modules, expert_mesh, embedding)` shards
the input embedding, every block, then the root (final norm, head, whatever no block holds), over `mesh` (1-D: FSDP;
2-D (replicate, shard): HSDP). The root stays unsharded after forward, so a loss can read the head weight directly.
The embedding is a group of its own because FSDP2 reduces a group's gradients through one flat fp32 buffer of the
group's size: with both [V, H] matrices that is 2 x 3.4 GiB at Motif-3's vocabulary, on every rank after the
backward, when the freed activations leave holes of one matrix's size (one H100, bench_vs_torchtitan --size
proxy_16e, session 20: that 6.72 GiB request grew the reserve by 5.76 GiB with 16.9 GiB free; 74.3 -> 67.4 GiB
reserved with the split). Like the blocks, it is resharded after its forward (the model looks the trunk's and the
MTP modules' ids up in one call): its gathered bf16 [V, H] table (1.7 GiB at Motif-3's vocabulary, on every rank)
is not held through the loss, where the step's memory peaks. Its backward needs no table (a lookup's gradient reads
only the ids and the table's size): `set_unshard_in_backward(False)`, so no all-gather for it. Over a
one-rank shard dimension `parallelize_motif` keeps every other group gathered for the whole step (its gathers are
only casts; `ParallelizedModel.defer_grad_sync`) but still reshards the embedding (one H100, session 22: its table
was 1.68 GiB of the 66.4 GiB allocated at the peak of bench_vs_torchtitan's one-GPU proxy_16e step). Parameters named in
`replicated_param_names` stay out of FSDP2 (`ignored_params`): full, in their own dtype, on every rank;
`ReplicatedGradSync` all-reduces their gradients.

Expert parallelism: the expert modules (already DTensors on the EP mesh) are each their own FSDP2 group over
`expert_mesh` (`expert_parallel.expert_grad_mesh`: the ranks holding the same experts), sharded before the block
that contains them, so their gradients are summed over those ranks only, never over the EP ranks.

Gradients are SUMMED over data ranks, never averaged: the losses are already normalised by the global
labelled-token count (trainer/losses.py). FSDP2 is told so with `set_gradient_divide_factor(1)` and SUM-only
collectives (gloo has no PREMUL_SUM), over any mesh of more than one rank (`_sum_gradients`; over one rank the sum is
the gradient, and a factor would only cost a division).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


def apply_fsdp(
    model: nn.Module,
    blocks: list[nn.Module],
    mesh,
    mp_policy,
    replicated_param_names: list[str],
    expert_modules: list[nn.Module] = (),
    expert_mesh=None,
    embedding: nn.Module | None = None,
) -> None:
    """fully_shard each expert module over `expert_mesh`, then `embedding`, each block and the root over `mesh`;
    the named parameters are left out (replicated). Every group's gradients are summed over its mesh
    (`_sum_gradients`)."""
    from torch.distributed.fsdp import fully_shard

    ignored = {model.get_parameter(name) for name in replicated_param_names}
    if expert_modules and expert_mesh is None:
        raise ValueError("apply_fsdp: expert modules given without the expert mesh to shard them over")

    def shard(module: nn.Module, over) -> None:
        fully_shard(module, mesh=over, mp_policy=mp_policy, ignored_params=ignored & set(module.parameters()))
        _sum_gradients(module, over)

    for experts in expert_modules:  # inner groups first: each lies inside one of the blocks
        shard(experts, expert_mesh)
    if embedding is not None:
        shard(embedding, mesh)
        # a lookup's backward reads the ids and the table's size, never the table: no all-gather for it
        embedding.set_unshard_in_backward(False)
    for block in blocks:
        shard(block, mesh)
    shard(model, mesh)


def _sum_gradients(module: nn.Module, mesh) -> None:
    """FSDP2 sums `module`'s gradients over `mesh` (divide factor 1, SUM-only collectives) instead of averaging.

    Over a one-rank mesh the sum is the gradient itself, and no factor is set: given one, FSDP2's one-rank path
    (torch 2.11-2.13, `foreach_reduce`) copies `input / factor`, a division into a temporary the size of the group's
    gradients in the reduce dtype (3.4 GiB fp32 for Motif-3's embedding) and one more pass over them, per step and
    group (one H100, proxy_16e, session 36: 2.4 ms per step for each [V, H] group alone)."""
    if not (hasattr(module, "set_gradient_divide_factor") and hasattr(module, "set_force_sum_reduction_for_comms")):
        raise RuntimeError(
            f"torch {torch.__version__}: FSDP2 lacks set_gradient_divide_factor / "
            "set_force_sum_reduction_for_comms, which llm_training needs for summed gradients (torch >= 2.11)"
        )
    if mesh.size() > 1:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)


# the FSDPCommContext attributes (torch 2.11-2.13) of the streams that run FSDP2's gradient reduction
REDUCE_STREAMS = ("reduce_scatter_stream", "all_reduce_stream")


def reduce_on_compute_stream(model: nn.Module) -> None:
    """Make the FSDP2 root `model` (and every group under it) run its gradient reduction on the compute stream (the
    stream current at FSDP2's lazy init, the first forward) instead of its own reduce-scatter / all-reduce streams.

    For FSDP2 over one rank without replicas, where the "reduce-scatter" is local copies: the fp32 sharded
    gradients and the reduce-scatter buffers FSDP2 allocates on its side stream stay cached in that stream's pool
    after `zero_grad`, where the next forward cannot reuse them (by the code and the sizes: the ~23 GiB a one-H200
    motif3_proxy step reserves on a side stream with nothing allocated). On the compute stream that memory is reused;
    the copies no longer overlap the backward, which costs nothing measurable (bench_vs_torchtitan on one H200,
    session 14: 131.8 -> 115.2 GiB reserved, step 1618.2 -> 1619.2 ms). `parallelize_motif` applies it when the
    FSDP2 mesh is one rank; with several ranks the side stream overlaps real communication and stays."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        raise ValueError(
            f"reduce_on_compute_stream: {type(model).__name__} is not an FSDP2 module (one process applies FSDP2 on "
            "CUDA only)"
        )
    ctx = model._get_fsdp_state()._comm_ctx

    def move_to_compute_stream():
        missing = [name for name in REDUCE_STREAMS if not hasattr(ctx, name)]
        if missing:
            raise RuntimeError(f"torch {torch.__version__}: FSDP2's comm context has no {missing}")
        compute = ctx.device_handle.current_stream()
        for name in REDUCE_STREAMS:
            setattr(ctx, name, compute)

    if hasattr(ctx, "device_handle"):  # FSDP2's lazy init (the first forward) has run
        move_to_compute_stream()
        return
    lazy_init = ctx.lazy_init

    def lazy_init_then_move(device):
        lazy_init(device)
        move_to_compute_stream()

    ctx.lazy_init = lazy_init_then_move


@dataclass
class ReplicatedGradSync:
    """All-reduce (SUM, in fp32, one flat buffer) of the gradients of parameters kept out of FSDP2, over
    `group` (every rank that saw different data). Holds FQNs, not Parameter objects: `to_empty` / loading may
    replace the Parameter objects."""

    model: nn.Module
    param_names: list[str]
    group: object = None

    def __call__(self) -> None:
        if not self.param_names or dist.get_world_size(self.group) == 1:
            return
        params = [self.model.get_parameter(name) for name in self.param_names]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(g).to(p.dtype)
            offset += n
