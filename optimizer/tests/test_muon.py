"""Single-device Muon: parity with torch.optim.Muon, Newton-Schulz quality, expert stacks, gate/up split."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from optimizer import Muon, newton_schulz

STEPS = 4


def _ns_fp32_reference(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's NS recipe (addmm form, clamp-normalised), in fp32/fp64 instead of its fixed bf16."""
    a, b, c = ns_coefficients
    x = grad.to(torch.promote_types(grad.dtype, torch.float32))
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _grads(shapes, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]


def _run(opt, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("nesterov,batch_limit", [(True, None), (False, None), (True, 2000)])
def test_matches_torch_muon(monkeypatch, nesterov, batch_limit):
    import optimizer.muon
    import torch.optim._muon as torch_muon

    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _ns_fp32_reference)
    if batch_limit is not None:  # force several batches per shape (same-shape params are batched)
        monkeypatch.setattr(optimizer.muon, "_LOCAL_BATCH_ELEMENTS", batch_limit)
    shapes = [(24, 40), (48, 16), (32, 32), (24, 40), (24, 40), (32, 32)]
    init = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    ours = [t.clone().requires_grad_() for t in init]
    ref = [t.clone().requires_grad_() for t in init]
    grads = _grads(shapes, STEPS)
    hp = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov)
    _run(Muon(ours, **hp, ns_dtype=torch.float32), ours, grads)
    _run(torch.optim.Muon(ref, **hp, adjust_lr_fn="match_rms_adamw"), ref, grads)
    for a, b in zip(ours, ref):
        # fp32 NS on both sides; the two differ only in matmul association (addmm vs ours) and the
        # momentum-buffer convention (torch's EMA is (1-mu) x ours; NS normalises it away)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("shape", [(64, 32), (32, 96), (50, 50)])
def test_newton_schulz_close_to_polar_factor(shape):
    m = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = newton_schulz(m, dtype=torch.float64)
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    sv = torch.linalg.svdvals(out)
    # the quintic is tuned for speed: singular values of the result land in ~[0.7, 1.2], not exactly 1
    assert sv.min() > 0.6 and sv.max() < 1.25, sv
    polar = u @ vh
    cos = (out * polar).sum() / (out.norm() * polar.norm())
    assert cos > 0.97
    # same singular vectors as M: U^T O V is (nearly) diagonal
    core = u.T @ out @ vh.T
    off = core - torch.diag(torch.diagonal(core))
    assert off.norm() / core.norm() < 0.05


def test_newton_schulz_batched_equals_loop():
    m = torch.randn(3, 20, 12, generator=torch.Generator().manual_seed(2))
    batched = newton_schulz(m, dtype=torch.float64)
    for e in range(3):
        torch.testing.assert_close(batched[e], newton_schulz(m[e], dtype=torch.float64))


def _muon_separate_reference(weights, grads, lr, wd, mu, steps=5):
    """Plain float64 Muon on independent 2-D matrices (fresh code path, no Muon class)."""
    ws = [w.double().clone() for w in weights]
    bufs = [torch.zeros_like(w) for w in ws]
    for step_grads in grads:
        for i, g in enumerate(step_grads):
            g = g.double()
            bufs[i] = mu * bufs[i] + g
            o = _ns_fp32_reference(g + mu * bufs[i], (3.4445, -4.7750, 2.0315), steps, 1e-7)
            ws[i] = ws[i] * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(g.shape)) * o
    return ws


def test_expert_stack_equals_separate_matrices():
    E, out_f, in_f = 3, 12, 20
    w0 = torch.randn(E, out_f, in_f, generator=torch.Generator().manual_seed(3))
    grads = _grads([(E, out_f, in_f)], STEPS, seed=4)
    p = w0.clone().requires_grad_()
    _run(Muon([p], lr=0.05, weight_decay=0.1, ns_dtype=torch.float64), [p], grads)
    ref = _muon_separate_reference(list(w0), [[g[0][e] for e in range(E)] for g in grads], 0.05, 0.1, 0.95)
    torch.testing.assert_close(p.detach().double(), torch.stack(ref), rtol=1e-5, atol=1e-5)


