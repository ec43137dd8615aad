"""Emulated low-precision GEMMs: quantize-dequantize with each recipe's exact scaling rules, then fp32 GEMMs.

This is the CPU path of every recipe (so CI checks the converted model's numerics) and the reference the GPU
kernels are tested against (`tests/quantization/test_quantization_gpu.py`). A quantizer returns the fp32 tensor
its low-precision encoding decodes to (the values a real kernel multiplies), so an emulated GEMM differs from
the real one only by fp32 accumulation order.

Scaling rules (docs/model-spec.md §9; E4M3: max 448, 3 mantissa bits, so one element's relative rounding error is at
most 2^-4):
  * rowwise   one scale per row along the GEMM's reduction dim: s = 448 / max(amax, 1e-12) rounded DOWN to a
              power of two (torchao float8 "rowwise", `round_scales_to_power_of_2`); q = sat_e4m3(x s) / s.
  * blockwise activations / gradients in 1x128 tiles along the reduction dim, weights in 128x128 blocks;
              fp32 scale s = amax / 448 (DeepSeek-V3); q = sat_e4m3(x / s) s.
  * mx        32 consecutive elements along the reduction dim share an E8M0 scale 2^e,
              e = clamp(ceil(log2(amax / 448)), -127, 127) ("rceil", the Blackwell hardware rule torchao uses);
              q = sat_e4m3(x / 2^e) 2^e.
Dims that are not a multiple of the tile / block are zero-padded for the scale computation (the GPU kernels
need whole tiles: `RecipeKernels.linear` pads a linear's operands before either path, with the same result).

Each GEMM quantizes its two operands along ITS reduction dim (fprop Y = X W^T over K, dgrad dX = dY W over
the output features, wgrad dW = dY^T X over the tokens), requantizing from high precision each time (never
transposing a quantized tensor). With `hp_weight_grad` the wgrad GEMM runs unquantized.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llm_training.autograd_output import function_output

E4M3_MAX = 448.0
AMAX_EPS = 1e-12
MX_BLOCK = 32
FP8_TILE = 128


def _sat_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest E4M3 number, saturating at +-448 (fp32 container)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def quantize_rowwise(x: torch.Tensor, dim: int) -> torch.Tensor:
    """E4M3 with one power-of-two scale per slice along `dim` (the reduction dim)."""
    x = x.float()
    amax = x.abs().amax(dim=dim, keepdim=True).double().clamp_min(AMAX_EPS)
    scale = torch.exp2(torch.floor(torch.log2((E4M3_MAX / amax).float())))
    return _sat_e4m3(x * scale) / scale


def _blocks_along(x: torch.Tensor, dim: int, block: int) -> tuple[torch.Tensor, int]:
    """View `x` (fp32) with `dim` moved last and split into [..., n_blocks, block] (zero-padded); returns it
    and the original size of `dim`."""
    x = x.float().movedim(dim, -1)
    size = x.shape[-1]
    pad = (-size) % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, block), size


def _unblock(q: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    return q.reshape(*q.shape[:-2], -1)[..., :size].movedim(-1, dim)


def quantize_tiles(x: torch.Tensor, dim: int, tile: int = FP8_TILE) -> torch.Tensor:
    """E4M3 with an fp32 scale amax / 448 per 1 x `tile` tile along `dim` (activations and gradients)."""
    xb, size = _blocks_along(x, dim, tile)
    scale = xb.abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_EPS) / E4M3_MAX
    return _unblock(_sat_e4m3(xb / scale) * scale, dim, size)


def quantize_blocks_2d(w: torch.Tensor, block: int = FP8_TILE) -> torch.Tensor:
    """E4M3 with an fp32 scale amax / 448 per `block` x `block` block of the last two dims (weights)."""
    w = w.float()
    rows, cols = w.shape[-2:]
    pr, pc = (-rows) % block, (-cols) % block
    wp = torch.nn.functional.pad(w, (0, pc, 0, pr)) if (pr or pc) else w
    R, C = wp.shape[-2] // block, wp.shape[-1] // block
    wb = wp.reshape(*wp.shape[:-2], R, block, C, block)
    scale = wb.abs().amax(dim=(-3, -1), keepdim=True).clamp_min(AMAX_EPS) / E4M3_MAX
    q = (_sat_e4m3(wb / scale) * scale).reshape(wp.shape)
    return q[..., :rows, :cols]


def quantize_mx(x: torch.Tensor, dim: int, block: int = MX_BLOCK) -> torch.Tensor:
    """MXFP8: E4M3 elements, one E8M0 scale 2^e per `block` elements along `dim` ("rceil" rule)."""
    xb, size = _blocks_along(x, dim, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    e = torch.clamp(torch.ceil(torch.log2(amax / E4M3_MAX)), -127, 127)
    # e = -127 (amax ~ 0) is E8M0's smallest scale; torchao then multiplies by 1 instead of 2^127
    inv_scale = torch.where(e == -127, torch.ones_like(e), torch.exp2(-e))
    q = _sat_e4m3(xb * inv_scale) * torch.exp2(e)
    return _unblock(q, dim, size)


class Scheme:
    """How one recipe quantizes a GEMM operand along the GEMM's reduction dim: `act` for activations and
    gradients, `weight` for weights."""

    def __init__(
        self, act: Callable[[torch.Tensor, int], torch.Tensor], weight: Callable[[torch.Tensor, int], torch.Tensor]
    ):
        self.act, self.weight = act, weight


SCHEMES = {
    "fp8_rowwise": Scheme(quantize_rowwise, quantize_rowwise),
    "fp8_blockwise": Scheme(quantize_tiles, lambda w, dim: quantize_blocks_2d(w)),
    "mxfp8": Scheme(quantize_mx, quantize_mx),
}


class _EmulatedLinear(torch.autograd.Function):
    """y = x W^T with the three GEMMs on quantized operands. x [N, K], w [O, K] -> y [N, O] in x's dtype."""

    @staticmethod
    def forward(ctx, x_NK, w_OK, scheme: Scheme, hp_weight_grad: bool):
        ctx.save_for_backward(x_NK, w_OK)
        ctx.scheme, ctx.hp_weight_grad = scheme, hp_weight_grad
        return function_output(scheme.act(x_NK, 1) @ scheme.weight(w_OK, 1).t(), x_NK.dtype)

    @staticmethod
    def backward(ctx, g_NO):
        x_NK, w_OK = ctx.saved_tensors
        s = ctx.scheme
        g = g_NO.float()
        grad_x = (s.act(g, 1) @ s.weight(w_OK, 0)).to(x_NK.dtype)  # reduction over O
        if ctx.hp_weight_grad:
            grad_w = g.t() @ x_NK.float()
        else:
            grad_w = s.act(g, 0).t() @ s.act(x_NK, 0)  # reduction over the tokens
        return grad_x, grad_w.to(w_OK.dtype), None, None


