"""mHC's fused backward kernels (`layers.mhc_kernels` via the custom ops of `layers.mhc_ops`): each against the
same gradient written as float64 tensor math, with the stream given and rebuilt from its source, for n = 4 and a
non-power-of-two n, and stream widths that are not a multiple of the kernels' column block; then a whole block's
mHC backward with the kernels on against the tensor-op path. They run on CUDA, or on the CPU under the Triton
interpreter (tests/triton_kernels.py)."""

import pytest
import torch

from llm_training.layers.mhc import hyper_connections as mhc
from llm_training.layers.mhc import ops as mhc_ops
from llm_training.layers.mhc.hyper_connections import MHC, StreamSource
from tests.triton_kernels import KERNEL_DEVICE, needs_triton_kernels

pytestmark = [pytest.mark.gpu, needs_triton_kernels]
BF16 = torch.bfloat16


def _inputs(T, n, H, seed=0):
    """A bf16 source (X0, y0) with fp32 coefficients, and X = mix(X0, H0, p0, y0) as the forward stores it."""
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.randn(T, n, H, generator=gen).to(BF16)
    h0 = torch.rand(T, n, n, generator=gen)
    p0 = torch.rand(T, n, generator=gen) * 2
    y0 = torch.randn(T, H, generator=gen).to(BF16)
    x = mhc._mix(x0, h0, p0, y0)
    return [t.to(KERNEL_DEVICE) for t in (x, x0, h0, p0, y0)], gen


def _args(x, source, from_source):
    """(x, x0, h0, p0, y0) arguments of an op: the stream, or its source."""
    return (None, *source) if from_source else (x, None, None, None, None)


def _close(got, want, tol):
    """Elementwise, for the outputs rounded to bf16 (tol 1e-2: one rounding)."""
    torch.testing.assert_close(got.double().cpu(), want.cpu(), atol=tol, rtol=tol)


def _close_norm(got, want, tol=1e-4):
    """Relative Frobenius error, for the fp32 reductions over the stream. With the stream rebuilt from its source,
    the kernel's fp32 sum order can round an element one bf16 step away from the forward's (an element in ~10^4
    at these sizes), which the norm absorbs; a wrong term would not pass."""
    err = ((got.double().cpu() - want.cpu()).norm() / want.cpu().norm()).item()
    assert err < tol, err


CASES = [(4, 64), (4, 272), (3, 40)]  # (n, H): 272 = two full 128-column steps and a partial one; 40: no multiple of 16


@pytest.mark.parametrize("block_h", [None, 128])
@pytest.mark.parametrize("from_source", [False, True])
@pytest.mark.parametrize("n,H", CASES)
def test_mix_backward(n, H, from_source, block_h):
    """Through the custom op (block_h None: the default tiling), and the kernel called with another column block."""
    T = 37
    (x, *source), gen = _inputs(T, n, H)
    h = torch.rand(T, n, n, generator=gen).to(KERNEL_DEVICE)
    p = torch.rand(T, n, generator=gen).to(KERNEL_DEVICE)
    y = torch.randn(T, H, generator=gen).to(BF16).to(KERNEL_DEVICE)
    g = torch.randn(T, n, H, generator=gen).to(BF16).to(KERNEL_DEVICE)
    x_, g_ = x.double(), g.double()
    xarg, *src = _args(x, source, from_source)
    if block_h is None:
        dx, dh, dp, dy = mhc_ops.mix_backward(g, xarg, h, p, y, *src)
    else:
        from llm_training.layers.mhc import kernels as mhc_kernels  # imports triton

        dx, dh, dp, dy = mhc_kernels.mix_backward(g, xarg, h, p, y, tuple(src), block_h=block_h, num_warps=4)
    assert dx.dtype == BF16 and dy.dtype == BF16 and dh.dtype == dp.dtype == torch.float32
    _close(dx, torch.einsum("tij,tic->tjc", h.double(), g_), 1e-2)  # bf16 output: one rounding
    _close(dy, torch.einsum("ti,tic->tc", p.double(), g_), 1e-2)
    _close_norm(dh, torch.einsum("tic,tjc->tij", g_, x_))
    _close_norm(dp, torch.einsum("tic,tc->ti", g_, y.double()))


