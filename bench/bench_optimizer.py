"""Benchmark the optimizer on one GPU: (1) one optimizer step for motif3_small (fp32 master weights on CUDA,
random gradients) with Muon + AdamW vs AdamW only, (2) Newton-Schulz throughput (5 steps, bf16) at the
model's main matrix shapes with the PyTorch X X^T vs the Triton upper-triangle kernel, and (3) the Muon step
of `--muon-flavor` (default motif3_proxy: its real Muon parameter set, built on meta, `to_empty` on CUDA, fp32,
random weights and gradients) three ways: the earlier per-shape path (`per_shape_muon_step` below: main@1c6e804's
single-device step), the first batched step (`batched_foreach_step`: one NS per wide shape, `_foreach`
elementwise passes; both kept here only for this comparison) and the package's `Muon.step` ("fused": the update
scale folded into the last NS iteration, momentum with the Nesterov input and decay with the update one kernel each
per parameter: Triton's tiled kernels on CUDA, `optimizer/muon_kernels.py`).

Usage (H200):  python bench/bench_optimizer.py [--flavor motif3_small] [--muon-flavor motif3_proxy]
               [--repeats 10] [--out bench_optimizer.json]
Prints three tables and writes JSON. Checks first: NS with Triton agrees with NS with PyTorch (relative
Frobenius difference < 2e-2, both bf16), the model step leaves finite parameters, and one batched Muon step
and a per-shape / first-batched step from the same weights and zero momentum give the same update as the
package step (largest per-parameter relative Frobenius difference < 5e-2: all bf16 NS; the batched paths
normalise in fp32 before the cast, the old one after it); then times with CUDA events after warm-up (median of the repeats). Case (3) prints
the three step times, their ratios, and the NS TFLOP/s each step reaches (5 x (4 m^2 k + 2 m^3) per [m, k] matrix,
m <= k, over the whole step), and the NS calls alone on stacks of the batched step's shapes (the matmul
floor: batched step minus NS-only is the momentum / Nesterov / update memory traffic and launch overhead).

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
from optimizer import Muon, group_parameters, newton_schulz, triton_gram
from optimizer.muon import _batches, _Entry, update_scale
from optimizer.newton_schulz import orthogonalise_wide_

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


def _per_shape_newton_schulz(m: torch.Tensor, muon: Muon, steps: int) -> torch.Tensor:
    """main@1c6e804's NS: cast to bf16 first, fp32 norm of the cast copy, bf16 division, transposed copy."""
    a, b, c = muon.ns_coefficients
    x = m.to(torch.bfloat16)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    norm = torch.linalg.vector_norm(x.float(), dim=(-2, -1), keepdim=True)
    x = (x / (norm + muon.eps).to(torch.bfloat16)).reshape(-1, x.shape[-2], x.shape[-1]).contiguous()
    for _ in range(steps):
        p = torch.bmm(x, x.mT)
        poly = torch.baddbmm(p, p, p.mT, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    x = x.reshape(*m.shape[:-2], *x.shape[-2:])
    return x.mT if transposed else x


@torch.no_grad()
def per_shape_muon_step(muon: Muon, batch_elements: int = 1 << 27) -> None:
    """main@1c6e804's single-device Muon step on `muon`'s parameters and state (the reference of case 3):
    per-parameter momentum and Nesterov tensors, one NS per exact parameter shape (torch.stack copy), per
    parameter decay, a bf16 -> fp32 cast copy of the result and the update."""
    buckets: dict[tuple, list] = {}

    def flush(bucket):
        _, first, group = bucket[0]
        stacked = first[None] if len(bucket) == 1 else torch.stack([u for _, u, _ in bucket])
        split, (rows, cols) = group["row_split"], stacked.shape[-2:]
        blocks = stacked.reshape(*stacked.shape[:-2], split, rows // split, cols)
        ortho = _per_shape_newton_schulz(blocks, muon, group["ns_steps"]).reshape(stacked.shape)
        for (p, _, g), o in zip(bucket, ortho):
            if g["weight_decay"]:
                p.mul_(1.0 - g["lr"] * g["weight_decay"])
            p.add_(o.to(p.dtype), alpha=-g["lr"] * update_scale(rows // split, cols))

    for group in muon.param_groups:
        for p in group["params"]:
            state = muon.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            m = state["momentum_buffer"]
            m.mul_(group["momentum"]).add_(p.grad)
            update = p.grad.add(m, alpha=group["momentum"]) if group["nesterov"] else m
            bucket = buckets.setdefault((tuple(p.shape), group["row_split"], group["ns_steps"]), [])
            if bucket and (len(bucket) + 1) * update.numel() > batch_elements:
                flush(bucket)
                bucket.clear()
            bucket.append((p, update, group))
    for bucket in buckets.values():
        flush(bucket)


@torch.no_grad()
def batched_foreach_step(muon: Muon) -> None:
    """The first batched step (135dd80^, kept here only for this comparison): `_foreach` momentum and decay
    passes over every parameter, the Nesterov input into the bucket stack, NS without the folded scale, one
    `add_` per parameter. Same buckets and NS as the package; 48 instead of 32 bytes of elementwise traffic."""
    buckets: dict[tuple, list[_Entry]] = {}
    for group in muon.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            if "momentum_buffer" not in muon.state[p]:
                muon.state[p]["momentum_buffer"] = torch.zeros_like(p)
        bufs = [muon.state[p]["momentum_buffer"] for p in params]
        torch._foreach_mul_(bufs, group["momentum"])
        torch._foreach_add_(bufs, [p.grad for p in params])
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1.0 - group["lr"] * group["weight_decay"])
        for p in params:
            rows, cols = p.shape[-2] // group["row_split"], p.shape[-1]
            entry = _Entry(p, group, p.shape[:-2].numel() * group["row_split"], rows, cols)
            buckets.setdefault((entry.wide_shape, group["ns_steps"], group["lr"]), []).append(entry)
    for entries in buckets.values():
        for batch in _batches(entries):
            stack = muon._new_stack(batch, batch[0].param.device)  # noqa: SLF001 - same stack layout
            for e in batch:
                shape = (e.count, e.rows, e.cols)
                g, buf = e.param.grad.reshape(shape), muon.state[e.param]["momentum_buffer"].view(shape)
                if e.group["nesterov"]:
                    torch.add(g, buf, alpha=e.group["momentum"], out=e.slots(stack))
                else:
                    e.slots(stack).copy_(buf)
            ortho = orthogonalise_wide_(stack, batch[0].group["ns_steps"], muon.ns_coefficients, muon.eps)
            for e in batch:
                e.param.view(e.count, e.rows, e.cols).add_(e.slots(ortho), alpha=-e.group["lr"] * e.scale())


@torch.no_grad()
def same_update_check(muon: Muon, params: list[torch.Tensor], other_step) -> float:
    """One package step and one `other_step` from the same weights and zero momentum (weights restored after);
    returns the largest per-parameter relative Frobenius difference of the two updates."""
    start = [p.clone() for p in params]
    muon.state.clear()
    muon.step()
    package_updates = [p - p0 for p, p0 in zip(params, start)]
    for p, p0 in zip(params, start):
        p.copy_(p0)
    muon.state.clear()
    other_step(muon)
    rel = 0.0
    for p, p0, ours in zip(params, start, package_updates):
        other = p - p0
        rel = max(rel, float((ours - other).norm() / other.norm()))
        p.copy_(p0)
    muon.state.clear()
    return rel


def muon_case(flavor: str, device: str) -> tuple[Muon, list[torch.Tensor], dict[str, int], float]:
    """`flavor`'s Muon parameters on `device` (model built on meta, `to_empty`; memory only for the Muon
    parameters), random fp32 weights and gradients, and a Muon over them (the package's defaults: bf16 NS on
    CUDA). Returns (muon, params, matrix count per wide shape, NS TFLOP of one step)."""
    with torch.device("meta"):
        model = Motif3Model(get_flavor(flavor))
    cfg = ConfigManager().parse_args(["--model.flavor", flavor])
    grouping = group_parameters(model.named_parameters(), *motif_optimizer_rules(cfg.optimizer))
    names = set(grouping.names("muon"))
    for name, p in model.named_parameters():
        if name not in names:  # drop the rest: CUDA memory only for the Muon parameters
            p.data = torch.empty(0, device="meta")
    model.to_empty(device=device)
    grouping = group_parameters(model.named_parameters(), *motif_optimizer_rules(cfg.optimizer))
    gen = torch.Generator(device).manual_seed(0)
    params = [p for _, p, _ in grouping.groups["muon"]]
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.02, generator=gen)
            p.grad = torch.randn(p.shape, device=device, generator=gen) * 1e-3
    shapes: dict[str, int] = {}
    ns_tflop = 0.0
    for _, p, rule in grouping.groups["muon"]:
        rows, cols = p.shape[-2] // rule.row_split, p.shape[-1]
        wide = (min(rows, cols), max(rows, cols))
        count = p.shape[:-2].numel() * rule.row_split
        shapes[str(wide)] = shapes.get(str(wide), 0) + count
        ns_tflop += count * ns_flops(wide) / 1e12
    return Muon(grouping.muon_param_groups(), lr=1e-3, weight_decay=0.1), params, shapes, ns_tflop


def ns_only_ms(muon: Muon, repeats: int) -> float:
    """Milliseconds of the batched step's Newton-Schulz calls alone, on bf16 stacks of the shapes the step
    builds (same buckets and 2^27-element batches; random content): the matmul floor of the step."""
    entries: dict[tuple, list[_Entry]] = {}
    for group in muon.param_groups:
        for p in group["params"]:
            rows, cols = p.shape[-2] // group["row_split"], p.shape[-1]
            entry = _Entry(p, group, p.shape[:-2].numel() * group["row_split"], rows, cols)
            entries.setdefault((entry.wide_shape, group["ns_steps"]), []).append(entry)
    stacks = []
    for ((m, k), steps), bucket in entries.items():
        for batch in _batches(bucket):
            n = sum(e.count for e in batch)
            stacks.append((torch.randn(n, m, k, device="cuda", dtype=torch.bfloat16), steps))

    def run_all():
        for stack, steps in stacks:
            orthogonalise_wide_(stack, steps, muon.ns_coefficients, muon.eps)

    return statistics.median(cuda_time_ms(run_all, 2, repeats))


def bench_muon_paths(flavor: str, repeats: int) -> dict:
    """Case (3): the Muon step of `flavor`'s Muon parameters: per-shape (main@1c6e804), batched (first batched
    step, `_foreach` elementwise passes), fused (the package: folded scale, one pass for momentum + Nesterov input,
    one for decay + update)."""
    muon, muon_params, shapes, ns_tflop = muon_case(flavor, "cuda")
    rel_per_shape = same_update_check(muon, muon_params, per_shape_muon_step)
    rel_batched = same_update_check(muon, muon_params, batched_foreach_step)
    if max(rel_per_shape, rel_batched) > 5e-2:
        raise AssertionError(
            f"Muon paths differ: max relative update difference vs per-shape {rel_per_shape:.3g}, "
            f"vs batched {rel_batched:.3g}"
        )
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    per_shape_ms = statistics.median(cuda_time_ms(lambda: per_shape_muon_step(muon), 2, repeats))
    batched_ms = statistics.median(cuda_time_ms(lambda: batched_foreach_step(muon), 2, repeats))
    fused_ms = statistics.median(cuda_time_ms(muon.step, 2, repeats))
    ns_ms = ns_only_ms(muon, repeats)
    return {
        "flavor": flavor,
        "muon_tensors": len(muon_params),
        "muon_params": sum(p.numel() for p in muon_params),
        "matrices_by_wide_shape": shapes,
        "ns_tflop_per_step": ns_tflop,
        "per_shape_ms": per_shape_ms,
        "batched_ms": batched_ms,
        "fused_ms": fused_ms,
        "ns_only_ms": ns_ms,
        "per_shape_ns_tflops": ns_tflop / per_shape_ms * 1e3,
        "batched_ns_tflops": ns_tflop / batched_ms * 1e3,
        "fused_ns_tflops": ns_tflop / fused_ms * 1e3,
        "ns_only_ns_tflops": ns_tflop / ns_ms * 1e3,
        "max_rel_update_diff_vs_per_shape": rel_per_shape,
        "max_rel_update_diff_vs_batched": rel_batched,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="motif3_small")
    parser.add_argument("--muon-flavor", default="motif3_proxy")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default="bench_optimizer.json")
    parser.add_argument("--skip-ns-table", action="store_true", help="skip case (2) (smoke runs: no Triton compiles)")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_optimizer.py needs a CUDA GPU")
    model_args = get_flavor(opts.flavor)
    ns_rows = [] if opts.skip_ns_table else bench_ns(model_args, opts.repeats)
    if ns_rows:
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
    torch.cuda.empty_cache()
    paths = bench_muon_paths(opts.muon_flavor, opts.repeats)
    print(
        f"\nMuon step, {opts.muon_flavor} ({paths['muon_tensors']} tensors, {paths['muon_params'] / 1e9:.2f}B params, "
        f"{paths['ns_tflop_per_step']:.1f} NS TFLOP; max rel. update diff vs per-shape "
        f"{paths['max_rel_update_diff_vs_per_shape']:.2g}, vs batched {paths['max_rel_update_diff_vs_batched']:.2g})"
    )
    print(f"{'path':<12}{'step ms':>10}{'NS TFLOP/s':>12}")
    for name in ("per_shape", "batched", "fused", "ns_only"):
        print(f"{name:<12}{paths[name + '_ms']:>10.1f}{paths[name + '_ns_tflops']:>12.1f}")
    print(
        f"per-shape / fused: {paths['per_shape_ms'] / paths['fused_ms']:.2f}x, batched / fused: "
        f"{paths['batched_ms'] / paths['fused_ms']:.2f}x; fused step - NS only = "
        f"{paths['fused_ms'] - paths['ns_only_ms']:.1f} ms"
    )
    result = {
        "device": torch.cuda.get_device_name(),
        "flavor": opts.flavor,
        "newton_schulz": ns_rows,
        "step": step_rows,
        "muon_paths": paths,
    }
    with open(opts.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {opts.out}")


if __name__ == "__main__":
    main()
