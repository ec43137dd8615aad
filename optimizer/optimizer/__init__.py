"""optimizer: Muon (single-device and FSDP2/DTensor-distributed), QK-clip, parameter grouping, LR schedules.

Independent of llm_training: model-specific rules (which FQN goes where, attention layouts) are passed in.
"""

from optimizer.grouping import GroupRule, ParamGrouping, group_parameters
from optimizer.lr_schedule import LRScheduler, build_lr_scheduler, lr_factor
from optimizer.muon import Muon
from optimizer.newton_schulz import newton_schulz
from optimizer.optimizers import OptimizersContainer, build_optimizers
from optimizer.qk_clip import QKClipStats, QKLayout, qk_clip_

__all__ = [
    "GroupRule",
    "LRScheduler",
    "Muon",
    "OptimizersContainer",
    "ParamGrouping",
    "QKClipStats",
    "QKLayout",
    "build_lr_scheduler",
    "build_optimizers",
    "group_parameters",
    "lr_factor",
    "newton_schulz",
    "qk_clip_",
]
