"""CUDA-only checks of the tensor-core fp32 paths: `matmul_fp32` / `Fp32Projection` (split-bf16 weights, fp32
accumulation) against float64, router top-k stability with the real kernels, and the fused mHC Functions on a
bf16 stream (eager and torch.compile) against float64, as accurate as the same CUDA code with exact fp32 math."""

import pytest
import torch
import torch.nn.functional as F

from llm_training.layers.mhc.hyper_connections import MHC, StreamSource
from llm_training.layers.projection import Fp32Projection
from tests.layers.test_projection import check_split_bf16_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize(
    "a_dtype,b_dtype,out_dtype",
    [("bf16", "fp32", "fp32"), ("fp32", "bf16", "fp32"), ("bf16", "bf16", "fp32"), ("fp32", "fp32", "bf16")],
)
def test_matmul_fp32_split_bf16_error_vs_float64(a_dtype, b_dtype, out_dtype):
    """Exact bf16 operands + split fp32 operands: max error ~1e-5 of the output's spread (the dropped lo x lo
    term and fp32 accumulation). Both fp32 with a bf16 result (the backward's dx): within bf16 rounding."""
    check_split_bf16_error(a_dtype, b_dtype, out_dtype, "cuda", (4096, 2048, 96))


def test_router_projection_on_cuda_keeps_top_k_and_fp32_gradients():
    torch.manual_seed(0)
    T, H, E, K = 4096, 4096, 384, 8
    proj = Fp32Projection(H, E).cuda()
    torch.nn.init.normal_(proj.weight, std=0.02)
    x = F.rms_norm(torch.randn(T, H, device="cuda"), (H,)).bfloat16().requires_grad_()
    bias = torch.randn(E, device="cuda") * 1e-3
    logits = proj(x)
    exact = x.double() @ proj.weight.double().t()
    assert logits.dtype == torch.float32
    # the split weight keeps 16 of fp32's 24 mantissa bits (~2^-17 per term): the max over 1.5M logits measured
    # 3.1e-5 of their spread on the H200 (rms 2.4e-6 in the float64 emulation of tests/layers/test_projection.py)
    assert ((logits.double() - exact).abs().max() / exact.std()).item() < 6e-5
    pick = lambda z: (torch.sigmoid(z) + bias.to(z.dtype)).topk(K, -1).indices.sort(-1).values
    flips = (pick(logits) != pick(exact)).any(-1).float().mean().item()
    assert flips <= 1e-3, flips
    g = torch.randn_like(logits)
    logits.backward(g)
    dx_want = (g.double() @ proj.weight.double()).float()
    dw_want = g.double().t() @ x.double()
    assert x.grad.dtype == torch.bfloat16 and proj.weight.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad.float(), dx_want, atol=2e-2 * dx_want.std().item(), rtol=1e-2)
    # dW = g^T x with the fp32 g split in two bf16 pieces: the same ~2^-17 per-term error as the logits above
    assert ((proj.weight.grad.double() - dw_want).abs().max() / dw_want.std()).item() < 6e-5


def _sublayer(u, w):
    """A stand-in sub-layer, tanh(u * w), computed in fp32 (float64 for float64 input) and rounded once to u's
    dtype: eager and compiled code then round it at the same point (inductor keeps a fused bf16 product in fp32),
    so the mHC Functions under test see the same input either way."""
    ct = torch.promote_types(u.dtype, torch.float32)
    return torch.tanh(u.to(ct) * w.to(ct)).to(u.dtype)


def _pair(mhc_a, mhc_f, x, w_a, w_f):
    h_pre, h_post, h_res = mhc_a.coefficients(x)
    mid = StreamSource(x, h_res, h_post, _sublayer(MHC.collapse(x, h_pre), w_a))
    x = MHC.update(*mid)
    h_pre, h_post, h_res = mhc_f.coefficients(x, mid)
    return MHC.update(x, h_res, h_post, _sublayer(MHC.collapse(x, h_pre, mid), w_f), mid)


def _modules(n, H, device, dtype):
    torch.manual_seed(0)
    mods = []
    for _ in range(2):
        m = MHC(H, n, sinkhorn_iters=20, eps=1e-6, identity_init=False, h_post_alpha=0.0)
        m.init_weights()
        with torch.no_grad():
            for a in (m.alpha_pre, m.alpha_post, m.alpha_res):
                a.fill_(0.5)
        mods.append(m.to(device=device, dtype=dtype))
    return mods


def _run_pair(fn, mods, x, w, g):
    """[output, dx, every parameter gradient] of `fn` (the pair, maybe compiled) over `mods` on x with upstream g."""
    x = x.clone().requires_grad_()
    out = fn(mods[0], mods[1], x, w, w)
    out.backward(g)
    return [out, x.grad] + [p.grad for m in mods for p in m.parameters()]


