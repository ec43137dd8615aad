"""Flavor registry: lookup errors and parameter counts against the hand arithmetic of docs/model-spec.md §0.1."""

from __future__ import annotations

import pytest

from llm_training.config import ConfigError, ConfigManager
from llm_training.motif import MODEL_FLAVORS, get_flavor, param_counts


def test_unknown_flavor_lists_the_valid_ones():
    with pytest.raises(KeyError) as e:
        get_flavor("motif3_xl")
    for name in MODEL_FLAVORS:
        assert name in str(e.value)
    with pytest.raises(ConfigError) as e:
        ConfigManager().parse_args(["--model.flavor=motif3_xl"])
    assert "motif3_seq" in str(e.value) and "motif3_debug" in str(e.value)


def _spec_hand_arithmetic() -> tuple[float, float]:
    """Total and active parameters of motif3_seq as docs/model-spec.md §0.1 adds them up (coarse, by hand)."""
    H, V, E, K, I_e, I = 4096, 220160, 384, 8, 1280, 12288
    expert = 3 * H * I_e  # gate, up, down
    moe_layers, dense_layers, layers = 51, 2, 53
    # GDLA attention from the tensor shapes: wq_a, wq_b, wq_b_gate, wkv_a, wkv_b, lambda_proj, wo
    attention = (
        H * 1024 + 1024 * 80 * 192 + 1024 * 64 * 128 + H * (512 + 64) + 512 * 16 * (128 + 128) + H * 64 + 64 * 128 * H
    )
    mhc = 2 * (4 * H) * (1 + 2 * 4 + 16)  # two modules per layer: gain + proj_pre/post/res over the 4H stream
    edge = 2 * V * H  # embedding + untied head
    shared_and_router = moe_layers * (expert + E * H)
    total = moe_layers * E * expert + layers * (attention + mhc) + dense_layers * 3 * H * I + shared_and_router + edge
    active = moe_layers * K * expert + layers * (attention + mhc) + dense_layers * 3 * H * I + shared_and_router + edge
    return total, active


def test_motif3_seq_matches_the_published_size():
    total, active = _spec_hand_arithmetic()
    assert total == pytest.approx(314.4e9, rel=0.01)  # the spec's quoted sum
    counts = param_counts(get_flavor("motif3_seq"))
    assert counts.total == pytest.approx(total, rel=0.01)
    assert counts.active == pytest.approx(active, rel=0.05)
    assert counts.active == pytest.approx(13e9, rel=0.05)


def test_long_context_flavor_has_the_same_weights():
    assert param_counts(get_flavor("motif3_seq_256k_mtp1_sft")) == param_counts(get_flavor("motif3_seq"))
    assert get_flavor("motif3_seq_256k_mtp1_sft").max_seq_len == 262144


def test_small_and_debug_sizes():
    small = param_counts(get_flavor("motif3_small"))
    assert 1e9 <= small.total <= 3e9 and small.active < small.total
    debug = param_counts(get_flavor("motif3_debug"))
    assert debug.total < 2e6  # CPU in seconds
    assert get_flavor("motif3_debug").max_seq_len == 256  # the demo's seq_len


def test_production_flavors_carry_every_published_value():
    """docs/model-spec.md §0.1's table, written out literally (plus the eps and init values stated there)."""
    published = dict(
        num_hidden_layers=53, hidden_size=4096, intermediate_size=12288, n_dense_first_layers=2,
        interleave_moe_layer_step=1, num_experts=384, experts_top_k=8, num_shared_experts=1,
        moe_intermediate_size=1280, score_func="sigmoid", route_norm=True, route_scale=2.0,
        score_before_experts=False, load_balance_coeff=1e-4, router_aux_loss_coef=0.0, attention_cls="gdla",
        num_attention_heads=80, num_key_value_heads=16, num_noise_heads=16, head_dim=192, qk_rope_head_dim=64,
        v_head_dim=128, q_lora_rank=1024, kv_lora_rank=512, elementwise_attn_output_gate=True,
        sliding_window=128, sliding_window_period=4, rope_theta=10000.0, swa_rope_theta=10000.0,
        original_seq_len=4096, rope_factor=64.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
        mhc_enabled=True, mhc_expansion_rate=4, mhc_sinkhorn_iters=20, mhc_identity_init=False,
        mhc_h_post_alpha_end=0.0, hidden_act="poly_norm", polynorm_sigmoid_weight=True,
        polynorm_output_scale=0.5, polynorm_bias_clamp=0.5, hidden_clamp=1e6, rms_norm_eps=1e-5,
        polynorm_eps=1e-6, mhc_eps=1e-6, polynorm_init_weight=1 / 3, initializer_range=0.02,
        num_nextn_predict_layers=1, vocab_size=220160, tie_word_embeddings=False,
    )  # fmt: skip
    for name, seq_len in (("motif3_seq", 4096), ("motif3_seq_256k_mtp1_sft", 262144)):
        args = get_flavor(name)
        wrong = {k: (getattr(args, k), v) for k, v in published.items() if getattr(args, k) != v}
        assert not wrong, f"{name}: (ours, published) {wrong}"
        assert args.max_seq_len == seq_len and args.yarn_active == (seq_len > 4096)