@pytest.mark.parametrize("from_source", [False, True])
@pytest.mark.parametrize("n,H", CASES)
def test_collapse_backward(n, H, from_source):
    T = 37
    (x, *source), gen = _inputs(T, n, H)
    h = torch.rand(T, n, generator=gen).to(KERNEL_DEVICE)
    gu = torch.randn(T, H, generator=gen).to(BF16).to(KERNEL_DEVICE)
    xarg, *src = _args(x, source, from_source)
    dx, dh = mhc_ops.collapse_backward(gu, xarg, h, *src)
    _close(dx, h.double()[:, :, None] * gu.double()[:, None, :], 1e-2)
    _close_norm(dh, torch.einsum("tic,tc->ti", x.double(), gu.double()))


def _block_grads(use_kernels: bool, monkeypatch, compiled: bool = False) -> dict:
    """Gradients of an attention-like and an FFN-like mHC sub-layer pair (the second from the first's StreamSource,
    as TransformerBlock runs them) with a bf16 stream, the kernels on (`fused`) or off; `compiled`: through torch.compile
    (aot_eager: the ops' fake implementations trace the backward graph, the kernels run as opaque nodes)."""
    monkeypatch.setattr(mhc_ops, "uses_stream_kernels", lambda x: True)  # the interpreter runs them on the CPU
    torch.manual_seed(0)
    n, H, fused = 4, 64, use_kernels
    m1, m2 = (MHC(H, n, 20, 1e-6, False, 0.0, fused_backward=fused) for _ in range(2))
    for m in (m1, m2):
        m.init_weights()
    lin1, lin2 = torch.nn.Linear(H, H, bias=False), torch.nn.Linear(H, H, bias=False)
    modules = [m.to(KERNEL_DEVICE) for m in (m1, m2, lin1, lin2)]
    x = torch.randn(2, 24, n, H).to(BF16).to(KERNEL_DEVICE).requires_grad_()

    def pair(x):
        h_pre, h_post, h_res = m1.coefficients(x)
        y = lin1(MHC.collapse(x, h_pre, fused=fused).float()).to(BF16)
        mid = StreamSource(x, h_res, h_post, y)
        x1 = MHC.update(*mid, fused=fused)
        h_pre, h_post, h_res = m2.coefficients(x1, mid)
        y = lin2(MHC.collapse(x1, h_pre, mid, fused).float()).to(BF16)
        return MHC.update(x1, h_res, h_post, y, mid, fused)

    fn = torch.compile(pair, backend="aot_eager", fullgraph=True) if compiled else pair
    fn(x).float().square().mean().backward()
    grads = {"x": x.grad}
    for k, mod in enumerate(modules):
        grads.update({f"{k}.{name}": p.grad for name, p in mod.named_parameters()})
    return grads


@pytest.mark.parametrize("compiled", [False, True])
def test_block_backward_with_kernels_matches_tensor_ops(compiled, monkeypatch):
    """Every gradient of the sub-layer pair agrees between the two paths (relative Frobenius error). Both round the
    same fp32 values to bf16 (interpreter: equal to ~1e-5), but their fp32 sums differ in order, so on CUDA a bf16
    gradient element can land one step apart; the scalar gains alpha_*, sums over every token with cancellation,
    amplify that (their bf16 noise, tests/layers/mhc/test_mhc_gpu.py)."""
    want = _block_grads(False, monkeypatch)
    got = _block_grads(True, monkeypatch, compiled)
    assert want.keys() == got.keys()
    for name in want:
        w, g = want[name].double(), got[name].double()
        rel = ((g - w).norm() / w.norm()).item()
        bound = 3e-2 if ".alpha_" in name else 5e-3
        assert rel < bound, (name, rel)
