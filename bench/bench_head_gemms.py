"""The LM head's three GEMMs on one GPU, one at a time, at the loss's chunk shapes: TF/s by chunk length and form.

The chunked loss (`llm_training.trainer.losses`) runs per chunk of C tokens, V = vocabulary, H = hidden:

  * logits  [C, V] = h [C, H] @ W^T        out fp32 (`mm(out_dtype=float32)`), or bf16 (then a cast)
  * dh      [C, H] = G [C, V] @ W [V, H]   G bf16, either the CE kernel's in-place view (row stride 2V) or contiguous
  * dW      [V, H] += G^T [V, C] @ h [C, H] accumulated in fp32 inside the GEMM (`baddbmm` as the loss does, or
                                          `addmm`, beta 1), or bf16 out

This prints each form's ms and TF/s for C in `--chunks`, so the loss's chunk size and layout can be chosen from
measured rates (a whole 8192-token micro-batch is what an unchunked loss such as torchtitan's runs).

Usage: python bench/bench_head_gemms.py [--chunks 1024,2048,4096,8192] [--vocab 220160] [--hidden 4096]
       [--out bench_head_gemms.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from cuda_timing import cuda_time_ms


def _rate(ms: float, flop: float) -> float:
    return flop / (ms * 1e-3) / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="1024,2048,4096,8192")
    ap.add_argument("--vocab", type=int, default=220160)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    V, H = args.vocab, args.hidden
    torch.manual_seed(0)
    w_VH = (torch.randn(V, H, device=dev) * 0.02).to(torch.bfloat16)
    acc_VH = torch.zeros(V, H, device=dev)
    rows = []
    for C in (int(c) for c in args.chunks.split(",")):
        h_CH = torch.randn(C, H, device=dev).to(torch.bfloat16)
        logits32 = torch.empty(C, V, device=dev)
        g_inplace = logits32.view(torch.bfloat16)[:, :V]  # the CE kernel's layout: row stride 2V
        g_dense = torch.randn(C, V, device=dev).to(torch.bfloat16) * 1e-3
        g_inplace.copy_(g_dense)
        dh = torch.empty(C, H, device=dev, dtype=torch.bfloat16)
        flop = 2.0 * C * V * H
        forms = {
            "logits fp32 out": lambda: torch.mm(h_CH, w_VH.t(), out_dtype=torch.float32, out=logits32),
            "logits bf16 out": lambda: torch.mm(h_CH, w_VH.t()),
            "dh, G in place": lambda: torch.mm(g_inplace, w_VH, out=dh),
            "dh, G dense": lambda: torch.mm(g_dense, w_VH, out=dh),
            "dW fp32 += (in place G)": lambda: torch.baddbmm(
                acc_VH[None], g_inplace.t()[None], h_CH[None], out_dtype=torch.float32, out=acc_VH[None]
            ),
            "dW fp32 += (dense G)": lambda: torch.baddbmm(
                acc_VH[None], g_dense.t()[None], h_CH[None], out_dtype=torch.float32, out=acc_VH[None]
            ),
            "dW fp32 += addmm (in place G)": lambda: torch.addmm(
                acc_VH, g_inplace.t(), h_CH, out_dtype=torch.float32, out=acc_VH
            ),
            "dW bf16 out": lambda: torch.mm(g_dense.t(), h_CH),
        }
        for name, fn in forms.items():
            try:
                ms = statistics.median(cuda_time_ms(fn, warmup=2, repeats=args.repeats))
            except (RuntimeError, TypeError, NotImplementedError) as e:  # a form this torch's CUDA build lacks
                rows.append({"chunk": C, "form": name, "ms": None, "tflops": None, "error": str(e)[:200]})
                continue
            rows.append({"chunk": C, "form": name, "ms": ms, "tflops": _rate(ms, flop)})
        del h_CH, logits32, g_inplace, g_dense, dh
        torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}  V={V} H={H}")
    print(f"{'chunk':>6}  {'form':<30} {'ms':>8} {'TF/s':>7}")
    for r in rows:
        if r["ms"] is None:
            print(f"{r['chunk']:>6}  {r['form']:<30} unavailable: {r['error']}")
        else:
            print(f"{r['chunk']:>6}  {r['form']:<30} {r['ms']:>8.3f} {r['tflops']:>7.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "vocab": V, "hidden": H, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
