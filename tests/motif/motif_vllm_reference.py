"""Test-only float64 reference of the Motif-3 forward as Motif's own vLLM port serves it.

Written from `MotifTechnologies/vllm` (commit 4cd9eb41): `vllm/model_executor/models/motif.py` (GDLA attention,
MotifMLP, MotifMoEFused + `fused_moe/motif_experts.py` / `csrc/grouped_poly_norm_kernel.cu` for the routed
experts, MotifMHCLayer, MotifDecoderLayer, MotifModel), `motif_mtp.py` (the MTP blocks), the config class
`vllm/transformers_utils/configs/motif.py` (MotifConfig defaults) and vLLM's `get_rope` / YaRN rotary
embedding. Nothing here comes from llm_training's layers: it reads a config.json dict and HF-layout tensors
(the names Motif's `load_weights` consumes) and returns logits, one sequence at a time, as vLLM flattens tokens.
"""

from __future__ import annotations

import math

import torch

# MotifConfig.__init__ defaults for the fields the model code reads as attributes.
_MOTIF_CONFIG_DEFAULTS = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None, "use_sliding_window": False,
    "sliding_window": 4096, "sliding_window_pattern": "interleave", "sliding_window_period": 2, "head_dim": None,
    "num_noise_heads": 0, "num_experts": 0, "experts_top_k": 2, "num_shared_experts": 0,
    "interleave_moe_layer_step": 0, "moe_intermediate_size": None, "score_func": "softmax", "route_norm": False,
    "route_scale": 1.0, "load_balance_coeff": None, "n_dense_first_layers": 0, "polynorm_output_scale": 1.0,
    "polynorm_output_scale_per_layer": None, "polynorm_bias_clamp": None, "mhc_enabled": False,
    "mhc_expansion_rate": 4, "mhc_sinkhorn_iters": 20, "q_lora_rank": 0, "kv_lora_rank": 0,
    "qk_rope_head_dim": None, "v_head_dim": None, "original_seq_len": 32768, "rope_factor": 1.0, "mscale": 1.0,
    "elementwise_attn_output_gate": False, "num_nextn_predict_layers": 0,
}  # fmt: skip


class MotifConfigView:
    """config.json as MotifConfig + the model's getattr calls see it."""

    def __init__(self, config: dict, **overrides):
        self._raw = dict(config) | overrides
        v = {k: self._raw.get(k, d) for k, d in _MOTIF_CONFIG_DEFAULTS.items()}
        if not v["use_sliding_window"]:
            v["sliding_window"] = None  # MotifConfig: sliding_window if use_sliding_window else None
        if v["moe_intermediate_size"] is None:
            v["moe_intermediate_size"] = v["intermediate_size"]
        v["polynorm_output_scale_per_layer"] = v["polynorm_output_scale_per_layer"] or {}
        if v["head_dim"] is not None:
            v["qk_rope_head_dim"] = v["qk_rope_head_dim"] or v["head_dim"] // 2
            v["v_head_dim"] = v["v_head_dim"] or v["head_dim"]
        self.__dict__.update(v)

    def get(self, name: str, default):
        """`getattr(config, name, default)` for a field MotifConfig does not declare."""
        return self.__dict__[name] if name in _MOTIF_CONFIG_DEFAULTS else self._raw.get(name, default)

    def mtp_clone(self) -> MotifConfigView:
        """motif_mtp.py `_make_mtp_hf_config`: dense, no mHC, every layer sliding (sliding_window kept)."""
        clone = MotifConfigView(self._raw)
        clone.__dict__.update(self.__dict__)
        clone.interleave_moe_layer_step, clone.mhc_enabled = 0, False
        clone.use_sliding_window, clone.sliding_window_pattern = True, "all"
        return clone


# ------------------------------------------------------------------------------------------ pieces
def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def poly_norm(x, weight_raw, bias, sigmoid_weight, eps=1e-6):
    """PolyNormTorch / grouped_poly_norm_forward: w0 x^3 rsqrt(mean x^6) + w1 x^2 rsqrt(mean x^4) + w2 x rsqrt(mean x^2) + b."""
    w = torch.sigmoid(weight_raw) if sigmoid_weight else weight_raw
    x2, x3 = x * x, x * x * x
    inv2 = torch.rsqrt(x2.mean(-1, keepdim=True) + eps)
    inv4 = torch.rsqrt((x2 * x2).mean(-1, keepdim=True) + eps)
    inv6 = torch.rsqrt((x3 * x3).mean(-1, keepdim=True) + eps)
    return w[..., 0:1] * x3 * inv6 + w[..., 1:2] * x2 * inv4 + w[..., 2:3] * x * inv2 + bias


