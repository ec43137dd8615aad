"""How much of a first compile is torch.compile's one-time start, and does compiling a tiny function first take it
off the next compile? (Issue 31's first-step target: the first frame of each system carries inductor's one-time
start, bench/README "Session 29".)

Two fresh processes, each over fresh inductor and Triton caches, each starting inductor's compile workers first (as
the Trainer does, `distributed.compile.start_compile_workers`), then compiling three small functions one after
another (forward and backward of a [N, N] elementwise-and-sum, different ops each, so none reuses another's kernels):
  cold      the three compiles as they come: the first carries the one-time start
  prepaid   a tiny function compiled first (its seconds reported apart), then the same three
The one-time start is the cold first compile less the median of the cold second and third; what a prepaid compile
takes off is the cold first compile less the prepaid one. Only a gain where the prepaid compile can overlap other
start-up work (the model's build), which this benchmark does not measure.

Measured on this repository's CPU machine (2 cores, torch 2.13 CPU inductor, `--size 256`, session 30): cold first
12.0 s, second and third 1.80 and 1.75 s; prepaid compile 10.5 s, then 1.88, 1.80, 1.81 s: the one-time start
(10.2 s there) moves to the prepaid compile. Not yet run on a GPU.

    python bench/bench_compile_start.py                 # CUDA if present, else CPU
    python bench/bench_compile_start.py --size 256      # a smaller tensor
Writes bench/results/bench_compile_start.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
MODES = ("cold", "prepaid")


def run_worker(mode: str, size: int) -> dict:
    """In this (fresh) process: start inductor's workers, compile a tiny function first if `mode` is "prepaid", then
    time three compiles (forward + backward each). Seconds per compile."""
    import torch

    from llm_training.distributed.compile import start_compile_workers

    device = "cuda" if torch.cuda.is_available() else "cpu"

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def compile_and_step(fn, x) -> float:
        t = time.perf_counter()
        torch.compile(fn)(x).sum().backward()
        sync()
        return time.perf_counter() - t

    start_compile_workers()
    x = torch.randn(size, size, device=device, requires_grad=True)
    sync()
    row = {"mode": mode, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "size": size}
    if mode == "prepaid":
        row["prepay_s"] = compile_and_step(lambda t: (t.cos() + 1).sum(-1), x[:8, :8].detach().requires_grad_())
    functions = (
        lambda t: (torch.sigmoid(t) * t).sum(-1),
        lambda t: (torch.tanh(t) * t + 1).sum(-1),
        lambda t: (torch.exp(t) * 3 - t).sum(-1),
    )
    row["compile_s"] = [compile_and_step(fn, x) for fn in functions]
    return row


def run_mode(mode: str, size: int, timeout_s: float) -> dict:
    """`run_worker(mode)` in a fresh process over fresh inductor and Triton caches; its row, or one with `error`."""
    with tempfile.TemporaryDirectory(prefix="bench_compile_start_") as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor", "TRITON_CACHE_DIR": f"{tmp}/triton"}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        cmd = [sys.executable, __file__, "--worker", mode, "--size", str(size)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {"mode": mode, "error": f"timed out after {timeout_s:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"mode": mode, "error": f"exit {proc.returncode}: {last}"}
    return json.loads(lines[-1])


def summary(rows: list[dict]) -> dict:
    """The one-time start (cold first compile less the median of the cold later ones) and what the prepaid compile
    took off the first compile; None where a mode failed."""
    by_mode = {r["mode"]: r for r in rows if "error" not in r}
    cold, prepaid = by_mode.get("cold"), by_mode.get("prepaid")
    one_time = cold["compile_s"][0] - statistics.median(cold["compile_s"][1:]) if cold else None
    saved = cold["compile_s"][0] - prepaid["compile_s"][0] if cold and prepaid else None
    return {"one_time_start_s": one_time, "prepaid_saves_s": saved}


def format_table(rows: list[dict], totals: dict) -> str:
    """One line per mode (FAIL lines give the reason), then the one-time start and what prepaying took off."""
    lines = [f"{'mode':<9}{'prepay s':>9}{'1st s':>8}{'2nd s':>8}{'3rd s':>8}  device"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['mode']:<9}FAIL {r['error']}")
            continue
        prepay = f"{r['prepay_s']:.2f}" if "prepay_s" in r else "-"
        first, second, third = r["compile_s"]
        lines.append(f"{r['mode']:<9}{prepay:>9}{first:>8.2f}{second:>8.2f}{third:>8.2f}  {r['device']}")
    one_time, saved = (_seconds(totals[k]) for k in ("one_time_start_s", "prepaid_saves_s"))
    lines.append(f"one-time start {one_time}; a prepaid compile takes {saved} off the first compile")
    return "\n".join(lines)


def _seconds(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f} s"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1024, help="the functions' input is [size, size] fp32")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per mode before it is a FAIL row")
    p.add_argument("--out", default=str(BENCH_DIR / "results" / "bench_compile_start.json"))
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)  # internal: one mode, in this process
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args.worker, args.size)), flush=True)
        return 0
    rows = [run_mode(mode, args.size, args.timeout) for mode in MODES]
    totals = summary(rows)
    print(format_table(rows, totals))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, **totals}, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
