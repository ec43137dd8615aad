"""Gradient clipping by the global L2 norm over a mix of FSDP2 DTensor and plain (replicated) parameters.

DTensor grads: the norm of each group is a DTensor with a Partial placement; `.full_tensor()` reduces it
over the mesh once. Plain grads are identical on every rank (replicated params after their all-reduce),
so their norm is local. The two are combined as sqrt(a^2 + b^2) and the scale is applied per group
(foreach kernels cannot mix DTensor and plain tensors). Design follows torchtitan's clip_grad_norm_.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def _group_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm.float()


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip grads in place so their global L2 norm is <= max_norm (0: measure only); returns the norm
    before clipping (inf/nan when a grad is non-finite; grads are then left untouched)."""
    with_grad = [p for p in params if p.grad is not None]
    dtensor_params = [p for p in with_grad if isinstance(p.grad, DTensor)]
    plain_params = [p for p in with_grad if not isinstance(p.grad, DTensor)]
    norms = [_group_norm([p.grad for p in ps]) for ps in (dtensor_params, plain_params) if ps]
    if not norms:
        return 0.0
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
    if max_norm > 0 and torch.isfinite(total):
        for ps in (dtensor_params, plain_params):
            if ps:
                torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total, foreach=True)
    return float(total)
