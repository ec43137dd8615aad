"""A CPU emulation of flash-attn-4's interface kernel functions (`flash_attn.cute.interface._flash_attn_fwd` /
`_flash_attn_bwd`, what `layers/attention/fa4.py`'s custom ops call), in fp32 with FA4's mask convention, layouts
and backward formulation, so the fa4 glue, its custom ops and compiled models that use them run on CPU."""

import sys
import types

import torch

from llm_training.layers.attention import fa4


def _emulated_probabilities(q, k, scale, causal, window_size):
    """fp32 attention probabilities [H, S, S] and lse [H, S] of one sequence q [S, H, D], k [S, H, D] with FA4's
    documented mask convention (window_size = (left, right): key j visible iff i - left <= j <= i + right; causal:
    right = 0)."""
    S = q.shape[0]
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    left, right = window_size
    right = 0 if causal else right
    visible = torch.ones(S, S, dtype=torch.bool)
    if left is not None:
        visible &= j >= i - left
    if right is not None:
        visible &= j <= i + right
    logits = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    logits = logits.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    return torch.exp(logits - lse[..., None]), lse


def _emulated_attention(q, k, v, scale, causal, window_size):
    """(out [S, H, E] in q's dtype, lse [H, S]) of one sequence; k, v [S, Hk, *] shared by H / Hk query heads."""
    rep = q.shape[1] // k.shape[1]
    probs, lse = _emulated_probabilities(q, k.repeat_interleave(rep, 1), scale, causal, window_size)
    out = torch.einsum("hqk,khe->qhe", probs, v.float().repeat_interleave(rep, 1))
    return out.to(q.dtype), lse


def _emulated_attention_bwd(q, k, v, out, dout, lse, dlse, scale, causal, window_size):
    """(dq, dk, dv) of one sequence in fp32, FA4's formulation: dS = P * (dP - rowsum(dO * O) + dlse)."""
    rep = q.shape[1] // k.shape[1]
    k_, v_ = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    probs, _ = _emulated_probabilities(q, k_, scale, causal, window_size)
    dout = dout.float()
    dv = torch.einsum("hqk,qhe->khe", probs, dout)
    dprobs = torch.einsum("qhe,khe->hqk", dout, v_)
    row = torch.einsum("qhe,qhe->hq", dout, out.float())
    if dlse is not None:
        row = row - dlse.float()
    dlogits = probs * (dprobs - row[..., None]) * scale
    dq = torch.einsum("hqk,khd->qhd", dlogits, k_)
    dk = torch.einsum("hqk,qhd->khd", dlogits, q.float())
    dk, dv = (x.unflatten(1, (-1, rep)).sum(2) for x in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _segments(B, cu_seqlens, max_seqlen):
    """The sequences the kernel attends within: (batch index, None) per row, or (None, (start, end)) per document of
    the flattened tokens when cu_seqlens is given (varlen)."""
    if cu_seqlens is None:
        return [(b, None) for b in range(B)]
    assert cu_seqlens.dtype == torch.int32
    bounds = cu_seqlens.tolist()
    assert max_seqlen >= max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    return [(None, (a, b)) for a, b in zip(bounds[:-1], bounds[1:])]


def _emulated_kernel(q, k, v, scale, causal, window_size, cu_seqlens, max_seqlen):
    """FA4's (out, lse) layouts: [B, S, H, E] and [B, H, S], or with cu_seqlens (varlen) [T, H, E] and [H, T]."""
    if cu_seqlens is None:
        parts = [_emulated_attention(q[b], k[b], v[b], scale, causal, window_size) for b in range(q.shape[0])]
        return torch.stack([o for o, _ in parts]), torch.stack([s for _, s in parts])
    parts = [
        _emulated_attention(q[a:b], k[a:b], v[a:b], scale, causal, window_size)
        for _, (a, b) in _segments(None, cu_seqlens, max_seqlen)
    ]
    return torch.cat([o for o, _ in parts]), torch.cat([s for _, s in parts], dim=1)


def _emulated_kernel_bwd(q, k, v, out, dout, lse, dlse, scale, causal, window_size, cu_seqlens, max_seqlen):
    """(dq, dk, dv) in the layouts of q, k, v (`_emulated_kernel`'s)."""
    grads = [torch.empty_like(x) for x in (q, k, v)]
    for b, span in _segments(q.shape[0], cu_seqlens, max_seqlen):
        rows = b if span is None else slice(*span)
        lse_rows = lse[b] if span is None else lse[:, slice(*span)]
        dlse_rows = None if dlse is None else (dlse[b] if span is None else dlse[:, slice(*span)])
        parts = _emulated_attention_bwd(
            q[rows], k[rows], v[rows], out[rows], dout[rows], lse_rows, dlse_rows, scale, causal, window_size
        )
        for grad, part in zip(grads, parts):
            grad[rows] = part
    return grads


def fake_flash_attn_cute():
    """flash_attn.cute whose interface's forward and backward kernels (what fa4's custom ops call) are emulated in
    fp32 (the backward with FA4's formulas, no autograd: a custom op's kernel runs below autograd); b36's limits
    kept: the backward rejects GQA with head_dim != head_dim_v."""
    module = types.ModuleType("flash_attn.cute")
    interface = types.ModuleType("flash_attn.cute.interface")

    def _flash_attn_fwd(
        q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None,
        causal=False, softcap=None, window_size_left=None, window_size_right=None, return_lse=False,
    ):  # fmt: skip
        assert cu_seqlens_q is cu_seqlens_k and max_seqlen_q == max_seqlen_k and return_lse and softcap == 0.0
        out, lse = _emulated_kernel(
            q, k, v, softmax_scale, causal, (window_size_left, window_size_right), cu_seqlens_q, max_seqlen_q
        )
        return out, lse, None, None, None

    def _flash_attn_bwd(
        q, k, v, out, dout, lse, softmax_scale, causal, softcap, window_size_left=None, window_size_right=None,
        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, dlse=None,
    ):  # fmt: skip
        assert cu_seqlens_q is cu_seqlens_k and max_seqlen_q == max_seqlen_k and softcap == 0.0
        if k.shape[-2] != q.shape[-2] and k.shape[-1] != v.shape[-1]:
            raise RuntimeError("emulated FA4 b36: GQA backward with head_dim != head_dim_v is not supported")
        window_size = (window_size_left, window_size_right)
        return _emulated_kernel_bwd(
            q, k, v, out, dout, lse, dlse, softmax_scale, causal, window_size, cu_seqlens_q, max_seqlen_q
        )

    interface._flash_attn_fwd, interface._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
    module.interface = interface
    return module


def install_emulated_fa4(monkeypatch) -> None:
    """Make `flash_attn.cute` the emulation for this test (sys.modules) and skip fa4's device / dtype checks."""
    package = types.ModuleType("flash_attn")
    package.cute = fake_flash_attn_cute()
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", package.cute)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", package.cute.interface)
    monkeypatch.setattr(fa4, "_check_inputs", lambda q, v: None)
