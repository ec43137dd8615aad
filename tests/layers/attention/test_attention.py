"""GDLA attention and its kernels vs explicit per-head loops written here."""

import math

import pytest
import torch

from llm_training.layers.attention.gdla import GDLAttention
from llm_training.layers.attention.backends import ATTENTION_BACKENDS, build_attention_metadata, get_attention_backend
from llm_training.layers.attention.masks import chunked_max_logits
from llm_training.layers.attention.rope import RotaryEmbedding, plain_inv_freq
from llm_training.motif import get_flavor


def _visible(i, j, window, docs_row):
    if j > i:
        return False
    if window is not None and j < i - window:
        return False
    return docs_row is None or docs_row[i] == docs_row[j]


def loop_attention(q, k, v, scale, window, docs):
    """Per batch, head and query: softmax over visible keys, float64; also the max visible logit per head."""
    B, S, Hq, _ = q.shape
    Hkv = k.shape[2]
    out = torch.zeros(B, S, Hq, v.shape[-1], dtype=torch.float64)
    max_logit = torch.full((Hq,), -math.inf, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            g = h // (Hq // Hkv)
            for i in range(S):
                js = [j for j in range(S) if _visible(i, j, window, None if docs is None else docs[b].tolist())]
                logits = torch.stack([(q[b, i, h].double() @ k[b, j, g].double()) * scale for j in js])
                max_logit[h] = max(max_logit[h], logits.max())
                p = torch.softmax(logits, 0)
                out[b, i, h] = sum(p[t] * v[b, j, g].double() for t, j in enumerate(js))
    return out, max_logit


def run_kernel(backend, q, k, v, *, scale, window, docs, record_max_logits=True):
    """One kernel call with the metadata a model forward would build for it."""
    B, S = q.shape[:2]
    metadata = build_attention_metadata(backend, docs, [window], B, S, q.device)
    return get_attention_backend(backend).kernel(
        q, k, v, scale=scale, window=window, metadata=metadata, record_max_logits=record_max_logits
    )


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(0)
    B, S, Hq, Hkv, D, E = 2, 12, 6, 2, 5, 3
    q = torch.randn(B, S, Hq, D, generator=g)
    k = torch.randn(B, S, Hkv, D, generator=g)
    v = torch.randn(B, S, Hkv, E, generator=g)
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    return q, k, v, docs


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(
    "backend,window,use_docs",
    [(b, w, d) for b in ("reference", "sdpa") for w in (None, 3) for d in (False, True)]
    + [("flex", 3, True)],  # flex is slow on CPU (unfused); its GPU path is exercised by bench/bench_model.py
)
def test_kernels_match_loop(qkv, window, use_docs, backend):
    q, k, v, docs = qkv
    docs = docs if use_docs else None
    want, want_max = loop_attention(q, k, v, 0.37, window, docs)
    got, got_max = run_kernel(backend, q, k, v, scale=0.37, window=window, docs=docs)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got_max.double(), want_max, atol=2e-5, rtol=2e-5)


def test_window_sees_w_plus_one_keys():
    # Values = one-hot key index, uniform logits: the output row is the visible-key distribution.
    S, W = 10, 3
    q = torch.zeros(1, S, 1, 4)
    k = torch.zeros(1, S, 1, 4)
    v = torch.eye(S).view(1, S, 1, S)
    out, _ = run_kernel("sdpa", q, k, v, scale=1.0, window=W, docs=None, record_max_logits=False)
    counts = (out[0, :, 0] > 0).sum(-1)
    assert counts.tolist() == [min(i + 1, W + 1) for i in range(S)]


def test_unknown_backend_names_choices():
    with pytest.raises(ValueError, match="reference"):
        get_attention_backend("nope")
    assert {"reference", "sdpa", "auto", "flex"} <= set(ATTENTION_BACKENDS)


def _small_args():
    return get_flavor("motif3_debug").replace(
        elementwise_attn_output_gate=True, lambda_init="normal", gate_init="normal"
    )


