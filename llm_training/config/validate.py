"""Cross-field checks of a JobConfig, run before any heavy work.

`validate_config` needs only the config (called by ConfigManager.parse_args); `validate_for_world_size`
also checks the parallel layout against the number of processes and is called by the entrypoint once
WORLD_SIZE is known; `validate_environment` checks what the config points at (data set, tokenizer, optional
packages) and is called by the entrypoint before any process-group or model work. Every message names the
keys involved and how to fix them. These are the only config checks: nothing downstream (trainer, model,
parallelizer) re-checks the config. The parallel-layout rules that need the model (context-parallel heads /
chunks, the expert dispatcher) live next to their implementation (`distributed.context_parallel.
check_context_parallel`, `distributed.expert_parallel.check_dispatcher_available`) and are called from here only.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from llm_training.errors import ConfigError

if TYPE_CHECKING:
    from llm_training.config.job_config import JobConfig
    from llm_training.distributed.parallel_dims import ParallelDims


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_context_parallel(c: "JobConfig", flavor) -> None:
    """Heads / noise groups (Ulysses), chunk count and sliding window (ring + halo) against the CP degree."""
    from llm_training.distributed.context_parallel import check_context_parallel

    p = c.parallelism
    try:
        check_context_parallel(flavor, p.context_parallel_degree, p.context_parallel_mode, c.training.seq_len)
    except ValueError as e:
        raise ConfigError(
            f"{e} (flavor {c.model.flavor!r}, [parallelism] context_parallel_degree = {p.context_parallel_degree}, "
            f"context_parallel_mode = {p.context_parallel_mode!r})"
        ) from None


def _check_dispatcher(c: "JobConfig") -> None:
    """The expert-parallel dispatcher must be importable; DeepEP cannot run deterministically."""
    from llm_training.distributed.expert_parallel import DISPATCHER_KEY, check_dispatcher_available

    name = c.parallelism.expert_parallel_dispatcher
    _require(
        not (name == "deepep" and c.training.deterministic),
        f"{DISPATCHER_KEY} = 'deepep' cannot run with [training] deterministic = true (DeepEP rejects "
        "deterministic algorithms with uninitialised-memory filling); set deterministic = false or use the "
        "'all_to_all' dispatcher",
    )
    check_dispatcher_available(name)


def _check_quantize(c: "JobConfig") -> None:
    """[quantize]: at least one module kind; on a CUDA run, a recipe this GPU can run and torchao importable."""
    from llm_training.quantization import run_on_cuda
    from llm_training.quantization.kernels import torchao_problem
    from llm_training.quantization.recipes import cuda_capability, recipe_problem, resolve_recipe

    q = c.quantize
    _require(
        bool(q.convert) or q.recipe == "none",
        f"[quantize] convert is empty with recipe = {q.recipe!r}; list module kinds to convert or set recipe = 'none'",
    )
    if not run_on_cuda(c):
        return  # CPU: every recipe runs emulated; auto is none
    capability = cuda_capability()
    if capability is None:
        return  # [training] device = cuda without CUDA: the device check reports it
    problem = recipe_problem(q.recipe, capability)
    _require(problem is None, f"[quantize] {problem}")
    if resolve_recipe(q.recipe, capability) != "none":
        problem = torchao_problem()
        _require(problem is None, f"[quantize] recipe = {q.recipe!r} on CUDA: {problem}")


def _check_profiling(c: "JobConfig") -> None:
    pr = c.profiling
    _require(pr.start_step >= 0, f"[profiling] start_step must be >= 0 (0: off), got {pr.start_step}")
    _require(
        pr.end_step == 0 or pr.end_step >= pr.start_step > 0,
        f"[profiling] end_step = {pr.end_step} needs start_step >= 1 and end_step >= start_step (0: start_step "
        f"alone); got start_step = {pr.start_step}",
    )
    _require(
        not pr.memory_snapshot or pr.start_step > 0,
        "[profiling] memory_snapshot = true records over the profiled steps: set [profiling] start_step too",
    )
    _require(
        not pr.memory_snapshot or c.training.device != "cpu",
        "[profiling] memory_snapshot = true records the CUDA allocator: it needs [training] device = 'cuda' "
        "(or 'auto' on a GPU); set memory_snapshot = false",
    )


def _check_cuda_allocator(c: "JobConfig") -> None:
    """[training] cuda_allocator: comma-separated key:value pairs, a value possibly a bracketed list with its own
    commas and colons (roundup_power2_divisions:[256:1,>:8]); PyTorch checks the keys when CUDA starts."""
    settings = c.training.cuda_allocator
    items, depth, start = [], 0, 0
    for i, ch in enumerate(settings):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(settings[start:i])
            start = i + 1
    items.append(settings[start:])
    for item in items if settings.strip() else ():
        key, sep, value = item.partition(":")
        _require(
            bool(sep and key.strip() and value.strip()) and (":" not in value or value.strip().startswith("[")),
            f"[training] cuda_allocator = {settings!r}: {item!r} is not key:value; write comma-separated key:value "
            "pairs (e.g. 'expandable_segments:True'), or '' for PyTorch's defaults",
        )


def _check_loss_spike(c: "JobConfig") -> None:
    """[loss_spike]: factors above 1, a non-empty window, and a checkpoint to roll back to."""
    ls = c.loss_spike
    if not ls.enable:
        return
    _require(
        ls.loss_factor > 1,
        f"[loss_spike] loss_factor must be > 1 (a spike is a loss above factor x its moving average), "
        f"got {ls.loss_factor}; e.g. 2.0",
    )
    _require(
        ls.grad_norm_factor == 0 or ls.grad_norm_factor > 1,
        f"[loss_spike] grad_norm_factor must be 0 (off) or > 1, got {ls.grad_norm_factor}; e.g. 5.0",
    )
    _require(ls.window >= 1, f"[loss_spike] window must be >= 1 good steps, got {ls.window}; e.g. 50")
    _require(ls.warmup_steps >= 0, f"[loss_spike] warmup_steps must be >= 0, got {ls.warmup_steps}")
    _require(ls.max_consecutive >= 1, f"[loss_spike] max_consecutive must be >= 1, got {ls.max_consecutive}")
    _require(
        ls.policy != "rollback" or c.checkpoint.enable,
        "[loss_spike] policy = 'rollback' reloads the last checkpoint, but [checkpoint] enable = false; "
        "set [checkpoint] enable = true or policy = 'skip'",
    )


def source_key(i: int, source, key: str) -> str:
    """How a message names `key` of the i-th [[training.sources]] table (0-based, as --training.sources.N.KEY)."""
    return f"[[training.sources]] #{i} ({source.resolved_name!r}) {key}"


def _check_sources(c: "JobConfig") -> None:
    """[[training.sources]]: each names one data set (path or hub), hub-only keys only with hub, positive weights,
    non-negative epochs, distinct names usable as metric keys; dataset_path is left at its default."""
    import math
    import re

    from llm_training.config.job_config import DEFAULT_DATASET_PATH, SOURCE_NAME_PATTERN

    t = c.training
    _require(
        not t.sources or t.dataset_path == DEFAULT_DATASET_PATH,
        f"[training] dataset_path = {t.dataset_path!r} and [[training.sources]] are both set: list that data set "
        "as one more [[training.sources]] table (path = ...) and remove dataset_path",
    )
    names: dict[str, int] = {}
    for i, s in enumerate(t.sources):
        _require(
            bool(s.path) != bool(s.hub),
            f"{source_key(i, s, 'path / hub')}: set exactly one of path (local data) and hub (a HuggingFace Hub "
            f"dataset id), got path = {s.path!r}, hub = {s.hub!r}",
        )
        for key in ("hub_config", "revision"):
            _require(
                not getattr(s, key) or bool(s.hub),
                f"{source_key(i, s, key)} = {getattr(s, key)!r} applies to hub datasets only: set hub, or remove {key}",
            )
        _require(
            math.isfinite(s.weight) and s.weight > 0,
            f"{source_key(i, s, 'weight')} must be > 0 (its share of the rows relative to the other sources), "
            f"got {s.weight}; e.g. weight = 1.0",
        )
        _require(
            s.epochs >= 0,
            f"{source_key(i, s, 'epochs')} must be >= 0 (0: repeat without end; N: leave the mixture after N "
            f"passes), got {s.epochs}",
        )
        name = s.resolved_name
        _require(
            re.fullmatch(SOURCE_NAME_PATTERN, name) is not None,
            f"{source_key(i, s, 'name')}: {name!r} is not a usable source name (letters, digits, _ . - only); "
            "set name = '...' for this source",
        )
        _require(
            name not in names,
            f"{source_key(i, s, 'name')}: sources #{names.get(name)} and #{i} are both named {name!r}; give one of "
            "them another name = '...'",
        )
        names[name] = i
    _require(
        c.huggingface_dataset.shuffle_buffer >= 1,
        f"[huggingface_dataset] shuffle_buffer must be >= 1 record, got {c.huggingface_dataset.shuffle_buffer}; "
        "e.g. 10000",
    )


def validate_config(c: "JobConfig") -> None:
    """World-size-independent checks; raises ConfigError on the first problem found."""
    from llm_training.motif import MODEL_FLAVORS

    flavor = MODEL_FLAVORS[c.model.flavor]  # a known name: the choices check of [model] flavor ran at parse time
    t, p = c.training, c.parallelism
    _require(t.local_batch_size >= 1, f"[training] local_batch_size must be >= 1, got {t.local_batch_size}")
    _require(t.steps >= 1, f"[training] steps must be >= 1, got {t.steps}")
    _require(t.seq_len >= 2, f"[training] seq_len must be >= 2, got {t.seq_len}")
    _require(
        t.seq_len <= flavor.max_seq_len,
        f"[training] seq_len = {t.seq_len} exceeds the max_seq_len {flavor.max_seq_len} of flavor "
        f"{c.model.flavor!r}; lower seq_len or pick a longer-context flavor (e.g. motif3_seq_256k_mtp1_sft)",
    )
    _require(
        t.global_batch_size == -1 or t.global_batch_size >= 1,
        f"[training] global_batch_size must be -1 (local_batch_size x dp) or >= 1, got {t.global_batch_size}",
    )
    _require(
        t.global_batch_size == -1 or t.global_batch_size % t.local_batch_size == 0,
        f"[training] global_batch_size = {t.global_batch_size} is not a multiple of local_batch_size = "
        f"{t.local_batch_size}; set global_batch_size to local_batch_size x dp x accumulation steps (or -1)",
    )
    _require(t.max_norm >= 0, f"[training] max_norm must be >= 0 (0 disables clipping), got {t.max_norm}")
    _require(t.mtp_loss_weight >= 0, f"[training] mtp_loss_weight must be >= 0, got {t.mtp_loss_weight}")
    _require(
        t.max_consecutive_nonfinite >= 1,
        f"[training] max_consecutive_nonfinite must be >= 1, got {t.max_consecutive_nonfinite}",
    )
    hf = c.huggingface_dataset
    _require(
        0.0 <= hf.max_bad_fraction <= 1.0,
        f"[huggingface_dataset] max_bad_fraction must be in [0, 1], got {hf.max_bad_fraction}",
    )
    _check_sources(c)

    v = c.validation
    _require(v.freq >= 1, f"[validation] freq must be >= 1 (evaluate every this many steps), got {v.freq}")
    _require(v.steps >= 1, f"[validation] steps must be >= 1 (batches per evaluation), got {v.steps}")
    _require(
        not v.enable or bool(v.dataset_path),
        "[validation] enable = true needs [validation] dataset_path: set it to the held-out data (a *.jsonl file, "
        "a folder of them or a datasets.save_to_disk directory), or set enable = false",
    )

    o = c.optimizer
    _require(o.lr > 0, f"[optimizer] lr must be > 0, got {o.lr}")
    _require(o.weight_decay >= 0, f"[optimizer] weight_decay must be >= 0, got {o.weight_decay}")
    _require(0 <= o.momentum < 1, f"[optimizer] momentum must be in [0, 1), got {o.momentum}")
    _require(o.ns_steps >= 1, f"[optimizer] ns_steps must be >= 1, got {o.ns_steps}")
    _require(
        len(o.adamw_betas) == 2 and all(0 <= b < 1 for b in o.adamw_betas),
        f"[optimizer] adamw_betas must be two numbers in [0, 1), e.g. [0.9, 0.95]; got {o.adamw_betas}",
    )
    _require(o.adamw_eps > 0, f"[optimizer] adamw_eps must be > 0, got {o.adamw_eps}")
    _require(
        o.qk_clip_threshold >= 0, f"[optimizer] qk_clip_threshold must be >= 0 (0 disables), got {o.qk_clip_threshold}"
    )

    _require(
        c.compile.granularity != "sublayer" or c.activation_checkpoint.mode == "none",
        f"[compile] granularity = 'sublayer' needs [activation_checkpoint] mode = 'none' (got "
        f"{c.activation_checkpoint.mode!r}: a checkpointed block compiles whole, its recompute inside the graph); "
        f"set granularity = 'auto' / 'block' or mode = 'none'",
    )

    _require(
        c.compile.prebuild_workers >= 0,
        f"[compile] prebuild_workers must be >= 0 (0: our Triton kernels build in the training process), got "
        f"{c.compile.prebuild_workers}",
    )

    s = c.lr_scheduler
    _require(s.warmup_steps >= 0, f"[lr_scheduler] warmup_steps must be >= 0, got {s.warmup_steps}")
    _require(
        s.warmup_steps <= t.steps,
        f"[lr_scheduler] warmup_steps = {s.warmup_steps} exceeds [training] steps = {t.steps}; "
        f"lower warmup_steps or raise steps",
    )
    _require(0 < s.wsd_decay_ratio <= 1, f"[lr_scheduler] wsd_decay_ratio must be in (0, 1], got {s.wsd_decay_ratio}")
    _require(0 <= s.min_lr_factor <= 1, f"[lr_scheduler] min_lr_factor must be in [0, 1], got {s.min_lr_factor}")

    _require(
        p.data_parallel_replicate_degree >= 1,
        f"[parallelism] data_parallel_replicate_degree must be >= 1, got {p.data_parallel_replicate_degree}",
    )
    _require(
        p.data_parallel_shard_degree == -1 or p.data_parallel_shard_degree >= 1,
        f"[parallelism] data_parallel_shard_degree must be -1 (the rest) or >= 1, got {p.data_parallel_shard_degree}",
    )
    _require(
        p.expert_parallel_degree >= 1,
        f"[parallelism] expert_parallel_degree must be >= 1, got {p.expert_parallel_degree}",
    )
    _require(
        p.context_parallel_degree >= 1,
        f"[parallelism] context_parallel_degree must be >= 1, got {p.context_parallel_degree}",
    )
    _check_context_parallel(c, flavor)
    ep = p.expert_parallel_degree
    _require(
        flavor.num_experts % ep == 0,
        f"[parallelism] expert_parallel_degree = {ep} does not divide the {flavor.num_experts} experts of "
        f"{c.model.flavor!r}; pick a divisor of {flavor.num_experts}",
    )
    _check_dispatcher(c)
    _check_quantize(c)

    ck = c.checkpoint
    _require(ck.interval >= 1, f"[checkpoint] interval must be >= 1, got {ck.interval}")
    _require(ck.keep_latest_k >= 0, f"[checkpoint] keep_latest_k must be >= 0 (0 keeps all), got {ck.keep_latest_k}")
    _require(
        ck.export_hf_every >= 0,
        f"[checkpoint] export_hf_every must be >= 0 (0: never), got {ck.export_hf_every}",
    )
    _require(
        ck.export_hf_every == 0 or ck.enable,
        f"[checkpoint] export_hf_every = {ck.export_hf_every} exports checkpoints, but [checkpoint] enable = false; "
        "set enable = true or export_hf_every = 0",
    )
    _check_loss_spike(c)
    _check_cuda_allocator(c)
    _require(c.metrics.log_freq >= 1, f"[metrics] log_freq must be >= 1, got {c.metrics.log_freq}")
    _check_profiling(c)
    _require(
        c.job.dry_run_world_size >= 0,
        f"[job] dry_run_world_size must be >= 0 (0: WORLD_SIZE or the config's degrees), got {c.job.dry_run_world_size}",
    )
    _require(
        c.job.dry_run_gpu_memory_gib > 0,
        f"[job] dry_run_gpu_memory_gib must be > 0 (e.g. 178 for B200), got {c.job.dry_run_gpu_memory_gib}",
    )
    _require(
        c.job.run_name not in ("", ".", "..") and "/" not in c.job.run_name and "\\" not in c.job.run_name,
        f"[job] run_name {c.job.run_name!r} must be a plain folder name (no path separators)",
    )


def validate_for_world_size(c: "JobConfig", world_size: int) -> "ParallelDims":
    """Check the parallel layout and batch sizes against `world_size` processes; returns the ParallelDims."""
    from llm_training.distributed.parallel_dims import ParallelDims

    dims = ParallelDims.from_config(c.parallelism, world_size)
    t = c.training
    per_step = t.local_batch_size * dims.dp_size
    _require(
        t.global_batch_size == -1 or t.global_batch_size % per_step == 0,
        f"[training] global_batch_size = {t.global_batch_size} is not divisible by local_batch_size x dp = "
        f"{t.local_batch_size} x {dims.dp_size} = {per_step} (world size {world_size}); set it to a multiple of "
        f"{per_step} (the quotient is the number of gradient-accumulation steps) or to -1",
    )
    return dims


def grad_accumulation_steps(c: "JobConfig", dp_size: int) -> int:
    """Micro-batches per optimizer step: global_batch_size / (local_batch_size x dp), 1 when it is -1."""
    t = c.training
    return 1 if t.global_batch_size == -1 else t.global_batch_size // (t.local_batch_size * dp_size)


# Optional packages a `[metrics]` switch needs: (flag, package imported, pip name).
OPTIONAL_METRICS_PACKAGES = (("enable_tensorboard", "tensorboard", "tensorboard"), ("enable_wandb", "wandb", "wandb"))


def _validation_keys(message: str) -> str:
    """A data-set error about the validation data: the data layer names the [training] dataset_path and
    [huggingface_dataset] split keys; the keys the user sets for this data set are [validation]'s."""
    return message.replace("[training] dataset_path", "[validation] dataset_path").replace(
        "[huggingface_dataset] split", "[validation] split"
    )


