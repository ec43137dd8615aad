"""The micro-batch as the model and the loss consume it, prepared once before the model.

The data loader yields `input_ids`, `labels` (next-token targets, -100 = ignore), `position_ids` and
`document_ids`, all [B, S]. `prepare_batch` adds what multi-token prediction needs, shifted per packed document:
MTP module k (0-based) embeds t_{i+k+1} at position i (`mtp_input_ids[k]`) and predicts the label k+1 positions
further on (`mtp_labels[k]`, -100 where that position belongs to another document or is past the row's end).
Every tensor of a `PreparedBatch` is [B, S] and aligned on the sequence dim, so a context-parallel split slices
all of them the same way (`PreparedBatch.map`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch

from llm_training.trainer.losses import shift_labels


@dataclass
class PreparedBatch:
    """One micro-batch, every tensor [B, S]."""

    input_ids: torch.Tensor  # long
    labels: torch.Tensor  # long, -100 = ignore
    position_ids: torch.Tensor  # long, restarts at 0 per packed document
    document_ids: torch.Tensor  # int, packed-document index per token
    mtp_input_ids: list[torch.Tensor]  # per MTP module k: the ids it embeds (t_{i+k+1})
    mtp_labels: list[torch.Tensor]  # per MTP module k: its targets (labels shifted k+1 more, per document)

    def targets(self) -> list[torch.Tensor]:
        """The label tensors of every loss term: main CE first, then each MTP module."""
        return [self.labels, *self.mtp_labels]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "PreparedBatch":
        """A batch with `fn` applied to every tensor (device moves, context-parallel slicing)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = [fn(t) for t in value] if isinstance(value, list) else fn(value)
        return PreparedBatch(**out)


def prepare_batch(
    raw: dict[str, torch.Tensor], num_mtp: int, mtp_inputs: Callable[[torch.Tensor, int], list[torch.Tensor]]
) -> PreparedBatch:
    """The loader's batch dict plus the MTP inputs (the family's `ModelSpec.mtp_inputs`) and targets of `num_mtp`
    modules (on the batch's device)."""
    labels, document_ids = raw["labels"], raw["document_ids"]
    return PreparedBatch(
        input_ids=raw["input_ids"],
        labels=labels,
        position_ids=raw["position_ids"],
        document_ids=document_ids,
        mtp_input_ids=mtp_inputs(raw["input_ids"], num_mtp),
        mtp_labels=[shift_labels(labels, k + 1, document_ids) for k in range(num_mtp)],
    )
