"""Public ops: argument checks, parameter transforms (sigmoid, bias clamp, fp32 cast) and dispatch.

The parameter transforms run here in plain torch on the tiny parameter tensors, so autograd chains
through them exactly; both backends then receive fp32 effective coefficients and 2-D row views.
"""

from __future__ import annotations

import torch

from . import reference, triton_ops
from .backend import use_triton


def _backend(x: torch.Tensor):
    """`triton_ops` (custom ops; triton itself is imported on their first real call) or `reference`."""
    return triton_ops if use_triton(x) else reference


def _rows(t: torch.Tensor, name: str, op: str) -> torch.Tensor:
    """2-D [N, D] view of `t` with unit stride along D (copies only if the last dim is strided)."""
    if t.dim() == 0:
        raise ValueError(f"{op}: `{name}` must have at least 1 dimension (features last), got a scalar")
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_shape(t: torch.Tensor, shape: tuple, name: str, op: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: `{name}` must have shape {list(shape)}, got {list(t.shape)}")


def _check_floating(x: torch.Tensor, name: str, op: str) -> None:
    if not x.is_floating_point():
        raise TypeError(f"{op}: `{name}` must be a floating tensor, got {x.dtype}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x * rsqrt(mean(x^2, -1) + eps) * weight, fp32 inside, returned in x.dtype."""
    _check_floating(x, "x", "rms_norm")
    _check_shape(weight, (x.shape[-1],), "weight", "rms_norm")
    y_ND = _backend(x).rms_norm_rows(_rows(x, "x", "rms_norm"), None, weight.to(_math_dtype(x)), float(eps))
    return y_ND.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; gradients flow to both x and residual."""
    op = "fused_add_rms_norm"
    _check_floating(x, "x", op)
    _check_shape(residual, tuple(x.shape), "residual", op)
    if residual.dtype != x.dtype:
        raise TypeError(f"{op}: `residual` dtype {residual.dtype} must equal `x` dtype {x.dtype}; cast one of them")
    _check_shape(weight, (x.shape[-1],), "weight", op)
    y_ND, h_ND = _backend(x).rms_norm_rows(
        _rows(x, "x", op), _rows(residual, "residual", op), weight.to(_math_dtype(x)), float(eps)
    )
    return y_ND.view(x.shape), h_ND.view(x.shape)


def _effective_poly_params(weight, bias, dtype, sigmoid_weight, bias_clamp):
    weight = weight.to(dtype)
    bias = bias.to(dtype)
    if sigmoid_weight:
        weight = torch.sigmoid(weight)
    if bias_clamp is not None:
        bias = bias.clamp(-bias_clamp, bias_clamp)  # zero gradient outside the range, as docs/model-spec.md §1.1 asks
    return weight, bias


def poly_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6, sigmoid_weight: bool = True
) -> torch.Tensor:
    """PolyNorm(x) = w0 N(x^3) + w1 N(x^2) + w2 N(x) + b over the last dim (w = sigmoid(weight) if asked)."""
    op = "poly_norm"
    _check_floating(x, "x", op)
    _check_shape(weight, (3,), "weight", op)
    _check_shape(bias, (1,), "bias", op)
    w, b = _effective_poly_params(weight, bias, _math_dtype(x), sigmoid_weight, None)
    y_ND = _backend(x).poly_norm_rows(_rows(x, "x", op), None, w.view(1, 3), b.view(1, 1), None, float(eps), 1.0)
    return y_ND.view(x.shape)


def fused_mul_poly_norm(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-6,
    sigmoid_weight: bool = True,
    output_scale: float = 1.0,
) -> torch.Tensor:
    """(PolyNorm(gate) * up computed in fp32).to(gate.dtype) * output_scale (scale AFTER the cast)."""
    op = "fused_mul_poly_norm"
    _check_floating(gate, "gate", op)
    _check_shape(up, tuple(gate.shape), "up", op)
    _check_shape(weight, (3,), "weight", op)
    _check_shape(bias, (1,), "bias", op)
    w, b = _effective_poly_params(weight, bias, _math_dtype(gate), sigmoid_weight, None)
    y_ND = _backend(gate).poly_norm_rows(
        _rows(gate, "gate", op), _rows(up, "up", op), w.view(1, 3), b.view(1, 1), None, float(eps), float(output_scale)
    )
    return y_ND.view(gate.shape)


def grouped_poly_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    offs: torch.Tensor,
    eps: float = 1e-6,
    sigmoid_weight: bool = True,
    bias_clamp: float | None = None,
    up: torch.Tensor | None = None,
    output_scale: float = 1.0,
) -> torch.Tensor:
    """Per-expert PolyNorm of x[T, D]; row t uses expert e with offs[e-1] <= t < offs[e].

    Rows at/after offs[-1] give 0 (and zero gradients). The bias is clamped to +-bias_clamp in the forward
    when given. With `up` the result is the fused form (P(x) * up in fp32).to(x.dtype) * output_scale;
    without it, P(x).to(x.dtype) * output_scale.
    """
    op = "grouped_poly_norm"
    _check_floating(x, "x", op)
    if x.dim() != 2:
        raise ValueError(f"{op}: `x` must be [T, D] (rows grouped by expert), got shape {list(x.shape)}")
    if offs.dim() != 1 or offs.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{op}: `offs` must be a 1-D int32/int64 tensor of cumulative row ends, got {offs.dtype} "
            f"shape {list(offs.shape)}"
        )
    if offs.device != x.device:
        raise ValueError(f"{op}: `offs` is on {offs.device} but `x` on {x.device}; move offs to x's device")
    num_experts = offs.shape[0]
    _check_shape(weight, (num_experts, 3), "weight", op)
    _check_shape(bias, (num_experts, 1), "bias", op)
    if up is not None:
        _check_shape(up, tuple(x.shape), "up", op)
    if bias_clamp is not None and not bias_clamp > 0:
        raise ValueError(f"{op}: `bias_clamp` must be positive or None, got {bias_clamp}")
    w, b = _effective_poly_params(weight, bias, _math_dtype(x), sigmoid_weight, bias_clamp)
    return _backend(x).poly_norm_rows(
        _rows(x, "x", op), None if up is None else _rows(up, "up", op), w, b, offs, float(eps), float(output_scale)
    )
