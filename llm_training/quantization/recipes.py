"""Which low-precision recipe runs where: the `[quantize] recipe` names, what GPU each needs, and `auto`.

  * mxfp8         MX FP8 (OCP MX v1.0): E4M3 elements, one E8M0 power-of-two scale per 32 consecutive elements
                  of the GEMM's reduction dim (docs/model-spec.md §9). Native tensor cores on Blackwell (SM100+) only.
  * fp8_rowwise   E4M3 with one power-of-two scale per row of each GEMM operand (along the reduction dim);
                  torchao float8 "rowwise" linears and FP8 rowwise grouped GEMMs (`torch._scaled_grouped_mm`), SM90+.
  * fp8_blockwise DeepSeek-V3 block FP8: activations and gradients in 1x128 tiles, weights in 128x128 blocks,
                  fp32 scales (docs/model-spec.md §9); torchao blockwise kernels (DeepGEMM for the experts when it is
                  importable), SM90+.
  * auto          mxfp8 on SM100+, fp8_rowwise on SM90, none on CPU and other GPUs.
  * none          the mixed-precision dtype, no conversion.

On CPU every explicit recipe runs emulated (`quantization.emulation`: exact scaling rules, fp32 GEMMs), so CI
checks the numerics; `auto` never picks emulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RECIPES = ("none", "mxfp8", "fp8_rowwise", "fp8_blockwise", "auto")


@dataclass(frozen=True)
class RecipeSpec:
    """One low-precision recipe: the oldest GPU generation that runs it natively and what to use instead."""

    name: str
    min_sm: int  # compute capability major (9: Hopper, 10: Blackwell)
    needs: str  # what the GPU must have, for the error message


LOW_PRECISION = {
    "mxfp8": RecipeSpec("mxfp8", 10, "MXFP8 tensor cores, which only Blackwell (SM100+) has"),
    "fp8_rowwise": RecipeSpec("fp8_rowwise", 9, "FP8 grouped GEMMs (torch._scaled_grouped_mm), SM90+"),
    "fp8_blockwise": RecipeSpec("fp8_blockwise", 9, "FP8 GEMMs with 1x128 / 128x128 block scales, SM90+"),
}


def cuda_capability() -> tuple[int, int] | None:
    """(major, minor) of the current CUDA device, None without CUDA."""
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def resolve_recipe(recipe: str, capability: tuple[int, int] | None) -> str:
    """The concrete recipe ("none" or a LOW_PRECISION key) that `recipe` means on a device of `capability`
    (None: CPU). Only `auto` depends on the device."""
    if recipe != "auto":
        return recipe
    if capability is None:
        return "none"
    if capability[0] >= 10:
        return "mxfp8"
    return "fp8_rowwise" if capability[0] == 9 else "none"


def recipe_problem(recipe: str, capability: tuple[int, int] | None) -> str | None:
    """Why `recipe` cannot run on a GPU of `capability` (with the alternative), or None when it can (and on CPU,
    where it runs emulated)."""
    concrete = resolve_recipe(recipe, capability)
    if concrete == "none" or capability is None:
        return None
    spec = LOW_PRECISION[concrete]
    if capability[0] >= spec.min_sm:
        return None
    sm = f"SM{capability[0]}{capability[1]}"
    alternative = resolve_recipe("auto", capability)
    instead = f"use recipe = '{alternative}' or 'auto'" if alternative != "none" else "use recipe = 'none' or 'auto'"
    return f"recipe = '{recipe}' needs {spec.needs}; this GPU is {sm}: {instead}"


__all__ = ["LOW_PRECISION", "RECIPES", "RecipeSpec", "cuda_capability", "recipe_problem", "resolve_recipe"]
