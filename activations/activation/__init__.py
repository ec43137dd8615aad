"""activation: fused PolyNorm / RMSNorm ops for Motif-3 with autograd.

Triton kernels run for CUDA tensors when triton is importable; the PyTorch reference (custom autograd
Functions with the analytic backward, fp32 math) runs everywhere else. `ACTIVATION_BACKEND=torch|triton`
overrides the choice. See activations/README.md.
"""

from .api import fused_add_rms_norm, fused_mul_poly_norm, grouped_poly_norm, poly_norm, rms_norm

__all__ = ["rms_norm", "fused_add_rms_norm", "poly_norm", "fused_mul_poly_norm", "grouped_poly_norm"]
