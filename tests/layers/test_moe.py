"""MoE: router rules, grouped experts vs a loop, the whole layer vs a per-token computation, balance loss
and the expert-bias update."""

import pytest
import torch
from torch import nn

from llm_training.layers.moe import MoE, TokenChoiceRouter, update_expert_bias
from llm_training.motif import get_flavor


def _args(**kw):
    return get_flavor("motif3_debug").replace(**kw)


def test_router_bias_changes_selection_not_weights():
    args = _args(num_experts=6, experts_top_k=2, route_scale=2.0)
    router = TokenChoiceRouter(args)
    router.init_weights(0.5)
    x = torch.randn(5, args.hidden_size)
    w0, ids0, s = router(x, torch.zeros(6))
    bias = torch.zeros(6)
    bias[5] = 10.0  # force expert 5 into every top-2
    w1, ids1, s1 = router(x, bias)
    assert (ids1 == 5).any(-1).all()
    torch.testing.assert_close(s1, s)
    # weights = selected scores renormalised over the K selected, times route_scale; no bias inside
    want = s.gather(-1, ids1)
    torch.testing.assert_close(w1, 2.0 * want / want.sum(-1, keepdim=True))
    torch.testing.assert_close(w1.sum(-1), torch.full((5,), 2.0))
    router.route_norm = False
    w2, ids2, _ = router(x, bias)
    torch.testing.assert_close(w2, 2.0 * s.gather(-1, ids2))
    assert torch.equal(ids0, torch.topk(torch.sigmoid(x @ router.gate.weight.T), 2, -1).indices)


def moe_by_hand(moe: MoE, x):
    """Per token: top-k on sigmoid + bias, renormalised weights x route_scale on expert outputs, each
    expert W_down(s * PolyNorm_e(clamp-bias) (W_gate x) * W_up x), plus the shared expert; float64."""
    a_I = moe.experts.intermediate_size
    T = x.shape[0]
    ex = moe.experts
    out = torch.zeros(T, x.shape[1], dtype=torch.float64)
    scores = torch.sigmoid(x.double() @ moe.router.gate.weight.double().T)
    for t in range(T):
        ids = torch.topk(scores[t] + moe.expert_bias.double(), moe.top_k).indices
        w = scores[t, ids] / scores[t, ids].sum() * moe.router.route_scale
        for k, e in enumerate(ids.tolist()):
            gu = ex.gate_up_proj[e].double() @ x[t].double()
            g, u = gu[:a_I], gu[a_I:]
            ws = torch.sigmoid(ex.act_fn.weight[e].double())
            b = ex.act_fn.bias[e].double().clamp(-ex.act_fn.bias_clamp, ex.act_fn.bias_clamp)

            def n(v):
                return v / torch.sqrt(v.pow(2).mean() + ex.act_fn.eps)

            h = (ws[0] * n(g**3) + ws[1] * n(g**2) + ws[2] * n(g) + b) * u * ex.act_fn.output_scale
            out[t] += w[k] * (ex.down_proj[e].double() @ h)
    sh = moe.shared_experts
    g, u = x.double() @ sh.gate_proj.weight.double().T, x.double() @ sh.up_proj.weight.double().T
    ws = torch.sigmoid(sh.act_fn.weight.double())

    def n(v):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)

    h = (ws[0] * n(g**3) + ws[1] * n(g**2) + ws[2] * n(g) + sh.act_fn.bias.double()) * u * 0.5
    return out + h @ sh.down_proj.weight.double().T


@pytest.fixture
def moe():
    args = _args(num_experts=8, experts_top_k=3, moe_intermediate_size=8, hidden_size=16)
    torch.manual_seed(0)
    m = MoE(args)
    m.init_weights(0.3)
    with torch.no_grad():
        m.experts.act_fn.weight.normal_()
        m.experts.act_fn.bias.uniform_(-1.0, 1.0)  # some beyond the +-0.5 clamp
        m.expert_bias.normal_(0, 0.05)
    return m


@pytest.mark.parametrize("grouped", [True, False])
def test_moe_matches_per_token_computation(moe, grouped):
    moe.experts.use_grouped_mm = grouped
    x = torch.randn(2, 7, 16)
    out, stats = moe(x)
    torch.testing.assert_close(out.double(), moe_by_hand(moe, x.view(-1, 16)).view(2, 7, 16), atol=1e-5, rtol=1e-4)
    ids = torch.topk(torch.sigmoid(x.view(-1, 16) @ moe.router.gate.weight.T) + moe.expert_bias, 3).indices
    assert torch.equal(stats.tokens_per_expert, torch.bincount(ids.flatten(), minlength=8).float())
    assert stats.balance_loss is None


