"""Benchmark the GDLA attention kernel alone, forward + backward, per backend, full-causal and sliding-window
layers, from 4K to 128K tokens per sequence, on one GPU.

Usage (H200):  python bench/bench_attention.py [--seq-lens 4096,16384,65536,131072] [--tokens 131072]
                   [--backends fa4,sdpa,fa4_pad_v,flex,flex_b64] [--kinds full,sliding] [--budget-s 150]
                   [--out bench/results/bench_attention.json]

Shape: the motif3_seq attention layer (80 query heads, 16 KV heads, qk head dim 192, v head dim 128, sliding
window 128: `Motif3ModelArgs`); batch B = max(1, tokens // S), so every row moves about the same number of
tokens (B*S = 128K by default; B = 1 at 128K). bf16 inputs, a random upstream gradient.

Backends: `sdpa` (cuDNN for full causal; an explicit-mask SDPA for the window, i.e. the math kernel, which
OOMs beyond small S), `flex` (FlexAttention, torch.compile'd, the 128-token block mask of
attention_backends.flex_block_mask), `flex_b64` (FlexAttention with a 64-token block mask and 64x64 kernel
tiles: a W = 128 window then spans 3 instead of 2 key blocks per query block, 67% instead of 50% of the
computed logits visible), `fa4` (the fa4 backend: flash-attn-4 with KV heads expanded, the default layout),
`fa4_pad_v` (flash-attn-4 native GQA with V zero-padded to 192).

FLOP counting: 2 * (d_qk + d_v) FLOPs per (query head, visible query-key pair) in the forward (QK^T and PV),
times 3.5 for forward + backward (the backward's 5 matmuls = 2.5 forwards); visible pairs are those of the
mask (causal: S(S+1)/2 per row; window W: sum_i min(i + 1, W + 1)), not the computed tiles. Share of the
ceiling: against --ceiling-tflops (790, bf16 dense on the H200). Memory floor (sliding rows): the bytes of
q, k, v, o, dO, dq, dk, dv (GQA-shaped, bf16) and the fp32 lse read or written once, over --hbm-tbs (4.2 TB/s).

Guards: each case is warmed up once (which also compiles), then timed with CUDA events; a case whose single
call exceeds --case-cap-s is reported from that one call; out-of-memory and kernel errors give a row saying so;
once --budget-s of wall time is spent the remaining cases are listed as skipped. Values are checked once per
backend against the fp32 reference on a short sequence before timing (a wrong kernel is not timed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from cuda_timing import cuda_time_ms

from llm_training.layers.attention.backends import (
    AttentionMetadata,
    build_attention_metadata,
    get_attention_backend,
    reference_attention,
)
from llm_training.motif.args import Motif3ModelArgs

BACKENDS = ("fa4", "sdpa", "fa4_pad_v", "flex", "flex_b64")  # run in this order (the budget may end the last)


def visible_pairs(S: int, window: int | None) -> int:
    """Number of (query, key) pairs a causal (window None) or sliding-window-W row of length S attends."""
    if window is None:
        return S * (S + 1) // 2
    w = min(window + 1, S)
    return w * (w + 1) // 2 + (S - w) * w


def fwd_bwd_flops(B: int, S: int, Hq: int, d_qk: int, d_v: int, window: int | None) -> float:
    return 3.5 * 2 * (d_qk + d_v) * Hq * B * visible_pairs(S, window)


def memory_floor_s(B, S, Hq, Hkv, d_qk, d_v, hbm_bytes_per_s) -> float:
    per_token = 2 * (2 * (Hq * d_qk + Hkv * d_qk + Hkv * d_v) + 2 * Hq * d_v) + 4 * Hq  # q,k,v,dq,dk,dv; o,dO; lse
    return B * S * per_token / hbm_bytes_per_s


def _flex_b64_kernel():
    """FlexAttention with a 64-token block mask (and matching 64 x 64 kernel tiles), window + causal, no docs."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def kernel(q, k, v, *, scale, window, metadata, record_max_logits):
        B, S = q.shape[:2]
        key = (S, window)
        if key not in masks:

            def mask_mod(b, h, qi, kj):
                visible = kj <= qi
                return visible if window is None else visible & (kj >= qi - window)

            masks[key] = create_block_mask(
                mask_mod, None, None, S, S, device=q.device, BLOCK_SIZE=64, _compile=S * S >= 1 << 30
            )
        out = compiled(
            *(t.transpose(1, 2) for t in (q, k, v)),
            block_mask=masks[key],
            scale=scale,
            enable_gqa=True,
            # forward and backward tiles that divide the 64-token mask blocks
            kernel_options={
                "BLOCK_M": 64,
                "BLOCK_N": 64,
                "BLOCK_M1": 32,
                "BLOCK_N1": 64,
                "BLOCK_M2": 64,
                "BLOCK_N2": 32,
            },
        )
        return out.transpose(1, 2), None

    return kernel


