"""Checkpoints in the layout Motif's own vLLM port serves (docs/model-spec.md §0.2), checked against a float64
reference written from that code (`motif_vllm_reference.py`): (a) a checkpoint written in Motif's layout
loads into our model with Motif's logits, (b) our export, read the way Motif's config code reads
config.json, gives our logits. Tiny configs with sliding and full layers, YaRN on and off, mHC on and off,
MoE with a shared expert, noise heads, clamps that bite, per-layer PolyNorm scales and chained MTP modules."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from llm_training.motif.model import Motif3Model
from llm_training.motif.state_dict_adapter import (
    args_from_hf_config,
    export_hf_checkpoint,
    load_hf_checkpoint,
    read_hf_config,
)
from tests.motif.motif_vllm_reference import motif_layout_shapes, reference_logits

SEQ = 24


def motif_config(**changes) -> dict:
    """A tiny config.json in the field names and conventions of Motif's releases."""
    cfg = {
        "architectures": ["MotifForCausalLM"], "model_type": "Motif", "torch_dtype": "float32",
        "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 5, "intermediate_size": 48,
        "n_dense_first_layers": 1, "interleave_moe_layer_step": 1, "num_experts": 8, "experts_top_k": 2,
        "num_shared_experts": 1, "moe_intermediate_size": 16, "score_func": "sigmoid", "route_norm": True,
        "route_scale": 2.0, "load_balance_coeff": 1e-3, "hidden_act": "poly_norm", "polynorm_sigmoid_weight": True,
        "polynorm_output_scale": 0.5, "polynorm_output_scale_per_layer": {"2": 0.75, "5": 0.25},
        "polynorm_bias_clamp": 0.3, "hidden_clamp": 0.6, "rms_norm_eps": 1e-5,
        "num_attention_heads": 10, "num_key_value_heads": 2, "num_noise_heads": 2, "head_dim": 12,
        "qk_rope_head_dim": 6, "v_head_dim": 8, "q_lora_rank": 16, "kv_lora_rank": 12,
        "elementwise_attn_output_gate": True, "use_sliding_window": True, "sliding_window": 5,
        "sliding_window_pattern": "interleave", "sliding_window_period": 2, "rope_theta": 10000.0,
        "swa_rope_theta": 500.0, "max_position_embeddings": 32, "original_seq_len": 32, "rope_factor": 1.0,
        "mscale": 1.0, "rope_scaling": None, "mhc_enabled": True, "mhc_expansion_rate": 3,
        "mhc_sinkhorn_iters": 10, "mhc_h_post_alpha_end": 0.25, "num_nextn_predict_layers": 2, "diff_v2": True,
        "attention_cls": "gdla", "tie_word_embeddings": False,
    }  # fmt: skip
    return cfg | changes


YARN = dict(
    max_position_embeddings=64,
    original_seq_len=16,
    rope_factor=4.0,
    mscale=0.8,
    rope_scaling={
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "apply_yarn_scaling": False,
    },
)
CONFIGS = {
    "mhc_plain_rope": motif_config(),
    "mhc_yarn": motif_config(**YARN),
    "no_mhc_yarn_one_mtp": motif_config(mhc_enabled=False, num_nextn_predict_layers=1, **YARN),
}


def _ids():
    return torch.randint(0, 96, (SEQ,), generator=torch.Generator().manual_seed(7))


def random_motif_tensors(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Values for every tensor of Motif's layout, scaled so that every clamp and the routing bias matter."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in motif_layout_shapes(config).items():
        t = torch.randn(shape, generator=g)
        if name.endswith(("layernorm.weight", "norm.weight")):
            t = 1.0 + 0.1 * t
        elif name.endswith(("act_fn.weight", "act_fn.bias", "alpha_pre", "alpha_post", "alpha_res")):
            t = 0.5 * t
        elif name.endswith(("bias_pre", "bias_post", "bias_res")):
            t = 0.3 * t
        elif name.endswith("expert_bias"):
            t = 0.05 * t
        elif not name.endswith("embed_tokens.weight"):
            t = 0.15 * t
        out[name] = t
    return out


def _write_motif_dir(path, config, tensors):
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))


def _assert_close_rel(ours, ref, what, tol=2e-5):
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert err < tol, f"{what}: max error {err:.2e} of the largest |logit|"


