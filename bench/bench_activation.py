#!/usr/bin/env python3
"""GPU benchmark of the `activation` ops, forward and forward+backward, at Motif-3 shapes.

Columns per op: `eager` (PyTorch reference backend), `compile` (torch.compile of the same reference
calls) and `triton` (the Triton kernels). Every case first checks the Triton outputs and gradients
against the eager reference, then times with CUDA events after warm-up (median of --iters). Bandwidth is
the op's minimum HBM traffic (each input read once, each output written once, forward and backward)
divided by the time, also shown as a fraction of a device-to-device copy bandwidth measured in the
same run. Prints a table and writes JSON.

    python bench/bench_activation.py [--out bench/results/activation.json] [--iters 20] [--cases poly_norm,...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

import activation

from cuda_timing import cuda_time_ms


@dataclass
class Case:
    """One benchmark case: `fn(*tensors)` with `tensors[i]` differentiable for i in `grad_inputs`."""

    name: str
    shape: str
    fn: Callable
    tensors: list
    grad_inputs: tuple
    bytes_fwd: int
    bytes_bwd: int


@contextlib.contextmanager
def backend(name: str):
    previous = os.environ.get("ACTIVATION_BACKEND")
    os.environ["ACTIVATION_BACKEND"] = name
    try:
        yield
    finally:
        if previous is None:
            del os.environ["ACTIVATION_BACKEND"]
        else:
            os.environ["ACTIVATION_BACKEND"] = previous


def _randn(shape, dtype=torch.bfloat16, scale=1.0, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (scale * torch.randn(shape, device="cuda", generator=gen)).to(dtype)


def make_cases(experts: int, selected: set[str] | None, row_divisor: int = 1) -> list[Case]:
    bf16 = 2
    rows = lambda n: max(n // row_divisor, 1)  # noqa: E731  (smaller smoke runs)
    cases = []

    def add(name, *args):
        if selected is None or name in selected:
            cases.append(Case(name, *args))

    t, d = rows(131072), 1280
    add(
        "poly_norm",
        f"[{t}, {d}] bf16",
        lambda x, w, b: activation.poly_norm(x, w, b),
        [_randn((t, d)), _randn((3,), torch.float32, seed=1), _randn((1,), torch.float32, seed=2)],
        (0, 1, 2),
        2 * t * d * bf16,
        3 * t * d * bf16,
    )
    for label, (t, d) in (("dense", (rows(8 * 4096), 12288)), ("expert", (rows(8 * 4096 * 8), 1280))):
        add(
            f"fused_mul_poly_norm_{label}",
            f"[{t}, {d}] bf16",
            lambda g, u, w, b: activation.fused_mul_poly_norm(g, u, w, b, output_scale=0.5),
            [
                _randn((t, d)),
                _randn((t, d), seed=3),
                _randn((3,), torch.float32, seed=1),
                _randn((1,), torch.float32, seed=2),
            ],
            (0, 1, 2, 3),
            3 * t * d * bf16,
            5 * t * d * bf16,
        )
    t, d = rows(8 * 4096 * 8), 1280
    sizes = torch.distributions.Dirichlet(torch.ones(experts)).sample((1,))[0]
    counts = (sizes * (t - t // 512)).long()  # ~t/512 padding rows at the end, as after a padded dispatch
    offs = counts.cumsum(0).to(torch.int32).cuda()
    add(
        "grouped_poly_norm_fused",
        f"[{t}, {d}] bf16, {experts} experts",
        lambda x, u, w, b: activation.grouped_poly_norm(x, w, b, offs, bias_clamp=0.5, up=u, output_scale=0.5),
        [
            _randn((t, d)),
            _randn((t, d), seed=3),
            _randn((experts, 3), torch.float32, seed=1),
            _randn((experts, 1), torch.float32, scale=0.3, seed=2),
        ],
        (0, 1, 2, 3),
        3 * t * d * bf16,
        5 * t * d * bf16,
    )
    t, d = rows(32768), 4096
    add(
        "rms_norm",
        f"[{t}, {d}] bf16",
        lambda x, w: activation.rms_norm(x, w, 1e-5),
        [_randn((t, d)), _randn((d,), torch.float32, seed=1) + 1],
        (0, 1),
        2 * t * d * bf16,
        3 * t * d * bf16,
    )
    add(
        "fused_add_rms_norm",
        f"[{t}, {d}] bf16",
        lambda x, r, w: activation.fused_add_rms_norm(x, r, w, 1e-5),
        [_randn((t, d)), _randn((t, d), seed=3), _randn((d,), torch.float32, seed=1) + 1],
        (0, 1, 2),
        4 * t * d * bf16,
        4 * t * d * bf16,
    )
    t, d = rows(8192), 4 * 4096  # mHC: RMSNorm over the n*H flattened fp32 streams
    add(
        "rms_norm_mhc",
        f"[{t}, {d}] fp32",
        lambda x, w: activation.rms_norm(x, w, 1e-6),
        [_randn((t, d), torch.float32), _randn((d,), torch.float32, seed=1) + 1],
        (0, 1),
        2 * t * d * 4,
        3 * t * d * 4,
    )
    return cases


def time_ms(fn, warmup: int, iters: int) -> float:
    return statistics.median(cuda_time_ms(fn, warmup, iters))


def copy_bandwidth_gbs(warmup: int, iters: int) -> float:
    src = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup, iters)
    return 2 * src.numel() * 2 / ms / 1e6


def runners(case: Case, fn: Callable):
    """(forward-only callable, forward+backward callable) for `fn` on the case's tensors."""
    leaves = [t.detach().clone().requires_grad_(i in case.grad_inputs) for i, t in enumerate(case.tensors)]
    inputs = [leaves[i] for i in case.grad_inputs]
    with torch.no_grad():
        outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads_out = [_randn(o.shape, o.dtype, seed=100 + k) for k, o in enumerate(outs)]

    def forward():
        with torch.no_grad():
            return fn(*leaves)

    def forward_backward():
        result = fn(*leaves)
        result = result if isinstance(result, tuple) else (result,)
        return result, torch.autograd.grad(result, inputs, grads_out)

    return forward, forward_backward


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.float().abs().max().item() + 1e-12
    return (actual.float() - expected.float()).abs().max().item() / scale


