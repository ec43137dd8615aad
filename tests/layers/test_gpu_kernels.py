"""CUDA-only checks of the GPU paths: attention backends vs the fp32 reference on the GDLA shape, and
bf16 grouped-GEMM experts (padded token groups) vs the per-expert loop."""

import pytest
import torch

from llm_training.layers.attention.backends import build_attention_metadata, get_attention_backend
from llm_training.layers.moe import MoE
from llm_training.motif import get_flavor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("backend", ["sdpa", "flex", "auto"])
@pytest.mark.parametrize("window,docs", [(None, False), (128, False), (None, True), (128, True)])
def test_attention_backend_matches_reference_bf16(backend, window, docs):
    torch.manual_seed(0)
    B, S, Hq, Hkv = 2, 1024, 10, 2
    q = torch.randn(B, S, Hq, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, S, Hkv, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, S, Hkv, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    doc_ids = None
    if docs:
        doc_ids = (torch.arange(S, device="cuda") >= 300).int() + (torch.arange(S, device="cuda") >= 700).int()
        doc_ids = doc_ids.expand(B, S).contiguous()

    def run(name):
        metadata = build_attention_metadata(name, doc_ids, [window], B, S, q.device)
        kernel = get_attention_backend(name).kernel
        return kernel(q, k, v, scale=192**-0.5, window=window, metadata=metadata, record_max_logits=True)

    out, mx = run(backend)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref, ref_mx = run("reference")
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(mx, ref_mx, atol=5e-2, rtol=2e-2)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2)


def test_grouped_mm_bf16_experts_match_loop():
    args = get_flavor("motif3_small").replace(num_experts=16, experts_top_k=4)
    torch.manual_seed(0)
    moe = MoE(args).cuda()
    moe.init_weights(0.02)
    moe = moe.to(torch.bfloat16)
    moe.expert_bias = moe.expert_bias.float()
    x = torch.randn(2, 333, args.hidden_size, device="cuda", dtype=torch.bfloat16)
    results = []
    for grouped in (True, False):
        moe.zero_grad()
        moe.experts.use_grouped_mm = grouped
        out, _ = moe(x)
        out.float().square().mean().backward()
        results.append((out.float(), moe.experts.gate_up_proj.grad.float(), moe.experts.down_proj.grad.float()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
