"""Context parallelism for GDLA attention: which algorithm each layer uses, its validation, and the kernel
wrapper the parallelizer installs on every attention layer (docs/architecture.md §5, docs/model-spec.md §10).

Plan (`plan_context_parallel`):
- mode "ulysses" with heads that allow it (KV heads and noise groups divisible by cp): every layer runs
  Ulysses (ulysses.py); tokens are split contiguously.
- mode "ring", or "ulysses" when the heads do not allow it: full-attention layers run ring attention
  (ring.py), sliding-window layers exchange only a halo of W keys (halo.py); tokens are
  split zigzag (2 cp chunks) for causal load balance.

`ContextParallelAttention` has the attention-kernel signature of layers/attention/backends.py, with one
difference: `metadata` (AttentionMetadata) is built for the FULL sequence ([B, S] document ids, identical on
the cp ranks; Motif3Model.forward's `attention_document_ids`), while q/k/v are this rank's [B, S/cp, ...]
tokens in `plan.layout` order. max_logits is this rank's partial [Hq] (-inf where it saw nothing); the MAX
all-reduce over the world that QK-clip does assembles the exact value.

`apply_context_parallel` also gives every MoE a `SequenceShardSum` so that its sequence-wise balance loss uses
the expert frequencies of the WHOLE sequence (layers/moe.py `sequence_balance_loss`), and returns the
`ContextParallelSplit` the trainer slices its batches with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from llm_training.distributed.context_parallel.block_attention import block_attention_kernel
from llm_training.distributed.context_parallel.sharding import SequenceLayout, cp_shard
from llm_training.distributed.context_parallel.halo import halo_attention
from llm_training.distributed.context_parallel.ring import ring_attention
from llm_training.distributed.context_parallel.ulysses import ulysses_attention
from llm_training.layers.attention.masks import window_value

CP_MODES = ("ulysses", "ring")


@dataclass(frozen=True)
class ContextParallelPlan:
    """Algorithm per attention-layer kind at degree `cp`; `reason` says why ring replaced Ulysses."""

    cp: int
    full_attention: str  # "ulysses" | "ring"
    sliding_attention: str  # "ulysses" | "halo"
    reason: str = ""

    @property
    def layout(self) -> SequenceLayout:
        return SequenceLayout("zigzag" if self.full_attention == "ring" else "contiguous", self.cp)

    def strategy(self, window: Optional[int]) -> str:
        return self.full_attention if window is None else self.sliding_attention


def ulysses_head_problem(args, cp: int) -> str:
    """Why Ulysses cannot split the heads of `args` (a Motif3ModelArgs) over cp ranks, or "" if it can."""
    problems = []
    if args.num_key_value_heads % cp != 0:
        problems.append(f"num_key_value_heads = {args.num_key_value_heads}")
    if args.num_noise_heads % cp != 0:
        problems.append(f"num_noise_heads = {args.num_noise_heads} (signal+noise groups)")
    if not problems:
        return ""
    return f"Ulysses splits whole KV heads and head groups over ranks: {', '.join(problems)} not divisible by {cp}"


def plan_context_parallel(args, cp: int, mode: str) -> ContextParallelPlan:
    """The per-layer algorithm choice for [parallelism] context_parallel_mode = `mode` at degree `cp`."""
    if mode not in CP_MODES:
        raise ValueError(f"[parallelism] context_parallel_mode = {mode!r}; expected one of {CP_MODES}")
    problem = ulysses_head_problem(args, cp)
    if mode == "ulysses" and not problem:
        return ContextParallelPlan(cp, "ulysses", "ulysses")
    return ContextParallelPlan(cp, "ring", "halo", reason=problem if mode == "ulysses" else "")


def check_context_parallel(args, cp: int, mode: str, seq_len: int) -> ContextParallelPlan:
    """Validate a CP layout for config/validate.py; ValueError naming the keys and the fix, else the plan."""
    if cp < 1:
        raise ValueError(f"[parallelism] context_parallel_degree must be >= 1, got {cp}")
    plan = plan_context_parallel(args, cp, mode)
    if cp == 1:
        return plan
    layout = plan.layout
    if seq_len % layout.num_chunks != 0:
        why = "ring attention splits it into 2 x cp zigzag chunks" if layout.kind == "zigzag" else "Ulysses"
        raise ValueError(
            f"[training] seq_len = {seq_len} is not divisible by {layout.num_chunks} ({why}, "
            f"[parallelism] context_parallel_degree = {cp}); make seq_len a multiple of {layout.num_chunks}"
        )
    chunk = seq_len // layout.num_chunks
    if plan.sliding_attention == "halo" and args.sliding_window > chunk:
        raise ValueError(
            f"sliding-window layers under ring context parallelism fetch their W = {args.sliding_window} "
            f"(the flavor's sliding_window) previous keys from the neighbouring chunk only, so W must be <= the "
            f"chunk length [training] seq_len / (2 x [parallelism] context_parallel_degree) = {seq_len} / "
            f"{2 * cp} = {chunk}; raise seq_len or lower context_parallel_degree"
        )
    return plan


class ContextParallelAttention:
    """Attention-kernel wrapper running `inner_kernel` (Ulysses) or ring / halo attention over `group`
    (the cp process group) for one layer; `strategy` in ("ulysses", "ring", "halo")."""

    def __init__(self, inner_kernel, strategy: str, layout: SequenceLayout, group: dist.ProcessGroup):
        if strategy not in ("ulysses", "ring", "halo"):
            raise ValueError(f"unknown context-parallel strategy {strategy!r}; expected ulysses, ring or halo")
        if strategy == "ulysses" and layout.kind != "contiguous":
            raise ValueError("Ulysses gathers the sequence in rank order: it needs the contiguous layout")
        if dist.get_world_size(group) != layout.cp or layout.cp < 2:
            raise ValueError(
                f"context-parallel group of {dist.get_world_size(group)} ranks for a layout of degree {layout.cp}: "
                "they must match and be >= 2 (at degree 1 keep the plain kernel)"
            )
        self.inner_kernel, self.strategy, self.layout, self.group = inner_kernel, strategy, layout, group

    def __call__(
        self, q_BSHD, k_BSKD, v_BSKE, *, scale, window, metadata, record_max_logits, keep_slot=None
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """`keep_slot` (flash-attn-4's keep across a recompute) reaches the inner kernel under Ulysses; ring and
        halo attention keep nothing (they run eagerly, outside the compiled pieces)."""
        if self.strategy == "ulysses":
            kernel_options = {} if keep_slot is None else {"keep_slot": keep_slot}
            return ulysses_attention(
                self.inner_kernel,
                q_BSHD,
                k_BSKD,
                v_BSKE,
                scale=scale,
                window=window,
                metadata=metadata,
                record_max_logits=record_max_logits,
                group=self.group,
                **kernel_options,
            )
        window = window_value(window)  # ring / halo run eagerly and slice by it (the int form)
        common = dict(
            scale=scale,
            document_ids=metadata.document_ids,
            record_max_logits=record_max_logits,
            layout=self.layout,
            group=self.group,
            block_kernel=block_attention_kernel(q_BSHD.device, metadata.block_pair_masks),
        )
        if self.strategy == "ring":
            if window is not None:
                raise ValueError("ring attention is for full-attention layers; sliding layers use halo attention")
            return ring_attention(q_BSHD, k_BSKD, v_BSKE, **common)
        return halo_attention(q_BSHD, k_BSKD, v_BSKE, window=window, **common)


@dataclass(frozen=True)
class SequenceShardSum:
    """What a model layer needs to compute a per-sequence statistic from sequence shards: `degree` shards per
    sequence, and `sum(x)` adding a (detached) per-row tensor over the cp ranks (a functional all-reduce)."""

    group: dist.ProcessGroup
    degree: int

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_reduce

        return all_reduce(x.contiguous(), "sum", self.group)


@dataclass(frozen=True)
class ContextParallelSplit:
    """How this rank's batch is cut from the full one: `shard(x_BS)` for every per-token [B, S] tensor."""

    layout: SequenceLayout
    cp_rank: int
    group: dist.ProcessGroup

    def shard(self, x_BS: torch.Tensor) -> torch.Tensor:
        return cp_shard(x_BS, self.layout, self.cp_rank)


def shard_batch(split: Optional[ContextParallelSplit], batch):
    """(this rank's part of `batch`, the document ids attention needs) for a batch with `.map(fn)` over its
    [B, S] tensors and `.document_ids`: without context parallelism (`split` None) the batch itself and None;
    with it, every [B, S] tensor's shard and the WHOLE sequences' document ids (the cp ranks attend across
    shards)."""
    if split is None:
        return batch, None
    return batch.map(split.shard), batch.document_ids


def apply_context_parallel(
    model: torch.nn.Module, plan: ContextParallelPlan, group: dist.ProcessGroup
) -> ContextParallelSplit:
    """Wrap the kernel of every GDLA layer (trunk and MTP) of `model` for context parallelism, give every MoE
    the cp-group sum its sequence-wise balance loss needs, and return the batch split of this rank."""
    from llm_training.layers.attention.gdla import GDLAttention
    from llm_training.layers.moe import MoE

    shard_sum = SequenceShardSum(group, plan.cp)
    for module in model.modules():
        if isinstance(module, GDLAttention):
            module.kernel = ContextParallelAttention(module.kernel, plan.strategy(module.window), plan.layout, group)
        elif isinstance(module, MoE):
            module.sequence_shards = shard_sum
    return ContextParallelSplit(plan.layout, dist.get_rank(group), group)
