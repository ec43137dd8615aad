"""The optimizers of a run: `build_optimizers(model, job_config, group_rules, forbidden)` builds Muon + AdamW and
one LR scheduler from the `[optimizer]` / `[lr_scheduler]` config. Which parameter goes where is the model
family's rule (`ModelSpec.optimizer_rules`; Motif-3's is `motif/optimizer_groups.py`); everything generic (Muon,
grouping engine, schedules) lives in the `optimizer` package.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from optimizer import LRScheduler, OptimizersContainer
from optimizer import build_optimizers as _build_generic

logger = logging.getLogger(__name__)


def build_optimizers(model: nn.Module, job_config, group_rules, forbidden: tuple[str, ...]) -> OptimizersContainer:
    """Muon + AdamW for `model` from `job_config.optimizer`, parameters grouped by the model family's
    `group_rules` (`forbidden`: names that must not be parameters), with `.lr_scheduler` (an `LRScheduler` over
    both optimizers, `job_config.lr_scheduler`, total steps = `job_config.training.steps`) attached.
    `[optimizer] name = "adamw"` puts every parameter in AdamW (matrices with decay)."""
    o, s = job_config.optimizer, job_config.lr_scheduler
    if o.name not in ("muon", "adamw"):
        raise ValueError(f"[optimizer] name {o.name!r} is not one of ('muon', 'adamw')")
    container = _build_generic(
        model,
        group_rules,
        forbidden=forbidden,
        lr=o.lr,
        weight_decay=o.weight_decay,
        use_muon=o.name == "muon",
        momentum=o.momentum,
        nesterov=o.nesterov,
        ns_steps=o.ns_steps,
        muon_momentum_dtype=getattr(torch, o.muon_momentum_dtype),
        adamw_betas=tuple(o.adamw_betas),
        adamw_eps=o.adamw_eps,
        log=logger.info,
    )
    container.lr_scheduler = LRScheduler(
        container.optimizers,
        warmup_steps=s.warmup_steps,
        total_steps=job_config.training.steps,
        decay_type=s.decay_type,
        min_lr_factor=s.min_lr_factor,
        wsd_decay_ratio=s.wsd_decay_ratio,
    )
    return container
