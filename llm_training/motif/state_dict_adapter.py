"""HuggingFace import/export for Motif-3: config.json <-> Motif3ModelArgs, our state-dict keys <-> HF
safetensors keys, and the RoPE row permutation between our interleaved layout and HF's half-split one.

Public API (stable):
  args_from_hf_config(config: dict) -> Motif3ModelArgs
  hf_config_from_args(args) -> dict
  load_hf_checkpoint(model, path)                      # into a built Motif3Model(args), any dtype
  export_hf_checkpoint(model, path, dtype=torch.bfloat16, max_shard_bytes=...)

Key mapping (docs/CONTRACTS.md): HF keys are ours with a `model.` prefix, except `lm_head.*`.
RoPE: our weights rotate interleaved pairs (2j, 2j+1); HF stores the rope rows half-split (j, j + d/2).
The rope rows are the last `qk_rope_head_dim` rows of every head block of `self_attn.wq_b.weight` and
the last `qk_rope_head_dim` rows of `self_attn.wkv_a.weight` (main layers and MTP layers alike).

Dtypes on export: tensors matching FP32_KEY_PATTERNS (router gate, expert_bias, PolyNorm act_fn, mHC)
stay fp32; everything else is cast to the export dtype.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path

import torch

from llm_training.motif.args import Motif3ModelArgs

logger = logging.getLogger(__name__)

# Substrings of parameter/buffer names that are kept in fp32 (in the model under mixed precision and in
# exported checkpoints). One definition, used by the parallelizer too.
FP32_KEY_PATTERNS = (".moe.router.gate.", ".moe.expert_bias", ".act_fn.", ".mhc_attn.", ".mhc_ffn.")

HF_ARCHITECTURE = "Motif3ForCausalLM"
HF_MODEL_TYPE = "motif3"
SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_SAFETENSORS = "model.safetensors"

# Our Motif3ModelArgs fields that are NOT written 1:1 under their own name.
_ROPE_SCALING_FIELDS = {  # rope_scaling key -> our field
    "factor": "rope_factor",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "mscale": "mscale",
    "original_max_position_embeddings": "original_seq_len",
}
_RENAMED = {"max_position_embeddings": "max_seq_len"}  # HF name -> our field
# HF fields we understand but that carry no information for our model; the value is checked when fixed.
_FIXED_HF_FIELDS = {"diff_v2": True, "headwise_attn_output_gate": False, "sliding_window_pattern": "interleave"}
_IGNORED_HF_FIELDS = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "auto_map",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "attention_dropout", "attention_bias",
}  # fmt: skip


def is_fp32_key(key: str) -> bool:
    """True for the parameters/buffers that stay fp32 (our FQN or HF key)."""
    k = "." + key
    return any(p in k for p in FP32_KEY_PATTERNS)


# ---------------------------------------------------------------------------------------- config
def _our_direct_fields() -> list[str]:
    special = set(_ROPE_SCALING_FIELDS.values()) | set(_RENAMED.values())
    return [f.name for f in dataclasses.fields(Motif3ModelArgs) if f.name not in special]


def hf_config_from_args(args: Motif3ModelArgs) -> dict:
    """The config.json dict (model-spec §0.1 field names) for `args`."""
    cfg: dict = {"architectures": [HF_ARCHITECTURE], "model_type": HF_MODEL_TYPE}
    for name in _our_direct_fields():
        cfg[name] = getattr(args, name)
    for hf_name, ours in _RENAMED.items():
        cfg[hf_name] = getattr(args, ours)
    cfg["rope_scaling"] = {"type": "yarn"} | {k: getattr(args, v) for k, v in _ROPE_SCALING_FIELDS.items()}
    cfg.update(_FIXED_HF_FIELDS)
    return cfg


def args_from_hf_config(config: dict) -> Motif3ModelArgs:
    """Motif3ModelArgs from a config.json dict. Unknown fields are left out with one warning listing them;
    a field of the wrong type or an inconsistent shape raises ValueError naming the field."""
    defaults = Motif3ModelArgs()
    field_types = {f.name: type(getattr(defaults, f.name)) for f in dataclasses.fields(Motif3ModelArgs)}
    values: dict = {}
    unknown: list[str] = []

    def take(hf_name: str, ours: str, value) -> None:
        want = field_types[ours]
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ValueError(
                f"config.json field {hf_name!r} must be {want.__name__}, got {type(value).__name__} {value!r}"
            )
        values[ours] = value

    direct = set(_our_direct_fields())
    for key, value in config.items():
        if key in direct:
            take(key, key, value)
        elif key in _RENAMED:
            take(key, _RENAMED[key], value)
        elif key == "rope_scaling":
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ValueError(f"config.json field 'rope_scaling' must be an object, got {value!r}")
            rope_type = value.get("type", value.get("rope_type"))
            if rope_type != "yarn":
                raise ValueError(f"config.json field 'rope_scaling.type' must be 'yarn', got {rope_type!r}")
            for rk, rv in value.items():
                if rk in _ROPE_SCALING_FIELDS:
                    take(f"rope_scaling.{rk}", _ROPE_SCALING_FIELDS[rk], rv)
                elif rk not in ("type", "rope_type"):
                    unknown.append(f"rope_scaling.{rk}")
        elif key in _FIXED_HF_FIELDS:
            if value != _FIXED_HF_FIELDS[key]:
                raise ValueError(
                    f"config.json field {key!r} = {value!r} is not supported (this model implements "
                    f"{key} = {_FIXED_HF_FIELDS[key]!r})"
                )
        elif key not in _IGNORED_HF_FIELDS:
            unknown.append(key)
    if unknown:
        logger.warning("config.json: ignoring fields unknown to Motif3ModelArgs: %s", ", ".join(sorted(unknown)))
    args = Motif3ModelArgs(**values)
    args.validate()
    return args


def read_hf_config(path: str | os.PathLike) -> Motif3ModelArgs:
    """Args from `<path>/config.json` (errors name the file)."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no config.json in HF checkpoint directory {path}")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
    try:
        return args_from_hf_config(config)
    except ValueError as e:
        raise ValueError(f"{cfg_path}: {e}") from None