def test_gate_up_split_orthogonalises_halves_separately():
    E, inter, hidden = 2, 6, 16
    w0 = torch.randn(E, 2 * inter, hidden, generator=torch.Generator().manual_seed(5))
    grads = _grads([(E, 2 * inter, hidden)], STEPS, seed=6)
    p = w0.clone().requires_grad_()
    _run(Muon([{"params": [p], "row_split": 2}], lr=0.05, weight_decay=0.1, ns_dtype=torch.float64), [p], grads)
    halves = [w0[e, h * inter : (h + 1) * inter] for e in range(E) for h in range(2)]
    ref_grads = [[g[0][e, h * inter : (h + 1) * inter] for e in range(E) for h in range(2)] for g in grads]
    ref = _muon_separate_reference(halves, ref_grads, 0.05, 0.1, 0.95)  # each half scaled by sqrt(max(I, H))
    got = [p.detach()[e, h * inter : (h + 1) * inter].double() for e in range(E) for h in range(2)]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # and it differs from orthogonalising the fused [2I, H] matrix
    fused = w0.clone().requires_grad_()
    _run(Muon([fused], lr=0.05, weight_decay=0.1, ns_dtype=torch.float64), [fused], grads)
    assert (fused.detach() - p.detach()).abs().max() > 1e-3


def test_rejects_non_matrix_params():
    with pytest.raises(ValueError, match="2-D matrices or 3-D expert stacks"):
        Muon([torch.zeros(4, requires_grad=True)])
    with pytest.raises(ValueError, match="row_split"):
        Muon([{"params": [torch.zeros(2, 5, 4, requires_grad=True)], "row_split": 2}])
    with pytest.raises(ValueError, match="not contiguous"):
        Muon([torch.zeros(6, 4).t().requires_grad_()])


def _per_matrix_step(params, groups, bufs, lr, wd, mu, nesterov):
    """One Muon step matrix by matrix (no batching across parameters): each [rows/row_split, cols] block gets
    its own `newton_schulz` call in fp32, in the step's arithmetic order (momentum, decay, update)."""
    for p, row_split, buf in zip(params, groups, bufs):
        g = p.grad
        buf.mul_(mu).add_(g)
        u = g.add(buf, alpha=mu) if nesterov else buf
        rows, cols = p.shape[-2] // row_split, p.shape[-1]
        p_blocks, u_blocks = p.detach().view(-1, rows, cols), u.reshape(-1, rows, cols)
        p_blocks.mul_(1 - lr * wd)
        for i in range(u_blocks.shape[0]):
            p_blocks[i].add_(
                newton_schulz(u_blocks[i], dtype=torch.float32), alpha=-lr * 0.2 * math.sqrt(max(rows, cols))
            )