# What the fast path's own arithmetic may add over the exact-fp32 path's. Its split-bf16 GEMMs carry 16 of fp32's
# 24 mantissa bits (2^-17 per product: tests/layers/test_projection.py's bound), and the alpha_* gradients amplify
# a relative change of their inputs up to ~100x (the bf16 stream's 2^-9 rounding moves them by up to 4e-2), so
# ~1e-3: the largest excess measured on the H200 was 0.alpha_pre's, eager, 1.05e-3 vs the exact run's 7.1e-5.
# The floor is twice that.
_FP32_PATH_FLOOR = 2e-3


def _rel(a, b):
    """Relative Frobenius error of a against the reference b, in float64 on the CPU."""
    return ((a.cpu().double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_mhc_bf16_stream_on_cuda_is_as_accurate_as_exact_fp32(compiled, monkeypatch):
    """The bf16-stream CUDA run with the fast paths (tensor-core split-bf16 GEMMs, the Sinkhorn and stream kernels;
    eager or torch.compile) and the same CUDA code with exact fp32 GEMMs and the reference Sinkhorn, run the same
    way (eager, or compiled), each against the run whose arithmetic is float64 and whose stream, sub-layer inputs
    and outputs are bf16 at the same points (the CPU path with float64 parameters and bf16 tensors: it rounds
    exactly where the model stores bf16): the fast run's error is at most 1.5x the exact run's plus
    `_FP32_PATH_FLOOR` for every tensor.

    Why that reference and not all-float64 math: the coefficient gradients, the alpha_* gains most, are a small
    remainder of large cancelling sums (Sinkhorn's gradient is nearly orthogonal to what the mix backward feeds it
    when the streams are alike), so the bf16 rounding of the mid-block stream, a property of the model's bf16
    stream (docs/model-spec.md §4.2), moves them by several % against float64, and which few % depends on which
    elements round which way.
    Why the exact run is compiled too when the fast one is: inductor fuses the bf16 glue around the Functions
    (collapse, the stand-in sub-layer, the coefficient epilogues) and rounds it at other points than eager, even
    with `emulate_precision_casts`; each such point redraws that error. Measured on the H200 (2026-12-04), the
    compiled fast run against the eager-rounding reference: out 1.5e-3, 0.alpha_pre 1.3e-2, 1.alpha_res 1.4e-2,
    while against float64 it was as close as the exact run (0.alpha_pre 2.6e-3 vs 1.6e-2; 1.alpha_res 2.0e-2 vs
    6.5e-3): another draw, not a worse path. Compiling both runs gives them the same rounding points, so what is
    compared is what the fast paths themselves add, and a compiled Function that computed a wrong value or
    gradient would stand out by far more than the floor."""
    from llm_training.layers import projection
    from llm_training.layers.mhc import sinkhorn

    n, H, B, S = 4, 1024, 2, 512
    fast, exact_fp32 = (_modules(n, H, "cuda", torch.float32) for _ in range(2))
    x = torch.randn(B, S, n, H, device="cuda").bfloat16()
    w = torch.rand(H, device="cuda").add(0.5).bfloat16()
    g = torch.randn(B, S, n, H, device="cuda").bfloat16()

    def run(mods):
        torch._dynamo.reset()  # the exact run's patched globals must be traced afresh, not served from the cache
        with monkeypatch.context() as m:
            # keep explicit casts: closer to eager's rounding points (not the same: see above)
            m.setattr(torch._inductor.config, "emulate_precision_casts", True)
            return _run_pair(torch.compile(_pair) if compiled else _pair, mods, x, w, g)

    got = run(fast)
    with monkeypatch.context() as m:
        m.setattr(projection, "_use_split_bf16", lambda *a, **k: False)
        m.setattr(sinkhorn, "_HAS_TRITON", False)
        baseline = run(exact_fp32)
    ref = _run_pair(_pair, _modules(n, H, "cpu", torch.float64), x.cpu(), w.cpu(), g.cpu())
    f64 = _run_pair(_pair, _modules(n, H, "cpu", torch.float64), x.cpu().double(), w.cpu().double(), g.cpu().double())
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.bfloat16 and ref[0].dtype == torch.bfloat16

    names = ["out", "dx"] + [f"{k}.{name}" for k, m in enumerate(fast) for name, _ in m.named_parameters()]
    table, failed = [], []
    for name, a, c, r, e in zip(names, got, baseline, ref, f64):
        assert torch.isfinite(a).all(), name
        table.append(
            f"{name:<16} vs bf16-stream ref: fast {_rel(a, r):.2e} exact-fp32 {_rel(c, r):.2e} | vs float64: "
            f"fast {_rel(a, e):.2e} exact-fp32 {_rel(c, e):.2e}"
        )
        if _rel(a, r) > 1.5 * _rel(c, r) + _FP32_PATH_FLOOR:
            failed.append(name)
    print("\n".join(table))
    assert not failed, f"{failed} (errors of every tensor: {'; '.join(table)})"
