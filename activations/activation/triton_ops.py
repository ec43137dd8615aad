"""Triton backend as `torch.library` custom ops (`torch.ops.activation.*`) with fake and autograd rules.

Wrapping the kernels as custom ops makes them opaque, shape-known nodes for `torch.compile` (no graph
break, inductor fuses around them) and gives them autograd without an `autograd.Function`. Defining the
ops does not import triton: the kernels module is imported on the first real (non-fake) call, so this
module is safe to import on a CPU-only machine. Entry points `rms_norm_rows` / `poly_norm_rows` mirror
`reference.py`. (No `from __future__ import annotations` here: the op schemas are inferred from
the annotations.)
"""

from typing import Optional

import torch
from torch import Tensor

from .triton_prebuild import capture_launches


def _kernels():
    from . import triton_kernels  # imports triton

    return triton_kernels


# ------------------------------------------------------------------------------------------- RMSNorm
@torch.library.custom_op("activation::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(y, x + residual (empty without residual), rstd fp32 [N]) for 2-D x [N, D]."""
    return _kernels().rms_norm_fwd(x, residual, weight, eps)


@rms_norm_fwd.register_fake
def _rms_norm_fwd_fake(x, residual, weight, eps):
    capture_launches(lambda: _kernels().rms_norm_fwd(x, residual, weight, eps), x, what="rms_norm_fwd")
    n, d = x.shape
    h = x.new_empty((n, d)) if residual is not None else x.new_empty((0,))
    return x.new_empty((n, d)), h, x.new_empty((n,), dtype=torch.float32)


@torch.library.custom_op("activation::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: Tensor, dh: Optional[Tensor], h: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """(dL/dh (plus the direct gradient dh of the x + residual output), dL/dweight fp32)."""
    dx, dw = _kernels().rms_norm_bwd(dy, dh, h, weight, rstd)
    return dx, dw.to(weight.dtype)


@rms_norm_bwd.register_fake
def _rms_norm_bwd_fake(dy, dh, h, weight, rstd):
    capture_launches(lambda: _kernels().rms_norm_bwd(dy, dh, h, weight, rstd), h, what="rms_norm_bwd")
    return h.new_empty(h.shape), weight.new_empty(weight.shape)


def _rms_setup_context(ctx, inputs, output):
    x, residual, weight, _eps = inputs
    _y, h, rstd = output
    ctx.has_residual = residual is not None
    ctx.save_for_backward(h if ctx.has_residual else x, weight, rstd)


def _rms_backward(ctx, dy, dh, _drstd):
    h, weight, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(h)
    dx, dw = torch.ops.activation.rms_norm_bwd(dy, dh if ctx.has_residual else None, h, weight, rstd)
    return dx, (dx if ctx.has_residual else None), dw, None


rms_norm_fwd.register_autograd(_rms_backward, setup_context=_rms_setup_context)


# ------------------------------------------------------------------------------------------ PolyNorm
@torch.library.custom_op("activation::poly_norm_fwd", mutates_args=())
def poly_norm_fwd(
    x: Tensor,
    up: Optional[Tensor],
    weight: Tensor,
    bias: Tensor,
    offs: Optional[Tensor],
    eps: float,
    output_scale: float,
) -> tuple[Tensor, Tensor]:
    """(out [N, D] in x's dtype, rstd fp32 [N, 3]); see `reference.PolyNormFn` for the semantics."""
    return _kernels().poly_norm_fwd(x, up, weight, bias, offs, eps, output_scale)


@poly_norm_fwd.register_fake
def _poly_norm_fwd_fake(x, up, weight, bias, offs, eps, output_scale):
    launch = lambda: _kernels().poly_norm_fwd(x, up, weight, bias, offs, eps, output_scale)
    capture_launches(launch, x, what="poly_norm_fwd")
    n, d = x.shape
    return x.new_empty((n, d)), x.new_empty((n, 3), dtype=torch.float32)


@torch.library.custom_op("activation::poly_norm_bwd", mutates_args=())
def poly_norm_bwd(
    dy: Tensor,
    x: Tensor,
    up: Optional[Tensor],
    weight: Tensor,
    bias: Tensor,
    offs: Optional[Tensor],
    rstd: Tensor,
    output_scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dup (empty without up), dweight [E, 3], dbias [E, 1]) of the effective coefficients."""
    dx, dup, per_expert_E4 = _kernels().poly_norm_bwd(dy, x, up, weight, bias, offs, rstd, output_scale)
    return dx, dup, per_expert_E4[:, :3].to(weight.dtype).clone(), per_expert_E4[:, 3:].to(bias.dtype).clone()


@poly_norm_bwd.register_fake
def _poly_norm_bwd_fake(dy, x, up, weight, bias, offs, rstd, output_scale):
    launch = lambda: _kernels().poly_norm_bwd(dy, x, up, weight, bias, offs, rstd, output_scale)
    capture_launches(launch, x, what="poly_norm_bwd")
    n, d = x.shape
    dup = up.new_empty((n, d)) if up is not None else x.new_empty((0,))
    return x.new_empty((n, d)), dup, weight.new_empty(weight.shape), bias.new_empty(bias.shape)


def _poly_setup_context(ctx, inputs, output):
    x, up, weight, bias, offs, _eps, output_scale = inputs
    _out, rstd = output
    ctx.output_scale = output_scale
    ctx.has_up = up is not None
    ctx.save_for_backward(x, up, weight, bias, offs, rstd)


def _poly_backward(ctx, dout, _drstd):
    x, up, weight, bias, offs, rstd = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(x)
    dx, dup, dw, db = torch.ops.activation.poly_norm_bwd(dout, x, up, weight, bias, offs, rstd, ctx.output_scale)
    return dx, (dup if ctx.has_up else None), dw, db, None, None, None


poly_norm_fwd.register_autograd(_poly_backward, setup_context=_poly_setup_context)


# ------------------------------------------------------------------------------ backend entry points
def rms_norm_rows(x_ND, residual_ND, weight_D, eps):
    """Backend entry (same signature as `reference.rms_norm_rows`): y, or (y, h) with a residual."""
    y, h, _rstd = torch.ops.activation.rms_norm_fwd(x_ND, residual_ND, weight_D, eps)
    return (y, h) if residual_ND is not None else y


def poly_norm_rows(x_ND, up_ND, weight_E3, bias_E1, offs_E, eps, output_scale):
    """Backend entry (same signature as `reference.poly_norm_rows`)."""
    out, _rstd = torch.ops.activation.poly_norm_fwd(x_ND, up_ND, weight_E3, bias_E1, offs_E, eps, output_scale)
    return out
