"""Finite loss-spike detection (`[loss_spike]`): moving averages of the loss and the gradient norm over recent good
steps, and the test that flags a step jumping above them.

The trainer calls `check(step, loss, grad_norm)` once per step with the globally reduced loss and the gradient norm
before clipping (the same numbers on every rank), so every rank reaches the same verdict without a collective. A
good step enters the averages; a spike does not, and counts towards `consecutive`, which only a good step past the
last spike's step resets (after a rollback, re-trained steps before the spike do not reset it). The state is part of
the checkpoint (`spike_detector` key, JSON; optional there, so that detection can be switched on when resuming a
checkpoint saved without it), so a resumed run detects exactly as the uninterrupted one would.
"""

from __future__ import annotations

import json
from collections import deque


class LossSpikeDetector:
    """Running statistics of the recent good steps and the spike test (see the module doc)."""

    optional_in_checkpoint = True  # safe_dcp_load leaves it as it is when a checkpoint has no entry for it

    def __init__(self, loss_factor: float, grad_norm_factor: float, window: int, warmup_steps: int):
        self.loss_factor = loss_factor
        self.grad_norm_factor = grad_norm_factor  # 0: the gradient norm is not tested
        self.warmup_steps = warmup_steps
        self.recent: deque[tuple[float, float]] = deque(maxlen=window)  # (loss, grad_norm) of good steps
        self.good_steps = 0
        self.total = 0  # spikes seen by this run and the runs it resumed from
        self.consecutive = 0
        self.last_spike_step = 0

    @classmethod
    def from_config(cls, loss_spike) -> LossSpikeDetector:
        """The detector of a `[loss_spike]` section."""
        return cls(loss_spike.loss_factor, loss_spike.grad_norm_factor, loss_spike.window, loss_spike.warmup_steps)

    def averages(self) -> tuple[float, float]:
        """Mean loss and mean gradient norm of the recent good steps (nan before the first)."""
        if not self.recent:
            return float("nan"), float("nan")
        return (
            sum(loss for loss, _ in self.recent) / len(self.recent),
            sum(norm for _, norm in self.recent) / len(self.recent),
        )

    def check(self, step: int, loss: float, grad_norm: float) -> str | None:
        """The reason step `step` is a spike (None: a good step, now part of the averages)."""
        reason = None
        if self.good_steps >= self.warmup_steps and self.recent:
            mean_loss, mean_norm = self.averages()
            if loss > self.loss_factor * mean_loss:
                reason = f"loss {loss:.4g} > {self.loss_factor:g} x moving average {mean_loss:.4g}"
            elif self.grad_norm_factor > 0 and grad_norm > self.grad_norm_factor * mean_norm:
                reason = f"grad norm {grad_norm:.4g} > {self.grad_norm_factor:g} x moving average {mean_norm:.4g}"
        if reason is None:
            self.recent.append((loss, grad_norm))
            self.good_steps += 1
            if step > self.last_spike_step:
                self.consecutive = 0
        else:
            self.total += 1
            self.consecutive += 1
            self.last_spike_step = step
        return reason

    def state_dict(self) -> dict:
        state = {
            "recent_loss": [loss for loss, _ in self.recent],
            "recent_grad_norm": [norm for _, norm in self.recent],
            "good_steps": self.good_steps,
            "total": self.total,
            "consecutive": self.consecutive,
            "last_spike_step": self.last_spike_step,
        }
        return {"json": json.dumps(state)}  # one string: DCP would flatten the lists into per-element keys

    def load_state_dict(self, saved: dict) -> None:
        state = json.loads(saved["json"])
        self.recent.clear()
        self.recent.extend(zip(map(float, state["recent_loss"]), map(float, state["recent_grad_norm"])))
        self.good_steps = int(state["good_steps"])
        self.total = int(state["total"])
        self.consecutive = int(state["consecutive"])
        self.last_spike_step = int(state["last_spike_step"])