def make_kernel(name: str):
    """(kernel with the attention_backends signature, registry name whose metadata it reads)."""
    if name in ("sdpa", "flex", "fa4"):
        return get_attention_backend(name).kernel, name
    if name == "flex_b64":
        return _flex_b64_kernel(), "reference"
    if name == "fa4_pad_v":
        from llm_training.layers.attention.fa4 import fa4_attention_lse

        def kernel(q, k, v, *, scale, window, metadata, record_max_logits):
            return fa4_attention_lse(q, k, v, scale=scale, window=window, metadata=metadata, gqa_layout="pad_v")[
                0
            ], None

        return kernel, "fa4"
    raise ValueError(f"unknown backend {name!r}; one of {BACKENDS}")


def _inputs(B, S, Hq, Hkv, d_qk, d_v, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def make(h, d):
        return torch.randn(B, S, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()

    return make(Hq, d_qk), make(Hkv, d_qk), make(Hkv, d_v)


def check_backend(kernel, meta_name, a: Motif3ModelArgs, window) -> str | None:
    """None when `kernel` matches the fp32 reference (values and gradients) at B1 S1024, else what differs."""
    B, S = 1, 1024
    q, k, v = _inputs(B, S, 2 * (a.num_attention_heads // a.num_key_value_heads), 2, a.head_dim, a.v_head_dim)
    scale = a.head_dim**-0.5
    meta = build_attention_metadata(meta_name, None, [window], B, S, q.device)
    out, _ = kernel(q, k, v, scale=scale, window=window, metadata=meta, record_max_logits=False)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref, _ = reference_attention(q, k, v, scale=scale, window=window, metadata=meta, record_max_logits=False)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for label, x, y, tol in [("out", out, ref, 2e-2), *zip(("dq", "dk", "dv"), grads, ref_grads, [5e-2] * 3)]:
        err = (x.float() - y.float()).abs().max().item()
        if not err <= tol + tol * y.float().abs().max().item():
            return f"{label} max abs err {err:.3g}"
    return None


def time_case(kernel, meta_name, B, S, a: Motif3ModelArgs, window, repeats, case_cap_s):
    q, k, v = _inputs(B, S, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.v_head_dim)
    meta = build_attention_metadata(meta_name, None, [window], B, S, q.device) if meta_name else AttentionMetadata()
    scale = a.head_dim**-0.5
    grad_out = torch.randn(B, S, a.num_attention_heads, a.v_head_dim, device="cuda", dtype=torch.bfloat16)

    def step():
        out, _ = kernel(q, k, v, scale=scale, window=window, metadata=meta, record_max_logits=False)
        torch.autograd.grad(out, (q, k, v), grad_out)

    step()  # warm-up (and compilation)
    single = cuda_time_ms(step, warmup=0, repeats=1)
    if single[0] / 1e3 > case_cap_s or repeats <= 1:
        return single[0], 1
    times = single + cuda_time_ms(step, warmup=0, repeats=repeats - 1)
    return statistics.median(times), len(times)


def run_case(name, S, kind, window, margs, a, kernels, checked, start) -> dict:
    """One table cell: the guarded check + timing of backend `name` at (S, kind)."""
    B = max(1, a.tokens // S)
    row = {"kind": kind, "window": window, "seq_len": S, "batch": B, "backend": name}
    if time.monotonic() - start > a.budget_s:
        return row | {"status": "skipped: budget"}
    if name == "sdpa" and window is not None and S > 4096:
        return row | {"status": "skipped: masked SDPA is the math kernel ([S, S] scores)"}
    H, Hkv, d_qk, d_v = margs.num_attention_heads, margs.num_key_value_heads, margs.head_dim, margs.v_head_dim
    try:
        if name not in kernels:
            kernels[name] = make_kernel(name)
        kernel, meta_name = kernels[name]
        if (name, kind) not in checked:
            checked[(name, kind)] = check_backend(kernel, meta_name, margs, window)
        if checked[(name, kind)] is not None:
            return row | {"status": f"WRONG vs reference: {checked[(name, kind)]}"}
        ms, n = time_case(kernel, meta_name, B, S, margs, window, a.repeats, a.case_cap_s)
        tflops = fwd_bwd_flops(B, S, H, d_qk, d_v, window) / (ms / 1e3) / 1e12
        floor_ms = memory_floor_s(B, S, H, Hkv, d_qk, d_v, a.hbm_tbs * 1e12) * 1e3
        row.update(status="ok", ms=ms, runs=n, tflops=tflops, ceiling_share=tflops / a.ceiling_tflops)
        row.update(floor_ms=floor_ms, x_floor=ms / floor_ms)
    except torch.OutOfMemoryError:
        row["status"] = "OOM"
    except Exception as e:  # noqa: BLE001 - one failing kernel must not end the table
        row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return row


def _cell(r: dict) -> str:
    status = r.get("status", "")
    if status == "ok":
        return f"{r['ms']:.2f}/{r['tflops']:.0f}"
    return status.split(":")[0].split()[0]  # OOM, skipped, error, WRONG


def print_table(rows: list[dict], backends: list[str], tokens: int, ceiling: float) -> None:
    """One line per (kind, S): each backend's 'ms/TFLOP/s' (or OOM / skipped / error / WRONG), the memory floor,
    and the fastest backend with its share of the ceiling; then the distinct error messages."""
    print(f"GPU: {torch.cuda.get_device_name()}; GDLA shape 80/16 heads, qk 192, v 128; fwd+bwd; B = {tokens}//S")
    print(f"{'kind':<8}{'S':>7}{'B':>4} " + "".join(f"{b:>13}" for b in backends) + f"{'floor ms':>10}  fastest")
    cases: dict = {}
    for r in rows:
        cases.setdefault((r["kind"], r["seq_len"], r["batch"]), {})[r["backend"]] = r
    for (kind, S, B), by in cases.items():
        ok = [r for r in by.values() if r.get("status") == "ok"]
        best = min(ok, key=lambda r: r["ms"]) if ok else None
        floor = f"{best['floor_ms']:.2f}" if best else ""
        fastest = f"{best['backend']} ({100 * best['tflops'] / ceiling:.0f}% of ceiling)" if best else "none"
        cells = "".join(f"{_cell(by[b]) if b in by else '':>13}" for b in backends)
        print(f"{kind:<8}{S:>7}{B:>4} {cells}{floor:>10}  {fastest}")
    errors = sorted({r["status"] for r in rows if r.get("status", "ok") != "ok" and r["status"] != "OOM"})
    for e in errors[:6]:
        print(f"  note: {e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", default="4096,16384,65536,131072")
    p.add_argument("--tokens", type=int, default=131072, help="tokens per case: B = max(1, tokens // S)")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--kinds", default="full,sliding")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--case-cap-s", type=float, default=2.0, help="a single call longer than this is timed once")
    p.add_argument("--budget-s", type=float, default=1e9, help="wall-time budget; later cases are skipped")
    p.add_argument("--ceiling-tflops", type=float, default=790.0)
    p.add_argument("--hbm-tbs", type=float, default=4.2)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_attention.json"))
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU", file=sys.stderr)
        return 1
    margs = Motif3ModelArgs()
    seq_lens = [int(s) for s in a.seq_lens.split(",")]
    backends = a.backends.split(",")
    kinds = a.kinds.split(",")
    start = time.monotonic()
    rows, checked, kernels = [], {}, {}
    for name in backends:  # backend-major: the budget ends the slowest-compiling (flex) backends, not fa4's rows
        for S in seq_lens:
            for kind in kinds:
                window = None if kind == "full" else margs.sliding_window
                rows.append(run_case(name, S, kind, window, margs, a, kernels, checked, start))
                torch.cuda.empty_cache()
    print_table(rows, backends, a.tokens, a.ceiling_tflops)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