# ------------------------------------------------------------------------------- key + rope mapping
def to_hf_key(key: str) -> str:
    return key if key.startswith("lm_head.") else "model." + key


def from_hf_key(key: str) -> str:
    if key.startswith("lm_head."):
        return key
    if not key.startswith("model."):
        raise KeyError(f"HF tensor {key!r}: expected a 'model.' prefix (or 'lm_head.')")
    return key[len("model.") :]


def interleaved_to_half_split(d_rope: int) -> torch.Tensor:
    """Row index p with hf_rows = our_rows[p]: HF row j <- ours 2j, HF row d/2 + j <- ours 2j + 1."""
    return torch.cat([torch.arange(0, d_rope, 2), torch.arange(1, d_rope, 2)])


def half_split_to_interleaved(d_rope: int) -> torch.Tensor:
    """Inverse permutation of `interleaved_to_half_split`."""
    return torch.argsort(interleaved_to_half_split(d_rope))


_WQ_B = re.compile(r"(^|\.)self_attn\.wq_b\.weight$")
_WKV_A = re.compile(r"(^|\.)self_attn\.wkv_a\.weight$")


def _permute_rope_rows(key: str, w: torch.Tensor, args: Motif3ModelArgs, perm: torch.Tensor) -> torch.Tensor:
    """Apply `perm` to the rope rows of wq_b (per head) / wkv_a (tail); other tensors unchanged."""
    d_rope = args.qk_rope_head_dim
    if _WQ_B.search(key):
        heads = w.reshape(args.num_attention_heads, args.head_dim, -1)
        nope, rope = heads[:, : args.head_dim - d_rope], heads[:, args.head_dim - d_rope :]
        return torch.cat([nope, rope[:, perm]], dim=1).reshape(w.shape)
    if _WKV_A.search(key):
        return torch.cat([w[:-d_rope], w[-d_rope:][perm]], dim=0)
    return w


def to_hf_tensor(key: str, w: torch.Tensor, args: Motif3ModelArgs) -> torch.Tensor:
    return _permute_rope_rows(key, w, args, interleaved_to_half_split(args.qk_rope_head_dim))


def from_hf_tensor(key: str, w: torch.Tensor, args: Motif3ModelArgs) -> torch.Tensor:
    return _permute_rope_rows(key, w, args, half_split_to_interleaved(args.qk_rope_head_dim))


# ------------------------------------------------------------------------------------ load / export
def _model_args(model) -> Motif3ModelArgs:
    args = getattr(model, "args", None) or getattr(model, "model_args", None)
    if not isinstance(args, Motif3ModelArgs):
        raise TypeError("model has no Motif3ModelArgs at `model.args`; build it as Motif3Model(args)")
    return args


