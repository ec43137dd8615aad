"""mHC: manifold-constrained hyper-connections around one sub-layer (docs/model-spec.md §4.2 with the §0.1
corrections).

The residual is n streams, stored as one tensor X [B, S, n, H] in the compute dtype (bf16 under bf16
training, as docs/model-spec.md §4.2 "Numerics" says: only the math is fp32; an fp32 stream would double what a
block keeps, 32 KiB -> 64 KiB per token at H 4096, n 4, i.e. 8 -> 16 GiB per layer at 256K tokens). Per token:
    x~     = RMSNorm_gamma(vec(X))                     (over all n*H values, eps = mhc_eps), fp32
    p, q, R = proj_pre(x~), proj_post(x~), proj_res(x~)   (bias-free; R viewed [n, n])
    h_pre  = sigmoid(clamp(alpha_pre * p + bias_pre, +-10))
    h_post = c_post * sigmoid(clamp(alpha_post * q + bias_post, +-10)),   c_post = 1 + alpha_sched
    H_res  = Sinkhorn(alpha_res * R + bias_res)        (exp of the input clamped to +-20; rows then columns)
    sub-layer input = norm(sum_i h_pre[i] X[i])        (the block's own input/post-attention RMSNorm)
    X'[i]  = sum_j H_res[i, j] X[j] + h_post[i] * y    (fp32, cast back to X's dtype)

How it runs (the mHC paper's infrastructure remedies, arXiv 2512.24880: the norm reordered after the matmul,
fused pre/post work, recompute in backward):
  * The norm is folded into the GEMM: x~ W^T = rstd * (vec(X) (W * gamma)^T), so the three projections are one
    [nH -> 2n + n^2] GEMM on the bf16 stream itself (`projection.matmul_fp32`: tensor cores, fp32
    accumulation) and the norm is a per-token fp32 sum of squares; no fp32 copy of the n-wide stream exists.
    (Same math as the formula above; fp32 rounding differs in the last bits.)
  * `_StreamNormProjection`, `_CollapseStreams`, `_MixStreams` are autograd Functions that save only the bf16
    stream (one storage, shared), the sub-layer output y and per-token coefficients; fp32 values over the
    stream exist at most one stream ([..., H]) wide at a time in eager mode, and under torch.compile only in
    the registers of fused kernels.
  * The coefficient math on the [2n + n^2] projections (sigmoids, 20 Sinkhorn steps) is checkpointed: it
    keeps only its fp32 input, not the Sinkhorn iterates. On CUDA the Sinkhorn steps are one fused Triton
    kernel each way (`layers.sinkhorn`: an op torch.compile does not trace, whose backward recomputes the
    iterates in registers), which keeps about half of the nodes out of a compiled block's graph.
  * `[kernels] mhc_backward = "auto"` (the default) or "fused": on CUDA with triton, the collapse and mix Functions'
    backward runs one Triton kernel each over the stream instead of tensor ops (`layers.mhc_ops`,
    `layers.mhc_kernels`; on the H200: mix 1.31x, collapse 1.04x, the step 1.012x); elsewhere tensor ops.
    The norm + projection backward stays tensor ops (a fused kernel for it measured 0.83x and was removed).
  * Recompute of the mid-block stream: the stream after the attention update, X1 = mix(X0, H_res, h_post, y),
    is NOT saved: the FFN sub-layer's Functions get its `StreamSource` (X0 and the attention update's
    coefficients and output, which that update keeps anyway) and rebuild X1 in their backward. A block then
    keeps one n-wide stream (its input) instead of two: n*H*2 bytes per token per layer less.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from llm_training.autograd_output import function_output
from llm_training.layers import projection
from llm_training.layers.mhc import ops as mhc_ops
from llm_training.layers.norms import RMSNorm
from llm_training.layers.projection import Fp32Projection, matmul_fp32
from llm_training.layers.mhc.sinkhorn import sinkhorn

_SIGMOID_ARG_CLAMP = 10.0
_BACKWARD_CHUNK = 1 << 26  # fp32 elements of the projection's dx computed at a time (256 MiB)


class StreamSource(NamedTuple):
    """How a stream tensor was made: X = mix(x, h_res, h_post, y). Functions handed one save these (which the
    update that made X keeps anyway) instead of X and rebuild X in their backward."""

    x: torch.Tensor
    h_res: torch.Tensor
    h_post: torch.Tensor
    y: torch.Tensor


_NO_SOURCE = (None, None, None, None)


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
        fused_backward: bool = False,
    ):
        super().__init__()
        n, nh = n_streams, n_streams * hidden_size
        self.n, self.sinkhorn_iters, self.identity_init = n, sinkhorn_iters, identity_init
        # [kernels] mhc_backward auto / fused: the backward over the stream runs `layers.mhc_ops` where it can (CUDA +
        # triton: `mhc_ops.uses_stream_kernels`, checked per call)
        self.fused_backward = fused_backward
        self.h_post_alpha = h_post_alpha  # c_post = 1 + h_post_alpha; the trainer schedules it
        self.norm = RMSNorm(nh, eps)  # its gain is folded into the projection GEMM (module docstring)
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

    def coefficients(
        self, x_BSnH: torch.Tensor, source: StreamSource | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h_pre [B, S, n], h_post [B, S, n], H_res [B, S, n, n], all fp32. `source`: how x was made (then x is
        not kept for the backward; module docstring)."""
        pqr = self.projections(x_BSnH, source)
        if torch.is_grad_enabled():  # keep only pqr, not the Sinkhorn iterates
            return checkpoint(self._coefficients_from_projections, pqr, use_reentrant=False)
        return self._coefficients_from_projections(pqr)

    def projections(self, x_BSnH: torch.Tensor, source: StreamSource | None = None) -> torch.Tensor:
        """[p, q, vec(R)] = RMSNorm_gamma(vec(X)) [proj_pre; proj_post; proj_res]^T, fp32 [B, S, 2n + n^2]."""
        weights = (self.proj_pre.weight, self.proj_post.weight, self.proj_res.weight)
        return _StreamNormProjection.apply(x_BSnH, self.norm.weight, self.norm.eps, *weights, *(source or _NO_SOURCE))

    def _coefficients_from_projections(self, pqr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.n
        p, q, r = pqr[..., :n], pqr[..., n : 2 * n], pqr[..., 2 * n :].unflatten(-1, (n, n))
        c = _SIGMOID_ARG_CLAMP
        h_pre = torch.sigmoid((self.alpha_pre * p + self.bias_pre).clamp(-c, c))
        h_post = (1.0 + self.h_post_alpha) * torch.sigmoid((self.alpha_post * q + self.bias_post).clamp(-c, c))
        h_res = sinkhorn(self.alpha_res * r + self.bias_res, self.sinkhorn_iters)
        return h_pre, h_post, h_res

    @staticmethod
    def collapse(
        x_BSnH: torch.Tensor, h_pre_BSn: torch.Tensor, source: StreamSource | None = None, fused: bool = False
    ) -> torch.Tensor:
        """sum_i h_pre[i] X[i] in fp32, returned in X's dtype: [B, S, H]. `fused`: the backward runs the fused
        kernels (where `mhc_ops.uses_stream_kernels`)."""
        return _CollapseStreams.apply(x_BSnH, h_pre_BSn, fused, *(source or _NO_SOURCE))

    @staticmethod
    def update(
        x_BSnH: torch.Tensor,
        h_res_BSnn: torch.Tensor,
        h_post_BSn: torch.Tensor,
        y_BSH: torch.Tensor,
        source: StreamSource | None = None,
        fused: bool = False,
    ) -> torch.Tensor:
        """X'[i] = sum_j H_res[i, j] X[j] + h_post[i] y, fp32 inside, X's dtype out. `fused`: as in collapse."""
        return _MixStreams.apply(x_BSnH, h_res_BSnn, h_post_BSn, y_BSH, fused, *(source or _NO_SOURCE))


# ---------------------------------------------------------------------------------------------- math
# Plain tensor expressions over the n streams (n is small): each term is one stream [.., H]; products of a
# low-precision stream with an fp32 coefficient promote to fp32, so the fp32 values are one stream wide at a
# time in eager mode and live in registers of one fused kernel under torch.compile.


def _collapse(x_BSnH: torch.Tensor, h_BSn: torch.Tensor) -> torch.Tensor:
    acc = h_BSn[..., 0, None] * x_BSnH[..., 0, :]
    for i in range(1, x_BSnH.shape[-2]):
        acc = torch.addcmul(acc, h_BSn[..., i, None], x_BSnH[..., i, :])  # one op per term in eager mode
    return function_output(acc, x_BSnH.dtype)


def _mix(
    x_BSnH: torch.Tensor,
    h_BSnn: torch.Tensor,
    h_post_BSn: torch.Tensor | None = None,
    y_BSH: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """X'[i] = sum_j H[i, j] X[j] (+ h_post[i] y), fp32 inside, `out_dtype` (default X's dtype) out.

    Compiled: one broadcast product summed over j, which inductor unrolls per output element. The per-row form
    below compiles its `torch.stack` into a masked select over all n rows' chains for every element, an
    instruction-bound kernel (H200, tensor-op mHC backward, 16K tokens: 3.2 -> 0.7 ms per launch). Eager: per row,
    since the broadcast would materialise an fp32 [.., n, n, H] temporary."""
    if torch.compiler.is_compiling():
        acc = (h_BSnn.unsqueeze(-1) * x_BSnH.unsqueeze(-3)).sum(-2)
        if y_BSH is not None:
            acc = acc + h_post_BSn.unsqueeze(-1) * y_BSH.unsqueeze(-2)
        return function_output(acc, out_dtype or x_BSnH.dtype)
    n = x_BSnH.shape[-2]
    rows = []
    for i in range(n):
        acc = h_BSnn[..., i, 0, None] * x_BSnH[..., 0, :]
        for j in range(1, n):
            acc = torch.addcmul(acc, h_BSnn[..., i, j, None], x_BSnH[..., j, :])
        if y_BSH is not None:
            acc = torch.addcmul(acc, h_post_BSn[..., i, None], y_BSH)
        rows.append(acc.to(out_dtype or x_BSnH.dtype))
    return torch.stack(rows, dim=-2)


def _bmm_fp32(a_TnH: torch.Tensor, b_THm: torch.Tensor) -> torch.Tensor:
    """Batched a @ b with fp32 accumulation and output. bf16 operands are exact: tensor cores on CUDA
    (`torch.bmm(..., out_dtype=torch.float32)`); elsewhere exact math in promote(dtype, fp32)."""
    if projection.on_tensor_cores(a_TnH) and a_TnH.dtype == b_THm.dtype == torch.bfloat16:
        return projection.bmm_fp32_out(a_TnH, b_THm)
    ct = torch.promote_types(torch.promote_types(a_TnH.dtype, b_THm.dtype), torch.float32)
    return torch.bmm(a_TnH.to(ct), b_THm.to(ct))


def _rows(t: torch.Tensor, trailing: int) -> torch.Tensor:
    """Flatten the leading [B, S] of t into one token dimension, keeping `trailing` dims."""
    return t.reshape(-1, *t.shape[t.dim() - trailing :])


def _token_rows(t: torch.Tensor) -> torch.Tensor:
    """Flatten the leading [B, S] of a per-token tensor (stream [B, S, n, H], H_res [B, S, n, n], h [B, S, n],
    y [B, S, H]) into one token dimension."""
    return _rows(t, t.dim() - 2)


def _save_stream(ctx, x: torch.Tensor, fused: bool, source: tuple, *others: torch.Tensor | None) -> None:
    ctx.n_source = len(source)  # the source arguments get no gradient (they get it through X's own graph)
    ctx.from_source = len(source) > 0 and source[0] is not None  # (torch 2.11's dynamo cannot trace bool(tuple))
    ctx.fused = fused and mhc_ops.uses_stream_kernels(x)  # the backward runs the fused kernels (`layers.mhc_ops`)
    ctx.save_for_backward(*(source if ctx.from_source else (x,)), *others)


def _load_stream(ctx) -> tuple[torch.Tensor, tuple]:
    """(X, the other saved tensors), X rebuilt from its source when that was saved."""
    saved = ctx.saved_tensors
    if ctx.from_source:
        return _mix(*saved[:4]), saved[4:]
    return saved[0], saved[1:]


def _saved_stream(ctx) -> tuple[torch.Tensor | None, tuple, tuple]:
    """(X or None, its source or 4 x None, the other saved tensors), for the fused kernels (`layers.mhc_ops`),
    which rebuild X themselves."""
    saved = ctx.saved_tensors
    if ctx.from_source:
        return None, saved[:4], saved[4:]
    return saved[0], _NO_SOURCE, saved[1:]


def _folded_weight(gamma_D: torch.Tensor, weights: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, W~ = W * gamma) with W = [proj_pre; proj_post; proj_res], fp32 (or wider) [2n + n^2, nH]."""
    ct = torch.promote_types(gamma_D.dtype, torch.float32)
    w_KD = torch.cat([w.to(ct) for w in weights], dim=0)
    return w_KD, w_KD * gamma_D.to(ct)


class _StreamNormProjection(torch.autograd.Function):
    """pqr = rstd * (vec(X) W~^T), rstd = rsqrt(mean(vec(X)^2) + eps), W~ = [W_pre; W_post; W_res] * gamma.
    Saves X (or its source), rstd [T] and pqr [T, K] (fp32, K = 2n + n^2); W~ is rebuilt in backward (so no
    per-layer weight copy is kept either)."""

    @staticmethod
    def forward(ctx, x_BSnH, gamma_D, eps, w_pre, w_post, w_res, *source):
        _, folded_KD = _folded_weight(gamma_D, (w_pre, w_post, w_res))
        xf_TD = x_BSnH.reshape(-1, folded_KD.shape[1])
        ct = torch.promote_types(x_BSnH.dtype, folded_KD.dtype)
        # sum of squares accumulated in fp32 without an fp32 copy of the stream
        sq_T = torch.linalg.vector_norm(xf_TD, dim=-1, dtype=ct).square()
        rstd_T = torch.rsqrt(sq_T / xf_TD.shape[1] + eps)
        pqr_TK = matmul_fp32(xf_TD, folded_KD.t(), out_dtype=ct) * rstd_T[:, None]
        _save_stream(ctx, x_BSnH, False, source, gamma_D, w_pre, w_post, w_res, rstd_T, pqr_TK)
        return pqr_TK.view(*x_BSnH.shape[:-2], folded_KD.shape[0])

    @staticmethod
    def backward(ctx, dpqr):
        x_BSnH, (gamma_D, w_pre, w_post, w_res, rstd_T, pqr_TK) = _load_stream(ctx)
        w_KD, folded_KD = _folded_weight(gamma_D, (w_pre, w_post, w_res))
        xf_TD = x_BSnH.reshape(-1, folded_KD.shape[1])
        D = xf_TD.shape[1]
        draw_TK, dmean_T = _StreamNormProjection._raw_grads(dpqr, rstd_T, pqr_TK)
        dx = None
        if ctx.needs_input_grad[0]:
            # dx = draw W~ + (2 / D) dmean * X in fp32, rounded once to X's dtype (a bf16 GEMM output would add a
            # rounding that a cancellation-prone coefficient gradient feels: tests/layers/mhc/test_mhc.py; on CUDA the
            # fp32 GEMM runs on tensor cores as split-bf16 pairs, not as fp32 FFMA), over
            # token chunks so the fp32 values are at most _BACKWARD_CHUNK elements at a time, not the n-wide
            # stream (a single chunk at the CPU demo's size). Compiled: one chunk; inductor keeps every chunk's GEMM
            # output alive anyway and adds a full-buffer copy per chunk (two kernels of ~0.6 ms per block on the
            # H200 at 16K tokens).
            ct = torch.promote_types(x_BSnH.dtype, torch.float32)
            coef_T1 = (dmean_T * (2.0 / D))[:, None]

            def dx_rows(rows: slice) -> torch.Tensor:  # fp32
                gemm = matmul_fp32(draw_TK[rows], folded_KD, out_dtype=ct, split_fp32_pair=True)
                return torch.addcmul(gemm, xf_TD[rows], coef_T1[rows])

            if torch.compiler.is_compiling():
                dx_TD = dx_rows(slice(None)).to(xf_TD.dtype)
            else:
                dx_TD = torch.empty_like(xf_TD)
                step = max(1, _BACKWARD_CHUNK // D)
                for s in range(0, xf_TD.shape[0], step):
                    dx_TD[s : s + step] = dx_rows(slice(s, s + step))
            dx = dx_TD.view(x_BSnH.shape)
        need_w = any(ctx.needs_input_grad[i] for i in (1, 3, 4, 5))
        dfolded_KD = matmul_fp32(draw_TK.t(), xf_TD, out_dtype=folded_KD.dtype) if need_w else None
        return (
            dx,
            *_StreamNormProjection._weight_grads(ctx, dfolded_KD, gamma_D, w_KD, (w_pre, w_post, w_res)),
            *[None] * ctx.n_source,
        )

    @staticmethod
    def _raw_grads(dpqr, rstd_T, pqr_TK) -> tuple[torch.Tensor, torch.Tensor]:
        """(draw = d(vec(X) W~^T) [T, K], d(mean sq) [T]) from dpqr."""
        dpqr_TK = dpqr.reshape(pqr_TK.shape).to(pqr_TK.dtype)
        # d rstd = sum_k dpqr_k raw_k = sum_k dpqr_k pqr_k / rstd;  d(mean sq) = -rstd^3 / 2 * d rstd
        return dpqr_TK * rstd_T[:, None], -0.5 * rstd_T.square() * (dpqr_TK * pqr_TK).sum(-1)

    @staticmethod
    def _weight_grads(ctx, dfolded_KD, gamma_D, w_KD, weights) -> tuple:
        """(dgamma, None for eps, dW_pre, dW_post, dW_res) from dW~ (W~ = W * gamma)."""
        need = ctx.needs_input_grad
        dgamma = (dfolded_KD * w_KD).sum(0).to(gamma_D.dtype) if need[1] else None
        dws, start = [], 0
        for k, w in enumerate(weights):
            rows = slice(start, start + w.shape[0])
            dws.append((dfolded_KD[rows] * gamma_D.to(dfolded_KD.dtype)).to(w.dtype) if need[3 + k] else None)
            start += w.shape[0]
        return dgamma, None, *dws


class _CollapseStreams(torch.autograd.Function):
    """u = sum_i h[i] X[i] computed in fp32; saves X (or its source) in its own dtype and h."""

    @staticmethod
    def forward(ctx, x_BSnH, h_BSn, fused, *source):
        _save_stream(ctx, x_BSnH, fused, source, h_BSn)
        return _collapse(x_BSnH, h_BSn)

    @staticmethod
    def backward(ctx, g_BSH):
        if ctx.fused:
            x, source, (h,) = _saved_stream(ctx)
            rows = [None if t is None else _token_rows(t) for t in (x, *source)]
            dx, dh = mhc_ops.collapse_backward(_token_rows(g_BSH), rows[0], _token_rows(h), *rows[1:])
            shape = (source[0] if x is None else x).shape
            return dx.view(shape), dh.view(h.shape), None, *[None] * ctx.n_source
        x, (h,) = _load_stream(ctx)
        dx = dh = None
        if ctx.needs_input_grad[0]:
            dx = torch.stack([(h[..., i, None] * g_BSH).to(x.dtype) for i in range(h.shape[-1])], dim=-2)
        if ctx.needs_input_grad[1]:
            dh = _bmm_fp32(_rows(x, 2), _rows(g_BSH, 1).unsqueeze(-1)).view(h.shape).to(h.dtype)
        return dx, dh, None, *[None] * ctx.n_source


class _MixStreams(torch.autograd.Function):
    """X'[i] = sum_j H[i, j] X[j] + p[i] y computed in fp32; saves X (or its source) and y in their own dtype."""

    @staticmethod
    def forward(ctx, x_BSnH, h_res_BSnn, h_post_BSn, y_BSH, fused, *source):
        _save_stream(ctx, x_BSnH, fused, source, h_res_BSnn, h_post_BSn, y_BSH)
        return _mix(x_BSnH, h_res_BSnn, h_post_BSn, y_BSH)

    @staticmethod
    def backward(ctx, g_BSnH):
        if ctx.fused:
            x, source, (h_res, h_post, y) = _saved_stream(ctx)
            rows = [None if t is None else _token_rows(t) for t in (x, *source)]
            dx, dh_res, dh_post, dy = mhc_ops.mix_backward(
                _token_rows(g_BSnH), rows[0], _token_rows(h_res), _token_rows(h_post), _token_rows(y), *rows[1:]
            )
            return dx.view(g_BSnH.shape), dh_res.view(h_res.shape), dh_post.view(h_post.shape), dy.view(y.shape), \
                None, *[None] * ctx.n_source  # fmt: skip
        x, (h_res, h_post, y) = _load_stream(ctx)
        need = ctx.needs_input_grad
        g = g_BSnH
        dx = _mix(g, h_res.transpose(-1, -2), out_dtype=x.dtype) if need[0] else None  # dX[j] = sum_i H[i, j] g[i]
        dh_res = dh_post = dy = None
        if need[1]:  # dH[i, j] = sum_h g[i] X[j]
            dh_res = _bmm_fp32(_rows(g, 2), _rows(x, 2).transpose(-1, -2)).view(h_res.shape).to(h_res.dtype)
        if need[2]:  # dp[i] = sum_h g[i] y
            dh_post = _bmm_fp32(_rows(g, 2), _rows(y, 1).unsqueeze(-1)).view(h_post.shape).to(h_post.dtype)
        if need[3]:  # dy = sum_i p[i] g[i]
            dy = _collapse(g, h_post).to(y.dtype)
        return dx, dh_res, dh_post, dy, None, *[None] * ctx.n_source