def _compare(model, config, tensors, ids):
    with torch.no_grad():
        out = model(ids[None])
    ref, ref_mtp = reference_logits(config, tensors, ids)
    _assert_close_rel(out.logits[0], ref, "main logits")
    assert len(out.mtp_logits) == len(ref_mtp) == config["num_nextn_predict_layers"]
    for k, (ours, want) in enumerate(zip(out.mtp_logits, ref_mtp)):
        valid = SEQ - k - 1  # later positions read a filler id
        _assert_close_rel(ours[0, :valid], want[:valid], f"MTP module {k} logits")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_motif_layout_checkpoint_loads_with_motifs_logits(tmp_path, name):
    config, tensors = CONFIGS[name], random_motif_tensors(CONFIGS[name], seed=1)
    _write_motif_dir(tmp_path, config, tensors)
    model = Motif3Model(read_hf_config(tmp_path), attention_backend="reference")
    model.init_weights()
    model = model.double().eval()
    load_hf_checkpoint(model, tmp_path)
    _compare(model, config, tensors, _ids())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_our_export_is_served_with_our_logits(tmp_path, name):
    args = args_from_hf_config(CONFIGS[name])
    torch.manual_seed(2)
    model = Motif3Model(args, attention_backend="reference")
    model.init_weights()
    with torch.no_grad():  # move every init-constant parameter off its start value
        for key, p in model.named_parameters():
            if "act_fn" in key or "alpha_" in key or "bias_" in key or "norm" in key:
                p.add_(0.3 * torch.randn_like(p))
        for key, b in model.named_buffers():
            if key.endswith("expert_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    export_hf_checkpoint(model, tmp_path, dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    tensors = load_file(str(next(tmp_path.glob("*.safetensors"))))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == motif_layout_shapes(config)
    _compare(model.double().eval(), config, tensors, _ids())


def test_released_config_reads_with_motifs_defaults_and_finished_mhc_schedule():
    """Fields a release leaves out take the value Motif's code falls back to; mhc_h_post_alpha_start (ours)
    missing means the schedule is finished (start = end); a missing swa_rope_theta with plain RoPE means
    sliding layers use rope_theta."""
    config = motif_config()
    for field in ("swa_rope_theta", "polynorm_bias_clamp", "hidden_clamp", "polynorm_output_scale_per_layer"):
        del config[field]
    args = args_from_hf_config(config)
    assert args.swa_rope_theta == config["rope_theta"]
    assert args.polynorm_bias_clamp is None and args.hidden_clamp == 1000.0
    assert args.polynorm_output_scale_per_layer == {}
    assert args.mhc_h_post_alpha_start == args.mhc_h_post_alpha_end == 0.25


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(YARN, rope_scaling=dict(YARN["rope_scaling"], apply_yarn_scaling=True)), "apply_yarn_scaling"),
        (dict(YARN, rope_factor=2.0), "rope_scaling.factor"),
        (dict(YARN, swa_rope_theta=None), "swa_rope_theta"),
        (dict(YARN, rope_scaling=None), "rope_scaling"),
        (dict(YARN, max_position_embeddings=16), "max_position_embeddings <= original_seq_len"),
        ({"use_sliding_window": False}, "use_sliding_window"),
        ({"score_before_experts": True}, "score_before_experts"),
    ],
)
def test_configs_motif_would_serve_differently_are_rejected(change, needle):
    with pytest.raises(ValueError, match=needle):
        args_from_hf_config(motif_config(**change))


def test_pre_motif_layout_names_and_shapes_are_rejected(tmp_path):
    config = CONFIGS["mhc_plain_rope"]
    tensors = random_motif_tensors(config, seed=3)
    tensors["model.layers.0.mhc_attn.norm.weight"] = tensors.pop("model.layers.0.mhc_attn.rms_norm.weight")
    tensors["model.layers.1.mhc_ffn.alpha_res"] = tensors["model.layers.1.mhc_ffn.alpha_res"].reshape(())
    _write_motif_dir(tmp_path, config, tensors)
    model = Motif3Model(read_hf_config(tmp_path))
    model.init_weights()
    with pytest.raises(ValueError) as e:
        load_hf_checkpoint(model, tmp_path)
    assert "model.layers.0.mhc_attn.norm.weight" in str(e.value) and "rms_norm" in str(e.value)
    assert "model.layers.1.mhc_ffn.alpha_res" in str(e.value) and "expected shape [1]" in str(e.value)