def _yarn_inv_freq(dim, base, rs):
    """vLLM YaRNScalingRotaryEmbedding._compute_inv_freq (truncate=True, extrapolation_factor 1)."""
    factor, orig = rs["factor"], rs["original_max_position_embeddings"]
    beta_fast, beta_slow = rs.get("beta_fast", 32), rs.get("beta_slow", 1)

    def correction_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = max(math.floor(correction_dim(beta_fast)), 0), min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    mask = (1 - ramp) * rs.get("extrapolation_factor", 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - mask) + (1.0 / pos_freqs) * mask


def rope_cos_sin(positions, dim, theta, rope_scaling):
    """get_rope(dim, rope_parameters={rope_theta, **rope_scaling}): default or "yarn" (cos/sin times mscale)."""
    rs = rope_scaling or {}
    rope_type = rs.get("rope_type", rs.get("type", "default"))
    if rope_type == "yarn":
        inv_freq = _yarn_inv_freq(dim, theta, rs)
        m = (0.1 * math.log(rs["factor"]) + 1.0 if rs["factor"] > 1 else 1.0) * rs.get("attn_factor", 1)
        mscale = m if rs.get("apply_yarn_scaling", True) else rs.get("attn_factor", 1)
    else:
        assert rope_type == "default", rope_type
        inv_freq, mscale = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim), 1.0
    ang = positions[:, None].double() * inv_freq
    return ang.cos() * mscale, ang.sin() * mscale


def rotate_neox(x_ThD, cos, sin):
    d = x_ThD.shape[-1] // 2
    x1, x2 = x_ThD[..., :d], x_ThD[..., d:]
    c, s = cos[:, None], sin[:, None]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


# ------------------------------------------------------------------------------------------ modules
def gdla_attention(x_TD, p, cfg: MotifConfigView, layer_idx, positions, w):
    """MotifGDLAttention.forward (the MLA path of full layers is the same GQA math on replicated kv_b)."""
    T = x_TD.shape[0]
    H, Hkv, Hn = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_noise_heads
    hd = cfg.head_dim if cfg.head_dim is not None else cfg.hidden_size // H
    d_rope, d_v = cfg.qk_rope_head_dim, cfg.v_head_dim
    d_nope, r = hd - d_rope, (H - Hn) // Hn
    n_sig = r * Hn
    swa = False
    if cfg.use_sliding_window and cfg.sliding_window is not None:
        swa = cfg.sliding_window_pattern == "all" or (
            cfg.sliding_window_pattern == "interleave" and layer_idx % cfg.sliding_window_period != 0
        )
    scale = hd**-0.5
    if not swa and cfg.max_position_embeddings > cfg.get("original_seq_len", 32768):
        m = 0.1 * cfg.get("mscale", 1.0) * math.log(cfg.get("rope_factor", 1.0)) + 1.0
        scale = scale * m * m

    q_lat = rms_norm(x_TD @ w[p + "wq_a.weight"].T, w[p + "q_norm.weight"], cfg.rms_norm_eps)
    q = (q_lat @ w[p + "wq_b.weight"].T).view(T, H, hd)
    gate = (q_lat @ w[p + "wq_b_gate.weight"].T).view(T, n_sig, d_v) if cfg.elementwise_attn_output_gate else None
    q_nope, q_pe = q.split([d_nope, d_rope], dim=-1)
    kv_lat, k_pe = (x_TD @ w[p + "wkv_a.weight"].T).split([cfg.kv_lora_rank, d_rope], dim=-1)
    kv_lat = rms_norm(kv_lat, w[p + "kv_norm.weight"], cfg.rms_norm_eps)
    swa_theta = cfg.get("swa_rope_theta", None)
    if swa and swa_theta is not None:
        cos, sin = rope_cos_sin(positions, d_rope, swa_theta, None)
    else:
        cos, sin = rope_cos_sin(positions, d_rope, cfg.rope_theta, cfg.rope_scaling)
    q_pe, k_pe = rotate_neox(q_pe, cos, sin), rotate_neox(k_pe[:, None], cos, sin)
    k_nope, v = (kv_lat @ w[p + "wkv_b.weight"].T).view(T, Hkv, d_nope + d_v).split([d_nope, d_v], dim=-1)
    q_full = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, hd]
    k_full = torch.cat([k_nope, k_pe.expand(T, Hkv, d_rope)], dim=-1)  # [T, Hkv, hd]
    kv_of_head = torch.arange(H) // (H // Hkv)
    logits = torch.einsum("ihd,jhd->hij", q_full, k_full[:, kv_of_head]) * scale
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = (j <= i) & ((i - j <= cfg.sliding_window) if swa else True)  # flash window (W, 0)
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    out = torch.einsum("hij,jhd->ihd", probs, v[:, kv_of_head])  # [T, H, d_v]
    groups = out.view(T, Hn, r + 1, d_v)
    signal = groups[:, :, :r].reshape(T, n_sig, d_v)
    noise = groups[:, :, r:].reshape(T, Hn, d_v).repeat_interleave(r, dim=1)
    lam = torch.sigmoid(x_TD @ w[p + "lambda_proj.weight"].T)[..., None]
    res = signal - lam * noise
    if gate is not None:
        res = res * torch.sigmoid(gate)
    return res.reshape(T, n_sig * d_v) @ w[p + "wo.weight"].T


