"""HF import/export: config mapping, key mapping, RoPE row permutation, round trip, independent writer,
and the errors for bad config.json / missing / misshaped tensors."""

import json
import logging

import pytest
import torch
from safetensors.torch import save_file

from llm_training.motif import get_flavor
from llm_training.motif.model import Motif3Model
from llm_training.motif.state_dict_adapter import (
    args_from_hf_config,
    export_hf_checkpoint,
    half_split_to_interleaved,
    hf_config_from_args,
    interleaved_to_half_split,
    load_hf_checkpoint,
)

ARGS = get_flavor("motif3_debug")


def _model(seed):
    torch.manual_seed(seed)
    m = Motif3Model(ARGS)
    m.init_weights()
    with torch.no_grad():  # non-trivial values for every fp32 param/buffer too
        for layer in m.layers:
            if layer.moe is not None:
                layer.moe.expert_bias.copy_(torch.randn(ARGS.num_experts) * 0.01)
    return m.eval()


def _ids():
    return torch.randint(0, ARGS.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))


def _logits(m, ids):
    with torch.no_grad():
        out = m(ids)
    return out.logits, out.mtp_logits[0]


def _assert_same_logits(src, dst, ids):
    """Main and MTP logits of the two models are bitwise equal."""
    for a, b in zip(_logits(src, ids), _logits(dst, ids)):
        assert torch.equal(a, b)


def test_permutation_is_half_split_and_invertible():
    p = interleaved_to_half_split(8)
    assert p.tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    rows = torch.arange(8)
    assert torch.equal(rows[p][half_split_to_interleaved(8)], rows)


def test_config_round_trip_and_published_field_names():
    cfg = hf_config_from_args(ARGS)
    for name in (
        "num_hidden_layers",
        "hidden_size",
        "num_experts",
        "experts_top_k",
        "max_position_embeddings",
        "qk_rope_head_dim",
        "num_nextn_predict_layers",
        "rope_scaling",
        "vocab_size",
    ):
        assert name in cfg
    assert cfg["rope_scaling"] is None  # YaRN inactive (max_seq_len == original_seq_len): plain RoPE for Motif too
    assert cfg["architectures"] == ["MotifForCausalLM"] and cfg["model_type"] == "Motif"
    assert cfg["use_sliding_window"] is True
    long = ARGS.replace(max_seq_len=4 * ARGS.original_seq_len, rope_factor=4.0)
    assert hf_config_from_args(long)["rope_scaling"] == {
        "type": "yarn",
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ARGS.original_seq_len,
        "beta_fast": ARGS.beta_fast,
        "beta_slow": ARGS.beta_slow,
        "apply_yarn_scaling": False,
    }
    assert args_from_hf_config(json.loads(json.dumps(hf_config_from_args(long)))) == long
    assert cfg["max_position_embeddings"] == ARGS.max_seq_len
    assert args_from_hf_config(json.loads(json.dumps(cfg))) == ARGS


def test_unknown_fields_are_dropped_with_a_warning(caplog):
    cfg = hf_config_from_args(ARGS) | {"made_up_field": 1, "transformers_version": "5.0"}
    with caplog.at_level(logging.WARNING):
        assert args_from_hf_config(cfg) == ARGS
    assert "made_up_field" in caplog.text and "transformers_version" not in caplog.text


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"hidden_size": "64"}, "hidden_size"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.type"),
        ({"use_sliding_window": False}, "use_sliding_window"),
        ({"load_balance_coeff": None}, "load_balance_coeff"),
        ({"diff_v2": False}, "diff_v2"),
        ({"num_noise_heads": 3}, "num_noise_heads"),
    ],
)
def test_bad_config_errors_name_the_field(change, needle):
    with pytest.raises(ValueError, match=needle):
        args_from_hf_config(hf_config_from_args(ARGS) | change)


def test_export_then_import_reproduces_logits_exactly(tmp_path):
    src, dst, ids = _model(0), _model(1), _ids()
    export_hf_checkpoint(src, tmp_path, dtype=torch.float32, max_shard_bytes=200_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    assert "lm_head.weight" in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]
    assert "model.mtp_layers.0.self_attn.wq_b.weight" in index["weight_map"]
    load_hf_checkpoint(dst, tmp_path)
    _assert_same_logits(src, dst, ids)


