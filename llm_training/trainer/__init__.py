"""Training: the loop (`train` / `Trainer`), losses, checkpointing (DCP), gradient clipping and metrics.

`llm_training.train` calls `train(job_config, parallel_dims, device) -> TrainResult` after `setup_distributed`.
"""

from llm_training.trainer.trainer import LossSpikeError, NonFiniteLossError, Trainer, TrainResult, train

__all__ = ["LossSpikeError", "NonFiniteLossError", "TrainResult", "Trainer", "train"]