@pytest.mark.parametrize("nesterov,batch_limit", [(True, None), (False, None), (True, 3000)])
def test_batched_step_equals_per_matrix_step(monkeypatch, nesterov, batch_limit):
    """Wide and tall matrices, an expert stack (tall experts) and a gate|up stack share one bucket of wide
    shape [24, 40]; (32, 32) gets its own. In fp32 the batched step is the per-matrix step up to fp32 rounding
    (the batched step folds -lr * scale into the last NS product and the decay into the update's one add)."""
    import optimizer.muon

    if batch_limit is not None:  # several stacks per bucket
        monkeypatch.setattr(optimizer.muon, "_LOCAL_BATCH_ELEMENTS", batch_limit)
    shapes_splits = [((24, 40), 1), ((40, 24), 1), ((32, 32), 1), ((3, 40, 24), 1), ((2, 48, 40), 2), ((24, 40), 1)]
    gen = torch.Generator().manual_seed(7)
    init = [torch.randn(s, generator=gen) for s, _ in shapes_splits]
    ours = [t.clone().requires_grad_() for t in init]
    ref = [t.clone().requires_grad_() for t in init]
    groups = [
        {"params": [p for p, (_, s) in zip(ours, shapes_splits) if s == split], "row_split": split} for split in (1, 2)
    ]
    hp = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov)
    opt = Muon(groups, **hp, ns_dtype=torch.float32)
    bufs = [torch.zeros_like(t) for t in init]
    for step_grads in _grads([s for s, _ in shapes_splits], STEPS, seed=8):
        for a, b, g in zip(ours, ref, step_grads):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        with torch.no_grad():
            _per_matrix_step(ref, [s for _, s in shapes_splits], bufs, 0.02, 0.1, 0.95, nesterov)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=2e-6)
    for p, buf in zip(ours, bufs):
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], buf, rtol=1e-6, atol=1e-6)


def test_newton_schulz_leaves_input_untouched():
    m = torch.randn(2, 30, 20, generator=torch.Generator().manual_seed(9))
    before = m.clone()
    newton_schulz(m, dtype=torch.float32)
    assert torch.equal(m, before)


def test_bf16_step_close_to_fp32_step():
    """The CUDA default (bf16 stack and iterations; fp32 momentum, norms, division and update) against the
    fp32 step on the mixed bucket: bf16 rounding of the NS input and of each product, which the quintic does
    not amplify; bound: relative Frobenius difference of each parameter's update < 3e-2 (measured ~1-2e-2)."""
    shapes = [(24, 40), (40, 24), (3, 40, 24), (32, 32)]
    gen = torch.Generator().manual_seed(10)
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    updates = {}
    for ns_dtype in (torch.float32, torch.bfloat16):
        params = [t.clone().requires_grad_() for t in init]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        Muon(params, lr=0.02, weight_decay=0.0, ns_dtype=ns_dtype).step()
        updates[ns_dtype] = [p.detach() - t for p, t in zip(params, init)]
    for ref, got in zip(updates[torch.float32], updates[torch.bfloat16]):
        assert got.dtype == torch.float32
        assert float((got - ref).norm() / ref.norm()) < 3e-2


