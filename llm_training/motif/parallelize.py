"""The ONE place that applies parallelism and memory/speed wrappers to a Motif3Model. It only decides what
goes where and in which order; each wrapper is a composable `apply_*` function of `llm_training.distributed`.

Order (fixed; each step wraps what the previous ones produced, so it cannot be reordered):
    1. expert parallel            distributed.expert_parallel.apply_expert_parallel (ep > 1): each MoE's
                                  `experts` sharded over the "ep" dim of ParallelDims.ep_mesh, tokens dispatched
                                  with [parallelism] expert_parallel_dispatcher
    2. context parallel           distributed.context_parallel.apply_context_parallel (cp > 1): every attention
                                  kernel wrapped (Ulysses / ring / halo per the plan) over the "cp" mesh dim's
                                  group; every MoE's balance loss summed over the sequence shards
    3. activation checkpointing   distributed.activation_checkpoint.apply_ac (per block); the blocks dynamo
                                  cannot trace whole (`blocks_compiled_in_pieces`: expert-parallel MoE blocks,
                                  ring / halo context parallelism, long_context recompute) get their forward
                                  compiled just before
                                  (distributed.compile.compile_in_pieces), so the checkpoint stays outside dynamo
    4. torch.compile              distributed.compile.apply_compile (per block, regional, over the checkpoint)
    5. FSDP2                      distributed.fsdp.apply_fsdp (expert modules over expert_grad_mesh, the
                                  embedding, the blocks, then the root), SUM gradient reduction; over a one-rank
                                  mesh the reduction runs on the compute stream
                                  (distributed.fsdp.reduce_on_compute_stream)

Use (docs/architecture.md §2 step 3; the model spec's `parallelize`):
    with torch.device("meta"): model = Motif3Model(args)
    parallel = parallelize_motif(model, parallel_dims, job_config, device)
    model.to_empty(device=device); model.init_weights(buffer_device=device)   # or load a checkpoint
    ... per micro-batch under CP: batch.map(parallel.context_parallel.shard), full document ids to the model
    ... after the backward passes of a step: parallel.sync_replicated_grads()

Choices:
  * Blocks are `layers[i]` and `mtp_layers[k]`. The input embedding is an FSDP2 group of its own (as in
    torchtitan; resharded after its one forward call, as the blocks are) and the root (final norm, lm_head)
    another (kept gathered from forward to backward: the loss reads the head weight): FSDP2 reduces a group
    through one flat fp32 buffer of its size, and the two [V, H] matrices together would need 6.7 GiB of it at
    once (`distributed.fsdp`).
  * fp32 parameters (the spec's fp32 rule, `state_dict_adapter.is_fp32_key`: router gate, mHC, PolyNorm
    act_fn) are kept OUT of FSDP2: fp32 and replicated on every rank (~2% of motif3_seq's parameters), their
    gradients all-reduced (SUM) by `sync_replicated_grads`. FSDP2's MixedPrecisionPolicy would otherwise hand
    the model bf16 copies of them. The EP-sharded ones (the experts' grouped PolyNorm act_fn) hold different
    experts on the EP ranks: their grads are summed over `expert_grad_mesh` only (`sum_expert_grads`).
  * FSDP2 is applied when a process group exists and either there is more than one data-parallel rank
    (replicate or shard) or the device is CUDA (a 1-rank FSDP2 gives bf16 mixed precision with fp32 master
    weights). On CPU, FSDP2 runs in fp32 (gloo). Pure replication (dp_shard = 1) runs as HSDP over a 1-rank
    shard dim, so the ranks still sum their gradients.
  * One process (world size 1): the two vocabulary tables (`embed_tokens`, `lm_head`) stay out of FSDP2 too, fp32
    (`vocabulary_tables`). Over one rank FSDP2's "gather" and "reduction" of a group are full-size copies: per step
    it cast the embedding's [V, H] table to bf16 at every micro-batch's forward (the embedding is resharded after
    it, see above), cast and added its dense gradient into an fp32 accumulator at every backward, and packed,
    copied and re-copied both tables' fp32 gradients at the last one: 46 ms of a 890 ms one-H100 proxy_16e step
    (bench_vs_torchtitan --profile-steps 1, session 37). Out of FSDP2 the lookup reads its rows from the fp32 table,
    hands them on in the compute dtype and adds their gradients into the table's fp32 `.grad` in place
    (`layers.embedding.Embedding.accumulate_grad_in_place`: no dense [V, H] gradient per micro-batch), and the
    loss casts the head to bf16 once per step and hands it its fp32 gradient sum once
    (`trainer.losses.HeadGradAccumulator`). The tables out of FSDP2 took a step from 889.9 to 855.4 ms on one H100
    (session 38, the same harness and machine, before the in-place embedding gradient, which bench_embedding.py
    measures apart: 21.6 -> 4.9 ms of embedding work per 4-micro-batch step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from llm_training.distributed.activation_checkpoint import apply_ac
from llm_training.distributed.compile import apply_compile, compile_in_pieces
from llm_training.distributed.context_parallel import (
    ContextParallelSplit,
    apply_context_parallel,
    plan_context_parallel,
)
from llm_training.distributed.expert_parallel import apply_expert_parallel, expert_grad_mesh, sum_expert_grads
from llm_training.distributed.fsdp import ReplicatedGradSync, apply_fsdp, reduce_on_compute_stream
from llm_training.layers.moe import MoE
from llm_training.motif.state_dict_adapter import is_fp32_key


@dataclass
class ParallelizedModel:
    """What parallelize_motif did, and the step-time duties it leaves: syncing the replicated grads, and under
    context parallelism slicing every [B, S] batch tensor with `context_parallel.shard` (None without CP)."""

    model: nn.Module
    fsdp: bool
    sync_replicated_grads: Callable[[], None] = lambda: None
    context_parallel: Optional[ContextParallelSplit] = None
    # FSDP2 shards over ONE rank (one GPU, or HSDP with dp_shard = 1): its per-micro-batch reduce-scatter is only
    # copies (bf16 grads into an fp32 buffer, the "scatter", an add into the sharded grads: ~150 ms of a 64K-token
    # step of motif3_proxy on one H200), so gradients accumulate unsharded in fp32 and are reduced once per step.
    # Its all-gathers are only copies too (the fp32 -> bf16 cast, then a copy out of the gather buffer: about 80 ms
    # of that step, twice per micro-batch), so the parameters are also gathered once per step: kept unsharded from
    # forward to backward (parallelize_motif) and between the micro-batches, resharded by the last backward, before
    # the optimizer updates the shards.
    defer_grad_sync: bool = False
    # blocks compiled in pieces around the parts dynamo cannot trace (`blocks_compiled_in_pieces`): their graph
    # breaks are by design, which the first step's compile report says
    blocks_compiled_in_pieces: int = 0

    def set_gradient_sync(self, last_micro_batch: bool) -> None:
        """Before each micro-batch's backward: whether this backward reduces the gradients and reshards the
        parameters (the last one does)."""
        if self.defer_grad_sync:
            self.model.set_requires_gradient_sync(last_micro_batch)
            self.model.set_reshard_after_backward(last_micro_batch)


def fsdp_mixed_precision(parallel_dims, job_config, device: torch.device):
    """FSDP2's MixedPrecisionPolicy for this run, or None where FSDP2 is not applied (module docstring: a process
    group, and more than one data-parallel rank or a CUDA device): the configured parameter and reduction dtypes on
    CUDA, fp32 on CPU (gloo)."""
    use_fsdp = dist.is_initialized() and (
        parallel_dims.dp_enabled or parallel_dims.fsdp_enabled or device.type == "cuda"
    )
    if not use_fsdp:
        if device.type == "cuda" and job_config.training.mixed_precision_param == "bfloat16":
            raise RuntimeError(
                "bf16 mixed precision on CUDA needs a process group (FSDP2 provides it, even on one GPU): set up "
                "the run with llm_training.distributed.utils.setup_distributed"
            )
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if device.type != "cuda":
        return MixedPrecisionPolicy()  # fp32 on CPU / gloo
    return MixedPrecisionPolicy(
        param_dtype=getattr(torch, job_config.training.mixed_precision_param),
        reduce_dtype=getattr(torch, job_config.training.mixed_precision_reduce),
    )


def vocabulary_tables(model: nn.Module) -> list[str]:
    """The names of the input embedding's and the output head's [V, H] weights (module docstring: one process keeps
    them out of FSDP2)."""
    tables = (model.embed_tokens.weight, model.lm_head.weight)
    return [name for name, p in model.named_parameters() if any(p is t for t in tables)]


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: trunk layers then MTP modules."""
    return [*model.layers, *model.mtp_layers]


