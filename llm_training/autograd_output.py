"""`function_output(t, dtype)`: what the autograd Functions of this package return.

torch 2.11 (the torch of our H200s) computes wrong gradients under torch.compile for an autograd.Function whose
forward returns an intermediate unchanged: a same-dtype `.to()` of it, or a tensor it also saved for backward
(found by running tests/distributed/test_compile.py with torch 2.11; torch 2.13 is correct). A Function returns
`function_output(result, dtype)` instead: the cast when the dtype differs (bf16 training: no extra work), else a
copy (fp32 models, i.e. CPU tests and debugging: one copy of the output).
"""

from __future__ import annotations

import torch


def function_output(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype` as a tensor distinct from t (module docstring)."""
    return t.to(dtype) if t.dtype != dtype else t.clone()
