"""CPU tests of the public ops (reference backend): values vs float64 formulas written here, analytic
backward vs gradcheck, grouped vs a per-expert loop, bias clamp, fused order of operations, dtypes."""

import pytest
import torch

import activation
from activation import reference
from activation.segments import expert_of_row, segment_sum_rows


# ------------------------------------------------------------------ independent float64 formulas
def rms_norm_f64(x, weight, eps):
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight.double()


def normalise_f64(u, eps):
    return u / torch.sqrt((u * u).mean(-1, keepdim=True) + eps)


def poly_norm_f64(x, weight, bias, eps, sigmoid_weight=True):
    x = x.double()
    w = weight.double()
    w = 1.0 / (1.0 + torch.exp(-w)) if sigmoid_weight else w
    terms = w[0] * normalise_f64(x**3, eps) + w[1] * normalise_f64(x**2, eps) + w[2] * normalise_f64(x, eps)
    return terms + bias.double()


def grouped_poly_norm_loop(x, weight, bias, offs, eps, sigmoid_weight, bias_clamp, up, output_scale):
    """Per-expert Python loop, output in x.dtype, following the contract's order of operations."""
    out = torch.zeros_like(x)
    start = 0
    for e, end in enumerate(offs.tolist()):
        b = bias[e]
        if bias_clamp is not None:
            b = b.clamp(-bias_clamp, bias_clamp)
        if end > start:
            p = poly_norm_f64(x[start:end], weight[e], b, eps, sigmoid_weight)
            if up is not None:
                p = p * up[start:end].double()
            out[start:end] = (p.to(x.dtype) * output_scale).to(x.dtype)
        start = end
    return out


def _params(seed=0, experts=None):
    g = torch.Generator().manual_seed(seed)
    shape_w = (3,) if experts is None else (experts, 3)
    shape_b = (1,) if experts is None else (experts, 1)
    return torch.randn(shape_w, generator=g), 0.3 * torch.randn(shape_b, generator=g)


# ----------------------------------------------------------------------------- forward values
@pytest.mark.parametrize("shape", [(5, 24), (2, 3, 40)])
def test_rms_norm_matches_formula(shape):
    x = torch.randn(shape, dtype=torch.float64)
    w = torch.randn(shape[-1], dtype=torch.float64)
    torch.testing.assert_close(activation.rms_norm(x, w, 1e-5), rms_norm_f64(x, w, 1e-5))


def test_fused_add_rms_norm_matches_formula():
    x, res = torch.randn(2, 4, 32, dtype=torch.float64), torch.randn(2, 4, 32, dtype=torch.float64)
    w = torch.randn(32, dtype=torch.float64)
    y, h = activation.fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(h, x + res)
    torch.testing.assert_close(y, rms_norm_f64(x + res, w, 1e-6))


@pytest.mark.parametrize("sigmoid_weight", [True, False])
def test_poly_norm_matches_formula(sigmoid_weight):
    x = torch.randn(3, 5, 48, dtype=torch.float64)
    w, b = _params()
    y = activation.poly_norm(x, w, b, eps=1e-6, sigmoid_weight=sigmoid_weight)
    torch.testing.assert_close(y, poly_norm_f64(x, w, b, 1e-6, sigmoid_weight))


def test_fused_mul_poly_norm_matches_formula():
    gate, up = torch.randn(7, 40, dtype=torch.float64), torch.randn(7, 40, dtype=torch.float64)
    w, b = _params(1)
    y = activation.fused_mul_poly_norm(gate, up, w, b, eps=1e-6, output_scale=0.5)
    torch.testing.assert_close(y, poly_norm_f64(gate, w, b, 1e-6) * up * 0.5)


