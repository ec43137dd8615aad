"""Dry run of a job on one machine (`--job.dry_run`): will it fit on its GPUs, before it is submitted?

The entrypoint calls `dry_run(job_config)` after config validation and INSTEAD of the real setup. It sets the job
up as it would run, for its full world size (`[job] dry_run_world_size`; 0: WORLD_SIZE when set, else the
product of the config's degrees), in this one CPU process: PyTorch's fake process group (every collective a
no-op) plays one rank at a time, the device mesh is the real one (`ParallelDims.build_mesh`), the model is built
on the meta device (no memory), converted (`quantization.apply_converters`), parallelized by the model family's
own `parallelize` (EP / CP / AC / compile / FSDP2, whatever the config asks) and its optimizers are built (no
step). No tokenizer, data, weights or GPU are touched.

It then prints, per rank, the GPU memory the step needs, from the real objects:
  * parameters: local elements and bytes by dtype, split into sharded (DTensor: FSDP2's fp32 master shards,
    stored padded to the largest shard, as FSDP2 allocates them) and replicated (plain fp32 tensors kept out of
    FSDP2); gradients: the same storage again for every trainable parameter (FSDP2 keeps sharded gradients in
    the parameter dtype);
  * optimizer state, per optimizer group: Muon's momentum (1 x the local shard), AdamW's two moments (2 x), in
    the parameter dtype (both create them with `zeros_like` of the local shard at the first step);
  * the FSDP2 transients: the root group (final norm, head) stays unsharded in the compute dtype for the whole
    step and its gradients unsharded through the backward (so does the input embedding's group where
    `parallelize` keeps it gathered; in one process both tables are plain fp32 parameters); the largest other
    FSDP2 group (a block, the embedding, or under expert parallelism a block's experts, a group of their own) is
    all-gathered twice over (the group computing and the one prefetched) and its gradients exist unsharded in the
    compute dtype plus the reduce-scatter input in the reduce dtype. Where FSDP2 shards over one rank
    (`ParallelizedModel.defer_grad_sync`) every group but the embedding is gathered once per step and stays
    gathered through it, so all of them count instead of two;
  * activations: the model family's estimate (`ModelSpec.activation_memory`; Motif-3's formula is in
    motif/activation_memory.py) at local_batch_size x seq_len / cp tokens and the configured activation
    checkpointing, plus the loss's buffers (trainer/losses.py: per loss head grad hidden [T, H] in the compute
    dtype, and one grad weight [V, H] fp32 for all heads (one shared pass), kept until the backward, the step's
    compute-dtype copy of a head kept out of FSDP2 in fp32 (one process), and one fp32 [chunk, V] logits block while
    it runs, over which the CUDA kernel writes its bf16 gradient);
    peak = saved + max(loss buffers + chunk, one block's recomputation).
Total = parameters + gradients + optimizer state + FSDP2 transients + activation peak, against
`[job] dry_run_gpu_memory_gib`. It does not count the CUDA context, NCCL buffers, kernel workspaces, Muon's
Newton-Schulz temporaries at the optimizer step (the activations are gone by then) or allocator fragmentation:
keep some headroom (a few GiB and ~5-10%).

The dry run models the job on CUDA GPUs: `parallelize` is told the device is CUDA (so a one-rank job gets its
one-rank FSDP2 in `[training] mixed_precision_param`, as on a GPU) while the mesh is a CPU one; with the model on
meta nothing is allocated on either. Ranks: rank 0 holds the largest shard of every FSDP2-sharded tensor (dim-0
ceil split) and the last rank the smallest, every other rank lies between, and no rank differs in its activations
(same local batch), so those two are set up and reported (one rank when the world has one).

Exit codes: 0 when every reported rank fits, DOES_NOT_FIT (3) when one does not; configuration errors raise
ConfigError (the entrypoint's exit code 2).
"""

from __future__ import annotations

