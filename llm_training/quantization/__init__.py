"""Low-precision training: model converters, applied to the meta-device model BEFORE parallelization.

A converter rewrites modules in place (`quantization.converter`: the selected nn.Linear and GroupedExperts
modules become low-precision subclasses whose GEMMs run FP8 / MXFP8 kernels); FSDP2, expert parallelism,
activation checkpointing and compile then wrap the converted model. Converters select modules by type: the
weights that must never be converted (router gate, GDLA lambda, mHC projections, the output head) are not
`nn.Linear` (`llm_training.layers.projection`), so a swap cannot touch or silently miss them.

`[quantize] recipe` is one of `RECIPES` (`quantization.recipes`: what each needs, and what `auto` picks per
GPU); `[quantize] convert` one or more of `MODULE_KINDS`. Parameters keep their names, dtype and storage under
every recipe, so a checkpoint saved under one recipe loads under another. FSDP2 all-gathers the weights in the
mixed-precision dtype: torchao's FP8 all-gather exists only for tensorwise scaling, which none of these recipes
uses (each GEMM requantizes rowwise / per block from bf16).
"""

from __future__ import annotations

from typing import Protocol

from torch import nn

from llm_training.quantization.converter import MODULE_KINDS, LowPrecisionConverter
from llm_training.quantization.recipes import RECIPES, cuda_capability, resolve_recipe


class ModelConverter(Protocol):
    """Rewrites a model (on the meta device) in place for one low-precision recipe."""

    def convert(self, model: nn.Module) -> None: ...


def run_on_cuda(job_config) -> bool:
    """Whether the job trains on CUDA ([training] device, auto: when CUDA is available)."""
    import torch

    device = job_config.training.device
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def build_converter(job_config) -> LowPrecisionConverter | None:
    """The converter `[quantize]` asks for on this job's device (None for recipe none, or auto off SM90/SM100)."""
    q = job_config.quantize
    cuda = run_on_cuda(job_config)
    recipe = resolve_recipe(q.recipe, cuda_capability() if cuda else None)
    if recipe == "none":
        return None
    return LowPrecisionConverter(recipe, tuple(q.convert), q.high_precision_weight_grad, cuda)


def apply_converters(model: nn.Module, job_config) -> list[ModelConverter]:
    """Build the converter of `[quantize]` and apply it to `model`; returns what was applied."""
    converter = build_converter(job_config)
    if converter is None:
        return []
    converter.convert(model)
    return [converter]


__all__ = ["MODULE_KINDS", "RECIPES", "ModelConverter", "apply_converters", "build_converter", "run_on_cuda"]