def motif_mlp(x_TD, p, w, hidden_clamp, output_scale, sigmoid_weight):
    """MotifMLP.forward: clamp(gate), clamp(up) only when hidden_clamp is given; PolyNorm(gate) * up * scale."""
    gate, up = x_TD @ w[p + "gate_proj.weight"].T, x_TD @ w[p + "up_proj.weight"].T
    if hidden_clamp is not None:
        gate, up = gate.clamp(-hidden_clamp, hidden_clamp), up.clamp(-hidden_clamp, hidden_clamp)
    h = poly_norm(gate, w[p + "act_fn.weight"], w[p + "act_fn.bias"], sigmoid_weight) * up * output_scale
    return h @ w[p + "down_proj.weight"].T


def motif_moe(x_TD, p, cfg: MotifConfigView, w, output_scale):
    """MotifMoEFused: router (fp32 in vLLM; float64 here) + FusedTopKBias routing + MotifTritonExperts + shared."""
    hc = cfg.get("hidden_clamp", 1000)
    sigmoid_weight = cfg.get("polynorm_sigmoid_weight", True)
    bias_clamp = cfg.polynorm_bias_clamp
    logits = x_TD @ w[p + "router.gate.weight"].T
    scores = torch.sigmoid(logits) if cfg.score_func == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores + w[p + "expert_bias"] if cfg.load_balance_coeff is not None else scores
    ids = torch.topk(choice, cfg.experts_top_k, dim=-1).indices  # [T, K]
    weights = scores.gather(-1, ids)
    if cfg.route_norm:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights * cfg.route_scale
    I = cfg.moe_intermediate_size
    gate_up = torch.einsum("td,eid->tei", x_TD, w[p + "experts.gate_up_proj"])  # every expert, [T, E, 2I]
    gate, up = gate_up[..., :I], gate_up[..., I:]
    if hc is not None and hc > 0:
        gate, up = gate.clamp(-hc, hc), up.clamp(-hc, hc)
    b = w[p + "experts.act_fn.bias"]
    if bias_clamp is not None:  # clamped once at load time in _load_fused_moe_expert_weight
        b = b.clamp(-bias_clamp, bias_clamp)
    act = poly_norm(gate, w[p + "experts.act_fn.weight"], b, sigmoid_weight) * up
    if hc is not None and hc > 0:
        act = act.clamp(-hc, hc)
    act = act * output_scale
    y = torch.einsum("tei,edi->ted", act, w[p + "experts.down_proj"])  # [T, E, D]
    routed = (y.gather(1, ids[..., None].expand(-1, -1, y.shape[-1])) * weights[..., None]).sum(1)
    if cfg.num_shared_experts > 0:
        routed = routed + motif_mlp(x_TD, p + "shared_experts.", w, hc, output_scale, sigmoid_weight)
    return routed