@pytest.mark.parametrize("with_up", [False, True])
def test_grouped_matches_per_expert_loop(with_up):
    offs = torch.tensor([3, 3, 8, 12], dtype=torch.int32)  # expert 1 empty, rows 12..14 are padding
    x = torch.randn(15, 32, dtype=torch.float64)
    up = torch.randn(15, 32, dtype=torch.float64) if with_up else None
    w, b = _params(2, experts=4)
    b[2, 0] = 0.9  # outside the clamp
    y = activation.grouped_poly_norm(x, w, b, offs, eps=1e-6, bias_clamp=0.5, up=up, output_scale=0.5)
    expected = grouped_poly_norm_loop(x, w, b, offs, 1e-6, True, 0.5, up, 0.5)
    torch.testing.assert_close(y, expected)
    assert torch.equal(y[12:], torch.zeros(3, 32, dtype=torch.float64))


def test_grouped_padding_rows_with_nonfinite_values_give_zero_and_zero_grad():
    offs = torch.tensor([2, 4], dtype=torch.int32)
    x = torch.randn(6, 16)
    x[4:] = float("nan")
    x[5, 0] = float("inf")
    x.requires_grad_(True)
    up = torch.randn(6, 16)
    up[4:] = float("inf")
    w, b = _params(3, experts=2)
    w.requires_grad_(True)
    b.requires_grad_(True)
    y = activation.grouped_poly_norm(x, w, b, offs, up=up)
    assert torch.equal(y[4:], torch.zeros(2, 16))
    y.sum().backward()
    assert torch.equal(x.grad[4:], torch.zeros(2, 16))
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all() and torch.isfinite(b.grad).all()


# --------------------------------------------------------------------------- gradients (fp64)
def _gradcheck(fn, *inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-4)


def test_rms_norm_gradcheck():
    x = torch.randn(4, 12, dtype=torch.float64, requires_grad=True)
    w = torch.randn(12, dtype=torch.float64, requires_grad=True)
    _gradcheck(lambda x, w: reference.RMSNormFn.apply(x, None, w, 1e-5), x, w)


def test_fused_add_rms_norm_gradcheck_both_outputs():
    x = torch.randn(4, 12, dtype=torch.float64, requires_grad=True)
    res = torch.randn(4, 12, dtype=torch.float64, requires_grad=True)
    w = torch.randn(12, dtype=torch.float64, requires_grad=True)
    _gradcheck(lambda x, r, w: reference.RMSNormFn.apply(x, r, w, 1e-5), x, res, w)


