"""Training metrics: throughput / MFU arithmetic, one log line per `log_freq` steps, JSONL file, and the
optional wandb / TensorBoard sinks (imported lazily).

metrics.jsonl is strict JSON, one object per line (`null` for a non-finite or missing value), and holds one
record per logged step across resumes: a resumed run first drops the records of steps after the checkpoint
it resumed from (written by the crashed run, now trained again). `lr` is the rate the step used. With
`[validation]` each evaluation adds its own record: `step` and the `val_*` values (`record_validation`).

MFU is reported in both conventions of docs/architecture.md §7 (`training_flops_per_token(args, seq_len,
"megatron"|"torchtitan")`) against the dense bf16 peak of the detected GPU; on CPU it is n/a. Beside the
padded figures (every position of every row), the true throughput counts only the tokens of documents:
`real_tokens_per_s`, `real_mfu_*` and `packing_efficiency` (their share of the rows) per logging interval.
A data mixture (`[[training.sources]]`) adds `tokens/<source>`: the real tokens of each source trained so far
(`SourceTokenCounts`, summed over ranks and the applied steps, kept in the checkpoint), also at the end of the line.
wandb settings come from the environment only (`wandb_init_kwargs`: WANDB_PROJECT, WANDB_TEAM, WANDB_RUN_NAME,
WANDB_RUN_ID, WANDB_API_KEY, WANDB_MODE): never from the TOML; the key is never printed or written.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


logger = logging.getLogger(__name__)

MFU_CONVENTIONS = ("megatron", "torchtitan")
# Dense bf16 peak FLOP/s per GPU (no sparsity), matched on the device name.
_PEAK_BF16 = (
    ("B200", 2250e12),
    ("B100", 1750e12),
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
)


def peak_bf16_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of `device` (None on CPU or an unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for tag, peak in _PEAK_BF16:
        if tag in name:
            return peak
    return None


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _count(n: int) -> str:
    """A token count in a few characters: 950, 12.3K, 4.56M, 7.89B."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def format_eta(seconds: float) -> str:
    """`Nd HH:MM:SS` (days are not wrapped: three days and five seconds is `3d 00:00:05`)."""
    if not math.isfinite(seconds):
        return "n/a"
    total = max(int(round(seconds)), 0)
    days, rest = divmod(total, 86400)
    return f"{days}d {rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"


def strict_json_record(metrics: dict[str, Any]) -> str:
    """One JSON line of `metrics`, non-finite floats written as null (valid JSON for any strict parser)."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
    return json.dumps(clean, allow_nan=False)


def drop_records_after(path: Path, step: int) -> int:
    """Rewrite the JSONL file `path` without the records of steps after `step` (and without lines a crash cut
    short); returns how many lines were dropped. Atomic: the file is replaced by a complete new one."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            keep = json.loads(line).get("step", 0) <= step
        except (json.JSONDecodeError, AttributeError):
            keep = False
        if keep:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped


@dataclass
class StepRecord:
    """Everything measured for one optimizer step (already reduced over ranks where it matters)."""

    step: int
    loss: float  # total (CE + w * MTP + balance)
    ce_loss: float
    mtp_loss: float
    balance_loss: float
    grad_norm: float
    lr: float
    tokens: int  # tokens processed this step over all ranks (global batch x seq_len, padding included)
    step_time_s: float
    real_tokens: int | None = None  # of those, the non-padding ones (None: not measured, e.g. a benchmark)
    expert_imbalance: float | None = None
    qk_clip_events: int = 0  # heads rescaled by QK-clip this step
    skipped: bool = False  # non-finite step, not applied
    spike: bool = False  # loss spike ([loss_spike]), not applied
    source_tokens: dict[str, int] | None = None  # a mixture's real tokens per source trained so far (cumulative)


