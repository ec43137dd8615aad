"""Training-step benchmark (GPU): full Motif-3 training steps (forward, chunked/fused CE + MTP, backward,
grad clip, Muon + AdamW, QK-clip, expert-bias update) through the real Trainer, in bf16 (FSDP2 1-rank
mixed precision), on random token batches.

Reports per configuration: median step time, tokens/s, TFLOP/s and MFU in both conventions of
ARCHITECTURE.md §7 (megatron / torchtitan, dense bf16 peak of the GPU), peak memory. Before timing it checks
the first step's CE against the untrained-model reference ln(V) (random init => near-uniform predictions).

    python bench/bench_train.py                                   # motif3_small and motif3_proxy defaults
    python bench/bench_train.py --flavor motif3_small --seq-len 4096 --batch 8 --ac none --steps 10
Writes bench/results/bench_train.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

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


def random_batch(batch: int, seq_len: int, vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random tokens packed as 2 documents per row (exercises the document mask), next-token labels."""
    ids = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    half = seq_len // 2
    pos = torch.cat([torch.arange(half), torch.arange(seq_len - half)]).expand(batch, seq_len).contiguous()
    doc = torch.cat([torch.zeros(half, dtype=torch.long), torch.ones(seq_len - half, dtype=torch.long)])
    doc = doc.expand(batch, seq_len).contiguous()
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[:, half - 1] = -100  # no prediction across the document boundary
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "document_ids": doc}


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
) -> dict:
    cfg = ConfigManager().parse_args([
        "--job.config_file", str(PACKAGE_DIR / "motif" / "train_configs" / "debug_cpu.toml"),
        f"--job.dump_folder={dump}", f"--job.run_name=bench_{flavor}_{ac}", f"--model.flavor={flavor}",
        "--training.device=cuda", "--training.mixed_precision_param=bfloat16", f"--training.seq_len={seq_len}",
        f"--training.local_batch_size={batch}", f"--training.steps={steps + warmup}", "--checkpoint.enable=false",
        f"--activation_checkpoint.mode={ac}", f"--compile.enable={'true' if compile_ else 'false'}",
        "--metrics.save_jsonl=false", "--lr_scheduler.warmup_steps=1",
    ])  # fmt: skip
    args = get_flavor(flavor)
    dims = ParallelDims(1, -1, 1, 1, 1)
    device, _ = setup_distributed(cfg.training.device, dims)  # a 1-rank nccl group (FSDP2), kept for the run
    trainer = Trainer(cfg, dims, device)
    gen = torch.Generator().manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    times_ms, first = [], None
    for i in range(steps + warmup):
        mb = random_batch(batch, seq_len, args.vocab_size, gen)
        trainer.train_state.step = i + 1
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        rec = trainer.train_step([mb])
        end.record()
        torch.cuda.synchronize()
        if i == 0:
            first = rec
            # reference: an untrained model predicts ~uniformly: CE ~ ln(V) + var(logit)/2, with logit std
            # 0.02 * sqrt(H) at init (<= 1.3 for H = 4096), so within 1.5 of ln(V)
            if not (math.isfinite(rec.ce_loss) and abs(rec.ce_loss - math.log(args.vocab_size)) < 1.5):
                raise RuntimeError(
                    f"{flavor}: first-step CE {rec.ce_loss:.3f} is not ~ln(V) = {math.log(args.vocab_size):.3f}"
                )
        if i >= warmup:
            times_ms.append(start.elapsed_time(end))
    if profile:
        profile_steps(trainer, batch, seq_len, args.vocab_size, profile, profile_out)
    del trainer
    med_s = statistics.median(times_ms) / 1e3
    tokens = batch * seq_len
    peak = peak_bf16_flops(torch.device("cuda"))
    row = {
        "flavor": flavor, "seq_len": seq_len, "batch": batch, "ac": ac, "compile": compile_,
        "step_ms_median": med_s * 1e3, "tokens_per_s": tokens / med_s,
        "first_ce": first.ce_loss, "ln_vocab": math.log(args.vocab_size),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "peak_bf16_tflops": peak / 1e12 if peak else None,
    }  # fmt: skip
    for conv in ("megatron", "torchtitan"):
        tflops = tokens / med_s * training_flops_per_token(args, seq_len, conv) / 1e12
        row[f"tflops_{conv}"] = tflops
        row[f"mfu_{conv}"] = tflops * 1e12 / peak if peak else None
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flavor")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ac", default="none", choices=("none", "full", "selective"))
    p.add_argument("--compile", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_train.json"))
    p.add_argument("--dump", default="/tmp/bench_train_outputs")
    p.add_argument("--profile", type=int, default=0, help="profile this many extra steps of each case")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_train needs a CUDA GPU", file=sys.stderr)
        return 1
    cases = [(a.flavor, a.seq_len, a.batch, a.ac)] if a.flavor else DEFAULT_CASES
    rows = []
    for flavor, seq, batch, ac in cases:
        try:
            profile_out = str(Path(a.out).with_name(f"profile_{flavor}_{ac}.txt"))
            rows.append(run_case(flavor, seq, batch, ac, a.steps, a.warmup, a.compile, a.dump, a.profile, profile_out))
        except torch.OutOfMemoryError as e:
            rows.append({"flavor": flavor, "seq_len": seq, "batch": batch, "ac": ac, "error": f"OOM: {str(e)[:200]}"})
        torch.cuda.empty_cache()
    print(f"GPU: {torch.cuda.get_device_name()}")
    hdr = f"{'flavor':<14}{'seq':>6}{'B':>4}{'ac':>10}{'ms/step':>10}{'tok/s':>10}{'TF/s mg':>9}{'MFU mg':>8}{'TF/s tt':>9}{'MFU tt':>8}{'mem GiB':>9}"
    print(hdr)
    for r in rows:
        if "error" in r:
            print(f"{r['flavor']:<14}{r['seq_len']:>6}{r['batch']:>4}{r['ac']:>10}  {r['error']}")
            continue
        mfu = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        print(f"{r['flavor']:<14}{r['seq_len']:>6}{r['batch']:>4}{r['ac']:>10}{r['step_ms_median']:>10.1f}"
              f"{r['tokens_per_s']:>10.0f}{r['tflops_megatron']:>9.1f}{mfu(r['mfu_megatron']):>8}"
              f"{r['tflops_torchtitan']:>9.1f}{mfu(r['mfu_torchtitan']):>8}{r['peak_mem_gib']:>9.1f}")  # fmt: skip
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
