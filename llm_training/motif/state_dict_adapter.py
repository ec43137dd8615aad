"""HuggingFace import/export for Motif-3 in the layout Motif's own vLLM port reads (docs/model-spec.md §0.2):
config.json <-> Motif3ModelArgs (`hf_config`), our state-dict keys <-> HF safetensors keys, and the RoPE
row permutation between our interleaved layout and HF's half-split one.

Public API (stable):
  args_from_hf_config(config: dict) -> Motif3ModelArgs
  hf_config_from_args(args) -> dict
  load_hf_checkpoint(model, path)                      # into a built Motif3Model(args), any dtype
  export_hf_checkpoint(model, path, dtype=torch.bfloat16, base_config=None, max_shard_bytes=...)

Key mapping (docs/CONTRACTS.md): HF keys are ours with a `model.` prefix, except `lm_head.*`; the mHC
RMSNorm gain `mhc_{attn,ffn}.norm.weight` is `mhc_{attn,ffn}.rms_norm.weight` on the HF side, and the mHC
gains `alpha_{pre,post,res}` (0-d here) are stored with shape [1].
RoPE: our weights rotate interleaved pairs (2j, 2j+1); HF stores the rope rows half-split (j, j + d/2).
The rope rows are the last `qk_rope_head_dim` rows of every head block of `self_attn.wq_b.weight` and
the last `qk_rope_head_dim` rows of `self_attn.wkv_a.weight` (main layers and MTP layers alike).

Dtypes on export: tensors matching FP32_KEY_PATTERNS (router gate, expert_bias, PolyNorm act_fn, mHC)
stay fp32; everything else is cast to the export dtype. Values are written as stored: the routed-expert
PolyNorm bias is clamped by the forward (ours, and Motif's vLLM at load time), not by the export, so an
HF -> DCP -> HF round trip is exact.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch

from llm_training.motif.args import Motif3ModelArgs
from llm_training.motif.hf_config import args_from_hf_config, hf_config_from_args, merge_into_base

logger = logging.getLogger(__name__)

# Substrings of parameter/buffer names that are kept in fp32 (in the model under mixed precision and in
# exported checkpoints). One definition, used by the parallelizer too.
FP32_KEY_PATTERNS = (".moe.router.gate.", ".moe.expert_bias", ".act_fn.", ".mhc_attn.", ".mhc_ffn.")

SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_SAFETENSORS = "model.safetensors"
SOURCE_DIR_KEY = "_name_or_path"  # HF's own field for where a config came from; set in a run's stored config


def is_fp32_key(key: str) -> bool:
    """True for the parameters/buffers that stay fp32 (our FQN or HF key)."""
    k = "." + key
    return any(p in k for p in FP32_KEY_PATTERNS)


# ---------------------------------------------------------------------------------------- config
def read_hf_config_dict(path: str | os.PathLike) -> dict:
    """`<path>/config.json` as a dict (errors name the file)."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no config.json in HF checkpoint directory {path}")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None


def read_hf_config(path: str | os.PathLike) -> Motif3ModelArgs:
    """Args from `<path>/config.json` (errors name the file)."""
    try:
        return args_from_hf_config(read_hf_config_dict(path))
    except ValueError as e:
        raise ValueError(f"{Path(path) / 'config.json'}: {e}") from None


def run_hf_config(args: Motif3ModelArgs, initial_load_path: str = "", initial_load_format: str = "hf") -> dict:
    """The config.json a run records in its checkpoints (`train_state.model_config_json`), from which
    `python -m llm_training.convert dcp-to-hf` exports: for a run that starts from an HF directory, that
    directory's config.json with `args` written over it (`merge_into_base`: unknown fields kept) plus
    `_name_or_path` = the directory, whose other files (tokenizer, generation config, remote code) export
    carries; otherwise `hf_config_from_args(args)`."""
    if not (initial_load_path and initial_load_format == "hf"):
        return hf_config_from_args(args)
    source = Path(initial_load_path).resolve()
    if not (source / "config.json").is_file():  # e.g. resuming after the source directory was removed
        logger.warning("%s has no config.json: the run's export starts from a fresh config.json", source)
        return hf_config_from_args(args)
    return merge_into_base(args, read_hf_config_dict(source)) | {SOURCE_DIR_KEY: str(source)}


# ------------------------------------------------------------------------------- key + rope mapping
_MHC_NORM = re.compile(r"\.(mhc_attn|mhc_ffn)\.norm\.weight$")  # ours
_MHC_RMS_NORM = re.compile(r"\.(mhc_attn|mhc_ffn)\.rms_norm\.weight$")  # Motif's
_MHC_ALPHA = re.compile(r"\.(mhc_attn|mhc_ffn)\.alpha_(pre|post|res)$")


def to_hf_key(key: str) -> str:
    if key.startswith("lm_head."):
        return key
    return "model." + _MHC_NORM.sub(r".\1.rms_norm.weight", "." + key)[1:]


