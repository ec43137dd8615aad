"""Checkpointing with torch.distributed.checkpoint (DCP): atomic publish, integrity, resume on any layout,
keep-last-N, async.

Layout under the checkpoint folder:
  step-<N>/                 a complete checkpoint (DCP files + `.complete` marker)
  step-<N>.tmp-<id>/        a save in progress (or one killed mid-way: ignored, cleaned at startup)
  step-<N>.damaged-<id>/    a checkpoint that failed verification, moved aside (kept for inspection)

A save writes into `step-N.tmp-<id>/` (id shared by all ranks); once every rank has finished writing, the
ranks hash the files (each rank a share of them), rank 0 writes the `.complete` marker (JSON: step, and the
size + SHA-256 of every file) into it and renames it to `step-N/` (an atomic rename on one file system). A
kill at any moment therefore leaves the previous `step-*` directory intact and the resume scan never sees a
partial save.

Resume (`load_latest`) verifies the newest checkpoint's files against its marker before DCP opens any of them.
A damaged one (missing file such as `.metadata`, truncated or bit-flipped shard, unreadable marker) is
reported with the file names and, with `[checkpoint] on_damaged = "fall_back"`, moved aside while the next
newest is tried; with "stop" the run ends naming the checkpoint.

Any layout: tensors (model, Muon momentum, AdamW moments, fp32 replicated params, expert biases) are resharded
by DCP to the loading world size. Non-tensor per-rank state (data loader position, RNG) is stored under ONE
key for all ranks (`RankStates`: every rank's JSON value gathered into one list), so the loading run finds it
whatever its world size and decides what to do with it (the data loader continues the global sample order,
see llm_training.data.dataloader). Works in a single process without torch.distributed initialised (DCP's
no-dist mode).

Trust model. A checkpoint folder is data this code reads, never code it runs:
  * our own values (data loader, RNG) are JSON; DCP's non-tensor values are read with
    `torch.load(weights_only=True)` (primitive types and tensors only);
  * DCP's `.metadata` is a pickle; it is unpickled with an allow-list of the DCP metadata classes, torch
    dtypes/Size/layout and pathlib paths (`_restricted_unpickle`): any other global in it is refused;
  * the SHA-256 list in `.complete` detects corruption (storage, transfer, partial copies), not tampering:
    whoever can write the folder can rewrite the marker too. Load checkpoints only from storage you control.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from llm_training.distributed.utils import rank, world_size

# A single-process run saves and loads with no_dist=True on purpose; DCP still warns about it on every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

logger = logging.getLogger(__name__)

COMPLETE_MARKER = ".complete"
MARKER_FORMAT = 1
ON_DAMAGED_POLICIES = ("fall_back", "stop")
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^step-\d+\.tmp-")
_HASH_CHUNK_BYTES = 1 << 24


class CheckpointDamagedError(RuntimeError):
    """A checkpoint whose files do not match its completion marker (names the checkpoint and the files)."""


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _all_gather(value: Any) -> list[Any]:
    """`value` of every rank, in rank order (a list of one without torch.distributed)."""
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# ------------------------------------------------------------------------------ safe reading
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP `.metadata`, refusing every global outside the allow-list (see the module doc)."""

    def find_class(self, module: str, name: str):
        if module == "torch.distributed.checkpoint.metadata" and not name.startswith("__"):
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return super().find_class(module, name)
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which is not a DCP metadata type; refusing to load it"
        )


def _restricted_unpickle(stream) -> Any:
    return _MetadataUnpickler(stream).load()


