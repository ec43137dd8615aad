"""Benchmark the Motif-3 model on one GPU: (1) motif3_small forward+backward in bf16 at seq 4096 for several
batch sizes (tokens/s, MFU in both FLOP conventions against a 989 TFLOP/s dense-bf16 peak), and (2) the
GDLA attention kernel alone per backend (causal full / sliding window / packed documents).

Usage (H200):  python bench/bench_model.py [--batch-sizes 2,4,8] [--seq-len 4096] [--compile]
                                           [--attention-backend auto] [--out bench_model.json]
Prints a table per part and writes JSON. Each measurement is checked against a reference first
(model: loss finite and the first step's loss equal to a second run's; attention: vs the fp32 reference
kernel on a shorter sequence), then timed with CUDA events after warm-up (median of the repeats).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from cuda_timing import cuda_time_ms

from llm_training.layers.attention.backends import build_attention_metadata, get_attention_backend
from llm_training.motif import get_flavor, training_flops_per_token
from llm_training.motif.model import Motif3Model
from llm_training.trainer.losses import linear_cross_entropy_sum
from llm_training.trainer.metrics import peak_bf16_flops


def peak_flops() -> float:
    """Dense bf16 peak of this GPU (H100/H200 989 TFLOP/s when the name is not in the table)."""
    return peak_bf16_flops(torch.device("cuda")) or 989e12


def chunked_ce(hidden_BSH: torch.Tensor, weight_VH: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Mean CE through the trainer's chunked linear cross-entropy (never the full [tokens, V] logits)."""
    return linear_cross_entropy_sum(hidden_BSH, weight_VH, labels_BS) / labels_BS.numel()


def bench_model(args) -> list[dict]:
    margs = get_flavor(args.flavor)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Motif3Model(margs, attention_backend=args.attention_backend)
    model.to_empty(device="cuda")
    model.init_weights()
    model.to(torch.bfloat16)
    for m in model.modules():  # expert bias stays fp32 (a buffer the optimizer never sees)
        if hasattr(m, "expert_bias"):
            m.expert_bias = m.expert_bias.float()
    if args.compile:
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer)
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        S = args.seq_len
        ids = torch.randint(0, margs.vocab_size, (bs, S), device="cuda")
        labels = torch.roll(ids, -1, dims=1)

        def step():
            out = model(ids, return_hidden=True)
            loss = chunked_ce(out.hidden, model.lm_head.weight, labels)
            for h in out.mtp_hidden:
                loss = loss + 0.3 * chunked_ce(h, model.lm_head.weight, torch.roll(labels, -1, 1))
            loss.backward()
            return loss

        row = {
            "flavor": args.flavor,
            "batch": bs,
            "seq_len": S,
            "params": params,
            "compile": args.compile,
            "attention_backend": args.attention_backend,
        }
        try:
            torch.cuda.reset_peak_memory_stats()
            l1 = step().item()
            model.zero_grad(set_to_none=True)
            l2 = step().item()
            model.zero_grad(set_to_none=True)
            if not (torch.isfinite(torch.tensor([l1, l2])).all() and abs(l1 - l2) < 1e-2 * abs(l1)):
                raise RuntimeError(f"loss check failed: {l1} vs {l2}")
            times = cuda_time_ms(lambda: (step(), model.zero_grad(set_to_none=True)), args.warmup, args.repeats)
            ms = statistics.median(times)
            tok_s = bs * S / (ms / 1e3)
            row.update(loss=l1, ms=ms, tokens_per_s=tok_s, peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30)
            for conv in ("megatron", "torchtitan"):
                flops = training_flops_per_token(margs, S, convention=conv)
                row[f"mfu_{conv}"] = tok_s * flops / (peak_flops())
        except torch.OutOfMemoryError:
            row["error"] = "OOM"
        except Exception as e:  # report and continue with the next batch size
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        rows.append(row)
        print_row(row)
    return rows


def print_row(row):
    if "error" in row:
        print(f"{row['flavor']:>14} bs={row['batch']:<3} seq={row['seq_len']:<6} ERROR {row['error']}")
        return
    print(
        f"{row['flavor']:>14} bs={row['batch']:<3} seq={row['seq_len']:<6} {row['ms']:9.1f} ms "
        f"{row['tokens_per_s']:11.0f} tok/s  MFU megatron {100 * row['mfu_megatron']:5.1f}%  "
        f"torchtitan {100 * row['mfu_torchtitan']:5.1f}%  peak {row['peak_mem_gib']:.1f} GiB"
    )