def from_hf_key(key: str) -> str:
    """Our key for an HF tensor name; KeyError (naming it) for a name that is not in Motif's layout."""
    if key.startswith("lm_head."):
        return key
    if not key.startswith("model."):
        raise KeyError(f"HF tensor {key!r}: expected a 'model.' prefix (or 'lm_head.')")
    if _MHC_NORM.search(key):
        raise KeyError(
            f"HF tensor {key!r}: Motif's layout names the mHC RMSNorm gain '.rms_norm.weight' (a checkpoint "
            "exported by llm_training before it followed Motif's layout; re-export it from its DCP checkpoint)"
        )
    return _MHC_RMS_NORM.sub(r".\1.norm.weight", key[len("model.") :])


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
    """Our tensor `key` in HF layout (rope rows half-split, mHC alphas [1])."""
    if _MHC_ALPHA.search("." + key):
        return w.reshape(1)
    return _permute_rope_rows(key, w, args, interleaved_to_half_split(args.qk_rope_head_dim))


def from_hf_tensor(key: str, w: torch.Tensor, args: Motif3ModelArgs) -> torch.Tensor:
    """The HF tensor for our `key` in our layout; an mHC alpha must have shape [1] (ValueError otherwise)."""
    if _MHC_ALPHA.search("." + key):
        if tuple(w.shape) != (1,):
            raise ValueError(
                f"HF tensor {to_hf_key(key)!r}: expected shape [1] (Motif's layout), found {list(w.shape)}"
            )
        return w.reshape(())
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
    """All tensors of a HF checkpoint, under OUR keys and in our layout (CPU, stored dtype). Names or
    shapes that are not Motif's layout raise one ValueError listing them."""
    from safetensors import safe_open

    path = Path(path)
    by_file: dict[Path, list[str]] = {}
    for hf_key, file in _hf_tensor_files(path).items():
        by_file.setdefault(file, []).append(hf_key)
    out: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    for file, keys in by_file.items():
        if not file.is_file():
            raise FileNotFoundError(f"{path}: shard {file.name} listed in the index is missing")
        with safe_open(str(file), framework="pt") as f:
            for hf_key in keys:
                try:
                    key = from_hf_key(hf_key)
                    out[key] = from_hf_tensor(key, f.get_tensor(hf_key), args)
                except (KeyError, ValueError) as e:
                    problems.append(str(e.args[0]))
    if problems:
        raise ValueError(f"HF checkpoint {path} is not in Motif's layout: " + "; ".join(problems[:20]))
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
    model's dtypes. The checkpoint's config.json must describe the same architecture as `model.args`.

    The loaded weights are a finished mHC schedule: the model continues with the h_post coefficient
    1 + the checkpoint's `mhc_h_post_alpha_end` (what Motif's vLLM serves), i.e. `model.args` gets
    start = end = that value and `set_mhc_progress` keeps it there."""
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
    end = ckpt_args.mhc_h_post_alpha_end
    model.args = args.replace(mhc_h_post_alpha_start=end, mhc_h_post_alpha_end=end)
    model.set_mhc_progress(0.0)


def full_model_state_dict(model) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict (collective under FSDP2: every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# Files of a source HF directory that export does not carry over: the weights and config.json it rewrites.
_NOT_CARRIED = re.compile(r"(\.safetensors|\.safetensors\.index\.json|\.bin|\.bin\.index\.json|\.pt|\.pth)$")


def carry_source_files(source: Path, dst: Path) -> list[str]:
    """Copy the top-level files of a source HF directory (tokenizer, generation config, remote-code *.py,
    README, ...) to `dst`, except weights and config.json. Returns the names copied."""
    copied = []
    for f in sorted(source.iterdir()):
        if f.is_file() and f.name != "config.json" and not _NOT_CARRIED.search(f.name):
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied


def export_hf_state_dict(
    state: dict[str, torch.Tensor],
    args: Motif3ModelArgs,
    path: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 5 * 2**30,
    base_config: dict | None = None,
) -> None:
    """Write `state` (our keys, full tensors) as HF safetensors shards + index json + config.json.

    `base_config`: the config.json to start from (a run's stored config, see `run_hf_config`); its fields
    are kept except where `args` needs another value, and when it names a source directory
    (`_name_or_path`) that still exists, that directory's other files are copied too."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf: dict[str, torch.Tensor] = {}
    for key, w in state.items():
        w = w.detach().cpu()
        w = w.float() if is_fp32_key(key) else w.to(dtype)
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
    for name, value in (("mhc_eps", args.mhc_eps), ("polynorm_eps", args.polynorm_eps)):
        if value != 1e-6:
            logger.warning(
                "export: %s = %g, but Motif's vLLM hard-codes 1e-6 for it; served logits will differ", name, value
            )
    config = merge_into_base(args, base_config) | {"torch_dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    source = Path(base_config[SOURCE_DIR_KEY]) if base_config and base_config.get(SOURCE_DIR_KEY) else None
    if source is not None:
        if source.is_dir() and source.resolve() != path.resolve():
            logger.info("export: carried from %s: %s", source, ", ".join(carry_source_files(source, path)) or "nothing")
        elif not source.is_dir():
            logger.warning(
                "export: the run's source HF directory %s is gone; its tokenizer etc. were not copied", source
            )


def export_hf_checkpoint(
    model, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, base_config: dict | None = None, **kw
) -> None:
    """Export `model` (plain or FSDP2) as a HF checkpoint dir. Collective under FSDP2; rank 0 writes.
    `base_config`: see `export_hf_state_dict`."""
    import torch.distributed as dist

    state = full_model_state_dict(model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        export_hf_state_dict(state, _model_args(model), path, dtype, base_config=base_config, **kw)
    if dist.is_initialized():
        dist.barrier()
