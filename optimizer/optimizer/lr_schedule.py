"""LR schedules: linear warmup, then cosine, linear, or warmup-stable-decay (WSD), each down to
`min_lr_factor`; one scheduler drives the param groups of several optimizers.

Step `s` (0-based) is the index of the optimizer step the factor is used for. With W warmup steps and
T total steps:
    warmup   (s < W):     f = (s + 1) / W                        (the first step already trains)
    cosine / linear:      p = (s - W + 1) / (T - W), clamped to [0, 1]
                          cosine f = m + (1 - m) * (1 + cos(pi p)) / 2;  linear f = 1 - (1 - m) p
    wsd:                  D = round(wsd_decay_ratio * T) decay steps at the end (at most T - W);
                          f = 1 before T - D, then p = (s - (T - D) + 1) / D and f = 1 - (1 - m) p
So the last step (s = T - 1) runs at exactly `min_lr_factor`; steps past T stay there.
"""

from __future__ import annotations

import math

import torch

DECAY_TYPES = ("cosine", "linear", "wsd")


def lr_factor(
    step: int, warmup_steps: int, total_steps: int, decay_type: str, min_lr_factor: float, wsd_decay_ratio: float
) -> float:
    """Multiplier on the base LR for optimizer step `step` (see module doc)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    m = min_lr_factor
    if decay_type == "wsd":
        decay = min(round(wsd_decay_ratio * total_steps), total_steps - warmup_steps)
        start = total_steps - decay
        if decay <= 0 or step < start:
            return 1.0
        p = min(1.0, (step - start + 1) / decay)
        return 1.0 - (1.0 - m) * p
    p = min(1.0, max(0.0, (step - warmup_steps + 1) / max(1, total_steps - warmup_steps)))
    if decay_type == "cosine":
        return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * p))
    if decay_type == "linear":
        return 1.0 - (1.0 - m) * p
    raise ValueError(f"[lr_scheduler] decay_type {decay_type!r} is not one of {DECAY_TYPES}")


class LRScheduler:
    """Sets `group["lr"] = group["initial_lr"] * lr_factor(step)` for every group of every optimizer.

    `step()` is called after each optimizer step (LambdaLR convention); `state_dict()` holds the step count,
    so a resumed run continues the schedule. Construction applies the step-0 factor.
    """

    def __init__(
        self,
        optimizers: list[torch.optim.Optimizer],
        warmup_steps: int,
        total_steps: int,
        decay_type: str = "cosine",
        min_lr_factor: float = 0.1,
        wsd_decay_ratio: float = 0.2,
    ) -> None:
        if decay_type not in DECAY_TYPES:
            raise ValueError(f"[lr_scheduler] decay_type {decay_type!r} is not one of {DECAY_TYPES}")
        if not 0 <= warmup_steps <= total_steps or total_steps <= 0:
            raise ValueError(
                f"[lr_scheduler] warmup_steps={warmup_steps} must be in [0, training.steps={total_steps}] "
                "and training.steps > 0"
            )
        if not 0.0 <= min_lr_factor <= 1.0 or not 0.0 <= wsd_decay_ratio <= 1.0:
            raise ValueError(
                f"[lr_scheduler] min_lr_factor={min_lr_factor} and wsd_decay_ratio={wsd_decay_ratio} must be in [0, 1]"
            )
        self.optimizers = list(optimizers)
        self.schedule = dict(
            warmup_steps=warmup_steps,
            total_steps=total_steps,
            decay_type=decay_type,
            min_lr_factor=min_lr_factor,
            wsd_decay_ratio=wsd_decay_ratio,
        )
        for opt in self.optimizers:
            for group in opt.param_groups:
                group.setdefault("initial_lr", group["lr"])
        self.last_step = 0
        self._set_lrs()

    def factor(self) -> float:
        return lr_factor(self.last_step, **self.schedule)

    def _set_lrs(self) -> None:
        f = self.factor()
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * f

    def step(self) -> None:
        self.last_step += 1
        self._set_lrs()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for opt in self.optimizers for g in opt.param_groups]

    def state_dict(self) -> dict:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        self.last_step = int(state["last_step"])
        self._set_lrs()


def build_lr_scheduler(optimizers: list[torch.optim.Optimizer], total_steps: int, **schedule) -> LRScheduler:
    """`LRScheduler(optimizers, total_steps=..., warmup_steps=..., decay_type=..., ...)`."""
    return LRScheduler(optimizers, total_steps=total_steps, **schedule)
