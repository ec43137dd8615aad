"""Benchmark PolyNorm's activation memory on one GPU at the MoE expert shape: what the fused grouped op
(`activation.grouped_poly_norm(x, ..., up=up)`, selective recompute: saves x, up and the per-row fp32 r_p only,
recomputes the powers and P(x) in backward) keeps for backward, against plain autograd of the same fp32
formula (which saves the fp32 x, its powers and the normalised terms), plus fwd+bwd ms and peak memory.

Shape (default): rows = tokens x top_k = 16384 x 8 (a 4 x 4096 micro-batch's routed rows), D = 1280 (the
expert intermediate width), 64 experts, bf16 x / up. Also prints the op's output size: the down projection's
GEMM saves it for its weight gradient, which is the next recompute candidate (outside this op).

Usage (H200):  python bench/bench_polynorm_memory.py [--rows 131072] [--width 1280] [--experts 64]
               [--repeats 10] [--out bench_polynorm_memory.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import activation
import torch
from cuda_timing import cuda_time_ms

from llm_training.saved_tensors import saved_bytes

EPS = 1e-6


def plain_autograd_poly(x, up, weight_E3, bias_E1, offs, bias_clamp, output_scale):
    """The grouped fused PolyNorm written as plain torch ops (autograd saves every fp32 intermediate)."""
    expert = torch.searchsorted(offs, torch.arange(x.shape[0], device=x.device), right=True)
    w = torch.sigmoid(weight_E3)[expert]
    b = bias_E1.clamp(-bias_clamp, bias_clamp)[expert]
    x32 = x.float()

    def normalise(u):
        return u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + EPS)

    p = w[:, 0:1] * normalise(x32**3) + w[:, 1:2] * normalise(x32**2) + w[:, 2:3] * normalise(x32) + b
    return (p * up.float()).to(x.dtype) * output_scale


def fused_poly(x, up, weight_E3, bias_E1, offs, bias_clamp, output_scale):
    return activation.grouped_poly_norm(
        x, weight_E3, bias_E1, offs, eps=EPS, bias_clamp=bias_clamp, up=up, output_scale=output_scale
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384 * 8)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default="bench_polynorm_memory.json")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_polynorm_memory.py needs a CUDA GPU")
    N, D, E = opts.rows, opts.width, opts.experts
    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(N, D, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    up = torch.randn(N, D, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    weight = torch.zeros(E, 3, device="cuda", requires_grad=True)
    bias = torch.zeros(E, 1, device="cuda", requires_grad=True)
    offs = torch.linspace(N / E, N, E, device="cuda").round().to(torch.int64)
    dout = torch.randn(N, D, device="cuda", generator=gen).to(torch.bfloat16)
    args = (x, up, weight, bias, offs, 1.0, 0.5)
    rows, outs = [], {}
    for name, fn in (("fused_recompute", fused_poly), ("plain_autograd", plain_autograd_poly)):
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out, kept = saved_bytes(lambda fn=fn: fn(*args))
            after_fwd = torch.cuda.memory_allocated() - base
            out.backward(dout)
            peak = torch.cuda.max_memory_allocated() - base
            outs[name] = (out.detach().float(), x.grad.float())
            for t in (x, up, weight, bias):
                t.grad = None
            del out

            def step(fn=fn):
                fn(*args).backward(dout)

            ms = statistics.median(cuda_time_ms(step, 2, opts.repeats))
            rows.append({"variant": name, "saved_for_backward_gib": kept / 2**30,
                         "held_after_forward_gib": after_fwd / 2**30, "peak_fwd_bwd_gib": peak / 2**30, "ms": ms})  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - one variant failing must not hide the other
            rows.append({"variant": name, "FAIL": f"{type(exc).__name__}: {exc}"[:300]})
        for t in (x, up, weight, bias):
            t.grad = None
    inputs_gib = 2 * N * D * 2 / 2**30
    print(f"PolyNorm (grouped, fused with up), rows {N} x width {D}, {E} experts, bf16; x + up = {inputs_gib:.3f} GiB")
    print(f"{'variant':<18}{'saved GiB':>11}{'held fwd GiB':>14}{'peak GiB':>10}{'fwd+bwd ms':>12}")
    for r in rows:
        if "FAIL" in r:
            print(f"FAIL {r['variant']}: {r['FAIL']}")
            continue
        print(
            f"{r['variant']:<18}{r['saved_for_backward_gib']:>11.3f}{r['held_after_forward_gib']:>14.3f}"
            f"{r['peak_fwd_bwd_gib']:>10.3f}{r['ms']:>12.3f}"
        )
    result = {"device": torch.cuda.get_device_name(), "rows": N, "width": D, "experts": E, "variants": rows}
    if len(outs) == 2:
        (o1, g1), (o2, g2) = outs["fused_recompute"], outs["plain_autograd"]
        result["out_rel_diff"] = float((o1 - o2).norm() / o2.norm())
        result["dx_rel_diff"] = float((g1 - g2).norm() / g2.norm())
        saved = {r["variant"]: r.get("saved_for_backward_gib") for r in rows}
        if None not in saved.values():
            result["saved_gib_per_layer"] = saved["plain_autograd"] - saved["fused_recompute"]
            print(
                f"recompute keeps {result['saved_gib_per_layer']:.3f} GiB less per MoE layer; out rel diff "
                f"{result['out_rel_diff']:.2e}, dx rel diff {result['dx_rel_diff']:.2e}"
            )
    print(f"op output (saved by the down projection for its weight gradient): {N * D * 2 / 2**30:.3f} GiB per layer")
    with open(opts.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