def blocks_compiled_in_pieces(model: nn.Module, expert_parallel: bool, cp_plan, long_context: bool) -> list[nn.Module]:
    """The blocks compiled with the checkpoint outside (`distributed.compile.compile_in_pieces`): every block under
    ring / halo context parallelism (`cp_plan`, a ContextParallelPlan or None) and under "long_context" checkpointing
    (the routed experts' chunks run eagerly, each its own checkpoint: `MoE._routed_in_chunks`; the blocks' recompute
    then holds what eager recompute holds), else under expert parallelism the blocks with a MoE (trunk MoE layers,
    and MTP modules whose block has one)."""
    if long_context or (cp_plan is not None and cp_plan.full_attention == "ring"):  # ring: halo on sliding layers
        return blocks(model)
    if expert_parallel:
        return [b for b in blocks(model) if any(isinstance(m, MoE) for m in b.modules())]
    return []


def block_kind(block: nn.Module) -> str:
    """What sets a block's compiled graphs apart: its class, attention window and feed-forward (dense / MoE). (With
    flash-attn-4 the window no longer does, `masks.window_tensor`; keeping it apart only costs one more code copy.)"""
    window = block.self_attn.window
    ffn = "moe" if getattr(block, "moe", None) is not None else "dense"
    return f"{type(block).__name__}_{'full' if window is None else f'window{window}'}_{ffn}"


