"""The train loop (docs/architecture.md §2 step 5): build model / data / optimizers, resume, then per step
forward -> loss -> backward per micro-batch -> grad clip -> Muon/AdamW step -> QK-clip -> expert-bias
update -> LR step -> metrics -> validation (`[validation] freq`, end; trainer/validation.py) -> checkpoint
(interval, SIGTERM/SIGINT, end).

Entry point for `llm_training/train.py`: `llm_training.trainer.train(job_config, parallel_dims, device)`, after
`llm_training.distributed.utils.setup_distributed` resolved the device, the process group and the mesh (once).
The model family is reached only through its spec (`llm_training.motif.spec.MOTIF3_SPEC`): build, parallelize,
optimizer grouping, state-dict adapter and the per-step hooks.

Fault handling:
  * non-finite loss or gradient norm (one flag, agreed by all ranks): the step is skipped (grads zeroed, no
    optimizer / scheduler / bias update, no checkpoint) and counted; `max_consecutive_nonfinite` skipped
    steps in a row stop the run with NonFiniteLossError, leaving the last good checkpoint as it was.
  * finite loss spike (`[loss_spike]`, llm_training/trainer/spikes.py; decided from the reduced loss and grad norm,
    so the same on every rank): the step is not applied either (the same skip), counted and logged; policy
    "rollback" then reloads the last checkpoint (all but the detector) and continues with the data after the
    spike's batches. `max_consecutive` spikes in a row stop the run with LossSpikeError.
  * SIGTERM / SIGINT (Kubernetes pre-emption, Ctrl-C): a handler sets a flag; the loop finishes the
    current step, saves a checkpoint and returns cleanly (TrainResult.stopped_by_signal).
  * torch.OutOfMemoryError: re-raised naming the step and the config keys that reduce memory.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from activation.triton_prebuild import capture_launches, start_triton_prebuild

from llm_training.config import grad_accumulation_steps, to_toml
from llm_training.distributed.compile import (
    compile_progress,
    compile_report,
    compile_stats,
    compiled_since,
    start_compile_workers,
)
from llm_training.distributed.context_parallel import shard_batch
from llm_training.distributed.utils import (
    all_reduce_,
    clip_coefficient,
    grad_norm,
    rank,
    to_device_async,
    world_size,
)
from llm_training.layers.attention.fa4_prebuild import fa4_attention_kinds, start_fa4_prebuild
from llm_training.layers.attention.masks import prebuild_max_logits_kernels
from llm_training.model_spec import StepStat
from llm_training.motif.spec import MOTIF3_SPEC
from llm_training.trainer.batch import prepare_batch
from llm_training.trainer.checkpoint import (
    CheckpointManager,
    ModelState,
    RankStates,
    load_model_weights_dcp,
    restore_rng_of_rank,
    rng_state,
)
from llm_training.trainer.components import build_components
from llm_training.trainer.hf_export import export_hf_snapshot, hf_export_due
from llm_training.trainer.losses import (
    HeadGradAccumulator,
    count_labelled_tokens,
    forward_loss,
    prebuild_chunk_kernel,
)
from llm_training.trainer.metrics import MFU_CONVENTIONS, MetricsLogger, SourceTokenCounts, StepRecord
from llm_training.trainer.profiling import StepProfiler
from llm_training.trainer.resume import reapply_lr_schedule, warn_changed_config
from llm_training.trainer.spikes import LossSpikeDetector
from llm_training.trainer.validation import Validator

logger = logging.getLogger(__name__)

# guard failures kept per compile_stats() snapshot: enough to see every new one between two steps
_COMPILE_REASONS = 64

OOM_HINT = (
    "reduce memory with: training.local_batch_size (raise training.global_batch_size / local for accumulation), "
    "training.seq_len, activation_checkpoint.mode = 'selective' or 'full', a larger "
    "parallelism.data_parallel_shard_degree (more GPUs to shard over), training.mixed_precision_param = 'bfloat16'"
)


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient norm."""


class LossSpikeError(RuntimeError):
    """Too many consecutive loss spikes (`[loss_spike] max_consecutive`)."""