def gdla_by_hand(attn: GDLAttention, x, pos, docs, rope_theta):
    """docs/model-spec.md §2.4 written out: projections, interleaved RoPE via complex numbers, per-head loop attention,
    group-wise signal - sigmoid(lambda) * noise, gate, wo. float64."""
    a = attn
    B, S, _ = x.shape
    xd = x.double()
    W = {n: p.detach().double() for n, p in a.named_parameters()}

    def rms(t, w, eps):
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + eps) * w

    c_q = rms(xd @ W["wq_a.weight"].T, W["q_norm.weight"], a.q_norm.eps)
    q = (c_q @ W["wq_b.weight"].T).view(B, S, a.n_heads, a.d_nope + a.d_rope)
    kv_all = xd @ W["wkv_a.weight"].T
    c_kv = rms(kv_all[..., : a.kv_lora_rank], W["kv_norm.weight"], a.kv_norm.eps)
    k_pe = kv_all[..., a.kv_lora_rank :]
    kv = (c_kv @ W["wkv_b.weight"].T).view(B, S, a.n_kv_heads, a.d_nope + a.d_v)

    inv = torch.tensor([rope_theta ** (-2 * j / a.d_rope) for j in range(a.d_rope // 2)], dtype=torch.float64)

    def rot(t):  # t [..., d_rope] at positions pos [B, S]; pairs (2j, 2j+1) as complex numbers
        z = torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous())
        ang = pos.double()[..., None] * inv
        if t.dim() == 4:
            ang = ang[:, :, None]
        return torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)).flatten(-2)

    q = torch.cat([q[..., : a.d_nope], rot(q[..., a.d_nope :])], -1)
    k_pe = rot(k_pe)
    k = torch.cat([kv[..., : a.d_nope], k_pe[:, :, None].expand(B, S, a.n_kv_heads, a.d_rope)], -1)
    v = kv[..., a.d_nope :]
    o, _ = loop_attention(q, k, v, a.softmax_scale, a.window, docs)
    lam = torch.sigmoid(xd @ W["lambda_proj.weight"].T)  # [B, S, n_sig]
    gate = torch.sigmoid(c_q @ W["wq_b_gate.weight"].T).view(B, S, a.n_sig, a.d_v)
    ys = []
    sig_idx = 0
    for grp in range(a.n_noise):
        noise = o[:, :, grp * (a.r + 1) + a.r]
        for j in range(a.r):
            sig = o[:, :, grp * (a.r + 1) + j]
            ys.append((sig - lam[:, :, sig_idx, None] * noise) * gate[:, :, sig_idx])
            sig_idx += 1
    y = torch.stack(ys, 2).reshape(B, S, -1)
    return y @ W["wo.weight"].T


@pytest.mark.parametrize("sliding", [False, True])
def test_gdla_matches_spec_by_hand(sliding):
    args = _small_args()
    torch.manual_seed(0)
    theta = 1000.0
    rope = RotaryEmbedding(plain_inv_freq(args.qk_rope_head_dim, theta), 32)
    attn = GDLAttention(args, sliding=sliding, softmax_scale=0.3, rope=rope, attention_backend="reference").double()
    attn.window = 4 if sliding else None
    attn.init_weights()
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.05 * torch.randn_like(p))  # make norms / gate / lambda non-trivial
    B, S = 2, 10
    x = torch.randn(B, S, args.hidden_size, dtype=torch.float64)
    pos = torch.tensor([list(range(4)) + list(range(6)), list(range(10))])
    docs = torch.tensor([[0] * 4 + [1] * 6, [0] * 10])
    got, max_logits = attn(x, pos, build_attention_metadata("reference", docs, [attn.window], B, S, x.device))
    assert max_logits is None  # not recording
    want = gdla_by_hand(attn, x, pos, docs, theta)
    torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-4)  # the layer computes in fp32 inside


def test_gdla_sdpa_equals_reference_and_records_max_logits():
    args = _small_args()
    torch.manual_seed(1)
    rope = RotaryEmbedding(plain_inv_freq(args.qk_rope_head_dim, 1e4), 32)
    ref = GDLAttention(args, sliding=True, softmax_scale=0.25, rope=rope, attention_backend="reference")
    ref.init_weights()
    sdpa = GDLAttention(args, sliding=True, softmax_scale=0.25, rope=rope, attention_backend="sdpa")
    sdpa.load_state_dict(ref.state_dict())
    x = torch.randn(2, 20, args.hidden_size)
    pos = torch.arange(20).expand(2, 20)
    docs = torch.tensor([[0] * 7 + [1] * 13, [3] * 20])
    for m in (ref, sdpa):
        m.record_max_logits = True
    meta = {name: build_attention_metadata(name, docs, [ref.window], 2, 20, x.device) for name in ("sdpa", "reference")}
    got, got_max = sdpa(x, pos, meta["sdpa"])
    want, want_max = ref(x, pos, meta["reference"])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_max, want_max, atol=1e-5, rtol=1e-5)
    assert want_max.shape == (args.num_attention_heads,) and want_max.dtype == torch.float32
    assert not want_max.requires_grad


