"""mHC's fused backward kernels (`layers.mhc_kernels`) alone, at one motif3_proxy micro-batch (4 x 4096 tokens,
n 4, H 4096, bf16 stream): milliseconds per launch, the bytes each must move and the bandwidth that makes, and
each output's relative error against the same gradient as fp32 tensor ops on the GPU, in a few tilings. Then the
two autograd Functions that use them, forward + backward under torch.compile, once with inductor's code for the
backward ([kernels] mhc_backward = "tensor_ops") and once with these kernels ("fused"), side by side in the same run.
(H200, session 6: mix 3.76 -> 2.88 ms, collapse 1.55 -> 1.49 ms per Function call; the kernels 1.39 and 0.38 ms.
Session 9: the mix kernel's current layout 1.08 / 1.40 ms with X given / rebuilt, against 1.38 / 2.14 ms for the
pair-row layout it replaced: bench/results/bench_mhc_kernels_session9_layouts.json.)

    python bench/bench_mhc_kernels.py [--tokens 16384] [--skip-functions] [--out bench/results/bench_mhc_kernels.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from cuda_timing import cuda_time_ms

from llm_training.layers.mhc import kernels as K

# collapse: (block_h, num_warps); on the H200 128 x 4 was the best of (128, 4), (256, 4), (512, 8), (256, 2)
TOKEN_TILINGS = [(64, 2), (64, 4), (128, 2), (128, 4), (256, 2)]
# mix: on the H200 (session 9) 64 x 2 was the best of these, summed over both stream modes
MIX_TILINGS = [(64, 2), (128, 4), (256, 4), (256, 8), (512, 8)]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def function_rows(x, g, h, p, y, repeats: int) -> list[dict]:
    """Each mHC autograd Function, forward + backward under torch.compile, with [kernels] mhc_backward = tensor_ops
    (inductor's code for the backward) and = fused (these kernels), side by side: the step's real alternatives."""
    from llm_training.layers.mhc import hyper_connections as mhc

    x, g, h, p, y = (t.unsqueeze(0) for t in (x, g, h, p, y))  # [B = 1, S = T, ...]: the Functions' layout
    ops = {
        "mix": (lambda x, h, p, y, fused: mhc._MixStreams.apply(x, h, p, y, fused), (x, h, p, y), g),
        "collapse": (lambda x, p, fused: mhc._CollapseStreams.apply(x, p, fused), (x, p), y),
    }  # fmt: skip
    out = []
    print(f"\n{'function (fwd+bwd, compiled)':<30}{'tensor_ops ms':>14}{'fused ms':>10}{'speed-up':>10}")
    for name, (op, inputs, grad) in ops.items():
        ms = {}
        for fused in (False, True):
            leaves = [t.detach().requires_grad_() for t in inputs]
            compiled = torch.compile(lambda *args, op=op, fused=fused: op(*args, fused), fullgraph=True)

            def step(compiled=compiled, leaves=leaves, grad=grad):
                compiled(*leaves).backward(grad)

            ms[fused] = statistics.median(cuda_time_ms(step, warmup=3, repeats=repeats))
        out.append({"function": name, "tensor_ops_ms": ms[False], "fused_ms": ms[True]})
        print(f"{name:<30}{ms[False]:14.3f}{ms[True]:10.3f}{ms[False] / ms[True]:9.2f}x", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--skip-functions", action="store_true", help="only the kernels, not the compiled Functions")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_mhc_kernels.json"))
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_mhc_kernels needs a CUDA GPU", file=sys.stderr)
        return 1
    T, n, H = a.tokens, 4, 4096
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    x0 = torch.randn(T, n, H, device=dev, dtype=bf)
    h0, p0 = torch.rand(T, n, n, device=dev), torch.rand(T, n, device=dev)
    y0 = torch.randn(T, H, device=dev, dtype=bf)
    x = ((h0 @ x0.float()) + p0[..., None] * y0.float()[:, None, :]).to(bf)  # the stream the forward stored
    g = torch.randn(T, n, H, device=dev, dtype=bf)
    h, p, y = torch.rand(T, n, n, device=dev), torch.rand(T, n, device=dev), torch.randn(T, H, device=dev, dtype=bf)
    src = (x0, h0, p0, y0)
    stream, vec = T * n * H * 2, T * H * 2  # bytes of one bf16 stream and of one [T, H] tensor

    xf = x.float()
    ref = {
        "mix": (h.transpose(-1, -2) @ g.float(), torch.einsum("tic,tjc->tij", g.float(), xf)),
        "collapse": (p[..., None] * y.float()[:, None, :], torch.einsum("tic,tc->ti", xf, y.float())),
    }  # fmt: skip
    cases = []
    for from_source in (False, True):
        xs, s = (None, src) if from_source else (x, (None,) * 4)
        read_x = stream + (vec if from_source else 0)
        for bh, nw in MIX_TILINGS:
            tiling = f"block_h {bh}, warps {nw}"
            cases.append(("mix", from_source, tiling, lambda xs=xs, s=s, bh=bh, nw=nw: K.mix_backward(g, xs, h, p, y, s, bh, nw),
                          2 * stream + read_x + 2 * vec))  # fmt: skip
        for bh, nw in TOKEN_TILINGS:
            tiling = f"block_h {bh}, warps {nw}"
            cases.append(("collapse", from_source, tiling, lambda xs=xs, s=s, bh=bh, nw=nw: K.collapse_backward(y, xs, p, s, bh, nw),
                          stream + read_x + vec))  # fmt: skip
    rows = []
    print(f"{'kernel':<11}{'source':>7}  {'tiling':<32}{'ms':>8}{'GB/s':>8}  rel. error of the outputs")
    for name, from_source, tiling, fn, nbytes in cases:
        out = fn()
        errs = [_rel(out[0], ref[name][0]), _rel(out[1], ref[name][1])]
        ms = statistics.median(cuda_time_ms(fn, warmup=3, repeats=a.repeats))
        rows.append({"kernel": name, "from_source": from_source, "tiling": tiling, "ms": ms,
                     "gb_per_s": nbytes / ms / 1e6, "bytes": nbytes, "rel_errors": errs})  # fmt: skip
        print(f"{name:<11}{from_source!s:>7}  {tiling:<32}{ms:8.3f}{nbytes / ms / 1e6:8.0f}  "
              + ", ".join(f"{e:.1e}" for e in errs), flush=True)  # fmt: skip
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    report = {"gpu": torch.cuda.get_device_name(), "T": T, "n": n, "H": H, "rows": rows, "functions": []}
    Path(a.out).write_text(json.dumps(report, indent=1))
    if not a.skip_functions:
        report["functions"] = function_rows(x, g, h, p, y, a.repeats)
        Path(a.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