def test_poly_norm_fn_gradcheck():
    x = torch.randn(5, 10, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(1, 1, dtype=torch.float64, requires_grad=True)
    _gradcheck(lambda x, w, b: reference.PolyNormFn.apply(x, None, w, b, None, 1e-6, 1.0), x, w, b)


def test_fused_mul_poly_norm_fn_gradcheck():
    x = torch.randn(5, 10, dtype=torch.float64, requires_grad=True)
    up = torch.randn(5, 10, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(1, 1, dtype=torch.float64, requires_grad=True)
    _gradcheck(lambda x, u, w, b: reference.PolyNormFn.apply(x, u, w, b, None, 1e-6, 0.5), x, up, w, b)


@pytest.mark.parametrize("with_up", [False, True])
def test_grouped_poly_norm_fn_gradcheck(with_up):
    offs = torch.tensor([2, 2, 5], dtype=torch.int32)
    x = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    up = torch.randn(7, 8, dtype=torch.float64, requires_grad=with_up)
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 1, dtype=torch.float64, requires_grad=True)
    _gradcheck(
        lambda x, u, w, b: reference.PolyNormFn.apply(x, u if with_up else None, w, b, offs, 1e-6, 0.5), x, up, w, b
    )


def test_public_ops_gradcheck_through_parameter_transforms():
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    b = torch.tensor([[0.2], [-0.1]], dtype=torch.float64, requires_grad=True)
    offs = torch.tensor([3, 5], dtype=torch.int32)
    _gradcheck(lambda x, w, b: activation.grouped_poly_norm(x, w, b, offs, bias_clamp=0.5), x, w, b)
    _gradcheck(lambda x, w, b: activation.poly_norm(x, w[0], b[0]), x, w, b)


def test_backward_matches_plain_autograd_of_formula():
    """Analytic backward in fp32 vs autograd through the float64 formula."""
    x = torch.randn(9, 64, requires_grad=True)
    up = torch.randn(9, 64, requires_grad=True)
    w, b = _params(4)
    w.requires_grad_(True)
    b.requires_grad_(True)
    g = torch.randn(9, 64)
    activation.fused_mul_poly_norm(x, up, w, b, output_scale=0.5).backward(g)
    x64, up64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, up, w, b))
    (poly_norm_f64(x64, w64, b64, 1e-6) * up64 * 0.5).backward(g.double())
    for ours, expected in ((x.grad, x64.grad), (up.grad, up64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        torch.testing.assert_close(ours.double(), expected, rtol=1e-4, atol=1e-4)


def test_grouped_weight_and_bias_grads_match_loop_autograd():
    offs = torch.tensor([4, 4, 9], dtype=torch.int32)
    x = torch.randn(11, 16, dtype=torch.float64, requires_grad=True)
    up = torch.randn(11, 16, dtype=torch.float64)
    w, b = _params(5, experts=3)
    w, b = w.double().requires_grad_(True), b.double().requires_grad_(True)
    g = torch.randn(11, 16, dtype=torch.float64)
    activation.grouped_poly_norm(x, w, b, offs, up=up, output_scale=0.5).backward(g)
    w2, b2 = w.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    loss = 0
    for e, (start, end) in enumerate([(0, 4), (4, 4), (4, 9)]):
        p = poly_norm_f64(x2[start:end], w2[e], b2[e], 1e-6) * up[start:end] * 0.5
        loss = loss + (p * g[start:end]).sum()
    loss.backward()
    torch.testing.assert_close(w.grad, w2.grad)
    torch.testing.assert_close(b.grad, b2.grad)
    torch.testing.assert_close(x.grad, x2.grad)
    assert torch.equal(w.grad[1], torch.zeros(3, dtype=torch.float64))


def test_bias_clamp_gradient_is_zero_outside_range():
    offs = torch.tensor([3, 6], dtype=torch.int32)
    x = torch.randn(6, 8)
    w = torch.zeros(2, 3, requires_grad=True)
    b = torch.tensor([[0.7], [0.3]], requires_grad=True)
    y = activation.grouped_poly_norm(x, w, b, offs, bias_clamp=0.5)
    y.sum().backward()
    assert b.grad[0, 0] == 0.0
    assert b.grad[1, 0] == pytest.approx(3 * 8)  # d(sum y)/db = number of elements of the expert
    expected = grouped_poly_norm_loop(x, w.detach(), b.detach(), offs, 1e-6, True, 0.5, None, 1.0)
    torch.testing.assert_close(y, expected)


# ---------------------------------------------------------------------------------- dtypes and order
def test_bf16_in_bf16_out_with_fp32_math():
    x = torch.randn(4, 256) * 3
    xb = x.bfloat16().requires_grad_(True)
    w, b = _params(6)
    y = activation.poly_norm(xb, w, b)
    assert y.dtype == torch.bfloat16
    # fp32 math then one rounding: equal to the float64 formula rounded to bf16 up to one bf16 ulp
    expected = poly_norm_f64(xb.detach(), w, b, 1e-6)
    torch.testing.assert_close(y.double(), expected, rtol=2**-7, atol=1e-2)
    y.float().sum().backward()
    assert xb.grad.dtype == torch.bfloat16
    assert torch.isfinite(xb.grad).all()
    x_big = torch.full((1, 64), 400.0, dtype=torch.bfloat16)  # x^6 = 4e15 overflows bf16, fine in fp32
    assert torch.isfinite(activation.poly_norm(x_big, w, b)).all()
    yr = activation.rms_norm(xb.detach(), torch.ones(256, dtype=torch.bfloat16), 1e-5)
    assert yr.dtype == torch.bfloat16


def test_fused_mul_rounds_to_bf16_before_the_scale():
    """out = (P(gate) * up in fp32).to(bf16) * scale; scaling before the rounding differs in general."""
    torch.manual_seed(7)
    gate = torch.randn(64, 128).bfloat16()
    up = torch.randn(64, 128).bfloat16()
    w, b = _params(7)
    scale = 0.3  # not a power of two, so the two orders round differently
    y = activation.fused_mul_poly_norm(gate, up, w, b, output_scale=scale)
    prod32 = (poly_norm_f64(gate, w, b, 1e-6) * up.double()).float()
    right_order = prod32.bfloat16() * scale
    wrong_order = (prod32 * scale).bfloat16()
    assert not torch.equal(right_order, wrong_order)
    mismatch_right = (y != right_order).float().mean().item()
    mismatch_wrong = (y != wrong_order).float().mean().item()
    assert mismatch_right < 0.01 < mismatch_wrong


def test_grads_keep_parameter_dtypes():
    x = torch.randn(3, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    activation.poly_norm(x, w, b).float().sum().backward()
    assert w.grad.dtype == torch.bfloat16 and b.grad.dtype == torch.float32
    rw = torch.ones(16, dtype=torch.bfloat16, requires_grad=True)
    activation.rms_norm(x, rw, 1e-5).float().sum().backward()
    assert rw.grad.dtype == torch.bfloat16


def test_fused_add_rms_norm_grad_reaches_both_inputs_and_sum_output():
    x = torch.randn(3, 16, requires_grad=True)
    res = torch.randn(3, 16, requires_grad=True)
    w = torch.randn(16)
    y, h = activation.fused_add_rms_norm(x, res, w, 1e-5)
    (y.sum() + 2 * h.sum()).backward()
    x2 = (x.detach() + res.detach()).double().requires_grad_(True)
    (rms_norm_f64(x2, w, 1e-5).sum() + 2 * x2.sum()).backward()
    torch.testing.assert_close(x.grad.double(), x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res.grad, x.grad)


# --------------------------------------------------------------------------- helpers and checks
def test_expert_of_row_and_segment_sum():
    offs = torch.tensor([2, 2, 5], dtype=torch.int32)
    assert expert_of_row(offs, 7).tolist() == [0, 0, 2, 2, 2, 3, 3]
    values = torch.arange(14, dtype=torch.float32).view(7, 2)
    sums = segment_sum_rows(values, expert_of_row(offs, 7), 3)
    assert sums.tolist() == [[0 + 2, 1 + 3], [0, 0], [4 + 6 + 8, 5 + 7 + 9]]


def test_strided_gate_and_up_views_of_one_buffer():
    gate_up = torch.randn(2, 5, 2 * 24)
    gate, up = gate_up[..., :24], gate_up[..., 24:]
    w, b = _params(8)
    y = activation.fused_mul_poly_norm(gate, up, w, b)
    torch.testing.assert_close(y.double(), poly_norm_f64(gate, w, b, 1e-6) * up.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: activation.poly_norm(torch.randn(2, 4), torch.zeros(2), torch.zeros(1)), "`weight` must have shape"),
        (lambda: activation.rms_norm(torch.randn(2, 4), torch.ones(5), 1e-5), "`weight` must have shape"),
        (
            lambda: activation.grouped_poly_norm(
                torch.randn(4, 4), torch.zeros(2, 3), torch.zeros(2, 1), torch.tensor([1.0, 4.0])
            ),
            "`offs` must be a 1-D int32/int64",
        ),
        (
            lambda: activation.fused_add_rms_norm(torch.randn(2, 4), torch.randn(2, 4).double(), torch.ones(4), 1e-5),
            "`residual` dtype",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


def test_backend_env_override(monkeypatch):
    from activation import backend

    monkeypatch.setenv("ACTIVATION_BACKEND", "torch")
    assert backend.use_triton(torch.zeros(1)) is False
    monkeypatch.setenv("ACTIVATION_BACKEND", "triton")
    with pytest.raises(RuntimeError, match="ACTIVATION_BACKEND=triton"):
        backend.use_triton(torch.zeros(1))
    monkeypatch.setenv("ACTIVATION_BACKEND", "cuda")
    with pytest.raises(ValueError, match="ACTIVATION_BACKEND"):
        backend.use_triton(torch.zeros(1))
    monkeypatch.delenv("ACTIVATION_BACKEND")
    assert backend.use_triton(torch.zeros(1)) is False  # CPU tensor -> reference


def test_grouped_poly_norm_compiles_with_aot_autograd():
    """aot_eager traces forward AND backward (the autograd.Function's backward included) into one graph
    each, with no graph break. (Inductor on CUDA is checked in test_triton.py.)"""
    torch._dynamo.reset()
    offs = torch.tensor([10, 10, 30, 60], dtype=torch.int32)
    tensors = [torch.randn(64, 16), torch.randn(64, 16), torch.randn(4, 3), torch.randn(4, 1)]

    def fn(x, up, w, b):
        return activation.grouped_poly_norm(x, w, b, offs, bias_clamp=0.5, up=up, output_scale=0.5)

    eager_leaves = [t.clone().requires_grad_(True) for t in tensors]
    compiled_leaves = [t.clone().requires_grad_(True) for t in tensors]
    eager = fn(*eager_leaves)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(*compiled_leaves)
    torch.testing.assert_close(compiled, eager)
    g = torch.randn(64, 16)
    (eager * g).sum().backward()
    (compiled * g).sum().backward()
    for a, e in zip(compiled_leaves, eager_leaves):
        torch.testing.assert_close(a.grad, e.grad)


def test_public_ops_trace_under_torch_compile_without_graph_breaks():
    """fullgraph=True: the dispatch, parameter transforms and autograd.Functions trace in one graph."""
    offs = torch.tensor([3, 5], dtype=torch.int32)

    def block(x, up, w, b, ew, eb, rw):
        y, h = activation.fused_add_rms_norm(activation.rms_norm(x, rw, 1e-5), x, rw, 1e-5)
        grouped = activation.grouped_poly_norm(h, ew, eb, offs, bias_clamp=0.5, up=up)
        return activation.fused_mul_poly_norm(y, up, w, b, output_scale=0.5) + grouped + activation.poly_norm(x, w, b)

    tensors = [torch.randn(s) for s in ((6, 8), (6, 8), (3,), (1,), (2, 3), (2, 1), (8,))]
    eager_leaves = [t.clone().requires_grad_(True) for t in tensors]
    compiled_leaves = [t.clone().requires_grad_(True) for t in tensors]
    eager = block(*eager_leaves)
    compiled = torch.compile(block, fullgraph=True, backend="eager")(*compiled_leaves)
    torch.testing.assert_close(compiled, eager)
    eager.sum().backward()
    compiled.sum().backward()
    for a, e in zip(compiled_leaves, eager_leaves):
        torch.testing.assert_close(a.grad, e.grad)


def _saved_for_backward_bytes(fn):
    """(fn(), bytes of the distinct storages autograd saves for backward while running fn)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


@pytest.mark.parametrize("grouped", [False, True])
def test_poly_norm_saves_only_inputs_and_row_stats(grouped):
    """Selective recompute (docs/model-spec.md §1.1 'needs saved: x (or recompute), r_1, r_2, r_3'): the fused PolyNorm
    keeps only its inputs x and up (bf16) and the per-row fp32 r_p [N, 3] for backward; x^2, x^3, the
    normalised terms and P(x) are recomputed there. Bound: x + up + r_p + 1 KiB for the tiny parameters."""
    N, D, E = 64, 32, 4
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g).to(torch.bfloat16).requires_grad_()
    up = torch.randn(N, D, generator=g).to(torch.bfloat16).requires_grad_()
    if grouped:
        weight = torch.zeros(E, 3, requires_grad=True)
        bias = torch.zeros(E, 1, requires_grad=True)
        offs = torch.tensor([10, 30, 50, 64])
        out, saved = _saved_for_backward_bytes(
            lambda: activation.grouped_poly_norm(x, weight, bias, offs, bias_clamp=1.0, up=up, output_scale=0.5)
        )
    else:
        weight = torch.zeros(3, requires_grad=True)
        bias = torch.zeros(1, requires_grad=True)
        out, saved = _saved_for_backward_bytes(
            lambda: activation.fused_mul_poly_norm(x, up, weight, bias, output_scale=0.5)
        )
    out.float().sum().backward()
    inputs = 2 * N * D * x.element_size()
    assert inputs <= saved <= inputs + N * 3 * 4 + 1024, saved
    assert x.grad is not None and up.grad is not None and weight.grad is not None