@pytest.mark.parametrize("with_docs", [True, False])
@pytest.mark.parametrize("window", [None, 2])
def test_chunked_max_logits_with_small_blocks(qkv, window, with_docs):
    """Many tiny query x key blocks (block boundaries inside documents and windows; without documents most
    tiles lie wholly inside the visible band and skip the mask) give the same max."""
    q, k, v, docs = qkv
    docs = docs if with_docs else None
    _, want = loop_attention(q, k, v, 0.5, window, docs)
    got = chunked_max_logits(q, k, scale=0.5, window=window, document_ids=docs, block_elems=1, query_chunk=5)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_checkpoint_recompute_does_not_record_max_logits_again():
    """Under activation checkpointing the backward re-runs the layer: the max-logit side pass runs in the
    forward only, and the forward's output is the recorded value."""
    from torch.utils.checkpoint import checkpoint

    args = _small_args()
    torch.manual_seed(3)
    rope = RotaryEmbedding(plain_inv_freq(args.qk_rope_head_dim, 1e4), 32)
    attn = GDLAttention(args, sliding=False, softmax_scale=0.25, rope=rope, attention_backend="reference")
    attn.init_weights()
    calls = []
    kernel = attn.kernel
    attn.kernel = lambda *a, **kw: calls.append(kw["record_max_logits"]) or kernel(*a, **kw)
    attn.record_max_logits = True
    x = torch.randn(2, 12, args.hidden_size, requires_grad=True)
    pos = torch.arange(12).expand(2, 12)
    out, recorded = checkpoint(attn, x, pos, use_reentrant=False)
    out.sum().backward()
    assert calls == [True, False]
    _, plain = attn(x, pos)
    torch.testing.assert_close(recorded, plain, rtol=0, atol=0)


@pytest.mark.parametrize("with_gate", [True, False])
def test_grouped_differential_gradients(with_gate):
    """The memory-saving combination Function: gradcheck in float64 and agreement with a direct formula."""
    from llm_training.layers.attention.gdla import grouped_differential

    torch.manual_seed(0)
    B, S, G, r, D = 2, 3, 2, 3, 4
    out = torch.randn(B, S, G, r + 1, D, dtype=torch.float64, requires_grad=True)
    lam = torch.rand(B, S, G, r, dtype=torch.float64, requires_grad=True)
    gate = torch.randn(B, S, G * r * D, dtype=torch.float64, requires_grad=True) if with_gate else None
    args = (out, lam, gate)
    torch.autograd.gradcheck(grouped_differential, args)
    want = out[:, :, :, :r] - lam[..., None] * out[:, :, :, r:]
    if with_gate:
        want = want * torch.sigmoid(gate).view(B, S, G, r, D)
    torch.testing.assert_close(grouped_differential(*args), want)


def test_metadata_holds_flex_masks_only_where_the_backend_uses_them():
    """Built once per forward: flex gets one block mask per window; auto on CPU and sdpa need none; a missing
    window is a clear error, not a silent rebuild."""
    docs = torch.tensor([[0] * 5 + [1] * 7])
    flex = build_attention_metadata("flex", docs, [None, 3], 1, 12, torch.device("cpu"))
    assert set(flex.flex_block_masks) == {None, 3} and flex.document_ids is docs
    assert build_attention_metadata("auto", docs, [None, 3], 1, 12, torch.device("cpu")).flex_block_masks == {}
    assert build_attention_metadata("sdpa", docs, [None, 3], 1, 12, torch.device("cpu")).flex_block_masks == {}
    with pytest.raises(RuntimeError, match="no FlexAttention block mask for window 7"):
        flex.flex_block_mask(7)