import os
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from llm_training.config import ConfigError, validate_for_world_size
from llm_training.distributed import ParallelDims
from llm_training.distributed.activation_checkpoint import LONG_CONTEXT_MOE_CHUNK_TOKENS
from llm_training.distributed.utils import destroy_process_group

DOES_NOT_FIT = 3
GIB = 1 << 30


# ---------------------------------------------------------------------------------------- setup under a fake PG
def dry_run_world_size(job_config, environ=os.environ) -> int:
    """`[job] dry_run_world_size`, else WORLD_SIZE, else data_parallel_replicate x shard x context_parallel
    degrees (an error when data_parallel_shard_degree = -1 leaves the world size open)."""
    if job_config.job.dry_run_world_size > 0:
        return job_config.job.dry_run_world_size
    if "WORLD_SIZE" in environ:
        return int(environ["WORLD_SIZE"])
    p = job_config.parallelism
    if p.data_parallel_shard_degree == -1:
        raise ConfigError(
            "[job] dry_run needs the world size: set [job] dry_run_world_size (e.g. --job.dry_run_world_size=32), "
            "WORLD_SIZE, or an explicit [parallelism] data_parallel_shard_degree (it is -1: the rest of the world)"
        )
    return p.data_parallel_replicate_degree * p.data_parallel_shard_degree * p.context_parallel_degree


@contextmanager
def fake_process_group(rank: int, world_size: int):
    """The default process group as PyTorch's fake backend (collectives do nothing), playing `rank`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the dry run needs a process without a process group (run it as one plain process)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        destroy_process_group()


@dataclass
class BuiltJob:
    """What the setup produced for one rank: the parallelized meta model and its optimizers."""

    model: nn.Module
    model_args: object
    optimizers: object
    parallel: object  # the spec's parallelize result (motif: ParallelizedModel)


def build_job(job_config, parallel_dims: ParallelDims) -> BuiltJob:
    """The trainer's model / optimizer setup (`trainer.components.build_components`, the same function), on meta
    (needs the process group)."""
    from llm_training.motif.spec import MOTIF3_SPEC as spec
    from llm_training.trainer.components import build_components

    parallel_dims.build_mesh("cpu")
    built = build_components(spec, job_config, parallel_dims, torch.device("cuda"), init_weights=False)
    return BuiltJob(built.model, built.model_args, built.optimizers, built.parallel)


# ---------------------------------------------------------------------------------------- measuring
@dataclass
class Memory:
    """Elements and bytes, the bytes split by dtype."""

    numel: int = 0
    bytes_by_dtype: dict[str, int] = field(default_factory=dict)

    def add(self, numel: int, dtype: torch.dtype) -> None:
        self.numel += numel
        name = _dtype_name(dtype)
        self.bytes_by_dtype[name] = self.bytes_by_dtype.get(name, 0) + numel * dtype.itemsize

    @property
    def bytes(self) -> int:
        return sum(self.bytes_by_dtype.values())


@dataclass(frozen=True)
class FsdpShard:
    """One FSDP2-managed parameter: its group (module FQN, "" = root), padded local storage, all-gathered size, and
    whether its group stays gathered for the whole step (the root; an input embedding that `parallelize` keeps
    unsharded from its forward to its backward, as it does over a one-rank shard dimension; over several ranks the
    embedding is resharded after its forward like a block)."""

    group: str
    padded_numel: int
    unsharded_numel: int
    kept_gathered: bool = False
    reshards_after_forward: bool = True  # False: FSDP2 keeps the group gathered from its forward on


def fsdp_shards(model: nn.Module) -> dict[int, FsdpShard]:
    """id(sharded parameter) -> FsdpShard, for every parameter FSDP2 manages (read from its parameter groups)."""
    from torch.distributed.fsdp import FSDPModule

    out = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        reshards = group is not None and group.post_forward_mesh_info is not None
        kept = fqn == "" or (isinstance(module, nn.Embedding) and not reshards)
        for fp in group.fsdp_params if group is not None else ():
            padded = fp.padded_sharded_param_size.numel()
            unsharded = padded * fp.mesh_info.shard_mesh_size
            out[id(fp.sharded_param)] = FsdpShard(fqn, padded, unsharded, kept, reshards and fqn != "")
    return out


def local_numel(p: torch.Tensor) -> int:
    """Elements this rank holds of `p` (its DTensor shard, or all of a plain tensor)."""
    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


@dataclass
class ParameterMemory:
    """Per rank: parameters (and, as their copy, gradients) sharded vs replicated; storage as allocated."""

    sharded: Memory
    replicated: Memory
    sharded_local_numel: int  # the real shard elements (storage is padded to the largest shard)
    trainable: Memory  # storage of the parameters that get gradients


def parameter_memory(model: nn.Module, shards: dict[int, FsdpShard]) -> ParameterMemory:
    sharded, replicated, trainable = Memory(), Memory(), Memory()
    shard_numel = 0
    for p in model.parameters():
        storage = shards[id(p)].padded_numel if id(p) in shards else local_numel(p)
        if isinstance(p, DTensor):
            sharded.add(storage, p.dtype)
            shard_numel += local_numel(p)
        else:
            replicated.add(storage, p.dtype)
        if p.requires_grad:
            trainable.add(storage, p.dtype)
    return ParameterMemory(sharded, replicated, shard_numel, trainable)


def state_slots(optimizer: torch.optim.Optimizer, group: dict) -> tuple[str, ...]:
    """The per-parameter state tensors (each zeros_like the parameter) an optimizer creates at its first step."""
    from optimizer import Muon

    if isinstance(optimizer, Muon):
        return ("momentum_buffer",)
    if isinstance(optimizer, torch.optim.AdamW):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
    raise TypeError(f"dry run: unknown optimizer {type(optimizer).__name__}; add its state slots to state_slots()")


@dataclass(frozen=True)
class OptimizerGroupMemory:
    """One optimizer group of the grouping rules on this rank: its tensors' local elements and state bytes."""

    name: str  # e.g. "muon (muon)", "AdamW (adamw_decay)"
    tensors: int
    local_numel: int
    slots: tuple[str, ...]
    state_bytes: int