@dataclass
class TrainResult:
    """What a training run did and where its outputs are."""

    start_step: int  # 0, or the step of the checkpoint resumed from
    last_step: int
    losses: dict[int, float]  # step -> global total loss (nan for skipped steps)
    skipped_steps: int
    stopped_by_signal: bool
    run_folder: Path
    checkpoint_folder: Path | None
    metrics_path: Path | None
    last_checkpoint: Path | None = None
    spikes: int = 0  # loss spikes detected (not applied), this run and the runs it resumed from
    extra: dict = field(default_factory=dict)


class TrainState:
    """Step counter and run bookkeeping stored in the checkpoint (`train_state` key)."""

    def __init__(self, config_toml: str, model_config_json: str):
        self.step = 0
        self.skipped_steps = 0
        self.wandb_run_id = ""
        self.config_toml = config_toml
        self.model_config_json = model_config_json
        self.resumed_config_toml = ""  # the config of the checkpoint resumed from

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "wandb_run_id": self.wandb_run_id,
            "config_toml": self.config_toml,
            "model_config_json": self.model_config_json,
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.skipped_steps = int(state["skipped_steps"])
        self.wandb_run_id = str(state["wandb_run_id"])
        self.resumed_config_toml = str(state["config_toml"])


class _StopSignal:
    """SIGTERM/SIGINT handlers that only set a flag (installed in the main thread, restored on exit)."""

    def __init__(self):
        self.received: int | None = None
        self._old = {}

    def install(self) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # a second signal: stop waiting for the step to finish
            self.restore()
            signal.raise_signal(signum)
            return
        self.received = signum
        logger.warning(
            "received %s: finishing this step, saving a checkpoint, then exiting", signal.Signals(signum).name
        )

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def accumulate_stats(total: dict[str, StepStat], new: dict[str, StepStat]) -> dict[str, StepStat]:
    """Combine one micro-batch's statistics into the step's: elementwise sum or max, per each stat's op."""
    for name, stat in new.items():
        if name not in total:
            total[name] = stat
        else:
            combine = torch.add if stat.op == "sum" else torch.maximum
            total[name] = StepStat(combine(total[name].value, stat.value), stat.op)
    return total


