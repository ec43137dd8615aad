"""Benchmark the optimizer on one GPU: (1) one optimizer step for motif3_small (fp32 master weights on CUDA,
random gradients) with Muon + AdamW vs AdamW only, and (2) Newton-Schulz throughput (5 steps, bf16) at the
model's main matrix shapes with the PyTorch X X^T vs the Triton upper-triangle kernel.

Usage (H200):  python bench/bench_optimizer.py [--flavor motif3_small] [--repeats 10] [--out bench_optimizer.json]
Prints two tables and writes JSON. Checks first: NS with Triton agrees with NS with PyTorch (relative
Frobenius difference < 2e-2, both bf16), and the model step leaves finite parameters; then times with CUDA
events after warm-up (median of the repeats).

NS TFLOP/s counts the FLOPs of the plain algorithm per [m, k] matrix (m <= k): 5 x (4 m^2 k + 2 m^3)
for both backends, so the Triton number is an "effective" rate (it does ~half of the X X^T / P^2 work).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from llm_training.config import ConfigManager
from llm_training.motif import get_flavor
from llm_training.motif.model import Motif3Model
from llm_training.motif.optimizer_groups import motif_optimizer_rules
from llm_training.trainer.optim import build_optimizers
from optimizer import newton_schulz, triton_gram

from cuda_timing import cuda_time_ms

NS_STEPS = 5


def main_ns_shapes(args) -> dict[str, tuple[int, ...]]:
    """Batch x [rows, cols] of the Muon matrices of one layer (gate_up split into halves)."""
    H, E, Ie = args.hidden_size, args.num_experts, args.moe_intermediate_size
    n_h, n_kv, d_qk, d_v = args.num_attention_heads, args.num_key_value_heads, args.head_dim, args.v_head_dim
    return {
        "wq_a": (args.q_lora_rank, H),
        "wq_b": (n_h * d_qk, args.q_lora_rank),
        "wkv_b": (n_kv * (args.qk_nope_head_dim + d_v), args.kv_lora_rank),
        "wo": (H, args.num_signal_heads * d_v),
        "dense_mlp_up": (args.intermediate_size, H),
        "expert_gate|up (x2E)": (2 * E, Ie, H),
        "expert_down (xE)": (E, H, Ie),
    }


def ns_flops(shape: tuple[int, ...]) -> float:
    *batch, rows, cols = shape
    m, k = min(rows, cols), max(rows, cols)
    n = 1
    for b in batch:
        n *= b
    return n * NS_STEPS * (4.0 * m * m * k + 2.0 * m**3)


def bench_ns(model_args, repeats: int) -> list[dict]:
    rows = []
    for name, shape in main_ns_shapes(model_args).items():
        x = torch.randn(shape, device="cuda", dtype=torch.float32)
        os.environ["MUON_GRAM_BACKEND"] = "torch"
        ref = newton_schulz(x, NS_STEPS, dtype=torch.bfloat16)
        t_torch = statistics.median(cuda_time_ms(lambda: newton_schulz(x, NS_STEPS, dtype=torch.bfloat16), 3, repeats))
        row = {
            "matrix": name,
            "shape": list(shape),
            "torch_ms": t_torch,
            "torch_tflops": ns_flops(shape) / t_torch / 1e9,
        }
        if triton_gram.available():
            os.environ["MUON_GRAM_BACKEND"] = "triton"
            got = newton_schulz(x, NS_STEPS, dtype=torch.bfloat16)
            rel = float((got.float() - ref.float()).norm() / ref.float().norm())
            if rel > 2e-2:
                raise AssertionError(f"NS with the Triton gram differs from PyTorch on {name} {shape}: rel {rel:.3g}")
            t_tri = statistics.median(
                cuda_time_ms(lambda: newton_schulz(x, NS_STEPS, dtype=torch.bfloat16), 3, repeats)
            )
            row.update(triton_ms=t_tri, triton_tflops=ns_flops(shape) / t_tri / 1e9, triton_rel_diff=rel)
        rows.append(row)
        del x
    os.environ.pop("MUON_GRAM_BACKEND", None)
    return rows


def bench_step(flavor: str, repeats: int) -> list[dict]:
    args = get_flavor(flavor)
    with torch.device("meta"):
        model = Motif3Model(args)
    model.to_empty(device="cuda")
    model.init_weights(buffer_device=torch.device("cuda"))
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator("cuda").manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, device="cuda", dtype=p.dtype, generator=gen) * 1e-3
    rows = []
    for name in ("muon", "adamw"):
        cfg = ConfigManager().parse_args(["--optimizer.name", name, "--model.flavor", flavor])
        opt = build_optimizers(model, cfg, *motif_optimizer_rules(cfg.optimizer))
        times = cuda_time_ms(opt.step, 2, repeats)
        if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            raise AssertionError(f"{name}: non-finite parameters after the step")
        rows.append({"optimizer": name, "step_ms": statistics.median(times), "params": n_params,
                     "muon_tensors": len(opt.grouping.groups["muon"])})  # fmt: skip
        del opt
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="motif3_small")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default="bench_optimizer.json")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_optimizer.py needs a CUDA GPU")
    model_args = get_flavor(opts.flavor)
    ns_rows = bench_ns(model_args, opts.repeats)
    print(
        f"\nNewton-Schulz ({NS_STEPS} steps, bf16) at {opts.flavor} shapes; triton available: {triton_gram.available()}"
    )
    print(f"{'matrix':<22}{'shape':<22}{'torch ms':>10}{'TFLOP/s':>9}{'triton ms':>11}{'TFLOP/s':>9}")
    for r in ns_rows:
        tri = f"{r['triton_ms']:>11.3f}{r['triton_tflops']:>9.1f}" if "triton_ms" in r else f"{'-':>11}{'-':>9}"
        print(f"{r['matrix']:<22}{str(tuple(r['shape'])):<22}{r['torch_ms']:>10.3f}{r['torch_tflops']:>9.1f}{tri}")
    step_rows = bench_step(opts.flavor, opts.repeats)
    print(f"\nOptimizer step, {opts.flavor} ({step_rows[0]['params'] / 1e9:.2f}B params, fp32, one GPU)")
    print(f"{'optimizer':<12}{'step ms':>10}{'muon tensors':>14}")
    for r in step_rows:
        print(f"{r['optimizer']:<12}{r['step_ms']:>10.1f}{r['muon_tensors']:>14}")
    result = {
        "device": torch.cuda.get_device_name(),
        "flavor": opts.flavor,
        "newton_schulz": ns_rows,
        "step": step_rows,
    }
    with open(opts.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {opts.out}")


if __name__ == "__main__":
    main()
