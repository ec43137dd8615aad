"""Job configuration: dataclasses per TOML section, TOML + `--section.key` parsing, validation, TOML dump."""

from llm_training.config.job_config import (
    ActivationCheckpoint,
    Checkpoint,
    Compile,
    HuggingFaceDataset,
    Job,
    JobConfig,
    LossSpike,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Quantize,
    Training,
)
from llm_training.config.manager import ConfigManager
from llm_training.config.toml_writer import to_toml
from llm_training.config.validate import (
    grad_accumulation_steps,
    validate_config,
    validate_environment,
    validate_for_world_size,
)
from llm_training.errors import ConfigError

__all__ = [
    "ActivationCheckpoint",
    "Checkpoint",
    "Compile",
    "ConfigError",
    "ConfigManager",
    "HuggingFaceDataset",
    "Job",
    "JobConfig",
    "LossSpike",
    "LRScheduler",
    "Metrics",
    "Model",
    "Optimizer",
    "Parallelism",
    "Quantize",
    "Training",
    "grad_accumulation_steps",
    "to_toml",
    "validate_config",
    "validate_environment",
    "validate_for_world_size",
]
