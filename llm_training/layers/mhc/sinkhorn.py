"""mHC's Sinkhorn projection onto doubly stochastic matrices (docs/model-spec.md §4.2): exp(clamp(Z, +-20)), then
`iters` x {divide the rows by max(rowsum, 1e-8); the same for the columns}, in fp32 (or float64 for float64 input).

`sinkhorn(Z, iters)` runs, for fp32 CUDA tensors with triton installed, the fused kernels of
`layers.sinkhorn_kernels` as the custom op `torch.ops.llm_training.sinkhorn` (opaque to torch.compile: a block's
graph no longer carries 2 x iters reductions and divisions forward and their gradients backward, about half of
its nodes with 20 iterations), whose backward keeps only Z and recomputes the iterates in registers. Elsewhere
(CPU, float64, no triton) it runs `sinkhorn_reference`, the same arithmetic as plain tensor ops. (No `from
__future__ import annotations` here: the op schemas are inferred from the annotations.)
"""

import torch
from activation.backend import TRITON_AVAILABLE as _HAS_TRITON  # probed once, never in compiled code
from activation.triton_prebuild import capture_launches
from torch import Tensor

_EXP_CLAMP = 20.0
_FLOOR = 1e-8


def sinkhorn_reference(logits_NN: Tensor, iters: int) -> Tensor:
    """The projection as plain tensor ops over [..., n, n] (module docstring)."""
    m = torch.exp(logits_NN.to(torch.promote_types(logits_NN.dtype, torch.float32)).clamp(-_EXP_CLAMP, _EXP_CLAMP))
    for _ in range(iters):
        m = m / m.sum(dim=-1, keepdim=True).clamp_min(_FLOOR)
        m = m / m.sum(dim=-2, keepdim=True).clamp_min(_FLOOR)
    return m


def _kernels():
    from llm_training.layers.mhc import sinkhorn_kernels  # imports triton

    return sinkhorn_kernels


@torch.library.custom_op("llm_training::sinkhorn", mutates_args=())
def _sinkhorn_op(logits_Tnn: Tensor, iters: int) -> Tensor:
    return _kernels().sinkhorn_fwd(logits_Tnn, iters)


@_sinkhorn_op.register_fake
def _sinkhorn_fake(logits_Tnn, iters):
    capture_launches(lambda: _kernels().sinkhorn_fwd(logits_Tnn, iters), logits_Tnn, what="sinkhorn")
    return torch.empty_like(logits_Tnn)


@torch.library.custom_op("llm_training::sinkhorn_bwd", mutates_args=())
def _sinkhorn_bwd_op(logits_Tnn: Tensor, grad_Tnn: Tensor, iters: int) -> Tensor:
    return _kernels().sinkhorn_bwd(logits_Tnn, grad_Tnn, iters)


@_sinkhorn_bwd_op.register_fake
def _sinkhorn_bwd_fake(logits_Tnn, grad_Tnn, iters):
    launch = lambda: _kernels().sinkhorn_bwd(logits_Tnn, grad_Tnn, iters)
    capture_launches(launch, logits_Tnn, what="sinkhorn_bwd")
    return torch.empty_like(logits_Tnn)


def _setup_context(ctx, inputs, output):
    logits_Tnn, iters = inputs
    ctx.save_for_backward(logits_Tnn)
    ctx.iters = iters


def _backward(ctx, grad_Tnn):
    (logits_Tnn,) = ctx.saved_tensors
    return _sinkhorn_bwd_op(logits_Tnn, grad_Tnn.contiguous(), ctx.iters), None


_sinkhorn_op.register_autograd(_backward, setup_context=_setup_context)


def uses_kernels(logits_NN: Tensor) -> bool:
    """Whether `sinkhorn` runs the fused kernels for this input: fp32 on CUDA, triton installed."""
    return _HAS_TRITON and logits_NN.is_cuda and logits_NN.dtype == torch.float32


def sinkhorn(logits_NN: Tensor, iters: int) -> Tensor:
    """Doubly stochastic matrices [..., n, n] from logits [..., n, n] (module docstring)."""
    if not uses_kernels(logits_NN):
        return sinkhorn_reference(logits_NN, iters)
    n = logits_NN.shape[-1]
    out = _sinkhorn_op(logits_NN.reshape(-1, n, n).contiguous(), iters)
    return out.view(logits_NN.shape)