def test_export_writes_a_drifted_routed_expert_polynorm_bias_as_stored(tmp_path):
    """A routed-expert PolyNorm bias stored beyond +-polynorm_bias_clamp is exported unchanged (the forward
    clamps it, ours and Motif's vLLM at load time), so the logits after import are unchanged and an
    HF -> DCP -> HF round trip stays exact."""
    from safetensors import safe_open

    src, dst, ids = _model(0), _model(1), _ids()
    bound = ARGS.polynorm_bias_clamp
    with torch.no_grad():
        src.layers[2].moe.experts.act_fn.bias.fill_(3 * bound)
    export_hf_checkpoint(src, tmp_path, dtype=torch.float32)
    (shard,) = sorted(tmp_path.glob("*.safetensors"))
    with safe_open(str(shard), framework="pt") as f:
        assert torch.all(f.get_tensor("model.layers.2.moe.experts.act_fn.bias") == 3 * bound)
    load_hf_checkpoint(dst, tmp_path)
    _assert_same_logits(src, dst, ids)


def test_bf16_export_keeps_fp32_tensors(tmp_path):
    from safetensors import safe_open

    export_hf_checkpoint(_model(0), tmp_path, dtype=torch.bfloat16)
    (shard,) = sorted(tmp_path.glob("*.safetensors"))
    with safe_open(str(shard), framework="pt") as f:
        assert f.get_tensor("model.layers.2.moe.expert_bias").dtype == torch.float32
        assert f.get_tensor("model.layers.2.moe.router.gate.weight").dtype == torch.float32
        assert f.get_tensor("model.layers.0.mhc_attn.proj_res.weight").dtype == torch.float32
        assert f.get_tensor("model.layers.0.mlp.act_fn.weight").dtype == torch.float32
        assert f.get_tensor("model.layers.0.self_attn.wq_b.weight").dtype == torch.bfloat16
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"


def _half_split_rows(w, n_heads, head_dim, d_rope):
    """The test's own NeoX re-layout: per head, rope rows (2j, 2j+1) -> (j, j + d/2)."""
    w = w.clone().reshape(n_heads, head_dim, -1)
    rope = w[:, head_dim - d_rope :]
    w[:, head_dim - d_rope :] = torch.cat([rope[:, 0::2], rope[:, 1::2]], dim=1)
    return w.reshape(n_heads * head_dim, -1)