def check_triton_vs_reference(case: Case, tolerance: float) -> float:
    results = {}
    for name in ("torch", "triton"):
        with backend(name):
            _, forward_backward = runners(case, case.fn)
            outs, grads = forward_backward()
            results[name] = list(outs) + list(grads)
    worst = max(max_rel_err(a, e) for a, e in zip(results["triton"], results["torch"]))
    if worst > tolerance:
        raise SystemExit(f"{case.name}: Triton differs from the reference (max rel err {worst:.3g} > {tolerance})")
    return worst


def time_column(case: Case, column: str, warmup: int, iters: int, copy_gbs: float) -> dict:
    """Timings of one backend column; a failure (e.g. a compile error) is recorded, not fatal."""
    try:
        fn = torch.compile(case.fn) if column == "compile" else case.fn
        with backend("triton" if column == "triton" else "torch"):
            forward, forward_backward = runners(case, fn)
            fwd_ms = time_ms(forward, warmup, iters)
            fwd_bwd_ms = time_ms(forward_backward, warmup, iters)
    except Exception as error:  # noqa: BLE001 - keep the other columns of a long GPU run
        return {"error": f"{type(error).__name__}: {error}"[:500], "traceback": traceback.format_exc()[-4000:]}
    total_bytes = case.bytes_fwd + case.bytes_bwd
    return {
        "fwd_ms": fwd_ms,
        "fwd_bwd_ms": fwd_bwd_ms,
        "fwd_GBs": case.bytes_fwd / fwd_ms / 1e6,
        "fwd_bwd_GBs": total_bytes / fwd_bwd_ms / 1e6,
        "fwd_bwd_frac_of_copy": total_bytes / fwd_bwd_ms / 1e6 / copy_gbs,
    }


def format_cell(column: str, result: dict) -> str:
    if "error" in result:
        return f"{column}: FAILED ({result['error'][:60]})"
    return f"{column}: {result['fwd_ms']:7.3f} / {result['fwd_bwd_ms']:7.3f} ms ({result['fwd_bwd_GBs']:5.0f} GB/s)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/activation.json", help="JSON output path")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations (median reported)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations first (compile happens here)")
    parser.add_argument("--experts", type=int, default=64, help="experts of the grouped case")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--backends", default="eager,compile,triton", help="columns to run")
    parser.add_argument("--row-divisor", type=int, default=1, help="divide every row count (quick smoke runs)")
    parser.add_argument("--tolerance", type=float, default=3e-2, help="max relative error Triton vs reference")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_activation.py needs a CUDA GPU")
    torch.manual_seed(0)
    selected = {c for c in args.cases.split(",") if c} or None
    columns = [c for c in args.backends.split(",") if c]
    unknown = set(columns) - {"eager", "compile", "triton"}
    if unknown:
        raise SystemExit(f"--backends: unknown {sorted(unknown)}; choose from eager, compile, triton")

    copy_gbs = copy_bandwidth_gbs(args.warmup, args.iters)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  copy bandwidth {copy_gbs:.0f} GB/s")
    rows = []
    for case in make_cases(args.experts, selected, args.row_divisor):
        row = {"case": case.name, "shape": case.shape, "bytes_fwd": case.bytes_fwd, "bytes_bwd": case.bytes_bwd}
        if "triton" in columns:
            row["triton_max_rel_err"] = check_triton_vs_reference(case, args.tolerance)
        for column in columns:
            row[column] = time_column(case, column, args.warmup, args.iters, copy_gbs)
            torch.cuda.empty_cache()
        rows.append(row)
        cells = "  ".join(format_cell(c, row[c]) for c in columns)
        print(f"{case.name:28s} {case.shape:34s} {cells}")

    print("\nms = forward / forward+backward; GB/s on forward+backward minimum traffic")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_GBs": copy_gbs, "results": rows},
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
