"""The skip rule of the tests that run our Triton kernels: on CUDA, or on the CPU under the Triton interpreter
(TRITON_INTERPRET=1 with triton installed, the README's torch 2.11 command); they also carry the `gpu` marker, so
`-m gpu` runs them on the device."""

import importlib.util
import os

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton_kernels = pytest.mark.skipif(
    not (HAS_TRITON and (torch.cuda.is_available() or INTERPRET)),
    reason="needs triton and CUDA (or TRITON_INTERPRET=1 with triton)",
)
