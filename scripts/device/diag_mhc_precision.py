"""Diagnostic (device only, not a test): which CUDA path makes the fused mHC pair's `0.alpha_res` gradient ~10x
less accurate than the CPU path (tests/layers/test_mhc_gpu.py)? Runs the test's pair under variants that switch
one suspect off each, and prints every tensor's error vs float64."""

import contextlib

import torch

import llm_training.layers.projection as projection
import llm_training.layers.sinkhorn as sinkhorn
from tests.layers.test_mhc_gpu import _modules, _pair


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def no_reduced_reduction():
    old = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = old


def run(mods, x, w, g):
    x = x.clone().requires_grad_()
    out = _pair(mods[0], mods[1], x, w, w)
    out.backward(g)
    return [out, x.grad] + [p.grad for m in mods for p in m.parameters()]


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

    def rel(a, b):
        return ((a.cpu().double() - b.double()).norm() / b.double().norm()).item()

    variants = {
        "default": contextlib.nullcontext,
        "no bf16 reduced-precision reduction": no_reduced_reduction,
        "exact fp32 GEMMs (no split-bf16)": lambda: patched(projection, "_use_split_bf16", lambda *a, **k: False),
        "Sinkhorn reference (no Triton kernel)": lambda: patched(sinkhorn, "_HAS_TRITON", False),
    }
    print(f"{'tensor':<18}{'cpu':>10}" + "".join(f"{v[:16]:>18}" for v in variants))
    cols = {}
    for label, ctx in variants.items():
        with ctx():
            cols[label] = run(_modules(n, H, "cuda", torch.float32), x, w, g)
    for i, name in enumerate(names):
        print(
            f"{name:<18}{rel(cpu_path[i], exact[i]):>10.2e}"
            + "".join(f"{rel(cols[v][i], exact[i]):>18.2e}" for v in variants)
        )


if __name__ == "__main__":
    main()
