"""Benchmark the linear + cross-entropy loss path on one GPU: fwd+bwd ms and peak memory at the LM head's shape
(default T = 16384 tokens, V = 220160, H = 4096, bf16 hidden and weight), for

  * old:     main@f39a373's chunked loss (`OldChunkedCE` below, kept here only for this comparison): per chunk a
             bf16 logits GEMM + fp32 cast, and the weight gradient as a bf16 GEMM, an fp32 cast copy of the
             full [V, H] product and an fp32 `+=`; one pass (and one fp32 [V, H] buffer) per loss head;
  * new:     `llm_training.trainer.losses` (fp32 logits out of the GEMM, the weight gradient accumulated in fp32
             inside the GEMM; main + MTP heads in one pass); new_chunkMx: the same with M times the default chunk
             (`--chunk-multiples`, default 2,4: fewer [V, H] weight-gradient passes for more logits memory);
  * liger:   liger-kernel's `LigerFusedLinearCrossEntropyLoss(reduction="sum")` as main used it (accum_dtype
             None: the [V, H] weight gradient accumulated in bf16 across its chunks), and with
             accum_dtype=float32 (fp32 accumulation via addmm out_dtype), when liger is importable.

Two cases: one head (T tokens), and main + one MTP head (2 x T tokens; old and liger run two passes, new one).
Checks first that every variant's loss matches new's (relative 1e-3) and reports each variant's weight- and
hidden-gradient relative Frobenius difference from new's. Times with CUDA events after warm-up (median).

Usage (H200):  python bench/bench_loss.py [--tokens 16384] [--vocab 220160] [--hidden 4096] [--repeats 5]
               [--chunk-multiples 2,4] [--out bench_loss.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from cuda_timing import cuda_time_ms

from llm_training.trainer.losses import (
    IGNORE_INDEX,
    _fp32_out_gemms,
    default_chunk_tokens,
    linear_cross_entropy_segments,
)


class OldChunkedCE(torch.autograd.Function):
    """main@f39a373's `_ChunkedLinearCrossEntropy` (eager chunk arithmetic): sum of CE over labelled tokens."""

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, labels_T, chunk_tokens):
        mm_dtype = hidden_TH.dtype
        w_VH = weight_VH.to(mm_dtype)
        T = hidden_TH.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=hidden_TH.device)
        grad_hidden_TH = torch.empty_like(hidden_TH)
        grad_weight_VH = torch.zeros_like(weight_VH, dtype=torch.float32)
        for start in range(0, T, chunk_tokens):
            h_CH = hidden_TH[start : start + chunk_tokens]
            y_C = labels_T[start : start + chunk_tokens]
            valid_C = y_C != IGNORE_INDEX
            logits_CV = (h_CH @ w_VH.t()).float()
            lse_C = torch.logsumexp(logits_CV, dim=-1)
            safe_y_C = torch.where(valid_C, y_C, torch.zeros_like(y_C))
            loss += ((lse_C - logits_CV.gather(1, safe_y_C[:, None]).squeeze(1)) * valid_C).sum()
            grad_CV = (logits_CV - lse_C[:, None]).exp_()
            grad_CV.scatter_add_(1, safe_y_C[:, None], -torch.ones_like(lse_C[:, None]))
            g_CV = grad_CV.mul_(valid_C[:, None].float()).to(mm_dtype)
            del grad_CV, logits_CV
            grad_hidden_TH[start : start + chunk_tokens] = g_CV @ w_VH
            grad_weight_VH += (g_CV.t() @ h_CH).float()
        ctx.save_for_backward(grad_hidden_TH, grad_weight_VH)
        ctx.weight_dtype = weight_VH.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden_TH, grad_weight_VH = ctx.saved_tensors
        return (
            grad_hidden_TH * grad_loss.to(grad_hidden_TH.dtype),
            (grad_weight_VH * grad_loss).to(ctx.weight_dtype),
            None,
            None,
        )


def _liger(accum_dtype):
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as exc:  # ImportError, or triton missing/broken
        print(f"liger-kernel not importable ({type(exc).__name__}: {exc}); skipping the liger rows")
        return None
    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum", accum_dtype=accum_dtype)