def test_grouped_mm_and_loop_paths_agree_with_grads(moe, monkeypatch):
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(3, 5, 16)
    grads = []
    for grouped in (True, False):
        moe.zero_grad()
        moe.experts.use_grouped_mm = grouped
        out, _ = moe(x)
        assert len(calls) == 2  # the grouped run used torch._grouped_mm for both GEMMs, the loop none
        out.sum().backward()  # a stride-0 gradient: the grouped path must cope
        grads.append(
            (
                out.detach(),
                moe.experts.gate_up_proj.grad.clone(),
                moe.experts.down_proj.grad.clone(),
                moe.experts.act_fn.bias.grad.clone(),
            )
        )
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_score_before_experts_equals_after_for_linear_scaling(moe):
    """Weighting the inputs instead of the outputs changes results (PolyNorm is scale-invariant-ish), but
    must still route identically and produce finite output."""
    x = torch.randn(1, 4, 16)
    moe.score_before_experts = True
    out, stats = moe(x)
    assert torch.isfinite(out).all() and stats.tokens_per_expert.sum() == 4 * 3


def test_sequence_balance_loss_formula():
    args = _args(num_experts=4, experts_top_k=2, hidden_size=8, moe_intermediate_size=8, router_aux_loss_coef=0.1)
    torch.manual_seed(0)
    m = MoE(args)
    m.init_weights(0.5)
    x = torch.randn(2, 6, 8)
    _, stats = m(x)
    want = 0.0
    for b in range(2):
        s = torch.sigmoid(x[b].double() @ m.router.gate.weight.double().T)  # [S, E]
        sel = torch.topk(s, 2).indices
        f = torch.tensor([(sel == i).any(-1).sum().item() for i in range(4)], dtype=torch.float64) * 4 / (2 * 6)
        p = (s / s.sum(-1, keepdim=True)).mean(0)
        want += (f * p).sum() / 2
    torch.testing.assert_close(stats.balance_loss.double(), 0.1 * want, atol=1e-6, rtol=1e-6)
    stats.balance_loss.backward()
    assert m.router.gate.weight.grad.abs().sum() > 0


def test_update_expert_bias_sign_rule():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            args = _args(num_experts=4, experts_top_k=2)
            self.a, self.b = MoE(args), MoE(args)
            for m in (self.a, self.b):
                m.init_weights(0.02)

    model = Two()
    counts = torch.tensor([[10.0, 2.0, 6.0, 6.0], [0.0, 0.0, 8.0, 0.0]])
    update_expert_bias(model, counts, 0.5)
    assert model.a.expert_bias.tolist() == [-0.5, 0.5, 0.0, 0.0]
    assert model.b.expert_bias.tolist() == [0.5, 0.5, -0.5, 0.5]
    assert model.a.expert_bias.dtype == torch.float32
    with pytest.raises(ValueError, match="MoE layers"):
        update_expert_bias(model, counts[:1], 0.5)


