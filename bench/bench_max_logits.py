"""QK-clip's max-logit side pass alone, at one motif3_proxy micro-batch (B 4 x S 4096, 80 query / 16 KV heads,
qk head dim 192, bf16, rows of two packed documents), full-causal and sliding-window (128) layers: the torch-ops
pass (`attention_masks.chunked_max_logits`, what flash-attn-4 and cuDNN SDPA used before) against the Triton
kernel (`layers.max_logits_kernels`) in a few tilings, side by side in one run; each kernel's result is checked
against the torch pass (bf16 products, fp32 sums: equal to ~1e-3 relative). When flash-attn-4 imports, its
forward at the same shape is timed too, for scale.

    python bench/bench_max_logits.py [--batch 4] [--seq 4096] [--repeats 10] [--out bench/results/bench_max_logits.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from cuda_timing import cuda_time_ms

from llm_training.layers.attention.masks import chunked_max_logits, document_starts

TILINGS = [(64, 64, 4), (128, 64, 4), (128, 64, 8), (64, 128, 4), (128, 128, 8)]  # (block_m, block_n, warps)


def _fa4_forward_ms(q, k, v, window, docs, repeats):
    """flash-attn-4's forward (the fa4 backend, no max-logit pass) at this shape, or None without flash-attn-4."""
    from llm_training.layers.attention.backends import build_attention_metadata
    from llm_training.layers.attention.fa4 import fa4_attention, fa4_usable

    if not fa4_usable(q.device):
        return None
    meta = build_attention_metadata("fa4", docs, [window], q.shape[0], q.shape[1], q.device)

    def run():
        return fa4_attention(q, k, v, scale=0.07, window=window, metadata=meta, record_max_logits=False)

    return statistics.median(cuda_time_ms(run, warmup=2, repeats=repeats))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_max_logits.json"))
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_max_logits needs a CUDA GPU", file=sys.stderr)
        return 1
    from llm_training.layers.attention.max_logits_kernels import max_logits

    B, S, Hq, Hkv, D, Dv = a.batch, a.seq, 80, 16, 192, 128
    torch.manual_seed(0)
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, S, Hkv, Dv, device="cuda", dtype=torch.bfloat16)
    docs = torch.zeros(B, S, dtype=torch.long, device="cuda")
    docs[:, S // 3 :] = 1  # two documents per row, the second starting inside a block
    starts = document_starts(docs)
    rows = []
    print(f"{'layer':<9}{'pass':<34}{'ms':>8}{'speed-up':>10}  max rel. diff vs torch ops")
    for window in (None, 128):
        layer = "full" if window is None else f"window {window}"

        def torch_pass(window=window):
            return chunked_max_logits(q, k, scale=0.07, window=window, document_ids=docs)

        want = torch_pass()
        base = statistics.median(cuda_time_ms(torch_pass, warmup=2, repeats=a.repeats))
        rows.append({"layer": layer, "pass": "torch ops (chunked_max_logits)", "ms": base})
        print(f"{layer:<9}{'torch ops (chunked_max_logits)':<34}{base:8.3f}{1.0:9.2f}x", flush=True)
        for bm, bn, nw in TILINGS:

            def kernel(window=window, bm=bm, bn=bn, nw=nw):
                return max_logits(q, k, scale=0.07, window=window, document_ids=docs, document_starts=starts,
                                  block_m=bm, block_n=bn, num_warps=nw)  # fmt: skip

            diff = ((kernel() - want).abs() / want.abs()).max().item()
            ms = statistics.median(cuda_time_ms(kernel, warmup=2, repeats=a.repeats))
            name = f"kernel {bm}x{bn}, {nw} warps"
            rows.append({"layer": layer, "pass": name, "ms": ms, "speedup": base / ms, "max_rel_diff": diff})
            print(f"{layer:<9}{name:<34}{ms:8.3f}{base / ms:9.2f}x  {diff:.1e}", flush=True)
        fa4_ms = _fa4_forward_ms(q, k, v, window, docs, a.repeats)
        if fa4_ms is not None:
            rows.append({"layer": layer, "pass": "flash-attn-4 forward (for scale)", "ms": fa4_ms})
            print(f"{layer:<9}{'flash-attn-4 forward (for scale)':<34}{fa4_ms:8.3f}", flush=True)
    report = {"gpu": torch.cuda.get_device_name(), "B": B, "S": S, "Hq": Hq, "Hkv": Hkv, "D": D, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
