"""The GEMMs of one recipe: `linear(x, w)` and `grouped_mm(x, w, offs)`, on CUDA through torchao 0.18, on CPU
through the emulation (`quantization.emulation`). The device of the input picks the path (static under
torch.compile). torchao is imported when a RecipeKernels is built for CUDA (`cuda=True`), never for CPU.

CUDA kernels (torchao 0.18 API, read from its source):
  * fp8_rowwise    linear: `torchao.float8.float8_linear.matmul_with_hp_or_float8_args` with the "rowwise"
                   Float8LinearConfig, i.e. the op `convert_to_float8_training`'s Float8Linear runs; experts: `moe_training._to_fp8_rowwise_then_scaled_grouped_mm`
                   (`torch._scaled_grouped_mm`), token groups pre-padded to 16 rows (torchao 0.18 must be called
                   with pad_token_groups_for_grouped_mm=False).
  * mxfp8 (SM100)  linear: `moe_training.mxfp8_linear._to_mxfp8_then_scaled_mm`; experts:
                   `moe_training._to_mxfp8_then_scaled_grouped_mm`, both RCEIL scales, kernel preference AUTO,
                   native `wgrad_with_hp`; token groups pre-padded to 32 rows.
  * fp8_blockwise  linear: `blockwise_fp8_training.linear.fp8_blockwise_mm` (1x128 x 128x128 `F.scaled_mm`);
                   experts: `moe_training.blockwise_fp8.grouped_mm._to_fp8_blockwise_then_scaled_grouped_mm`,
                   which runs DeepGEMM when `deep_gemm` is importable and torchao's emulated grouped GEMM
                   otherwise; token groups pre-padded to 128 rows.
High-precision weight gradients: MXFP8 uses torchao's own `wgrad_with_hp`; fp8_rowwise and fp8_blockwise use
`_HighPrecisionWeightGrad` (forward and dgrad through the recipe's quantized op, wgrad a bf16 (grouped) GEMM),
which is the emulation's semantics exactly (torchao's "rowwise_with_gw_hp" linear recipe would instead scale
the dgrad weight tensorwise).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llm_training.layers.moe import _ContiguousGrad
from llm_training.quantization.emulation import emulated_grouped_mm, emulated_linear

GROUP_MULTIPLE = {"fp8_rowwise": 16, "mxfp8": 32, "fp8_blockwise": 128}  # token-group alignment of the kernel
# Every GEMM dim the CUDA kernels contract over must be a multiple of this (forward: in features; dgrad: out
# features; wgrad: tokens): one scale per row (16: the FP8 GEMM's 16-byte rule), per 32 or per 128 elements.
DIM_MULTIPLE = {"fp8_rowwise": 16, "mxfp8": 32, "fp8_blockwise": 128}
TORCHAO_INSTALL = "pip install torchao==0.18.0 (pinned by the repo's gpu and dev extras)"
# torchao 0.18 autotunes its three 1x128 activation-quantization kernels (lhs, rhs, transposed lhs) over 45 Triton
# configs (NUM_GROUPS 2..128 x 2/4/8 warps x 2/4/6 stages) for every K, and a first step compiles and times all of
# them: 16 s per kernel and K on the H200, and a first motif3_small fp8_blockwise step took 426 s. The kernels have no
# loop, so the stage count changes nothing. We keep four (NUM_GROUPS, num_warps) configs (1.2 s per kernel and K):
# at every K >= 4096 of the motif3_small and motif3 GEMMs the best of them is within 2.4% of the best of all 45
# (below 4096 every config times the ~90 us of the call's launch); bench/bench_blockwise_quant.py, H200:
# bench/results/bench_blockwise_quant.json.
BLOCKWISE_QUANT_CONFIGS = ((16, 8), (32, 4), (64, 2), (128, 8))
BLOCKWISE_QUANT_KERNELS = (
    "triton_fp8_blockwise_act_quant_lhs_kernel",
    "triton_fp8_blockwise_act_quant_rhs_kernel",
    "triton_fp8_blockwise_act_quant_transposed_lhs_kernel",
)


def trim_blockwise_quant_autotune() -> None:
    """Restrict torchao's blockwise activation-quantization autotuners to BLOCKWISE_QUANT_CONFIGS ((NUM_GROUPS,
    num_warps) pairs): the module-level Autotuner objects are shared, so this holds for every later call (eager, and the
    kernels torch.compile wraps, which read the configs when they are traced). Imports torchao."""
    import triton
    from torchao.prototype.blockwise_fp8_training import kernels as blockwise

    for name in BLOCKWISE_QUANT_KERNELS:
        autotuner = getattr(blockwise, name)
        autotuner.configs = [
            triton.Config({"NUM_GROUPS": g}, num_warps=w, num_stages=2) for g, w in BLOCKWISE_QUANT_CONFIGS
        ]
        autotuner.cache.clear()


def fits_cuda_kernel(recipe: str, *dims: int) -> bool:
    """Whether every GEMM dim (in and out features) meets the CUDA kernel's alignment."""
    return all(d % DIM_MULTIPLE[recipe] == 0 for d in dims)


