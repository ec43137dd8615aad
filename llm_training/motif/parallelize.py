"""The ONE place that applies parallelism and memory/speed wrappers to a Motif3Model:
activation checkpointing, torch.compile and FSDP2 (with mixed precision), in that order, per block.

Order of use (ARCHITECTURE.md §2 step 3):
    with torch.device("meta"): model = Motif3Model(args)
    parallel = parallelize_motif(model, parallel_dims, job_config, device)
    model.to_empty(device=device); model.init_weights(buffer_device=device)   # or load a checkpoint
    ... after the backward passes of a step: parallel.sync_replicated_grads()

Choices (documented here and in the report):
  * Blocks (`layers[i]`, `mtp_layers[k]`) are wrapped WITHOUT replacing modules (forward patched for
    activation checkpointing, `Module.compile()` for torch.compile), so parameter FQNs never change.
  * fp32 parameters (router gate, mHC, PolyNorm act_fn: `state_dict_adapter.FP32_KEY_PATTERNS`) are kept
    OUT of FSDP2 (`ignored_params`): they stay fp32, replicated on every rank (they are small: ~2% of the
    parameters of motif3_seq), and their gradients are all-reduced (SUM) by `sync_replicated_grads`.
    FSDP2's MixedPrecisionPolicy would otherwise hand the model bf16 copies of them; the model computes
    those modules in fp32 from whatever it gets, so this keeps their forward exact.
  * Gradient reduction is a SUM over data ranks (no 1/N): the trainer's losses are already normalised by
    the global token count (see trainer/losses.py). FSDP2 is told so with `set_gradient_divide_factor(1)`
    and SUM-only collectives (gloo has no PREMUL_SUM).
  * FSDP2 is applied when torch.distributed is initialised and either there is more than one data-parallel
    rank (replicate or shard) or the device is CUDA (a 1-rank FSDP2 gives bf16 mixed precision with fp32 master weights). On CPU,
    FSDP2 runs in fp32 (gloo), verified with 2 ranks in tests/motif/test_parallelize.py.
  * The root module (embedding, final norm, lm_head) is its own FSDP2 group; FSDP2 does not reshard the
    root after forward, so the trainer's chunked loss can use `model.lm_head.weight` after the forward.
  * activation_checkpoint.mode = "selective" saves the outputs of matmuls and attention kernels and
    recomputes everything else (norms, PolyNorm, mHC Sinkhorn, routing arithmetic, elementwise ops).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from llm_training.config.errors import ConfigError
from llm_training.motif.state_dict_adapter import is_fp32_key

# ops whose outputs "selective" activation checkpointing keeps (the expensive ones)
_SAVE_OPS = {
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default", "aten.linear.default",
    "aten._grouped_mm.default", "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default", "aten._flash_attention_forward.default",
    "aten._efficient_attention_forward.default",
}  # fmt: skip

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class ParallelizedModel:
    """What parallelize_motif did, and the step-time duty it leaves: syncing the replicated grads."""

    model: nn.Module
    fsdp: bool
    # FQNs, not Parameter objects: `to_empty` / loading may replace the Parameter objects.
    replicated_param_names: list[str] = field(default_factory=list)
    grad_group: object = None  # process group over all ranks that see different data

    def sync_replicated_grads(self) -> None:
        """All-reduce (SUM) the grads of the non-FSDP (replicated fp32) parameters in one flat buffer."""
        if not self.fsdp or not self.replicated_param_names or dist.get_world_size(self.grad_group) == 1:
            return
        params = [self.model.get_parameter(name) for name in self.replicated_param_names]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.grad_group)
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(g).to(p.dtype)
            offset += n


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: trunk layers then MTP modules."""
    return [*model.layers, *model.mtp_layers]


def _selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if str(op) in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(block: nn.Module, mode: str) -> None:
    """Recompute the block's activations in backward ("full") or all but matmul/attention outputs
    ("selective"). Patches `block.forward` so the module tree and FQNs stay the same."""
    from torch.utils.checkpoint import checkpoint

    if mode == "none":
        return
    inner = block.forward
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = _selective_context
    elif mode != "full":
        raise ConfigError(f"[activation_checkpoint] mode must be none, full or selective, got {mode!r}")

    @functools.wraps(inner)
    def forward(*args, **kw):
        return checkpoint(inner, *args, **kwargs, **kw)

    block.forward = forward


def fp32_param_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters() if is_fp32_key(name)]


def parallelize_motif(model: nn.Module, parallel_dims, job_config, device: torch.device) -> ParallelizedModel:
    """Apply activation checkpointing, compile and FSDP2 to `model` (typically still on meta)."""
    if parallel_dims.ep_enabled or parallel_dims.cp_enabled:
        raise ConfigError(
            "[parallelism] expert_parallel_degree / context_parallel_degree > 1 are not applied by "
            "motif/parallelize.py yet; set both to 1"
        )
    mode = job_config.activation_checkpoint.mode
    for block in blocks(model):
        apply_activation_checkpointing(block, mode)
    if job_config.compile.enable and "model" in job_config.compile.components:
        for block in blocks(model):
            block.compile()

    # Any data parallelism needs FSDP2's gradient reduction, pure replication (dp_shard = 1) included: it
    # then runs as HSDP over a 1-rank shard dim. Without it the ranks would never sum their gradients.
    use_fsdp = dist.is_initialized() and (
        parallel_dims.dp_enabled or parallel_dims.fsdp_enabled or device.type == "cuda"
    )
    if not use_fsdp:
        if device.type == "cuda" and job_config.training.mixed_precision_param == "bfloat16":
            raise ConfigError(
                "bf16 mixed precision on CUDA needs torch.distributed initialised (FSDP2 provides it, even on one "
                "GPU): launch with torchrun, or set training.mixed_precision_param = 'float32'"
            )
        return ParallelizedModel(model, fsdp=False)

    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = parallel_dims.world_mesh
    if mesh is None:
        mesh = parallel_dims.build_mesh(device.type)
    fsdp_mesh = mesh["dp_replicate", "dp_shard_cp"] if parallel_dims.dp_replicate_enabled else mesh["dp_shard_cp"]
    if device.type == "cuda":
        mp = MixedPrecisionPolicy(
            param_dtype=_DTYPES[job_config.training.mixed_precision_param],
            reduce_dtype=_DTYPES[job_config.training.mixed_precision_reduce],
        )
    else:
        mp = MixedPrecisionPolicy()  # fp32 on CPU / gloo
    replicated = fp32_param_names(model)
    ignored = {model.get_parameter(name) for name in replicated}
    for block in blocks(model):
        fully_shard(block, mesh=fsdp_mesh, mp_policy=mp, ignored_params=ignored & set(block.parameters()))
    fully_shard(model, mesh=fsdp_mesh, mp_policy=mp, ignored_params=ignored)
    # The loss is already normalised by the global labelled-token count, so gradients must be SUMMED over
    # data ranks (as sync_replicated_grads does for the fp32 params kept outside FSDP); FSDP2's default
    # averaging would scale the sharded gradients by 1/dp against the replicated ones.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            if not (
                hasattr(module, "set_gradient_divide_factor") and hasattr(module, "set_force_sum_reduction_for_comms")
            ):
                raise RuntimeError(
                    f"torch {torch.__version__}: FSDP2 lacks set_gradient_divide_factor / "
                    "set_force_sum_reduction_for_comms, which llm_training needs for summed gradients (torch >= 2.11)"
                )
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return ParallelizedModel(model, fsdp=True, replicated_param_names=replicated, grad_group=dist.group.WORLD)
