"""config.json <-> Motif3ModelArgs, with the meaning Motif's own vLLM port gives every field (docs/model-spec.md §0.2).

The semantics are those of `MotifTechnologies/vllm` (commit 4cd9eb41): the config class
`vllm/transformers_utils/configs/motif.py` (MotifConfig: a field missing from config.json takes its default
there) and the reads in `vllm/model_executor/models/motif.py` / `motif_mtp.py` (`getattr(config, name,
default)`). `MOTIF_FIELDS` lists each field Motif's code reads, the default it falls back to, and where.
So a config.json we write is served by Motif's vLLM as the model we trained, and a config.json Motif wrote
is read as the model Motif serves; a config.json whose meaning our model cannot reproduce (e.g. a YaRN
`rope_scaling` that also scales cos/sin) is rejected with the field named.

Field rules that are not a plain copy:
  * `max_position_embeddings` is our `max_seq_len`.
  * YaRN: Motif interpolates the full layers' RoPE frequencies whenever `rope_scaling` is a yarn dict, and
    multiplies their softmax scale by mscale^2 when `max_position_embeddings > original_seq_len`, reading
    `rope_factor` / `original_seq_len` / `mscale` at the top level. We write `rope_scaling` only when YaRN
    is active (`args.yarn_active`), with `apply_yarn_scaling: false` (no cos/sin scaling), and `null`
    otherwise; the top-level fields are always written.
  * `use_sliding_window` must be true (false makes every layer, MTP included, full attention) and
    `sliding_window_pattern` "interleave"; a missing `swa_rope_theta` means sliding layers use the full
    layers' RoPE (accepted when that RoPE is plain: then swa_rope_theta = rope_theta).
  * `mhc_h_post_alpha_start` (ours) missing: a released checkpoint's mHC schedule is finished, so it is
    set to `mhc_h_post_alpha_end` (Motif serves with h_post coefficient 1 + alpha_end).
  * Unknown fields are left out of the args with one warning per distinct set; `merge_into_base` keeps them
    (and every other field of a base config.json) when writing.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from llm_training.motif.args import Motif3ModelArgs

logger = logging.getLogger(__name__)

HF_ARCHITECTURE = "MotifForCausalLM"  # models/registry.py of the fork; served as MotifForCausalLM (motif.py)
HF_MODEL_TYPE = "Motif"  # configs/motif.py: MotifConfig.model_type

_CFG = "configs/motif.py MotifConfig.__init__"
_NO_DEFAULT = object()  # Motif's code has no usable default (derived, or read only through another field)

# config.json field -> (the default Motif's code uses when it is missing, where Motif reads it).
MOTIF_FIELDS: dict[str, tuple[object, str]] = {
    "vocab_size": (151936, _CFG),
    "hidden_size": (4096, _CFG),
    "intermediate_size": (22016, _CFG + "; motif.py MotifDecoderLayer (dense MLP)"),
    "num_hidden_layers": (32, _CFG + "; motif.py MotifModel make_layers, motif_mtp.py mtp_start_layer_idx"),
    "num_attention_heads": (32, _CFG + "; motif.py MotifGDLAttention"),
    "num_key_value_heads": (32, _CFG + "; motif.py MotifGDLAttention"),
    "hidden_act": ("silu", _CFG + "; motif.py MotifMLP (poly_norm -> PolyNormTorch)"),
    "max_position_embeddings": (32768, _CFG + "; motif.py MotifGDLAttention mscale condition and get_rope"),
    "initializer_range": (0.02, _CFG + " (stored only)"),
    "rms_norm_eps": (1e-6, _CFG + "; motif.py RMSNorm(..., eps=config.rms_norm_eps) everywhere but mHC"),
    "tie_word_embeddings": (False, _CFG + " (PretrainedConfig)"),
    "rope_theta": (1000000.0, _CFG + "; motif.py MotifGDLAttention rope_params"),
    "rope_scaling": (None, _CFG + "; motif.py MotifGDLAttention `getattr(config, 'rope_scaling', None) or {}`"),
    "use_sliding_window": (False, _CFG + "; motif.py MotifGDLAttention `if config.use_sliding_window and ...`"),
    "sliding_window": (4096, _CFG + " (None unless use_sliding_window); motif.py `swa_window = sliding_window + 1`"),
    "sliding_window_pattern": ("interleave", _CFG + "; motif.py MotifGDLAttention"),
    "sliding_window_period": (2, _CFG + "; motif.py MotifGDLAttention `layer_idx % period != 0`"),
    "head_dim": (_NO_DEFAULT, _CFG + " (None -> hidden_size // num_attention_heads in MotifGDLAttention)"),
    "num_noise_heads": (0, _CFG + "; motif.py MotifGDLAttention"),
    "num_experts": (0, _CFG + "; motif.py MotifMoEFused"),
    "experts_top_k": (2, _CFG + "; motif.py MotifMoEFused `top_k=config.experts_top_k`"),
    "num_shared_experts": (0, _CFG + "; motif.py MotifMoEFused"),
    "interleave_moe_layer_step": (0, _CFG + "; motif.py MotifDecoderLayer moe_enabled"),
    "moe_intermediate_size": (_NO_DEFAULT, _CFG + " (None -> intermediate_size); motif.py MotifMoEFused"),
    "score_func": ("softmax", _CFG + "; motif.py MotifMoEFused `scoring_func=config.score_func`"),
    "route_norm": (False, _CFG + "; motif.py MotifMoEFused `renormalize=config.route_norm`"),
    "route_scale": (1.0, _CFG + "; motif.py MotifMoEFused `routed_scaling_factor=config.route_scale`"),
    "load_balance_coeff": (None, _CFG + "; motif.py MotifMoEFused (None: no e_score_correction_bias)"),
    "score_before_experts": (False, _CFG + " (motif.py serves apply_router_weight_on_input=False)"),
    "router_aux_loss_coef": (0.0, _CFG + " (training only)"),
    "n_dense_first_layers": (0, _CFG + "; motif.py MotifDecoderLayer moe_enabled"),
    "polynorm_output_scale": (1.0, _CFG + "; motif.py MotifDecoderLayer `getattr(config, 'polynorm_output_scale', 1.0)`"),
    "polynorm_output_scale_per_layer": ({}, _CFG + "; motif.py MotifDecoderLayer `_pn_per_layer.get(str(layer_idx))`"),
    "polynorm_bias_clamp": (None, _CFG + "; motif.py MotifMoEFused bias_clamp, _load_fused_moe_expert_weight clamp_"),
    "hidden_clamp": (1000, "motif.py MotifMoEFused `getattr(config, 'hidden_clamp', 1000)` (routed + shared only)"),
    "polynorm_sigmoid_weight": (True, "motif.py MotifMoEFused / MotifDecoderLayer `getattr(..., True)`"),
    "swa_rope_theta": (None, "motif.py MotifGDLAttention `getattr(config, 'swa_rope_theta', None)`"),
    "mhc_enabled": (False, _CFG + "; motif.py MotifDecoderLayer / MotifModel"),
    "mhc_expansion_rate": (4, _CFG + "; motif.py MotifDecoderLayer MotifMHCLayer(expansion_rate=...)"),
    "mhc_identity_init": (False, _CFG + " (init only)"),
    "mhc_sinkhorn_iters": (20, _CFG + "; motif.py MotifMHCLayer(sinkhorn_iters=...)"),
    "mhc_h_post_alpha_end": (0.0, "motif.py MotifDecoderLayer `1.0 + getattr(config, 'mhc_h_post_alpha_end', 0.0)`"),
    "diff_v2": (_NO_DEFAULT, _CFG + " (default False; not read by the Motif-3 model code)"),
    "attention_cls": (_NO_DEFAULT, _CFG + " (default basic; not read by the Motif-3 model code)"),
    "q_lora_rank": (0, _CFG + "; motif.py MotifGDLAttention"),
    "kv_lora_rank": (0, _CFG + "; motif.py MotifGDLAttention"),
    "qk_rope_head_dim": (_NO_DEFAULT, _CFG + " (None -> head_dim // 2); motif.py MotifGDLAttention"),
    "v_head_dim": (_NO_DEFAULT, _CFG + " (None -> head_dim); motif.py MotifGDLAttention"),
    "original_seq_len": (32768, "motif.py MotifGDLAttention `getattr(config, 'original_seq_len', 32768)`"),
    "rope_factor": (1.0, "motif.py MotifGDLAttention `getattr(config, 'rope_factor', 1.0)` (mscale^2 only)"),
    "mscale": (1.0, "motif.py MotifGDLAttention `getattr(config, 'mscale', 1.0)`"),
    "headwise_attn_output_gate": (_NO_DEFAULT, _CFG + " (default False; not read by the Motif-3 model code)"),
    "elementwise_attn_output_gate": (False, _CFG + "; motif.py MotifGDLAttention q_b_gate"),
    "num_nextn_predict_layers": (0, _CFG + "; motif_mtp.py MotifMultiTokenPredictor"),
}  # fmt: skip

# rope_scaling keys (vLLM get_rope, type "yarn": rotary_embedding/__init__.py + yarn_scaling_rope.py).
_ROPE_SCALING_TO_OURS = {
    "factor": "rope_factor",
    "original_max_position_embeddings": "original_seq_len",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
}
_ROPE_SCALING_FIXED = {"apply_yarn_scaling": False, "extrapolation_factor": 1, "attn_factor": 1, "truncate": True}
_ROPE_SCALING_UNREAD = {"type", "rope_type", "mscale", "mscale_all_dim"}  # not used by vLLM's "yarn" type
_VLLM_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "apply_yarn_scaling": True}

# Fields with one supported value (checked when present).
_FIXED = {
    "use_sliding_window": True,
    "sliding_window_pattern": "interleave",
    "diff_v2": True,
    "headwise_attn_output_gate": False,
}
# Known fields that carry nothing for our model (HF bookkeeping, MotifConfig fields the model never reads).
_IGNORED = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "auto_map", "_name_or_path",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "attention_dropout", "attention_bias",
    "k_ratio", "max_window_layers", "_debug_force_load_balance", "output_router_logits", "qk_nope_head_dim",
}  # fmt: skip
_OPTIONAL_FLOATS = {"hidden_clamp", "polynorm_bias_clamp"}  # None = no clamp

_reported_unknown: set[tuple[str, ...]] = set()


def _our_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(Motif3ModelArgs) if f.name != "max_seq_len"]


def hf_config_from_args(args: Motif3ModelArgs) -> dict:
    """The config.json dict for `args`, as Motif's vLLM reads it."""
    cfg: dict = {"architectures": [HF_ARCHITECTURE], "model_type": HF_MODEL_TYPE}
    for name in _our_fields():
        cfg[name] = getattr(args, name)
    cfg["max_position_embeddings"] = args.max_seq_len
    cfg.update(_FIXED)
    cfg["rope_scaling"] = (
        {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": args.rope_factor,
            "original_max_position_embeddings": args.original_seq_len,
            "beta_fast": args.beta_fast,
            "beta_slow": args.beta_slow,
            "apply_yarn_scaling": False,
        }
        if args.yarn_active
        else None
    )
    return cfg


