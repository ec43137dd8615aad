"""The low-precision converter: picks the modules a `[quantize]` config converts and swaps them for their
low-precision subclasses (`quantization.modules`), on the meta model before parallelization.

Module kinds (`[quantize] convert`):
  * attention       the GDLA projections wq_a, wq_b, wkv_a, wkv_b, wo
  * dense_mlp       gate/up/down of the dense layers' and the MTP modules' MLPs
  * routed_experts  the MoE's grouped experts (both grouped GEMMs)
  * shared_expert   gate/up/down of the MoE's shared expert
Never converted, whatever the config: the embedding, the output head and the router gate, GDLA lambda_proj
and the mHC projections (not nn.Linear: `layers.projection`), the norms, the attention output gate wq_b_gate
and the MTP input projection (docs/model-spec.md §9 keeps them in bf16 / fp32).

Every selected module converts. On CUDA a linear whose dims miss the kernel's alignment runs on zero-padded
operands (`RecipeKernels.linear`); routed experts whose hidden or intermediate size misses it are a config error
naming the layer and the fix (padding them would copy every expert's weights on every call). On CPU (emulation)
any shape runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

from llm_training.errors import ConfigError
from llm_training.layers.attention.gdla import GDLAttention
from llm_training.layers.ffn import FeedForward
from llm_training.layers.moe import GroupedExperts, MoE
from llm_training.quantization.kernels import DIM_MULTIPLE, RecipeKernels, fits_cuda_kernel
from llm_training.quantization.modules import to_low_precision

logger = logging.getLogger(__name__)

MODULE_KINDS = ("attention", "dense_mlp", "routed_experts", "shared_expert")
ATTENTION_NEVER_CONVERTED = ("wq_b_gate",)  # the elementwise output gate: a gate projection stays high precision


def convertible_modules(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(qualified name, module, kind) of every module a recipe may convert, in model order."""
    shared = {id(m.shared_experts) for m in model.modules() if isinstance(m, MoE) and m.shared_experts is not None}
    found = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, GDLAttention):
            found += [
                (prefix + child, sub, "attention")
                for child, sub in module.named_children()
                if isinstance(sub, nn.Linear) and child not in ATTENTION_NEVER_CONVERTED
            ]
        elif isinstance(module, FeedForward):
            kind = "shared_expert" if id(module) in shared else "dense_mlp"
            found += [
                (prefix + child, sub, kind) for child, sub in module.named_children() if isinstance(sub, nn.Linear)
            ]
        elif isinstance(module, GroupedExperts):
            found.append((name, module, "routed_experts"))
    return found


def gemm_dims(module: nn.Module) -> tuple[int, ...]:
    if isinstance(module, GroupedExperts):
        return (*module.gate_up_proj.shape[1:], *module.down_proj.shape[1:])
    return (module.in_features, module.out_features)


@dataclass
class LowPrecisionConverter:
    """Converts the modules of `kinds` to `recipe` (a concrete one: mxfp8 / fp8_rowwise / fp8_blockwise).
    `cuda`: the run's device is CUDA (apply the kernels' shape rule)."""

    recipe: str
    kinds: tuple[str, ...]
    hp_weight_grad: bool
    cuda: bool
    converted: list[str] = field(default_factory=list)

    def convert(self, model: nn.Module) -> None:
        chosen = []
        for name, module, kind in convertible_modules(model):
            if kind not in self.kinds:
                continue
            if self.cuda and kind == "routed_experts" and not fits_cuda_kernel(self.recipe, *gemm_dims(module)):
                raise ConfigError(
                    f"[quantize] recipe = '{self.recipe}': the routed experts of {name} have GEMM dims "
                    f"{gemm_dims(module)} (2 x moe_intermediate_size, hidden_size; hidden_size, moe_intermediate_size), not "
                    f"all multiples of "
                    f"{DIM_MULTIPLE[self.recipe]}, which its grouped GEMM needs; use a recipe with a smaller "
                    f"alignment ({', '.join(f'{r}: {m}' for r, m in DIM_MULTIPLE.items())}) or leave them in bf16: "
                    f"[quantize] convert = {[k for k in self.kinds if k != 'routed_experts']}"
                )
            chosen.append(module)
            self.converted.append(name)
        # CUDA ops are bound (torchao imported) only when something converts
        kernels = RecipeKernels(self.recipe, self.hp_weight_grad, cuda=self.cuda and bool(chosen))
        for module in chosen:
            to_low_precision(module, kernels)
        if self.cuda and self.recipe == "fp8_blockwise" and "routed_experts" in self.kinds:
            import importlib.util

            if importlib.util.find_spec("deep_gemm") is None:
                logger.warning(
                    "[quantize] fp8_blockwise: deep_gemm is not importable, so the routed experts run torchao's "
                    "emulated blockwise grouped GEMM (blockwise numerics, no FP8 speed-up); install DeepGEMM or use "
                    "recipe = 'fp8_rowwise'"
                )
        padded = [
            n for n, m in zip(self.converted, chosen) if self.cuda and not fits_cuda_kernel(self.recipe, *gemm_dims(m))
        ]
        logger.info(
            "[quantize] %s: %d modules converted (%s)%s",
            kernels,
            len(self.converted),
            ", ".join(self.kinds),
            f"; {len(padded)} run on operands zero-padded to multiples of {DIM_MULTIPLE[self.recipe]}: "
            f"{', '.join(padded[:8])}{' ...' if len(padded) > 8 else ''}"
            if padded
            else "",
        )


__all__ = ["ATTENTION_NEVER_CONVERTED", "MODULE_KINDS", "LowPrecisionConverter", "convertible_modules"]