class _SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is unpickled with the allow-list (same steps as the parent's)."""

    def read_metadata(self, *args, **kwargs):
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as metadata_file:
            metadata = _restricted_unpickle(metadata_file)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def safe_dcp_load(state: dict[str, Any], path: str | os.PathLike) -> None:
    """`dcp.load(state, path)` with the safe metadata reader and planner (every DCP load goes through here).
    The metadata is read once up front so that a refused pickle raises UnpicklingError naming the global,
    not DCP's wrapped exception (a BaseException). An entry whose object says `optional_in_checkpoint = True`
    (state a later version added) keeps its current state when the checkpoint has none for it."""
    reader = _SafeReader(str(path))
    saved = {fqn.split(".", 1)[0] for fqn in reader.read_metadata().state_dict_metadata}
    absent_optional = [k for k, v in state.items() if k not in saved and getattr(v, "optional_in_checkpoint", False)]
    if absent_optional:
        state = {k: v for k, v in state.items() if k not in absent_optional}
    dcp.load(state, storage_reader=reader, planner=_SafeLoadPlanner(), no_dist=not dist.is_initialized())


# ------------------------------------------------------------------------------ stateful adapters
class ModelState:
    """The model's (sharded) state dict with clean FQNs (expert_bias buffers included)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state)


class RankStates:
    """A JSON value of every rank (data loader position, RNG states) stored under one checkpoint key.

    Saving gathers each rank's `get_local()` into a list in rank order (every rank then holds the same
    value, which DCP writes once); loading hands the whole list to `set_from_ranks(values)` on every rank,
    whatever the world size of the saving run was. JSON, not pickle: loading runs no code from the file."""

    def __init__(self, get_local: Callable[[], Any], set_from_ranks: Callable[[list[Any]], None]):
        self._get, self._set = get_local, set_from_ranks

    def state_dict(self) -> dict:
        return {"json": json.dumps(_all_gather(self._get()), separators=(",", ":"))}

    def load_state_dict(self, state: dict) -> None:
        self._set(json.loads(state["json"]))


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and (if present) CUDA RNG states of this process, as JSON values."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def restore_rng_of_rank(states: list[dict[str, Any]], rank: int, world_size: int) -> None:
    """Restore this rank's RNG states from those of every rank of the saving run: exactly when the world size
    is unchanged; otherwise each rank is seeded from a hash of the saved states and its rank (deterministic,
    distinct per rank and per checkpoint), since a rank of the new layout has no saved stream of its own."""
    if len(states) == world_size:
        set_rng_state(states[rank])
        return
    digest = hashlib.sha256(json.dumps([states, rank], sort_keys=True).encode()).digest()
    seed = int.from_bytes(digest[:8], "little") >> 1
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if rank == 0:
        logger.info("RNG states saved by %d ranks, resuming on %d: every rank reseeded", len(states), world_size)


# ------------------------------------------------------------------------------------ integrity
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _checkpoint_files(folder: Path) -> list[str]:
    """Names of the files of a checkpoint folder (recursive, relative, sorted; the marker excluded)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != COMPLETE_MARKER)


def _hash_share(folder: Path, names: list[str]) -> dict[str, dict]:
    """{name: {size, sha256}} of this rank's share of `names` (every world_size-th, from its rank)."""
    share = names[rank() :: world_size()]
    return {n: {"size": (folder / n).stat().st_size, "sha256": _sha256(folder / n)} for n in share}


def _read_marker(folder: Path) -> dict:
    """The parsed `.complete` marker; raises CheckpointDamagedError when it is missing or unreadable."""
    path = folder / COMPLETE_MARKER
    try:
        text = path.read_text(encoding="utf-8")
        if text.startswith("step "):
            raise ValueError(
                "a marker without checksums, from an older version whose checkpoints this one cannot resume"
            )
        marker = json.loads(text)
        if marker.get("format") != MARKER_FORMAT or not isinstance(marker.get("files"), dict):
            raise ValueError(f"format {marker.get('format')!r}, expected {MARKER_FORMAT} with a file list")
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointDamagedError(f"{path}: unreadable completion marker ({e})") from None
    return marker


def verify_checkpoint(folder: str | os.PathLike) -> list[str]:
    """Problems of checkpoint `folder` against its marker (empty: intact), each naming a file. Collective
    under torch.distributed: every rank checks a share of the files, every rank gets the full list."""
    folder = Path(folder)
    try:
        expected = _read_marker(folder)["files"]
    except CheckpointDamagedError as e:
        problems = [str(e)]
        expected = {}
    else:
        problems = []
    names = sorted(expected)
    mine = []
    for name in names[rank() :: world_size()]:
        path, want = folder / name, expected[name]
        if not path.is_file():
            mine.append(f"{path}: missing")
        elif path.stat().st_size != want["size"]:
            mine.append(f"{path}: {path.stat().st_size} bytes, the marker says {want['size']} (truncated?)")
        elif _sha256(path) != want["sha256"]:
            mine.append(f"{path}: SHA-256 differs from the marker (corrupted)")
    for rank_problems in _all_gather(mine):
        problems += rank_problems
    return problems


