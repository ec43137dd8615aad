"""Low-precision benchmark (GPU): what the `[quantize]` recipes buy over bf16, in three parts.

  layers  per-layer forward+backward time, bf16 vs each recipe this GPU runs, at motif3_proxy shapes: the GDLA
          attention projections, the dense MLP, the routed experts' two grouped GEMMs (64 experts, top-8 rows);
          also each layer's output relative error vs bf16. Every layer runs under torch.compile, as in training:
          eager, the scale / cast / transpose kernels around each FP8 GEMM are separate launches and made the
          FP8 projections 0.12-0.4x bf16 on the H200
  step    a motif3_proxy training step (the real Trainer, 1-rank FSDP2 bf16) under recipe none vs fp8_rowwise
  curve   motif3_small trained on the demo data from the same init and batches under bf16 ('none'), a second bf16
          run per other seed ('none@8', 'none@9': the run-to-run noise) and each FP8 recipe; prints the curves, each FP8
          curve's gap to bf16 and whether it stays within the bf16 run-to-run gap

    python bench/bench_quantization.py layers step curve          # all three (H200: layers alone > 5 min, below)
    python bench/bench_quantization.py layers --tiny               # a smoke run at tiny sizes
    python bench/bench_quantization.py layers --layers mlp,experts --recipes fp8_rowwise   # some layers, one recipe
    python bench/bench_quantization.py curve --curve-steps 200 --curve-parallel 3   # three curves at a time
Writes bench/results/bench_quantization.json (or --out) after every part, so a run cut short keeps its parts.
Time on the H200 (torch 2.11): `layers` compiles every layer once per recipe, ~65 s per layer with fp8_rowwise and
fp8_blockwise (5 attention layers took 330 s), so run it alone in a 10-minute command. `curve`: one eager
motif3_small run of 300 steps took 265 s alone, so the curves run as concurrent processes (`--curve-parallel N`), or
one at a time against a saved bf16 curve:

    python bench/bench_quantization.py curve --curve-steps 300 --curve-recipes none,fp8_rowwise \
        --curve-baseline bench/results/bench_quantization_curve_session6_bf16_only.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from cuda_timing import cuda_time_ms
from torch import nn

from llm_training.config import ConfigManager
from llm_training.config.job_config import PACKAGE_DIR
from llm_training.distributed import ParallelDims
from llm_training.distributed.utils import setup_distributed
from llm_training.layers.moe import GroupedExperts
from llm_training.motif import get_flavor
from llm_training.quantization.emulation import relative_error
from llm_training.quantization.kernels import RecipeKernels
from llm_training.quantization.modules import to_low_precision
from llm_training.quantization.recipes import LOW_PRECISION, cuda_capability, recipe_problem

DEBUG_TOML = str(PACKAGE_DIR / "motif" / "train_configs" / "debug_cpu.toml")
# the loss curves differ in the recipe only; the saved bf16 curve (bench/results, session 6) ran this mHC backward
CURVE_MHC_BACKWARD = "tensor_ops"


def runnable_recipes() -> list[str]:
    return [r for r in LOW_PRECISION if recipe_problem(r, cuda_capability()) is None]


# ------------------------------------------------------------------------------------------------------- layers
class GroupedGemm(nn.Module):
    """One grouped GEMM x_e w_e^T (the experts' gate_up GEMM alone): torch._grouped_mm, or `kernels.grouped_mm`
    once `kernels` is set."""

    def __init__(self, w_EOK: torch.Tensor):
        super().__init__()
        self.weight, self.kernels = nn.Parameter(w_EOK), None

    def forward(self, x_NK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        if self.kernels is None:
            return torch._grouped_mm(x_NK, self.weight.transpose(-2, -1), offs=offs_E)
        return self.kernels.grouped_mm(x_NK, self.weight, offs_E)


def layer_cases(tiny: bool):
    """(name, GEMM dims, builder -> (module, inputs, upstream grad)) for the convertible modules of layer 0
    (attention projections, dense MLP) and of the first MoE layer (experts) of motif3_proxy (tiny: motif3_small,
    fewer tokens)."""
    from llm_training.motif.model import Motif3Model
    from llm_training.quantization.converter import convertible_modules, gemm_dims

    flavor = "motif3_small" if tiny else "motif3_proxy"
    args = get_flavor(flavor)
    tokens = 1024 if tiny else 8192  # B x S of one micro-batch (2 x 4096)
    with torch.device("meta"):
        model = Motif3Model(args)
    found = convertible_modules(model)
    first_moe = next(n for n, _, kind in found if kind == "routed_experts").rsplit(".", 1)[0]
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    cases = []
    for name, meta_module, kind in found:
        if kind in ("attention", "dense_mlp") and name.startswith("layers.0."):
            i, o = meta_module.in_features, meta_module.out_features

            def build(i=i, o=o):
                m = nn.Linear(i, o, bias=False, **bf16)
                return m, (torch.randn(tokens, i, **bf16),), torch.randn(tokens, o, **bf16)

            cases.append((name, (i, o), build))
    rows = tokens * args.experts_top_k
    E, H, I = args.num_experts, args.hidden_size, args.moe_intermediate_size

    def routed():
        counts = torch.bincount(torch.randint(0, E, (rows,), device="cuda"), minlength=E)
        return torch.randn(rows, H, **bf16), counts

    def build_experts():
        m = GroupedExperts(args).to(**bf16)
        with torch.no_grad():
            m.init_weights(0.02)
        return m, routed(), torch.randn(rows, H, **bf16)

    def build_gemm():
        x, counts = routed()
        offs = torch.cumsum(torch.div(counts + 127, 128, rounding_mode="floor") * 128, 0).to(torch.int32)
        x = torch.randn(int(offs[-1]), H, **bf16)  # groups 128-aligned: every recipe's alignment
        return GroupedGemm(torch.randn(E, 2 * I, H, **bf16) * 0.02), (x, offs), torch.randn(x.shape[0], 2 * I, **bf16)

    cases.append((f"{first_moe}.experts gate_up GEMM", (H, 2 * I), build_gemm))
    cases.append((f"{first_moe}.experts", gemm_dims(model.get_submodule(first_moe + ".experts")), build_experts))
    return cases


def fwd_bwd_ms(module, inputs, grad, repeats: int) -> tuple[float, torch.Tensor]:
    """Median forward+backward ms of `module` compiled (the warm-up calls compile it), and its output. The modules
    share forward code objects (every nn.Linear's), so dynamo keeps one compiled entry per layer shape and recipe:
    the recompile limit is raised to hold them all, never falling back to eager."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    module = torch.compile(module, dynamic=False)
    x0 = inputs[0].detach().requires_grad_()
    args = (x0, *inputs[1:])

    def step():
        module.zero_grad(set_to_none=True)
        x0.grad = None
        module(*args).backward(grad)

    times = cuda_time_ms(step, warmup=3, repeats=repeats)
    with torch.no_grad():
        out = module(*args)
    return statistics.median(times), out


def selected(name: str, patterns: list[str]) -> bool:
    """Whether layer `name` is one of `--layers` (substrings of the layer names; empty: every layer)."""
    return not patterns or any(p in name for p in patterns)


def bench_layers(tiny: bool, repeats: int, patterns: list[str], recipes: list[str]) -> list[dict]:
    rows = []
    for name, dims, build in layer_cases(tiny):
        if not selected(name, patterns):
            continue
        torch.manual_seed(0)
        module, inputs, grad = build()
        base_ms, base_out = fwd_bwd_ms(module, inputs, grad, repeats)
        row = {"layer": name, "dims": list(dims), "bf16_ms": base_ms}
        for recipe in recipes:
            try:
                torch.manual_seed(0)
                q, _, _ = build()
                q.load_state_dict(module.state_dict())
                kernels = RecipeKernels(recipe, hp_weight_grad=False, cuda=True)
                if isinstance(q, GroupedGemm):
                    q.kernels = kernels
                else:
                    to_low_precision(q, kernels)
                ms, out = fwd_bwd_ms(q, inputs, grad, repeats)
                row[recipe] = {"ms": ms, "speedup": base_ms / ms, "rel_err": relative_error(out, base_out)}
            except Exception as e:  # noqa: BLE001 - one recipe's failure must not hide the others
                row[recipe] = f"FAIL {type(e).__name__}: {str(e)[:160]}"
            torch.cuda.empty_cache()
        rows.append(row)
        print(f"[layers] {name}: bf16 {base_ms:.3f} ms; " + "; ".join(
            f"{r} {v['ms']:.3f} ms {v['speedup']:.2f}x" if isinstance(v, dict) else f"{r} {v}"
            for r, v in row.items() if r in recipes), flush=True)  # fmt: skip
        del module, inputs, grad
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------- train step
def bench_step(recipe: str, tiny: bool, steps: int, warmup: int) -> dict:
    """Median train-step time of the real Trainer (bench_train.build_trainer, full recompute) under `recipe`."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_train import build_trainer, time_steps, train_step_on_random_data

    flavor, seq, batch = ("motif3_debug", 256, 2) if tiny else ("motif3_proxy", 4096, 2)
    trainer = build_trainer(flavor, seq, batch, ac="full", dump="/tmp/bench_quant", steps=steps + warmup,
                            quantize=recipe)  # fmt: skip
    converted = len(trainer.converters[0].converted) if trainer.converters else 0
    gen = torch.Generator().manual_seed(0)
    vocab = get_flavor(flavor).vocab_size
    torch.cuda.reset_peak_memory_stats()

    def step(i: int, trainer=trainer):
        return train_step_on_random_data(trainer, 1, batch, seq, vocab, gen, i)

    timed = time_steps(step, lambda i: i, steps, warmup, torch.device("cuda"))
    del step, trainer  # free the model before the next recipe's
    torch.cuda.empty_cache()
    ms = statistics.median(timed["times_s"]) * 1e3
    return {
        "flavor": flavor, "recipe": recipe, "seq_len": seq, "batch": batch, "converted_modules": converted,
        "step_ms": ms, "tokens_per_s": batch * seq / ms * 1e3, "first_loss": timed["first"].loss,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------- loss curves
def parse_curve_spec(spec: str) -> tuple[str, int]:
    """'recipe' or 'recipe@seed' -> (recipe, seed); the default seed is 7, a second bf16 run 'none@8' gives the
    bf16 run-to-run noise the FP8 curves are judged against."""
    recipe, _, seed = spec.partition("@")
    return recipe, int(seed) if seed else 7


def loss_curve(spec: str, tiny: bool, steps: int) -> dict:
    from llm_training.layers.attention.fa4 import fa4_usable
    from llm_training.trainer import train

    recipe, seed = parse_curve_spec(spec)

    flavor, seq, batch = ("motif3_debug", 256, 4) if tiny else ("motif3_small", 1024, 4)
    cfg = ConfigManager().parse_args([
        "--job.config_file", DEBUG_TOML, "--job.dump_folder=/tmp/bench_quant", f"--job.run_name=curve_{recipe}",
        f"--model.flavor={flavor}", "--training.device=cuda", "--training.mixed_precision_param=bfloat16",
        f"--training.seq_len={seq}", f"--training.local_batch_size={batch}", f"--training.steps={steps}",
        "--checkpoint.enable=false", "--metrics.save_jsonl=false", "--metrics.log_freq=1000",
        f"--lr_scheduler.warmup_steps={max(1, steps // 10)}", f"--quantize.recipe={recipe}", f"--training.seed={seed}",
        f"--kernels.mhc_backward={CURVE_MHC_BACKWARD}",
    ])  # fmt: skip
    dims = ParallelDims(1, -1, 1, 1, 1)
    device, _ = setup_distributed(cfg.training.device, dims)
    t0 = time.perf_counter()
    result = train(cfg, dims, device)
    torch.cuda.empty_cache()
    return {
        "flavor": flavor, "recipe": recipe, "seed": seed, "seq_len": seq, "batch": batch,
        "seconds": time.perf_counter() - t0,
        "mhc_backward": CURVE_MHC_BACKWARD,
        "fa4_usable": fa4_usable(device),  # attention auto ran flash-attn-4 (else flex/SDPA): compare like with like
        "losses": [result.losses[s] for s in sorted(result.losses)],
    }  # fmt: skip


def baseline_curves(path: str, steps: int) -> dict:
    """The curves of an earlier JSON of this script that ran `steps` steps with this script's mHC backward (the
    others cannot be compared: the LR schedule depends on the step count), each marked with the file it came from.
    (Curves saved before the key existed ran tensor_ops, then the default.)"""
    curves = json.loads(Path(path).read_text()).get("curves", {})
    return {
        r: {**c, "from": path}
        for r, c in curves.items()
        if len(c["losses"]) == steps and c.get("mhc_backward", "tensor_ops") == CURVE_MHC_BACKWARD
    }


def curve_summary(base: list[float], quant: list[float]) -> dict:
    """Loss gap statistics over the last quarter of the steps both curves ran (and the step-to-step noise of bf16
    there): a curve stopped early (a time limit's SIGTERM ends the run cleanly) is compared step for step with
    the same steps of the other, never with its later ones."""
    steps = min(len(base), len(quant))
    base, quant = base[:steps], quant[:steps]
    n = steps // 4
    tail_b, tail_q = base[-n:], quant[-n:]
    gap = [q - b for b, q in zip(tail_b, tail_q)]
    noise = statistics.pstdev([b2 - b1 for b1, b2 in itertools.pairwise(tail_b)]) if n > 2 else float("nan")
    return {
        "mean_gap_last_quarter": statistics.fmean(gap),
        "mean_abs_gap_last_quarter": statistics.fmean(abs(g) for g in gap),
        "bf16_step_noise_last_quarter": noise,
        "final_bf16": statistics.fmean(base[-10:]),
        "final_fp8": statistics.fmean(quant[-10:]),
        "compared_steps": steps,
    }


def curves_verdict(curves: dict) -> dict:
    """Each FP8 curve against the bf16 one ('none'): the loss-gap summary, the bf16 run-to-run gaps (each other
    bf16 seed, 'none@8', 'none@9', ..., against 'none' over the same steps) and `within_noise`: the FP8 curve's
    mean |gap| over the last quarter is at most the largest bf16 run-to-run mean |gap| there (with one extra seed
    that is a single noisy sample; each added seed widens the estimate of the noise's spread)."""
    out = {}
    base = curves["none"]["losses"]
    noise = [
        curve_summary(base, c["losses"])["mean_abs_gap_last_quarter"]
        for spec, c in sorted(curves.items())
        if parse_curve_spec(spec)[0] == "none" and spec != "none"
    ]
    for spec, c in curves.items():
        if parse_curve_spec(spec)[0] == "none":
            continue
        summary = curve_summary(base, c["losses"])
        summary["max_abs_gap"] = max(abs(q - b) for b, q in zip(base, c["losses"]))
        summary["finite"] = all(math.isfinite(v) for v in c["losses"])
        if noise:
            summary["bf16_run_to_run_mean_abs_gaps_last_quarter"] = noise
            summary["within_noise"] = summary["finite"] and summary["mean_abs_gap_last_quarter"] <= max(noise)
        out[spec] = summary
    return out


def run_curves_in_parallel(specs: list[str], tiny: bool, steps: int, out: str, at_once: int) -> dict:
    """Each curve in its own process on the same GPU, `at_once` at a time (a motif3_small eager step leaves the
    H200 mostly idle: three runs of 200 steps took 267-316 s together, one alone ~180 s); each writes its own JSON
    beside `out`. Each run holds ~45 GiB on the H200 (2B parameters with fp32 master weights and AdamW state), so
    three fit in its 140 GiB and four did not."""
    import signal
    import subprocess

    procs: dict = {}
    # a time limit's SIGTERM reaches every run, each of which then stops cleanly and saves the steps it ran
    signal.signal(signal.SIGTERM, lambda *_: [proc.terminate() for proc, _ in procs.values()])
    curves = {}
    for start in range(0, len(specs), at_once):
        batch = {}
        for spec in specs[start : start + at_once]:
            path = f"{out}.{spec.replace('@', '_')}.json"
            cmd = [sys.executable, __file__, "curve", "--curve-recipes", spec, "--curve-steps", str(steps)]
            batch[spec] = (subprocess.Popen([*cmd, "--out", path, *(["--tiny"] if tiny else [])]), path)
        procs.update(batch)
        for spec, (proc, path) in batch.items():
            if proc.wait() == 0:
                curves.update(json.loads(Path(path).read_text()).get("curves", {}))
            else:
                print(f"FAIL curve {spec}: exit {proc.returncode}")
    return curves


# ---------------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("parts", nargs="*", help="layers, step, curve (default: all three)")
    p.add_argument("--tiny", action="store_true", help="smoke run at tiny sizes")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--steps", type=int, default=6, help="timed train steps per recipe (step part)")
    p.add_argument("--curve-steps", type=int, default=200)
    p.add_argument(
        "--curve-recipes",
        default="none,none@8,none@9,fp8_rowwise,fp8_blockwise",
        help="comma-separated curves: recipe or recipe@seed (default seed 7; none@8, none@9 give the bf16 run-to-run noise)",
    )
    p.add_argument(
        "--curve-parallel", type=int, default=1, help="run the curves as this many concurrent processes (H200: 3)"
    )
    p.add_argument("--curve-baseline", help="a JSON this script wrote: its curves (e.g. the bf16 one, 'none') are "
                   "reused instead of run again when they ran the same steps and mHC backward (same seed and batches)")  # fmt: skip
    p.add_argument("--layers", default="", help="layers part: comma-separated substrings of the layer names to run "
                   "(e.g. mlp,experts; default: all)")  # fmt: skip
    p.add_argument(
        "--recipes", default="", help="layers part: comma-separated recipes (default: every one this GPU runs)"
    )
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_quantization.json"))
    a = p.parse_args(argv)
    a.parts = a.parts or ["layers", "step", "curve"]
    if set(a.parts) - {"layers", "step", "curve"}:
        p.error(f"unknown parts {sorted(set(a.parts) - {'layers', 'step', 'curve'})}; choose from layers, step, curve")
    if not torch.cuda.is_available():
        print("bench_quantization needs a CUDA GPU", file=sys.stderr)
        return 1
    logging.getLogger("llm_training").setLevel(logging.WARNING)
    report: dict = {"gpu": torch.cuda.get_device_name(), "capability": list(cuda_capability()), "tiny": a.tiny}
    status = 0

    def save():  # after every part (and every curve), so a run cut short keeps what it measured
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=1))

    print(f"GPU: {report['gpu']} (SM{''.join(map(str, cuda_capability()))}); recipes here: {runnable_recipes()}")

    layer_recipes = [r for r in a.recipes.split(",") if r] or runnable_recipes()
    if set(layer_recipes) - set(runnable_recipes()):
        p.error(f"--recipes {sorted(set(layer_recipes) - set(runnable_recipes()))} cannot run on this GPU; it runs "
                f"{runnable_recipes()}")  # fmt: skip
    if "layers" in a.parts:
        try:
            rows = bench_layers(a.tiny, a.repeats, [x for x in a.layers.split(",") if x], layer_recipes)
            report["layers"] = rows
            flavor = "motif3_small, 1024 tokens" if a.tiny else "motif3_proxy, 8192 tokens x top-8"
            print(f"per-layer fwd+bwd ({flavor}); cells: ms, speed-up over bf16, output rel. error vs bf16")
            print(f"{'layer':<34}{'bf16 ms':>9}" + "".join(f"{r:>26}" for r in layer_recipes))
            for row in rows:
                cells = []
                for r in layer_recipes:
                    v = row.get(r)
                    cells.append(
                        f"{v['ms']:7.3f} ms {v['speedup']:4.2f}x e{v['rel_err']:.3f}"
                        if isinstance(v, dict)
                        else str(v)[:25]
                    )
                print(f"{row['layer']:<34}{row['bf16_ms']:>9.3f}" + "".join(f"{c:>26}" for c in cells))
        except Exception:  # noqa: BLE001 - keep the other parts
            print("FAIL layers:\n" + traceback.format_exc()[-1500:])
            status = 1
        save()

    if "step" in a.parts:
        rows = []
        for recipe in ("none", "fp8_rowwise"):
            try:
                rows.append(bench_step(recipe, a.tiny, a.steps, warmup=3))
            except Exception:  # noqa: BLE001 - keep the other parts
                print(f"FAIL step {recipe}:\n" + traceback.format_exc()[-1500:])
                status = 1
        report["step"] = rows
        for r in rows:
            print(
                f"step {r['flavor']} {r['recipe']:<12} {r['step_ms']:8.1f} ms  {r['tokens_per_s']:8.0f} tok/s  "
                f"{r['converted_modules']} modules converted  first loss {r['first_loss']:.3f}  {r['peak_mem_gib']:.1f} GiB"
            )
        if len(rows) == 2:
            report["step_speedup_fp8_rowwise"] = rows[0]["step_ms"] / rows[1]["step_ms"]
            print(f"step speed-up fp8_rowwise over bf16: {report['step_speedup_fp8_rowwise']:.3f}x")
        save()

    if "curve" in a.parts:
        specs = [r.strip() for r in a.curve_recipes.split(",") if r.strip()]
        curves = {}
        if a.curve_baseline:
            curves = baseline_curves(a.curve_baseline, a.curve_steps)
            print(f"curves reused from {a.curve_baseline}: {sorted(curves) or 'none of that length'}")
        todo = [spec for spec in specs if spec not in curves]
        if a.curve_parallel > 1 and len(todo) > 1:
            curves.update(run_curves_in_parallel(todo, a.tiny, a.curve_steps, a.out, a.curve_parallel))
            status |= int(any(spec not in curves for spec in todo))
        else:
            for spec in todo:
                try:
                    curves[spec] = loss_curve(spec, a.tiny, a.curve_steps)
                    print(f"curve {spec}: {curves[spec]['seconds']:.0f} s, final loss {curves[spec]['losses'][-1]:.3f}")
                except Exception:  # noqa: BLE001 - keep the other curves
                    print(f"FAIL curve {spec}:\n" + traceback.format_exc()[-1500:])
                    status = 1
                report["curves"] = curves
                save()
        report["curves"] = curves
        if "none" in curves and len(curves) > 1:
            base = curves["none"]["losses"]
            every = max(1, len(base) // 8)
            print("curve step  " + "".join(f"{s + 1:>7}" for s in range(0, len(base), every)))
            for spec, c in curves.items():
                print(f"{spec:<12}" + "".join(f"{c['losses'][s]:>7.3f}" for s in range(0, len(c["losses"]), every)))
            verdict = curves_verdict(curves)
            report["curve_summary"] = verdict
            for spec, v in verdict.items():
                noise = max(v.get("bf16_run_to_run_mean_abs_gaps_last_quarter") or [float("nan")])
                print(
                    f"{spec} - bf16, last quarter of {v['compared_steps']} steps: mean {v['mean_gap_last_quarter']:+.4f}, "
                    f"mean |gap| {v['mean_abs_gap_last_quarter']:.4f} vs bf16 run-to-run (largest) {noise:.4f}, max |gap| "
                    f"{v['max_abs_gap']:.3f}; final {v['final_bf16']:.3f} vs {v['final_fp8']:.3f}: "
                    f"{'within' if v.get('within_noise') else 'NOT within'} bf16 run-to-run noise"
                )
                if not v["finite"]:
                    print(f"FAIL curve: non-finite {spec} loss")
                    status = 1

    save()
    print(f"wrote {a.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
