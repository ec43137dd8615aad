"""Can each kind of block be compiled in a side process, all kinds in parallel, so that the training process loads
its graphs from the inductor cache instead of compiling them one after another? (Issue 31's first-step target.)

Two runs of a compiled model's first step (forward + backward of one random micro-batch), each in a fresh process
over a fresh compile cache:
  cold       the whole model compiles as a training run's first step does
  prebuilt   first one side process per kind of block (`motif.parallelize.block_kind`: attention window x dense /
             MoE), all at once: each keeps only its block (the model's `layers` cut to that one, after the
             embedding as in training, so the block sees the input it sees there), compiles it and steps once into
             the shared cache; then the whole model as in "cold"
and for each the first-step time and inductor's FX-graph cache hits and misses. A prebuilt first step with no
miss means the side processes produced exactly the graphs training compiles. The plain model path (no FSDP2, no
activation checkpointing; bf16 on CUDA).

Measured (session 22, one H100, motif3_proxy_nomtp, 2 x 4096, bench/results/bench_compile_prebuild_h100_session22.json):
cold 44.0 s; each side process 31 s, 43.1 s wall all at once; then 9.9 s with every graph a cache hit. The graphs
carry over, but a side process's fixed cost (start, imports, CUDA and flash-attn-4 set-up, its own Triton builds)
is most of its time, so sides + training are slower than the cold step: the plan does not pay as measured.

    python bench/bench_compile_prebuild.py                                  # motif3_proxy_nomtp, 2 x 4096 (GPU)
    python bench/bench_compile_prebuild.py --flavor motif3_debug_nomtp --batch 2 --seq-len 64   # CPU smoke test
Writes bench/results/bench_compile_prebuild.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent


def block_kinds(flavor: str) -> dict[str, int]:
    """The first layer index of each kind of block of `flavor`, in layer order (built on the meta device)."""
    import torch

    from llm_training.motif import get_flavor
    from llm_training.motif.model import Motif3Model
    from llm_training.motif.parallelize import block_kind

    with torch.device("meta"):
        model = Motif3Model(get_flavor(flavor))
    kinds: dict[str, int] = {}
    for index, block in enumerate(model.layers):
        kinds.setdefault(block_kind(block), index)
    return kinds


def run_worker(flavor: str, layer: int | None, batch: int, seq_len: int) -> dict:
    """Build `flavor`, compile its blocks (only block `layer`, the model cut to it, when given) and time one
    forward + backward on a random micro-batch; the FX-graph cache counters and what dynamo compiled."""
    import torch
    from bench_train import random_batch
    from torch import nn
    from torch._dynamo.utils import counters

    from llm_training.distributed.compile import apply_compile, compile_stats
    from llm_training.motif import get_flavor
    from llm_training.motif.model import Motif3Model

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    args = get_flavor(flavor)
    torch.manual_seed(0)
    with torch.device(device):
        model = Motif3Model(args)
    model.init_weights()
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    if layer is not None:
        model.layers = nn.ModuleList([model.layers[layer]])
    apply_compile(list(model.layers), sublayers=True)
    b = {k: v.to(device) for k, v in random_batch(batch, seq_len, args.vocab_size, torch.Generator()).items()}
    start = time.perf_counter()
    # the blocks' input and gradient as in training; no logits (the head compiles nothing here, and four side
    # processes' [tokens, vocab] logits would not fit one GPU beside each other)
    out = model(b["input_ids"], b["position_ids"], b["document_ids"], return_hidden=True)
    out.hidden.float().square().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    fx = counters["inductor"]
    return {
        "layer": layer,
        "first_step_s": time.perf_counter() - start,
        "fxgraph_cache_hit": int(fx["fxgraph_cache_hit"]),
        "fxgraph_cache_miss": int(fx["fxgraph_cache_miss"]),
        "compiled_frames": compile_stats()["compiled_frames"],
    }


def _worker_command(flavor: str, layer: int | None, batch: int, seq_len: int) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--flavor", flavor, "--batch", str(batch),
           "--seq-len", str(seq_len)]  # fmt: skip
    return cmd if layer is None else [*cmd, "--layer", str(layer)]


def _result(returncode: int, output: str) -> dict:
    """The worker's result (its JSON line), or an error row with its last output line."""
    lines = [ln for ln in output.splitlines() if ln.strip()]
    rows = [ln for ln in lines if ln.startswith('{"layer"')]
    if returncode == 0 and rows:
        return json.loads(rows[-1])
    return {"error": f"exit {returncode}: {(lines or ['(no output)'])[-1][-300:]}"}


