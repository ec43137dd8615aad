"""Weight holders that are deliberately NOT `nn.Linear`, and the fp32-output GEMM they use.

Module-swapping converters (FP8 / MXFP8, `llm_training.quantization`) replace `nn.Linear` modules. Some
projections must never be converted, and some weights are never run through their module's forward (the
chunked loss multiplies `lm_head.weight` itself; mHC folds its three projections into one GEMM), so a swap
would silently miss them or change their numerics. Each such weight lives in one of these classes instead,
with the same parameter name (`<module>.weight`), so checkpoints and optimizer rules are unaffected:

  * `Fp32Projection`: a bias-free projection with fp32 output and fp32-faithful math whatever the weight's or
    input's dtype (router gate, GDLA lambda_proj, mHC proj_pre / proj_post / proj_res; docs/model-spec.md §6, §2.4,
    §4.2).
  * `OutputHead`: the vocabulary projection; its weight is read directly by the fused/chunked loss.

`matmul_fp32(a, b)`: a @ b with fp32 accumulation and fp32 (or the requested) output. On CUDA, an operand
that is bf16 is used as is (it is exact) and an fp32 operand is split into bf16 pairs hi + lo (hi = bf16(t),
lo = bf16(t - hi): t to ~2^-17 relative); the products run on bf16 tensor cores with fp32 accumulation
(`torch.mm(..., out_dtype=torch.float32)`, CUDA-only in torch 2.11/2.13) and the lo x lo term is dropped.

Why this and not TF32 (docs/model-spec.md §0.2 notes Motif's own router GEMM runs in TF32) or plain bf16: the spec's
"fp32" (header: compute in float32, cast back at the stated point) is about the accumulation, the outputs
and the fp32 weights. All our inputs are already bf16 activations (the router's and lambda_proj's normed
hidden, mHC's bf16 stream), so they are exact in bf16; only the fp32 weight needs more bits, and hi + lo
carries 16 of its 24 mantissa bits. Measured (float64 emulation, Motif-3 router E = 384, K = 8, H = 4096,
4096 normed bf16 tokens, gate N(0, 0.02^2)): logit error rms 2.4e-6 x the logits' spread, no top-8 selection
changed; TF32 (weight rounded to 11 bits) 2.1e-4 and 0.27% of tokens changed; bf16 weights 1.7e-3 and 2.0%.
It costs the FLOPs of TF32 (two bf16 passes = one TF32 pass) and needs no fp32 copy of the input, which TF32
or fp32 would (and TF32 would need a global flag; this is scoped to these GEMMs by construction). The test
is tests/layers/test_projection.py. On the CPU (and for fp32/fp64 inputs anywhere) the math is exact fp32 (or
the inputs' wider dtype), so CPU tests are strict.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _bf16_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """[t] if t is bf16 (exact), else [hi, lo] with hi + lo = t to ~2^-17 relative."""
    if t.dtype == torch.bfloat16:
        return [t]
    hi = t.to(torch.bfloat16)
    return [hi, (t - hi).to(torch.bfloat16)]


def on_tensor_cores(t: torch.Tensor) -> bool:
    """Whether `t` takes the bf16 tensor-core paths (CUDA). The CPU tests emulate those paths by patching this
    and the two `*_fp32_out` products below."""
    return t.is_cuda


def mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 @ bf16 with fp32 accumulation and fp32 output (CUDA-only in torch 2.11/2.13)."""
    return torch.mm(a, b, out_dtype=torch.float32)


