"""Motif3Model: layer assignment, parameter counts, init, causality, MTP alignment, max logits, speed."""

import time

import pytest
import torch

from llm_training.layers.attention.gdla import GDLAttention
from llm_training.layers.moe import MoE
from llm_training.motif import get_flavor, param_counts
from llm_training.motif.args import is_moe_layer, is_sliding_layer
from llm_training.motif.model import Motif3Model


@pytest.fixture(scope="module")
def debug_model():
    torch.manual_seed(0)
    model = Motif3Model(get_flavor("motif3_debug"), attention_backend="sdpa")
    model.init_weights()
    return model


def test_layer_types_for_the_53_layer_shape():
    a = get_flavor("motif3_seq")
    full = [i for i in range(53) if not is_sliding_layer(i, a)]
    assert full == list(range(0, 53, 4)) and len(full) == 14
    assert [i for i in range(53) if not is_moe_layer(i, a)] == [0, 1]
    with torch.device("meta"):
        model = Motif3Model(a.replace(num_hidden_layers=6, num_experts=8, vocab_size=64))
    assert [layer.self_attn.window for layer in model.layers] == [None, 128, 128, 128, None, 128]
    assert [layer.moe is not None for layer in model.layers] == [False, False, True, True, True, True]
    assert model.mtp_layers[0].self_attn.window == 128


@pytest.mark.parametrize(
    "flavor", ["motif3_small", "motif3_proxy", "motif3_proxy_16e", "motif3_seq", "motif3_seq_256k_mtp1_sft"]
)
def test_param_count_meta(flavor):
    a = get_flavor(flavor)
    with torch.device("meta"):
        model = Motif3Model(a)
    pc = param_counts(a)
    assert sum(p.numel() for p in model.parameters()) == pc.total + pc.mtp


def test_param_count_debug_and_fqns(debug_model):
    pc = param_counts(debug_model.args)
    assert sum(p.numel() for p in debug_model.parameters()) == pc.total + pc.mtp
    names = dict(debug_model.named_parameters())
    a = debug_model.args
    expected = {
        "embed_tokens.weight": (a.vocab_size, a.hidden_size),
        "layers.0.self_attn.wq_b.weight": (a.num_attention_heads * a.head_dim, a.q_lora_rank),
        "layers.0.self_attn.wq_b_gate.weight": (a.num_signal_heads * a.v_head_dim, a.q_lora_rank),
        "layers.0.self_attn.wkv_a.weight": (a.kv_lora_rank + a.qk_rope_head_dim, a.hidden_size),
        "layers.0.self_attn.lambda_proj.weight": (a.num_signal_heads, a.hidden_size),
        "layers.0.self_attn.wo.weight": (a.hidden_size, a.num_signal_heads * a.v_head_dim),
        "layers.0.mlp.act_fn.weight": (3,),
        "layers.2.moe.router.gate.weight": (a.num_experts, a.hidden_size),
        "layers.2.moe.experts.gate_up_proj": (a.num_experts, 2 * a.moe_intermediate_size, a.hidden_size),
        "layers.2.moe.experts.down_proj": (a.num_experts, a.hidden_size, a.moe_intermediate_size),
        "layers.2.moe.experts.act_fn.bias": (a.num_experts, 1),
        "layers.2.moe.shared_experts.gate_proj.weight": (a.moe_intermediate_size, a.hidden_size),
        "layers.3.mhc_attn.proj_res.weight": (16, 4 * a.hidden_size),
        "layers.3.mhc_ffn.bias_res": (4, 4),
        "layers.3.mhc_ffn.alpha_pre": (),
        "mtp_layers.0.input_proj.weight": (a.hidden_size, 2 * a.hidden_size),
        "mtp_layers.0.mlp.down_proj.weight": (a.hidden_size, a.intermediate_size),
        "mtp_layers.0.final_layernorm.weight": (a.hidden_size,),
        "lm_head.weight": (a.vocab_size, a.hidden_size),
    }
    for name, shape in expected.items():
        assert tuple(names[name].shape) == shape, name
    buffers = dict(debug_model.named_buffers())
    assert (
        buffers["layers.2.moe.expert_bias"].dtype == torch.float32
        and "layers.2.moe.expert_bias" in debug_model.state_dict()
    )
    assert names["layers.2.moe.router.gate.weight"].dtype == torch.float32


