"""Training-step benchmark (GPU): full Motif-3 training steps (forward, chunked/fused CE + MTP, backward,
grad clip, Muon + AdamW, QK-clip, expert-bias update) through the real Trainer, in bf16 (FSDP2 1-rank
mixed precision), on random token batches.

Reports per configuration: median step time, tokens/s, TFLOP/s and MFU in both conventions of
docs/architecture.md §7 (megatron / torchtitan, dense bf16 peak of the GPU), peak memory. Before timing it checks
the first step's CE against the untrained-model reference ln(V) (random init => near-uniform predictions).

    python bench/bench_train.py                                   # motif3_small and motif3_proxy defaults
    python bench/bench_train.py --flavor motif3_small --seq-len 4096 --batch 8 --ac none --steps 10
Writes bench/results/bench_train.json (or --out).

Several GPUs (weak scaling: every data rank trains `--batch` sequences of its own per micro-batch), under torchrun:

    torchrun --nproc_per_node 8 bench/bench_train.py --flavor motif3_proxy --batch 2 --ac full --ep 8 \
        --baseline bench/results/bench_train_1gpu.json
FSDP2 shards over every data rank, `--ep` splits the experts and `--cp` each sequence over that many of the ranks.
Times are the slowest rank's; tok/s, TF/s and MFU are per GPU (tokens of all data ranks / step time / GPUs), and
with `--baseline` (a JSON of this script from one GPU) the weak-scaling efficiency is this run's tok/s per GPU over
the baseline row's of the same flavor, seq, batch and ac. Rank 0 prints and writes the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from cuda_timing import slowest_over_ranks

from llm_training.config import ConfigManager
from llm_training.config.job_config import PACKAGE_DIR
from llm_training.distributed import ParallelDims
from llm_training.distributed.utils import setup_distributed
from llm_training.motif import get_flavor, training_flops_per_token
from llm_training.trainer import Trainer
from llm_training.trainer.metrics import peak_bf16_flops

DEFAULT_CASES = [
    # flavor, seq_len, local batch, activation checkpointing
    ("motif3_small", 4096, 8, "none"),
    ("motif3_small", 4096, 8, "selective"),
    ("motif3_proxy", 4096, 2, "full"),
]


# documents per row of a random micro-batch: drawn per row from this range, 2 on average (the fixed 2 of earlier
# sessions), so the micro-batch's document count changes as packed chat data changes it
DOCUMENTS_PER_ROW = (1, 3)


def random_batch(batch: int, seq_len: int, vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random tokens packed as 1 to 3 documents per row (count and cut points drawn per row from `gen`, each document
    at least 2 tokens), positions restarting per document, next-token labels within each document only."""
    ids = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    doc = torch.empty(batch, seq_len, dtype=torch.long)
    lo, hi = DOCUMENTS_PER_ROW
    for row in range(batch):
        n_docs = int(torch.randint(lo, hi + 1, (), generator=gen))
        cuts = (torch.randperm(seq_len // 2 - 1, generator=gen)[: n_docs - 1] + 1).sort().values * 2  # even: >= 2
        doc[row] = torch.bucketize(torch.arange(seq_len), cuts, right=True)
    starts = torch.ones_like(doc, dtype=torch.bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    index = torch.arange(seq_len).expand(batch, seq_len)
    start_of = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    pos = (index - start_of).contiguous()
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = torch.where(starts[:, 1:], -100, ids[:, 1:])  # no prediction across a document boundary
    real = torch.full((batch,), seq_len, dtype=torch.long)  # no padding
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "document_ids": doc, "real_tokens": real}


def profile_steps(trainer, batch: int, seq_len: int, vocab: int, steps: int, out_path: str) -> None:
    """torch.profiler over `steps` more training steps: prints the top ops by self CUDA time and by self CPU
    time (host overhead and syncs show up there) and writes both tables next to the JSON."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            trainer.train_step([random_batch(batch, seq_len, vocab, gen)])
        torch.cuda.synchronize()
    events = prof.key_averages()
    tables = [
        events.table(sort_by="self_cuda_time_total", row_limit=30),
        events.table(sort_by="self_cpu_time_total", row_limit=20),
    ]
    print("\n\n".join(tables))
    Path(out_path).write_text("\n\n".join(tables))


def build_trainer(
    flavor: str,
    seq_len: int,
    batch: int,
    ac: str = "none",
    compile_: bool = False,
    dump: str = "/tmp/bench_train_outputs",
    steps: int = 10,
    accum: int = 1,
    optimizer: str | None = None,
    device: str = "cuda",
    quantize: str = "none",
    mhc_backward: str = "auto",
    compile_granularity: str = "auto",
    kernel_tuning: str = "",
    ep: int = 1,
    cp: int = 1,
    prebuild_workers: int | None = None,
) -> Trainer:
    """Our real Trainer (build_model + parallelize + optimizers + loss) for `flavor` on random data, as a training
    run builds it: bf16 FSDP2 mixed precision on CUDA (a 1-rank process group, or torchrun's ranks), fp32 on CPU.
    `accum` micro-batches of `batch` x `seq_len` tokens per data rank make one optimizer step; `optimizer` None keeps
    the config's default (Muon); `quantize`: the [quantize] recipe (none = bf16); `mhc_backward`: [model]
    mhc_backward; `compile_granularity`: [compile] granularity; `kernel_tuning`: [compile] kernel_tuning ("": the
    default); `prebuild_workers`: [compile] prebuild_workers (None: the default); `ep` / `cp`: the expert- /
    context-parallel degrees over torchrun's WORLD_SIZE ranks (FSDP2 over the data ranks, world / cp)."""
    on_cuda = device == "cuda"
    precision = "bfloat16" if on_cuda else "float32"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    overrides = [
        "--job.config_file", str(PACKAGE_DIR / "motif" / "train_configs" / "debug_cpu.toml"),
        f"--job.dump_folder={dump}", f"--job.run_name=bench_{flavor}_{ac}", f"--model.flavor={flavor}",
        f"--training.device={device}", f"--training.mixed_precision_param={precision}",
        "--training.mixed_precision_reduce=float32", f"--training.seq_len={seq_len}",
        f"--training.local_batch_size={batch}", f"--training.global_batch_size={batch * accum * (world // cp)}",
        f"--training.steps={steps}", "--checkpoint.enable=false",
        f"--activation_checkpoint.mode={ac}", f"--compile.enable={'true' if compile_ else 'false'}",
        "--metrics.save_jsonl=false", "--lr_scheduler.warmup_steps=1", f"--quantize.recipe={quantize}",
        f"--kernels.mhc_backward={mhc_backward}", f"--compile.granularity={compile_granularity}",
        f"--parallelism.expert_parallel_degree={ep}",
        f"--parallelism.context_parallel_degree={cp}",
    ]  # fmt: skip
    if optimizer is not None:
        overrides.append(f"--optimizer.name={optimizer}")
    if kernel_tuning:
        overrides.append(f"--compile.kernel_tuning={kernel_tuning}")
    if prebuild_workers is not None:
        overrides.append(f"--compile.prebuild_workers={prebuild_workers}")
    cfg = ConfigManager().parse_args(overrides)
    dims = ParallelDims(1, -1, cp, ep, world)
    torch_device, _ = setup_distributed(cfg.training.device, dims)  # torchrun's group, or a 1-rank one (FSDP2)
    return Trainer(cfg, dims, torch_device)


def train_step_on_random_data(trainer: Trainer, accum: int, batch: int, seq_len: int, vocab: int, gen, i: int):
    """Step `i` of the benchmark: one optimizer step of `trainer` over `accum` fresh random micro-batches."""
    trainer.train_state.step = i + 1
    return trainer.train_step([random_batch(batch, seq_len, vocab, gen) for _ in range(accum)])


def check_first_loss(name: str, ce_loss: float, vocab: int) -> None:
    """An untrained model predicts ~uniformly: CE ~ ln(V) + var(logit)/2, with logit std 0.02 * sqrt(H) at init
    (<= 1.3 for H = 4096), so within 1.5 of ln(V). Raises RuntimeError otherwise."""
    if not (math.isfinite(ce_loss) and abs(ce_loss - math.log(vocab)) < 1.5):
        raise RuntimeError(f"{name}: first-step CE {ce_loss:.3f} is not ~ln(V) = {math.log(vocab):.3f}")


def time_steps(step_fn, make_step_input, steps: int, warmup: int, device: torch.device) -> dict:
    """Run `warmup + steps` calls of `step_fn(make_step_input(i))` and time each one (CUDA events on a GPU, wall
    clock on the CPU). Returns the first call's wall seconds (compilation included: the first-step time),
    the timed steps' seconds (after warm-up), and the first call's result. Prints a line as each step starts and
    ends (a benchmark killed by a timeout then shows how far it got, e.g. still in the first, compiling, step), and
    every 30 s of the first step the compile phases finished so far (`compile_progress`), and the frames dynamo
    compiled after the first step ("later_compiled_frames", 0 when every later step ran the first step's graphs). On
    CUDA also the allocator's high-water marks (peak allocated and reserved GiB since the caller's last reset) after
    each step: whether the peak comes from the first, compiling step or from the steady state."""
    from llm_training.distributed.compile import compile_progress, compile_stats

    on_cuda = device.type == "cuda"
    times_s, first_step_s, first, frames_after_first = [], None, None, 0
    high_water = {"peak_alloc_gib_after_step": [], "peak_reserved_gib_after_step": []}
    for i in range(steps + warmup):
        print(f"[time_steps] step {i + 1}/{steps + warmup} starts{' (compiles)' if i == 0 else ''}", flush=True)
        step_input = make_step_input(i)
        wall = time.perf_counter()
        if on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        with compile_progress(lambda line: print(line, flush=True)) if i == 0 else contextlib.nullcontext():
            result = step_fn(step_input)
        if on_cuda:
            end.record()
            torch.cuda.synchronize()
        wall = time.perf_counter() - wall
        print(f"[time_steps] step {i + 1}/{steps + warmup} took {wall:.1f} s", flush=True)
        if i == 0:
            first_step_s, first = wall, result
            frames_after_first = compile_stats()["compiled_frames"]
        if i >= warmup:
            times_s.append(start.elapsed_time(end) / 1e3 if on_cuda else wall)
        if on_cuda:
            high_water["peak_alloc_gib_after_step"].append(round(torch.cuda.max_memory_allocated() / 2**30, 2))
            high_water["peak_reserved_gib_after_step"].append(round(torch.cuda.max_memory_reserved() / 2**30, 2))
    later = compile_stats()["compiled_frames"] - frames_after_first
    return {
        "times_s": times_s, "first_step_s": first_step_s, "first": first, "later_compiled_frames": later,
        **(high_water if on_cuda else {}),
    }  # fmt: skip


def throughput(tokens_per_step: int, step_s: float, flops_per_token: dict[str, float], peak: float | None) -> dict:
    """tokens/s, and per FLOP convention TFLOP/s and MFU (None without a known peak) of a step of `step_s`."""
    row = {"step_ms_median": step_s * 1e3, "tokens_per_s": tokens_per_step / step_s}
    for conv, fpt in flops_per_token.items():
        tflops = row["tokens_per_s"] * fpt / 1e12
        row[f"gflop_per_token_{conv}"] = fpt / 1e9
        row[f"tflops_{conv}"] = tflops
        row[f"mfu_{conv}"] = tflops * 1e12 / peak if peak else None
    return row


def peak_memory_gib(device: torch.device) -> dict:
    """Peak allocated and reserved memory of the CUDA caching allocator since the last reset, and the reserved
    memory now split by the stream that owns it (`segments_by_stream`; None on CPU)."""
    if device.type != "cuda":
        return {"peak_alloc_gib": None, "peak_reserved_gib": None, "reserved_by_stream": None}
    return {
        "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "reserved_by_stream": segments_by_stream(torch.cuda.memory_snapshot()),
    }


def segments_by_stream(snapshot: list[dict]) -> list[dict]:
    """The caching allocator's segments (`torch.cuda.memory_snapshot()`) summed per owning stream, largest first:
    [{"stream": "default" | "side N", "segments", "reserved_gib", "allocated_gib"}]. A freed block is reused only
    by its own stream, so memory that one stream (e.g. FSDP2's all-gather or reduce-scatter stream) keeps cached
    counts as reserved while another stream's peak allocates more: this is what the gap between the peak
    reserved and peak allocated memory is made of, when it is not fragmentation inside one stream's segments."""
    per_stream: dict[int, dict] = {}
    for seg in snapshot:
        row = per_stream.setdefault(seg["stream"], {"segments": 0, "reserved": 0, "allocated": 0})
        row["segments"] += 1
        row["reserved"] += seg["total_size"]
        row["allocated"] += seg["allocated_size"]
    ordered = sorted(per_stream.items(), key=lambda kv: -kv[1]["reserved"])
    side = iter(range(1, len(ordered) + 1))
    return [
        {
            "stream": "default" if handle == 0 else f"side {next(side)}",
            "segments": row["segments"],
            "reserved_gib": row["reserved"] / 2**30,
            "allocated_gib": row["allocated"] / 2**30,
        }
        for handle, row in ordered
    ]


def run_case(
    flavor: str,
    seq_len: int,
    batch: int,
    ac: str,
    steps: int,
    warmup: int,
    compile_: bool,
    dump: str,
    profile: int = 0,
    profile_out: str = "",
    device: str = "cuda",
    ep: int = 1,
    cp: int = 1,
) -> dict:
    args = get_flavor(flavor)
    trainer = build_trainer(flavor, seq_len, batch, ac, compile_, dump, steps + warmup, device=device, ep=ep, cp=cp)
    dev = trainer.device
    world, dp = trainer.parallel_dims.world_size, trainer.dp_size
    gen = torch.Generator().manual_seed(trainer.dp_rank)  # the context-parallel ranks of a data rank: the same rows
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    step = functools.partial(train_step_on_random_data, trainer, 1, batch, seq_len, args.vocab_size, gen)
    timed = time_steps(step, lambda i: i, steps, warmup, dev)
    check_first_loss(flavor, timed["first"].ce_loss, args.vocab_size)
    if profile:
        profile_steps(trainer, batch, seq_len, args.vocab_size, profile, profile_out)
    del step, trainer
    peak = peak_bf16_flops(dev)
    mem = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None
    row = {
        "flavor": flavor, "seq_len": seq_len, "batch": batch, "ac": ac, "compile": compile_, "gpus": world,
        "dp": dp, "ep": ep, "cp": cp, "first_ce": timed["first"].ce_loss, "ln_vocab": math.log(args.vocab_size),
        "peak_mem_gib": None if mem is None else slowest_over_ranks(mem, dev), "peak_bf16_tflops": peak / 1e12 if peak else None,
    }  # fmt: skip
    flops = {conv: training_flops_per_token(args, seq_len, conv) for conv in ("megatron", "torchtitan")}
    step_s = slowest_over_ranks(statistics.median(timed["times_s"]), dev)
    # per GPU: every data rank's batch x seq tokens in the step, over all the GPUs
    row.update(throughput(dp * batch * seq_len / world, step_s, flops, peak))
    return row


def weak_scaling(rows: list[dict], baseline_path: str) -> None:
    """Each row's `scaling_efficiency`: its tok/s per GPU over that of the baseline JSON's row of the same flavor,
    seq_len, batch and ac (None where the baseline has no such row)."""
    key = lambda r: (r["flavor"], r["seq_len"], r["batch"], r["ac"])  # noqa: E731
    base = {key(r): r for r in json.loads(Path(baseline_path).read_text())["rows"] if "error" not in r}
    for r in rows:
        b = base.get(key(r)) if "error" not in r else None
        r["scaling_efficiency"] = r["tokens_per_s"] / b["tokens_per_s"] if b else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flavor")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8, help="sequences per data rank per step")
    p.add_argument("--ac", default="none", choices=("none", "full", "selective"))
    p.add_argument("--compile", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (under torchrun)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree (under torchrun)")
    p.add_argument("--baseline", help="a JSON of this script from one GPU: adds the weak-scaling efficiency")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a logic check (fp32, gloo)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_train.json"))
    p.add_argument("--dump", default="/tmp/bench_train_outputs")
    p.add_argument("--profile", type=int, default=0, help="profile this many extra steps of each case")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench_train needs a CUDA GPU (--device cpu: the logic check)", file=sys.stderr)
        return 1
    cases = [(a.flavor, a.seq_len, a.batch, a.ac)] if a.flavor else DEFAULT_CASES
    rows = []
    for flavor, seq, batch, ac in cases:
        try:
            profile_out = str(Path(a.out).with_name(f"profile_{flavor}_{ac}.txt"))
            rows.append(run_case(flavor, seq, batch, ac, a.steps, a.warmup, a.compile, a.dump, a.profile, profile_out,
                                 a.device, a.ep, a.cp))  # fmt: skip
        except torch.OutOfMemoryError as e:
            rows.append({"flavor": flavor, "seq_len": seq, "batch": batch, "ac": ac, "error": f"OOM: {str(e)[:200]}"})
        if cuda:
            torch.cuda.empty_cache()
    if a.baseline:
        weak_scaling(rows, a.baseline)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"GPU: {gpu} x {int(os.environ.get('WORLD_SIZE', '1'))} (ep {a.ep}, cp {a.cp})")
    hdr = (f"{'flavor':<14}{'seq':>6}{'B':>4}{'ac':>10}{'ms/step':>10}{'tok/s/GPU':>10}{'TF/s mg':>9}{'MFU mg':>8}"
           f"{'TF/s tt':>9}{'MFU tt':>8}{'mem GiB':>9}{'scaling':>9}")  # fmt: skip
    print(hdr)
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    for r in rows:
        if "error" in r:
            print(f"{r['flavor']:<14}{r['seq_len']:>6}{r['batch']:>4}{r['ac']:>10}  {r['error']}")
            continue
        mem = "n/a" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}"
        print(f"{r['flavor']:<14}{r['seq_len']:>6}{r['batch']:>4}{r['ac']:>10}{r['step_ms_median']:>10.1f}"
              f"{r['tokens_per_s']:>10.0f}{r['tflops_megatron']:>9.1f}{pct(r['mfu_megatron']):>8}"
              f"{r['tflops_torchtitan']:>9.1f}{pct(r['mfu_torchtitan']):>8}{mem:>9}"
              f"{pct(r.get('scaling_efficiency')):>9}")  # fmt: skip
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"gpu": gpu, "gpus": int(os.environ.get("WORLD_SIZE", "1")), "rows": rows},
                                      indent=2))  # fmt: skip
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
