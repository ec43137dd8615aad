"""CUDA-only: the motif3_debug model on the GPU paths vs the same weights on the reference paths.

Two questions, two tests:

1. Do the GPU kernels compute the same function? fp32 weights and activations on both sides; GPU side:
   FlexAttention (`flex`, or `auto` with documents) and the Triton `activation` kernels; reference
   side: `reference` attention, `ACTIVATION_BACKEND=torch`, looped expert matmuls. TF32 off. Logits and
   every parameter gradient must agree to ~fp32 reduction-order noise. Router gates are scaled up so
   that top-k selection has margins far above fp32 noise (a single flipped expert choice would move the
   logits by ~1e-2 and say nothing about the kernels); the test checks that routing is identical.

2. Is the bf16 training configuration as accurate as bf16 allows? Weights are cast the way training
   holds them (FSDP2 `param_dtype=bf16` for everything except the fp32-by-spec parameters, which
   `parallelize.py` keeps fp32: router gate, expert_bias, PolyNorm act_fn, mHC), activations are bf16.
   GPU side: `auto` attention (cuDNN SDPA for full layers without documents, FlexAttention otherwise),
   bf16 grouped GEMMs (`torch._grouped_mm`, padded token groups), Triton `activation` kernels.
   The yardstick is the SAME bf16 model on the reference paths: bf16 error of the GPU run vs the fp32
   reference must be at most 1.5x (logits) / 2x (gradients) the bf16-reference error, plus a small
   slack. At random init the bf16 reference path itself is ~0.045 off in relative Frobenius norm
   (measured on CPU; part of it top-k routing flips, ~40 changed expert counts per run), so an absolute
   bound of 0.05 sat at the noise level; the ratio compares like with like.

Not torch.autocast: the model calls `F.linear(x.float(), w.float())` where the spec wants fp32 (router,
mHC projections, GDLA lambda); autocast would run those matmuls in bf16 anyway. Training uses FSDP2
mixed precision, not autocast.
"""

import pytest
import torch

from llm_training.layers.moe import GroupedExperts, TokenChoiceRouter
from llm_training.motif import get_flavor
from llm_training.motif.model import Motif3Model
from llm_training.motif.state_dict_adapter import is_fp32_key

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SEQ = 256
ROUTER_GATE_SCALE = 20.0  # router logit std ~0.16 -> ~3: top-4 score gaps ~1e-1 >> fp32 noise (~1e-6)


def _inputs(args, with_docs):
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (2, SEQ), device="cuda", generator=gen)
    kw = {}
    if with_docs:
        pos = torch.arange(SEQ, device="cuda")
        kw["document_ids"] = (pos >= 100).long().expand(2, SEQ).contiguous()
        kw["position_ids"] = torch.where(pos >= 100, pos - 100, pos).expand(2, SEQ).contiguous()
    return ids, kw


def _use_reference_experts(model):
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.use_grouped_mm = False  # looped per-expert matmuls: the reference expert path
    return model


def _fp32_reference_model(args, scale_router=False):
    torch.manual_seed(0)
    model = Motif3Model(args, attention_backend="reference").cuda()
    model.init_weights()
    if scale_router:
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, TokenChoiceRouter):
                    m.gate.weight.mul_(ROUTER_GATE_SCALE)
    return _use_reference_experts(model)


def _copy(args, source, attention_backend, bf16_weights):
    """A model with `source`'s weights; bf16 weights except the fp32-by-spec ones when asked."""
    model = Motif3Model(args, attention_backend=attention_backend).cuda()
    model.load_state_dict(source.state_dict())
    if bf16_weights:
        for name, p in model.named_parameters():
            if not is_fp32_key(name):
                p.data = p.data.to(torch.bfloat16)
    return _use_reference_experts(model) if attention_backend == "reference" else model


