#!/usr/bin/env python3
"""GPU benchmark of mHC at the motif3_proxy width (H = 4096, n = 4, 20 Sinkhorn steps): the implementation
before the fused rewrite (`legacy`, kept here only as the yardstick) against `llm_training.layers.mhc.hyper_connections`
(`fused`), and the fp32-output projections (router gate) before/after.

One case = one block's mHC work around two trivial sub-layers (y = u * w): attention-side coefficients,
collapse, update, then the FFN side, exactly as `TransformerBlock.forward` wires it. Per case: forward ms,
forward+backward ms (CUDA events, median), the bytes kept for backward per token (allocated after the forward,
the output excluded), the fwd+bwd peak above the inputs, and the first-call (compile) seconds when compiled.
Router rows: `Fp32Projection` fwd+bwd at [T, 4096] -> E, fp32 `F.linear` on an fp32 copy (legacy) vs the
split-bf16 tensor-core GEMM. Prints a table and writes JSON.

    python bench/bench_mhc.py [--tokens 16384,65536] [--compile-tokens 16384] [--iters 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import torch
import torch.nn.functional as F
from cuda_timing import cuda_time_ms
from torch.utils.checkpoint import checkpoint

from llm_training.layers.mhc.hyper_connections import MHC, StreamSource
from llm_training.layers.mhc.sinkhorn import sinkhorn
from llm_training.layers.projection import Fp32Projection

N_STREAMS, HIDDEN, SEQ = 4, 4096, 4096


# ----------------------------------------------------------------------------- legacy (before the rewrite)
class _LegacyCollapse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h):
        ctx.save_for_backward(x, h)
        return torch.einsum("bsn,bsnh->bsh", h.float(), x.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, h = ctx.saved_tensors
        g = g.float()
        return (h.unsqueeze(-1) * g.unsqueeze(-2)).to(x.dtype), torch.einsum("bsh,bsnh->bsn", g, x.float())


class _LegacyMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h_res, h_post, y):
        ctx.save_for_backward(x, h_res, h_post, y)
        mixed = torch.einsum("bsij,bsjh->bsih", h_res, x.float())
        return (mixed + h_post.unsqueeze(-1) * y.float().unsqueeze(-2)).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, h_res, h_post, y = ctx.saved_tensors
        g = g.float()
        dx = torch.einsum("bsij,bsih->bsjh", h_res, g).to(x.dtype)
        dh_res = torch.einsum("bsih,bsjh->bsij", g, x.float())
        dh_post = torch.einsum("bsih,bsh->bsi", g, y.float())
        dy = torch.einsum("bsi,bsih->bsh", h_post, g).to(y.dtype)
        return dx, dh_res, dh_post, dy


def _legacy_coefficients(m: MHC, x):
    def coeffs(x):
        flat = m.norm(x.flatten(-2).float())
        p = F.linear(flat, m.proj_pre.weight.float())
        q = F.linear(flat, m.proj_post.weight.float())
        r = F.linear(flat, m.proj_res.weight.float()).unflatten(-1, (m.n, m.n))
        h_pre = torch.sigmoid((m.alpha_pre * p + m.bias_pre).clamp(-10, 10))
        h_post = (1.0 + m.h_post_alpha) * torch.sigmoid((m.alpha_post * q + m.bias_post).clamp(-10, 10))
        return h_pre, h_post, sinkhorn(m.alpha_res * r + m.bias_res, m.sinkhorn_iters)

    return checkpoint(coeffs, x, use_reentrant=False)


def legacy_pair(mhc_a, mhc_f, x, w):
    h_pre, h_post, h_res = _legacy_coefficients(mhc_a, x)
    x = _LegacyMix.apply(x, h_res, h_post, _LegacyCollapse.apply(x, h_pre) * w)
    h_pre, h_post, h_res = _legacy_coefficients(mhc_f, x)
    return _LegacyMix.apply(x, h_res, h_post, _LegacyCollapse.apply(x, h_pre) * w)


def fused_pair(mhc_a, mhc_f, x, w):
    h_pre, h_post, h_res = mhc_a.coefficients(x)
    mid = StreamSource(x, h_res, h_post, MHC.collapse(x, h_pre) * w)
    x = MHC.update(*mid)
    h_pre, h_post, h_res = mhc_f.coefficients(x, mid)
    return MHC.update(x, h_res, h_post, MHC.collapse(x, h_pre, mid) * w, mid)


# ----------------------------------------------------------------------------- measurement
def _mib(b):
    return b / 2**20


def measure_mhc(variant: str, compiled: bool, tokens: int, iters: int) -> dict:
    torch.manual_seed(0)
    mods = []
    for _ in range(2):
        m = MHC(HIDDEN, N_STREAMS, sinkhorn_iters=20, eps=1e-6, identity_init=False, h_post_alpha=0.0)
        m.init_weights()
        mods.append(m.cuda())  # parameters fp32, as parallelize.py keeps the mHC parameters
    B = tokens // SEQ
    x = torch.randn(B, SEQ, N_STREAMS, HIDDEN, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = torch.rand(HIDDEN, device="cuda", dtype=torch.bfloat16).requires_grad_()
    g = torch.randn_like(x)
    fn = {"legacy": legacy_pair, "fused": fused_pair}[variant]
    if compiled:
        fn = torch.compile(fn, dynamic=False)
    t0 = time.perf_counter()
    fn(mods[0], mods[1], x, w).backward(g)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0

    def fwd():
        with torch.no_grad():
            fn(mods[0], mods[1], x, w)

    def fwd_bwd():
        x.grad = None
        fn(mods[0], mods[1], x, w).backward(g)

    fwd_ms = statistics.median(cuda_time_ms(fwd, warmup=1, repeats=iters))
    step_ms = statistics.median(cuda_time_ms(fwd_bwd, warmup=1, repeats=iters))
    x.grad = None
    for m in mods:
        m.zero_grad(set_to_none=True)
    w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = fn(mods[0], mods[1], x, w)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
    del out
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(mods[0], mods[1], x, w).backward(g)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {
        "case": "mhc",
        "variant": variant,
        "compiled": compiled,
        "tokens": tokens,
        "first_call_s": round(first_s, 2),
        "fwd_ms": round(fwd_ms, 3),
        "fwd_bwd_ms": round(step_ms, 3),
        "kept_bytes_per_token": round(kept / tokens, 1),
        "peak_mib": round(_mib(peak), 1),
    }


def measure_router(variant: str, tokens: int, experts: int, iters: int) -> dict:
    torch.manual_seed(0)
    proj = Fp32Projection(HIDDEN, experts).cuda()
    torch.nn.init.normal_(proj.weight, std=0.02)
    x = F.rms_norm(torch.randn(tokens, HIDDEN, device="cuda"), (HIDDEN,)).bfloat16().requires_grad_()
    g = torch.randn(tokens, experts, device="cuda")
    call = {"legacy": lambda: F.linear(x.float(), proj.weight.float()), "split_bf16": lambda: proj(x)}[variant]

    def fwd_bwd():
        x.grad = None
        proj.weight.grad = None
        call().backward(g)

    ms = statistics.median(cuda_time_ms(fwd_bwd, warmup=2, repeats=iters))
    with torch.no_grad():
        exact = x.double() @ proj.weight.double().t()
        err = ((call().double() - exact).abs().max() / exact.std()).item()
    return {
        "case": "router",
        "variant": variant,
        "tokens": tokens,
        "experts": experts,
        "fwd_bwd_ms": round(ms, 3),
        "max_err_over_std": err,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16384,65536", help="token counts (multiples of 4096) for the eager rows")
    ap.add_argument("--compile-tokens", default="16384", help="token counts for the compiled rows ('' = none)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--router", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", default="bench/results/bench_mhc.json")
    args = ap.parse_args()
    plan = [(v, False, int(t)) for t in args.tokens.split(",") if t for v in ("legacy", "fused")]
    plan += [(v, True, int(t)) for t in args.compile_tokens.split(",") if t for v in ("fused", "legacy")]
    rows = []
    print(
        f"mHC pair (n={N_STREAMS}, H={HIDDEN}, 20 Sinkhorn steps), bf16 stream, fp32 parameters, {torch.cuda.get_device_name()}"
    )
    print(
        f"{'variant':8} {'mode':8} {'tokens':>7} {'fwd ms':>8} {'fwd+bwd ms':>11} {'kept B/token':>13} {'peak MiB':>9} {'first s':>8}"
    )
    for variant, compiled, tokens in plan:
        try:
            r = measure_mhc(variant, compiled, tokens, args.iters)
        except Exception as e:  # noqa: BLE001  one failed case must not hide the others
            traceback.print_exc()
            print(f"FAIL mhc {variant} compiled={compiled} tokens={tokens}: {type(e).__name__}: {e}")
            continue
        finally:
            torch.cuda.empty_cache()
        rows.append(r)
        mode = "compile" if compiled else "eager"
        print(
            f"{variant:8} {mode:8} {tokens:>7} {r['fwd_ms']:>8.2f} {r['fwd_bwd_ms']:>11.2f} "
            f"{r['kept_bytes_per_token']:>13.0f} {r['peak_mib']:>9.0f} {r['first_call_s']:>8.1f}"
        )
    if args.router:
        print(f"router gate fwd+bwd, [T, {HIDDEN}] bf16 input, fp32 weight")
        for experts in (64, 384):
            for variant in ("legacy", "split_bf16"):
                try:
                    r = measure_router(variant, 16384, experts, args.iters)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    print(f"FAIL router {variant} E={experts}: {type(e).__name__}: {e}")
                    continue
                rows.append(r)
                print(
                    f"  {variant:10} E={experts:<4} T=16384 {r['fwd_bwd_ms']:8.3f} ms  max err/std {r['max_err_over_std']:.2e}"
                )
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
