"""Our training step vs torchtitan 0.2.2's DeepSeek-V3 at the matched shape, on one device, in one invocation.

Every case runs in a fresh subprocess (no memory, compile cache or process group leaks from one case into the
next) under a per-case timeout; a case that crashes, runs out of memory or times out becomes a FAIL row.

Systems (bench/README.md has the column definitions and how to install torchtitan):
  ours          the real Trainer step of `motif3_proxy` (Muon + AdamW, MTP on, mHC, GDLA; bench_train.build_trainer)
  ours_nomtp    the same without the MTP module (`motif3_proxy_nomtp`), AdamW everywhere by default: the
                like-for-like peer (`--nomtp-optimizers muon,adamw` runs both)
  torchtitan    torchtitan's DeepSeekV3Model with the same shape (matched_torchtitan_args), built and stepped
                by torchtitan's own TrainSpec functions (parallelize_deepseekv3 incl. its compile, its AdamW
                optimizer container with the MoE load-balancing hook, its LR scheduler and CE loss) and its
                Trainer.train_step code, on one device (AMP bf16, fp32 parameters, as torchtitan runs there)

Groups (same tokens per optimizer step within a group; select with --cases, comma-separated):
  eager     2 x seq_len tokens per step, no compile
  compiled  4 x seq_len tokens per step, torch.compile (ours: [compile] model+loss; torchtitan: model+loss)
  accum     4 micro-batches of 4 x seq_len per optimizer step (64K tokens at seq 4096), compiled
A case name (ours@compiled, torchtitan@accum, ...) selects one case. `--quantize fp8_rowwise,...` adds our two
systems again under each low-precision recipe ([quantize] recipe; e.g. "ours_nomtp+adamw+fp8_rowwise@accum"),
and the ratio table then also gives each one's speed-up over the same case in bf16; `--mhc-backward tensor_ops`
likewise adds them with that [kernels] mhc_backward ("...+mhc_tensor_ops@accum"; the plain rows run the default,
auto: the fused mHC backward kernels on the GPU), with the plain row's ratio to it; `--granularity block` adds
them in the compiled groups with that [compile] granularity ("...+block@accum": whole blocks compiled, against the
default auto, which compiles the attention and feed-forward halves apart without activation checkpointing: first
step, step time, memory); `--kernel-tuning heuristic,benchmark` likewise with each [compile] kernel_tuning
set explicitly ("...+heuristic@accum": one launch configuration per generated kernel, untimed), against the
config's default. `--warm-restart` runs each
compiled case once more over the compile caches of its first run, as a restarted run with [compile] cache_folder
starts: the table adds its first-step time. `--size proxy_16e` is the proxy with 16 experts and 32K tokens per accum
step (fits one 80 GiB H100); `--size tiny` runs every case at the tiny CPU shape (motif3_debug and its matched
DeepSeek-V3) for a smoke test.

    python bench/bench_vs_torchtitan.py                         # all groups at the proxy shape (GPU)
    python bench/bench_vs_torchtitan.py --cases compiled,accum  # a subset
    python bench/bench_vs_torchtitan.py --size tiny --cases eager --steps 2 --warmup 1   # CPU smoke test
Writes bench/results/bench_vs_torchtitan.json (or --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:  # run as a script, bench/ is on sys.path already; imported by a test, not
    sys.path.insert(0, str(BENCH_DIR))

GROUPS = ("eager", "compiled", "accum")
SYSTEMS = ("ours", "ours_nomtp", "torchtitan")


@dataclass(frozen=True)
class Size:
    """A benchmark shape: our flavors (with and without MTP) and the sequence length; torchtitan's model is
    derived from the MTP-less flavor by `matched_torchtitan_args`."""

    flavor: str
    flavor_nomtp: str
    seq_len: int
    device: str  # "cuda", or "auto" (the GPU when one is visible, else the CPU)
    group_batch: dict  # group -> (local batch, micro-batches per optimizer step)


SIZES = {
    "proxy": Size(
        "motif3_proxy", "motif3_proxy_nomtp", 4096, "cuda", {"eager": (2, 1), "compiled": (4, 1), "accum": (4, 4)}
    ),
    # motif3_proxy with 16 experts and half the micro-batch (32K tokens per accum step): fits one 80 GiB H100.
    "proxy_16e": Size(
        "motif3_proxy_16e",
        "motif3_proxy_16e_nomtp",
        4096,
        "cuda",
        {"eager": (2, 1), "compiled": (2, 1), "accum": (2, 4)},
    ),
    "tiny": Size(
        "motif3_debug", "motif3_debug_nomtp", 64, "auto", {"eager": (2, 1), "compiled": (2, 1), "accum": (2, 2)}
    ),
}


@dataclass(frozen=True)
class Case:
    """One measured configuration, run in its own subprocess."""

    system: str  # one of SYSTEMS
    group: str  # one of GROUPS
    size: str  # a key of SIZES
    optimizer: str  # "muon" | "adamw" (torchtitan: always its AdamW)
    steps: int
    warmup: int
    profile_steps: int = 0  # optimizer steps profiled after timing (CUDA): kernel time by group (+1: by caller)
    recipe: str = "none"  # our systems: the [quantize] recipe (torchtitan: always "none", bf16)
    mhc_backward: str = "auto"  # our systems: [kernels] mhc_backward (auto = the default config)
    granularity: str = "auto"  # our systems: [compile] granularity (auto = the default config)
    kernel_tuning: str = ""  # our systems: [compile] kernel_tuning ("" = the config's default)
    memory_snapshot: bool = False  # one more step after timing recorded by the CUDA allocator: what holds its peak
    sample_first_step: bool = False  # sample the first step's Python stacks: its seconds by compile phase and line
    triton_prebuild: bool = True  # our systems: [compile] prebuild_workers as configured (False: 0, none)

    @property
    def name(self) -> str:
        opt = f"+{self.optimizer}" if self.system == "ours_nomtp" else ""
        quant = f"+{self.recipe}" if self.recipe != "none" else ""
        mhc = f"+mhc_{self.mhc_backward}" if self.mhc_backward != "auto" else ""
        granularity = f"+{self.granularity}" if self.granularity != "auto" else ""
        tuning = f"+{self.kernel_tuning}" if self.kernel_tuning else ""
        prebuild = "" if self.triton_prebuild else "+no_prebuild"
        return f"{self.system}{opt}{quant}{mhc}{granularity}{tuning}{prebuild}@{self.group}"

    @property
    def shape(self) -> Size:
        return SIZES[self.size]

    @property
    def batch(self) -> int:
        return self.shape.group_batch[self.group][0]

    @property
    def accum(self) -> int:
        return self.shape.group_batch[self.group][1]

    @property
    def compiled(self) -> bool:
        return self.group != "eager"

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.accum * self.shape.seq_len


def build_cases(
    selection: str,
    size: str,
    steps: int,
    warmup: int,
    nomtp_optimizers: list[str],
    profile_steps: int = 0,
    recipes: tuple[str, ...] = (),
    mhc_backwards: tuple[str, ...] = (),
    granularities: tuple[str, ...] = (),
    without_prebuild: bool = False,
    kernel_tunings: tuple[str, ...] = (),
) -> list[Case]:
    """The cases named by `selection`: comma-separated groups ("eager", "compiled", "accum", "all") and/or case
    names as printed (e.g. "ours@compiled", "ours_nomtp+adamw@accum", "torchtitan@eager"). Order: group, then
    ours, ours_nomtp (per optimizer), each again under every one of `recipes` (low-precision [quantize] recipes)
    and then in bf16 with every other [kernels] mhc_backward of `mhc_backwards`, every other [compile] granularity
    of `granularities` and every [compile] kernel_tuning of `kernel_tunings` (compiled groups), and with
    `without_prebuild` once more without the Triton prebuild (compiled groups), then torchtitan. The accum group
    runs half the timed steps (each is 4x longer)."""
    every = []
    for group in GROUPS:
        n_steps = max(1, steps // 2) if group == "accum" else steps
        variants = [{"recipe": r} for r in ("none", *(r for r in recipes if r != "none"))]
        variants += [{"mhc_backward": m} for m in mhc_backwards if m != "auto"]
        if group != "eager":
            variants += [{"granularity": g} for g in granularities if g != "auto"]
            variants += [{"kernel_tuning": t} for t in kernel_tunings]
            variants += [{"triton_prebuild": False}] if without_prebuild else []
        for common in variants:
            every.append(Case("ours", group, size, "muon", n_steps, warmup, profile_steps, **common))
            every += [
                Case("ours_nomtp", group, size, opt, n_steps, warmup, profile_steps, **common)
                for opt in nomtp_optimizers
            ]
        every.append(Case("torchtitan", group, size, "adamw", n_steps, warmup, profile_steps))
    chosen = []
    for token in [t.strip() for t in selection.split(",") if t.strip()]:
        if token == "all":
            picked = every
        elif token in GROUPS:
            picked = [c for c in every if c.group == token]
        else:
            picked = [c for c in every if c.name == token]
            if not picked:
                names = ", ".join(c.name for c in every)
                raise SystemExit(f"--cases: unknown case or group {token!r}; groups: all, {', '.join(GROUPS)}; "
                                 f"cases: {names}")  # fmt: skip
        chosen += [c for c in picked if c not in chosen]
    return chosen


# ---------------------------------------------------------------------------------------------- FLOP counts
def torchtitan_flops_per_token(titan_flops: float, n_layers: int, n_heads: int, head_dims: int, seq_len: int) -> dict:
    """Training FLOPs per token of torchtitan's DeepSeek-V3 in both conventions (docs/flops.md), from its own count
    `titan_flops` (models/utils.get_moe_model_nparams_and_flops: 6 x active non-embedding params + 6 x n_layers x
    n_heads x (d_qk + d_v) x seq_len, i.e. unmasked attention).

    "torchtitan": that count. "megatron": the work its step really does: the same matmuls and causal attention
    (half the keys); it has no MTP and no sliding window."""
    attention_unmasked = 6.0 * n_layers * n_heads * head_dims * seq_len
    return {"megatron": titan_flops - attention_unmasked / 2, "torchtitan": float(titan_flops)}


def our_flops_per_token(flavor: str, seq_len: int) -> dict[str, float]:
    from llm_training.motif import get_flavor, training_flops_per_token

    args = get_flavor(flavor)
    return {conv: training_flops_per_token(args, seq_len, conv) for conv in ("megatron", "torchtitan")}


# ---------------------------------------------------------------------------------------------- torchtitan side
def matched_torchtitan_args(flavor: str, seq_len: int):
    """torchtitan's DeepSeekV3ModelArgs with our flavor's shape: dim, layers (dense first), MLA heads and ranks,
    head dims, experts (sigmoid top-k, route norm/scale, shared experts), vocabulary. What it does not have:
    GDLA's noise heads / output gate / lambda, sliding windows, mHC, PolyNorm (SwiGLU instead), MTP; its
    attention is causal SDPA over the whole row (no document mask)."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs
    from torchtitan.models.moe import MoEArgs

    from llm_training.motif import get_flavor

    a = get_flavor(flavor)
    return DeepSeekV3ModelArgs(
        vocab_size=a.vocab_size,
        dim=a.hidden_size,
        inter_dim=a.intermediate_size,
        moe_inter_dim=a.moe_intermediate_size,
        n_layers=a.num_hidden_layers,
        n_dense_layers=a.n_dense_first_layers,
        n_heads=a.num_attention_heads,
        norm_eps=a.rms_norm_eps,
        moe_args=MoEArgs(
            num_experts=a.num_experts,
            num_shared_experts=a.num_shared_experts,
            score_func=a.score_func,
            route_norm=a.route_norm,
            route_scale=a.route_scale,
            score_before_experts=a.score_before_experts,
            top_k=a.experts_top_k,
            load_balance_coeff=a.load_balance_coeff,
        ),
        q_lora_rank=a.q_lora_rank,
        kv_lora_rank=a.kv_lora_rank,
        qk_nope_head_dim=a.qk_nope_head_dim,
        qk_rope_head_dim=a.qk_rope_head_dim,
        v_head_dim=a.v_head_dim,
        attn_type="sdpa",
        attn_mask_type="causal",
        max_seq_len=seq_len,
        original_seq_len=a.original_seq_len,
        rope_theta=a.rope_theta,
    )