def mhc_coefficients(x_TED, p, cfg: MotifConfigView, w):
    """MotifMHCLayer.forward (rms_norm eps 1e-6, h_post coefficient 1 + mhc_h_post_alpha_end)."""
    T, E, D = x_TED.shape
    xn = rms_norm(x_TED.reshape(T, E * D), w[p + "rms_norm.weight"], 1e-6)
    pre, post = xn @ w[p + "proj_pre.weight"].T, xn @ w[p + "proj_post.weight"].T
    res = (xn @ w[p + "proj_res.weight"].T).view(T, E, E)
    coeff = 1.0 + float(cfg.get("mhc_h_post_alpha_end", 0.0))
    h_pre = torch.sigmoid((w[p + "alpha_pre"] * pre + w[p + "bias_pre"]).clamp(-10, 10))
    h_post = coeff * torch.sigmoid((w[p + "alpha_post"] * post + w[p + "bias_post"]).clamp(-10, 10))
    m = (w[p + "alpha_res"] * res + w[p + "bias_res"]).clamp(-20.0, 20.0).exp()
    for _ in range(cfg.mhc_sinkhorn_iters):
        m = m / m.sum(dim=-1, keepdim=True).clamp(min=1e-8)
        m = m / m.sum(dim=-2, keepdim=True).clamp(min=1e-8)
    return h_pre, h_post, m


def decoder_layer(x, layer_idx, cfg: MotifConfigView, w, positions, prefix):
    """MotifDecoderLayer: x is [T, E, D] with mHC, [T, D] without (the residual add written out)."""
    p = prefix
    step = cfg.interleave_moe_layer_step
    moe = layer_idx >= cfg.n_dense_first_layers and step != 0 and (layer_idx + 1) % step == 0
    per_layer = cfg.polynorm_output_scale_per_layer
    scale = per_layer.get(layer_idx) or per_layer.get(str(layer_idx))
    scale = float(scale) if scale is not None else float(cfg.get("polynorm_output_scale", 1.0))
    sig_w = cfg.get("polynorm_sigmoid_weight", True)

    def ffn(h):
        return motif_moe(h, p + "moe.", cfg, w, scale) if moe else motif_mlp(h, p + "mlp.", w, None, scale, sig_w)

    def attn(h):
        return gdla_attention(h, p + "self_attn.", cfg, layer_idx, positions, w)

    eps = cfg.rms_norm_eps
    if not cfg.mhc_enabled:
        x = x + attn(rms_norm(x, w[p + "input_layernorm.weight"], eps))
        return x + ffn(rms_norm(x, w[p + "post_attention_layernorm.weight"], eps))
    for sub, norm, fn in (
        ("mhc_attn.", "input_layernorm.weight", attn),
        ("mhc_ffn.", "post_attention_layernorm.weight", ffn),
    ):
        h_pre, h_post, h_res = mhc_coefficients(x, p + sub, cfg, w)
        out = fn(rms_norm((x * h_pre[..., None]).sum(1), w[p + norm], eps))
        x = torch.einsum("tij,tjd->tid", h_res, x) + h_post[..., None] * out[:, None]
    return x


def reference_logits(config: dict, tensors: dict, input_ids_S: torch.Tensor):
    """(main logits [S, V], [MTP module k logits [S, V]]) in float64. MTP module k at position i reads
    t_{i+k+1}; positions past the end read the last id (only positions < S - k - 1 have a meaning)."""
    cfg = MotifConfigView(config)
    w = {k: v.double() for k, v in tensors.items()}
    S = input_ids_S.shape[0]
    positions = torch.arange(S)
    embed = w["model.embed_tokens.weight"]
    x = embed[input_ids_S]
    if cfg.mhc_enabled:
        x = x[:, None].expand(S, cfg.mhc_expansion_rate, -1)
    for i in range(cfg.num_hidden_layers):
        x = decoder_layer(x, i, cfg, w, positions, f"model.layers.{i}.")
    if cfg.mhc_enabled:
        x = x.mean(dim=1)
    hidden = rms_norm(x, w["model.norm.weight"], cfg.rms_norm_eps)
    logits = hidden @ w["lm_head.weight"].T

    mtp_cfg, mtp_logits, prev = cfg.mtp_clone(), [], hidden
    for k in range(cfg.num_nextn_predict_layers):
        p = f"model.mtp_layers.{k}."
        ids = torch.cat([input_ids_S[k + 1 :], input_ids_S[-1:].expand(min(k + 1, S))])[:S]
        nxt = rms_norm(embed[ids], w[p + "embed_norm.weight"], cfg.rms_norm_eps)
        h = torch.cat([prev, nxt], dim=-1) @ w[p + "input_proj.weight"].T
        h = decoder_layer(h, cfg.num_hidden_layers + k, mtp_cfg, w, positions, p)
        prev = rms_norm(h, w[p + "final_layernorm.weight"], cfg.rms_norm_eps)
        mtp_logits.append(prev @ w["lm_head.weight"].T)
    return logits, mtp_logits


