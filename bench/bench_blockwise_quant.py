"""Which of torchao's autotune configs the fp8_blockwise quantization kernels need (GPU).

torchao 0.18 autotunes its three 1x128 activation-quantization kernels (lhs, rhs, transposed lhs) over 45 Triton
configs for every K; a first fp8_blockwise step compiles and times all of them (426 s for motif3_small on the
H200). `llm_training.quantization.kernels.BLOCKWISE_QUANT_CONFIGS` keeps a few. This script times every config of
each kernel at every K that the converted GEMMs of the given flavors contract over (in and out features, padded to
128, as `RecipeKernels` pads them), with --tokens rows, and reports per (kernel, K): the best of all configs, the
best of the kept ones and their ratio (the cost of trimming), and what the full autotune and the trimmed one cost
in wall time (compile + timing) on a cold Triton cache.

Before timing, every config's output (fp8 values and scales) is checked bit for bit against the first config's:
the config changes the tiling, never the numbers.

    python bench/bench_blockwise_quant.py [--flavors motif3_small,motif3_seq] [--tokens 8192]
Writes bench/results/bench_blockwise_quant.json (or --out).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

BLOCK = 128
KERNELS = ("lhs", "rhs", "transposed_lhs")
# torchao 0.18's list (kernels.quant_kernel_configs_with_groups): NUM_GROUPS x num_warps x num_stages
TORCHAO_GROUPS, TORCHAO_WARPS, TORCHAO_STAGES = (2, 16, 32, 64, 128), (2, 4, 8), (2, 4, 6)


def gemm_ks(flavors: list[str]) -> list[int]:
    """Every dim a converted GEMM of these flavors contracts over (forward: in features; dgrad: out features),
    padded up to a multiple of 128, sorted."""
    from llm_training.motif import get_flavor
    from llm_training.motif.model import Motif3Model
    from llm_training.quantization.converter import convertible_modules, gemm_dims

    ks = set()
    for flavor in flavors:
        with torch.device("meta"):
            model = Motif3Model(get_flavor(flavor))
        for _, module, _ in convertible_modules(model):
            ks.update(-(-d // BLOCK) * BLOCK for d in gemm_dims(module))
    return sorted(ks)


def all_configs() -> list[tuple[int, int, int]]:
    return list(itertools.product(TORCHAO_GROUPS, TORCHAO_WARPS, TORCHAO_STAGES))


def best_within(times_by_config: dict, candidates) -> tuple[tuple, float]:
    """(config, ms) of the fastest of `candidates` present in `times_by_config`."""
    present = [c for c in candidates if c in times_by_config]
    best = min(present, key=lambda c: times_by_config[c])
    return best, times_by_config[best]


def trim_cost(rows: list[dict]) -> dict:
    """Over all (kernel, K) rows: the worst and the mean ratio of kept-best to overall-best time."""
    ratios = [r["kept_best_ms"] / r["best_ms"] for r in rows]
    return {"worst_ratio": max(ratios), "mean_ratio": statistics.fmean(ratios), "cases": len(ratios)}


def _quantizer(kernel: str):
    """The torchao wrapper function and its Autotuner object for `kernel`."""
    from torchao.prototype.blockwise_fp8_training import kernels as blockwise

    fn = getattr(blockwise, f"triton_fp8_blockwise_act_quant_{kernel}")
    return fn, getattr(blockwise, f"triton_fp8_blockwise_act_quant_{kernel}_kernel")


def _use(autotuner, config: tuple[int, int, int]) -> None:
    import triton

    g, w, s = config
    autotuner.configs = [triton.Config({"NUM_GROUPS": g}, num_warps=w, num_stages=s)]
    autotuner.cache.clear()


def _compile_jobs(jobs: list[tuple[str, int, tuple]], tokens: int) -> float:
    """Runs each (kernel, K, config) once (a worker process: fills the shared Triton cache); its wall time."""
    start = time.perf_counter()
    for kernel, k, config in jobs:
        fn, autotuner = _quantizer(kernel)
        _use(autotuner, config)
        fn(torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16), BLOCK)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def full_autotune_seconds(kernel: str, k: int, tokens: int, configs) -> float:
    """Wall time of torchao's own autotune of `kernel` at K over `configs` (compile from a cold cache + timing)."""
    import triton

    fn, autotuner = _quantizer(kernel)
    autotuner.configs = [triton.Config({"NUM_GROUPS": g}, num_warps=w, num_stages=s) for g, w, s in configs]
    autotuner.cache.clear()
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(x, BLOCK)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavors", default="motif3_small,motif3_seq")
    parser.add_argument("--tokens", type=int, default=8192, help="rows of the quantized activation")
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1), help="compile processes")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="bench/results/bench_blockwise_quant.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    from cuda_timing import cuda_time_ms

    from llm_training.quantization.kernels import BLOCKWISE_QUANT_CONFIGS

    kept = [(g, w, 2) for g, w in BLOCKWISE_QUANT_CONFIGS]
    ks = gemm_ks(args.flavors.split(","))
    configs = all_configs()
    print(f"K values: {ks}; {len(configs)} configs x {len(KERNELS)} kernels")

    # the cold-cache cost of one autotune, before any compile: torchao's 45 configs vs the kept ones, at a K the
    # flavors use (two different Ks, so neither run finds the other's binaries)
    cold = {
        "k_full": ks[-1],
        "full_s": full_autotune_seconds("lhs", ks[-1], args.tokens, configs),
        "k_kept": ks[-2],
        "kept_s": full_autotune_seconds("lhs", ks[-2], args.tokens, kept),
    }
    print(
        f"cold autotune of the lhs kernel: all {len(configs)} configs {cold['full_s']:.1f} s (K {cold['k_full']}), "
        f"kept {len(kept)} {cold['kept_s']:.1f} s (K {cold['k_kept']})"
    )

    # phase 1: compile every (kernel, K, config) in parallel processes into the shared Triton cache
    jobs = [(kern, k, c) for kern in KERNELS for k in ks for c in configs]
    chunks = [jobs[i :: args.workers] for i in range(args.workers)]
    start = time.perf_counter()
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.workers, mp_context=ctx) as pool:
        list(pool.map(_compile_jobs, chunks, [args.tokens] * len(chunks)))
    compile_s = time.perf_counter() - start
    print(f"compiled {len(jobs)} kernels in {compile_s:.0f} s on {args.workers} processes")

    # phase 2: check and time each config, one process, binaries from the cache
    rows = []
    for kernel in KERNELS:
        fn, autotuner = _quantizer(kernel)
        for k in ks:
            x = torch.randn(args.tokens, k, device="cuda", dtype=torch.bfloat16)
            reference, times = None, {}
            for config in configs:
                _use(autotuner, config)
                y, s = fn(x, BLOCK)
                if reference is None:
                    reference = (y.view(torch.uint8).clone(), s.clone())
                elif not (torch.equal(y.view(torch.uint8), reference[0]) and torch.equal(s, reference[1])):
                    raise AssertionError(f"{kernel} K={k} config {config}: output differs from {configs[0]}")
                times[config] = statistics.median(cuda_time_ms(lambda fn=fn, x=x: fn(x, BLOCK), 3, args.repeats))
            best, best_ms = best_within(times, configs)
            kept_best, kept_ms = best_within(times, kept)
            gbps = x.numel() * 3 / (best_ms * 1e-3) / 1e9  # bf16 in, fp8 out
            rows.append(
                {
                    "kernel": kernel,
                    "K": k,
                    "best_config": best,
                    "best_ms": best_ms,
                    "best_GBps": gbps,
                    "kept_best_config": kept_best,
                    "kept_best_ms": kept_ms,
                    "ms_by_config": {str(c): t for c, t in times.items()},
                }
            )
            print(
                f"{kernel:>15} K {k:>6}: best {best!s:>14} {best_ms * 1e3:7.1f} us ({gbps:5.0f} GB/s)  "
                f"kept best {kept_best!s:>14} {kept_ms * 1e3:7.1f} us  ratio {kept_ms / best_ms:.3f}"
            )
    summary = trim_cost(rows)
    print(
        f"kept / best time: worst {summary['worst_ratio']:.3f}, mean {summary['mean_ratio']:.3f} over "
        f"{summary['cases']} (kernel, K) cases"
    )
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tokens": args.tokens,
        "flavors": args.flavors,
        "kept_configs": kept,
        "cold_autotune": cold,
        "parallel_compile_s": compile_s,
        "trim_cost": summary,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