def test_meta_init_equals_cpu_init():
    a = get_flavor("motif3_debug")
    cpu = Motif3Model(a)
    torch.manual_seed(123)
    cpu.init_weights()
    with torch.device("meta"):
        meta = Motif3Model(a)
    meta.to_empty(device="cpu")
    torch.manual_seed(123)
    meta.init_weights()
    sd_cpu, sd_meta = cpu.state_dict(), meta.state_dict()
    assert sd_cpu.keys() == sd_meta.keys()
    for k in sd_cpu:
        assert torch.equal(sd_cpu[k], sd_meta[k]), k
    assert torch.all(sd_cpu["layers.1.self_attn.lambda_proj.weight"] == 0)  # lambda_init "zeros"
    assert torch.all(sd_cpu["layers.1.input_layernorm.weight"] == 1)
    assert torch.all(sd_cpu["layers.3.moe.expert_bias"] == 0)
    std = sd_cpu["layers.3.moe.experts.gate_up_proj"].std().item()
    assert abs(std - a.initializer_range) < 0.002


def test_forward_outputs_and_causality(debug_model):
    a = debug_model.args
    torch.manual_seed(1)
    ids = torch.randint(0, a.vocab_size, (2, 40))
    with torch.no_grad():
        out = debug_model(ids)
        changed = ids.clone()
        changed[:, 25] = (changed[:, 25] + 1) % a.vocab_size
        out2 = debug_model(changed)
    assert out.logits.shape == (2, 40, a.vocab_size) and out.hidden.shape == (2, 40, a.hidden_size)
    assert len(out.router_stats) == 4 and out.balance_loss.shape == ()
    assert all(s.tokens_per_expert.sum() == 2 * 40 * a.experts_top_k for s in out.router_stats)
    torch.testing.assert_close(out2.logits[:, :25], out.logits[:, :25], atol=0, rtol=0)
    assert not torch.allclose(out2.logits[:, 25:], out.logits[:, 25:])
    # MTP module 0 at position i reads t_{i+1}: position 24 changes, positions < 24 do not.
    torch.testing.assert_close(out2.mtp_logits[0][:, :24], out.mtp_logits[0][:, :24], atol=0, rtol=0)
    assert not torch.allclose(out2.mtp_logits[0][:, 24], out.mtp_logits[0][:, 24])
    hid = debug_model(ids, return_hidden=True)
    assert hid.logits is None and hid.mtp_logits is None
    torch.testing.assert_close(debug_model.lm_head(hid.hidden), out.logits)
    torch.testing.assert_close(debug_model.lm_head(hid.mtp_hidden[0]), out.mtp_logits[0])


def test_mtp_embeds_next_token(debug_model):
    """Module 1 = input_proj([final hidden ; embed_norm(embed(t_{i+1}))]) -> block -> final norm."""
    torch.manual_seed(2)
    ids = torch.randint(0, debug_model.args.vocab_size, (1, 12))
    captured = {}
    mtp = debug_model.mtp_layers[0]
    handle = mtp.embed_norm.register_forward_hook(lambda m, inp, out: captured.setdefault("emb", inp[0]))
    with torch.no_grad():
        out = debug_model(ids, return_hidden=True)
    handle.remove()
    emb = debug_model.embed_tokens.weight
    torch.testing.assert_close(captured["emb"][0, :11], emb[ids[0, 1:]])


def test_documents_do_not_interact(debug_model):
    a = debug_model.args
    torch.manual_seed(3)
    ids = torch.randint(0, a.vocab_size, (1, 30))
    docs = torch.tensor([[0] * 12 + [1] * 18])
    pos = torch.cat([torch.arange(12), torch.arange(18)])[None]
    with torch.no_grad():
        packed = debug_model(ids, position_ids=pos, document_ids=docs)
        alone = debug_model(ids[:, 12:])
    # The second document alone gives the same main logits (MTP at its first doc's last position differs).
    torch.testing.assert_close(packed.logits[:, 12:], alone.logits, atol=2e-5, rtol=2e-5)