# ------------------------------------------------------------------------------------ the manager
def complete_steps(folder: str | os.PathLike) -> list[int]:
    """Sorted steps of the published checkpoints (marker present) in `folder`."""
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
    """Save / verify / find / load DCP checkpoints of one run (see the module doc for the layout)."""

    def __init__(
        self,
        folder: str | os.PathLike,
        keep_latest_k: int = 0,
        async_mode: str = "disabled",
        on_damaged: str = "fall_back",
    ):
        if async_mode not in ("disabled", "async"):
            raise ValueError(f"[checkpoint] async_mode must be 'disabled' or 'async', got {async_mode!r}")
        if on_damaged not in ON_DAMAGED_POLICIES:
            raise ValueError(f"[checkpoint] on_damaged must be one of {ON_DAMAGED_POLICIES}, got {on_damaged!r}")
        self.folder = Path(folder)
        self.keep_latest_k = keep_latest_k
        self.async_mode = async_mode
        self.on_damaged = on_damaged
        self._pending = None  # (future, tmp_dir, step) of an async save not yet published
        # Background saves must not share the default group with the training collectives.
        self._async_group = dist.new_group(backend="gloo") if async_mode == "async" and dist.is_initialized() else None
        if rank() == 0:
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

    def _shared_token(self) -> str:
        token = [uuid.uuid4().hex[:12]]
        if dist.is_initialized():
            dist.broadcast_object_list(token, src=0)
        return token[0]

    def save(self, step: int, state: dict[str, Any], blocking: bool = False) -> None:
        """Save `state` as step `step`. Async mode returns after staging, unless `blocking`."""
        self.wait()
        if self.step_dir(step).is_dir():
            logger.info("checkpoint step-%d already exists; not saving it again", step)
            return
        tmp = self.folder / f"step-{step}.tmp-{self._shared_token()}"
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
        files: dict[str, dict] = {}
        for share in _all_gather(_hash_share(tmp, _checkpoint_files(tmp))):
            files.update(share)
        if rank() == 0:
            marker = {"format": MARKER_FORMAT, "step": step, "files": dict(sorted(files.items()))}
            (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, indent=1) + "\n", encoding="utf-8")
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
        """Verify step `step` against its marker, then load it into `state` in place (Stateful entries get
        load_state_dict); raises CheckpointDamagedError naming the damaged files."""
        path = self.step_dir(step)
        if not (path / COMPLETE_MARKER).is_file():
            raise FileNotFoundError(f"checkpoint {path} is missing or incomplete (no {COMPLETE_MARKER} marker)")
        problems = verify_checkpoint(path)
        if problems:
            raise CheckpointDamagedError(f"checkpoint {path} is damaged: " + "; ".join(problems))
        safe_dcp_load(state, path)

    def load_latest(self, state: dict[str, Any]) -> int | None:
        """Load the newest intact checkpoint into `state`; returns its step (None: there is none).

        A damaged one is reported with its files; with on_damaged = "fall_back" it is moved aside to
        `step-N.damaged-<id>/` (so that a later save of step N is not skipped) and the next newest is tried,
        with "stop" CheckpointDamagedError is raised. When every checkpoint is damaged the run stops."""
        damaged = []
        for step in reversed(complete_steps(self.folder)):
            try:
                self.load(step, state)
            except CheckpointDamagedError as e:
                damaged.append(self.step_dir(step))
                if self.on_damaged == "stop":
                    raise CheckpointDamagedError(
                        f"{e}. Move it away to resume from the previous checkpoint, or set "
                        "[checkpoint] on_damaged = 'fall_back' to do so automatically"
                    ) from None
                logger.error("%s; falling back to the previous checkpoint", e)
                self._set_aside(step)
                continue
            return step
        if damaged:
            raise CheckpointDamagedError(
                f"every checkpoint in {self.folder} is damaged (moved aside: {', '.join(map(str, damaged))}); "
                "restore one from a copy, or start the run afresh in another folder"
            )
        return None

    def _set_aside(self, step: int) -> None:
        token = self._shared_token()
        if rank() == 0:
            os.replace(self.step_dir(step), self.folder / f"step-{step}.damaged-{token}")
        _barrier()

    def close(self) -> None:
        self.wait()


def load_model_weights_dcp(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Load only the model weights from a DCP directory whose model lives under the `model` key (ours, or
    one written by `python -m llm_training.convert hf-to-dcp`)."""
    safe_dcp_load({"model": ModelState(model)}, path)
