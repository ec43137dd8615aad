"""Triton backend vs the PyTorch reference: values and gradients, bf16 and fp32, odd sizes.

Runs on CUDA (H200). Also runs on CPU tensors under the Triton interpreter
(`TRITON_INTERPRET=1` with triton installed), which is how the kernels were checked without a GPU;
the compile and auto-dispatch tests need CUDA.
"""

import importlib.util
import os

import pytest
import torch

import activation
from activation import api

HAS_TRITON = importlib.util.find_spec("triton") is not None
ON_CUDA = torch.cuda.is_available() and HAS_TRITON
INTERPRETED = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (ON_CUDA or INTERPRETED), reason="needs CUDA + triton (or TRITON_INTERPRET=1 with triton)"),
]
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")

# (rows, features): odd row counts, Motif widths (1280 expert, 12288 dense, 16384 = mHC n*H), non-powers of 2
SHAPES = [(37, 1280), (19, 3072), (6, 12288), (4, 16384), (1001, 64), (13, 100)]
if INTERPRETED:
    SHAPES = [(37, 1280), (6, 12288), (130, 64), (13, 100)]
DTYPES = [torch.float32, torch.bfloat16]


def _run(backend, monkeypatch, fn, *tensors):
    """Run fn on fresh leaf copies of `tensors` with the given backend; return (outputs, grads)."""
    monkeypatch.setattr(api, "use_triton", lambda x: backend == "triton")
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator(device=DEVICE).manual_seed(123)
    loss = sum((o.float() * torch.randn(o.shape, device=DEVICE, generator=gen)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [leaf.grad for leaf in leaves if leaf.requires_grad]


def _assert_close(actual, expected, dtype, what):
    """Within a few units of the output dtype's precision, relative to the tensor's largest value."""
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    scale = expected.float().abs().max().item() + 1e-6
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= tol * scale, f"{what}: max |diff| {err:.3g} > {tol} * max |ref| {scale:.3g}"


def _compare(monkeypatch, fn, dtype, *tensors):
    ref_out, ref_grads = _run("torch", monkeypatch, fn, *tensors)
    tri_out, tri_grads = _run("triton", monkeypatch, fn, *tensors)
    for i, (a, e) in enumerate(zip(tri_out, ref_out)):
        assert a.dtype == e.dtype and a.shape == e.shape
        _assert_close(a, e, dtype, f"output {i}")
    assert len(tri_grads) == len(ref_grads)
    for i, (a, e) in enumerate(zip(tri_grads, ref_grads)):
        assert a.dtype == e.dtype, f"grad {i} dtype"
        _assert_close(a, e, dtype, f"grad {i}")


def _rand(shape, dtype, scale=1.0, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return (scale * torch.randn(shape, device=DEVICE, generator=gen)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(monkeypatch, shape, dtype):
    x = _rand(shape, dtype)
    w = _rand(shape[-1:], torch.float32, seed=1) + 1
    _compare(monkeypatch, lambda x, w: activation.rms_norm(x, w, 1e-5), dtype, x, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm(monkeypatch, shape, dtype):
    x, res = _rand(shape, dtype), _rand(shape, dtype, seed=2)
    w = _rand(shape[-1:], torch.float32, seed=1) + 1
    _compare(monkeypatch, lambda x, r, w: activation.fused_add_rms_norm(x, r, w, 1e-5), dtype, x, res, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_poly_norm(monkeypatch, shape, dtype):
    x = _rand(shape, dtype, scale=2.0)
    w, b = _rand((3,), torch.float32, seed=3), _rand((1,), torch.float32, seed=4)
    _compare(monkeypatch, lambda x, w, b: activation.poly_norm(x, w, b), dtype, x, w, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_mul_poly_norm(monkeypatch, shape, dtype):
    gate, up = _rand(shape, dtype, scale=2.0), _rand(shape, dtype, seed=5)
    w, b = _rand((3,), torch.float32, seed=3), _rand((1,), torch.float32, seed=4)
    _compare(
        monkeypatch,
        lambda g, u, w, b: activation.fused_mul_poly_norm(g, u, w, b, output_scale=0.5),
        dtype,
        gate,
        up,
        w,
        b,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_up", [False, True])
@pytest.mark.parametrize("shape", [(301, 1280), (45, 100)])
def test_grouped_poly_norm(monkeypatch, shape, dtype, with_up):
    rows, d = shape
    num_experts = 8
    # uneven groups with two empty experts; the last 21 rows are padding (rows >= offs[-1])
    sizes = torch.tensor([3, 0, 40, 1, 0, 100, 7, 0], dtype=torch.int64)
    sizes = (sizes * (rows - 21) // sizes.sum()).clamp(min=0)
    offs = sizes.cumsum(0).to(torch.int32).to(DEVICE)
    x = _rand(shape, dtype, scale=2.0)
    x[int(offs[-1]) :] = float("nan")  # padding rows may hold garbage
    up = _rand(shape, dtype, seed=6)
    w = _rand((num_experts, 3), torch.float32, seed=7)
    b = _rand((num_experts, 1), torch.float32, seed=8)
    b[0, 0], b[2, 0] = 0.9, -0.7  # clamped experts: zero bias grad

    def fn(x, w, b, *maybe_up):
        return activation.grouped_poly_norm(
            x, w, b, offs, bias_clamp=0.5, up=maybe_up[0] if maybe_up else None, output_scale=0.5
        )

    tensors = (x, w, b, up) if with_up else (x, w, b)
    ref_out, ref_grads = _run("torch", monkeypatch, fn, *tensors)
    tri_out, tri_grads = _run("triton", monkeypatch, fn, *tensors)
    valid = int(offs[-1])
    assert torch.equal(tri_out[0][valid:], torch.zeros_like(tri_out[0][valid:]))
    _assert_close(tri_out[0], ref_out[0], dtype, "output")
    for i, (a, e) in enumerate(zip(tri_grads, ref_grads)):
        _assert_close(a, e, dtype, f"grad {i}")
    assert torch.equal(tri_grads[0][valid:], torch.zeros_like(tri_grads[0][valid:]))
    assert tri_grads[2][0, 0] == 0 and tri_grads[2][2, 0] == 0


def test_per_expert_sums_over_many_blocks():
    """The grouped weight-grad reduction: experts spanning block edges, empty experts, padding rows."""
    from activation.segments import expert_of_row
    from activation.triton_kernels import SEGMENT_BLOCK_ROWS, per_expert_sums

    sizes = [3, 0, SEGMENT_BLOCK_ROWS + 500, 1, 0, SEGMENT_BLOCK_ROWS - 7, 9, 0]
    rows = sum(sizes) + 37  # 37 padding rows
    offs = torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)
    stats = _rand((rows, 4), torch.float32)
    expert = expert_of_row(offs, rows)
    got = per_expert_sums(stats, expert, len(sizes))
    expected = torch.stack([stats.double()[expert == e].sum(0) for e in range(len(sizes))])
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


def test_custom_ops_pass_opcheck():
    """Schema, fake (meta) kernels and autograd registration of the torch.library ops."""
    x = _rand((9, 40), torch.float32)
    up = _rand((9, 40), torch.float32, seed=1)
    w = _rand((2, 3), torch.float32, seed=2).requires_grad_(True)
    b = _rand((2, 1), torch.float32, seed=3).requires_grad_(True)
    offs = torch.tensor([4, 7], dtype=torch.int32, device=DEVICE)
    rw = _rand((40,), torch.float32, seed=4).requires_grad_(True)
    cases = [
        (torch.ops.activation.poly_norm_fwd.default, (x.requires_grad_(True), up, w, b, offs, 1e-6, 0.5)),
        (torch.ops.activation.poly_norm_fwd.default, (x, None, w[:1], b[:1], None, 1e-6, 1.0)),
        (torch.ops.activation.rms_norm_fwd.default, (x, up, rw, 1e-5)),
        (torch.ops.activation.rms_norm_fwd.default, (x, None, rw, 1e-5)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@needs_cuda
def test_auto_dispatch_uses_triton_on_cuda(monkeypatch):
    monkeypatch.delenv("ACTIVATION_BACKEND", raising=False)
    from activation import triton_ops

    assert api._backend(torch.zeros(1, device="cuda")) is triton_ops
    monkeypatch.setenv("ACTIVATION_BACKEND", "torch")
    assert api._backend(torch.zeros(1, device="cuda")) is not triton_ops


@needs_cuda
def test_triton_ops_under_torch_compile_fullgraph(monkeypatch):
    monkeypatch.delenv("ACTIVATION_BACKEND", raising=False)
    torch._dynamo.reset()
    offs = torch.tensor([100, 300], dtype=torch.int32, device="cuda")

    def block(x, up, rw, w, b, ew, eb):
        h = activation.rms_norm(x, rw, 1e-5)
        y = activation.fused_mul_poly_norm(h, up, w, b, output_scale=0.5)
        return y + activation.grouped_poly_norm(h, ew, eb, offs, bias_clamp=0.5, up=up, output_scale=0.5)

    tensors = [
        _rand((320, 1280), torch.bfloat16),
        _rand((320, 1280), torch.bfloat16, seed=1),
        _rand((1280,), torch.float32, seed=2),
        _rand((3,), torch.float32, seed=3),
        _rand((1,), torch.float32, seed=4),
        _rand((2, 3), torch.float32, seed=5),
        _rand((2, 1), torch.float32, seed=6),
    ]
    eager_leaves = [t.clone().requires_grad_(True) for t in tensors]
    compiled_leaves = [t.clone().requires_grad_(True) for t in tensors]
    eager = block(*eager_leaves)
    compiled = torch.compile(block, fullgraph=True)(*compiled_leaves)
    torch.testing.assert_close(compiled, eager)
    eager.float().square().sum().backward()
    compiled.float().square().sum().backward()
    for a, e in zip(compiled_leaves, eager_leaves):
        torch.testing.assert_close(a.grad, e.grad, rtol=2e-2, atol=2e-2)


@needs_cuda
def test_reference_grouped_poly_norm_under_inductor(monkeypatch):
    """The reference backend compiled by inductor on CUDA (the benchmark's `compile` column): long enough
    for inductor's split kernels, padding rows, an empty expert; values and gradients vs eager."""
    monkeypatch.setenv("ACTIVATION_BACKEND", "torch")
    torch._dynamo.reset()
    rows, d, num_experts = 65536, 256, 8
    sizes = torch.tensor([9000, 0, 20000, 1, 15000, 7000, 8000, 5000])
    offs = sizes.cumsum(0).to(torch.int32).cuda()  # 535 padding rows

    def fn(x, up, w, b):
        return activation.grouped_poly_norm(x, w, b, offs, bias_clamp=0.5, up=up, output_scale=0.5)

    tensors = [
        _rand((rows, d), torch.bfloat16),
        _rand((rows, d), torch.bfloat16, seed=1),
        _rand((num_experts, 3), torch.float32, seed=2),
        _rand((num_experts, 1), torch.float32, seed=3),
    ]
    eager_leaves = [t.clone().requires_grad_(True) for t in tensors]
    compiled_leaves = [t.clone().requires_grad_(True) for t in tensors]
    eager = fn(*eager_leaves)
    compiled = torch.compile(fn, fullgraph=True)(*compiled_leaves)
    _assert_close(compiled, eager, torch.bfloat16, "output")
    g = _rand((rows, d), torch.bfloat16, seed=4)
    (eager.float() * g.float()).sum().backward()
    (compiled.float() * g.float()).sum().backward()
    for i, (a, e) in enumerate(zip(compiled_leaves, eager_leaves)):
        _assert_close(a.grad, e.grad, torch.bfloat16, f"grad {i}")