def _pad_dim(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """t with zeros appended along `dim` up to a multiple of `multiple` (t itself when it is one already)."""
    extra = -t.shape[dim] % multiple
    if not extra:
        return t
    pad = [0, 0] * (t.dim() - dim % t.dim())
    pad[-1] = extra
    return torch.nn.functional.pad(t, pad)


def _column_major(b_EKN: torch.Tensor) -> torch.Tensor:
    """The per-expert column-major layout the scaled grouped GEMMs need for their right operand."""
    return b_EKN if b_EKN.stride(-2) == 1 else b_EKN.transpose(-2, -1).contiguous().transpose(-2, -1)


def zero_past_last_group(y_NO: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Rows past offs[-1] (the padding buffer's slack) are not written by the scaled grouped GEMMs: make them 0."""
    rows = torch.arange(y_NO.shape[0], device=y_NO.device)
    return torch.where((rows < offs_E[-1])[:, None], y_NO, torch.zeros((), dtype=y_NO.dtype, device=y_NO.device))


class _NoGradPastLastGroup(torch.autograd.Function):
    """Identity on x [N, K] whose backward zeroes the gradient rows past offs[-1] (the padding buffer's slack):
    the scaled grouped GEMMs never write those rows of dX (torchao's backward returns them uninitialised, whatever
    the allocator held), so without this they would reach whoever reads x's gradient as garbage."""

    @staticmethod
    def forward(ctx, x_NK, offs_E):
        ctx.save_for_backward(offs_E)
        return x_NK.view_as(x_NK)

    @staticmethod
    def backward(ctx, g_NK):
        (offs_E,) = ctx.saved_tensors
        return zero_past_last_group(g_NK, offs_E), None


def _float8_rowwise_configs():
    """(Float8LinearConfig, LinearMMConfig) of torchao's "rowwise" recipe, as Float8Linear builds them."""
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    c = Float8LinearConfig.from_recipe_name("rowwise")
    mm = LinearMMConfig(
        *(
            ScaledMMConfig(c.emulate, g.use_fast_accum, False, c.pad_inner_dim)
            for g in (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)
        )
    )
    return c, mm


def _torchao_linear(recipe: str, mx_wgrad_with_hp: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """x [N, K], w [O, K] -> x w^T [N, O] through torchao's quantized op of `recipe` (a low-precision wgrad,
    except mxfp8 with `mx_wgrad_with_hp`, torchao's own high-precision wgrad)."""
    if recipe == "fp8_rowwise":
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        config, mm_config = _float8_rowwise_configs()
        return lambda x_NK, w_OK: matmul_with_hp_or_float8_args.apply(x_NK, w_OK.t(), mm_config, config)
    if recipe == "mxfp8":
        from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common import KernelPreference

        return lambda x_NK, w_OK: _to_mxfp8_then_scaled_mm(
            x_NK, w_OK, KernelPreference.AUTO, ScaleCalculationMode.RCEIL, wgrad_with_hp=mx_wgrad_with_hp
        )
    from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

    trim_blockwise_quant_autotune()
    return lambda x_NK, w_OK: fp8_blockwise_mm.apply(x_NK, w_OK.contiguous(), 128, x_NK.dtype, False)


def _torchao_grouped_mm(
    recipe: str, mx_wgrad_with_hp: bool
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """x [N, K], b [E, K, O] (column-major per expert), offs [E] -> [N, O] per token group (groups already
    padded) through torchao's quantized grouped op of `recipe`; wgrad as in `_torchao_linear`."""
    if recipe == "fp8_rowwise":
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

        return lambda x, b, offs: _to_fp8_rowwise_then_scaled_grouped_mm(
            x, b, offs, out_dtype=x.dtype, pad_token_groups_for_grouped_mm=False
        )
    if recipe == "mxfp8":
        from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common import KernelPreference

        return lambda x, b, offs: _to_mxfp8_then_scaled_grouped_mm(
            x,
            b,
            offs,
            out_dtype=x.dtype,
            kernel_preference=KernelPreference.AUTO,
            wgrad_with_hp=mx_wgrad_with_hp,
            scale_calculation_mode=ScaleCalculationMode.RCEIL,
            pad_token_groups_for_grouped_mm=False,
        )
    from torchao.prototype.moe_training.blockwise_fp8.grouped_mm import _to_fp8_blockwise_then_scaled_grouped_mm

    trim_blockwise_quant_autotune()
    return lambda x, b, offs: _to_fp8_blockwise_then_scaled_grouped_mm(
        x, b, offs, out_dtype=x.dtype, block_size=128, pad_token_groups_for_grouped_mm=False
    )


class _HighPrecisionWeightGrad(torch.autograd.Function):
    """y = op(x, w[, offs]) with `op` a quantized GEMM (x w^T, per group when offs is given); dgrad through
    the same quantized op on (dy, w^T), wgrad dy^T x in the input's precision (torch._grouped_mm per group)."""

    @staticmethod
    def forward(ctx, x, w, offs, op):
        ctx.save_for_backward(x, w, offs)
        ctx.op = op
        with torch.no_grad():
            return op(x, w, offs)

    @staticmethod
    def backward(ctx, g):
        x, w, offs = ctx.saved_tensors
        g = g.contiguous()
        with torch.no_grad():
            grad_x = ctx.op(g, w.transpose(-2, -1), offs)
            if offs is None:
                grad_w = g.t() @ x
            else:
                grad_w = torch._grouped_mm(g.t(), x, offs=offs)
        return grad_x, grad_w.to(w.dtype), None, None


class RecipeKernels:
    """The linear and grouped GEMMs of one recipe, and the token-group alignment its grouped GEMM needs.
    `grouped_mm`'s rows past offs[-1] (the padding buffer's slack) give 0 and receive a zero gradient.

    `cuda`: bind torchao's CUDA ops now (imports torchao). That happens here, at conversion, and not on the first
    forward: a compiled block would otherwise trace the imports and the config construction on every compile.
    Inputs on CUDA need `cuda=True`; CPU inputs run the emulation either way."""

    def __init__(self, recipe: str, hp_weight_grad: bool, cuda: bool):
        self.recipe, self.hp_weight_grad = recipe, hp_weight_grad
        self.group_multiple = GROUP_MULTIPLE[recipe]
        self._cuda_linear = self._cuda_grouped_mm = None
        if cuda:
            native_hp = recipe == "mxfp8" and hp_weight_grad
            linear, grouped = _torchao_linear(recipe, native_hp), _torchao_grouped_mm(recipe, native_hp)

            def grouped_EOK(x_NK, w_EOK, offs_E):  # w as the module stores it; rows past the last group: y = 0, dx = 0
                x_NK = _NoGradPastLastGroup.apply(x_NK.contiguous(), offs_E)
                y_NO = grouped(x_NK, _column_major(w_EOK.transpose(-2, -1)), offs_E)
                return zero_past_last_group(y_NO, offs_E)

            if hp_weight_grad and not native_hp:
                self._cuda_linear = lambda x, w: _HighPrecisionWeightGrad.apply(
                    x, w, None, lambda a, b, _: linear(a, b)
                )
                self._cuda_grouped_mm = lambda x, w, offs: _HighPrecisionWeightGrad.apply(x, w, offs, grouped_EOK)
            else:
                self._cuda_linear, self._cuda_grouped_mm = linear, grouped_EOK

    def _require_cuda(self) -> None:
        if self._cuda_linear is None:
            raise RuntimeError(f"{self!r} got CUDA inputs but was built with cuda=False; build it with cuda=True")

    # On CUDA the output's gradient is made contiguous first: torchao's quantization kernels require it (the
    # stride-0 gradient of e.g. `.sum()` is not).
    # A linear whose tokens, in or out features miss the kernel's alignment (`DIM_MULTIPLE`: e.g. GDLA's wkv_a,
    # 576 outputs, under fp8_blockwise's 128) runs on zero-padded operands, sliced back: zero rows and columns add
    # nothing to any product and get no gradient through the slice, and a block's scale is its largest |value|, so
    # the real elements quantize as without padding (the emulation pads the same way for its scales, so on CPU
    # the padded GEMM equals the unpadded one). The copies cost one pass over each padded operand.
    def linear(self, x_NK: torch.Tensor, w_OK: torch.Tensor) -> torch.Tensor:
        m = DIM_MULTIPLE[self.recipe]
        (N, _), O = x_NK.shape, w_OK.shape[0]
        x_NK = _pad_dim(_pad_dim(x_NK, 0, m), 1, m)
        w_OK = _pad_dim(_pad_dim(w_OK, 0, m), 1, m)
        if x_NK.is_cuda:
            self._require_cuda()
            y = _ContiguousGrad.apply(self._cuda_linear(x_NK, w_OK))
        else:
            y = emulated_linear(x_NK, w_OK, self.recipe, self.hp_weight_grad)
        return y if y.shape == (N, O) else y[:N, :O]

    def grouped_mm(self, x_NK: torch.Tensor, w_EOK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        if x_NK.is_cuda:
            self._require_cuda()
            return _ContiguousGrad.apply(self._cuda_grouped_mm(x_NK, w_EOK, offs_E))
        return emulated_grouped_mm(x_NK, w_EOK, offs_E, self.recipe, self.hp_weight_grad)

    def __repr__(self) -> str:
        return f"RecipeKernels({self.recipe!r}, hp_weight_grad={self.hp_weight_grad})"


def torchao_problem() -> str | None:
    """Why torchao 0.18's low-precision training modules cannot be imported, or None."""
    try:
        import torchao  # noqa: F401
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args  # noqa: F401
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install raising at import
        return f"torchao is not importable ({type(e).__name__}: {e}); install it: {TORCHAO_INSTALL}"
    return None


__all__ = [
    "BLOCKWISE_QUANT_CONFIGS",
    "DIM_MULTIPLE",
    "GROUP_MULTIPLE",
    "RecipeKernels",
    "fits_cuda_kernel",
    "torchao_problem",
    "trim_blockwise_quant_autotune",
]
