"""mHC: manifold-constrained hyper-connections around one sub-layer (model-spec §4.2 with the §0.1
corrections).

The residual is n streams, stored as one tensor X [B, S, n, H]. Per token:
    x~     = RMSNorm_gamma(vec(X))                     (over all n*H values, eps = mhc_eps), fp32
    p, q, R = proj_pre(x~), proj_post(x~), proj_res(x~)   (bias-free; R viewed [n, n])
    h_pre  = sigmoid(clamp(alpha_pre * p + bias_pre, +-10))
    h_post = c_post * sigmoid(clamp(alpha_post * q + bias_post, +-10)),   c_post = 1 + alpha_sched
    H_res  = Sinkhorn(alpha_res * R + bias_res)        (exp of the input clamped to +-20; rows then columns)
    sub-layer input = norm(sum_i h_pre[i] X[i])        (the block's own input/post-attention RMSNorm)
    X'[i]  = sum_j H_res[i, j] X[j] + h_post[i] * y    (fp32, cast back to X's dtype)
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from llm_training.layers.norms import RMSNorm
from llm_training.layers.projection import Fp32Projection

_SIGMOID_ARG_CLAMP = 10.0
_SINKHORN_EXP_CLAMP = 20.0
_SINKHORN_FLOOR = 1e-8


def sinkhorn(logits_NN: torch.Tensor, iters: int) -> torch.Tensor:
    """exp(clamp(Z, +-20)) then `iters` x {divide rows by max(rowsum, 1e-8); same for columns}, fp32."""
    m = torch.exp(logits_NN.float().clamp(-_SINKHORN_EXP_CLAMP, _SINKHORN_EXP_CLAMP))
    for _ in range(iters):
        m = m / m.sum(dim=-1, keepdim=True).clamp_min(_SINKHORN_FLOOR)
        m = m / m.sum(dim=-2, keepdim=True).clamp_min(_SINKHORN_FLOOR)
    return m


class MHC(nn.Module):
    """Coefficients (h_pre, h_post, H_res) from the streams, the collapse, and the stream update."""

    def __init__(
        self,
        hidden_size: int,
        n_streams: int,
        sinkhorn_iters: int,
        eps: float,
        identity_init: bool,
        h_post_alpha: float,
    ):
        super().__init__()
        n, nh = n_streams, n_streams * hidden_size
        self.n, self.sinkhorn_iters, self.identity_init = n, sinkhorn_iters, identity_init
        self.h_post_alpha = h_post_alpha  # c_post = 1 + h_post_alpha; the trainer schedules it
        self.norm = RMSNorm(nh, eps)
        self.proj_pre = Fp32Projection(nh, n)
        self.proj_post = Fp32Projection(nh, n)
        self.proj_res = Fp32Projection(nh, n * n)
        self.alpha_pre = nn.Parameter(torch.empty((), dtype=torch.float32))
        self.alpha_post = nn.Parameter(torch.empty((), dtype=torch.float32))
        self.alpha_res = nn.Parameter(torch.empty((), dtype=torch.float32))
        self.bias_pre = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.bias_post = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.bias_res = nn.Parameter(torch.empty(n, n, dtype=torch.float32))

    def init_weights(self) -> None:
        """identity_init False (published): alpha ~ N(0, 0.1^2), projections xavier-uniform, b_pre = b_post = 0,
        b_res ~ N(0, 0.1^2). True: alpha = 0, b_pre = logit(1/n), b_post = 0, b_res = -10 off the diagonal
        and 0 on it (H_res ~ I, collapse = mean); projections xavier-uniform either way (alpha = 0 mutes them)."""
        self.norm.init_weights()
        for proj in (self.proj_pre, self.proj_post, self.proj_res):
            nn.init.xavier_uniform_(proj.weight)
        with torch.no_grad():
            if self.identity_init:
                for a in (self.alpha_pre, self.alpha_post, self.alpha_res):
                    a.zero_()
                self.bias_pre.fill_(math.log((1.0 / self.n) / (1.0 - 1.0 / self.n)))
                self.bias_post.zero_()
                self.bias_res.fill_(-10.0).fill_diagonal_(0.0)
            else:
                for a in (self.alpha_pre, self.alpha_post, self.alpha_res):
                    a.normal_(0.0, 0.1)
                self.bias_pre.zero_()
                self.bias_post.zero_()
                self.bias_res.normal_(0.0, 0.1)

    def coefficients(self, x_BSnH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h_pre [B, S, n], h_post [B, S, n], H_res [B, S, n, n], all fp32.

        When autograd records, the computation is checkpointed (recomputed in backward): it is cheap
        (an [nH -> 2n + n^2] projection and n x n Sinkhorn steps) but would otherwise keep fp32 copies of
        the whole stream tensor and every Sinkhorn iterate alive (model-spec §4.2 "recompute")."""
        if torch.is_grad_enabled():
            return checkpoint(self._coefficients, x_BSnH, use_reentrant=False)
        return self._coefficients(x_BSnH)

    def _coefficients(self, x_BSnH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat = self.norm(x_BSnH.flatten(-2).float())  # fp32 [B, S, nH]
        p = self.proj_pre(flat)
        q = self.proj_post(flat)
        r = self.proj_res(flat).unflatten(-1, (self.n, self.n))
        c = _SIGMOID_ARG_CLAMP
        h_pre = torch.sigmoid((self.alpha_pre * p + self.bias_pre).clamp(-c, c))
        h_post = (1.0 + self.h_post_alpha) * torch.sigmoid((self.alpha_post * q + self.bias_post).clamp(-c, c))
        h_res = sinkhorn(self.alpha_res * r + self.bias_res, self.sinkhorn_iters)
        return h_pre, h_post, h_res

    @staticmethod
    def collapse(x_BSnH: torch.Tensor, h_pre_BSn: torch.Tensor) -> torch.Tensor:
        """sum_i h_pre[i] X[i] in fp32, returned in X's dtype: [B, S, H]."""
        return _CollapseStreams.apply(x_BSnH, h_pre_BSn)

    @staticmethod
    def update(
        x_BSnH: torch.Tensor, h_res_BSnn: torch.Tensor, h_post_BSn: torch.Tensor, y_BSH: torch.Tensor
    ) -> torch.Tensor:
        """X'[i] = sum_j H_res[i, j] X[j] + h_post[i] y, fp32 inside, X's dtype out."""
        return _MixStreams.apply(x_BSnH, h_res_BSnn, h_post_BSn, y_BSH)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


class _CollapseStreams(torch.autograd.Function):
    """u = sum_i h[i] X[i] computed in fp32; saves X in its own dtype (no fp32 copy kept for backward)."""

    @staticmethod
    def forward(ctx, x_BSnH, h_BSn):
        ctx.save_for_backward(x_BSnH, h_BSn)
        ct = _compute_dtype(x_BSnH)
        return torch.einsum("bsn,bsnh->bsh", h_BSn.to(ct), x_BSnH.to(ct)).to(x_BSnH.dtype)

    @staticmethod
    def backward(ctx, g_BSH):
        x, h = ctx.saved_tensors
        ct = _compute_dtype(x)
        g = g_BSH.to(ct)
        dx = (h.to(ct).unsqueeze(-1) * g.unsqueeze(-2)).to(x.dtype) if ctx.needs_input_grad[0] else None
        dh = torch.einsum("bsh,bsnh->bsn", g, x.to(ct)).to(h.dtype) if ctx.needs_input_grad[1] else None
        return dx, dh


class _MixStreams(torch.autograd.Function):
    """X'[i] = sum_j H[i, j] X[j] + p[i] y computed in fp32; saves X and y in their own dtype."""

    @staticmethod
    def forward(ctx, x_BSnH, h_res_BSnn, h_post_BSn, y_BSH):
        ctx.save_for_backward(x_BSnH, h_res_BSnn, h_post_BSn, y_BSH)
        ct = _compute_dtype(x_BSnH)
        mixed = torch.einsum("bsij,bsjh->bsih", h_res_BSnn.to(ct), x_BSnH.to(ct))
        return (mixed + h_post_BSn.to(ct).unsqueeze(-1) * y_BSH.to(ct).unsqueeze(-2)).to(x_BSnH.dtype)

    @staticmethod
    def backward(ctx, g_BSnH):
        x, h_res, h_post, y = ctx.saved_tensors
        ct = _compute_dtype(x)
        g = g_BSnH.to(ct)
        need = ctx.needs_input_grad
        dx = torch.einsum("bsij,bsih->bsjh", h_res.to(ct), g).to(x.dtype) if need[0] else None
        dh_res = torch.einsum("bsih,bsjh->bsij", g, x.to(ct)).to(h_res.dtype) if need[1] else None
        dh_post = torch.einsum("bsih,bsh->bsi", g, y.to(ct)).to(h_post.dtype) if need[2] else None
        dy = torch.einsum("bsi,bsih->bsh", h_post.to(ct), g).to(y.dtype) if need[3] else None
        return dx, dh_res, dh_post, dy
