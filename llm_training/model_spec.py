"""The contract between the trainer and a model family (in the spirit of torchtitan's TrainSpec).

A family (today: `llm_training.motif.MOTIF3_SPEC`) exports one `ModelSpec`: how to build its model, parallelize
it, group its parameters for the optimizers, which parameters stay fp32, its state-dict adapter, and its per-step
hooks. The trainer only talks to the model through this object and the model's forward output: it never probes
modules with `hasattr` or reaches into them.

Per-step hooks (`StepHooks`), called by the trainer in this order each optimizer step:
    begin_step(progress)                      before the first forward (progress = steps done / total steps)
    forward_stats(out) -> {name: StepStat}    after each micro-batch forward: statistics to accumulate
    after_step(stats, applied) -> metrics     after the optimizer step (applied=False: a skipped, non-finite
                                              step); `stats` are accumulated over the micro-batches and reduced
                                              over all ranks by the trainer, once per step, with each stat's op,
                                              and handed over as host (CPU) copies read before the optimizer
                                              step: a hook reads nothing from the device (that read would wait
                                              for the optimizer) and moves what it needs back asynchronously
The family's collectives-free model code only produces statistics; the trainer owns every reduction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class StepStat:
    """A per-step statistic from one micro-batch's forward: accumulated over micro-batches with `op`, then
    reduced over all ranks with the same op."""

    value: torch.Tensor
    op: Literal["sum", "max"]


class StepHooks(Protocol):
    def begin_step(self, progress: float) -> None: ...

    def forward_stats(self, out: Any) -> dict[str, StepStat]: ...

    def after_step(self, stats: dict[str, torch.Tensor], applied: bool) -> dict[str, Any]: ...


@dataclass(frozen=True)
class StateDictAdapter:
    """HuggingFace interop of a family: the config.json a run records (from the model args, or the HF directory it
    started from), and weight import/export."""

    run_hf_config: Callable[[Any, str, str], dict]  # (model args, initial_load_path, initial_load_format)
    load_hf_checkpoint: Callable[[nn.Module, str], None]
    export_hf_checkpoint: Callable[..., None]


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer needs to know about a model family."""

    name: str  # the family's name, in the run's log
    get_flavor: Callable[[str], Any]  # the args of a flavor (error lists the valid names)
    build_model: Callable[[Any, Any], nn.Module]  # (model args, job_config) -> model, on the current default device
    parallelize: Callable[..., Any]  # (model, parallel_dims, job_config, device) -> ParallelizedModel
    optimizer_rules: Callable[[Any], tuple[list, tuple[str, ...]]]  # [optimizer] -> (group rules, forbidden names)
    state_dict_adapter: StateDictAdapter
    build_step_hooks: Callable[[nn.Module, Any, Any], StepHooks]  # (model, model args, job_config) -> hooks
    head_weight: Callable[[nn.Module], torch.Tensor]  # the output projection the fused loss multiplies
    num_mtp_modules: Callable[[Any], int]  # model args -> multi-token-prediction modules (0: none)
    # (input ids [B, S], number of MTP modules) -> the ids each MTP module embeds, one [B, S] tensor per module
    mtp_inputs: Callable[[torch.Tensor, int], list]
    flops_per_token: Callable[[Any, int, str], float]  # (model args, seq_len, MFU convention) -> training FLOPs
    param_counts: Callable[[Any], Any]  # model args -> counts with `total`, `mtp`, `active` (the run's log)
    # (model args, tokens per rank, activation_checkpoint mode, compute dtype, whether full-attention layers keep
    # their kernel's output across the recompute) -> estimate with `saved_bytes` (kept from forward to backward)
    # and `recompute_bytes` (one block re-materialised in its backward); the dry run's
    activation_memory: Callable[[Any, int, str, torch.dtype, bool], Any]