class _CountMatmuls(TorchDispatchMode):
    """Counts batched / plain matmul launches (bmm, baddbmm, mm, addmm) by op name."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("bmm", "baddbmm", "mm", "addmm"):
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_same_shape_matrices_share_one_newton_schulz():
    """Eight small 'attention' matrices of two wide shapes (wide and tall of each) -> two NS calls per step:
    3 matmul launches per NS iteration per bucket, none per matrix."""
    shapes = [(8, 24), (24, 8), (8, 24), (24, 8), (16, 32), (32, 16), (16, 32), (32, 16)]
    params = [torch.randn(s, generator=torch.Generator().manual_seed(i)).requires_grad_() for i, s in enumerate(shapes)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = Muon(params, lr=0.02, ns_dtype=torch.float32)
    with _CountMatmuls() as counter:
        opt.step()
    assert counter.calls == {"bmm": 2 * 2 * 5, "baddbmm": 2 * 5}, counter.calls


def test_groups_with_different_lr_keep_their_own_update():
    """Same shapes in two param groups with different lr (and decay): each group's parameters get exactly the
    update a Muon of that group alone gives (the lr is folded into the NS stack, so buckets split by lr)."""
    shapes = [(24, 40), (40, 24), (24, 40)]
    gen = torch.Generator().manual_seed(3)
    init = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    grads = [_grads(shapes, STEPS, seed=4), _grads(shapes, STEPS, seed=5)]
    hps = [dict(lr=0.02, weight_decay=0.1), dict(lr=0.05, weight_decay=0.0)]
    together = [[t.clone().requires_grad_() for t in ts] for ts in init]
    opt = Muon([{"params": ps, **hp} for ps, hp in zip(together, hps)], ns_dtype=torch.float32)
    for step in range(STEPS):
        for ps, gs in zip(together, grads):
            for p, g in zip(ps, gs[step]):
                p.grad = g.clone()
        opt.step()
    for ts, gs, hp, got in zip(init, grads, hps, together):
        alone = [t.clone().requires_grad_() for t in ts]
        _run(Muon(alone, **hp, ns_dtype=torch.float32), alone, gs)
        for a, b in zip(got, alone):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def _momentum_run(momentum_dtype, steps=4):
    """Parameters of the mixed bucket after `steps` Muon steps (fp32 NS) with the given momentum dtype, and the
    optimizer."""
    shapes = [(24, 40), (40, 24), (3, 40, 24), (32, 32)]
    gen = torch.Generator().manual_seed(11)
    params = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
    opt = Muon(params, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, momentum_dtype=momentum_dtype)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


def test_bf16_momentum_halves_the_state_and_stays_close_to_fp32():
    """momentum_dtype=bf16: the buffers are bf16 (parameters and updates stay fp32); after 4 steps every
    parameter's total update is within 1e-2 (relative Frobenius) of the fp32-momentum run (measured ~1.5e-3:
    only the stored momentum is rounded, the arithmetic is fp32)."""
    ref, ref_opt = _momentum_run(None)
    got, opt = _momentum_run(torch.bfloat16)
    gen = torch.Generator().manual_seed(11)
    init = [torch.randn(p.shape, generator=gen) for p in ref]
    for p_ref, p_got, p0 in zip(ref, got, init):
        assert p_got.dtype == torch.float32
        assert opt.state[p_got]["momentum_buffer"].dtype == torch.bfloat16
        assert ref_opt.state[p_ref]["momentum_buffer"].dtype == torch.float32
        delta_ref, delta_got = p_ref.detach() - p0, p_got.detach() - p0
        assert 0 < float((delta_got - delta_ref).norm() / delta_ref.norm()) < 1e-2


def test_momentum_dtype_survives_a_state_dict_round_trip_in_either_direction():
    """torch.optim casts floating state to the parameter's dtype on load; Muon keeps its momentum_dtype: an fp32
    state loads into a bf16-momentum Muon as bf16 (rounded), and a bf16 state into an fp32 one as fp32."""
    params32, opt32 = _momentum_run(None, steps=1)
    params16, opt16 = _momentum_run(torch.bfloat16, steps=1)
    fresh16 = Muon([p.detach().clone().requires_grad_() for p in params32], momentum_dtype=torch.bfloat16)
    fresh16.load_state_dict(opt32.state_dict())
    for p_src, p_dst in zip(params32, fresh16.param_groups[0]["params"]):
        buf = fresh16.state[p_dst]["momentum_buffer"]
        assert buf.dtype == torch.bfloat16 and torch.equal(buf, opt32.state[p_src]["momentum_buffer"].bfloat16())
    fresh32 = Muon([p.detach().clone().requires_grad_() for p in params16])
    fresh32.load_state_dict(opt16.state_dict())
    for p_src, p_dst in zip(params16, fresh32.param_groups[0]["params"]):
        buf = fresh32.state[p_dst]["momentum_buffer"]
        assert buf.dtype == torch.float32 and torch.equal(buf, opt16.state[p_src]["momentum_buffer"].float())


def test_no_kernel_launches_to_prebuild_off_cuda():
    """`kernel_launches` announces the Triton elementwise kernels of CUDA parameters only: a CPU optimizer's step runs
    torch's kernels, so there is nothing for a prebuild to build."""
    params = [torch.zeros(8, 4, requires_grad=True), torch.zeros(2, 4, 8, requires_grad=True)]
    assert Muon(params, lr=0.02).kernel_launches() == []
