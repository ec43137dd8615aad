"""The training job's configuration: one dataclass per TOML section, every key with a default and a doc.

Each field is declared with `option(default, doc, choices=...)`; the doc string is what `--help`,
`scripts/gen_config_docs.py` (-> docs/config.md) and the resolved-config dump show, and `choices` (for
string fields, or the elements of list fields) is checked when the value is parsed. A choice set that names
implementations comes from the registry that implements them (flavors, attention backends, quantization
recipes, activation-checkpoint modes), so the config accepts exactly what exists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from activation.backend import BACKENDS as ACTIVATION_BACKENDS
from optimizer.newton_schulz import GRAM_BACKENDS

from llm_training.distributed.activation_checkpoint import AC_MODES
from llm_training.distributed.compile import KERNEL_TUNINGS
from llm_training.distributed.context_parallel import CP_MODES
from llm_training.distributed.expert_parallel import DISPATCHERS
from llm_training.layers.attention.backends import ATTENTION_BACKENDS
from llm_training.motif import MODEL_FLAVORS
from llm_training.quantization import MODULE_KINDS, RECIPES

# The dtype names the config accepts for parameters, gradient reduction and exports: names of torch dtypes, which
# their users resolve with getattr(torch, name).
DTYPE_NAMES = ("bfloat16", "float32")

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # .../llm_training
ASSETS_DIR = PACKAGE_DIR / "data" / "assets"


def option(default: Any, doc: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config field: its default, its one-line doc and (optionally) the fixed set of allowed values."""
    metadata = {"doc": doc}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class Job:
    config_file: str = option("", "TOML file this config was loaded from (set with --job.config_file)")
    dump_folder: str = option("./outputs", "root folder for run outputs: <dump_folder>/<run_name>/")
    description: str = option("", "free-text description of the run, shown in logs")
    print_config: bool = option(False, "print the resolved config as TOML and exit")
    run_name: str = option("", "run folder name under dump_folder (empty: the config file's stem, or 'default')")
    dry_run: bool = option(
        False,
        "instead of training, set the job up for its full world size on one CPU process (fake process group, "
        "model on meta), print each rank's memory report and exit: 0 fits, 3 does not fit (llm_training/dry_run.py)",
    )
    dry_run_world_size: int = option(
        0,
        "world size the dry run sets up (0: WORLD_SIZE when set, else data_parallel_replicate x shard x "
        "context_parallel degrees, which needs an explicit data_parallel_shard_degree)",
    )
    dry_run_gpu_memory_gib: float = option(
        178.0,
        "memory of one GPU the dry run checks against, in GiB as torch.cuda.mem_get_info reports it "
        "(B200 178, H200 139, H100 79)",
    )


@dataclass
class Model:
    flavor: str = option(
        "motif3_debug", "model flavor from llm_training.motif.MODEL_FLAVORS", choices=tuple(MODEL_FLAVORS)
    )
    tokenizer_path: str = option(str(ASSETS_DIR / "tokenizer"), "local HuggingFace tokenizer directory")


@dataclass
class Kernels:
    """Which kernel runs each op family: the one place they are chosen. The environment variables
    ACTIVATION_BACKEND and MUON_GRAM_BACKEND, when set, override `activations` and `muon_gram` (for a quick A/B)."""

    attention: str = option(
        "auto",
        "attention kernel: auto picks the fastest available for the device and head dims (flash-attn-4 on SM90 / "
        "SM100 when installed, else FlexAttention or SDPA)",
        choices=tuple(ATTENTION_BACKENDS),
    )
    mhc_backward: str = option(
        "auto",
        "mHC's backward over the n streams: fused (the collapse and mix backward as two Triton kernels; needs CUDA "
        "and triton), tensor_ops (inductor compiles the tensor ops), or auto (fused where the stream is on CUDA and "
        "triton is installed, else tensor_ops)",
        choices=("auto", "fused", "tensor_ops"),
    )
    activations: str = option(
        "auto",
        "PolyNorm / RMSNorm kernels (the activation package): auto (Triton on CUDA when triton is installed, else "
        "PyTorch), torch, triton",
        choices=ACTIVATION_BACKENDS,
    )
    muon_gram: str = option(
        "torch",
        "Muon's Newton-Schulz X X^T products: torch (bmm) or triton (symmetric Gram kernel; CUDA)",
        choices=GRAM_BACKENDS,
    )


DEFAULT_DATASET_PATH = str(ASSETS_DIR / "demo_chat.jsonl")
SOURCE_NAME_PATTERN = r"[A-Za-z0-9_.\-]+"  # a source name as metrics keys (tokens/<name>) carry it