@pytest.mark.parametrize("grouped", [True, False])
def test_padded_token_groups_give_the_same_result(moe, grouped):
    """The CUDA path pads each expert's rows to a multiple of 8; forcing it on CPU must not change output
    or gradients (padding rows are zero and dropped)."""
    moe.experts.use_grouped_mm = grouped
    counts = torch.tensor([3, 0, 5, 1, 0, 0, 2, 1])
    x = torch.randn(int(counts.sum()), 16, requires_grad=True)
    g = torch.randn(int(counts.sum()), 16)
    results = []
    for multiple in (1, 8):
        x.grad = None
        moe.zero_grad()
        y = moe.experts(x, counts, group_multiple=multiple)
        y.backward(g)
        results.append((y.detach(), x.grad.clone(), moe.experts.down_proj.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_sequence_chunked_routed_experts_match_unchunked_with_grads(moe):
    """long_context AC: the routed experts over checkpointed token chunks give the same output, stats and
    gradients as one pass (the chunk size 4 does not divide the 14 tokens)."""
    x = torch.randn(2, 7, 16, requires_grad=True)
    results = []
    for chunk in (None, 4):
        moe.zero_grad()
        x.grad = None
        moe.sequence_chunk_tokens = chunk
        out, stats = moe(x)
        out.square().sum().backward()
        results.append((out.detach(), stats.tokens_per_expert, x.grad.clone(), moe.experts.gate_up_proj.grad.clone()))
        results[-1] += (moe.router.gate.weight.grad.clone(), moe.experts.down_proj.grad.clone())
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)  # fp32 GEMMs of other shapes: rounding only


def _routing_permutation(T: int, K: int, gen: torch.Generator):
    """A random expert order of T*K (token, k) rows: (order [T*K], its inverse row_of_flat [T, K])."""
    order = torch.randperm(T * K, generator=gen)
    row_of_flat = torch.empty_like(order).scatter_(0, order, torch.arange(T * K)).view(T, K)
    return order, row_of_flat


def test_weighted_combine_matches_the_plain_ops_and_saves_only_compute_dtype_rows():
    """`_WeightedCombine` (the routed experts' combine, by gathers): the same output and gradients as `y.float() * w`
    then an fp32 index_add (float64 gradcheck), and with a bf16 y it keeps y in bf16: no fp32 [T*K, H] tensor."""
    from llm_training.layers.moe import _WeightedCombine

    gen = torch.Generator().manual_seed(3)
    T, K, H = 6, 3, 5
    order, row_of_flat = _routing_permutation(T, K, gen)
    token_of_row = order // K
    y = torch.randn(T * K, H, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.rand(T, K, dtype=torch.float64, generator=gen, requires_grad=True)
    combine = _WeightedCombine.apply
    torch.autograd.gradcheck(lambda y, w: combine(y, w, row_of_flat, order, torch.float64), (y, w))
    want = torch.zeros(T, H, dtype=torch.float64).index_add(0, token_of_row, y * w.reshape(-1)[order, None])
    torch.testing.assert_close(combine(y, w, row_of_flat, order, torch.float64), want)
    # no weights (score_before_experts: the rows are weighted already): a plain sum
    torch.autograd.gradcheck(lambda y: combine(y, None, row_of_flat, order, torch.float64), (y,))
    plain = torch.zeros(T, H, dtype=torch.float64).index_add(0, token_of_row, y)
    torch.testing.assert_close(combine(y, None, row_of_flat, order, torch.float64), plain)

    saved = []
    y16 = y.detach().bfloat16().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = combine(y16, w.detach().float().requires_grad_(), row_of_flat, order, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert sorted((str(t.dtype), tuple(t.shape)) for t in saved) == sorted(
        [("torch.bfloat16", (T * K, H)), ("torch.float32", (T, K)), ("torch.int64", (T, K)), ("torch.int64", (T * K,))]
    )


def test_dispatch_rows_copies_each_token_to_its_rows_and_sums_their_gradients():
    """`_DispatchRows`: row r is token order[r] // K; the backward (gathers through the inverse order, no scatter)
    gives each token the sum of its K rows' gradients (float64 gradcheck against the plain indexing)."""
    from llm_training.layers.moe import _DispatchRows

    gen = torch.Generator().manual_seed(4)
    T, K, H = 5, 4, 3
    order, row_of_flat = _routing_permutation(T, K, gen)
    x = torch.randn(T, H, dtype=torch.float64, generator=gen, requires_grad=True)
    rows = _DispatchRows.apply(x, order // K, row_of_flat)
    torch.testing.assert_close(rows, x[order // K])
    torch.autograd.gradcheck(lambda x: _DispatchRows.apply(x, order // K, row_of_flat), (x,))
    g = torch.randn(T * K, H, dtype=torch.float64, generator=gen)
    (dx,) = torch.autograd.grad(rows, x, g)
    torch.testing.assert_close(dx, torch.zeros(T, H, dtype=torch.float64).index_add(0, order // K, g))


@pytest.mark.parametrize("N,E,multiple", [(512, 8, 16), (37, 5, 32), (3, 3, 128), (100, 4, 1)])
def test_pad_token_groups_aligns_every_group_and_the_buffer(N, E, multiple):
    """Every expert's group starts on a multiple of `multiple` rows, each row lands once and in order, the padding
    is zero, and the buffer's own row count is a multiple too (the FP8 weight-gradient GEMM contracts over all of
    them: 512 rows of 8 experts at 16 gave 632 rows, a 632-byte FP8 row stride that torch._scaled_grouped_mm
    rejects)."""
    from llm_training.layers.moe import pad_token_groups

    torch.manual_seed(0)
    counts = torch.distributions.Multinomial(N, torch.ones(E)).sample().long()
    x = torch.randn(N, 4)
    buf, padded, rows = pad_token_groups(x, counts, multiple)
    assert buf.shape[0] % multiple == 0 and buf.shape[0] >= N + E * (multiple - 1)
    assert (padded % multiple == 0).all() and (padded >= counts).all() and (padded - counts < multiple).all()
    torch.testing.assert_close(buf[rows], x)
    rest = torch.ones(buf.shape[0], dtype=torch.bool)
    rest[rows] = False
    assert (buf[rest] == 0).all()
    starts = torch.cumsum(padded, 0) - padded
    first_rows = rows[torch.cumsum(counts, 0) - counts][counts > 0]
    torch.testing.assert_close(first_rows, starts[counts > 0])