def _cache_env(folder: Path) -> dict:
    """The environment of a worker whose compiled-kernel caches (inductor, Triton, flash-attn-4: the trainer's
    `[compile] cache_folder` layout, `KERNEL_CACHE_VARIABLES`, their persistent caches switched on) live in `folder`,
    fresh per run."""
    from llm_training.distributed.compile import CACHE_SWITCHES, KERNEL_CACHE_VARIABLES

    caches = {name: str(folder / sub) for name, sub in KERNEL_CACHE_VARIABLES}
    return {**os.environ, "PYTHONUNBUFFERED": "1", **caches, **dict.fromkeys(CACHE_SWITCHES, "1")}


def measure(flavor: str, batch: int, seq_len: int, timeout_s: float) -> dict:
    """The cold and prebuilt runs (module docstring)."""
    kinds = block_kinds(flavor)
    with tempfile.TemporaryDirectory(prefix="bench_compile_prebuild_") as tmp:
        cold_env, warm_env = _cache_env(Path(tmp) / "cold"), _cache_env(Path(tmp) / "prebuilt")
        main = _worker_command(flavor, None, batch, seq_len)
        run = subprocess.run(main, env=cold_env, capture_output=True, text=True, timeout=timeout_s)
        cold = _result(run.returncode, run.stdout + run.stderr)
        start = time.perf_counter()
        sides = {
            kind: subprocess.Popen(_worker_command(flavor, layer, batch, seq_len), env=warm_env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for kind, layer in kinds.items()
        }  # fmt: skip
        side_rows = {}
        for kind, proc in sides.items():
            output, _ = proc.communicate(timeout=timeout_s)
            side_rows[kind] = _result(proc.returncode, output)
        sides_wall_s = time.perf_counter() - start
        run = subprocess.run(main, env=warm_env, capture_output=True, text=True, timeout=timeout_s)
        prebuilt = _result(run.returncode, run.stdout + run.stderr)
    return {
        "flavor": flavor, "batch": batch, "seq_len": seq_len, "kinds": kinds, "cold": cold, "sides": side_rows,
        "sides_wall_s": sides_wall_s, "prebuilt": prebuilt,
    }  # fmt: skip


def format_table(result: dict) -> str:
    """One line per run and side process: first-step seconds, FX-graph cache hits / misses."""
    lines = [f"{'run':<52}{'first step s':>13}{'hits':>6}{'misses':>7}"]

    def line(name: str, row: dict) -> str:
        if "error" in row:
            return f"{name:<52}FAIL {row['error']}"
        return f"{name:<52}{row['first_step_s']:>13.1f}{row['fxgraph_cache_hit']:>6}{row['fxgraph_cache_miss']:>7}"

    lines.append(line("cold (whole model)", result["cold"]))
    for kind, row in result["sides"].items():
        lines.append(line(f"  side: {kind} (layer {result['kinds'][kind]})", row))
    lines.append(f"{'  side processes, all at once (wall)':<52}{result['sides_wall_s']:>13.1f}")
    lines.append(line("prebuilt (whole model)", result["prebuilt"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flavor", default="motif3_proxy_nomtp")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--timeout", type=float, default=480.0, help="seconds per process before the run fails")
    p.add_argument("--out", default=str(BENCH_DIR / "results" / "bench_compile_prebuild.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layer", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sys.path.insert(0, str(BENCH_DIR))
    if args.worker:
        print(json.dumps(run_worker(args.flavor, args.layer, args.batch, args.seq_len)), flush=True)
        return 0
    result = measure(args.flavor, args.batch, args.seq_len, args.timeout)
    print(format_table(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if all("error" not in r for r in (result["cold"], result["prebuilt"], *result["sides"].values())) else 1


if __name__ == "__main__":
    sys.exit(main())
