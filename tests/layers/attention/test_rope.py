"""RoPE tables (plain and YaRN) vs direct formulas, and the interleaved rotation vs complex multiplication."""

import math

import torch

from llm_training.layers.attention.rope import (
    RotaryEmbedding,
    apply_rope_interleaved,
    build_rotary_embeddings,
    plain_inv_freq,
    yarn_inv_freq,
)
from llm_training.motif import get_flavor


def test_plain_frequencies():
    got = plain_inv_freq(8, 500.0)
    want = torch.tensor([1.0, 500**-0.25, 500**-0.5, 500**-0.75], dtype=torch.float64)
    torch.testing.assert_close(got, want)


def yarn_by_hand(d, theta, s, beta_fast, beta_slow, orig):
    """Per pair j: wavelength-based correction range [low, high] (DeepSeek-V3 YaRN), linear blend."""

    def corr(rot):
        return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), d - 1)
    out = []
    for j in range(d // 2):
        f = theta ** (-2 * j / d)
        t = min(max((j - low) / (high - low), 0.0), 1.0)  # 0: keep original, 1: fully interpolated
        out.append(f * (1 - t) + (f / s) * t)
    return torch.tensor(out, dtype=torch.float64)


def test_yarn_frequencies_match_formula_and_limits():
    d, theta, s = 64, 10000.0, 64.0
    got = yarn_inv_freq(d, theta, s, 32.0, 1.0, 4096)
    torch.testing.assert_close(got, yarn_by_hand(d, theta, s, 32.0, 1.0, 4096))
    base = plain_inv_freq(d, theta)
    assert torch.equal(got[:4], base[:4])  # fast pairs untouched
    torch.testing.assert_close(got[-4:], base[-4:] / s)  # slow pairs fully interpolated


def test_flavor_tables_sliding_never_yarn():
    a = get_flavor("motif3_seq_256k_mtp1_sft")
    full, sliding = build_rotary_embeddings(a)
    torch.testing.assert_close(sliding.inv_freq, plain_inv_freq(a.qk_rope_head_dim, a.swa_rope_theta))
    torch.testing.assert_close(
        full.inv_freq,
        yarn_by_hand(a.qk_rope_head_dim, a.rope_theta, a.rope_factor, a.beta_fast, a.beta_slow, a.original_seq_len),
    )
    full4k, _ = build_rotary_embeddings(get_flavor("motif3_seq"))
    torch.testing.assert_close(full4k.inv_freq, plain_inv_freq(a.qk_rope_head_dim, a.rope_theta))
    assert a.softmax_scale(0) == a.head_dim**-0.5 * (0.1 * math.log(64) + 1) ** 2
    assert a.softmax_scale(1) == a.head_dim**-0.5


def test_interleaved_rotation_is_complex_multiplication_per_pair():
    torch.manual_seed(0)
    d = 8
    rope = RotaryEmbedding(plain_inv_freq(d, 100.0), 16)
    pos = torch.tensor([[0, 1, 2, 0, 1], [4, 3, 2, 1, 0]])
    x = torch.randn(2, 5, 3, d)
    got = apply_rope_interleaved(x, *rope.cos_sin(pos))
    ang = pos.double()[..., None, None] * plain_inv_freq(d, 100.0)  # [B, S, 1, d/2]
    z = torch.view_as_complex(x.double().view(2, 5, 3, d // 2, 2)) * torch.exp(1j * ang)
    torch.testing.assert_close(got.double(), torch.view_as_real(z).flatten(-2), atol=1e-6, rtol=1e-6)
    assert got.dtype == x.dtype
    got_bf16 = apply_rope_interleaved(x.bfloat16(), *rope.cos_sin(pos))
    assert got_bf16.dtype == torch.bfloat16