@dataclass
class DataSource:
    """One source of a data mixture: a `[[training.sources]]` table of the TOML (llm_training/data/mixture.py)."""

    name: str = option(
        "",
        "the source's name in metrics (tokens/<name>) and messages, letters, digits, _ . - (empty: the file or "
        "folder name of path, or the last part of hub plus -hub_config)",
    )
    path: str = option(
        "", "local data: a *.jsonl or *.parquet file, a folder of them, or a datasets save_to_disk directory"
    )
    hub: str = option(
        "", "HuggingFace Hub dataset id read with datasets.load_dataset, e.g. 'allenai/c4' (set path or hub)"
    )
    hub_config: str = option("", "hub only: the dataset's configuration (subset) name, e.g. 'en' (empty: its default)")
    revision: str = option(
        "", "hub only: branch, tag or commit of the dataset repository (empty: main); a commit pins the data"
    )
    split: str = option("", "split of a hub or save_to_disk dataset (empty: [huggingface_dataset] split)")
    streaming: bool = option(
        False,
        "hub or parquet only: read the records as a stream instead of downloading / converting them all first "
        "(shuffled in a buffer of [huggingface_dataset] shuffle_buffer records; every data-parallel rank reads the "
        "whole stream and keeps its share; a resume reads the current epoch again up to its position)",
    )
    conversations_field: str = option(
        "", "record field holding the chat turns (empty: [huggingface_dataset] conversations_field)"
    )
    weight: float = option(
        1.0, "relative share of the packed rows drawn from this source (> 0; the weights need not sum to 1)"
    )
    epochs: int = option(
        0,
        "passes over the source before it leaves the mixture (0: repeated without end); when every source "
        "has left, the run stops with an error",
    )

    @property
    def resolved_name(self) -> str:
        """`name`, or the default: the stem of a file path, the name of a folder, the hub id's last part (+ config)."""
        if self.name:
            return self.name
        if self.hub:
            return self.hub.rstrip("/").split("/")[-1] + (f"-{self.hub_config}" if self.hub_config else "")
        path = Path(self.path.rstrip("/"))
        return path.stem if path.suffix in (".jsonl", ".parquet") else path.name


@dataclass
class Training:
    dataset: str = option("huggingface", "dataset loader", choices=("huggingface",))
    dataset_path: str = option(
        DEFAULT_DATASET_PATH,
        "the data set when sources is empty: a local *.jsonl or *.parquet file, a folder of them, or a datasets "
        "save_to_disk directory",
    )
    sources: list[DataSource] = option(
        [],
        "a data mixture instead of dataset_path: one [[training.sources]] table per source (its keys: "
        "docs/config.md); each packed row comes from one source, drawn by weight with [huggingface_dataset] "
        "shuffle_seed",
    )
    local_batch_size: int = option(8, "sequences per data-parallel rank per micro-batch")
    global_batch_size: int = option(
        -1, "sequences per optimizer step over all ranks (-1: local_batch_size x dp); more gives grad accumulation"
    )
    seq_len: int = option(256, "tokens per sequence (packed); at most the flavor's max_seq_len")
    steps: int = option(300, "number of optimizer steps")
    max_norm: float = option(1.0, "gradient clipping max global L2 norm (0 disables clipping)")
    seed: int = option(
        42,
        "seed of model init and of the torch/python/numpy RNGs (the data order uses [huggingface_dataset] shuffle_seed)",
    )
    deterministic: bool = option(False, "use deterministic algorithms (slower; bitwise-reproducible where feasible)")
    mtp_loss_weight: float = option(0.3, "weight of the multi-token-prediction loss added to the main loss")
    mixed_precision_param: str = option(
        "bfloat16", "dtype of parameters in forward/backward (FSDP2 param_dtype)", choices=DTYPE_NAMES
    )
    mixed_precision_reduce: str = option(
        "float32", "dtype of gradient reduction (FSDP2 reduce_dtype)", choices=DTYPE_NAMES
    )
    max_consecutive_nonfinite: int = option(
        3, "abort after this many consecutive steps with a non-finite loss or grad norm (those steps are skipped)"
    )
    device: str = option(
        "auto", "device to train on (auto: cuda if available, else cpu)", choices=("auto", "cpu", "cuda")
    )
    cuda_allocator: str = option(
        "expandable_segments:True",
        "settings of the CUDA caching allocator (PYTORCH_ALLOC_CONF syntax, key:value[,key:value]), set at start; "
        "PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF in the environment win; empty: PyTorch's defaults",
    )


