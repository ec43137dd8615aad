"""Diagnostic (device only, not a test): does one of our CUDA fast paths make the fused mHC pair's coefficient
gradients less accurate than the CPU path (tests/layers/test_mhc_gpu.py)? Runs the test's pair under variants that
switch one suspect off each (cuBLAS reduced-precision reduction, the split-bf16 GEMMs, the Sinkhorn kernel) and
prints every tensor's error vs float64. On the H200 (2026-12-02) every variant gave the same errors: none of them
is the cause, which is why that test's baseline is the same device's exact-fp32 run.

    PYTHONPATH=.:activations:optimizer python3 scripts/device/diag_mhc_precision.py
"""

import contextlib
from unittest import mock

import torch

from llm_training.layers import projection, sinkhorn
from tests.layers.test_mhc_gpu import _modules, _pair, _rel, _run_pair


def run(mods, x, w, g):
    return _run_pair(_pair, mods, x, w, g)


def main():
    n, H, B, S = 4, 1024, 2, 512
    torch.manual_seed(1)
    x = torch.randn(B, S, n, H, device="cuda").bfloat16()
    w = torch.rand(H, device="cuda").add(0.5).bfloat16()
    g = torch.randn(B, S, n, H, device="cuda").bfloat16()
    cpu = _modules(n, H, "cpu", torch.float32)
    ref = _modules(n, H, "cpu", torch.float64)
    exact = run(ref, x.cpu().double(), w.cpu().double(), g.cpu().double())
    cpu_path = run(cpu, x.cpu(), w.cpu(), g.cpu())
    names = ["out", "dx"] + [f"{k}.{nm}" for k, m in enumerate(cpu) for nm, _ in m.named_parameters()]

    variants = {
        "default": contextlib.nullcontext,
        "no bf16 reduced-precision reduction": lambda: mock.patch.object(
            torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False
        ),
        "exact fp32 GEMMs (no split-bf16)": lambda: mock.patch.object(
            projection, "_use_split_bf16", lambda *a, **k: False
        ),
        "Sinkhorn reference (no Triton kernel)": lambda: mock.patch.object(sinkhorn, "_HAS_TRITON", False),
    }
    print(f"{'tensor':<18}{'cpu':>10}" + "".join(f"{v[:16]:>18}" for v in variants))
    cols = {}
    for label, ctx in variants.items():
        with ctx():
            cols[label] = run(_modules(n, H, "cuda", torch.float32), x, w, g)
    for i, name in enumerate(names):
        print(
            f"{name:<18}{_rel(cpu_path[i], exact[i]):>10.2e}"
            + "".join(f"{_rel(cols[v][i], exact[i]):>18.2e}" for v in variants)
        )


if __name__ == "__main__":
    main()
