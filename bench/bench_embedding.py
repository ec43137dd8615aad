"""The token embedding's share of one optimizer step on one GPU: autograd's path against the in-place gradient.

One step = `--micro-batches` lookups of `--tokens` ids each into an fp32 [V, H] table, the rows cast to bf16 (what
the blocks get), and each micro-batch's backward with a bf16 upstream gradient; then `.grad` is dropped
(`zero_grad`). Two paths (`llm_training.layers.embedding`):

  * autograd   `nn.Embedding` + a cast: each backward builds a dense fp32 [V, H] gradient (fill + scatter) that
               AccumulateGrad adds into `.grad` (stolen at the first micro-batch)
  * in place   `Embedding.accumulate_grad_in_place(bf16)`: the backward adds the rows into `.grad` itself
               (`index_put_` with accumulation; `.grad` created as zeros at the step's first backward)

Prints ms per step and peak allocated memory of each path, and checks their gradients agree (fp32 summation order).

Usage: python bench/bench_embedding.py [--vocab 220160] [--hidden 4096] [--tokens 16384] [--micro-batches 4]
       [--repeats 7] [--out bench_embedding.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch
from cuda_timing import cuda_time_ms
from torch import nn

from llm_training.layers.embedding import Embedding


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=220160)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=16384, help="ids per micro-batch (trunk + MTP lookups)")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    V, H = args.vocab, args.hidden
    g = torch.Generator(device=dev).manual_seed(0)
    ids = [torch.randint(0, V, (args.tokens,), device=dev, generator=g) for _ in range(args.micro_batches)]
    ups = [torch.randn(args.tokens, H, device=dev, generator=g).to(torch.bfloat16) for _ in ids]

    autograd_table = nn.Embedding(V, H, device=dev)
    in_place_table = Embedding(V, H).to(dev)
    in_place_table.load_state_dict(autograd_table.state_dict())
    in_place_table.accumulate_grad_in_place(torch.bfloat16)
    lookups = {
        "autograd": (autograd_table, lambda x: autograd_table(x).to(torch.bfloat16)),
        "in place": (in_place_table, in_place_table),
    }

    def step(table: nn.Module, lookup) -> None:
        table.weight.grad = None
        for x, up in zip(ids, ups):
            lookup(x).backward(up)

    rows, grads = [], {}
    for name, (table, lookup) in lookups.items():
        step(table, lookup)
        grads[name] = table.weight.grad.clone()
        table.weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = statistics.median(cuda_time_ms(functools.partial(step, table, lookup), warmup=1, repeats=args.repeats))
        peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
        table.weight.grad = None
        rows.append({"path": name, "ms_per_step": ms, "peak_extra_gib": peak_gib})
    diff = float((grads["in place"] - grads["autograd"]).abs().max())
    scale = float(grads["autograd"].abs().max())
    print(f"{torch.cuda.get_device_name()}  V={V} H={H}  {args.micro_batches} x {args.tokens} ids")
    print(f"{'path':<10} {'ms/step':>8} {'peak extra GiB':>15}")
    for r in rows:
        print(f"{r['path']:<10} {r['ms_per_step']:>8.2f} {r['peak_extra_gib']:>15.2f}")
    print(f"in place / autograd: {rows[1]['ms_per_step'] / rows[0]['ms_per_step']:.3f}x time; gradients: max |diff| "
          f"{diff:.3g} of max |grad| {scale:.3g}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "rows": rows,
                       "max_abs_grad_diff": diff, "max_abs_grad": scale}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