def motif_layout_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of a Motif-3 checkpoint as MotifForCausalLM.load_weights / MotifMTP consume
    them (main layers, then `model.mtp_layers.{k}.*`)."""
    c = MotifConfigView(config)
    D, V, E = c.hidden_size, c.vocab_size, c.mhc_expansion_rate
    H, Hkv, Hn = c.num_attention_heads, c.num_key_value_heads, c.num_noise_heads
    hd, d_rope, d_v = c.head_dim, c.qk_rope_head_dim, c.v_head_dim
    n_sig = H - Hn
    attn = {
        "self_attn.wq_a.weight": (c.q_lora_rank, D), "self_attn.q_norm.weight": (c.q_lora_rank,),
        "self_attn.wq_b.weight": (H * hd, c.q_lora_rank), "self_attn.wkv_a.weight": (c.kv_lora_rank + d_rope, D),
        "self_attn.kv_norm.weight": (c.kv_lora_rank,), "self_attn.wkv_b.weight": (Hkv * (hd - d_rope + d_v), c.kv_lora_rank),
        "self_attn.lambda_proj.weight": (n_sig, D), "self_attn.wo.weight": (D, n_sig * d_v),
        "input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
    }  # fmt: skip
    if c.elementwise_attn_output_gate:
        attn["self_attn.wq_b_gate.weight"] = (n_sig * d_v, c.q_lora_rank)

    def mlp(prefix, inter):
        return {f"{prefix}gate_proj.weight": (inter, D), f"{prefix}up_proj.weight": (inter, D),
                f"{prefix}down_proj.weight": (D, inter), f"{prefix}act_fn.weight": (3,), f"{prefix}act_fn.bias": (1,)}  # fmt: skip

    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(c.num_hidden_layers):
        layer = dict(attn)
        step = c.interleave_moe_layer_step
        if i >= c.n_dense_first_layers and step != 0 and (i + 1) % step == 0:
            I, NE = c.moe_intermediate_size, c.num_experts
            layer |= {"moe.router.gate.weight": (NE, D), "moe.expert_bias": (NE,),
                      "moe.experts.gate_up_proj": (NE, 2 * I, D), "moe.experts.down_proj": (NE, D, I),
                      "moe.experts.act_fn.weight": (NE, 3), "moe.experts.act_fn.bias": (NE, 1)}  # fmt: skip
            if c.num_shared_experts:
                layer |= mlp("moe.shared_experts.", I * c.num_shared_experts)
        else:
            layer |= mlp("mlp.", c.intermediate_size)
        if c.mhc_enabled:
            for sub in ("mhc_attn.", "mhc_ffn."):
                layer |= {f"{sub}rms_norm.weight": (E * D,), f"{sub}proj_pre.weight": (E, E * D),
                          f"{sub}proj_post.weight": (E, E * D), f"{sub}proj_res.weight": (E * E, E * D),
                          f"{sub}alpha_pre": (1,), f"{sub}alpha_post": (1,), f"{sub}alpha_res": (1,),
                          f"{sub}bias_pre": (E,), f"{sub}bias_post": (E,), f"{sub}bias_res": (E, E)}  # fmt: skip
        out |= {f"model.layers.{i}.{k}": s for k, s in layer.items()}
    for k in range(c.num_nextn_predict_layers):
        mtp = dict(attn) | mlp("mlp.", c.intermediate_size)
        mtp |= {"embed_norm.weight": (D,), "input_proj.weight": (D, 2 * D), "final_layernorm.weight": (D,)}
        out |= {f"model.mtp_layers.{k}.{n}": s for n, s in mtp.items()}
    return out