def variants(chunk: int, chunk_multiples: list[int]) -> dict:
    """name -> fn(hiddens, weight, labels, weights) returning the weighted total loss (differentiable)."""

    def old(hs, w, ys, ws):
        return sum(wt * OldChunkedCE.apply(h, w, y, chunk) for h, y, wt in zip(hs, ys, ws))

    def new(hs, w, ys, ws):
        return linear_cross_entropy_segments(hs, w, ys, ws, chunk_tokens=chunk)[0]

    out = {"new": new}  # new first: the others are compared against it
    for m in chunk_multiples:  # fewer [V, H] weight-gradient accumulations for m - 1 more GiB of fp32 logits
        out[f"new_chunk{m}x"] = lambda hs, w, ys, ws, m=m: linear_cross_entropy_segments(
            hs, w, ys, ws, chunk_tokens=m * chunk
        )[0]
    out["old"] = old
    for name, accum in (("liger_bf16_accum", None), ("liger_fp32_accum", torch.float32)):
        fn = _liger(accum)
        if fn is not None:
            out[name] = lambda hs, w, ys, ws, fn=fn: sum(wt * fn(w, h, y).float() for h, y, wt in zip(hs, ys, ws))
    return out


def run_case(heads: int, T: int, V: int, H: int, repeats: int, chunk_multiples: list[int]) -> list[dict]:
    gen = torch.Generator("cuda").manual_seed(0)
    weight = (torch.randn(V, H, device="cuda", generator=gen) * 0.02).to(torch.bfloat16).requires_grad_()
    hiddens = [
        torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(heads)
    ]
    labels = [torch.randint(0, V, (T,), device="cuda", generator=gen) for _ in range(heads)]
    for y in labels:
        y[::7] = IGNORE_INDEX
    weights = [1.0 / T] + [0.3 / max(heads - 1, 1) / T] * (heads - 1)  # main + mtp_loss_weight 0.3
    chunk = default_chunk_tokens(V)
    rows, ref = [], None
    for name, fn in variants(chunk, chunk_multiples).items():

        def step():
            weight.grad = None
            for h in hiddens:
                h.grad = None
            loss = fn(hiddens, weight, labels, weights)
            loss.backward()
            return loss

        try:
            loss = step()
            grads = (weight.grad.float(), torch.cat([h.grad for h in hiddens]).float())
            if name == "new":
                ref = (loss.detach(), *grads)
            row = {"variant": name, "heads": heads, "tokens_per_head": T, "loss": loss.item()}
            if ref is not None:
                row["loss_rel_diff_vs_new"] = float((loss.detach() - ref[0]).abs() / ref[0].abs())
                row["w_grad_rel_diff_vs_new"] = float((grads[0] - ref[1]).norm() / ref[1].norm())
                row["h_grad_rel_diff_vs_new"] = float((grads[1] - ref[2]).norm() / ref[2].norm())
            del grads
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            row["ms"] = statistics.median(cuda_time_ms(step, 1, repeats))
            row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        except Exception as exc:  # one variant failing must not hide the others
            row = {"variant": name, "heads": heads, "FAIL": f"{type(exc).__name__}: {exc}"[:300]}
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=220160)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-multiples", default="2,4", help="comma-separated multiples of the default chunk")
    parser.add_argument("--out", default="bench_loss.json")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_loss.py needs a CUDA GPU")
    fp32_gemms = _fp32_out_gemms(torch.device("cuda"))
    print(f"torch {torch.__version__}; bf16 x bf16 -> fp32 GEMMs (mm / baddbmm out_dtype): {fp32_gemms}")
    gemm_tflop = 3 * 2 * opts.tokens * opts.vocab * opts.hidden / 1e12
    rows = []
    for heads in (1, 2):
        multiples = [int(m) for m in opts.chunk_multiples.split(",") if m]
        rows += run_case(heads, opts.tokens, opts.vocab, opts.hidden, opts.repeats, multiples)
    print(
        f"\nLinear CE fwd+bwd, T={opts.tokens} per head, V={opts.vocab}, H={opts.hidden}, bf16 ({gemm_tflop:.1f} TFLOP of GEMMs per head)"
    )
    print(
        f"{'variant':<18}{'heads':>6}{'ms':>9}{'TFLOP/s':>9}{'peak GiB':>10}{'dW rel':>10}{'dh rel':>10}{'loss rel':>10}"
    )
    for r in rows:
        if "FAIL" in r:
            print(f"FAIL {r['variant']} heads={r['heads']}: {r['FAIL']}")
            continue
        tflops = gemm_tflop * r["heads"] / r["ms"] * 1e3
        print(
            f"{r['variant']:<18}{r['heads']:>6}{r['ms']:>9.1f}{tflops:>9.0f}{r['peak_extra_gib']:>10.2f}"
            f"{r.get('w_grad_rel_diff_vs_new', float('nan')):>10.2e}{r.get('h_grad_rel_diff_vs_new', float('nan')):>10.2e}"
            f"{r.get('loss_rel_diff_vs_new', float('nan')):>10.2e}"
        )
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "fp32_out_gemms": fp32_gemms,
              "tokens": opts.tokens, "vocab": opts.vocab, "hidden": opts.hidden, "rows": rows}  # fmt: skip
    with open(opts.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