def test_max_logits_recorded_per_head(debug_model):
    a = debug_model.args
    debug_model.set_record_max_logits(True)
    attn0 = debug_model.layers[1].self_attn
    q_store = {}
    real_kernel = attn0.kernel

    def kernel(q, k, v, **kw):
        q_store["qk"] = (q, k, kw)
        return real_kernel(q, k, v, **kw)

    attn0.kernel = kernel
    try:
        with torch.no_grad():
            recorded = debug_model(torch.randint(0, a.vocab_size, (2, 24))).max_logits
    finally:
        attn0.kernel = real_kernel
        debug_model.set_record_max_logits(False)
    q, k, kw = q_store["qk"]
    # explicit per-head max over visible (i, j): sliding layer 1 with window W
    W = a.sliding_window
    want = torch.full((a.num_attention_heads,), -float("inf"))
    group = a.num_attention_heads // a.num_key_value_heads
    for h in range(a.num_attention_heads):
        logits = torch.einsum("bid,bjd->bij", q[:, :, h].double(), k[:, :, h // group].double()) * kw["scale"]
        i = torch.arange(24)[:, None]
        j = torch.arange(24)[None]
        logits = logits.masked_fill(~((j <= i) & (j >= i - W)), -float("inf"))
        want[h] = logits.max()
    torch.testing.assert_close(recorded[1], want, atol=1e-5, rtol=1e-5)
    n_attention = sum(isinstance(m, GDLAttention) for m in debug_model.modules())
    assert len(recorded) == n_attention and all(r is not None and r.shape == want.shape for r in recorded)
    with torch.no_grad():
        assert debug_model(torch.randint(0, a.vocab_size, (2, 24))).max_logits is None  # recording off


def test_debug_forward_backward_is_fast_and_reaches_every_parameter():
    a = get_flavor("motif3_debug").replace(router_aux_loss_coef=1e-3)
    torch.manual_seed(0)
    model = Motif3Model(a)
    model.init_weights()
    ids = torch.randint(0, a.vocab_size, (2, 64))
    start = time.perf_counter()
    out = model(ids)
    loss = out.logits.float().logsumexp(-1).mean() + out.mtp_logits[0].float().logsumexp(-1).mean()
    (loss + out.balance_loss).backward()
    elapsed = time.perf_counter() - start
    assert out.balance_loss > 0
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, missing
    assert elapsed < 3.0, f"motif3_debug fwd+bwd took {elapsed:.2f}s"


def test_mhc_progress_and_plain_residual_variant():
    a = get_flavor("motif3_debug").replace(mhc_h_post_alpha_start=1.0, mhc_h_post_alpha_end=0.0)
    with torch.device("meta"):
        model = Motif3Model(a)
    model.set_mhc_progress(0.25)
    assert model.layers[0].mhc_attn.h_post_alpha == 0.75
    plain = Motif3Model(a.replace(mhc_enabled=False, num_nextn_predict_layers=0))
    plain.init_weights()
    assert plain.layers[0].mhc_attn is None and len(plain.mtp_layers) == 0
    out = plain(torch.randint(0, a.vocab_size, (1, 8)))
    assert out.logits.shape == (1, 8, a.vocab_size) and out.mtp_hidden == []


def test_gdla_in_model_uses_flavor_scale():
    a = get_flavor("motif3_debug").replace(max_seq_len=1024, original_seq_len=256, rope_factor=4.0)
    with torch.device("meta"):
        model = Motif3Model(a)
    assert model.layers[0].self_attn.softmax_scale == a.softmax_scale(0) > a.head_dim**-0.5
    assert model.layers[1].self_attn.softmax_scale == a.head_dim**-0.5
    assert model.mtp_layers[0].self_attn.softmax_scale == a.head_dim**-0.5
    assert sum(isinstance(m, MoE) for m in model.modules()) == 4


def test_blocks_work_under_activation_checkpointing(debug_model):
    """The parallelizer wraps model.layers[i]: recomputation must give identical outputs and gradients."""
    from torch.utils.checkpoint import checkpoint

    a = debug_model.args
    ids = torch.randint(0, a.vocab_size, (1, 20))
    pos = torch.arange(20)[None]
    x0 = debug_model.embed_tokens(ids).detach().unsqueeze(2).expand(1, 20, a.mhc_expansion_rate, -1).contiguous()
    results = []
    for use_ckpt in (False, True):
        debug_model.zero_grad()
        x = x0.clone().requires_grad_()
        h = x
        for layer in debug_model.layers:
            h, _, _ = checkpoint(layer, h, pos, use_reentrant=False) if use_ckpt else layer(h, pos)
        h.square().mean().backward()
        results.append([x.grad.clone()] + [p.grad.clone() for p in debug_model.layers.parameters()])
    for g0, g1 in zip(*results):
        torch.testing.assert_close(g0, g1, atol=1e-6, rtol=1e-5)


def test_forward_equals_spec_composition_by_hand():
    """Stream copy, mHC around each sub-layer (flattened-n*H RMSNorm eps 1e-6, projections, +-10 clamp, Sinkhorn
    with +-20 exp clamp and 1e-8 floors, rows then columns, X'[i] = sum_j H_res[i, j] X[j] + h_post[i] y,
    collapse then the block's own RMSNorm eps 1e-5), stream mean, final norm, head, and the MTP wiring
    input_proj([norm(main hidden) ; embed_norm(embed(t_{i+1}))]) -> attn -> MLP -> final_layernorm -> head,
    written out here (float64); attention and MLP / MoE modules are used as black boxes."""
    a = get_flavor("motif3_debug").replace(num_hidden_layers=3)  # 0: full dense, 1: sliding dense, 2: sliding MoE
    torch.manual_seed(3)
    model = Motif3Model(a, attention_backend="reference")
    model.init_weights()
    model = model.double().eval()
    with torch.no_grad():
        for layer in model.layers:
            for mhc in (layer.mhc_attn, layer.mhc_ffn):
                for alpha in (mhc.alpha_pre, mhc.alpha_post, mhc.alpha_res):
                    alpha.normal_(0.0, 1.0)  # coefficients clearly input-dependent
                mhc.bias_res.normal_(0.0, 1.0)
                mhc.norm.weight.uniform_(0.5, 1.5)
    B, S, H, n = 2, 12, a.hidden_size, a.mhc_expansion_rate
    ids = torch.randint(0, a.vocab_size, (B, S), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(S).expand(B, S)

    def rms(t, w, eps):
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + eps) * w

    def coefficients(mhc, X):
        flat = rms(X.reshape(B, S, n * H), mhc.norm.weight, 1e-6)
        p, q = flat @ mhc.proj_pre.weight.T, flat @ mhc.proj_post.weight.T
        r = (flat @ mhc.proj_res.weight.T).view(B, S, n, n)
        h_pre = torch.sigmoid((mhc.alpha_pre * p + mhc.bias_pre).clamp(-10, 10))
        h_post = 1.0 * torch.sigmoid((mhc.alpha_post * q + mhc.bias_post).clamp(-10, 10))  # c_post = 1
        m = torch.exp((mhc.alpha_res * r + mhc.bias_res).clamp(-20, 20))
        for _ in range(a.mhc_sinkhorn_iters):
            m = m / m.sum(-1, keepdim=True).clamp_min(1e-8)  # rows
            m = m / m.sum(-2, keepdim=True).clamp_min(1e-8)  # columns
        return h_pre, h_post, m

    def sublayer(mhc, norm, fn, X):
        h_pre, h_post, h_res = coefficients(mhc, X)
        u = sum(h_pre[..., i, None] * X[:, :, i] for i in range(n))
        y = fn(rms(u, norm.weight, 1e-5))
        return torch.stack(
            [sum(h_res[..., i, j, None] * X[:, :, j] for j in range(n)) + h_post[..., i, None] * y for i in range(n)],
            dim=2,
        )

    with torch.no_grad():
        X = model.embed_tokens.weight[ids][:, :, None].expand(B, S, n, H)
        for layer in model.layers:
            X = sublayer(layer.mhc_attn, layer.input_layernorm, lambda h: layer.self_attn(h, pos)[0], X)
            ffn = layer.mlp if layer.moe is None else (lambda h: layer.moe(h)[0])
            X = sublayer(layer.mhc_ffn, layer.post_attention_layernorm, ffn, X)
        hidden = rms(X.mean(dim=2), model.norm.weight, 1e-5)
        mtp = model.mtp_layers[0]
        e = model.embed_tokens.weight[ids[:, 1:]]  # t_{i+1} for i < S - 1
        z = torch.cat([hidden[:, : S - 1], rms(e, mtp.embed_norm.weight, 1e-5)], -1) @ mtp.input_proj.weight.T
        z = z + mtp.self_attn(rms(z, mtp.input_layernorm.weight, 1e-5), pos[:, : S - 1])[0]
        z = z + mtp.mlp(rms(z, mtp.post_attention_layernorm.weight, 1e-5))
        mtp_logits = rms(z, mtp.final_layernorm.weight, 1e-5) @ model.lm_head.weight.T
        out = model(ids)
    assert mtp.self_attn.window == a.sliding_window and mtp.self_attn.softmax_scale == a.head_dim**-0.5
    torch.testing.assert_close(out.logits, hidden @ model.lm_head.weight.T, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.mtp_logits[0][:, : S - 1], mtp_logits, atol=1e-5, rtol=1e-4)


def test_mhc_backward_choice_reaches_every_mhc_module():
    """`[kernels] mhc_backward` (Motif3Model's mhc_backward) sets how every block's two MHC modules run backward."""
    from llm_training.layers.mhc.hyper_connections import MHC

    for choice, want in (("tensor_ops", {False}), ("fused", {True}), ("auto", {True})):
        with torch.device("meta"):
            model = Motif3Model(get_flavor("motif3_debug"), mhc_backward=choice)
        mhcs = [m for m in model.modules() if isinstance(m, MHC)]
        assert len(mhcs) == 2 * len(model.layers) and {m.fused_backward for m in mhcs} == want