def all_reduce_step(sums: torch.Tensor, stats: dict[str, StepStat]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reduce the step's numbers over all ranks in at most two collectives: `sums` (float64 [N]: losses and flags)
    plus every "sum" stat in one SUM all-reduce, every "max" stat in one MAX all-reduce. Values travel as float64
    (exact for fp32 and for integer counts) and come back in each stat's dtype."""
    reduced: dict[str, torch.Tensor] = {}
    for op, dist_op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
        names = [n for n, s in stats.items() if s.op == op]
        parts = [stats[n].value.reshape(-1).to(torch.float64) for n in names]
        if op == "sum":
            parts = [sums.to(torch.float64), *parts]
        if not parts:
            continue
        flat = all_reduce_(torch.cat(parts), op=dist_op)
        if op == "sum":
            sums, flat = flat[: sums.numel()], flat[sums.numel() :]
        for n, piece in zip(names, flat.split([stats[n].value.numel() for n in names])):
            reduced[n] = piece.view_as(stats[n].value).to(stats[n].value.dtype)
    return sums, reduced


# the modules of our Triton kernels (norms, mHC, the loss, Muon), which the prebuild's workers import as they start
TRITON_KERNEL_MODULES = (
    "activation.triton_kernels",
    "llm_training.layers.mhc.kernels",
    "llm_training.layers.mhc.sinkhorn_kernels",
    "llm_training.trainer.cross_entropy_kernels",
    "optimizer.muon_kernels",
)


class Trainer:
    """Builds everything for `job_config` on this rank (the process group and mesh already set up, on `device`);
    `fit()` runs the loop."""

    def __init__(self, job_config, parallel_dims, device: torch.device):
        from llm_training.data import build_dataloader, build_tokenizer

        self.job_config = c = job_config
        self.parallel_dims = parallel_dims
        self.device = device
        if c.compile.enable and "model" in c.compile.components and device.type == "cuda":
            # inductor's compile workers start first: they take seconds to come up (7 s on an H100 host, session
            # 27), and until they have, inductor builds the first graph's kernels one by one in this process
            start_compile_workers()
        self.spec = spec = MOTIF3_SPEC
        self.rank = rank()
        self.dp_rank = parallel_dims.dp_rank(self.rank)
        self.dp_size = parallel_dims.dp_size
        self.accum = grad_accumulation_steps(c, self.dp_size)
        t = c.training
        logger.info(
            "layout: dp_replicate %d x dp_shard %d x cp %d (ep %d) on %d ranks; %d sequences/rank x %d accumulation "
            "steps -> %s tokens per optimizer step, %d steps",
            parallel_dims.dp_replicate,
            parallel_dims.dp_shard,
            parallel_dims.cp,
            parallel_dims.ep,
            parallel_dims.world_size,
            t.local_batch_size,
            self.accum,
            f"{t.local_batch_size * self.dp_size * self.accum * t.seq_len:,}",
            t.steps,
        )
        _seed_everything(t.seed)

        _log_model_summary(spec, c.model.flavor, spec.get_flavor(c.model.flavor), t.seq_len)
        self.tokenizer = build_tokenizer(c.model.tokenizer_path)
        self.dataloader = build_dataloader(c, self.tokenizer, self.dp_rank, self.dp_size)

        # our Triton kernels, built in worker processes from the shapes torch.compile traces (None where nothing
        # compiles on CUDA, or [compile] prebuild_workers = 0); started now, so its workers start with the build
        self.triton_prebuild = None
        if c.compile.enable and self.device.type == "cuda":
            self.triton_prebuild = start_triton_prebuild(c.compile.prebuild_workers, TRITON_KERNEL_MODULES)
        self.kernel_prebuild = None

        def start_kernel_prebuild(model):
            # flash-attn-4's kernels built in side processes from the moment the model exists (on meta) until the
            # first step needs them: through the parallelization, the weights' and the optimizer state's
            # initialisation and the first step's compile (None where it would not help); QK-clip's max-logit
            # kernels beside them go to the Triton prebuild's workers
            self.kernel_prebuild = start_fa4_prebuild(model, c, parallel_dims, self.device)
            if self.triton_prebuild is not None and c.optimizer.qk_clip_threshold > 0:
                kinds = fa4_attention_kinds(model, self.device)
                seq_len = t.seq_len // parallel_dims.cp  # the tokens of a row each rank's attention sees
                prebuild_max_logits_kernels(kinds, t.local_batch_size, seq_len, getattr(torch, t.mixed_precision_param))

        built = build_components(spec, c, parallel_dims, self.device, on_model_built=start_kernel_prebuild)
        self.model_args, self.model, self.converters = built.model_args, built.model, built.converters
        self.parallel, self.optimizers = built.parallel, built.optimizers  # Muon + AdamW, with .lr_scheduler
        self.model.train()
        self.lr_scheduler = self.optimizers.lr_scheduler
        self.hooks = spec.build_step_hooks(self.model, self.model_args, c)
        self.num_mtp = spec.num_mtp_modules(self.model_args)
        self.compile_loss = c.compile.enable and "loss" in c.compile.components
        self.head_grad = HeadGradAccumulator()  # the head weight's gradient, summed over a step's micro-batches
        if self.triton_prebuild is not None:  # the loss and the optimizer run eagerly: their kernels are announced here
            prebuild_chunk_kernel(self.model_args.vocab_size, getattr(torch, t.mixed_precision_param))
            if self.optimizers.muon is not None:
                # each launch runs on meta tensors, so the device handed to the capture is meta too
                for what, launch in self.optimizers.muon.kernel_launches():
                    capture_launches(launch, torch.empty(0, device="meta"), what=what)

        self.run_folder = Path(c.run_folder)
        model_config = spec.state_dict_adapter.run_hf_config(
            self.model_args, c.checkpoint.initial_load_path, c.checkpoint.initial_load_format
        )
        self.train_state = TrainState(to_toml(c), _json(model_config))
        self.checkpointer = None
        if c.checkpoint.enable:
            self.checkpointer = CheckpointManager(
                self.run_folder / c.checkpoint.folder,
                c.checkpoint.keep_latest_k,
                c.checkpoint.async_mode,
                c.checkpoint.on_damaged,
            )
        self.validator = None
        if c.validation.enable:
            self.validator = Validator(
                build_dataloader(c, self.tokenizer, self.dp_rank, self.dp_size, validation=True),
                c.validation.steps,
                spec,
                self.num_mtp,
                self.parallel.context_parallel,
                self.device,
                compiled_loss=self.compile_loss,
            )
        self.stop_signal = _StopSignal()
        self.nonfinite_in_a_row = 0
        self.spike_detector = LossSpikeDetector.from_config(c.loss_spike) if c.loss_spike.enable else None
        # a mixture's batches carry source_ids: its real tokens per source are counted (tokens/<source> metrics)
        names = [s.resolved_name for s in c.training.sources]
        self.source_tokens = SourceTokenCounts(names) if names else None

    # ------------------------------------------------------------------ checkpoint state
    def checkpoint_state(self) -> dict:
        """The components of one checkpoint (every rank's data loader / RNG state under one key each)."""
        world = world_size()
        state = {
            "model": ModelState(self.model),
            "optimizer": self.optimizers,
            "lr_scheduler": self.lr_scheduler,
            "dataloader": RankStates(self.dataloader.rank_state, self.dataloader.load_rank_states),
            "rng": RankStates(rng_state, lambda states: restore_rng_of_rank(states, self.rank, world)),
            "train_state": self.train_state,
        }
        if self.spike_detector is not None:
            state["spike_detector"] = self.spike_detector
        if self.source_tokens is not None:
            state["source_tokens"] = self.source_tokens
        return state

    def _resume_or_initial_load(self) -> None:
        ck = self.job_config.checkpoint
        latest = self.checkpointer.load_latest(self.checkpoint_state()) if self.checkpointer else None
        if latest is not None:
            logger.info("resumed from %s (step %d)", self.checkpointer.step_dir(latest), self.train_state.step)
            reapply_lr_schedule(self.lr_scheduler)  # the first resumed step uses the current schedule
            if self.rank == 0:
                warn_changed_config(self.train_state.resumed_config_toml, self.train_state.config_toml)
            self._warn_if_lr_differs_from_checkpoint()
        elif ck.initial_load_path:
            if ck.initial_load_format == "hf":
                self.spec.state_dict_adapter.load_hf_checkpoint(self.model, ck.initial_load_path)
            else:
                load_model_weights_dcp(self.model, ck.initial_load_path)
            logger.info("initial weights loaded from %s (%s)", ck.initial_load_path, ck.initial_load_format)

    def _warn_if_lr_differs_from_checkpoint(self) -> None:
        """Resuming restores the optimizer's param groups, so a changed `[optimizer] lr` has no effect: say so."""
        configured = self.job_config.optimizer.lr
        restored = {g.get("initial_lr", g["lr"]) for opt in self.optimizers.optimizers for g in opt.param_groups}
        if any(abs(lr - configured) > 1e-12 * max(abs(configured), 1.0) for lr in restored):
            logger.warning(
                "[optimizer] lr = %g differs from the resumed checkpoint's %s; the checkpoint's value is used "
                "(the optimizer state is restored on resume). Start a new run, or load the weights with "
                "[checkpoint] initial_load_path, to train with another lr.",
                configured,
                ", ".join(f"{lr:g}" for lr in sorted(restored)),
            )

    def _save(self, blocking: bool = False) -> None:
        if self.checkpointer is not None:
            self.checkpointer.save(self.train_state.step, self.checkpoint_state(), blocking=blocking)

    def _export_hf_if_due(self, step: int) -> None:
        """After the checkpoint of `step` is saved (and published, when async): its HF export, when
        `[checkpoint] export_hf_every` asks for this step."""
        ck = self.job_config.checkpoint
        if not hf_export_due(step, self.job_config.training.steps, ck.interval, ck.export_hf_every):
            return
        self.checkpointer.wait()
        export_hf_snapshot(
            self.spec, self.model, self.run_folder, step, ck.export_dtype, self.train_state.model_config_json
        )

    # ------------------------------------------------------------------ one step
    def train_step(self, micro_batches: list[dict]) -> StepRecord:
        """One optimizer step over `micro_batches` (the data loader's CPU batch dicts)."""
        t = self.job_config.training
        step = self.train_state.step
        lr = self.lr_scheduler.get_last_lr()[0]  # the rate this step uses (the scheduler steps after it)
        # Progress = optimizer steps taken so far / total (0 on the first step), from the LR scheduler's step
        # count: it is checkpointed, so a resumed run sees the same schedule as an uninterrupted one.
        self.hooks.begin_step(self.lr_scheduler.last_step / max(t.steps, 1))
        # Context parallelism: the cp ranks of a data rank read the same batch and each keeps its shard of every
        # [B, S] tensor; attention still needs the whole sequence's document ids.
        local = [
            shard_batch(self.parallel.context_parallel, prepare_batch(mb, self.num_mtp, self.spec.mtp_inputs))
            for mb in micro_batches
        ]
        batches = [b for b, _ in local]
        # This rank's labelled tokens: the world SUM is the global batch's count (cp shards do not overlap).
        normalisers = sum(count_labelled_tokens(b.targets()) for b in batches)
        normalisers = all_reduce_(to_device_async(normalisers, self.device))
        # The balance loss is a mean over micro-batches and data ranks; under CP each shard's loss is its part of
        # the sequence's loss (layers/moe.py), so the SUM over cp ranks needs no further scale.
        balance_scale = 1.0 / (len(batches) * self.dp_size)
        parts = torch.zeros(4, dtype=torch.float64, device=self.device)  # total, ce, mtp, balance
        stats: dict[str, StepStat] = {}
        self.head_grad.begin_step()
        for k, (cpu_batch, attention_docs) in enumerate(local):
            self.parallel.set_gradient_sync(last_micro_batch=k == len(batches) - 1)
            out, loss = forward_loss(
                self.model,
                self.spec.head_weight,
                cpu_batch,
                attention_docs,
                self.device,
                normalisers,
                t.mtp_loss_weight,
                balance_scale,
                compiled=self.compile_loss,
                head_grad=self.head_grad.micro_batch(k, len(batches)),
            )
            accumulate_stats(stats, self.hooks.forward_stats(out))
            loss.total.backward()
            parts += torch.stack([loss.total.detach(), loss.ce, loss.mtp, loss.balance]).double()
        self.parallel.sync_replicated_grads()
        # One SUM all-reduce for the losses, two flags (this rank saw a non-finite loss / a stop signal) and the
        # summed statistics; one MAX all-reduce for the max statistics.
        # ... and this rank's non-padding tokens, in total and (a mixture) per source (the cp ranks of a data rank
        # read the same batch: counted once).
        cp = self.parallel_dims.cp
        real_tokens = sum(int(mb["real_tokens"].sum()) for mb in micro_batches) / cp
        per_source = []
        if self.source_tokens is not None:
            counts = torch.zeros(len(self.source_tokens.counts), dtype=torch.float64)
            for mb in micro_batches:
                counts.index_add_(0, mb["source_ids"], mb["real_tokens"].double())
            per_source = (counts / cp).tolist()
        nonfinite_loss = (~torch.isfinite(parts).all()).to(torch.float64).reshape(1)
        host_part = torch.tensor(
            [float(self.stop_signal.received is not None), real_tokens, *per_source], dtype=torch.float64
        )
        extra = torch.cat([nonfinite_loss, to_device_async(host_part, self.device)])
        sums, global_stats = all_reduce_step(torch.cat([parts, extra]), stats)
        norm = grad_norm(list(self.model.parameters()))
        # The step's one wait for the device: everything the host decides or reports from is read here, before the
        # optimizer step is launched; nothing after that launch reads the device, so the host goes on to the next
        # step while the GPU runs the optimizer (a read after it would leave the GPU idle through the host's step
        # boundary once the optimizer is done).
        host_sums = sums.tolist()
        grad_norm_value = float(norm)
        host_stats = {name: value.cpu() for name, value in global_stats.items()}
        loss_value = host_sums[0]
        self._stop_requested = host_sums[5] > 0
        nonfinite = host_sums[4] > 0 or not math.isfinite(grad_norm_value)
        spike = None
        if not nonfinite and self.spike_detector is not None:
            spike = self.spike_detector.check(step, loss_value, grad_norm_value)
        if nonfinite or spike:
            self.optimizers.zero_grad()
            if nonfinite:
                self.train_state.skipped_steps += 1
                self.nonfinite_in_a_row += 1
                logger.warning(
                    "step %d: non-finite loss %.4g or grad norm %.4g: step skipped (%d in a row, %d in total)",
                    step, loss_value, grad_norm_value, self.nonfinite_in_a_row, self.train_state.skipped_steps,
                )  # fmt: skip
            else:
                self._warn_spike(step, loss_value, spike)
            model_metrics = self.hooks.after_step(host_stats, applied=False)
        else:
            self.nonfinite_in_a_row = 0
            self.optimizers.step(grad_scale=clip_coefficient(grad_norm_value, t.max_norm))
            model_metrics = self.hooks.after_step(host_stats, applied=True)
            self.lr_scheduler.step()
            self.optimizers.zero_grad()
            if self.source_tokens is not None:
                self.source_tokens.add(host_sums[7:])
        return StepRecord(
            step=step,
            loss=loss_value,
            ce_loss=host_sums[1],
            mtp_loss=host_sums[2],
            balance_loss=host_sums[3],
            grad_norm=grad_norm_value,
            lr=lr,
            tokens=t.local_batch_size * t.seq_len * len(micro_batches) * self.dp_size,
            real_tokens=round(host_sums[6]),
            step_time_s=0.0,
            skipped=nonfinite,
            spike=spike is not None,
            source_tokens=dict(self.source_tokens.counts) if self.source_tokens is not None else None,
            **model_metrics,
        )

    # ------------------------------------------------------------------ loss spikes
    def _warn_spike(self, step: int, loss: float, reason: str) -> None:
        d, policy = self.spike_detector, self.job_config.loss_spike.policy
        action = "not applied; rolling back to the last checkpoint" if policy == "rollback" else "step skipped"
        logger.warning(
            "step %d: loss spike, %s (loss %.4g, moving average %.4g): %s (%d in a row, %d in total)",
            step, reason, loss, d.averages()[0], action, d.consecutive, d.total,
        )  # fmt: skip

    @staticmethod
    def _log_compiled_since(seen: dict, when: str, level: int) -> dict:
        """Log at `level` what dynamo compiled since the snapshot `seen` (`compiled_since`), if anything; returns
        the new snapshot."""
        now = compile_stats(_COMPILE_REASONS)
        line = compiled_since(seen, now)
        if line is not None:
            logger.log(level, "[compile] %s %s", when, line)
        return now

    def _after_spike(self, step: int, metrics: MetricsLogger) -> None:
        """Stop after `max_consecutive` spikes in a row; with policy "rollback", reload the last checkpoint."""
        ls = self.job_config.loss_spike
        if self.spike_detector.consecutive >= ls.max_consecutive:
            raise LossSpikeError(
                f"{self.spike_detector.consecutive} loss spikes in a row (last: step {step}; "
                f"[loss_spike] max_consecutive = {ls.max_consecutive}); stopping. Lower optimizer.lr, check the "
                "data around these steps, or raise [loss_spike] loss_factor / grad_norm_factor"
            )
        if ls.policy == "rollback":
            self._roll_back_after_spike(step, metrics)

    def _roll_back_after_spike(self, step: int, metrics: MetricsLogger) -> None:
        """Reload the newest checkpoint (the detector keeps its statistics and counts), then put the data loader
        where it was after the spike step's batches: the batches of the steps from the checkpoint up to the spike
        are not read again. Without a checkpoint yet, the spike stays a skipped step."""
        data_after_spike = self.dataloader.state_dict()
        self.checkpointer.wait()  # an async save in flight is the newest checkpoint once published
        state = {k: v for k, v in self.checkpoint_state().items() if k != "spike_detector"}
        restored = self.checkpointer.load_latest(state)
        if restored is None:
            logger.warning("step %d: no checkpoint to roll back to yet; the spike step stays skipped", step)
            return
        reapply_lr_schedule(self.lr_scheduler)
        self.dataloader.load_state_dict(data_after_spike)
        metrics.rewind(restored)
        logger.warning(
            "rolled back from step %d to the checkpoint of step %d; the data continues after step %d's batches",
            step, restored, step,
        )  # fmt: skip

    # ------------------------------------------------------------------ the loop
    def fit(self) -> TrainResult:
        c = self.job_config
        self._resume_or_initial_load()
        start_step = self.train_state.step
        metrics = MetricsLogger(
            flops_per_token={
                conv: self.spec.flops_per_token(self.model_args, c.training.seq_len, conv) for conv in MFU_CONVENTIONS
            },
            total_steps=c.training.steps,
            log_freq=c.metrics.log_freq,
            run_folder=self.run_folder,
            device=self.device,
            world_size=world_size(),
            save_jsonl=c.metrics.save_jsonl,
            enable_wandb=c.metrics.enable_wandb,
            enable_tensorboard=c.metrics.enable_tensorboard,
            is_rank0=self.rank == 0,
            wandb_run_id=self.train_state.wandb_run_id or None,
            start_step=start_step,
        )
        run_id = [metrics.wandb_run_id or ""]
        if dist.is_initialized():  # only rank 0 talks to wandb; every rank stores the same id in the checkpoint
            dist.broadcast_object_list(run_id, src=0)
        self.train_state.wandb_run_id = run_id[0]
        profiler = StepProfiler(c.profiling, self.run_folder, self.rank, self.device)
        losses: dict[int, float] = {}
        compiled = None  # rank 0's compile_stats() after the last report (compile on), from the first step on
        data = iter(self.dataloader)
        self._stop_requested = False
        self.stop_signal.install()
        was_deterministic = torch.are_deterministic_algorithms_enabled()
        if c.training.deterministic:  # warn_only: ops without a deterministic kernel warn instead of failing
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            while self.train_state.step < c.training.steps:
                self.train_state.step += 1
                step = self.train_state.step
                t0 = time.perf_counter()
                micro_batches = [next(data) for _ in range(self.accum)]
                # the first step of a run compiles (minutes at full size): report its progress on rank 0
                compiling = c.compile.enable and step == start_step + 1 and self.rank == 0
                try:
                    with (
                        profiler.step(step),
                        compile_progress(logger.info, 60.0) if compiling else contextlib.nullcontext(),
                    ):
                        rec = self.train_step(micro_batches)
                except torch.OutOfMemoryError as e:
                    raise torch.OutOfMemoryError(
                        f"out of memory at step {step}: {OOM_HINT}. Original error: {e}"
                    ) from e
                rec.step_time_s = time.perf_counter() - t0
                if self.triton_prebuild is not None:  # its work is the first step's; later compiles build in process
                    if self.rank == 0:
                        logger.info("Triton prebuild: %s", self.triton_prebuild.summary())
                    self.triton_prebuild.close()
                    self.triton_prebuild = None
                if compiling:
                    compiled = compile_stats(_COMPILE_REASONS)
                    line, warning = compile_report(compiled, self.parallel.blocks_compiled_in_pieces)
                    logger.info(line)
                    if warning:
                        logger.warning(warning)
                elif compiled is not None:  # a later step should compile nothing: say what did, and why
                    compiled = self._log_compiled_since(compiled, f"step {step}", logging.WARNING)
                losses[step] = float("nan") if rec.skipped else rec.loss
                metrics.record(rec)
                if rec.spike:
                    self._after_spike(step, metrics)
                if rec.skipped and self.nonfinite_in_a_row >= c.training.max_consecutive_nonfinite:
                    raise NonFiniteLossError(
                        f"{self.nonfinite_in_a_row} consecutive steps (last: {step}) had a non-finite loss or gradient "
                        f"norm (training.max_consecutive_nonfinite = {c.training.max_consecutive_nonfinite}); "
                        "stopping without saving. Lower optimizer.lr, check the data, or resume from the last checkpoint"
                    )
                if self._stop_requested:
                    logger.warning(
                        "stop requested by signal: %s at step %d and exiting",
                        "saving a checkpoint" if self.checkpointer else "checkpointing is disabled, not saving",
                        step,
                    )
                    self._save(blocking=True)
                    break
                if self.validator is not None and (step % c.validation.freq == 0 or step == c.training.steps):
                    metrics.record_validation(step, self.validator.evaluate(self.model, step).metrics())
                    if compiled is not None:  # the first evaluation compiles its no-grad graphs: expected
                        compiled = self._log_compiled_since(compiled, f"validation at step {step}", logging.INFO)
                if not (rec.skipped or rec.spike) and step % c.checkpoint.interval == 0 and step < c.training.steps:
                    self._save()
                    self._export_hf_if_due(step)
            if not self._stop_requested and self.train_state.step == c.training.steps:
                self._save(blocking=True)
                self._export_hf_if_due(self.train_state.step)
        finally:
            profiler.close()
            torch.use_deterministic_algorithms(was_deterministic)
            self.stop_signal.restore()
            if self.checkpointer is not None:
                self.checkpointer.close()
            metrics.close()
        return self._result(start_step, losses, metrics)

    def _result(self, start_step: int, losses: dict, metrics: MetricsLogger) -> TrainResult:
        ck = self.checkpointer
        latest = ck.latest_step() if ck else None
        result = TrainResult(
            start_step=start_step,
            last_step=self.train_state.step,
            losses=losses,
            skipped_steps=self.train_state.skipped_steps,
            stopped_by_signal=self._stop_requested,
            run_folder=self.run_folder,
            checkpoint_folder=ck.folder if ck else None,
            metrics_path=metrics.jsonl_path if self.job_config.metrics.save_jsonl else None,
            last_checkpoint=ck.step_dir(latest) if latest is not None else None,
            spikes=self.spike_detector.total if self.spike_detector is not None else 0,
        )
        if self.rank == 0:
            lines = [f"run folder: {result.run_folder}"]
            if result.metrics_path:
                lines.append(f"metrics: {result.metrics_path}")
            if result.last_checkpoint:
                lines.append(f"last checkpoint: {result.last_checkpoint}")
                lines.append(
                    "export to HuggingFace: python -m llm_training.convert dcp-to-hf "
                    f"{result.last_checkpoint} <out_dir> --dtype {self.job_config.checkpoint.export_dtype}"
                )
            logger.info("training finished at step %d.\n  %s", result.last_step, "\n  ".join(lines))
        return result


def _json(obj) -> str:
    import json

    return json.dumps(obj, sort_keys=True)


def _log_model_summary(spec, flavor: str, model_args, seq_len: int) -> None:
    """Parameter counts and training FLOPs/token of the flavor (from the args, through the family's spec)."""
    counts = spec.param_counts(model_args)
    logger.info(
        "model %s/%s: total params %s (+ MTP %s), active params/token %s; training FLOPs/token at seq %d: "
        "%.4g (megatron), %.4g (torchtitan)",
        spec.name,
        flavor,
        f"{counts.total:,}",
        f"{counts.mtp:,}",
        f"{counts.active:,}",
        seq_len,
        spec.flops_per_token(model_args, seq_len, "megatron"),
        spec.flops_per_token(model_args, seq_len, "torchtitan"),
    )


def train(job_config, parallel_dims, device: torch.device) -> TrainResult:
    """Build a Trainer for `job_config` and run it to the end (or to a stop signal)."""
    return Trainer(job_config, parallel_dims, device).fit()
