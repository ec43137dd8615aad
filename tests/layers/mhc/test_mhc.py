"""mHC: Sinkhorn invariants, coefficients vs a per-token formula, reduction to a plain residual, the fused
Functions (norm folded into the projection GEMM, mid-block stream rebuilt in backward) against the plain
formula in float64 (values and gradients), and what they save for backward."""

import math

import torch

from llm_training.layers.mhc.hyper_connections import MHC, StreamSource, _StreamNormProjection
from llm_training.layers.mhc.sinkhorn import sinkhorn
from llm_training.layers.attention.rope import build_rotary_embeddings
from llm_training.motif import get_flavor
from llm_training.motif.activation_memory import PerToken, mhc_sublayer_terms
from llm_training.motif.model import TransformerBlock
from llm_training.saved_tensors import saved_storages


def test_sinkhorn_doubly_stochastic_and_finite_grads():
    torch.manual_seed(0)
    z = torch.randn(7, 4, 4).requires_grad_()  # the scale of alpha_res * R + b_res in practice
    m = sinkhorn(z, 20)
    torch.testing.assert_close(m.sum(-1), torch.ones(7, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(m.sum(-2), torch.ones(7, 4), atol=1e-5, rtol=0)
    (m * torch.randn_like(m)).sum().backward()
    assert torch.isfinite(z.grad).all()
    big = torch.tensor([[[500.0, -500.0], [0.0, 1e4]]], requires_grad=True)  # exp clamped to +-20
    m = sinkhorn(big, 20)
    m.sum().backward()
    assert torch.isfinite(m).all() and torch.isfinite(big.grad).all()
    torch.testing.assert_close(m.sum(-2), torch.ones(1, 2))  # the last step normalises columns


def test_sinkhorn_one_iteration_by_hand():
    z = torch.tensor([[0.0, 1.0], [2.0, -1.0]], dtype=torch.float64)
    e = [[math.exp(v) for v in row] for row in z.tolist()]
    rows = [[v / sum(r) for v in r] for r in e]
    cols = [sum(rows[i][j] for i in range(2)) for j in range(2)]
    want = torch.tensor([[rows[i][j] / cols[j] for j in range(2)] for i in range(2)])
    torch.testing.assert_close(sinkhorn(z, 1).double(), want.double(), atol=1e-6, rtol=1e-6)


def test_coefficients_and_update_per_token():
    torch.manual_seed(0)
    n, H = 3, 5
    mhc = MHC(H, n, sinkhorn_iters=6, eps=1e-6, identity_init=False, h_post_alpha=0.5)
    mhc.init_weights()
    with torch.no_grad():
        mhc.norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 4, n, H)
    y = torch.randn(2, 4, H)
    h_pre, h_post, h_res = mhc.coefficients(x)
    out = MHC.update(x, h_res, h_post, y)
    u = MHC.collapse(x, h_pre)
    for b in range(2):
        for s in range(4):
            v = x[b, s].reshape(-1).double()
            xt = v / torch.sqrt(v.pow(2).mean() + 1e-6) * mhc.norm.weight.double()
            p, q = mhc.proj_pre.weight.double() @ xt, mhc.proj_post.weight.double() @ xt
            r = (mhc.proj_res.weight.double() @ xt).view(n, n)
            hp = torch.sigmoid((mhc.alpha_pre * p + mhc.bias_pre).clamp(-10, 10))
            hq = 1.5 * torch.sigmoid((mhc.alpha_post * q + mhc.bias_post).clamp(-10, 10))
            m = torch.exp((mhc.alpha_res * r + mhc.bias_res).double())
            for _ in range(6):
                m = m / m.sum(1, keepdim=True)
                m = m / m.sum(0, keepdim=True)
            torch.testing.assert_close(h_pre[b, s].double(), hp, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(h_post[b, s].double(), hq, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(h_res[b, s].double(), m, atol=1e-5, rtol=1e-5)
            want_u = sum(hp[i] * x[b, s, i].double() for i in range(n))
            torch.testing.assert_close(u[b, s].double(), want_u, atol=1e-5, rtol=1e-5)
            for i in range(n):
                want = sum(m[i, j] * x[b, s, j].double() for j in range(n)) + hq[i] * y[b, s].double()
                torch.testing.assert_close(out[b, s, i].double(), want, atol=1e-5, rtol=1e-5)


def test_identity_like_mhc_block_is_plain_prenorm_residual():
    """alpha = 0, h_pre = 1/n, h_post = 1 (c_post 2, bias 0), H_res = I: equal streams stay equal and each
    equals the plain pre-norm residual block with the same weights."""
    base = get_flavor("motif3_debug").replace(mhc_sinkhorn_iters=3)
    rope_full, rope_sliding = build_rotary_embeddings(base)
    torch.manual_seed(0)
    plain = TransformerBlock(base.replace(mhc_enabled=False), 2, rope_full, rope_sliding, "reference")
    plain.init_weights()
    hc = TransformerBlock(base, 2, rope_full, rope_sliding, "reference")
    hc.load_state_dict(plain.state_dict(), strict=False)
    n = base.mhc_expansion_rate
    for mhc in (hc.mhc_attn, hc.mhc_ffn):
        mhc.init_weights()
        mhc.h_post_alpha = 1.0
        with torch.no_grad():
            for a in (mhc.alpha_pre, mhc.alpha_post, mhc.alpha_res):
                a.zero_()
            mhc.bias_pre.fill_(math.log((1 / n) / (1 - 1 / n)))
            mhc.bias_post.zero_()
            mhc.bias_res.fill_(-1e4).fill_diagonal_(0.0)
    x = torch.randn(2, 9, base.hidden_size)
    pos = torch.arange(9).expand(2, 9)
    want, _, _ = plain(x, pos)
    got, _, _ = hc(x.unsqueeze(2).expand(2, 9, n, base.hidden_size).contiguous(), pos)
    for i in range(n):
        torch.testing.assert_close(got[:, :, i], want, atol=1e-5, rtol=1e-5)


def test_identity_init_gives_mean_collapse_and_near_identity_mixing():
    mhc = MHC(4, 4, sinkhorn_iters=20, eps=1e-6, identity_init=True, h_post_alpha=0.0)
    mhc.init_weights()
    h_pre, h_post, h_res = mhc.coefficients(torch.randn(1, 3, 4, 4))
    torch.testing.assert_close(h_pre, torch.full_like(h_pre, 0.25))
    torch.testing.assert_close(h_post, torch.full_like(h_post, 0.5))
    torch.testing.assert_close(h_res, torch.eye(4).expand_as(h_res), atol=1e-3, rtol=0)


def test_stream_collapse_and_mix_gradients_match_autograd():
    """The memory-saving autograd Functions vs plain autograd through the same formulas (float64)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    h_pre = torch.rand(2, 3, 4, dtype=torch.float64, requires_grad=True)
    h_res = torch.rand(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    h_post = torch.rand(2, 3, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(MHC.collapse, (x, h_pre))
    torch.autograd.gradcheck(MHC.update, (x, h_res, h_post, y))
    g = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    got = torch.autograd.grad(MHC.update(x, h_res, h_post, y), (x, h_res, h_post, y), g)
    want_out = sum(h_res[:, :, :, j, None] * x[:, :, None, j] for j in range(4)) + h_post[..., None] * y[:, :, None]
    want = torch.autograd.grad(want_out, (x, h_res, h_post, y), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    bf = MHC.update(x.detach().bfloat16(), h_res.detach().float(), h_post.detach().float(), y.detach().bfloat16())
    assert bf.dtype == torch.bfloat16


def _reference_sublayer_pair(mhc_a, mhc_f, x, sub_a, sub_f):
    """The formula of docs/model-spec.md §4.2 with plain autograd (the implementation this module replaced): fp32 norm
    of vec(X), three projections, sigmoids, Sinkhorn, collapse, sub-layer, mix; twice (attention then FFN side)."""

    def coeffs(m, x):
        ct = torch.promote_types(x.dtype, torch.float32)
        flat = x.flatten(-2).to(ct)
        flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + m.norm.eps) * m.norm.weight
        p, q = flat @ m.proj_pre.weight.t(), flat @ m.proj_post.weight.t()
        r = (flat @ m.proj_res.weight.t()).unflatten(-1, (m.n, m.n))
        h_pre = torch.sigmoid((m.alpha_pre * p + m.bias_pre).clamp(-10, 10))
        h_post = (1 + m.h_post_alpha) * torch.sigmoid((m.alpha_post * q + m.bias_post).clamp(-10, 10))
        return h_pre, h_post, sinkhorn(m.alpha_res * r + m.bias_res, m.sinkhorn_iters)

    def mix(x, h_res, h_post, y):
        ct = h_res.dtype
        return (torch.einsum("bsij,bsjh->bsih", h_res, x.to(ct)) + h_post[..., None] * y[..., None, :].to(ct)).to(
            x.dtype
        )

    def collapse(x, h_pre):
        return torch.einsum("bsn,bsnh->bsh", h_pre, x.to(h_pre.dtype)).to(x.dtype)

    h_pre, h_post, h_res = coeffs(mhc_a, x)
    x = mix(x, h_res, h_post, sub_a(collapse(x, h_pre)))
    h_pre, h_post, h_res = coeffs(mhc_f, x)
    return mix(x, h_res, h_post, sub_f(collapse(x, h_pre)))


def _fused_sublayer_pair(mhc_a, mhc_f, x, sub_a, sub_f):
    """What TransformerBlock.forward does with mHC, around two given sub-layers."""
    h_pre, h_post, h_res = mhc_a.coefficients(x)
    mid = StreamSource(x, h_res, h_post, sub_a(MHC.collapse(x, h_pre)))
    x = MHC.update(*mid)
    h_pre, h_post, h_res = mhc_f.coefficients(x, mid)
    return MHC.update(x, h_res, h_post, sub_f(MHC.collapse(x, h_pre, mid)), mid)


def _two_mhc(n, H, dtype, iters=4):
    mods = []
    for _ in range(2):
        m = MHC(H, n, sinkhorn_iters=iters, eps=1e-6, identity_init=False, h_post_alpha=0.3)
        m.init_weights()
        with torch.no_grad():
            m.norm.weight.uniform_(0.5, 1.5)
            for a in (m.alpha_pre, m.alpha_post, m.alpha_res):
                a.fill_(0.7)  # large enough that the projections matter
        mods.append(m.to(dtype))
    return mods


def test_fused_path_matches_the_plain_formula_values_and_gradients_float64():
    torch.manual_seed(0)
    n, H = 4, 6
    mhc_a, mhc_f = _two_mhc(n, H, torch.float64)
    w_a, w_f = torch.randn(H, H, dtype=torch.float64), torch.randn(H, H, dtype=torch.float64)
    sub_a, sub_f = (lambda u: torch.tanh(u @ w_a)), (lambda u: torch.tanh(u @ w_f))
    x = torch.randn(2, 3, n, H, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 3, n, H, dtype=torch.float64)
    params = [x] + list(mhc_a.parameters()) + list(mhc_f.parameters())
    outs, grads = [], []
    for fn in (_reference_sublayer_pair, _fused_sublayer_pair):
        out = fn(mhc_a, mhc_f, x, sub_a, sub_f)
        outs.append(out)
        grads.append(torch.autograd.grad(out, params, g))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-12, rtol=1e-12)
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, atol=1e-11, rtol=1e-11)


def test_fused_path_matches_the_plain_formula_bf16_stream():
    """bf16 stream, fp32 parameters (as under FSDP2): same values as the plain formula up to bf16 rounding of
    the stream; the stream stays bf16 and the coefficient parameters get fp32 gradients."""
    torch.manual_seed(0)
    n, H = 4, 32
    mhc_a, mhc_f = _two_mhc(n, H, torch.float32)
    sub = lambda u: u * 0.5
    x = torch.randn(2, 8, n, H).bfloat16().requires_grad_()
    ref = _reference_sublayer_pair(mhc_a, mhc_f, x, sub, sub)
    got = _fused_sublayer_pair(mhc_a, mhc_f, x, sub, sub)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    got.float().square().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and mhc_f.alpha_res.grad.dtype == torch.float32


def test_stream_norm_projection_gradcheck_every_input():
    torch.manual_seed(0)
    n, H = 3, 4
    x = torch.randn(2, 2, n, H, dtype=torch.float64, requires_grad=True)
    gamma = torch.rand(n * H, dtype=torch.float64).add(0.5).requires_grad_()
    ws = [torch.randn(k, n * H, dtype=torch.float64, requires_grad=True) for k in (n, n, n * n)]
    torch.autograd.gradcheck(lambda *t: _StreamNormProjection.apply(t[0], t[1], 1e-6, *t[2:]), (x, gamma, *ws))
    # with a source: x is rebuilt from it, so the gradient flows to the source through the update
    h_res = torch.rand(2, 2, n, n, dtype=torch.float64, requires_grad=True)
    h_post = torch.rand(2, 2, n, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 2, H, dtype=torch.float64, requires_grad=True)

    def from_source(x0, h_res, h_post, y, gamma):
        src = StreamSource(x0, h_res, h_post, y)
        x1 = MHC.update(*src)
        pqr = _StreamNormProjection.apply(x1, gamma, 1e-6, *ws, *src)
        return pqr, MHC.collapse(x1, pqr[..., :n], src), MHC.update(x1, h_res, h_post, 2 * y, src)

    torch.autograd.gradcheck(from_source, (x, h_res, h_post, y, gamma))


def test_saved_set_is_one_bf16_stream_per_block_and_matches_the_estimate():
    """Saved-tensor accounting at a Motif-3-like width (n = 4, H = 512): the block keeps its bf16 input stream
    once (not the mid-block stream, no fp32 stream copy), and the bytes per token equal the activation
    estimate's mHC terms exactly (the sub-layers here save only their input, as the real norms do)."""
    torch.manual_seed(0)
    n, H, B, S = 4, 512, 2, 16
    mhc_a, mhc_f = _two_mhc(n, H, torch.float32, iters=20)
    w = torch.randn(H, dtype=torch.bfloat16, requires_grad=True)
    sub = lambda u: u * w
    x = torch.randn(B, S, n, H).bfloat16().requires_grad_()
    params = [*mhc_a.parameters(), *mhc_f.parameters(), w]
    _, saved = saved_storages(lambda: _fused_sublayer_pair(mhc_a, mhc_f, x, sub, sub), exclude=params)
    stream_bytes = n * H * 2 * B * S
    big = [v for v in saved.values() if v.nbytes >= stream_bytes]
    assert big == [(stream_bytes, torch.bfloat16, (B, S, n, H))]  # the input stream, once
    per_token = sum(v.nbytes for v in saved.values()) / (B * S)
    a = get_flavor("motif3_debug").replace(hidden_size=H, mhc_expansion_rate=n)
    want = PerToken(b=n * H) + mhc_sublayer_terms(a) + mhc_sublayer_terms(a)
    assert per_token == want.bytes(2), (per_token, want.bytes(2))


def test_tensor_core_path_emulated_is_as_accurate_as_the_cpu_path(monkeypatch):
    """The CUDA code path (split-bf16 GEMMs, bf16 dx of the projection, fp32-output bmm; emulated on the CPU by
    patching `projection`'s hooks) against float64: output, dx and every parameter gradient within 1.5x the
    CPU path's error + 2e-3 (test_mhc_gpu.py runs the same comparison on the GPU)."""
    from llm_training.layers import projection

    n, H, B, S = 4, 256, 2, 32
    torch.manual_seed(0)
    x = torch.randn(B, S, n, H).bfloat16()
    g = torch.randn(B, S, n, H).bfloat16()
    w = torch.rand(H).add(0.5)

    def run(dtype, x, g, w):
        torch.manual_seed(1)
        mhc_a, mhc_f = _two_mhc(n, H, dtype, iters=20)
        x = x.clone().requires_grad_()
        out = _fused_sublayer_pair(mhc_a, mhc_f, x, lambda u: torch.tanh(u * w), lambda u: torch.tanh(u * w))
        out.backward(g)
        return [out, x.grad] + [p.grad for m in (mhc_a, mhc_f) for p in m.parameters()]

    exact = run(torch.float64, x.double(), g.double(), w.bfloat16().double())
    cpu_path = run(torch.float32, x, g, w.bfloat16())

    def product(op):
        def go(a, b):
            assert a.dtype == b.dtype == torch.bfloat16
            return op(a.float(), b.float())

        return go

    monkeypatch.setattr(projection, "on_tensor_cores", lambda t: True)
    monkeypatch.setattr(projection, "mm_fp32_out", product(torch.mm))
    monkeypatch.setattr(projection, "bmm_fp32_out", product(torch.bmm))
    emulated = run(torch.float32, x, g, w.bfloat16())

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    for k, (a, c, e) in enumerate(zip(emulated, cpu_path, exact)):
        assert a.dtype == c.dtype
        assert rel(a, e) <= 1.5 * rel(c, e) + 2e-3, (k, rel(a, e), rel(c, e))


def test_projection_backward_in_token_chunks_equals_one_chunk(monkeypatch):
    from llm_training.layers.mhc import hyper_connections as mhc_module

    torch.manual_seed(0)
    n, H = 4, 8
    m = _two_mhc(n, H, torch.float32)[0]
    x = torch.randn(2, 5, n, H).bfloat16().requires_grad_()
    g = torch.randn(2, 5, 2 * n + n * n)
    grads = []
    for chunk in (1 << 26, 3 * n * H):  # one chunk; 3 tokens per chunk (4 chunks, the last one partial)
        monkeypatch.setattr(mhc_module, "_BACKWARD_CHUNK", chunk)
        x.grad = None
        m.zero_grad()
        m.projections(x).backward(g)
        grads.append([x.grad.clone()] + [p.grad.clone() for p in m.parameters() if p.grad is not None])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