def _run(model, ids, kw, activation_backend, monkeypatch):
    """Forward + backward of a fixed scalar loss; returns (logits main+MTP fp32, routing counts, grads)."""
    monkeypatch.setenv("ACTIVATION_BACKEND", activation_backend)
    out = model(ids, **kw)
    loss = out.logits.float().logsumexp(-1).mean() + out.mtp_logits[0].float().logsumexp(-1).mean()
    loss.backward()
    monkeypatch.delenv("ACTIVATION_BACKEND")
    logits = torch.cat([out.logits.float(), out.mtp_logits[0].float()], dim=-1).detach()
    counts = [s.tokens_per_expert for s in out.router_stats]
    grads = {name: p.grad for name, p in model.named_parameters()}
    return logits, counts, grads


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _grad_vector(grads):
    return torch.cat([g.float().flatten() for _, g in sorted(grads.items())])


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# fp32 on CUDA: `auto` uses FlexAttention with a window or documents and SDPA (math kernel allowed for
# fp32, since the fused kernels are 16-bit only) for plain causal full layers.
FP32_ATTENTION_CASES = [("flex", False), ("auto", True), ("auto", False)]


@pytest.mark.parametrize("attention_backend, with_docs", FP32_ATTENTION_CASES)
def test_debug_model_fp32_gpu_kernels_match_reference(attention_backend, with_docs, monkeypatch, no_tf32):
    args = get_flavor("motif3_debug")
    ref = _fp32_reference_model(args, scale_router=True)
    gpu = _copy(args, ref, attention_backend, bf16_weights=False)
    ids, kw = _inputs(args, with_docs)
    ref_logits, ref_counts, ref_grads = _run(ref, ids, kw, "torch", monkeypatch)
    gpu_logits, gpu_counts, gpu_grads = _run(gpu, ids, kw, "auto", monkeypatch)
    for layer, (a, e) in enumerate(zip(gpu_counts, ref_counts)):
        assert torch.equal(a, e), f"MoE layer {layer}: routing differs ({a.tolist()} vs {e.tolist()})"
    rel = _rel(gpu_logits, ref_logits)
    assert rel < 1e-4, f"logits rel error {rel:.3g}"
    # per tensor: 1e-3 of its own norm, with a floor of 1e-6 of the model's gradient RMS per element
    # (a gradient that nearly cancels, e.g. a bias summed over all tokens, has no meaningful rel error)
    grad_rms = _grad_vector(ref_grads).square().mean().sqrt().item()
    for name, g_ref in ref_grads.items():
        g = gpu_grads[name]
        assert g is not None and g.dtype == torch.float32, name
        err, bound = (g - g_ref).norm().item(), 1e-3 * g_ref.norm().item() + 1e-6 * grad_rms * g.numel() ** 0.5
        assert err <= bound, f"grad of {name}: |diff| {err:.3g} > {bound:.3g} (|ref| {g_ref.norm().item():.3g})"


@pytest.mark.parametrize("with_docs", [False, True])
def test_debug_model_bf16_gpu_error_within_bf16_reference_error(with_docs, monkeypatch, no_tf32):
    args = get_flavor("motif3_debug")
    ref32 = _fp32_reference_model(args)
    ref16 = _copy(args, ref32, "reference", bf16_weights=True)
    gpu16 = _copy(args, ref32, "auto", bf16_weights=True)
    ids, kw = _inputs(args, with_docs)
    logits32, _, grads32 = _run(ref32, ids, kw, "torch", monkeypatch)
    logits_ref16, _, grads_ref16 = _run(ref16, ids, kw, "torch", monkeypatch)
    logits_gpu16, _, grads_gpu16 = _run(gpu16, ids, kw, "auto", monkeypatch)

    err_ref, err_gpu = _rel(logits_ref16, logits32), _rel(logits_gpu16, logits32)
    assert err_gpu <= 1.5 * err_ref + 5e-3, f"logits: GPU bf16 rel error {err_gpu:.4f}, reference bf16 {err_ref:.4f}"

    for name, p in gpu16.named_parameters():
        g = grads_gpu16[name]
        assert g is not None and torch.isfinite(g).all(), name
        assert g.dtype == (torch.float32 if is_fp32_key(name) else torch.bfloat16), name
    g32 = _grad_vector(grads32)
    gerr_ref, gerr_gpu = _rel(_grad_vector(grads_ref16), g32), _rel(_grad_vector(grads_gpu16), g32)
    assert gerr_gpu <= 2.0 * gerr_ref + 1e-2, f"grads: GPU bf16 rel error {gerr_gpu:.4f}, reference bf16 {gerr_ref:.4f}"
