"""`build_components`: the one way a job's model and optimizers are set up, used by the Trainer and the dry run.

Steps, through the model family's spec (`llm_training.model_spec.ModelSpec`), in this order:
  0. the `[kernels]` choices of the activation and optimizer packages, process-wide (attention and the mHC backward
     are the model's own arguments, passed by `spec.build_model`);
  1. the flavor's model args; the model built on the meta device (or, with `init_weights` on a CPU device, built
     on the device and initialised first: below);
  2. low-precision conversion (`quantization.apply_converters`): before parallelization, which wraps what it made;
  3. the family's `parallelize` (EP / CP / AC / compile / FSDP2, whatever the config asks);
  4. with `init_weights`: the sharded parameters materialised on the device and initialised in place from the
     training seed (DTensor random ops give every shard its own part of the full tensor's random stream);
  5. the optimizers (Muon + AdamW, each with the family's parameter groups) and their LR scheduler.

CPU devices initialise BEFORE parallelizing: DTensor random ops are not supported on a CPU mesh (every rank would
draw the same values for its shard), so the full model is initialised first and FSDP2 keeps each rank's rows of
it (the same weights as one process). The dry run passes `init_weights=False` and a CUDA device: nothing is
allocated, and a parameter that `parallelize` materialised anyway is an error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llm_training.model_spec import ModelSpec


@dataclass
class Components:
    """What `build_components` made for this rank."""

    model_args: Any
    model: nn.Module
    converters: list  # the low-precision converters applied (empty for recipe none)
    parallel: Any  # the spec's parallelize result (motif: ParallelizedModel)
    optimizers: Any  # the optimizers container, with `.lr_scheduler`


def build_components(
    spec: ModelSpec,
    job_config,
    parallel_dims,
    device: torch.device,
    init_weights: bool = True,
    on_model_built: Callable[[nn.Module], None] | None = None,
) -> Components:
    """Model args, model, converters, parallelization and optimizers of `job_config` on `device` (module
    docstring); the process group and `parallel_dims`' mesh must exist. `init_weights=False`: the model stays on
    the meta device (the dry run). `on_model_built(model)` runs as soon as the model exists, before step 2 (on
    CUDA still on the meta device): the Trainer starts flash-attn-4's kernel prebuild there, so that the side
    process runs while the rest is built."""
    from activation.backend import configure as configure_activation_kernels
    from optimizer.newton_schulz import set_gram_backend

    from llm_training.quantization import apply_converters
    from llm_training.trainer.optim import build_optimizers

    k = job_config.kernels  # the process-wide kernel choices (attention and mHC are the model's, below)
    configure_activation_kernels(k.activations)
    set_gram_backend(k.muon_gram)
    seed = job_config.training.seed
    model_args = spec.get_flavor(job_config.model.flavor)
    init_full_first = init_weights and device.type == "cpu"
    with torch.device(device if init_full_first else "meta"):
        model = spec.build_model(model_args, job_config)
    if on_model_built is not None:
        on_model_built(model)
    if init_full_first:
        torch.manual_seed(seed)
        model.init_weights(buffer_device=device)
    converters = apply_converters(model, job_config)
    parallel = spec.parallelize(model, parallel_dims, job_config, device)
    if init_weights and not init_full_first:
        model.to_empty(device=device)
        torch.manual_seed(seed)
        model.init_weights(buffer_device=device)
    if not init_weights:
        materialised = [name for name, p in model.named_parameters() if not p.is_meta]
        if materialised:
            raise RuntimeError(f"parallelize materialised parameters off the meta device: {materialised[:3]}")
    rules, forbidden = spec.optimizer_rules(job_config.optimizer)
    optimizers = build_optimizers(model, job_config, rules, forbidden)
    optimizers.init_state()  # the long-lived state before the activations (OptimizersContainer.init_state)
    return Components(model_args, model, converters, parallel, optimizers)


__all__ = ["Components", "build_components"]
