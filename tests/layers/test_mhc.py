"""mHC: Sinkhorn invariants, coefficients vs a per-token formula, and reduction to a plain residual."""

import math

import torch

from llm_training.layers.mhc import MHC, sinkhorn
from llm_training.motif import get_flavor
from llm_training.motif.model import TransformerBlock
from llm_training.layers.rope import build_rotary_embeddings


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
    want, _ = plain(x, pos)
    got, _ = hc(x.unsqueeze(2).expand(2, 9, n, base.hidden_size).contiguous(), pos)
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


def test_checkpointed_coefficients_give_the_same_gradients():
    torch.manual_seed(0)
    mhc = MHC(4, 4, sinkhorn_iters=5, eps=1e-6, identity_init=False, h_post_alpha=0.0)
    mhc.init_weights()
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    grads = []
    for fn in (mhc.coefficients, mhc._coefficients):
        mhc.zero_grad()
        x.grad = None
        h_pre, h_post, h_res = fn(x)
        (h_pre.sum() + (h_post * 2).sum() + (h_res * torch.arange(16.0).view(4, 4)).sum()).backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in mhc.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
