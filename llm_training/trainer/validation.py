"""Validation: the training loss on held-out data (`[validation]`), evaluated every `freq` optimizer steps.

`data.build_dataloader(..., validation=True)` reads `[validation] dataset_path` with the training data machinery
(the same chat rendering, loss masks, packing and seq_len; sharded by data-parallel rank) in file order. `Validator.evaluate` rewinds that loader to its start and runs `steps` batches through the model in
eval mode under `torch.no_grad()`, so every evaluation sees the same batches and numbers compare across steps.

The loss is the training loss without the balance term (`trainer.losses.micro_batch_loss`; batches prepared with
`prepare_batch` and split by `shard_batch` under context parallelism, as `Trainer.train_step` does): the main
cross-entropy per labelled token and the mean over MTP modules of each one's cross-entropy per labelled target,
both token-weighted over all batches and ranks (the labelled-token counts are summed over the world first, as
the training normalisers are). Perplexity is exp(main cross-entropy). No backward runs, so the gradient-sync
settings of the parallelizer are left alone and no parameter gets a gradient.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from llm_training.data.dataloader import PackedDataLoader
from llm_training.distributed.context_parallel import shard_batch
from llm_training.distributed.utils import all_reduce_
from llm_training.trainer.batch import prepare_batch
from llm_training.trainer.losses import count_labelled_tokens, forward_loss


@dataclass
class ValidationResult:
    """One evaluation, reduced over all ranks."""

    step: int  # the optimizer step after which it ran
    loss: float  # main cross-entropy per labelled token
    mtp_loss: float  # mean over MTP modules of their cross-entropy per labelled target (0 without MTP)
    tokens: int  # labelled tokens of the main loss over all batches and ranks
    time_s: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf  # exp overflows a float past ~709

    def metrics(self) -> dict[str, float | int]:
        """The record's values as metrics.jsonl / W&B / TensorBoard name them."""
        return {
            "val_loss": self.loss,
            "val_ppl": self.perplexity,
            "val_mtp_loss": self.mtp_loss,
            "val_tokens": self.tokens,
            "val_time_s": self.time_s,
        }


class Validator:
    """Evaluates a model on the first `steps` batches of `loader` (the same batches at every call).

    `spec` is the model family's ModelSpec (head weight, MTP inputs), `num_mtp` the model's MTP module count,
    `context_parallel` the trainer's `parallel.context_parallel` split (None without context parallelism)."""

    def __init__(
        self,
        loader: PackedDataLoader,
        steps: int,
        spec,
        num_mtp: int,
        context_parallel,
        device: torch.device,
        compiled_loss: bool = False,
    ):
        self.loader, self.steps, self.spec, self.num_mtp = loader, steps, spec, num_mtp
        self.context_parallel, self.device, self.compiled_loss = context_parallel, device, compiled_loss
        self._start_state = loader.state_dict()

    def _batches(self) -> list[dict[str, torch.Tensor]]:
        """The first `steps` batches of the loader, read again from its start."""
        self.loader.load_state_dict(self._start_state)
        return [self.loader.next_batch() for _ in range(self.steps)]

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, step: int) -> ValidationResult:
        """The validation loss of `model` (every rank calls it: the forward and the sums are collective); the
        model is in eval mode meanwhile and back in its previous mode after."""
        t0 = time.perf_counter()
        local = [
            shard_batch(self.context_parallel, prepare_batch(raw, self.num_mtp, self.spec.mtp_inputs))
            for raw in self._batches()
        ]
        normalisers = all_reduce_(sum(count_labelled_tokens(b.targets()) for b, _ in local).to(self.device))
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # main CE, MTP (each already normalised)
        was_training = model.training
        model.eval()
        try:
            for cpu_batch, attention_docs in local:
                _, loss = forward_loss(
                    model,
                    self.spec.head_weight,
                    cpu_batch,
                    attention_docs,
                    self.device,
                    normalisers,
                    mtp_loss_weight=1.0,  # only the total uses the weight; mtp is reported unweighted
                    balance_scale=0.0,
                    compiled=self.compiled_loss,
                )
                sums += torch.stack([loss.ce, loss.mtp]).double()
        finally:
            model.train(was_training)
        sums = all_reduce_(sums)
        return ValidationResult(
            step=step,
            loss=sums[0].item(),
            mtp_loss=sums[1].item(),
            tokens=int(normalisers[0].item()),
            time_s=time.perf_counter() - t0,
        )


__all__ = ["ValidationResult", "Validator"]