class SourceTokenCounts:
    """The real (non-padding) tokens of each data source of a mixture in the applied optimizer steps so far, summed
    over all ranks: the `tokens/<source>` metrics. Checkpointed; a checkpoint without it (another version, or a
    single-source run) leaves the counts at zero (`optional_in_checkpoint`)."""

    optional_in_checkpoint = True

    def __init__(self, names: list[str]):
        self.counts = dict.fromkeys(names, 0)

    def add(self, tokens: list[float]) -> None:
        """Add one step's tokens of each source (in the order of `names`)."""
        for name, value in zip(list(self.counts), tokens):
            self.counts[name] += round(value)

    def state_dict(self) -> dict:
        return {"json": json.dumps(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        saved = json.loads(state["json"])
        self.counts = {name: int(saved.get(name, 0)) for name in self.counts}


@dataclass
class MetricsLogger:
    """Accumulates StepRecords and emits one line + one JSONL record per `log_freq` steps (rank 0 only
    writes; every rank may call it)."""

    flops_per_token: dict[str, float]  # training FLOPs per token in each of MFU_CONVENTIONS (ModelSpec)
    total_steps: int
    log_freq: int
    run_folder: Path
    device: torch.device
    world_size: int = 1
    save_jsonl: bool = True
    enable_wandb: bool = False
    enable_tensorboard: bool = False
    is_rank0: bool = True
    wandb_run_id: str | None = None  # set to resume an existing wandb run
    start_step: int = 0  # the step resumed from (0: a fresh run)
    _window: list[StepRecord] = field(default_factory=list, init=False)
    _skipped_total: int = field(default=0, init=False)
    _spikes_total: int = field(default=0, init=False)
    _qk_clip_total: int = field(default=0, init=False)
    _start_time: float = field(default_factory=time.perf_counter, init=False)
    _seen_first: bool = field(default=False, init=False)
    _steps_timed: int = field(default=0, init=False)
    _time_total: float = field(default=0.0, init=False)
    _wandb: Any = field(default=None, init=False)
    _tb: Any = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.peak = peak_bf16_flops(self.device)
        self.jsonl_path = Path(self.run_folder) / "metrics.jsonl"
        if not self.is_rank0:
            return
        Path(self.run_folder).mkdir(parents=True, exist_ok=True)
        if self.save_jsonl:
            dropped = drop_records_after(self.jsonl_path, self.start_step)
            if dropped:
                logger.info(
                    "metrics: dropped %d record(s) after step %d from %s", dropped, self.start_step, self.jsonl_path
                )
        if self.enable_wandb:
            self._wandb = self._init_wandb()
        if self.enable_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "[metrics] enable_tensorboard = true needs the tensorboard package (pip install tensorboard)"
                ) from e
            self._tb = SummaryWriter(log_dir=str(Path(self.run_folder) / "tb"))

    def _init_wandb(self):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("[metrics] enable_wandb = true needs the wandb package (pip install wandb)") from e
        run = wandb.init(**wandb_init_kwargs(Path(self.run_folder), self.wandb_run_id, os.environ))
        self.wandb_run_id = run.id
        (Path(self.run_folder) / WANDB_RUN_ID_FILE).write_text(run.id + "\n")
        return run

    def record(self, rec: StepRecord) -> None:
        self._window.append(rec)
        self._skipped_total += int(rec.skipped)
        self._spikes_total += int(rec.spike)
        self._qk_clip_total += rec.qk_clip_events
        if self._seen_first:  # the first step of a run includes compilation / warm-up: not in the ETA
            self._steps_timed += 1
            self._time_total += rec.step_time_s
        self._seen_first = True
        if rec.step % self.log_freq == 0 or rec.step == self.total_steps:
            self.flush()

    def flush(self) -> None:
        """Emit the metrics of the steps recorded since the last flush."""
        if not self._window:
            return
        window, self._window = self._window, []
        applied = [r for r in window if not (r.skipped or r.spike)] or window
        last = window[-1]
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        time_s = sum(r.step_time_s for r in window)
        tokens = sum(r.tokens for r in window)
        tps = tokens / time_s if time_s > 0 else 0.0
        tflops = {c: tps * f / self.world_size / 1e12 for c, f in self.flops_per_token.items()}  # per GPU
        mfu = {c: (tflops[c] * 1e12 / self.peak if self.peak else None) for c in MFU_CONVENTIONS}
        # true throughput: only the tokens of documents (padding excluded), and the share of the rows they fill
        measured = all(r.real_tokens is not None for r in window)
        real = sum(r.real_tokens for r in window) if measured else None
        packing = real / tokens if measured and tokens else None
        real_tps = tps * packing if packing is not None else None
        real_mfu = {c: (None if v is None or packing is None else v * packing) for c, v in mfu.items()}
        peak_mem = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        avg_step = self._time_total / self._steps_timed if self._steps_timed else time_s / len(window)
        eta_s = avg_step * (self.total_steps - last.step)
        imbalance = [r.expert_imbalance for r in window if r.expert_imbalance is not None]
        metrics = {
            "step": last.step,
            "loss": mean([r.loss for r in applied]),
            "ce_loss": mean([r.ce_loss for r in applied]),
            "mtp_loss": mean([r.mtp_loss for r in applied]),
            "balance_loss": mean([r.balance_loss for r in applied]),
            "grad_norm": mean([r.grad_norm for r in applied]),
            "lr": last.lr,
            "tokens_per_s": tps,
            "real_tokens_per_s": real_tps,
            "packing_efficiency": packing,
            "tflops_per_gpu_megatron": tflops["megatron"],
            "tflops_per_gpu_torchtitan": tflops["torchtitan"],
            "mfu_megatron": mfu["megatron"],
            "mfu_torchtitan": mfu["torchtitan"],
            "real_mfu_megatron": real_mfu["megatron"],
            "real_mfu_torchtitan": real_mfu["torchtitan"],
            "peak_memory_gib": peak_mem,
            "expert_imbalance_max_over_mean": max(imbalance) if imbalance else None,
            "qk_clip_events": self._qk_clip_total,
            "skipped_steps": self._skipped_total,
            "loss_spikes": self._spikes_total,
            "eta_s": eta_s,
        }
        sources = last.source_tokens or {}
        metrics.update({f"tokens/{name}": count for name, count in sources.items()})
        if not self.is_rank0:
            return
        pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        logger.info(
            "step %d/%d  loss %.4f (ce %.4f mtp %.4f bal %.4g)  gnorm %.3f  lr %.3g  tok/s %.0f (real %s, packed %s)  "
            "TFLOP/s/gpu %s|%s  MFU %s|%s (megatron|torchtitan)  mem %s GiB  imbalance %s  "
            "qk-clip %d  skipped %d  spikes %d  eta %s%s",
            last.step, self.total_steps, metrics["loss"], metrics["ce_loss"], metrics["mtp_loss"],
            metrics["balance_loss"], metrics["grad_norm"], last.lr, tps, _fmt(real_tps, ".0f"), pct(packing),
            _fmt(tflops["megatron"], ".3g"), _fmt(tflops["torchtitan"], ".3g"),
            pct(mfu["megatron"]), pct(mfu["torchtitan"]), _fmt(peak_mem, ".1f"),
            _fmt(metrics["expert_imbalance_max_over_mean"], ".2f"), self._qk_clip_total, self._skipped_total,
            self._spikes_total, format_eta(eta_s),
            "  tokens " + " ".join(f"{name} {_count(count)}" for name, count in sources.items()) if sources else "",
        )  # fmt: skip
        if self.save_jsonl:
            with self.jsonl_path.open("a") as f:
                f.write(strict_json_record(metrics) + "\n")
        numeric = {k: v for k, v in metrics.items() if v is not None and k != "step"}
        if self._wandb is not None:
            self._wandb.log(numeric, step=last.step)
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, last.step)

    def rewind(self, step: int) -> None:
        """After a rollback to the checkpoint of `step`: emit the pending records, then drop those of later steps
        from metrics.jsonl (they are trained again; the totals such as loss_spikes keep counting)."""
        self.flush()
        if self.is_rank0 and self.save_jsonl:
            drop_records_after(self.jsonl_path, step)

    def record_validation(self, step: int, values: dict[str, float | int]) -> None:
        """Log one evaluation (`ValidationResult.metrics()`: val_loss, val_ppl, val_mtp_loss, val_tokens,
        val_time_s) after `step`: one line, and its own record in metrics.jsonl / W&B / TensorBoard (rank 0)."""
        if not self.is_rank0:
            return
        logger.info(
            "validation step %d: loss %.4f  ppl %.4g  mtp %.4f  (%s tokens, %.1f s)",
            step, values["val_loss"], values["val_ppl"], values["val_mtp_loss"], f"{values['val_tokens']:,}",
            values["val_time_s"],
        )  # fmt: skip
        if self.save_jsonl:
            with self.jsonl_path.open("a") as f:
                f.write(strict_json_record({"step": step, **values}) + "\n")
        numeric = {k: v for k, v in values.items() if v is not None and math.isfinite(v)}
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self.flush()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


