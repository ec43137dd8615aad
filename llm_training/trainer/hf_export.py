"""HuggingFace export during training (`[checkpoint] export_hf_every`): the model of chosen checkpoint steps, and of
the last step, written as `<run folder>/hf/step-<N>/` (safetensors shards + index + config.json, the layout of
`python -m llm_training.convert dcp-to-hf`).

Collective: every rank gathers the full tensors (FSDP2 shards included) through the family's
`state_dict_adapter.export_hf_checkpoint`; rank 0 writes into `step-<N>.tmp-<id>/` and renames it to `step-<N>/`
once complete, so a folder named `step-<N>` is always a whole export. Leftover `.tmp-` folders of an interrupted
export are removed by the next export.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from llm_training.distributed.utils import rank

logger = logging.getLogger(__name__)

HF_EXPORT_FOLDER = "hf"  # under the run folder
_TMP_DIR = re.compile(r"^step-\d+\.tmp-")


def hf_export_due(step: int, last_step: int, checkpoint_interval: int, export_every: int) -> bool:
    """Whether the checkpoint of `step` is also exported: every `export_every`-th checkpoint interval, and the last
    step of the run (never when `export_every` is 0)."""
    return export_every > 0 and (step == last_step or step % (checkpoint_interval * export_every) == 0)


def export_hf_snapshot(spec, model, run_folder: Path, step: int, dtype: str, model_config_json: str) -> Path:
    """Export `model` as `<run_folder>/hf/step-<step>/` in `dtype` (a torch dtype name) with the run's stored HF
    config (`train_state.model_config_json`) as the base of config.json; returns the folder. Collective: call on
    every rank. An existing `step-<step>` folder is kept (a resumed run reaching the step again)."""
    root = Path(run_folder) / HF_EXPORT_FOLDER
    final = root / f"step-{step}"
    exists = [final.is_dir()]
    if dist.is_initialized():  # rank 0's file system decides: every rank must take the same path
        dist.broadcast_object_list(exists, src=0)
    if exists[0]:
        logger.info("HF export %s already exists; not exporting it again", final)
        return final
    tmp = root / f"step-{step}.tmp-{uuid.uuid4().hex[:12]}"  # only rank 0 writes: the name need not be shared
    if rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.iterdir():
            if _TMP_DIR.match(leftover.name):
                shutil.rmtree(leftover, ignore_errors=True)
    spec.state_dict_adapter.export_hf_checkpoint(
        model, tmp, dtype=getattr(torch, dtype), base_config=json.loads(model_config_json)
    )
    if rank() == 0:
        tmp.rename(final)
        logger.info("exported step %d as a HuggingFace checkpoint: %s", step, final)
    if dist.is_initialized():
        dist.barrier()
    return final
