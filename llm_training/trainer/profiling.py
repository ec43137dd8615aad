"""`StepProfiler`: the `[profiling]` switches, a torch profiler trace and a CUDA memory snapshot of optimizer steps
start_step..end_step, on rank 0 or every rank, written under `<run folder>/<folder>/`:

  trace_rank<R>_steps<A>-<B>.json     Chrome trace (chrome://tracing, Perfetto); each step is a `train step N`
                                      range; CPU activity, and CUDA kernels on a GPU
  memory_rank<R>_steps<A>-<B>.pickle  the allocator's history over the same steps (pytorch.org/memory_viz)

A run that stops inside the range (a signal, an error) still writes what was recorded (`close`).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MEMORY_HISTORY_ENTRIES = 100_000  # allocator events kept (the oldest are dropped beyond)


class StepProfiler:
    """Starts before the first profiled step, stops after the last; no-op on ranks and steps outside the range."""

    def __init__(self, profiling, run_folder: Path, rank: int, device: torch.device):
        self.first = profiling.start_step
        self.last = profiling.end_step or profiling.start_step
        self.memory = profiling.memory_snapshot and device.type == "cuda"
        self.enabled = self.first > 0 and (profiling.ranks == "all" or rank == 0)
        self.folder = Path(run_folder) / profiling.folder
        self.name = f"rank{rank}_steps{self.first}-{self.last}"
        self.device = device
        self._profiler = None

    def step(self, step: int):
        """A context for the whole of optimizer step `step`: starts the recording at the first profiled step,
        labels the step, and writes the outputs after the last."""
        if not self.enabled or not self.first <= step <= self.last:
            return contextlib.nullcontext()
        return self._profiled_step(step)

    @contextlib.contextmanager
    def _profiled_step(self, step: int):
        if self._profiler is None:
            self._start()
        with torch.profiler.record_function(f"train step {step}"), self._whole_recomputes():
            yield
        if step == self.last:
            self.close()

    def _whole_recomputes(self):
        """While the allocator records its history, activation checkpointing recomputes each region to its end.

        torch 2.11 regression (pytorch/pytorch#179536): with the history on, an eager non-reentrant checkpoint
        whose recompute stops early (torch.utils.checkpoint raises inside the region once it has what the backward
        needs) loses that exception, and the backward fails with "SystemError: ... returned NULL without setting
        an exception" from an autograd Function inside the region (mHC's Sinkhorn). Recomputing whole regions
        raises nothing; it costs the rest of each region's forward, on the profiled steps only."""
        if not self.memory:
            return contextlib.nullcontext()
        from torch.utils.checkpoint import set_checkpoint_early_stop

        return set_checkpoint_early_stop(False)

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.__enter__()
        logger.info("profiling steps %d..%d into %s", self.first, self.last, self.folder)

    def close(self) -> None:
        """Stop the recording (if running) and write its files."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"trace_{self.name}.json"
        profiler.export_chrome_trace(str(trace))
        written = [trace]
        if self.memory:
            import pickle

            from llm_training.trainer.memory_peak import format_peak_breakdown, peak_breakdown

            recorded = torch.cuda.memory._snapshot()  # what _dump_snapshot pickles (pytorch.org/memory_viz reads it)
            torch.cuda.memory._record_memory_history(enabled=None)
            snapshot = self.folder / f"memory_{self.name}.pickle"
            with open(snapshot, "wb") as f:
                pickle.dump(recorded, f)
            written.append(snapshot)
            summary = self.folder / f"memory_{self.name}.txt"  # what holds the memory at its peak, by code site
            try:
                summary.write_text(format_peak_breakdown(peak_breakdown(recorded, self.device.index or 0)) + "\n")
                written.append(summary)
            except (KeyError, TypeError, ValueError) as e:  # a snapshot layout this reader does not know: the
                logger.warning("profiling: no memory summary (%s: %s); the snapshot is written", type(e).__name__, e)
        logger.info("profiling: wrote %s", ", ".join(str(p) for p in written))


__all__ = ["StepProfiler"]
