"""Distributed building blocks: parallel degrees and device meshes (more helpers live beside it)."""

from llm_training.distributed.parallel_dims import ParallelDims

__all__ = ["ParallelDims"]
