"""Checkpoint conversion CLI: `python -m llm_training.convert {hf-to-dcp,dcp-to-hf} SRC DST [options]`.

  hf-to-dcp SRC_HF_DIR DST_DCP_DIR
      HF safetensors (+ config.json) -> a DCP directory holding `model.*` (our keys, our RoPE layout) and the
      source's config.json (with its path), loadable with `[checkpoint] initial_load_path = DST,
      initial_load_format = "dcp"`.
  dcp-to-hf SRC_DCP_DIR DST_HF_DIR [--dtype bfloat16|float32] [--flavor NAME]
      A DCP checkpoint of ours (a training `step-N/` dir, or an hf-to-dcp output) -> HF safetensors shards +
      index + config.json. The model is built from the config stored in the checkpoint (or --flavor). When
      that config came from an HF directory (a run started from it, or hf-to-dcp), config.json starts from it
      (unknown fields kept) and the directory's other files (tokenizer, generation config, remote code) are
      copied, if it still exists.
Runs in one CPU process (no torch.distributed needed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def _stored_hf_config(dcp_dir: Path) -> dict:
    """The config.json dict saved in a DCP checkpoint's `train_state.model_config_json` (a run's
    `state_dict_adapter.run_hf_config`: for a run started from an HF directory, that directory's config)."""
    from llm_training.trainer.checkpoint import safe_dcp_load

    state = {"train_state": {"model_config_json": ""}}
    try:
        safe_dcp_load(state, dcp_dir)
    except Exception as e:  # missing key, or not a DCP dir
        raise ValueError(
            f"{dcp_dir}: cannot read train_state.model_config_json ({type(e).__name__}: {e}); "
            "pass --flavor NAME to say which model the checkpoint holds"
        ) from None
    return json.loads(state["train_state"]["model_config_json"])


def hf_to_dcp(src: Path, dst: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from llm_training.motif.model import Motif3Model
    from llm_training.motif.state_dict_adapter import (
        check_state_dict_matches,
        read_hf_config,
        read_hf_state_dict,
        run_hf_config,
    )

    args = read_hf_config(src)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Motif3Model(args).state_dict().items()}
    state = read_hf_state_dict(src, args)
    check_state_dict_matches(state, expected, f"HF checkpoint {src}")
    dcp.save(
        {"model": state, "train_state": {"model_config_json": json.dumps(run_hf_config(args, str(src), "hf"))}},
        checkpoint_id=str(dst),
        no_dist=True,
    )


def dcp_to_hf(src: Path, dst: Path, dtype: str, flavor: str | None) -> None:
    from llm_training.motif import get_flavor
    from llm_training.motif.model import Motif3Model
    from llm_training.motif.state_dict_adapter import args_from_hf_config, export_hf_checkpoint
    from llm_training.trainer.checkpoint import load_model_weights_dcp

    base_config = None if flavor else _stored_hf_config(src)
    args = get_flavor(flavor) if flavor else args_from_hf_config(base_config)
    with torch.device("meta"):
        model = Motif3Model(args)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))  # every entry is then overwritten by the load
    load_model_weights_dcp(model, src)
    export_hf_checkpoint(model, dst, dtype=getattr(torch, dtype), base_config=base_config)


def main(argv: list[str] | None = None) -> int:
    from llm_training.config.job_config import DTYPE_NAMES

    parser = argparse.ArgumentParser(prog="python -m llm_training.convert", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("hf-to-dcp", help="HuggingFace safetensors dir -> DCP dir")
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p = sub.add_parser("dcp-to-hf", help="DCP checkpoint dir -> HuggingFace safetensors dir")
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16", help="dtype of non-fp32 tensors")
    p.add_argument("--flavor", default=None, help="model flavor, when the checkpoint has no stored config")
    ns = parser.parse_args(argv)
    if not ns.src.exists():
        parser.error(f"{ns.src} does not exist")
    try:
        if ns.command == "hf-to-dcp":
            hf_to_dcp(ns.src, ns.dst)
        else:
            dcp_to_hf(ns.src, ns.dst, ns.dtype, ns.flavor)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"convert error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {ns.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