def state_dtype(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.dtype:
    """The dtype of `optimizer`'s state tensors for parameter `p` (Muon: its momentum_dtype, if set)."""
    from optimizer import Muon

    return (optimizer.momentum_dtype if isinstance(optimizer, Muon) else None) or p.dtype


def optimizer_memory(optimizers) -> list[OptimizerGroupMemory]:
    """Per (optimizer, grouping group): state = slots x the local shard, in the state dtype (`state_dtype`)."""
    group_of = {id(p): name for name, items in optimizers.grouping.groups.items() for _, p, _ in items}
    rows: dict[tuple[str, tuple[str, ...]], list] = defaultdict(lambda: [0, 0, 0])
    for opt in optimizers.optimizers:
        for group in opt.param_groups:
            slots = state_slots(opt, group)
            for p in group["params"]:
                row = rows[(f"{type(opt).__name__} ({group_of[id(p)]})", slots)]
                n = local_numel(p)
                row[0] += 1
                row[1] += n
                row[2] += len(slots) * n * state_dtype(opt, p).itemsize
    return [OptimizerGroupMemory(name, t, n, slots, b) for (name, slots), (t, n, b) in rows.items()]


@dataclass(frozen=True)
class FsdpTransients:
    """Unsharded FSDP2 buffers (see the module docstring); sizes in elements of one group, bytes as counted."""

    kept_numel: int  # the groups gathered for the whole step: the root and the input embedding
    largest_block: str
    largest_block_numel: int
    compute_dtype: torch.dtype  # of the gathered parameters and their gradients
    reduce_dtype: torch.dtype  # of the gradient reduce-scatter
    blocks_numel: int = 0  # every other group together that stays gathered from its forward on
    gathered_for_the_step: bool = False  # one-rank shards: every group stays gathered through the step

    @property
    def gathered_numel(self) -> int:
        """Elements of the other groups gathered at the peak: two groups, or (one-rank shards) every group that
        stays gathered from its forward on (all but the embedding)."""
        return self.blocks_numel if self.gathered_for_the_step else 2 * self.largest_block_numel

    @property
    def kept_bytes(self) -> int:
        return 2 * self.kept_numel * self.compute_dtype.itemsize  # parameters and gradients

    @property
    def all_gather_bytes(self) -> int:
        return self.gathered_numel * self.compute_dtype.itemsize

    @property
    def reduce_scatter_bytes(self) -> int:
        return self.largest_block_numel * (self.compute_dtype.itemsize + self.reduce_dtype.itemsize)

    @property
    def bytes(self) -> int:
        return self.kept_bytes + self.all_gather_bytes + self.reduce_scatter_bytes


def fsdp_transients(
    shards: dict[int, FsdpShard], compute: torch.dtype, reduce: torch.dtype, gathered_for_the_step: bool = False
) -> FsdpTransients:
    kept, blocks, staying = 0, defaultdict(int), 0
    for s in shards.values():
        if s.kept_gathered:
            kept += s.unsharded_numel
        else:
            blocks[s.group] += s.unsharded_numel
            staying += 0 if s.reshards_after_forward else s.unsharded_numel
    largest = max(blocks, key=blocks.get) if blocks else ""
    return FsdpTransients(kept, largest, blocks.get(largest, 0), compute, reduce, staying, gathered_for_the_step)


@dataclass(frozen=True)
class LossBuffers:
    """The chunked cross-entropy's buffers (trainer/losses.py) for `heads` loss heads."""

    heads: int
    kept_bytes: int  # grad hidden per head + one fp32 grad weight (the heads share one pass), forward to backward
    chunk_bytes: int  # one [chunk, V] fp32 logits block (+ a compute-dtype gradient block, unless written over it)


def loss_buffers(head_weight_VH: torch.Tensor, heads: int, tokens: int, compute: torch.dtype) -> LossBuffers:
    from llm_training.trainer.losses import default_chunk_tokens

    V, H = head_weight_VH.shape
    kept = heads * tokens * H * compute.itemsize + V * H * 4
    if not isinstance(head_weight_VH, DTensor) and head_weight_VH.dtype != compute:
        # a head kept out of FSDP2 in fp32 (one process, motif/parallelize.py): the step's copy in the compute dtype
        kept += V * H * compute.itemsize
    # the CUDA chunk kernel writes a 2-byte (bf16 / fp16) logit gradient over the fp32 logits it reads
    # (trainer/cross_entropy_kernels.py); any other compute dtype gets a gradient block of its own
    per_element = 4 if compute.itemsize == 2 else 4 + compute.itemsize
    return LossBuffers(heads, kept, min(tokens, default_chunk_tokens(V)) * V * per_element)


@dataclass
class RankReport:
    """Everything the dry run measured and estimated for one rank."""

    rank: int
    coords: tuple[int, int, int]  # (dp_replicate, dp_shard, cp)
    ep_rank: int
    params: ParameterMemory
    optimizer: list[OptimizerGroupMemory]
    fsdp: FsdpTransients
    activations: object  # the spec's ActivationEstimate
    loss: LossBuffers
    gpu_bytes: int

    @property
    def optimizer_bytes(self) -> int:
        return sum(g.state_bytes for g in self.optimizer)

    @property
    def activation_peak_bytes(self) -> int:
        a = self.activations
        return a.saved_bytes + max(self.loss.kept_bytes + self.loss.chunk_bytes, a.recompute_bytes)

    @property
    def total_bytes(self) -> int:
        p = self.params
        return (
            p.sharded.bytes
            + p.replicated.bytes
            + p.trainable.bytes
            + self.optimizer_bytes
            + self.fsdp.bytes
            + self.activation_peak_bytes
        )

    @property
    def headroom_bytes(self) -> int:
        return self.gpu_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0


def keeps_attention(job_config, parallel_dims, model_args) -> bool:
    """Whether the full-attention layers can keep flash-attn-4's result across the recompute
    (`[activation_checkpoint] keep_full_attention` under long_context): the attention kernel is flash-attn-4 on the
    GPUs the dry run plans for (fa4, or auto, which picks it on SM90 / SM100) and full attention is not ring
    attention (context parallel in ring mode, or Ulysses falling back to it), which keeps nothing."""
    from llm_training.distributed.context_parallel import plan_context_parallel

    ac, p = job_config.activation_checkpoint, job_config.parallelism
    if not (ac.mode == "long_context" and ac.keep_full_attention and job_config.kernels.attention in ("auto", "fa4")):
        return False
    cp = parallel_dims.cp
    return cp == 1 or plan_context_parallel(model_args, cp, p.context_parallel_mode).full_attention == "ulysses"


def measure_rank(job_config, world_size: int, rank: int) -> RankReport:
    """Set the job up as `rank` of `world_size` (fake process group, its own mesh, meta model) and measure it."""
    from llm_training.motif.spec import MOTIF3_SPEC as spec

    parallel_dims = validate_for_world_size(job_config, world_size)
    t = job_config.training
    compute, reduce = getattr(torch, t.mixed_precision_param), getattr(torch, t.mixed_precision_reduce)
    tokens = t.local_batch_size * t.seq_len // parallel_dims.cp
    ac_mode = job_config.activation_checkpoint.mode
    with fake_process_group(rank, parallel_dims.world_size):
        job = build_job(job_config, parallel_dims)
        shards = fsdp_shards(job.model)
        report = RankReport(
            rank=rank,
            coords=parallel_dims.coords(rank),
            ep_rank=parallel_dims.ep_rank(rank),
            params=parameter_memory(job.model, shards),
            optimizer=optimizer_memory(job.optimizers),
            fsdp=fsdp_transients(shards, compute, reduce, job.parallel.defer_grad_sync),
            activations=spec.activation_memory(
                job.model_args, tokens, ac_mode, compute, keeps_attention(job_config, parallel_dims, job.model_args)
            ),
            loss=loss_buffers(spec.head_weight(job.model), 1 + spec.num_mtp_modules(job.model_args), tokens, compute),
            gpu_bytes=int(job_config.job.dry_run_gpu_memory_gib * GIB),
        )
    return report


def ranks_to_report(world_size: int) -> list[int]:
    """Rank 0 (largest shards) and the last rank (smallest); see the module docstring."""
    return [0] if world_size == 1 else [0, world_size - 1]


# ---------------------------------------------------------------------------------------- report
def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _by_dtype(m: Memory) -> str:
    return ", ".join(f"{dtype} {_size(b)}" for dtype, b in sorted(m.bytes_by_dtype.items())) or "-"


def _row(label: str, nbytes: int, detail: str = "") -> str:
    return f"  {label:<46}{_size(nbytes):>12}  {detail}".rstrip()


def format_header(job_config, parallel_dims: ParallelDims) -> str:
    t, c, d = job_config.training, job_config, parallel_dims
    tokens = t.local_batch_size * t.seq_len // d.cp
    return (
        f"dry run of {c.job.config_file or '(defaults)'}: flavor {c.model.flavor} on {d.world_size} ranks (fake "
        f"process group, model on meta)\n"
        f"layout: dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x cp {d.cp}, ep {d.ep}; per rank and "
        f"micro-batch {t.local_batch_size} x {t.seq_len} / cp {d.cp} = {tokens:,} tokens; activation_checkpoint "
        f"{c.activation_checkpoint.mode}; compute {t.mixed_precision_param}, reduce {t.mixed_precision_reduce}\n"
        f"rows marked + add up to the total; GPU memory {c.job.dry_run_gpu_memory_gib:g} GiB"
    )


def format_rank(r: RankReport) -> str:
    p, f, a, loss = r.params, r.fsdp, r.activations, r.loss
    compute, reduce = _dtype_name(f.compute_dtype), _dtype_name(f.reduce_dtype)
    stored = f", {p.sharded.numel:,} stored (padded)" if p.sharded.numel != p.sharded_local_numel else ""
    lines = [
        f"rank {r.rank}: (dp_replicate, dp_shard, cp) = {r.coords}, ep rank {r.ep_rank}",
        _row(
            "+ parameters, sharded (DTensor)",
            p.sharded.bytes,
            f"{p.sharded_local_numel:,} local elements{stored}; {_by_dtype(p.sharded)}",
        ),
        _row("+ parameters, replicated", p.replicated.bytes, f"{p.replicated.numel:,}; {_by_dtype(p.replicated)}"),
        _row("+ gradients", p.trainable.bytes, f"{p.trainable.numel:,}; {_by_dtype(p.trainable)}"),
    ]
    for g in r.optimizer:
        lines.append(
            _row(
                f"+ optimizer {g.name}",
                g.state_bytes,
                f"{len(g.slots)} x {g.local_numel:,} local elements ({', '.join(g.slots)}), {g.tensors} tensors",
            )
        )
    lines += [
        _row("+ FSDP2 groups kept gathered, params + grads", f.kept_bytes, f"2 x {f.kept_numel:,} in {compute}"),
        _row(
            "+ FSDP2 every group gathered for the step"
            if f.gathered_for_the_step
            else "+ FSDP2 all-gather x2 of the largest group",
            f.all_gather_bytes,
            f"{f.gathered_numel:,} in {compute} (one shard per group: gathered once per step)"
            if f.gathered_for_the_step
            else f"{f.largest_block or '-'}: 2 x {f.largest_block_numel:,} in {compute} (computing + prefetched)",
        ),
        _row(
            "+ FSDP2 its unsharded grads + reduce-scatter in",
            f.reduce_scatter_bytes,
            f"{f.largest_block_numel:,} in {compute} + in {reduce}",
        ),
    ]
    for kind, (count, each) in a.block_bytes.items():
        lines.append(_row(f"  activations kept, {count} x {kind}", count * each, f"{_size(each)} each"))
    lines += [
        _row("  activations kept, outside the blocks", a.outside_blocks_bytes),
        _row(
            "  one block's recomputation (backward)",
            a.recompute_bytes,
            f"routed experts in {LONG_CONTEXT_MOE_CHUNK_TOKENS:,}-token chunks" if a.ac_mode == "long_context" else "",
        ),
        _row(f"  loss buffers, {loss.heads} heads + one chunk", loss.kept_bytes + loss.chunk_bytes),
        _row("+ activation peak: kept + max(loss, recompute)", r.activation_peak_bytes, f"{a.tokens:,} tokens"),
        _row(
            "= total",
            r.total_bytes,
            f"of {_size(r.gpu_bytes)}: "
            + (
                f"fits, headroom {_size(r.headroom_bytes)} ({r.headroom_bytes / r.gpu_bytes:.0%})"
                if r.fits
                else f"DOES NOT FIT, short by {_size(-r.headroom_bytes)}"
            ),
        ),
    ]
    return "\n".join(lines)


def measure_job(job_config) -> tuple[ParallelDims, list[RankReport]]:
    """The layout for the dry run's world size and the report of every rank in `ranks_to_report`."""
    parallel_dims = validate_for_world_size(job_config, dry_run_world_size(job_config))
    world = parallel_dims.world_size
    return parallel_dims, [measure_rank(job_config, world, rank) for rank in ranks_to_report(world)]


def format_report(job_config, parallel_dims: ParallelDims, reports: list[RankReport]) -> str:
    verdict = "fits on every rank" if all(r.fits for r in reports) else f"does NOT fit (exit code {DOES_NOT_FIT})"
    return "\n".join([format_header(job_config, parallel_dims), *map(format_rank, reports), f"dry run: {verdict}"])


def dry_run(job_config) -> int:
    """Measure, print the report, return the exit code (0 fits, DOES_NOT_FIT)."""
    parallel_dims, reports = measure_job(job_config)
    print(format_report(job_config, parallel_dims, reports))
    return 0 if all(r.fits for r in reports) else DOES_NOT_FIT
