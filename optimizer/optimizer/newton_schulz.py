"""Newton-Schulz orthogonalisation (docs/model-spec.md §8.1): approximate U V^T of a (batch of) matrices.

    X = M / (||M||_F + eps);  transpose when rows > cols;
    repeat `steps` times:  P = X X^T;  X <- a X + (b P + c P^2) X;   transpose back.

Two entry points: `newton_schulz(m)` for any [..., A, B] (copies `m`), and `orthogonalise_wide_(stack)`, the
core Muon calls on a stack [N, m, k] of wide matrices it has already built in the NS dtype (same-shape
matrices of many parameters, tall ones transposed): normalisation with fp32 norms and fp32 division in place
on the stack, iterations in the NS dtype (bf16 on CUDA), all N matrices in one batched matmul per product.

`(a, b, c) = (3.4445, -4.7750, 2.0315)` (Keller Jordan's quintic): the singular values of the result land
in roughly [0.7, 1.2] instead of exactly 1, which is what Muon wants (speed over exactness).

The two symmetric products (X X^T, and b P + c P P^T = b P + c P^2 with the axpy fused in the epilogue) go
through `gram()`, which uses `bmm` / `baddbmm` by default and the Triton kernel in `triton_gram.py` for CUDA
tensors when the backend is `triton` (`set_gram_backend`, llm_training's `[kernels] muon_gram`; the environment
variable `MUON_GRAM_BACKEND`, when set, overrides it) (measured on an H200, bench/bench_optimizer.py: the Triton kernel
is about 2x slower than cuBLAS at the motif3_small attention/MLP shapes and on par for the batched expert
stacks, so it is opt-in until it wins); the last product is one `bmm` by `a I + b P + c P^2`: the `a X` term rides
on the [m, m] factor's diagonal (m additions), so no [N, m, k] operand is read or copied for it. The `baddbmm(X,
poly, X, beta=a)` form reads X once more in the epilogue and, because torch's out-of-place baddbmm first copies its
`input` into the result, copies the whole stack once per iteration (most of the 11.5 ms of device-to-device copies
per step under Muon in the session-38 profile, one H100; bench/bench_optimizer.py there: NS of proxy_16e's Muon
stacks 144.9 -> 135.3 ms). In bf16 the diagonal a + poly_ii is rounded once more (it
is added in fp32 to the rounded poly_ii): against an fp64 NS of the same inputs, the bf16 result's relative
Frobenius error is 1.58e-2 / 1.71e-2 / 1.25e-2 at [4, 24, 40] / [4, 64, 256] / [2, 256, 1024] where the `baddbmm`
form's is 1.42e-2 / 1.36e-2 / 1.18e-2 (CPU, fp32 accumulation like cuBLAS's); in fp32 the two forms agree to
rounding (the tests compare with torch.optim.Muon).
"""

from __future__ import annotations

import os

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def default_ns_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (tensor cores; Muon tolerates it), fp32 elsewhere (CPU bf16 matmul is slow)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


GRAM_BACKENDS = ("torch", "triton")
_gram_backend = "torch"


def set_gram_backend(backend: str) -> None:
    """The Gram-product backend of this process from now on (unless MUON_GRAM_BACKEND is set)."""
    global _gram_backend
    if backend not in GRAM_BACKENDS:
        raise ValueError(f"Muon Gram backend {backend!r} is not one of {GRAM_BACKENDS}")
    _gram_backend = backend


def _use_triton(x: torch.Tensor) -> bool:
    backend = os.environ.get("MUON_GRAM_BACKEND", "") or _gram_backend
    if backend not in GRAM_BACKENDS:
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


def orthogonalise_wide_(
    x: torch.Tensor, steps: int, coefficients: tuple[float, float, float], eps: float, out_scale: float = 1.0
) -> torch.Tensor:
    """NS of a contiguous stack of wide matrices `x` [N, m, k] (m <= k) in the NS dtype (x.dtype), which it
    overwrites with the normalised input: Frobenius norms accumulated in fp32 (at least), the division done in
    fp32 arithmetic and stored in place. Returns `out_scale` * NS(x), [N, m, k] in x.dtype; the scale is
    applied to the last iteration's [N, m, m] factor, so it costs no pass over the stack."""
    a, b, c = coefficients
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=torch.promote_types(x.dtype, torch.float32))
    x = x.div_(norm.add_(eps))  # [N, 1, 1] fp32 divisor: fp32 arithmetic, stored in x.dtype
    for step in range(steps):
        s = out_scale if step == steps - 1 else 1.0
        p = gram(x)  # P = X X^T   [N, m, m]
        poly = gram(p, add=p, alpha=c * s, beta=b * s)  # s (b P + c P^2)   (P symmetric => P P^T = P^2)
        diag = poly.diagonal(dim1=-2, dim2=-1)  # + s a I: N m elements, added in fp32 (a bf16 add_ of a Python
        diag.copy_(diag.float() + a * s)  # scalar rounds the scalar to bf16 on CPU: 3.4445 -> 3.4375)
        x = torch.bmm(poly, x)  # s (a I + b P + c P^2) X = s (a X + b P X + c P^2 X)
    return x


def newton_schulz(
    m: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Orthogonalise `m` [..., A, B] (each trailing matrix independently); returns `dtype`
    (default: `default_ns_dtype(m.device)`) with the shape of `m`. `m` is left untouched."""
    if m.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a batch of matrices, got shape {tuple(m.shape)}")
    dtype = dtype or default_ns_dtype(m.device)
    transposed = m.shape[-2] > m.shape[-1]
    wide = m.mT if transposed else m
    stack = torch.empty((wide.shape[:-2].numel(), *wide.shape[-2:]), device=m.device, dtype=dtype)
    stack.view(wide.shape).copy_(wide)
    x = orthogonalise_wide_(stack, steps, coefficients, eps).view(wide.shape)
    return x.mT if transposed else x
