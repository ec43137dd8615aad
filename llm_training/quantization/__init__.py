"""Low-precision training: model converters, applied to the meta-device model BEFORE parallelization.

A converter rewrites modules in place (e.g. swaps `nn.Linear` for a float8 linear, or the routed experts'
grouped GEMM for a scaled one); FSDP2, activation checkpointing and compile then wrap the converted model.
Converters select modules by type: the weights that must never be converted (router gate, GDLA lambda, mHC
projections, the output head) are not `nn.Linear` (`llm_training.layers.projection`), so a swap cannot touch
or silently miss them.

The registry `CONVERTERS` maps each `[quantize] mode` to a factory `job_config -> ModelConverter | None`;
the config accepts exactly its keys. Today it holds "none" only (bf16 / fp32 training): the FP8 (SM90) and
MXFP8 (SM100) recipes are the low-precision issue's.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

from torch import nn


class ModelConverter(Protocol):
    """Rewrites a model (on the meta device) in place for one low-precision recipe."""

    def convert(self, model: nn.Module) -> None: ...


CONVERTERS: dict[str, Callable[[Any], Optional[ModelConverter]]] = {
    "none": lambda job_config: None,  # train in the mixed-precision dtype, no conversion
}


def apply_converters(model: nn.Module, job_config) -> list[ModelConverter]:
    """Build the converter of `[quantize] mode` and apply it to `model`; returns what was applied."""
    converter = CONVERTERS[job_config.quantize.mode](job_config)
    if converter is None:
        return []
    converter.convert(model)
    return [converter]


__all__ = ["CONVERTERS", "ModelConverter", "apply_converters"]