def fp32_param_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters() if is_fp32_key(name)]


def parallelize_motif(model: nn.Module, parallel_dims, job_config, device: torch.device) -> ParallelizedModel:
    """Apply (in the order of the module docstring) expert and context parallelism, activation checkpointing,
    compile and FSDP2 to `model` (typically still on meta). `parallel_dims` carries the meshes built at setup."""
    p = job_config.parallelism
    expert_plan = None
    if parallel_dims.ep_enabled:
        expert_plan = apply_expert_parallel(model, parallel_dims.ep_mesh["ep"], p.expert_parallel_dispatcher)
    cp_split = cp_plan = None
    if parallel_dims.cp_enabled:
        cp_plan = plan_context_parallel(model.args, parallel_dims.cp, p.context_parallel_mode)
        cp_split = apply_context_parallel(model, cp_plan, parallel_dims.world_mesh["cp"].get_group())
    compiled = job_config.compile.enable and "model" in job_config.compile.components
    ac_mode = job_config.activation_checkpoint.mode
    # only under whole-block recomputation: with no checkpoint, dynamo splits a block at its breaks by itself; a
    # "selective" policy cannot see into compiled pieces (those blocks run eagerly, which the first step reports)
    in_pieces = []
    if compiled and ac_mode in ("full", "long_context"):
        in_pieces = blocks_compiled_in_pieces(model, expert_plan is not None, cp_plan, ac_mode == "long_context")
    tuning = job_config.compile.kernel_tuning
    # before the checkpoint wraps their forward: it stays outside dynamo
    compile_in_pieces(in_pieces, block_kind, kernel_tuning=tuning)
    apply_ac(blocks(model), ac_mode, job_config.activation_checkpoint.keep_full_attention)
    if compiled:
        whole = [b for b in blocks(model) if all(b is not piece for piece in in_pieces)]
        granularity = job_config.compile.granularity
        sublayers = granularity == "sublayer" or (granularity == "auto" and ac_mode == "none")
        apply_compile(whole, sublayers=sublayers, kernel_tuning=tuning)

    mp = fsdp_mixed_precision(parallel_dims, job_config, device)
    if mp is None:
        return ParallelizedModel(model, fsdp=False, blocks_compiled_in_pieces=len(in_pieces))

    mesh = parallel_dims.world_mesh
    if mesh is None:
        raise RuntimeError("parallelize_motif: the device mesh is not built (setup_distributed builds it once)")
    fsdp_mesh = mesh["dp_replicate", "dp_shard_cp"] if parallel_dims.dp_replicate_enabled else mesh["dp_shard_cp"]
    replicated = fp32_param_names(model)
    expert_names = set(expert_plan.expert_param_names) if expert_plan else set()
    expert_modules = [m.experts for m in model.modules() if isinstance(m, MoE)] if expert_plan else []
    expert_mesh = expert_grad_mesh(parallel_dims) if expert_plan else None
    one_process = dist.get_world_size() == 1
    tables = vocabulary_tables(model) if one_process else []
    embedding = None if one_process else model.embed_tokens
    apply_fsdp(model, blocks(model), fsdp_mesh, mp, replicated + tables, expert_modules, expert_mesh, embedding)
    if one_process:
        model.embed_tokens.accumulate_grad_in_place(mp.param_dtype)
    single_shard = mesh["dp_shard_cp"].size() == 1
    if single_shard:  # one all-gather per optimizer step (ParallelizedModel.defer_grad_sync)
        model.set_reshard_after_forward(False)
    if single_shard and embedding is not None:
        # but the input embedding's table, which no later forward reads and its lookup's backward does not need,
        # would sit in every micro-batch's loss peak (1.7 GiB at Motif-3's vocabulary): it is resharded after its
        # forward (its backward needs no table: apply_fsdp). One H200,
        # motif3_proxy without MTP, together with the loss kernel's in-place gradient (bench/results/
        # bench_vs_torchtitan_accum_session23_h200*.json): peak allocated 103.0 -> 100.3 GiB, no slower step
        embedding.set_reshard_after_forward(True, recurse=False)
    if fsdp_mesh.size() == 1:
        # one rank, no replicas: the gradient "reduction" is local copies with nothing to overlap, and on FSDP2's
        # side stream its fp32 gradients stay cached where the next forward cannot reuse them (one H200,
        # motif3_proxy: 131.8 -> 115.2 GiB reserved at 0.999x the step time, bench_vs_torchtitan, session 14)
        reduce_on_compute_stream(model)
    replicated_sync = ReplicatedGradSync(model, [n for n in replicated if n not in expert_names], dist.group.WORLD)
    expert_fp32 = [n for n in replicated if n in expert_names]

    def sync_replicated_grads() -> None:
        replicated_sync()
        if expert_fp32:
            sum_expert_grads(model, expert_fp32, expert_mesh)

    return ParallelizedModel(
        model,
        fsdp=True,
        sync_replicated_grads=sync_replicated_grads,
        context_parallel=cp_split,
        defer_grad_sync=single_shard,
        blocks_compiled_in_pieces=len(in_pieces),
    )