def torchtitan_job_config(case: Case, lr: float = 2e-3):
    """torchtitan's JobConfig for `case`: its defaults (AdamW fused, bf16 AMP on one device, compile of model and
    loss when compiled), no activation checkpointing, no checkpoints, `case.accum` micro-batches per step."""
    from torchtitan.config import JobConfig

    jc = JobConfig()
    jc.model.name = "deepseek_v3"
    jc.training.seq_len = case.shape.seq_len
    jc.training.local_batch_size = case.batch
    jc.training.global_batch_size = case.batch * case.accum
    jc.training.steps = case.steps + case.warmup
    jc.training.mixed_precision_param = "bfloat16"
    jc.optimizer.lr = lr
    jc.lr_scheduler.warmup_steps = 1
    jc.activation_checkpoint.mode = "none"
    jc.compile.enable = case.compiled
    jc.compile.components = ["model", "loss"]
    jc.checkpoint.enable = False
    jc.metrics.log_freq = 1
    return jc


class _StepLog:
    """Stands in for torchtitan's MetricsProcessor inside Trainer.train_step: logs every step, keeps the loss."""

    def __init__(self):
        self.losses: list[float] = []

    def should_log(self, step: int) -> bool:
        return True

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None) -> None:
        self.losses.append(float(global_avg_loss))


