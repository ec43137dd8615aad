"""The converted modules: `nn.Linear` and `GroupedExperts` subclasses whose GEMMs run through a recipe's
kernels (`quantization.kernels.RecipeKernels`). They are made by swapping the class of an existing module
(`to_low_precision`), so parameters keep their names, dtype, storage and init: the state dict, DCP checkpoints,
FSDP2 sharding, EP's DTensor experts and the optimizer rules see the same model under every recipe.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from llm_training.layers.moe import GroupedExperts
from llm_training.quantization.kernels import RecipeKernels


class LowPrecisionLinear(nn.Linear):
    """nn.Linear whose x W^T runs through `kernels.linear` (bias, if any, added in high precision)."""

    kernels: RecipeKernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.linear(x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.kernels!r}"


class LowPrecisionGroupedExperts(GroupedExperts):
    """GroupedExperts whose two grouped GEMMs run through `kernels.grouped_mm`, with every expert's token group
    padded to the kernel's alignment (`kernels.group_multiple`) inside this module only."""

    kernels: RecipeKernels

    def forward(
        self, x_NH: torch.Tensor, tokens_per_expert_E: torch.Tensor, group_multiple: int | None = None
    ) -> torch.Tensor:
        multiple = self.kernels.group_multiple
        return super().forward(
            x_NH, tokens_per_expert_E, multiple if group_multiple is None else math.lcm(group_multiple, multiple)
        )

    def _grouped_matmul(self, x_NK, w_EOK, offs, counts):
        return self.kernels.grouped_mm(x_NK, w_EOK, offs)

    _looped_matmul = _grouped_matmul  # the quantized path does not depend on torch._grouped_mm's support

    def extra_repr(self) -> str:
        return f"{self.kernels!r}"


def to_low_precision(module: nn.Module, kernels: RecipeKernels) -> nn.Module:
    """Turn `module` (an nn.Linear or GroupedExperts, on any device, meta included) into its low-precision
    subclass in place; returns it."""
    if type(module) is nn.Linear:
        module.__class__ = LowPrecisionLinear
    elif type(module) is GroupedExperts:
        module.__class__ = LowPrecisionGroupedExperts
    else:
        raise TypeError(f"to_low_precision: cannot convert {type(module).__name__}")
    module.kernels = kernels
    return module


__all__ = ["LowPrecisionGroupedExperts", "LowPrecisionLinear", "to_low_precision"]
