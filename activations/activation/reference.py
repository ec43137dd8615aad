"""PyTorch reference backend: custom autograd Functions with the analytic backward of docs/model-spec.md §1.1.

Every Function here works on 2-D row-major views (`x_ND`: N rows, D features), computes in fp32 and
saves only the input(s) plus per-row fp32 inverse RMS values (`rstd_N` / `rstd_N3`); everything else is
recomputed in the backward. The parameter transforms (sigmoid of the PolyNorm weights, the bias clamp,
the fp32 cast of the weights) happen OUTSIDE these Functions in plain torch (see `api.py`), so autograd
chains through them exactly and the Functions only ever see fp32 "effective" coefficients.

PolyNorm notation (per row): `N(u) = u * rsqrt(mean(u^2) + eps)`, `r_p = rsqrt(mean(x^(2p)) + eps)`,
`P(x) = w0 * x^3 r_3 + w1 * x^2 r_2 + w2 * x r_1 + b` with effective weights `w` (after sigmoid).
"""

from __future__ import annotations

import torch

from .segments import expert_of_row, segment_sum_rows


def upcast(t: torch.Tensor) -> torch.Tensor:
    """The math dtype: fp32, or fp64 for fp64 inputs (so `gradcheck` can run in double precision)."""
    return t if t.dtype == torch.float64 else t.float()