def emulated_linear(x_NK: torch.Tensor, w_OK: torch.Tensor, recipe: str, hp_weight_grad: bool = False) -> torch.Tensor:
    """Differentiable emulated low-precision `x W^T` under `recipe`."""
    return _EmulatedLinear.apply(x_NK, w_OK, SCHEMES[recipe], hp_weight_grad)


def emulated_grouped_mm(
    x_NK: torch.Tensor, w_EOK: torch.Tensor, offs_E: torch.Tensor, recipe: str, hp_weight_grad: bool = False
) -> torch.Tensor:
    """Per expert e: rows offs[e-1]:offs[e] of x times w[e]^T, each group quantized on its own (the grouped
    kernels' per-group scales); rows past offs[-1] give 0. Reads the group sizes on the host (CPU path)."""
    ends = offs_E.tolist()
    outs, start = [], 0
    for e, end in enumerate(ends):
        if end > start:
            outs.append(emulated_linear(x_NK[start:end], w_EOK[e], recipe, hp_weight_grad))
        start = end
    outs.append(x_NK.new_zeros(x_NK.shape[0] - start, w_EOK.shape[1]))
    return torch.cat(outs, dim=0)


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref||_F / ||ref||_F in fp64."""
    ref = ref.detach().double()
    return float((y.detach().double() - ref).norm() / ref.norm().clamp_min(1e-30))


__all__ = [
    "E4M3_MAX",
    "SCHEMES",
    "emulated_grouped_mm",
    "emulated_linear",
    "quantize_blocks_2d",
    "quantize_mx",
    "quantize_rowwise",
    "quantize_tiles",
    "relative_error",
]