@dataclass
class LossSpike:
    """Finite loss spikes (llm_training/trainer/spikes.py): a step whose loss or gradient norm jumps above a moving
    average of recent good steps is not applied, then skipped or rolled back to the last checkpoint."""

    enable: bool = option(False, "detect loss / gradient-norm spikes and handle them with policy")
    loss_factor: float = option(
        2.0, "a step is a spike when its loss exceeds this factor x the moving average of recent good losses (> 1)"
    )
    grad_norm_factor: float = option(
        0.0, "the same test on the gradient norm before clipping (0 disables it; else > 1)"
    )
    window: int = option(50, "number of recent good steps in the moving averages")
    warmup_steps: int = option(50, "no detection before this many good steps were seen")
    policy: str = option(
        "skip",
        "skip: do not apply the step (as a non-finite one); rollback: reload the last checkpoint and continue with "
        "the data after the spike's batches (needs [checkpoint] enable)",
        choices=("skip", "rollback"),
    )
    max_consecutive: int = option(
        3, "stop the run after this many spikes in a row (no good step past the previous spike in between)"
    )


@dataclass
class HuggingFaceDataset:
    split: str = option("train", "dataset split to read")
    conversations_field: str = option(
        "conversations", "record field holding the chat turns (a list of {role, content})"
    )
    shuffle: bool = option(True, "shuffle records before packing")
    shuffle_seed: int = option(1234, "seed of the record shuffle (and of the source draws of a mixture)")
    shuffle_buffer: int = option(
        10000, "records in the shuffle buffer of a streaming source (the stream is shuffled within it)"
    )
    cache_dir: str = option(
        "",
        "datasets cache of hub sources and of parquet files converted for random access (empty: HF_DATASETS_CACHE, "
        "else ~/.cache/huggingface/datasets); offline (HF_HUB_OFFLINE=1), hub data must already be in it",
    )
    packing: str = option(
        "pack", "pack several documents per row, or one padded document per row", choices=("pack", "pad")
    )
    overlong: str = option("truncate", "what to do with documents longer than seq_len", choices=("truncate", "drop"))
    bad_record_policy: str = option(
        "skip", "malformed records: skip (counted, logged) or fail at once", choices=("skip", "fail")
    )
    max_bad_fraction: float = option(0.01, "fail when more than this fraction of records read so far was skipped")


@dataclass
class Validation:
    """Evaluation on held-out data while training: the training loss (same packing and loss masks, read with the
    [huggingface_dataset] settings but in file order), without gradients, on the same batches every time."""

    enable: bool = option(False, "evaluate on dataset_path every freq steps and at the last step")
    dataset_path: str = option(
        "", "validation data: local jsonl file (or folder of them) or datasets save_to_disk directory"
    )
    split: str = option("", "split of a save_to_disk DatasetDict to evaluate on (empty: [huggingface_dataset] split)")
    freq: int = option(100, "evaluate after every this many optimizer steps (and after the last one)")
    steps: int = option(
        10,
        "validation batches per evaluation, each local_batch_size x seq_len per data-parallel rank: the first ones "
        "of dataset_path (from its start again when it has fewer)",
    )


@dataclass
class Optimizer:
    name: str = option(
        "muon", "muon (Muon for hidden matrices + AdamW for the rest) or adamw everywhere", choices=("muon", "adamw")
    )
    lr: float = option(
        2e-3, "peak learning rate (Muon uses the Moonlight 0.2*sqrt(max(A,B)) scaling, so AdamW and Muon share it)"
    )
    weight_decay: float = option(0.1, "decoupled weight decay on matrices (not on norms, gains, biases)")
    momentum: float = option(0.95, "Muon momentum")
    nesterov: bool = option(True, "Nesterov momentum in Muon")
    ns_steps: int = option(5, "Newton-Schulz iterations in Muon")
    muon_momentum_dtype: str = option(
        "float32",
        "dtype of Muon's momentum buffers: bfloat16 halves that state (fp32 arithmetic, rounded store, as DeepSeek-V3 "
        "keeps AdamW's moments); checkpoints load across the two",
        choices=("float32", "bfloat16"),
    )
    adamw_betas: list[float] = option([0.9, 0.95], "AdamW (beta1, beta2)")
    adamw_eps: float = option(1e-8, "AdamW epsilon")
    qk_clip_threshold: float = option(100.0, "QK-clip threshold tau on the max attention logit (0 disables)")
    router_in_muon: bool = option(False, "optimize the MoE router gate with Muon instead of AdamW")
    mhc_proj_in_muon: bool = option(False, "optimize the mHC projections with Muon instead of AdamW")
    lambda_in_muon: bool = option(False, "optimize the GDLA lambda_proj with Muon instead of AdamW")