def bench_attention(args) -> list[dict]:
    a = get_flavor("motif3_seq")  # the production GDLA shape: 80 q heads, 16 KV heads, qk 192, v 128
    B, S, Hq, Hkv = 2, args.seq_len, a.num_attention_heads, a.num_key_value_heads
    scale = a.head_dim**-0.5
    cases = [
        ("causal", None, False),
        (f"window{a.sliding_window}", a.sliding_window, False),
        ("causal+docs", None, True),
        (f"window{a.sliding_window}+docs", a.sliding_window, True),
    ]
    rows = []
    for backend in [b for b in args.attention_backends.split(",")]:
        kernel = get_attention_backend(backend).kernel
        ref_kernel = get_attention_backend("reference").kernel
        for name, window, docs in cases:
            row = {"backend": backend, "case": name, "B": B, "S": S, "Hq": Hq, "Hkv": Hkv}
            try:

                def make(s):
                    g = torch.Generator(device="cuda").manual_seed(0)
                    q = torch.randn(B, s, Hq, a.head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
                    k = torch.randn(B, s, Hkv, a.head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
                    v = torch.randn(B, s, Hkv, a.v_head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
                    d = None
                    if docs:  # three documents of uneven length per row
                        pos = torch.arange(s, device="cuda")
                        d = ((pos >= s // 5).int() + (pos >= s // 2).int()).expand(B, s).contiguous()
                    return [t.requires_grad_() for t in (q, k, v)], d

                def kwargs(name, d, s):  # the metadata a model forward builds once for all its layers
                    meta = build_attention_metadata(name, d, [window], B, s, torch.device("cuda"))
                    return dict(scale=scale, window=window, metadata=meta, record_max_logits=False)

                (q, k, v), d = make(1024)  # correctness vs the fp32 reference on a short sequence
                out, _ = kernel(q, k, v, **kwargs(backend, d, 1024))
                ref, _ = ref_kernel(q, k, v, **kwargs("reference", d, 1024))
                err = (out.float() - ref.float()).abs().max().item()
                if err > 5e-2:
                    raise RuntimeError(f"mismatch vs reference: max abs err {err:.3g}")
                (q, k, v), d = make(S)
                kw = kwargs(backend, d, S)
                grad = torch.randn(B, S, Hq, a.v_head_dim, device="cuda", dtype=torch.bfloat16)

                def fwd_bwd():
                    o, _ = kernel(q, k, v, **kw)
                    torch.autograd.grad(o, (q, k, v), grad)

                ms = statistics.median(cuda_time_ms(fwd_bwd, args.warmup, args.repeats))
                keys = (S / 2) if window is None else min(window + 1, S)
                fwd_flops = 2 * B * Hq * S * keys * (a.head_dim + a.v_head_dim)
                row.update(max_err=err, ms=ms, tflops=3.5 * fwd_flops / (ms / 1e3) / 1e12)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            if "error" in row:
                print(f"{backend:>8} {name:>18}  ERROR {row['error']}")
            else:
                print(
                    f"{backend:>8} {name:>18} {row['ms']:8.2f} ms {row['tflops']:7.1f} TFLOP/s "
                    f"(fwd+bwd = 3.5x fwd, causal halved)  err {row['max_err']:.2e}"
                )
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="motif3_small")
    p.add_argument("--batch-sizes", default="2,4,8")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--attention-backends", default="sdpa,flex,auto")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--skip-attention", action="store_true")
    p.add_argument("--out", default="bench_model.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_model.py needs a CUDA GPU", file=sys.stderr)
        return 1
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "peak_tflops": peak_flops() / 1e12,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if not args.skip_attention:
        print("== GDLA attention kernel (motif3_seq head shape), fwd+bwd bf16 ==")
        result["attention"] = bench_attention(args)
    if not args.skip_model:
        # The attention sweep above compiled flex_attention for other head shapes; start the model with a
        # clean dynamo cache so it does not run into the recompile limit and fall back to unfused flex.
        torch._dynamo.reset()
        print(f"== {args.flavor} fwd+bwd bf16, attention_backend={args.attention_backend} ==")
        result["model"] = bench_model(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