def _same_value(base, ours) -> bool:
    if isinstance(base, dict) and isinstance(ours, dict):
        return all(k in base and _same_value(base[k], v) for k, v in ours.items())
    if isinstance(base, bool) or isinstance(ours, bool):
        return base is ours
    return base == ours


def merge_into_base(args: Motif3ModelArgs, base: dict | None) -> dict:
    """The config.json for `args` written over a base config.json (the one a run started from): the base is
    kept as it is when it already reads back as `args`; otherwise only the fields whose value differs are
    replaced, and missing fields added where their (Motif) default is not what `args` needs. Unknown base
    fields are always kept; `_name_or_path` (where the base came from) is dropped."""
    if not base:
        return hf_config_from_args(args)
    merged = {k: v for k, v in base.items() if k != "_name_or_path"}
    try:
        if args_from_hf_config(merged) == args:
            return merged
    except ValueError:
        pass  # e.g. the run changed max_seq_len, so the base's rope fields no longer agree with each other
    ours = hf_config_from_args(args)
    for key, value in ours.items():  # replace the base fields whose value differs
        if key in merged and key not in ("architectures", "model_type") and not _same_value(merged[key], value):
            merged[key] = value
    try:
        back = args_from_hf_config(merged)
    except ValueError:
        back = None
    for name in (f.name for f in dataclasses.fields(args)):  # add the missing fields that are still needed
        key = "max_position_embeddings" if name == "max_seq_len" else name
        if key not in merged and (back is None or getattr(back, name) != getattr(args, name)):
            merged[key] = ours[key]
    back = args_from_hf_config(merged)
    if back != args:  # a kept base field changes the meaning: a bug in this module, not the user's input
        diff = [f.name for f in dataclasses.fields(args) if getattr(back, f.name) != getattr(args, f.name)]
        raise AssertionError(f"merge_into_base: the merged config.json reads back differently in {diff}")
    return merged