@dataclass
class LRScheduler:
    warmup_steps: int = option(20, "linear warmup steps from 0 to the peak lr")
    decay_type: str = option(
        "cosine", "decay after warmup (wsd: constant, then linear decay)", choices=("cosine", "linear", "wsd")
    )
    wsd_decay_ratio: float = option(0.2, "wsd only: fraction of the steps spent decaying at the end")
    min_lr_factor: float = option(0.1, "final lr as a fraction of the peak lr")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = option(1, "DDP/HSDP replicas (parameters replicated across them)")
    data_parallel_shard_degree: int = option(-1, "FSDP2 shard degree (-1: world size / (replicate x context parallel))")
    expert_parallel_degree: int = option(
        1, "ranks the experts are split over; carved out of the dp_shard x context-parallel ranks"
    )
    expert_parallel_dispatcher: str = option(
        "all_to_all",
        "expert-parallel token dispatch: torch all-to-all (any backend) or DeepEP (CUDA, needs deep_ep importable)",
        choices=tuple(DISPATCHERS),
    )
    context_parallel_degree: int = option(1, "ranks one sequence is split over (sequence/context parallel)")
    context_parallel_mode: str = option(
        "ulysses",
        "context parallel algorithm: ulysses (head all-to-all; falls back to ring when the heads do not split) or "
        "ring (ring attention on full layers, a halo of sliding_window keys on sliding ones)",
        choices=CP_MODES,
    )


@dataclass
class Checkpoint:
    enable: bool = option(False, "save DCP checkpoints (and resume from the latest one in folder)")
    folder: str = option("checkpoint", "checkpoint folder, relative to <dump_folder>/<run_name>/")
    interval: int = option(100, "save every this many steps (also at the end and on SIGTERM)")
    keep_latest_k: int = option(3, "keep only the newest k checkpoints (0 keeps all)")
    async_mode: str = option("disabled", "save synchronously or in a background thread", choices=("disabled", "async"))
    initial_load_path: str = option(
        "", "weights to start from when no checkpoint of this run exists (empty: random init)"
    )
    initial_load_format: str = option("hf", "format of initial_load_path", choices=("hf", "dcp"))
    export_dtype: str = option("bfloat16", "dtype of exported HF safetensors", choices=DTYPE_NAMES)
    export_hf_every: int = option(
        0,
        "also export every this many-th checkpoint (and the final one) as a HuggingFace folder "
        "<dump_folder>/<run_name>/hf/step-<N>/ in export_dtype (0: never)",
    )
    on_damaged: str = option(
        "fall_back",
        "newest checkpoint fails verification (missing, truncated or corrupted file): move it aside and resume "
        "from the previous one, or stop",
        choices=("fall_back", "stop"),
    )


@dataclass
class ActivationCheckpoint:
    mode: str = option(
        "none",
        "recompute activations in backward: none, every block, selected ops, or long_context (every block + "
        "routed experts in checkpointed token chunks, for 64K-256K tokens per GPU)",
        choices=AC_MODES,
    )
    keep_full_attention: bool = option(
        True,
        "under long_context: full-attention layers keep flash-attn-4's forward output (n_heads x v_head_dim + "
        "n_heads fp32 per token and layer) for the backward instead of recomputing the quadratic kernel; false: "
        "recompute it (less memory)",
    )


COMPILE_COMPONENTS = ("model", "loss")
COMPILE_GRANULARITIES = ("auto", "block", "sublayer")