def build_torchtitan_trainer(case: Case, device):
    """torchtitan's single-device training state for `case`, built the way its Trainer.__init__ builds it for
    one rank without pipeline parallelism (meta init -> parallelize_fn -> to_empty -> init_weights ->
    build_optimizers_fn -> build_lr_schedulers_fn; build_loss_fn; maybe_enable_amp), as a namespace that
    torchtitan's own `Trainer.train_step` / `forward_backward_step` run on. Its Trainer itself is not
    constructed: __init__ also builds a tokenizer and an HF dataloader (network), and picks the device from
    torch's available accelerator (cuda), so it cannot run on a CPU."""
    import contextlib
    import functools
    import types

    import torch
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.protocols.train_spec import get_train_spec
    from torchtitan.train import Trainer as TitanTrainer

    _one_rank_process_group(device)  # torchtitan's train_step asks ParallelDims for its (1-rank) meshes
    jc = torchtitan_job_config(case)
    spec = get_train_spec("deepseek_v3")
    model_args = matched_torchtitan_args(case.shape.flavor_nomtp, case.shape.seq_len)
    if device.type == "cpu":
        # torchtitan's router counts tokens per expert with torch.histc on int64 indices, which has no CPU kernel
        # (torch 2.13): on the CPU (the tiny smoke-test shape) every torchtitan layer is dense.
        model_args.n_dense_layers = model_args.n_layers
    model_args.update_from_config(jc)
    parallel_dims = ParallelDims(dp_shard=-1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    nparams, tt_flops = model_args.get_nparams_and_flops(model, jc.training.seq_len)
    model = spec.parallelize_fn(model, parallel_dims, jc)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = spec.build_optimizers_fn([model], jc.optimizer, parallel_dims)
    lr_schedulers = spec.build_lr_schedulers_fn(optimizers, jc.lr_scheduler, jc.training.steps)
    amp = (
        dist_utils.maybe_enable_amp(parallel_dims, jc.training.mixed_precision_param, device.type)
        if device.type == "cuda"
        else contextlib.nullcontext()  # fp32 on the CPU, as our side runs there
    )
    ns = types.SimpleNamespace(
        job_config=jc, parallel_dims=parallel_dims, device=device, model_parts=[model], model_args=model_args,
        optimizers=optimizers, lr_schedulers=lr_schedulers, loss_fn=spec.build_loss_fn(jc, parallel_dims=parallel_dims),
        gradient_accumulation_steps=case.accum, train_context=dist_utils.get_train_context(False),
        maybe_enable_amp=amp, tokenizer=None, step=0, ntokens_seen=0, metrics_processor=_StepLog(),
        checkpointer=types.SimpleNamespace(maybe_wait_for_staging=lambda: None),
    )  # fmt: skip
    for method in ("post_dataloading_process", "forward_backward_step", "train_step"):
        setattr(ns, method, functools.partial(getattr(TitanTrainer, method), ns))
    head_dims = model_args.qk_nope_head_dim + model_args.qk_rope_head_dim + model_args.v_head_dim
    flops = torchtitan_flops_per_token(
        tt_flops, model_args.n_layers, model_args.n_heads, head_dims, jc.training.seq_len
    )
    return ns, flops, nparams


def _one_rank_process_group(device) -> None:
    """The 1-rank process group torchtitan's Trainer.init_distributed would create (nccl on a GPU, gloo on the
    CPU). On the CPU, torchtitan's ParallelDims builds its meshes for `torchtitan.tools.utils.device_type`, which
    is "cuda" whenever no accelerator is found; it is pointed at "cpu" here (this subprocess only)."""
    import torch.distributed as dist

    if device.type == "cpu":
        import torchtitan.distributed.parallel_dims as titan_parallel_dims

        titan_parallel_dims.device_type = "cpu"
    if dist.is_initialized():
        return
    if device.type == "cuda":
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


# ---------------------------------------------------------------------------------------------- worker
def run_worker(case: Case) -> dict:
    """Measure `case` in this process; returns its row."""
    import torch
    from bench_train import (
        build_trainer,
        check_first_loss,
        peak_memory_gib,
        random_batch,
        throughput,
        time_steps,
        train_step_on_random_data,
    )
    from jit_timing import jit_time_breakdown
    from stack_sampler import sample_stack

    from llm_training.distributed.compile import compile_stats, reset_compile_stats
    from llm_training.motif import get_flavor
    from llm_training.trainer.metrics import peak_bf16_flops

    if case.shape.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"size {case.size!r} needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    seq = case.shape.seq_len
    reset_compile_stats()
    t_build = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    if case.system == "torchtitan":
        titan, flops, nparams = build_torchtitan_trainer(case, device)
        vocab = titan.model_args.vocab_size

        def step(i: int):
            def micro_batches():
                for _ in range(case.accum):
                    b = random_batch(case.batch, seq, vocab, gen)
                    yield {"input": b["input_ids"]}, b["labels"]

            titan.step = i + 1
            titan.train_step(micro_batches())
            return titan.metrics_processor.losses[-1]

        first_ce = lambda r: r
    else:
        flavor = case.shape.flavor if case.system == "ours" else case.shape.flavor_nomtp
        vocab = get_flavor(flavor).vocab_size
        trainer = build_trainer(flavor, seq, case.batch, "none", case.compiled, tempfile.mkdtemp(prefix="bench_vs_tt_"),
                                case.steps + case.warmup, case.accum, case.optimizer, device.type,
                                quantize=case.recipe, mhc_backward=case.mhc_backward,
                                compile_granularity=case.granularity, kernel_tuning=case.kernel_tuning,
                                prebuild_workers=None if case.triton_prebuild else 0)  # fmt: skip
        nparams = sum(p.numel() for p in trainer.model.parameters())
        flops = our_flops_per_token(flavor, seq)

        def step(i: int):
            return train_step_on_random_data(trainer, case.accum, case.batch, seq, vocab, gen, i)

        first_ce = lambda r: r.ce_loss
    build_s = time.perf_counter() - t_build
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    first_step_samples = {}

    def step_sampled_first(i: int):
        if i > 0 or not case.sample_first_step:
            return step(i)
        with sample_stack() as samples:
            result = step(i)
        first_step_samples.update(samples.summary())
        return result

    pool_ready = compile_pool_ready()
    with jit_time_breakdown() as jit:  # the JIT builds outside torch.compile's phases (all in the first step)
        timed = time_steps(step_sampled_first, lambda i: i, case.steps, case.warmup, device)
    check_first_loss(case.name, first_ce(timed["first"]), vocab)
    peak = peak_bf16_flops(device)
    row = {
        "case": case.name, **dataclasses.asdict(case), "batch": case.batch, "accum": case.accum,
        "seq_len": seq, "tokens_per_step": case.tokens_per_step, "params": nparams, "build_s": build_s,
        "first_step_s": timed["first_step_s"], "first_ce": first_ce(timed["first"]), "ln_vocab": math.log(vocab),
        "step_times_ms": [t * 1e3 for t in timed["times_s"]], "peak_bf16_tflops": peak / 1e12 if peak else None,
        **peak_memory_gib(device), **compile_stats(), "first_step_jit": jit.summary(),
        "later_compiled_frames": timed["later_compiled_frames"], "compile_pool_ready_at_first_step": pool_ready,
        "compile_records": compile_records(),
        **({"first_step_samples": first_step_samples} if first_step_samples else {}),
        **{k: v for k, v in timed.items() if k.endswith("_after_step")},
    }  # fmt: skip
    row.update(throughput(case.tokens_per_step, statistics.median(timed["times_s"]), flops, peak))
    if case.system != "torchtitan" and trainer.triton_prebuild is not None:
        row["triton_prebuild_summary"] = trainer.triton_prebuild.summary()
    if case.system != "torchtitan" and trainer.kernel_prebuild is not None:
        row["fa4_prebuild_summary"] = trainer.kernel_prebuild.summary()
    next_step = case.steps + case.warmup
    if case.memory_snapshot and device.type == "cuda":
        row["memory_peak"] = record_memory_peak(step, next_step, device)
        next_step += 1
    if case.profile_steps and device.type == "cuda":
        row.update(profile_kernel_groups(step, next_step, case.profile_steps))
    return row


# The fields of torch's compilation records (`torch._dynamo.utils.get_compilation_metrics`) that the JSON keeps raw,
# one entry per record: which graph (compile id, direction, first run or compile), and the parts of its compile time
# that `compile_by_frame` does not split out (AOT autograd, inductor, its code generation and module load, i.e. the
# wait for the graph's Triton kernels, compile-time autotuning, garbage collection, each Triton kernel's build).
COMPILE_RECORD_FIELDS = (
    "compile_id", "is_forward", "is_runtime", "co_name", "co_firstlineno", "duration_us", "graph_op_count",
    "graph_node_count", "ir_count", "entire_frame_compile_time_s", "backend_compile_time_s",
    "aot_autograd_cumulative_compile_time_us", "inductor_cumulative_compile_time_us",
    "inductor_code_gen_cumulative_compile_time_us", "compile_time_autotune_time_us", "runtime_triton_autotune_time_us",
    "joint_graph_pass_time_us", "post_grad_pass_time_us", "gc_time_us", "triton_compile_time_us",
    "triton_kernel_compile_times_us",
)  # fmt: skip


def compile_records() -> list[dict]:
    """Every compilation record since the last reset, `COMPILE_RECORD_FIELDS` of each (None where torch left it
    empty), in the order torch kept them: the raw material for splitting one graph's compile further."""
    from torch._dynamo.utils import get_compilation_metrics

    return [{f: getattr(m, f, None) for f in COMPILE_RECORD_FIELDS} for m in get_compilation_metrics()]


def _seconds(record: dict, field: str) -> float:
    """A microsecond field of a compile record in seconds (absent: 0)."""
    return (record[field] or 0) / 1e6


def compile_graph_split(records: list[dict]) -> list[dict]:
    """One row per compile from `compile_records`, slowest first: a frame's forward (with dynamo's tracing; all the
    frame's graphs where it breaks) or one graph's backward. Each row has the frame's name, the compile id, the
    direction, the compile's seconds in all, AOT autograd's own part (the forward's joint trace and partition: backend
    seconds less inductor's), inductor's graph work (post-grad passes, lowering, scheduling: inductor less code
    generation), its code generation and module load (the load waits for the graph's Triton kernels), compile-time
    autotuning, garbage collection, and the Triton kernels built with their seconds: where a compile's time goes
    inside inductor, which `compile_by_frame` (llm_training.distributed.compile) leaves as one figure."""
    names = {r["compile_id"]: r["co_name"] for r in records if r["is_forward"] and r["co_name"]}
    rows = []
    for r in records:
        if r["compile_id"] is None or r["is_runtime"]:
            continue
        inductor = _seconds(r, "inductor_cumulative_compile_time_us")
        code_gen = _seconds(r, "inductor_code_gen_cumulative_compile_time_us")
        forward = bool(r["is_forward"])
        total = (r["entire_frame_compile_time_s"] or 0.0) if forward else _seconds(r, "duration_us")
        aot = max((r["backend_compile_time_s"] or 0.0) - inductor, 0.0) if forward else 0.0
        kernels = json.loads(r["triton_kernel_compile_times_us"] or "[]")  # [[name, us], ...]
        rows.append({
            "graph": f"{names.get(r['compile_id'], '?')} {r['compile_id']} {'forward' if forward else 'backward'}",
            "total_s": round(total, 3), "aot_s": round(aot, 3), "inductor_graph_s": round(inductor - code_gen, 3),
            "codegen_and_load_s": round(code_gen, 3), "kernels": len(kernels),
            "autotune_s": round(_seconds(r, "compile_time_autotune_time_us"), 3),
            "gc_s": round(_seconds(r, "gc_time_us"), 3),
            "kernels_s": round(sum(t for _, t in kernels) / 1e6, 3),
        })  # fmt: skip
    return sorted(rows, key=lambda row: -row["total_s"])


def format_compile_graph_split(rows: list[dict], limit: int = 6) -> str:
    """`compile_graph_split`'s `limit` slowest graphs on one line."""
    return "; ".join(
        f"{g['graph']} {g['total_s']:.1f} s (AOT {g['aot_s']:.1f}, inductor {g['inductor_graph_s']:.1f} + codegen and "
        f"load {g['codegen_and_load_s']:.1f}, autotune {g['autotune_s']:.1f}, gc {g['gc_s']:.1f}; {g['kernels']} "
        f"kernels {g['kernels_s']:.1f} s)"
        for g in rows[:limit]
    )


def compile_pool_ready() -> bool | None:
    """Whether inductor's pool of compile workers was up when the first step started (else inductor builds the
    first graph's kernels one by one in this process until it is); None where no pool was asked for (torchtitan
    starts none before its first compile). Reads the pool's readiness without starting one."""
    try:
        from torch._inductor.async_compile import AsyncCompile
    except ImportError:
        return None
    ready = getattr(AsyncCompile, "_ready_future", None)
    return None if ready is None else ready.done()


def record_memory_peak(step, index: int, device) -> dict:
    """One more optimizer step under the CUDA allocator's history (Python stacks); what held the memory at its
    peak (`trainer.memory_peak.peak_breakdown`: allocated and reserved, by the code that allocated) and what made
    the reserve grow. The step starts from an emptied cache, so that it maps its whole reserve again inside the
    recording: a step from an empty cache reaches the same reserve as the steady state (one H200, session 15:
    bench/results/memory_experiments_session15.txt), and every growth then shows with the request that caused it."""
    import torch

    from llm_training.trainer.memory_peak import format_peak_breakdown, peak_breakdown

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        step(index)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    report = peak_breakdown(snapshot, device.index or 0)
    print(format_peak_breakdown(report), flush=True)
    return report


def profile_kernel_groups(step, first_index: int, steps: int) -> dict:
    """`steps` more optimizer steps under torch.profiler (CPU ops and CUDA kernels), then one more with input shapes
    and Python stacks. Returns, per step: `profile_groups`, the kernel time by cost group (bench/kernel_groups.py:
    optimizer ranges, GEMM kinds, attention, copies/casts, ...); `profile_top_kernels`, the 120 kernels that take
    the most time (names cut at 200 characters: the mangled CUTLASS names run to thousands); `profile_idle`, the
    GPU's idle time and its longest gaps (bench/kernel_callers.py); and, from the stack-recording step (its host
    overhead would inflate the idle time, hence apart), `profile_callers`, the kernel time by launching op, its
    context and our innermost frame. The log prints the kernels and callers over 0.5 ms per step."""
    import torch
    from kernel_callers import format_callers, format_idle, gpu_idle, kernel_callers, python_frames
    from kernel_groups import format_groups, group_kernels, top_kernels
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        for i in range(steps):
            step(first_index + i)
        torch.cuda.synchronize()
    events = prof.events()
    groups = group_kernels(events)
    print(format_groups(groups, steps), flush=True)
    top = [
        {"group": g, "kernel": k[:200], "ms_per_step": ms / steps, "launches_per_step": calls / steps}
        for g, k, ms, calls in top_kernels(events, n=120)
    ]
    for t in (t for t in top if t["ms_per_step"] >= 0.5):
        print(f"{t['ms_per_step']:9.1f} ms {t['launches_per_step']:6.0f}x  {t['group']:<18} {t['kernel'][:140]}")
    idle = gpu_idle(events, steps)
    print(format_idle(idle), flush=True)
    with profile(activities=activities, record_shapes=True, with_stack=True) as prof:
        step(first_index + steps)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:  # the Python frames: only the Chrome trace has them on torch 2.11
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        frames = python_frames(json.loads(trace.read_text()))
    callers = kernel_callers(prof.events(), 1, n=120, frames=frames)
    print(format_callers(callers), flush=True)
    return {
        "profile_groups": [{"group": g, "ms_per_step": ms / steps, "share": share} for g, ms, share in groups],
        "profile_top_kernels": top,
        "profile_idle": idle,
        "profile_callers": callers,
    }


# ---------------------------------------------------------------------------------------------- driver
def run_case_subprocess(
    case: Case, timeout_s: float, log_dir: Path, alloc_conf: str = "", warm_restart: bool = False
) -> dict:
    """Run `case` in a fresh interpreter (its own process group, killed whole on timeout); the row, or a FAIL row
    with the reason (timeout, exit status and the last line of its stderr, e.g. CUDA out of memory).
    `alloc_conf`: PYTORCH_CUDA_ALLOC_CONF of the case (the same for every system). `warm_restart`: a compiled case
    then runs once more (one step) in a new interpreter over the compile caches the first run left, as a restarted
    run with `[compile] cache_folder` does; the row's "warm_restart" gives that run's first-step and compile times."""
    # a fresh inductor / triton / flash-attn-4 cache per case (outside log_dir, which keeps only logs and results):
    # the first-step time is a cold compile, whatever ran before, and a warm restart finds all three (as a run
    # restarted over `[compile] cache_folder` does)
    stem = case.name.replace("@", "_").replace("+", "_")
    cache = Path(tempfile.mkdtemp(prefix=f"bench_vs_torchtitan_cache_{stem}_"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
           "TRITON_CACHE_DIR": str(cache / "triton"), "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(cache / "fa4"),
           "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1"}  # fmt: skip
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    row = _run_worker_process(case, timeout_s, log_dir / f"{stem}.json", env)
    if warm_restart and case.compiled and "error" not in row:
        again = dataclasses.replace(case, steps=1, warmup=0, profile_steps=0, memory_snapshot=False)
        warm = _run_worker_process(again, timeout_s, log_dir / f"{stem}_warm_restart.json", env)
        row["warm_restart"] = {k: warm.get(k) for k in ("first_step_s", "compile_time_s", "error", "case_wall_s")}
    shutil.rmtree(cache, ignore_errors=True)
    return row


def _run_worker_process(case: Case, timeout_s: float, result: Path, env: dict) -> dict:
    """One worker interpreter for `case` (environment `env`) writing `result`: its row, or a FAIL row."""
    log = result.with_suffix(".log")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(dataclasses.asdict(case)),
           "--result", str(result)]  # fmt: skip
    start = time.perf_counter()
    with open(log, "w") as log_f:
        proc = subprocess.Popen(cmd, stdout=log_f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
            reason = None if rc == 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc, reason = None, f"timeout after {timeout_s:.0f} s"
    wall = time.perf_counter() - start
    if reason is None and result.exists():
        row = json.loads(result.read_text())
    else:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] or ["(no output)"]
        row = {"case": case.name, **dataclasses.asdict(case), "error": f"{reason or 'no result'}: {tail[0][-300:]}",
               "log": str(log)}  # fmt: skip
    row["case_wall_s"] = wall
    return row


def _plain(row: dict) -> bool:
    """A row of ours with every varied option at the config's default (the variants' reference)."""
    defaults = {"recipe": "none", "mhc_backward": "auto", "granularity": "auto", "kernel_tuning": "",
                "triton_prebuild": True}  # fmt: skip
    return all(row.get(k, v) == v for k, v in defaults.items())


def ratios(rows: list[dict]) -> list[dict]:
    """Per group: each of our rows against the torchtitan row of the same group (same tokens per step), and each
    low-precision or other-mHC-backward row against the same case with the defaults (`_plain`):
    tokens/s ratio and MFU ratio, each system counted in its own real-work convention ("megatron") and in torchtitan's."""

    def ok(t: dict) -> bool:
        return "error" not in t

    def same_case_with_defaults(r: dict, t: dict) -> bool:
        keys = ("system", "group", "optimizer")
        return _plain(t) and all(t.get(k) == r.get(k) for k in keys)

    out = []
    for r in rows:
        if r["system"] == "torchtitan" or not ok(r):
            continue
        peers = [next((t for t in rows if t["system"] == "torchtitan" and t["group"] == r["group"] and ok(t)), None)]
        if not _plain(r):
            peers.append(next((t for t in rows if ok(t) and same_case_with_defaults(r, t)), None))
        for peer in filter(None, peers):
            out.append({
                "case": r["case"], "vs": peer["case"],
                "tokens_per_s": r["tokens_per_s"] / peer["tokens_per_s"],
                "tflops_megatron": r["tflops_megatron"] / peer["tflops_megatron"],
                "tflops_torchtitan": r["tflops_torchtitan"] / peer["tflops_torchtitan"],
            })  # fmt: skip
    return out


def _pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def _num(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def format_rebuilt(rebuilt: list[dict], limit: int = 6) -> str:
    """`jit_timing`'s `rebuilt` as one line: each kernel with its number of specializations and, per argument whose
    specialization differed, the variants ("_ce_chunk_kernel x2 (weight_ptr: *fp32 D16 | *fp32)")."""
    parts = []
    for r in rebuilt[:limit]:
        differs = "; ".join(f"{arg}: {' | '.join(variants)}" for arg, variants in r["differs"].items())
        parts.append(f"{r['kernel']} x{r['specializations']} ({differs or 'same arguments'})")
    more = len(rebuilt) - limit
    return ", ".join(parts) + (f", and {more} more" if more > 0 else "")


def build_and_first_step(row: dict) -> str:
    """The build's seconds and the time to the end of the first step: work moved from the first step into the build
    (or back) is only a gain where this sum falls."""
    return f"build {row['build_s']:.1f} s; build + first step {row['build_s'] + row['first_step_s']:.1f} s"


def first_step_breakdown(row: dict) -> str:
    """The first step's wall seconds split into torch.compile's forward and backward compiles, the JIT builds
    outside them (bench/jit_timing.py: Triton, flash-attn-4's CuTe DSL, inductor's first-launch autotuning) and the
    rest (the step itself, allocator warm-up, Python), e.g. "83.4 s = compile fwd 28.7 + bwd 17.4 + ..."."""
    ct, jit = row["compile_time_s"], row.get("first_step_jit") or {}
    parts = [("compile fwd", ct.get("total_forward_s", 0.0)), ("bwd", ct.get("total_backward_s", 0.0))]
    labels = (("triton", "triton_compile"), ("cute", "cute_compile"), ("autotune", "inductor_autotune"))
    parts += [(name, jit[f"{label}_s"]) for name, label in labels if f"{label}_s" in jit]
    rest = row["first_step_s"] - sum(v for _, v in parts)
    counts = {name: jit.get(f"{label}_calls") for name, label in labels}
    text = " + ".join(f"{name} {v:.1f}" + (f" ({counts[name]}x)" if counts.get(name) else "") for name, v in parts)
    pool = {True: "up", False: "still starting", None: "not started"}[row.get("compile_pool_ready_at_first_step")]
    return f"{row['first_step_s']:.1f} s = {text} + rest {rest:.1f}; inductor's compile workers at its start: {pool}"


def format_table(rows: list[dict], ratio_rows: list[dict]) -> str:
    """The printed table: one line per case (FAIL lines give the reason), then the ours/torchtitan ratios."""
    from stack_sampler import format_samples

    from llm_training.distributed.compile import format_compile_by_frame
    from llm_training.trainer.memory_peak import format_peak_breakdown

    head = (f"{'case':<36}{'tok/step':>9}{'ms/step':>9}{'tok/s':>9}{'TF/s ours':>10}{'MFU ours':>9}"
            f"{'TF/s tt':>8}{'MFU tt':>8}{'resv GiB':>9}{'1st s':>7}{'graphs':>7}{'recomp':>7}{'case s':>7}")  # fmt: skip
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['case']:<36}FAIL {r['error']}")
            continue
        lines.append(
            f"{r['case']:<36}{r['tokens_per_step']:>9}{r['step_ms_median']:>9.1f}{r['tokens_per_s']:>9.0f}"
            f"{r['tflops_megatron']:>10.1f}{_pct(r['mfu_megatron']):>9}{r['tflops_torchtitan']:>8.1f}"
            f"{_pct(r['mfu_torchtitan']):>8}{_num(r['peak_reserved_gib'], '.1f'):>9}{r['first_step_s']:>7.1f}"
            f"{r['unique_graphs']:>7}{r['recompiles']:>7}{r['case_wall_s']:>7.0f}"
        )
    for r in rows:
        if r.get("later_compiled_frames"):  # a step after the first compiled: its time includes that compile
            lines.append(f"{r['case']:<36}compiled {r['later_compiled_frames']} more frame(s) after the first step")
    for r in rows:
        warm = r.get("warm_restart")
        if warm:
            what = f"FAIL {warm['error']}" if warm.get("error") else f"first step {warm['first_step_s']:.1f} s"
            lines.append(f"{r['case']:<36}restarted over its compile cache: {what} (cold {r['first_step_s']:.1f} s)")
    for r in rows:
        if "error" not in r and r.get("compile_time_s"):
            lines.append(f"{r['case']:<36}first step {first_step_breakdown(r)}")
            lines.append(f"{r['case']:<36}{build_and_first_step(r)}")
            if r.get("compile_by_frame"):
                by_frame = format_compile_by_frame(r["compile_by_frame"])
                lines.append(f"{r['case']:<36}compile by frame, forward + backward: {by_frame}")
            if r.get("compile_records"):
                by_graph = format_compile_graph_split(compile_graph_split(r["compile_records"]))
                lines.append(f"{r['case']:<36}compile by graph: {by_graph}")
            slowest = (r.get("first_step_jit") or {}).get("slowest", [])[:5]
            if slowest:
                builds = ", ".join(f"{e['s']:.1f} s {e['kernel'][:48]}" for e in slowest)
                lines.append(f"{r['case']:<36}slowest JIT builds: {builds}")
            if r.get("triton_prebuild_summary"):
                lines.append(f"{r['case']:<36}Triton prebuild: {r['triton_prebuild_summary']}")
            if r.get("fa4_prebuild_summary"):
                lines.append(f"{r['case']:<36}flash-attn-4 prebuild: {r['fa4_prebuild_summary']}")
            rebuilt = format_rebuilt((r.get("first_step_jit") or {}).get("rebuilt", []))
            if rebuilt:
                lines.append(f"{r['case']:<36}Triton kernels built more than once: {rebuilt}")
            if r.get("first_step_samples"):
                lines += [f"{r['case']:<36}{line}" for line in format_samples(r["first_step_samples"])]
                lines.append(f"{r['case']:<36}first step sampled: its memory figures are not the program's own")
    for r in rows:
        if r.get("peak_reserved_gib_after_step"):
            marks = " ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(r["peak_alloc_gib_after_step"],
                                                                r["peak_reserved_gib_after_step"]))  # fmt: skip
            lines.append(f"{r['case']:<36}peak allocated/reserved GiB after each step: {marks}")
    for r in rows:
        if r.get("memory_peak"):
            lines.append(f"{r['case']:<36}memory over one more step, from an emptied cache:")
            lines += [f"    {line}" for line in format_peak_breakdown(r["memory_peak"]).splitlines()]
    for r in rows:
        streams = r.get("reserved_by_stream")
        if streams:
            parts = ", ".join(f"{q['stream']} {q['reserved_gib']:.1f} ({q['allocated_gib']:.1f})" for q in streams)
            lines.append(f"{r['case']:<36}reserved GiB by stream (allocated at the end): {parts}")
    if ratio_rows:
        lines.append("ours / torchtitan, and low precision / bf16 (same group = same tokens per step):")
        lines.append(f"{'case':<36}{'vs':<30}{'tok/s':>8}{'TF/s ours-conv':>16}{'TF/s tt-conv':>14}")
        for q in ratio_rows:
            lines.append(f"{q['case']:<36}{q['vs']:<30}{q['tokens_per_s']:>8.3f}{q['tflops_megatron']:>16.3f}"
                         f"{q['tflops_torchtitan']:>14.3f}")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="all", help="comma-separated groups (all, eager, compiled, accum) or case names")
    p.add_argument("--size", default="proxy", choices=tuple(SIZES))
    p.add_argument("--steps", type=int, default=6, help="timed steps per case (accum: half)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per case (the first is the compile step)")
    p.add_argument("--timeout", type=float, default=480.0, help="seconds per case before it is killed (FAIL row)")
    p.add_argument("--quantize", default="", help="comma-separated [quantize] recipes (fp8_rowwise, mxfp8, ...): "
                   "our systems again under each, with their speed-up over bf16")  # fmt: skip
    p.add_argument("--mhc-backward", default="", help="comma-separated [kernels] mhc_backward values (tensor_ops, fused): "
                   "our systems again with each, against the default auto (e.g. ours_nomtp+adamw+mhc_tensor_ops@accum)")  # fmt: skip
    p.add_argument("--granularity", default="", help="comma-separated [compile] granularity values (block, sublayer): "
                   "our systems again with each in the compiled groups, against the default auto (e.g. "
                   "ours_nomtp+adamw+block@accum: first-step compile time, step time, memory)")  # fmt: skip
    p.add_argument("--kernel-tuning", default="", help="comma-separated [compile] kernel_tuning values (benchmark, "
                   "heuristic): our systems again with each in the compiled groups, against the config's default (e.g. "
                   "ours_nomtp+adamw+heuristic@accum: first-step time, step time)")  # fmt: skip
    p.add_argument("--without-prebuild", action="store_true", help="our systems again in the compiled groups with "
                   "[compile] prebuild_workers = 0 (e.g. ours_nomtp+adamw+no_prebuild@accum): our Triton kernels built "
                   "in the training process, the first step's baseline")  # fmt: skip
    p.add_argument("--nomtp-optimizers", default="adamw", help="optimizers of the ours_nomtp rows: adamw, muon or both")
    p.add_argument("--profile-steps", type=int, default=0, help="profile this many more steps per case (CUDA): "
                   "kernel time by cost group (bench/kernel_groups.py) and the GPU's idle gaps, then one more step "
                   "for the kernel time by launching op and caller (bench/kernel_callers.py); printed and in the "
                   "JSON")  # fmt: skip
    p.add_argument(
        "--alloc-conf",
        default="expandable_segments:True",
        help="PYTORCH_CUDA_ALLOC_CONF of every case (default: what torchtitan's run_train.sh sets)",
    )
    p.add_argument("--memory-snapshot", action="store_true", help="one more step per case, from an emptied cache, "
                   "under the CUDA allocator's history: allocated / reserved peaks, what was live at the peak and "
                   "what made the reserve grow, by code line")  # fmt: skip
    p.add_argument("--sample-first-step", action="store_true", help="sample each case's first step's Python "
                   "stacks every 10 ms (bench/stack_sampler.py): its seconds by compile phase, and the lines the "
                   "rest ran under; the sampled step's memory peak is not the program's own")  # fmt: skip
    p.add_argument("--warm-restart", action="store_true", help="run each compiled case once more over the compile "
                   "caches of its first run (a restarted run): first-step time with warm caches")  # fmt: skip
    p.add_argument("--out", default=str(BENCH_DIR / "results" / "bench_vs_torchtitan.json"))
    p.add_argument("--log-dir", help="where each case's log and result JSON go as it ends (default: a temp folder)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one case's JSON, run in this process
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        row = run_worker(Case(**json.loads(a.worker)))
        Path(a.result).write_text(json.dumps(row, indent=2))
        return 0
    optimizers = [o.strip() for o in a.nomtp_optimizers.replace("both", "adamw,muon").split(",") if o.strip()]
    recipes = tuple(r.strip() for r in a.quantize.split(",") if r.strip())
    mhc_backwards = tuple(m.strip() for m in a.mhc_backward.split(",") if m.strip())
    granularities = tuple(g.strip() for g in a.granularity.split(",") if g.strip())
    tunings = tuple(t.strip() for t in a.kernel_tuning.split(",") if t.strip())
    cases = build_cases(a.cases, a.size, a.steps, a.warmup, optimizers, a.profile_steps, recipes, mhc_backwards,
                        granularities, a.without_prebuild, tunings)  # fmt: skip
    cases = [
        dataclasses.replace(c, memory_snapshot=a.memory_snapshot, sample_first_step=a.sample_first_step) for c in cases
    ]
    log_dir = Path(a.log_dir) if a.log_dir else Path(tempfile.mkdtemp(prefix="bench_vs_torchtitan_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in cases:
        row = run_case_subprocess(case, a.timeout, log_dir, a.alloc_conf, a.warm_restart)
        status = "FAIL " + row["error"] if "error" in row else f"{row['tokens_per_s']:.0f} tok/s"
        print(f"[{time.strftime('%H:%M:%S')}] {case.name}: {row['case_wall_s']:.0f} s, {status}", flush=True)
        rows.append(row)
    ratio_rows = ratios(rows)
    print(format_table(rows, ratio_rows))
    for row in rows:
        if row.get("profile_groups"):
            print(f"\nkernel time per optimizer step by group, {row['case']}:")
            print(f"{'group':<22}{'ms/step':>10}{'share':>8}")
            for g in row["profile_groups"]:
                print(f"{g['group']:<22}{g['ms_per_step']:>10.1f}{100 * g['share']:>7.1f}%")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"size": a.size, "rows": rows, "ratios": ratio_rows}, indent=2))
    print(f"wrote {a.out} (per-case logs in {log_dir})")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