def _write_independent_hf_dir(path, model):
    """An HF directory written without the adapter: hand-made config + single safetensors file."""
    a = ARGS
    tensors = {}
    for key, w in model.state_dict().items():
        w = w.detach().clone()
        if key.endswith("self_attn.wq_b.weight"):
            w = _half_split_rows(w, a.num_attention_heads, a.head_dim, a.qk_rope_head_dim)
        elif key.endswith("self_attn.wkv_a.weight"):
            w = torch.cat(
                [w[: a.kv_lora_rank], _half_split_rows(w[a.kv_lora_rank :], 1, a.qk_rope_head_dim, a.qk_rope_head_dim)]
            )
        elif key.endswith(("alpha_pre", "alpha_post", "alpha_res")):
            w = w.reshape(1)  # Motif stores the mHC gains with shape [1]
        key = key.replace("mhc_attn.norm.", "mhc_attn.rms_norm.").replace("mhc_ffn.norm.", "mhc_ffn.rms_norm.")
        tensors[key if key.startswith("lm_head") else f"model.{key}"] = w.contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "architectures": ["MotifForCausalLM"],
        "model_type": "Motif",
        "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size,
        "num_hidden_layers": a.num_hidden_layers,
        "intermediate_size": a.intermediate_size,
        "n_dense_first_layers": a.n_dense_first_layers,
        "interleave_moe_layer_step": 1,
        "num_experts": a.num_experts,
        "experts_top_k": a.experts_top_k,
        "num_shared_experts": 1,
        "moe_intermediate_size": a.moe_intermediate_size,
        "score_func": "sigmoid",
        "route_norm": True,
        "route_scale": a.route_scale,
        "load_balance_coeff": a.load_balance_coeff,
        "hidden_act": "poly_norm",
        "rms_norm_eps": a.rms_norm_eps,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "num_noise_heads": a.num_noise_heads,
        "head_dim": a.head_dim,
        "qk_rope_head_dim": a.qk_rope_head_dim,
        "v_head_dim": a.v_head_dim,
        "q_lora_rank": a.q_lora_rank,
        "kv_lora_rank": a.kv_lora_rank,
        "elementwise_attn_output_gate": True,
        "use_sliding_window": True,
        "sliding_window": a.sliding_window,
        "sliding_window_period": a.sliding_window_period,
        "rope_theta": a.rope_theta,
        "swa_rope_theta": a.swa_rope_theta,
        "max_position_embeddings": a.max_seq_len,
        "original_seq_len": a.original_seq_len,
        "rope_factor": a.rope_factor,
        "mscale": a.mscale,
        "rope_scaling": None,
        "mhc_enabled": True,
        "mhc_expansion_rate": a.mhc_expansion_rate,
        "mhc_sinkhorn_iters": a.mhc_sinkhorn_iters,
        "polynorm_output_scale": a.polynorm_output_scale,
        "polynorm_bias_clamp": a.polynorm_bias_clamp,
        "hidden_clamp": a.hidden_clamp,
        "num_nextn_predict_layers": 1,
        "diff_v2": True,
        "torch_dtype": "float32",
        "transformers_version": "5.0.0",
    }
    (path / "config.json").write_text(json.dumps(config))


def test_independently_written_hf_dir_loads_with_same_logits(tmp_path):
    src, dst, ids = _model(0), _model(1), _ids()
    _write_independent_hf_dir(tmp_path, src)
    load_hf_checkpoint(dst, tmp_path)
    _assert_same_logits(src, dst, ids)


def test_missing_unexpected_and_misshaped_tensors_are_named(tmp_path):
    from safetensors.torch import load_file

    export_hf_checkpoint(_model(0), tmp_path, dtype=torch.float32)
    (shard,) = sorted(tmp_path.glob("*.safetensors"))
    tensors = load_file(str(shard))
    del tensors["model.layers.1.self_attn.wo.weight"]
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    tensors["model.norm.weight"] = torch.zeros(3)
    save_file(tensors, str(shard))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: shard.name for k in tensors}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError) as e:
        load_hf_checkpoint(_model(1), tmp_path)
    msg = str(e.value)
    assert "model.layers.1.self_attn.wo.weight" in msg and "model.layers.0.extra.weight" in msg
    assert "norm.weight: expected [64], found [3]" in msg


