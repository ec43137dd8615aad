"""Newton-Schulz orthogonalisation (model-spec §8.1): approximate U V^T of a (batch of) matrices.

    X = M / (||M||_F + eps);  transpose when rows > cols;
    repeat `steps` times:  P = X X^T;  X <- a X + (b P + c P^2) X;   transpose back.

`(a, b, c) = (3.4445, -4.7750, 2.0315)` (Keller Jordan's quintic): the singular values of the result land
in roughly [0.7, 1.2] instead of exactly 1, which is what Muon wants (speed over exactness).

The two symmetric products (X X^T, and b P + c P P^T = b P + c P^2 with the axpy fused in the epilogue) go
through `gram()`, which uses `bmm` / `baddbmm` by default and the Triton kernel in `triton_gram.py` for CUDA
tensors when `MUON_GRAM_BACKEND=triton` (measured on an H200, bench/bench_optimizer.py: the Triton kernel
is about 2x slower than cuBLAS at the motif3_small attention/MLP shapes and on par for the batched expert
stacks, so it is opt-in until it wins); the last product
`a X + poly X` is one `baddbmm`. Matrices are flattened to one batch dim [B, m, k] for the loop.
"""

from __future__ import annotations

import os

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def default_ns_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (tensor cores; Muon tolerates it), fp32 elsewhere (CPU bf16 matmul is slow)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _use_triton(x: torch.Tensor) -> bool:
    backend = os.environ.get("MUON_GRAM_BACKEND", "torch")
    if backend not in ("torch", "triton"):
        raise ValueError(f"MUON_GRAM_BACKEND={backend!r}; use 'torch' (default) or 'triton'")
    if x.device.type != "cuda" or backend == "torch":
        return False
    from optimizer import triton_gram  # lazy: importing the package must work without triton

    return triton_gram.available()


def gram(x: torch.Tensor, add: torch.Tensor | None = None, alpha: float = 1.0, beta: float = 0.0) -> torch.Tensor:
    """alpha * X X^T (+ beta * add, `add` symmetric) for `x` [B, m, k] -> [B, m, m] (symmetric)."""
    if _use_triton(x):
        from optimizer.triton_gram import gram_triton

        return gram_triton(x, add, alpha, beta)
    if add is None:
        return torch.bmm(x, x.mT) if alpha == 1.0 else torch.bmm(x, x.mT).mul_(alpha)
    return torch.baddbmm(add, x, x.mT, beta=beta, alpha=alpha)


def newton_schulz(
    m: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Orthogonalise `m` [..., A, B] (each trailing matrix independently); returns `dtype`
    (default: `default_ns_dtype(m.device)`) with the shape of `m`."""
    if m.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a batch of matrices, got shape {tuple(m.shape)}")
    a, b, c = coefficients
    dtype = dtype or default_ns_dtype(m.device)
    x = m.to(dtype)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    # Frobenius norm per matrix, computed in fp32 for range safety, applied in the NS dtype.
    norm = torch.linalg.vector_norm(x.float(), dim=(-2, -1), keepdim=True)
    x = (x / (norm + eps).to(dtype)).reshape(-1, x.shape[-2], x.shape[-1]).contiguous()  # [B, m, k]
    for _ in range(steps):
        p = gram(x)  # P = X X^T   [B, m, m]
        poly = gram(p, add=p, alpha=c, beta=b)  # b P + c P^2   (P symmetric => P P^T = P^2)
        x = torch.baddbmm(x, poly, x, beta=a)  # a X + poly X
    x = x.reshape(*m.shape[:-2], *x.shape[-2:])
    return x.mT if transposed else x
