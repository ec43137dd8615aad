"""The fused mHC backward kernels (`layers.mhc_kernels`) as custom ops, opaque to torch.compile, and the rule
for when `layers.mhc` uses them: CUDA tensors of a floating dtype up to fp32 and triton installed. Elsewhere
mHC's backward runs as tensor ops.

Every op takes the stream either as `x` or as its source (x0, h0, p0, y0: X = mix(X0, H0, p0, y0)), the other
left None. (No `from __future__ import annotations` here: the op schemas are inferred from the annotations.)
"""

from typing import Optional

import torch
from activation.backend import TRITON_AVAILABLE  # probed once, never in compiled code
from activation.triton_prebuild import capture_launches
from torch import Tensor

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _kernels():
    from llm_training.layers.mhc import kernels as mhc_kernels  # imports triton

    return mhc_kernels


def uses_stream_kernels(x: Tensor) -> bool:
    """Whether mHC's backward runs the fused kernels for a stream like `x` [..., n, H]."""
    return TRITON_AVAILABLE and x.is_cuda and x.dtype in _KERNEL_DTYPES


def _stream_shape(x: Optional[Tensor], x0: Optional[Tensor]) -> tuple:
    return tuple((x if x is not None else x0).shape)


def _stream_dtype(x: Optional[Tensor], x0: Optional[Tensor]) -> torch.dtype:
    return (x if x is not None else x0).dtype


@torch.library.custom_op("llm_training::mhc_mix_bwd", mutates_args=())
def mix_backward(
    g: Tensor, x: Optional[Tensor], h: Tensor, p: Tensor, y: Tensor,
    x0: Optional[Tensor], h0: Optional[Tensor], p0: Optional[Tensor], y0: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """X' = H X + p y over [T, n, H] streams: (dX, dH, dp, dy) from g = dX'."""
    return _kernels().mix_backward(g, x, h, p, y, (x0, h0, p0, y0))


@mix_backward.register_fake
def _(g, x, h, p, y, x0, h0, p0, y0):
    capture_launches(lambda: _kernels().mix_backward(g, x, h, p, y, (x0, h0, p0, y0)), g, what="mhc mix_backward")
    return (
        g.new_empty(_stream_shape(x, x0), dtype=_stream_dtype(x, x0)),
        h.new_empty(h.shape, dtype=torch.float32),
        p.new_empty(p.shape, dtype=torch.float32),
        y.new_empty(y.shape),
    )


@torch.library.custom_op("llm_training::mhc_collapse_bwd", mutates_args=())
def collapse_backward(
    gu: Tensor, x: Optional[Tensor], h: Tensor,
    x0: Optional[Tensor], h0: Optional[Tensor], p0: Optional[Tensor], y0: Optional[Tensor],
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """u = sum_i h[i] X[i] over [T, n, H] streams: (dX, dh) from gu = du."""
    return _kernels().collapse_backward(gu, x, h, (x0, h0, p0, y0))


@collapse_backward.register_fake
def _(gu, x, h, x0, h0, p0, y0):
    launch = lambda: _kernels().collapse_backward(gu, x, h, (x0, h0, p0, y0))
    capture_launches(launch, gu, what="mhc collapse_backward")
    return gu.new_empty(_stream_shape(x, x0), dtype=_stream_dtype(x, x0)), h.new_empty(h.shape, dtype=torch.float32)


__all__ = ["collapse_backward", "mix_backward", "uses_stream_kernels"]
