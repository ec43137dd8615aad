"""Expert-parallel dispatch + combine against a plain all-to-all of the same bytes (the multi-GPU issue's
dispatch bandwidth check: target >= 90% of the plain all-to-all).

Run under torchrun, one process per GPU (NCCL), or on CPU ranks with gloo for a smoke run:

    torchrun --nproc_per_node 2 bench/bench_ep_dispatch.py                     # motif3_proxy: 16K tokens x top-8
    torchrun --nproc_per_node 8 bench/bench_ep_dispatch.py --skew 1.0          # uneven expert load
    torchrun --nproc_per_node 2 bench/bench_ep_dispatch.py --device cpu --tokens 256 --hidden 64 --experts 8 --top-k 2

Every rank routes `--tokens` tokens to `--top-k` distinct experts of `--experts` (uniformly, or with expert e
drawn with weight (e + 1)^-skew), lays the token x top-k rows out sorted by expert, as the MoE hands them to its
experts (bf16 on CUDA, fp32 on CPU, `--hidden` values per row), and times for each dispatcher
(`llm_training.distributed.expert_parallel.DISPATCHERS`: all_to_all, and deepep where it imports on CUDA):

  dispatch   the dispatcher's dispatch: counts exchange, rows all-to-all, regroup by local expert
  combine    the dispatcher's combine: inverse regroup, reverse all-to-all
  plain      the baseline: the same two row all-to-alls (`all_to_all_single` with the same split sizes, known in
             advance): the communication alone, with no counts exchange, host sync or regrouping

Before timing it checks that combine(dispatch(x)) gives x back bitwise and that every rank receives, per local
expert, exactly the rows all ranks routed to it. Each rank times its own calls (CUDA events on GPU, wall clock on
CPU; medians of `--repeats` after `--warmup`); the table takes the slowest rank's median. Columns: ms of dispatch,
combine and plain (dispatch + combine's two all-to-alls), the bytes each rank sends to other ranks per direction
(its rows for other ranks' experts), GB/s = 2 x those bytes / (dispatch + combine), and efficiency = plain /
(dispatch + combine). Rank 0 prints the table and writes `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from cuda_timing import slowest_over_ranks

from llm_training.distributed.expert_parallel import DISPATCHERS, check_dispatcher_available, exchange_counts
from llm_training.distributed.utils import destroy_process_group


def route_rows(tokens: int, experts: int, top_k: int, skew: float, seed: int) -> torch.Tensor:
    """Expert of every row [tokens * top_k], sorted ascending (the MoE's expert-sorted layout): each token picks
    `top_k` distinct experts, expert e with weight (e + 1)^-skew (Gumbel top-k; skew 0 = uniform)."""
    gen = torch.Generator().manual_seed(seed)
    log_w = -skew * torch.log(torch.arange(1, experts + 1, dtype=torch.float64))
    gumbel = -torch.log(-torch.log(torch.rand(tokens, experts, generator=gen, dtype=torch.float64)))
    picks = (log_w + gumbel).topk(top_k, dim=-1).indices
    return picks.reshape(-1).sort().values


def check_round_trip(dispatcher, x_NH: torch.Tensor, counts_E: torch.Tensor, group) -> None:
    """combine(dispatch(x)) == x bitwise, and the received per-expert counts are the global counts of this rank's
    experts (AssertionError naming what differs)."""
    x_local, counts_L, route = dispatcher.dispatch(x_NH, counts_E)
    back = dispatcher.combine(x_local, route)
    if not torch.equal(back, x_NH):
        raise AssertionError(f"combine(dispatch(x)) != x: max |diff| {(back.float() - x_NH.float()).abs().max()}")
    global_E = counts_E.clone()
    dist.all_reduce(global_E, group=group)
    L, rank = counts_L.numel(), dist.get_rank(group)
    want = global_E[rank * L : (rank + 1) * L].to(counts_L.device, counts_L.dtype)
    if not torch.equal(counts_L, want) or x_local.shape[0] != int(want.sum()):
        raise AssertionError(
            f"rank {rank} received {counts_L.tolist()} rows per local expert, expected {want.tolist()}"
        )


def _waited(t: torch.Tensor) -> torch.Tensor:
    """`t` once its collective has finished: a functional collective's result (AsyncCollectiveTensor) is waited for
    only when used, and a timed call must include the communication it started."""
    return t.wait() if hasattr(t, "wait") else t


def median_ms(fn, device: torch.device, warmup: int, repeats: int, group) -> float:
    """Median milliseconds of `fn()` on this rank; every call starts after a barrier of the group."""
    times = []
    for i in range(warmup + repeats):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def bench_dispatcher(name: str, x_NH, counts_E, device, a, group) -> dict:
    dispatcher = DISPATCHERS[name](group)
    check_round_trip(dispatcher, x_NH, counts_E, group)
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    # the plain baseline: the same two row all-to-alls with split sizes known in advance
    recv_PL = exchange_counts(counts_E, group)
    send = counts_E.long().view(P, -1).sum(1).tolist()
    recv = recv_PL.sum(1).tolist()
    recv_buf = x_NH.new_empty(sum(recv), x_NH.shape[1])
    back_buf = torch.empty_like(x_NH)

    def plain():
        dist.all_to_all_single(recv_buf, x_NH, recv, send, group=group)
        dist.all_to_all_single(back_buf, recv_buf, send, recv, group=group)

    state = {}

    def dispatch():
        x_local, counts_L, route = dispatcher.dispatch(x_NH, counts_E)
        state["out"] = (_waited(x_local), counts_L, route)

    def combine():
        x_local, _, route = state["out"]
        _waited(dispatcher.combine(x_local, route))

    dispatch()  # combine's first timed call needs a route
    kw = {"device": device, "warmup": a.warmup, "repeats": a.repeats, "group": group}
    t_dispatch = slowest_over_ranks(median_ms(dispatch, **kw), device, group)
    t_combine = slowest_over_ranks(median_ms(combine, **kw), device, group)
    t_plain = slowest_over_ranks(median_ms(plain, **kw), device, group)
    off_rank_bytes = (sum(send) - send[rank]) * x_NH.shape[1] * x_NH.element_size()
    off_rank_bytes = slowest_over_ranks(off_rank_bytes, device, group)  # the most loaded sender
    return {
        "dispatcher": name,
        "dispatch_ms": t_dispatch,
        "combine_ms": t_combine,
        "plain_ms": t_plain,
        "off_rank_mib_per_direction": off_rank_bytes / 2**20,
        "gb_per_s": 2 * off_rank_bytes / ((t_dispatch + t_combine) * 1e-3) / 1e9,
        "plain_gb_per_s": 2 * off_rank_bytes / (t_plain * 1e-3) / 1e9,
        "efficiency": t_plain / (t_dispatch + t_combine),
    }


def dispatchers_here(device: torch.device) -> list[str]:
    """all_to_all everywhere; deepep on CUDA where it imports."""
    names = ["all_to_all"]
    if device.type == "cuda":
        try:
            check_dispatcher_available("deepep")  # imports DeepEP (ConfigError when it cannot)
            names.append("deepep")
        except Exception as e:  # noqa: BLE001 - report why, keep the all_to_all row
            print(f"[rank {dist.get_rank()}] deepep skipped: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank (motif3_proxy: 4 x 4096)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--skew", type=float, default=0.0, help="expert e drawn with weight (e + 1)^-skew (0: uniform)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_ep_dispatch.json"))
    a = p.parse_args(argv)
    if "RANK" not in os.environ:
        p.error("run under torchrun (one process per GPU), e.g. torchrun --nproc_per_node 2 bench/bench_ep_dispatch.py")
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    created = not dist.is_initialized()  # a caller's group (the tests) is used as it is
    if created:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        group, P, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
        if a.experts % P:
            p.error(f"--experts {a.experts} must be a multiple of the number of ranks ({P})")
        expert_of_row = route_rows(a.tokens, a.experts, a.top_k, a.skew, a.seed + rank)
        counts_E = torch.bincount(expert_of_row, minlength=a.experts).to(device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        gen = torch.Generator().manual_seed(10_000 + rank)
        x_NH = torch.randn(expert_of_row.numel(), a.hidden, generator=gen).to(device, dtype)
        rows = [bench_dispatcher(name, x_NH, counts_E, device, a, group) for name in dispatchers_here(device)]
        if rank == 0:
            report = {"ranks": P, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      "backend": dist.get_backend(), **{k: v for k, v in vars(a).items() if k != "out"}, "rows": rows}  # fmt: skip
            print(f"EP dispatch over {P} ranks ({report['device']}, {report['backend']}): {a.tokens} tokens x top-"
                  f"{a.top_k} of {a.experts} experts per rank, hidden {a.hidden}, {dtype}, skew {a.skew}")  # fmt: skip
            print(f"{'dispatcher':<12}{'dispatch ms':>12}{'combine ms':>12}{'plain ms':>10}{'MiB/dir':>10}"
                  f"{'GB/s':>9}{'plain GB/s':>12}{'efficiency':>12}")  # fmt: skip
            for r in rows:
                print(f"{r['dispatcher']:<12}{r['dispatch_ms']:>12.3f}{r['combine_ms']:>12.3f}{r['plain_ms']:>10.3f}"
                      f"{r['off_rank_mib_per_direction']:>10.1f}{r['gb_per_s']:>9.1f}{r['plain_gb_per_s']:>12.1f}"
                      f"{r['efficiency']:>11.1%}")  # fmt: skip
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(report, indent=1))
            print(f"wrote {a.out}")
    finally:
        if created:
            destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