@dataclass
class Compile:
    enable: bool = option(False, "torch.compile the components listed in components")
    components: list[str] = option(
        list(COMPILE_COMPONENTS),
        f"what to compile, from {', '.join(COMPILE_COMPONENTS)}: the blocks; the chunked loss's softmax arithmetic "
        "where triton is missing (on CUDA with triton the loss chunk is one Triton kernel either way)",
        choices=COMPILE_COMPONENTS,
    )
    granularity: str = option(
        "auto",
        "what one compiled graph covers: block (a whole block; under activation checkpointing its recompute is planned "
        "inside the graph), sublayer (the attention half and the feed-forward half apart, and with mHC the "
        "feed-forward half as mHC-in, MLP or MoE, mHC-out: a region shared by blocks that differ elsewhere compiles "
        "once; needs [activation_checkpoint] mode = none), or auto (sublayer without activation checkpointing, else "
        "block). H200, motif3_proxy_nomtp, 64K tokens per step: halves' first step 70.0 s vs 82.7 for blocks, reserved "
        "111.2 vs 117.0 GiB, step time 0.996x",
        choices=COMPILE_GRANULARITIES,
    )
    kernel_tuning: str = option(
        "heuristic",
        "how inductor picks each generated kernel's launch configuration: heuristic (builds only the one its "
        "heuristics rank first) or benchmark (inductor's own default: builds every configuration they list, 2-6 per "
        "kernel, and times them at the first launch). H100, motif3_proxy_nomtp with 16 experts, 32K tokens per step: "
        "heuristic's first step 35.7 s vs 43.2, step 975.6 vs 1011.7 ms",
        choices=KERNEL_TUNINGS,
    )
    prebuild_workers: int = option(
        4,
        "processes that build our Triton kernels (norms, mHC, the loss, QK-clip's max logits) from the shapes "
        "torch.compile traces or the trainer knows, "
        "before the compiled step first launches them, instead of the training process building them one after "
        "another in its first step (activation/triton_prebuild.py; CUDA only); 0: none",
    )
    cache_folder: str = option(
        "compile_cache",
        "the compiled-kernel caches (torch.compile's graphs and Triton kernels, our Triton kernels, flash-attn-4's, "
        "Triton's autotuning results), "
        "relative to <dump_folder>/<run_name>/: a restarted or resumed run reuses them instead of compiling again; "
        "empty: each library's default under /tmp or ~, lost with the container. TORCHINDUCTOR_CACHE_DIR, "
        "TRITON_CACHE_DIR, FLASH_ATTENTION_CUTE_DSL_CACHE_DIR, when set, win",
    )


@dataclass
class Quantize:
    recipe: str = option(
        "none",
        "low-precision GEMMs (llm_training.quantization.recipes): mxfp8 (SM100), fp8_rowwise / fp8_blockwise "
        "(SM90+), auto (mxfp8 on SM100, fp8_rowwise on SM90, none elsewhere); emulated on CPU",
        choices=RECIPES,
    )
    convert: list[str] = option(
        list(MODULE_KINDS),
        "module kinds the recipe converts (embedding, heads, router, norms, mHC, lambda and gate projections never are)",
        choices=MODULE_KINDS,
    )
    high_precision_weight_grad: bool = option(
        False, "compute the weight-gradient GEMMs of converted modules in bf16 instead of the recipe's low precision"
    )


@dataclass
class Profiling:
    """Profiler trace and CUDA memory snapshot of a range of steps (llm_training/trainer/profiling.py)."""

    start_step: int = option(0, "first optimizer step to profile (0: no profiling)")
    end_step: int = option(0, "last optimizer step to profile, inclusive (0: start_step alone)")
    memory_snapshot: bool = option(
        False,
        "also record the CUDA allocator's history over the steps and write its snapshot (open it in "
        "pytorch.org/memory_viz) and a summary of what holds the memory at its peak; CUDA only",
    )
    ranks: str = option("rank0", "which ranks profile: rank0 or all", choices=("rank0", "all"))
    folder: str = option("profile", "output folder, relative to <dump_folder>/<run_name>/")


@dataclass
class Metrics:
    log_freq: int = option(10, "log metrics every this many steps")
    enable_wandb: bool = option(
        False, "log to Weights & Biases (WANDB_API_KEY / WANDB_PROJECT / WANDB_MODE from the environment)"
    )
    enable_tensorboard: bool = option(False, "write TensorBoard event files under <dump_folder>/<run_name>/tb")
    save_jsonl: bool = option(True, "append metrics to <dump_folder>/<run_name>/metrics.jsonl")


@dataclass
class JobConfig:
    """The whole job: one attribute per TOML section."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    loss_spike: LossSpike = field(default_factory=LossSpike)
    huggingface_dataset: HuggingFaceDataset = field(default_factory=HuggingFaceDataset)
    validation: Validation = field(default_factory=Validation)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    kernels: Kernels = field(default_factory=Kernels)
    quantize: Quantize = field(default_factory=Quantize)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)

    @property
    def run_folder(self) -> Path:
        """<dump_folder>/<run_name>: where the resolved config, metrics and checkpoints of this run go."""
        return Path(self.job.dump_folder) / self.job.run_name


# Keys that moved to another section: (old section, old key) -> (new section, new key), for the error message.
MOVED_KEYS = {
    ("model", "attention_backend"): ("kernels", "attention"),
    ("model", "mhc_backward"): ("kernels", "mhc_backward"),
}


def section_classes() -> dict[str, type]:
    """Section name -> its dataclass, in declaration order."""
    return {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}  # type: ignore[misc]
