"""Backend choice: Triton kernels for CUDA tensors when triton imports, the PyTorch reference otherwise.

`configure(backend)` sets the process's choice (llm_training's `[kernels] activations`); the environment variable
`ACTIVATION_BACKEND`, when set, overrides it on every call: `auto` (default) as above, `torch` always the
reference, `triton` Triton or a clear error.
"""

from __future__ import annotations

import importlib.util
import os

import torch

BACKENDS = ("auto", "torch", "triton")


# Checked once at import, without importing triton (a plain constant keeps `torch.compile` tracing simple).
TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


_configured = "auto"


def configure(backend: str) -> None:
    """The backend every op uses from now on in this process (unless ACTIVATION_BACKEND is set)."""
    global _configured
    if backend not in BACKENDS:
        raise ValueError(f"activation backend {backend!r} is not one of {BACKENDS}")
    _configured = backend


def requested_backend() -> str:
    """ACTIVATION_BACKEND when set (validated), else the configured backend (default `auto`)."""
    value = os.environ.get("ACTIVATION_BACKEND", "").strip().lower() or _configured
    if value not in BACKENDS:
        raise ValueError(f"ACTIVATION_BACKEND={value!r} is not one of {BACKENDS}; unset it or pick one of those")
    return value


def use_triton(x: torch.Tensor) -> bool:
    """Whether the op on tensor `x` should run the Triton kernels."""
    backend = requested_backend()
    if backend == "torch":
        return False
    runnable = x.is_cuda and TRITON_AVAILABLE
    if backend == "triton" and not runnable:
        raise RuntimeError(
            f"ACTIVATION_BACKEND=triton but the input is on {x.device} and triton is "
            f"{'importable' if TRITON_AVAILABLE else 'not installed'}; Triton needs CUDA tensors and "
            "`pip install triton` (or set ACTIVATION_BACKEND=torch / auto)"
        )
    return runnable