def _check_type(name: str, value, want: type):
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if name in _OPTIONAL_FLOATS and value is None:
        return None
    if not isinstance(value, want) or (want in (int, float) and isinstance(value, bool)):
        raise ValueError(f"config.json field {name!r} must be {want.__name__}, got {type(value).__name__} {value!r}")
    return value


def args_from_hf_config(config: dict) -> Motif3ModelArgs:
    """Motif3ModelArgs from a config.json dict, read as Motif's vLLM reads it (missing fields take Motif's
    defaults, see MOTIF_FIELDS). Unknown fields are reported once (one warning per distinct set) and left
    out; a wrong type, an inconsistent shape or a meaning our model cannot reproduce raises ValueError
    naming the field."""
    defaults = Motif3ModelArgs()
    types = {f.name: type(getattr(defaults, f.name)) for f in dataclasses.fields(Motif3ModelArgs)}
    types.update({n: float for n in _OPTIONAL_FLOATS})

    def get(name: str):
        """The value Motif's code sees for `name` (config.json, else Motif's default); _NO_DEFAULT if none."""
        if name in config:
            return config[name]
        return MOTIF_FIELDS[name][0] if name in MOTIF_FIELDS else _NO_DEFAULT

    values: dict = {}
    for name in _our_fields():
        value = get(name)
        if value is not _NO_DEFAULT and value is not None or name in _OPTIONAL_FLOATS and value is None:
            values[name] = _check_type(name, value, types[name])
    values["max_seq_len"] = _check_type("max_position_embeddings", get("max_position_embeddings"), int)

    # derived dims (MotifConfig.__init__ / MotifGDLAttention)
    if "head_dim" not in values:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    values.setdefault("qk_rope_head_dim", values["head_dim"] // 2)
    values.setdefault("v_head_dim", values["head_dim"])
    values.setdefault("moe_intermediate_size", values["intermediate_size"])

    for key, want in _FIXED.items():
        # diff_v2 / headwise_attn_output_gate are not read by Motif's Motif-3 code: checked only when present
        read_by_motif = key in ("use_sliding_window", "sliding_window_pattern")
        have = get(key) if read_by_motif else config.get(key, want)
        if have != want:
            missing = f"; Motif's vLLM reads a missing field as {MOTIF_FIELDS[key][0]!r}" if read_by_motif else ""
            raise ValueError(
                f"config.json field {key!r} = {have!r} is not supported (this model implements {key} = {want!r}{missing})"
            )
    if values.get("score_before_experts"):
        raise ValueError(
            "config.json field 'score_before_experts' = true is not supported: Motif's vLLM always applies the "
            "routing weights to the expert outputs (apply_router_weight_on_input=False)"
        )
    if get("load_balance_coeff") is None:
        raise ValueError(
            "config.json field 'load_balance_coeff' is null or missing: Motif's vLLM then drops moe.expert_bias "
            "(routing without it), which this model cannot reproduce; set it to the expert-bias update speed"
        )
    scales = values.get("polynorm_output_scale_per_layer", {})
    values["polynorm_output_scale_per_layer"] = {str(k): _check_type(f"polynorm_output_scale_per_layer.{k}", v, float)
                                                 for k, v in scales.items()}  # fmt: skip
    values.setdefault("mhc_h_post_alpha_start", values.get("mhc_h_post_alpha_end", 0.0))

    unknown = sorted(k for k in config if k not in MOTIF_FIELDS and k not in values and k not in _IGNORED
                     and k not in types)  # fmt: skip
    unknown += _read_rope(config, values)
    if unknown and tuple(unknown) not in _reported_unknown:
        _reported_unknown.add(tuple(unknown))
        logger.warning(
            "config.json: fields unknown to Motif3ModelArgs (unused; kept by an export that starts from this config.json): %s",
            ", ".join(unknown),
        )
    args = Motif3ModelArgs(**values)
    args.validate()
    return args


def _read_rope(config: dict, values: dict) -> list[str]:
    """Check the RoPE fields against what our model can reproduce, fill `swa_rope_theta` when missing;
    returns the unknown rope_scaling keys."""
    rope_scaling = config.get("rope_scaling")
    yarn_softmax = values["max_seq_len"] > values["original_seq_len"] and values["rope_factor"] > 1.0
    unknown: list[str] = []
    if rope_scaling is None:
        if yarn_softmax:
            raise ValueError(
                "config.json: max_position_embeddings > original_seq_len with rope_factor > 1 but no rope_scaling: "
                "Motif's vLLM then scales the softmax by mscale^2 without YaRN frequencies, which this model "
                "cannot reproduce; add rope_scaling {type: yarn, apply_yarn_scaling: false, ...}"
            )
    else:
        if not isinstance(rope_scaling, dict):
            raise ValueError(f"config.json field 'rope_scaling' must be an object or null, got {rope_scaling!r}")
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if rope_type != "yarn" or rope_scaling.get("type", "yarn") != "yarn":
            raise ValueError(f"config.json field 'rope_scaling.type' must be 'yarn', got {rope_type!r}")
        for key, ours in _ROPE_SCALING_TO_OURS.items():
            have = rope_scaling.get(key, _VLLM_YARN_DEFAULTS.get(key))
            if key in ("beta_fast", "beta_slow") and key not in config:
                values[ours] = _check_type(f"rope_scaling.{key}", have, float)
            elif have is None or not math.isclose(float(have), float(values[ours]), rel_tol=0, abs_tol=0):
                raise ValueError(
                    f"config.json: rope_scaling.{key} = {have!r} differs from the top-level {ours} = {values[ours]!r} "
                    f"(Motif's vLLM uses rope_scaling for the frequencies and the top-level field for the softmax "
                    f"mscale); make them equal"
                )
        for key, want in _ROPE_SCALING_FIXED.items():
            have = rope_scaling.get(key, _VLLM_YARN_DEFAULTS.get(key, want))
            if have != want:
                raise ValueError(
                    f"config.json field 'rope_scaling.{key}' = {have!r} is not supported (this model implements "
                    f"{want!r}; apply_yarn_scaling true or missing makes vLLM scale cos/sin by 0.1 ln(factor) + 1)"
                )
        unknown = [f"rope_scaling.{k}" for k in rope_scaling
                   if k not in _ROPE_SCALING_TO_OURS and k not in _ROPE_SCALING_FIXED and k not in _ROPE_SCALING_UNREAD]  # fmt: skip
        if values["rope_factor"] > 1.0 and not yarn_softmax:
            raise ValueError(
                "config.json: rope_scaling is YaRN but max_position_embeddings <= original_seq_len: Motif's vLLM "
                "then interpolates frequencies without the softmax mscale^2, which this model cannot reproduce; "
                "drop rope_scaling (YaRN inactive) or raise max_position_embeddings"
            )
    if config.get("swa_rope_theta") is None:
        if rope_scaling is not None and values["rope_factor"] > 1.0:
            raise ValueError(
                "config.json: swa_rope_theta is missing, so Motif's vLLM gives sliding layers the YaRN RoPE of the "
                "full layers, which this model cannot reproduce; set swa_rope_theta"
            )
        values["swa_rope_theta"] = values["rope_theta"]  # sliding layers use the (plain) full-layer RoPE
    return unknown