def _source_keys(i: int, source):
    """A data-set error about the i-th [[training.sources]] table: prefixed with the table, and the data layer's
    [training] dataset_path (and the split / conversations_field the table sets itself) named as its keys."""

    def message_of(message: str) -> str:
        message = message.replace("[training] dataset_path", "path")
        for key in ("split", "conversations_field"):
            if getattr(source, key):
                message = message.replace(f"[huggingface_dataset] {key}", key)
        return f"{source_key(i, source, '')}data: {message}"

    return message_of


def validate_environment(c: "JobConfig") -> None:
    """Checks of the files and packages the config needs, so that they fail as config errors (exit 2) at start-up:
    the tokenizer directory (loads, has a chat template, eos and pad tokens), the data set or every
    [[training.sources]] table (exists, has a record, the split and conversations column exist, streaming only of hub
    or parquet data, a Hub dataset reachable or cached; the validation data set too when enabled), the datasets
    cache_dir, CUDA and triton for the [kernels] that run Triton, flash-attn-4 for attention = 'fa4' and the packages
    of the enabled metrics sinks."""
    from pathlib import Path

    from llm_training.data import build_tokenizer, check_dataset, check_source  # transformers is slow to import

    hf, v = c.huggingface_dataset, c.validation
    _require(
        not hf.cache_dir or not Path(hf.cache_dir).exists() or Path(hf.cache_dir).is_dir(),
        f"[huggingface_dataset] cache_dir = {hf.cache_dir!r} is a file: point it at a folder (created when missing) "
        "or leave it empty for the datasets default",
    )
    checks = [(lambda: build_tokenizer(c.model.tokenizer_path), str)]
    if c.training.sources:
        checks += [(lambda s=s: check_source(s, hf), _source_keys(i, s)) for i, s in enumerate(c.training.sources)]
    else:
        checks.append(
            (lambda: check_dataset(c.training.dataset_path, hf.conversations_field, hf.split, hf.cache_dir), str)
        )
    if v.enable:
        checks.append(
            (
                lambda: check_dataset(v.dataset_path, hf.conversations_field, v.split or hf.split, hf.cache_dir),
                _validation_keys,
            )
        )
    for check, message_of in checks:
        try:
            check()
        except (OSError, ValueError, KeyError, ImportError) as e:
            raise ConfigError(message_of(str(e.args[0]) if isinstance(e, KeyError) else str(e))) from None
    if c.kernels.mhc_backward == "fused":
        import torch
        from activation.backend import TRITON_AVAILABLE

        on_cuda = c.training.device == "cuda" or (c.training.device == "auto" and torch.cuda.is_available())
        _require(
            on_cuda and TRITON_AVAILABLE,
            "[kernels] mhc_backward = 'fused' runs Triton kernels on CUDA: it needs a CUDA device and the triton "
            "package; set mhc_backward = 'tensor_ops'",
        )
    for key in ("activations", "muon_gram"):
        if getattr(c.kernels, key) == "triton":
            import torch
            from activation.backend import TRITON_AVAILABLE

            on_cuda = c.training.device == "cuda" or (c.training.device == "auto" and torch.cuda.is_available())
            _require(
                on_cuda and TRITON_AVAILABLE,
                f"[kernels] {key} = 'triton' runs Triton kernels on CUDA: it needs a CUDA device and the triton "
                f"package; set {key} = '{'auto' if key == 'activations' else 'torch'}'",
            )
    if c.kernels.attention == "fa4":
        from llm_training.layers.attention.fa4 import fa4_unavailable_reason

        reason = fa4_unavailable_reason("cpu" if c.training.device == "cpu" else "cuda")
        if reason is not None:
            raise ConfigError(f"[kernels] attention = 'fa4': {reason}; set attention = 'auto'")
    for flag, package, pip_name in OPTIONAL_METRICS_PACKAGES:
        if getattr(c.metrics, flag) and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"[metrics] {flag} = true needs the {package} package, which is not installed: "
                f"pip install {pip_name}, or set {flag} = false"
            )
