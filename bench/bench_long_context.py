"""Long-context training on one device: a few full training steps (the real Trainer: forward, chunked CE + MTP,
backward, Muon + AdamW, QK-clip, expert-bias update) of a flavor at each given sequence length, one sequence
per step, under the long-sequence memory plan, with the dry run's memory estimate beside what was measured.

    python bench/bench_long_context.py --seq-lens 32768,65536            # motif3_small_256k, H200
    python bench/bench_long_context.py --flavor motif3_debug --device cpu --seq-lens 64 --steps 2   # logic test
    torchrun --nproc_per_node 2 bench/bench_long_context.py --cp 2 --seq-lens 65536,131072   # context parallel 2

With `--cp N` (under torchrun, N processes: one sequence split over N GPUs, `--cp-mode` ulysses or ring) each row is
the whole sequence's step: tokens/s of the N GPUs together, the largest peak over the ranks, and the dry run's
estimate for one rank of that layout; rank 0 prints and writes the JSON.

The plan (defaults): activation checkpointing `long_context` (full AC per block + the routed experts in
checkpointed token chunks: distributed/activation_checkpoint.py; the full-attention layers' flash-attn-4 output
kept for the backward, `--no-keep-full-attention` recomputes it), bf16 compute, fp32 reduce, the attention
backend `auto` (flash-attn-4 on SM90 / SM100 when installed). Each row: median step time and tokens/s over the
timed steps, the peak allocated CUDA memory (torch.cuda.max_memory_allocated, reset before the first step) and
the dry-run estimate for the same config (dry_run.measure_rank: parameters, gradients, optimizer state, FSDP
transients and the activation peak). On CUDA the blocks are compiled (`--no-compile`: eager), as the SFT example
does; each row then records how many graphs dynamo compiled and any graph break. The dry run runs first, for every
length, in this process (it needs no process group); a length whose estimate exceeds --gpu-gib is still tried (the
estimate is what is checked).
With --stop-on-oom (default) the lengths after the first out-of-memory one are reported as skipped.
Writes JSON (--out).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_train import random_batch

from llm_training.config import ConfigManager
from llm_training.config.job_config import PACKAGE_DIR
from llm_training.distributed import ParallelDims
from llm_training.distributed.compile import compile_stats, reset_compile_stats
from llm_training.distributed.utils import destroy_process_group, setup_distributed
from llm_training.dry_run import measure_rank
from llm_training.motif import get_flavor
from llm_training.trainer import Trainer

GIB = 2**30


def job_config(
    flavor, seq_len, ac, device, backend, steps, dump, gpu_gib, cp=1, cp_mode="ulysses", compiled=False, keep=True
):
    bf16 = device != "cpu"
    return ConfigManager().parse_args([
        "--job.config_file", str(PACKAGE_DIR / "motif" / "train_configs" / "debug_cpu.toml"),
        f"--job.dump_folder={dump}", f"--job.run_name=long_{flavor}_{seq_len}", f"--model.flavor={flavor}",
        f"--kernels.attention={backend}", f"--training.device={device}",
        f"--training.mixed_precision_param={'bfloat16' if bf16 else 'float32'}", f"--training.seq_len={seq_len}",
        "--training.local_batch_size=1", f"--training.steps={steps}", "--checkpoint.enable=false",
        f"--activation_checkpoint.mode={ac}", "--metrics.save_jsonl=false", "--lr_scheduler.warmup_steps=1",
        f"--job.dry_run_gpu_memory_gib={gpu_gib}", f"--parallelism.context_parallel_degree={cp}",
        f"--parallelism.context_parallel_mode={cp_mode}", f"--compile.enable={'true' if compiled else 'false'}",
        f"--activation_checkpoint.keep_full_attention={'true' if keep else 'false'}",
    ])  # fmt: skip


def estimate(cfg) -> dict:
    r = measure_rank(cfg, world_size=cfg.parallelism.context_parallel_degree, rank=0)
    return {
        "estimate_total_gib": r.total_bytes / GIB,
        "estimate_activation_peak_gib": r.activation_peak_bytes / GIB,
        "estimate_recompute_gib": r.activations.recompute_bytes / GIB,
        "estimate_fits": r.fits,
    }


def train(cfg, warmup: int, steps: int) -> dict:
    t = cfg.training
    args = get_flavor(cfg.model.flavor)
    cp = cfg.parallelism.context_parallel_degree
    dims = ParallelDims(1, -1, cp, 1, cp)
    device, _ = setup_distributed(t.device, dims)
    # each length compiles anew: the compiled FlexAttention variants of earlier lengths (2 windows x with/without
    # max logits each) would reach dynamo's recompile limit, after which FlexAttention runs unfused ([S, S] scores)
    reset_compile_stats()
    built = time.perf_counter()
    trainer = Trainer(cfg, dims, device)
    build_s = time.perf_counter() - built
    gen = torch.Generator().manual_seed(0)
    cuda = device.type == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(warmup + steps):
        mb = random_batch(1, t.seq_len, args.vocab_size, gen)
        trainer.train_state.step = i + 1
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        rec = trainer.train_step([mb])
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if i == 0:  # with compile: the graphs and kernels this length needs (cold only for a process's first length)
            first_step_s = elapsed
        if i >= warmup:
            times.append(elapsed)
        losses.append(rec.ce_loss)
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"non-finite CE losses {losses}")
    step_s = statistics.median(times)
    row = {"step_s": step_s, "tokens_per_s": t.seq_len / step_s, "build_s": build_s, "first_step_s": first_step_s,
           "ce_losses": losses}  # fmt: skip
    if cfg.compile.enable:  # what dynamo compiled: a graph break in a checkpointed block runs that block eagerly
        stats = compile_stats()
        row.update({k: stats[k] for k in ("unique_graphs", "graph_breaks", "graph_break_reasons")})
    if cuda:  # why backend auto did not run flash-attn-4 (None: it did), as the process saw it after the steps
        from llm_training.layers.attention.fa4 import fa4_unavailable_reason

        row["fa4_unavailable_reason"] = fa4_unavailable_reason(device)
    row["peak_gib"] = None
    if cuda:  # the largest over the context-parallel ranks
        peak = torch.tensor([torch.cuda.max_memory_allocated() / GIB], device=device)
        if dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        row["peak_gib"] = peak.item()
    del trainer
    gc.collect()  # the trainer's reference cycles: free its memory before the next length's peak is measured
    if cuda:
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flavor", default="motif3_small_256k")
    p.add_argument("--seq-lens", default="32768,65536")
    p.add_argument("--ac", default="long_context")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--cp", type=int, default=1, help="context-parallel degree (run under torchrun with this many processes)"
    )
    p.add_argument("--cp-mode", default="ulysses", choices=("ulysses", "ring"))
    p.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=None,
        help="torch.compile the blocks, as the SFT example does (default: on for cuda, off for the CPU logic test)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=3, help="timed steps per length")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--gpu-gib", type=float, default=139.0, help="GPU memory the estimate is checked against")
    p.add_argument("--stop-on-oom", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--keep-full-attention",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="[activation_checkpoint] keep_full_attention (long_context: flash-attn-4's full-attention output kept "
        "for the backward, not recomputed); --no-keep-full-attention measures the recompute",
    )
    p.add_argument("--dump", default="/tmp/bench_long_context_outputs")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_long_context.json"))
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench_long_context --device cuda needs a CUDA GPU (use --device cpu for the logic test)", file=sys.stderr
        )
        return 1
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != a.cp:
        p.error(f"--cp {a.cp} needs {a.cp} processes (torchrun --nproc_per_node {a.cp}); this run has {world}")
    seq_lens = [int(s) for s in a.seq_lens.split(",")]
    compiled = a.device == "cuda" if a.compile is None else a.compile
    run = (a.ac, a.device, a.attention_backend, a.warmup + a.steps, a.dump, a.gpu_gib, a.cp, a.cp_mode)
    cfgs = {S: job_config(a.flavor, S, *run, compiled=compiled, keep=a.keep_full_attention) for S in seq_lens}
    rows = []
    for S in seq_lens:  # every estimate first: the dry run needs a process without a process group
        row = {"flavor": a.flavor, "seq_len": S, "ac": a.ac, "attention_backend": a.attention_backend, "cp": a.cp,
               "cp_mode": a.cp_mode if a.cp > 1 else None, "compile": compiled,
               "keep_full_attention": a.keep_full_attention}  # fmt: skip
        try:
            row.update(estimate(cfgs[S]))
        except Exception as e:  # noqa: BLE001 - a failing estimate must not hide the measurement
            row["estimate_error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    oom, had_process_group = False, dist.is_initialized()
    for row in rows:
        if oom and a.stop_on_oom:
            row["status"] = "skipped: a shorter length ran out of memory"
            continue
        try:
            row.update(train(cfgs[row["seq_len"]], a.warmup, a.steps))
            row["status"] = "ok"
        except torch.OutOfMemoryError as e:
            oom = True
            row["status"] = f"OOM: {str(e).splitlines()[0][:160]}"
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - one failing length must not end the table
            row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if dist.is_initialized() and not had_process_group:
        destroy_process_group()  # the group the Trainer's FSDP2 (and context parallelism) ran in
    ok = all(r["status"] == "ok" or r["status"].startswith(("OOM", "skipped")) for r in rows)
    if rank != 0:
        return 0 if ok else 1
    gpu = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    layout = f"context parallel {a.cp} ({a.cp_mode})" if a.cp > 1 else "one device"
    print(
        f"device: {gpu}; flavor {a.flavor}, AC {a.ac}, attention {a.attention_backend}, batch 1, {layout}, "
        f"{'compiled' if compiled else 'eager'}, full attention {'kept' if a.keep_full_attention else 'recomputed'}"
    )
    print(f"{'seq':>8}{'s/step':>9}{'tok/s':>9}{'first s':>9}{'peak GiB':>10}{'est GiB':>9}{'est act':>9}  status")
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        print(
            f"{r['seq_len']:>8}{fmt(r.get('step_s'), '.2f'):>9}{fmt(r.get('tokens_per_s'), '.0f'):>9}"
            f"{fmt(r.get('first_step_s'), '.1f'):>9}"
            f"{fmt(r.get('peak_gib'), '.1f'):>10}{fmt(r.get('estimate_total_gib'), '.1f'):>9}"
            f"{fmt(r.get('estimate_activation_peak_gib'), '.1f'):>9}  {r['status']}"
            + (f" (estimate: {r['estimate_error']})" if "estimate_error" in r else "")
            + (f" (no flash-attn-4: {r['fa4_unavailable_reason']})" if r.get("fa4_unavailable_reason") else "")
            + (f" ({r['graph_breaks']} graph breaks: {r['graph_break_reasons']})" if r.get("graph_breaks") else "")
        )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"device": gpu, "cp": a.cp, "rows": rows}, indent=2))
    print(f"wrote {a.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