def function_output(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype` as a tensor distinct from t: the cast, or a copy when the dtype already matches. torch 2.11
    computes wrong gradients under torch.compile for an autograd.Function that returns an intermediate unchanged
    (a same-dtype `.to()` of it, or a tensor it also saved for backward); torch 2.13 is correct."""
    return t.to(dtype) if t.dtype != dtype else t.clone()


# ----------------------------------------------------------------------------------------- RMSNorm
def rms_forward_math(h_ND: torch.Tensor, weight_D: torch.Tensor, eps: float):
    """fp32 RMSNorm of the rows of `h_ND`; returns (y_ND fp32, rstd_N1 fp32)."""
    h32 = upcast(h_ND)
    rstd_N1 = torch.rsqrt(h32.square().mean(-1, keepdim=True) + eps)
    return h32 * rstd_N1 * weight_D, rstd_N1


def rms_backward_math(h_ND, weight_D, rstd_N1, dy_ND):
    """Analytic RMSNorm backward: returns (dh_ND fp32, per-row weight-grad rows dw_ND fp32)."""
    h32, g32 = upcast(h_ND), upcast(dy_ND)
    gw = g32 * weight_D
    mean_gwh_N1 = (gw * h32).mean(-1, keepdim=True)
    dh = rstd_N1 * gw - rstd_N1.pow(3) * mean_gwh_N1 * h32
    return dh, g32 * h32 * rstd_N1


class RMSNormFn(torch.autograd.Function):
    """y = h * rsqrt(mean(h^2) + eps) * weight; optional residual add fused in front (h = x + residual)."""

    @staticmethod
    def forward(ctx, x_ND, residual_ND, weight32_D, eps):
        h_ND = x_ND if residual_ND is None else x_ND + residual_ND
        y32, rstd_N1 = rms_forward_math(h_ND, weight32_D, eps)
        ctx.save_for_backward(h_ND, weight32_D, rstd_N1)
        ctx.has_residual = residual_ND is not None
        y = function_output(y32, x_ND.dtype)
        return (y, function_output(h_ND, h_ND.dtype)) if ctx.has_residual else y  # h_ND is saved too

    @staticmethod
    def backward(ctx, dy_ND, *maybe_dh):
        h_ND, weight32_D, rstd_N1 = ctx.saved_tensors
        dh32, dw_rows = rms_backward_math(h_ND, weight32_D, rstd_N1, dy_ND)
        if ctx.has_residual and maybe_dh[0] is not None:
            dh32 = dh32 + upcast(maybe_dh[0])
        dh = dh32.to(h_ND.dtype)
        dw = dw_rows.sum(0)
        return dh, (dh if ctx.has_residual else None), dw, None


# ---------------------------------------------------------------------------------------- PolyNorm
def poly_forward_math(x_ND, w_K3, b_K1, eps: float):
    """fp32 PolyNorm. `w_K3`/`b_K1` hold one row of coefficients (K = 1) or one per row (K = N).

    Returns (p_ND fp32, rstd_N3 fp32 with columns r_1, r_2, r_3)."""
    x = upcast(x_ND)
    x2 = x * x
    x3 = x2 * x
    rstd_N3 = torch.stack([x2.mean(-1), (x2 * x2).mean(-1), (x3 * x3).mean(-1)], dim=-1).add_(eps).rsqrt_()
    p = poly_from_rstd(x, rstd_N3, w_K3, b_K1)
    return p, rstd_N3


def poly_from_rstd(x32_ND, rstd_N3, w_K3, b_K1):
    """Recompute P(x) from saved per-row r_p (cheap; used by the fused backward for d(up))."""
    x = x32_ND
    r1, r2, r3 = rstd_N3[:, 0:1], rstd_N3[:, 1:2], rstd_N3[:, 2:3]
    return (w_K3[:, 0:1] * r3) * (x * x * x) + (w_K3[:, 1:2] * r2) * (x * x) + (w_K3[:, 2:3] * r1) * x + b_K1


def poly_backward_math(x_ND, rstd_N3, w_K3, g32_ND):
    """Analytic PolyNorm backward for upstream gradient `g32_ND` = dL/dP (fp32).

    Returns (dx_ND fp32, stats_N4 fp32) where stats rows are the per-row contributions to
    (dL/dw0, dL/dw1, dL/dw2, dL/db) of the EFFECTIVE weights: D * r_p * mean(g x^p) and sum(g)."""
    x = upcast(x_ND)
    g = g32_ND
    x2 = x * x
    x3 = x2 * x
    r1, r2, r3 = rstd_N3[:, 0:1], rstd_N3[:, 1:2], rstd_N3[:, 2:3]
    s1 = (g * x).mean(-1, keepdim=True)
    s2 = (g * x2).mean(-1, keepdim=True)
    s3 = (g * x3).mean(-1, keepdim=True)
    w0, w1, w2 = w_K3[:, 0:1], w_K3[:, 1:2], w_K3[:, 2:3]
    # d/dx of w * x^p * r_p (r_p depends on the row): a r_p p x^(p-1) - r_p^3 mean(a x^p) p x^(2p-1), a = w g.
    dx = (w2 * r1) * (g - (r1 * r1 * s1) * x)
    dx = dx + (2.0 * w1 * r2) * (x * g - (r2 * r2 * s2) * x3)
    dx = dx + (3.0 * w0 * r3) * (x2 * g - (r3 * r3 * s3) * (x3 * x2))
    d = x.shape[-1]
    stats_N4 = torch.cat([d * r3 * s3, d * r2 * s2, d * r1 * s1, g.sum(-1, keepdim=True)], dim=-1)
    return dx, stats_N4


def _row_coefficients(x_ND, weight32_E3, bias32_E1, offs_E):
    """Per-row view of the coefficients: (x with padding rows zeroed, w_K3, b_K1, valid_N1, expert_N).

    Dense (offs None): K = 1, shared coefficients, valid_N1 and expert_N None. Grouped: K = N, gathered
    by each row's expert (expert_N, E for padding); rows at/after offs[-1] are zeroed with `where` (not a
    product: padding rows may hold inf/nan)."""
    if offs_E is None:
        return x_ND, weight32_E3, bias32_E1, None, None
    num_experts = weight32_E3.shape[0]
    expert_N = expert_of_row(offs_E, x_ND.shape[0])
    valid_N1 = (expert_N < num_experts).unsqueeze(-1)
    safe_N = expert_N.clamp(max=num_experts - 1)
    x_safe = torch.where(valid_N1, x_ND, torch.zeros((), dtype=x_ND.dtype, device=x_ND.device))
    return x_safe, weight32_E3[safe_N], bias32_E1[safe_N], valid_N1, expert_N


class PolyNormFn(torch.autograd.Function):
    """out = (P(x) [* up] in fp32).to(x.dtype) * output_scale, per-row or shared effective coefficients.

    weight32_E3 / bias32_E1: fp32 effective coefficients (sigmoid / clamp already applied).
    offs_E: None for the dense op (E must be 1); else int cumulative row ends (grouped op): row t uses
    expert e with offs[e-1] <= t < offs[e]; rows >= offs[-1] give 0 and receive zero gradient.
    """

    @staticmethod
    def forward(ctx, x_ND, up_ND, weight32_E3, bias32_E1, offs_E, eps, output_scale):
        x_safe, w_K3, b_K1, valid_N1, _expert_N = _row_coefficients(x_ND, weight32_E3, bias32_E1, offs_E)
        p, rstd_N3 = poly_forward_math(x_safe, w_K3, b_K1, eps)
        if up_ND is not None:
            p = p * upcast(up_ND)
        if valid_N1 is not None:
            p = torch.where(valid_N1, p, 0.0)
        out = function_output(p, x_ND.dtype)
        if output_scale != 1.0:
            out = out * output_scale  # after the down-cast (docs/model-spec.md §1.1 "order matters")
        ctx.save_for_backward(x_ND, up_ND, weight32_E3, bias32_E1, offs_E, rstd_N3)
        ctx.output_scale = output_scale
        return out

    @staticmethod
    def backward(ctx, dout_ND):
        x_ND, up_ND, weight32_E3, bias32_E1, offs_E, rstd_N3 = ctx.saved_tensors
        x_safe, w_K3, b_K1, valid_N1, expert_N = _row_coefficients(x_ND, weight32_E3, bias32_E1, offs_E)
        g = upcast(dout_ND) * ctx.output_scale
        if valid_N1 is not None:
            g = torch.where(valid_N1, g, 0.0)
        dup = None
        if up_ND is not None:
            p = poly_from_rstd(upcast(x_safe), rstd_N3, w_K3, b_K1)
            dup = (g * p).to(up_ND.dtype)
            g = g * upcast(up_ND)
            if valid_N1 is not None:
                g = torch.where(valid_N1, g, 0.0)
        dx, stats_N4 = poly_backward_math(x_safe, rstd_N3, w_K3, g)
        if offs_E is None:
            per_expert_E4 = stats_N4.sum(0, keepdim=True)
        else:
            per_expert_E4 = segment_sum_rows(stats_N4, expert_N, weight32_E3.shape[0])
        dw = per_expert_E4[:, :3].to(weight32_E3.dtype)
        db = per_expert_E4[:, 3:].to(bias32_E1.dtype)
        return dx.to(x_ND.dtype), dup, dw, db, None, None, None


# ------------------------------------------------------------------------------ backend entry points
def rms_norm_rows(x_ND, residual_ND, weight_D, eps):
    """Backend entry (same signature as `triton_ops.rms_norm_rows`): y, or (y, h) with a residual."""
    return RMSNormFn.apply(x_ND, residual_ND, weight_D, eps)


def poly_norm_rows(x_ND, up_ND, weight_E3, bias_E1, offs_E, eps, output_scale):
    """Backend entry (same signature as `triton_ops.poly_norm_rows`), see `PolyNormFn`."""
    return PolyNormFn.apply(x_ND, up_ND, weight_E3, bias_E1, offs_E, eps, output_scale)