def _expected_shapes_dtypes(model) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Global shape and dtype of every persistent state entry (DTensor shapes are global)."""
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def _hf_tensor_files(path: Path) -> dict[str, Path]:
    """HF key -> safetensors file, from the index json or the single-file layout."""
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: missing 'weight_map'")
        return {k: path / f for k, f in weight_map.items()}
    single = path / SINGLE_SAFETENSORS
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(f"{path}: neither {SAFETENSORS_INDEX} nor {SINGLE_SAFETENSORS} found")


def read_hf_state_dict(path: str | os.PathLike, args: Motif3ModelArgs) -> dict[str, torch.Tensor]:
    """All tensors of a HF checkpoint, under OUR keys and in our rope layout (CPU, stored dtype)."""
    from safetensors import safe_open

    path = Path(path)
    by_file: dict[Path, list[str]] = {}
    for hf_key, file in _hf_tensor_files(path).items():
        by_file.setdefault(file, []).append(hf_key)
    out: dict[str, torch.Tensor] = {}
    for file, keys in by_file.items():
        if not file.is_file():
            raise FileNotFoundError(f"{path}: shard {file.name} listed in the index is missing")
        with safe_open(str(file), framework="pt") as f:
            for hf_key in keys:
                key = from_hf_key(hf_key)
                out[key] = from_hf_tensor(key, f.get_tensor(hf_key), args)
    return out


def check_state_dict_matches(found: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], where: str) -> None:
    """Raise ValueError listing missing / unexpected / misshaped tensors (expected vs found shape)."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    misshaped = [
        f"{k}: expected {list(expected[k])}, found {list(found[k].shape)}"
        for k in sorted(set(found) & set(expected))
        if tuple(found[k].shape) != expected[k]
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): " + ", ".join(to_hf_key(k) for k in missing[:20]))
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): " + ", ".join(to_hf_key(k) for k in unexpected[:20]))
    if misshaped:
        problems.append("wrong shapes: " + "; ".join(misshaped[:20]))
    if problems:
        raise ValueError(f"{where} does not match the model: " + " | ".join(problems))


def load_hf_checkpoint(model, path: str | os.PathLike) -> None:
    """Load a HF Motif-3 checkpoint directory into `model` (plain or FSDP2-sharded), casting to the
    model's dtypes. The checkpoint's config.json must describe the same architecture as `model.args`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    args = _model_args(model)
    ckpt_args = read_hf_config(path)
    diffs = [
        f"{f.name}: checkpoint {getattr(ckpt_args, f.name)!r} vs model {getattr(args, f.name)!r}"
        for f in dataclasses.fields(Motif3ModelArgs)
        if f.name not in ("max_seq_len", "initializer_range", "load_balance_coeff", "router_aux_loss_coef",
                          "mhc_h_post_alpha_start", "mhc_h_post_alpha_end", "lambda_init", "gate_init")
        and getattr(ckpt_args, f.name) != getattr(args, f.name)
    ]  # fmt: skip
    if diffs:
        raise ValueError(f"{path}/config.json describes a different architecture: " + "; ".join(diffs))
    state = read_hf_state_dict(path, args)
    expected = _expected_shapes_dtypes(model)
    check_state_dict_matches(state, {k: s for k, (s, _) in expected.items()}, f"HF checkpoint {path}")
    state = {k: v.to(expected[k][1]) for k, v in state.items()}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))


def full_model_state_dict(model) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict (collective under FSDP2: every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def export_hf_state_dict(
    state: dict[str, torch.Tensor],
    args: Motif3ModelArgs,
    path: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write `state` (our keys, full tensors) as HF safetensors shards + index json + config.json."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf: dict[str, torch.Tensor] = {}
    for key, w in state.items():
        w = w.detach().cpu()
        w = w.float() if is_fp32_key(key) else w.to(dtype)
        if key.endswith("moe.experts.act_fn.bias"):
            # Training clamps the routed-expert PolyNorm bias in the forward only (model-spec §1.1), so the
            # stored value can drift past the bound; export what the forward uses, for servers that don't clamp.
            w = w.clamp(-args.polynorm_bias_clamp, args.polynorm_bias_clamp)
        hf[to_hf_key(key)] = to_hf_tensor(key, w, args).contiguous()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(hf):
        nbytes = hf[k].numel() * hf[k].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = hf[k]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in hf.values())
    (path / SAFETENSORS_INDEX).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    config = hf_config_from_args(args) | {"torch_dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(config, indent=2))


def export_hf_checkpoint(model, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, **kw) -> None:
    """Export `model` (plain or FSDP2) as a HF checkpoint dir. Collective under FSDP2; rank 0 writes."""
    import torch.distributed as dist

    state = full_model_state_dict(model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        export_hf_state_dict(state, _model_args(model), path, dtype, **kw)
    if dist.is_initialized():
        dist.barrier()