def bmm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched bf16 @ bf16 with fp32 accumulation and fp32 output (CUDA-only in torch 2.11/2.13)."""
    return torch.bmm(a, b, out_dtype=torch.float32)


def _use_split_bf16(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float32, split_fp32_pair: bool = False
) -> bool:
    """The tensor-core path: CUDA, every operand bf16 or fp32, and either one of them bf16 (the inputs of the
    forward GEMMs), or a bf16 result (the backward's dx, which both split operands give to bf16 accuracy), or
    `split_fp32_pair` (the caller rounds the fp32 result to bf16 soon after). Otherwise (fp32 operands for an
    fp32 result, CPU, fp64) the math is exact in the wider dtype."""
    dtypes = {a.dtype, b.dtype}
    low = torch.bfloat16 in dtypes or out_dtype == torch.bfloat16 or split_fp32_pair
    return on_tensor_cores(a) and dtypes <= {torch.bfloat16, torch.float32} and low


def matmul_fp32(
    a_MK: torch.Tensor, b_KN: torch.Tensor, out_dtype: torch.dtype = torch.float32, split_fp32_pair: bool = False
) -> torch.Tensor:
    """a @ b with fp32 accumulation, returned in `out_dtype` (module docstring). 2-D operands.

    On CUDA with a bf16 operand the split pieces are concatenated along the SMALL operand's free dimension (or
    along K when both are split), so the large operand is never copied; the partial products are summed in
    fp32. `split_fp32_pair`: two fp32 operands for an fp32 result are split too (tensor cores instead of fp32
    FFMA; ~2^-17 relative per product), for results that are rounded to bf16 after a last fp32 step.
    Elsewhere: exact math in promote(a, b, fp32)."""
    if not _use_split_bf16(a_MK, b_KN, out_dtype, split_fp32_pair):
        ct = torch.promote_types(torch.promote_types(a_MK.dtype, b_KN.dtype), torch.float32)
        return (a_MK.to(ct) @ b_KN.to(ct)).to(out_dtype)
    A, B = _bf16_parts(a_MK), _bf16_parts(b_KN)
    if len(A) == 1 and len(B) == 1:
        return mm_fp32_out(a_MK, b_KN).to(out_dtype)
    if len(A) == 1:  # b split: [M, K] @ [K, 2N], then add the halves
        N = b_KN.shape[1]
        out = mm_fp32_out(a_MK, torch.cat(B, dim=1))
        return (out[:, :N] + out[:, N:]).to(out_dtype)
    if len(B) == 1:  # a split: [2M, K] @ [K, N]
        M = a_MK.shape[0]
        out = mm_fp32_out(torch.cat(A, dim=0), b_KN)
        return (out[:M] + out[M:]).to(out_dtype)
    # both split: hi.hi + hi.lo + lo.hi as one GEMM over a 3K contraction (fp32 accumulation inside)
    a_cat = torch.cat([A[0], A[0], A[1]], dim=1)
    b_cat = torch.cat([B[0], B[1], B[0]], dim=0)
    if out_dtype == torch.float32:
        return mm_fp32_out(a_cat, b_cat)
    return torch.mm(a_cat, b_cat).to(out_dtype)  # bf16 output, fp32 accumulation: one rounding


class _Fp32Linear(torch.autograd.Function):
    """y = x W^T (fp32 [..., out]) via `matmul_fp32`; saves x in its own dtype (no fp32 copy of the input).
    dx = g W in x's dtype (both split, one rounding at the output), dW = g^T x in fp32 (W's dtype)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        x_MK = x.reshape(-1, x.shape[-1])
        return matmul_fp32(x_MK, weight.t()).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g_MN = g.reshape(-1, g.shape[-1])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = matmul_fp32(g_MN, weight, out_dtype=x.dtype).view(x.shape)
        if ctx.needs_input_grad[1]:
            dw = matmul_fp32(g_MN.t(), x.reshape(-1, x.shape[-1]), out_dtype=weight.dtype)
        return dx, dw


class Fp32Projection(nn.Module):
    """y = x W^T with fp32 accumulation and fp32 output (`matmul_fp32`). weight [out_features, in_features].
    CPU, or fp32 input: exact fp32, as `F.linear(x.float(), W.float())`."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _use_split_bf16(x, self.weight):
            return F.linear(x.float(), self.weight.float())
        return _Fp32Linear.apply(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, compute=fp32"


class OutputHead(nn.Module):
    """Logits = hidden W^T in the hidden's dtype. weight [vocab_size, hidden_size]; training reads it directly
    (the chunked / fused cross-entropy never materialises the logits)."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight.to(hidden.dtype))  # an fp32 weight (one process) meets bf16 hiddens

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}"