WANDB_RUN_ID_FILE = "wandb_run_id"  # in the run folder: lets a restart before the first checkpoint resume the run
# The variables users set, then the names wandb itself reads (aliases).
_WANDB_ENV_ALIASES = {"entity": ("WANDB_TEAM", "WANDB_ENTITY"), "name": ("WANDB_RUN_NAME", "WANDB_NAME")}


def wandb_init_kwargs(run_folder: Path, run_id: str | None, env: Mapping[str, str]) -> dict[str, Any]:
    """`wandb.init` arguments from the environment: project WANDB_PROJECT (default "llm_training"), team
    WANDB_TEAM (alias WANDB_ENTITY), run name WANDB_RUN_NAME (alias WANDB_NAME; default the run folder's
    name). The run resumes the id it is given (the checkpoint's), else WANDB_RUN_ID, else the id a previous
    start wrote to `<run_folder>/wandb_run_id`; with none of them a new run starts. WANDB_API_KEY and
    WANDB_MODE are left to wandb: the key is never read, printed or written here."""
    chosen: dict[str, str | None] = {}
    for key, names in _WANDB_ENV_ALIASES.items():
        values = {n: env[n] for n in names if env.get(n)}
        if len(set(values.values())) > 1:
            raise ValueError(
                f"[metrics] {names[0]}={values[names[0]]!r} and {names[1]}={values[names[1]]!r} disagree; "
                f"set only {names[0]} ({names[1]} is an alias)"
            )
        chosen[key] = next(iter(values.values()), None)
    id_file = run_folder / WANDB_RUN_ID_FILE
    if not run_id:
        run_id = env.get("WANDB_RUN_ID") or (id_file.read_text().strip() if id_file.is_file() else None) or None
    return {
        "project": env.get("WANDB_PROJECT") or "llm_training",
        "entity": chosen["entity"],
        "name": chosen["name"] or run_folder.name,
        "dir": str(run_folder),
        "id": run_id,
        "resume": "allow" if run_id else None,
    }