def test_bad_config_json_file_is_named(tmp_path):
    export_hf_checkpoint(_model(0), tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_experts"] = 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_experts"):
        load_hf_checkpoint(_model(1), tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        load_hf_checkpoint(_model(1), tmp_path)


def test_hf_half_split_rope_on_exported_rows_equals_our_interleaved_rope():
    """HF rotates rope pairs (j, j + d/2) of its rows (NeoX `rotate_half`, written out here); we rotate
    (2j, 2j + 1) of ours. On the exported wq_b / wkv_a rows the HF rotation must give our rotated vectors
    permuted the same way (so every q_pe . k_pe logit is unchanged), and the nope rows must not move."""
    from llm_training.layers.attention.rope import apply_rope_interleaved, plain_inv_freq
    from llm_training.motif.state_dict_adapter import to_hf_tensor

    a = ARGS
    m = _model(0)
    pre = "layers.1.self_attn."
    wq_b, wkv_a = m.state_dict()[pre + "wq_b.weight"].double(), m.state_dict()[pre + "wkv_a.weight"].double()
    wq_b_hf, wkv_a_hf = to_hf_tensor(pre + "wq_b.weight", wq_b, a), to_hf_tensor(pre + "wkv_a.weight", wkv_a, a)
    g = torch.Generator().manual_seed(5)
    S, d, nope = 7, a.qk_rope_head_dim, a.head_dim - a.qk_rope_head_dim
    c_q = torch.randn(S, a.q_lora_rank, dtype=torch.float64, generator=g)
    x = torch.randn(S, a.hidden_size, dtype=torch.float64, generator=g)
    pos = torch.arange(S) * 13
    inv = torch.tensor([a.swa_rope_theta ** (-2.0 * j / d) for j in range(d // 2)], dtype=torch.float64)
    ang = pos[:, None].double() * inv  # [S, d/2]

    def hf_rotate(t):  # t [S, heads, d], HF/NeoX convention: cos/sin tables repeated twice, rotate_half
        cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
        sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
        rotated_half = torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1)
        return t * cos + rotated_half * sin

    q = (c_q @ wq_b.T).view(S, a.num_attention_heads, a.head_dim)
    q_hf = (c_q @ wq_b_hf.T).view(S, a.num_attention_heads, a.head_dim)
    torch.testing.assert_close(q_hf[..., :nope], q[..., :nope], rtol=0, atol=0)
    k_pe = (x @ wkv_a.T)[:, None, a.kv_lora_rank :]  # [S, 1, d]
    k_pe_hf = (x @ wkv_a_hf.T)[:, None, a.kv_lora_rank :]
    torch.testing.assert_close(
        (x @ wkv_a_hf.T)[:, : a.kv_lora_rank], (x @ wkv_a.T)[:, : a.kv_lora_rank], rtol=0, atol=0
    )

    cos, sin = ang.cos()[None].float(), ang.sin()[None].float()
    ours_q = apply_rope_interleaved(q[None, ..., nope:].float(), cos, sin)[0].double()
    ours_k = apply_rope_interleaved(k_pe[None].float(), cos, sin)[0].double()
    hf_q, hf_k = hf_rotate(q_hf[..., nope:]), hf_rotate(k_pe_hf)
    perm = [2 * j for j in range(d // 2)] + [2 * j + 1 for j in range(d // 2)]  # HF row r <- our row perm[r]
    torch.testing.assert_close(hf_q, ours_q[..., perm], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(hf_k, ours_k[..., perm], atol=1e-4, rtol=1e-5)
    logits_hf = torch.einsum("ihd,jd->hij", hf_q, hf_k[:, 0])
    logits_ours = torch.einsum("ihd,jd->hij", ours_q, ours_k[:, 0])
    torch.testing.assert_close(logits_hf, logits_ours, atol=1e-3, rtol=1e-4)


def test_run_config_from_an_hf_dir_changes_only_what_training_changed(tmp_path):
    """A run started from an HF directory records that directory's config.json (unknown fields and
    representation kept) and its path; exporting it after the run changed an architecture field (here the
    context length, which switches YaRN on) rewrites only the fields that depend on it, and carries the
    directory's other files."""
    from llm_training.motif.state_dict_adapter import SOURCE_DIR_KEY, run_hf_config

    src = tmp_path / "src"
    _write_independent_hf_dir(src.mkdir() or src, _model(0))
    base = json.loads((src / "config.json").read_text()) | {"unknown_field": [1, 2]}
    (src / "config.json").write_text(json.dumps(base))
    (src / "tokenizer_config.json").write_text('{"x": 1}')
    stored = run_hf_config(ARGS, str(src), "hf")
    assert stored == base | {SOURCE_DIR_KEY: str(src.resolve())}

    longer = ARGS.replace(max_seq_len=4 * ARGS.original_seq_len, rope_factor=4.0)
    model = Motif3Model(longer)
    model.init_weights()
    export_hf_checkpoint(model, tmp_path / "out", dtype=torch.float32, base_config=stored)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    changed = {k for k in written if written[k] != base.get(k)}
    assert changed == {"max_position_embeddings", "rope_factor", "rope_scaling"}
    assert written["unknown_field"] == [1, 2] and args_from_hf_config(written) == longer
    assert (tmp_path / "out" / "tokenizer_config.json").read_text() == '{"x": 1}'
