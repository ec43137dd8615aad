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
import ast
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
# At --tokens 8192 a call at K >= 4096 moves >= 100 MB (>= 50 us at the H200's copy bandwidth); below it every config
# takes the ~90 us of the call's launch on the H200, and the spread between configs is noise
KERNEL_BOUND_K = 4096


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


def pair_times(ms_by_config: dict) -> dict[tuple[int, int], float]:
    """{(NUM_GROUPS, num_warps): ms}: the median over the stage counts, which change nothing in these loop-free
    kernels (their spread is the timing noise)."""
    by_pair: dict = {}
    for config, ms in ms_by_config.items():
        g, w, _ = ast.literal_eval(config) if isinstance(config, str) else config
        by_pair.setdefault((g, w), []).append(ms)
    return {pair: statistics.median(times) for pair, times in by_pair.items()}


def kept_ratio(row: dict, kept: list[tuple[int, int]]) -> tuple[tuple[int, int], tuple[int, int], float]:
    """(best pair, best kept pair, kept-best / best time) of one (kernel, K) row."""
    times = pair_times(row["ms_by_config"])
    best = min(times, key=times.get)
    kept_best = min((p for p in kept if p in times), key=times.get)
    return best, kept_best, times[kept_best] / times[best]


def trim_cost(rows: list[dict], kept: list[tuple[int, int]]) -> dict:
    """The worst and mean kept-best / best ratio over every (kernel, K) row, and over the rows whose K is at least
    KERNEL_BOUND_K (the ones where the kernel, not the call's launch, is timed)."""
    out = {}
    for label, chosen in (("all", rows), (f"K>={KERNEL_BOUND_K}", [r for r in rows if r["K"] >= KERNEL_BOUND_K])):
        ratios = [kept_ratio(r, kept)[2] for r in chosen]
        out[label] = {"worst_ratio": max(ratios), "mean_ratio": statistics.fmean(ratios), "cases": len(ratios)}
    return out


def print_rows(rows: list[dict], kept: list[tuple[int, int]]) -> None:
    for row in rows:
        best, kept_best, ratio = kept_ratio(row, kept)
        times = pair_times(row["ms_by_config"])
        print(
            f"{row['kernel']:>15} K {row['K']:>6}: best {best!s:>9} {times[best] * 1e3:7.1f} us  "
            f"kept best {kept_best!s:>9} {times[kept_best] * 1e3:7.1f} us  ratio {ratio:.3f}"
        )
    for label, cost in trim_cost(rows, kept).items():
        print(
            f"kept / best time, {label}: worst {cost['worst_ratio']:.3f}, mean {cost['mean_ratio']:.3f} over "
            f"{cost['cases']} (kernel, K) cases"
        )


def rescore(path: str) -> int:
    """Scores the kept configs of llm_training (BLOCKWISE_QUANT_CONFIGS) against a saved run's timings (no GPU)
    and writes them and their trim cost back into that JSON."""
    from llm_training.quantization.kernels import BLOCKWISE_QUANT_CONFIGS

    kept = [tuple(p) for p in BLOCKWISE_QUANT_CONFIGS]
    result = json.loads(Path(path).read_text())
    print_rows(result["rows"], kept)
    result.update(kept_configs=kept, trim_cost=trim_cost(result["rows"], kept))
    Path(path).write_text(json.dumps(result, indent=1))
    print(f"rescored {path}")
    return 0


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
    parser.add_argument("--rescore", metavar="JSON", help="score the kept configs against a saved run (no GPU)")
    args = parser.parse_args(argv)
    if args.rescore:
        return rescore(args.rescore)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    from cuda_timing import cuda_time_ms

    from llm_training.quantization.kernels import BLOCKWISE_QUANT_CONFIGS

    kept = [tuple(p) for p in BLOCKWISE_QUANT_CONFIGS]
    kept_configs = [(g, w, 2) for g, w in kept]
    ks = gemm_ks(args.flavors.split(","))
    configs = all_configs()
    print(f"K values: {ks}; {len(configs)} configs x {len(KERNELS)} kernels")

    # the cold-cache cost of one autotune, before any compile: torchao's 45 configs vs the kept ones, at a K the
    # flavors use (two different Ks, so neither run finds the other's binaries)
    cold = {
        "k_full": ks[-1],
        "full_s": full_autotune_seconds("lhs", ks[-1], args.tokens, configs),
        "k_kept": ks[-2],
        "kept_s": full_autotune_seconds("lhs", ks[-2], args.tokens, kept_configs),
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
            best = min(times, key=times.get)
            gbps = x.numel() * 3 / (times[best] * 1e-3) / 1e9  # bf16 in, fp8 out
            rows.append(
                {"kernel": kernel, "K": k, "best_GBps": gbps, "ms_by_config": {str(c): t for c, t in times.items()}}
            )
    print_rows(rows, kept)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tokens": args.tokens,
        "flavors": args.flavors,
        "kept_configs": kept,
        "cold_autotune": cold,
        "parallel_compile_s": compile_s,
        "trim_cost": trim_cost(rows, kept),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
