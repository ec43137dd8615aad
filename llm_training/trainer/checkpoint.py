"""Checkpointing with torch.distributed.checkpoint (DCP): atomic publish, resume, keep-last-N, async.

Layout under the checkpoint folder:
  step-<N>/                 a complete checkpoint (DCP files + `.complete` marker)
  step-<N>.tmp-<id>/        a save in progress (or one killed mid-way: ignored, cleaned at startup)

A save writes into `step-N.tmp-<id>/` (id shared by all ranks); once every rank has finished writing,
rank 0 writes the `.complete` marker into it and renames it to `step-N/` (an atomic rename on one
file system). A kill at any moment therefore leaves the previous `step-*` directory intact and the
resume scan (highest `step-N` holding the marker) never sees a partial save.

What goes into one checkpoint is a flat dict of components assembled by the trainer (model, optimizers,
LR scheduler, per-rank data loader + RNG blobs, train state); each is a `Stateful` (state_dict /
load_state_dict) or a plain value. Per-rank values are stored under per-rank keys (the torchtitan
design: `dataloader_dp_rank_<r>`), since DCP keeps one copy of a non-tensor value per key.
Works in a single process without torch.distributed initialised (DCP's no-dist mode).
"""

from __future__ import annotations

import io
import logging
import os
import random
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

# A single-process run saves and loads with no_dist=True on purpose; DCP still warns about it on every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

logger = logging.getLogger(__name__)

COMPLETE_MARKER = ".complete"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^step-\d+\.tmp-")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


# ------------------------------------------------------------------------------ stateful adapters
class ModelState:
    """The model's (sharded) state dict with clean FQNs (expert_bias buffers included)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state)


class BlobState:
    """A per-rank Python object (data loader state, RNG states) stored as one opaque bytes value, so its
    inner structure may change between save and load without confusing DCP's key matching."""

    def __init__(self, get_state, set_state):
        self._get, self._set = get_state, set_state

    def state_dict(self) -> dict:
        buf = io.BytesIO()
        torch.save(self._get(), buf)
        return {"blob": buf.getvalue()}

    def load_state_dict(self, state: dict) -> None:
        self._set(torch.load(io.BytesIO(state["blob"]), weights_only=False))


def rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and (if present) CUDA RNG states of this process."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------------ the manager
def complete_steps(folder: str | os.PathLike) -> list[int]:
    """Sorted steps of the complete checkpoints (marker present) in `folder`."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    steps = []
    for d in folder.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir() and (d / COMPLETE_MARKER).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


class CheckpointManager:
    """Save / find / load DCP checkpoints of one run (see the module doc for the layout)."""

    def __init__(self, folder: str | os.PathLike, keep_latest_k: int = 0, async_mode: str = "disabled"):
        if async_mode not in ("disabled", "async"):
            raise ValueError(f"[checkpoint] async_mode must be 'disabled' or 'async', got {async_mode!r}")
        self.folder = Path(folder)
        self.keep_latest_k = keep_latest_k
        self.async_mode = async_mode
        self._pending = None  # (future, tmp_dir, step) of an async save not yet published
        # Background saves must not share the default group with the training collectives.
        self._async_group = dist.new_group(backend="gloo") if async_mode == "async" and dist.is_initialized() else None
        if _rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            for d in self.folder.iterdir():
                if _TMP_DIR.match(d.name):
                    logger.warning("removing incomplete checkpoint %s (a save was interrupted)", d)
                    shutil.rmtree(d, ignore_errors=True)
        _barrier()

    def latest_step(self) -> int | None:
        steps = complete_steps(self.folder)
        return steps[-1] if steps else None

    def step_dir(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def _shared_tmp_dir(self, step: int) -> Path:
        token = [uuid.uuid4().hex[:12]]
        if dist.is_initialized():
            dist.broadcast_object_list(token, src=0)
        return self.folder / f"step-{step}.tmp-{token[0]}"

    def save(self, step: int, state: dict[str, Any], blocking: bool = False) -> None:
        """Save `state` as step `step`. Async mode returns after staging, unless `blocking`."""
        self.wait()
        if self.step_dir(step).is_dir():
            logger.info("checkpoint step-%d already exists; not saving it again", step)
            return
        tmp = self._shared_tmp_dir(step)
        if self.async_mode == "async" and not blocking:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._async_group)
            self._pending = (future, tmp, step)
        else:
            dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
            self._publish(tmp, step)

    def wait(self) -> None:
        """Finish and publish a pending async save."""
        if self._pending is None:
            return
        future, tmp, step = self._pending
        self._pending = None
        future.result()
        self._publish(tmp, step)

    def _publish(self, tmp: Path, step: int) -> None:
        _barrier()
        if _rank() == 0:
            (tmp / COMPLETE_MARKER).write_text(f"step {step}\n")
            os.replace(tmp, self.step_dir(step))
            self._prune()
            logger.info("saved checkpoint %s", self.step_dir(step))
        _barrier()

    def _prune(self) -> None:
        if self.keep_latest_k <= 0:
            return
        for old in complete_steps(self.folder)[: -self.keep_latest_k]:
            shutil.rmtree(self.step_dir(old), ignore_errors=True)

    def load(self, step: int, state: dict[str, Any]) -> None:
        """Load step `step` into `state` in place (Stateful entries get load_state_dict)."""
        path = self.step_dir(step)
        if not (path / COMPLETE_MARKER).is_file():
            raise FileNotFoundError(f"checkpoint {path} is missing or incomplete (no {COMPLETE_MARKER} marker)")
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())

    def close(self) -> None:
        self.wait()


def load_model_weights_dcp(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Load only the model weights from a DCP directory whose model lives under the `model` key (ours, or
    one written by `python -m llm_training.convert hf-to-dcp`)."""
    dcp.load({"model": ModelState(model)}, checkpoint_id=str(path), no_dist=not dist.is_initialized())
