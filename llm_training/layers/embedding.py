"""The token embedding: `nn.Embedding` (same parameter, `<module>.weight`) with a lookup the parallelizer turns on
where the table is a plain fp32 tensor outside FSDP2 (one process: `motif/parallelize.py`,
`Embedding.accumulate_grad_in_place`):

  * its rows are handed on in `output_dtype` (the compute dtype FSDP2's gathered copy of the table would give); the
    gradient comes back to the table's dtype in the backward;
  * its backward adds the looked-up rows' gradients straight into the table's `.grad` (fp32,
    created as zeros by the first backward after `zero_grad`), so the micro-batches of a step accumulate into one
    buffer. Autograd's own path makes a dense [V, H] gradient per micro-batch (a fill of the whole table, the
    scatter of the rows) and then adds it into `.grad` (a read of two [V, H] tensors and a write of one). At Motif-3's
    vocabulary (V 220160, H 4096), 4 micro-batches of 16384 ids per step, one H100 (bench/bench_embedding.py,
    session 38): 21.6 -> 4.9 ms per step, and 3.6 GiB less at the peak (no dense gradient beside `.grad`).
    The rows are added with `index_put_(accumulate=True)`: deterministic (on CUDA it sorts the indices and adds the
    rows of one token in their order, where `index_add_` would use atomics; on the CPU it runs serially). The table
    must then be a leaf that nothing else gives a gradient (FSDP2 and DTensor tables keep autograd's path), and its
    gradient is read from `.grad` after `backward()`: `torch.autograd.grad` would return None for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _LookupWithGradInPlace(torch.autograd.Function):
    """rows = table[ids] in `dtype`; the backward adds d rows into `table.grad` in place and hands autograd nothing."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, table_VH: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.table_VH = table_VH
        return F.embedding(ids, table_VH).to(dtype)

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor):
        (ids,) = ctx.saved_tensors
        table_VH = ctx.table_VH
        if table_VH.grad is None:
            table_VH.grad = torch.zeros_like(table_VH)
        grad_NH = grad_rows.reshape(-1, table_VH.shape[1]).to(table_VH.dtype)
        table_VH.grad.index_put_((ids.reshape(-1),), grad_NH, accumulate=True)
        return None, None, None


class Embedding(nn.Embedding):
    """A token lookup: `nn.Embedding`'s until `accumulate_grad_in_place` turns on the lookup of the module docstring.
    Without a padding index, max_norm, frequency scaling or sparse gradients (Motif-3 uses none)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.grad_in_place = False  # the backward accumulates into weight.grad itself (module docstring)
        self.output_dtype: torch.dtype | None = None  # the in-place lookup's rows' dtype; None: the table's

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.grad_in_place:
            return _LookupWithGradInPlace.apply(ids, self.weight, self.output_dtype or self.weight.dtype)
        return super().forward(ids)

    def accumulate_grad_in_place(self, output_dtype: torch.dtype | None) -> None:
        """Turn on the lookup of the module docstring for a table that is a plain tensor: rows in `output_dtype`
        (None: the table's), gradients added into `weight.grad` by the backward."""
        if type(self.weight.data) is not torch.Tensor:
            raise TypeError(
                f"Embedding.accumulate_grad_in_place needs a plain tensor table, got {type(self.weight.data).__name__}"
                " (a table FSDP2 or DTensor holds gets its gradient through autograd)"
            )
        self.output_dtype = output_dtype
        self.grad_in_place = True
