"""MOTIF3_SPEC: the Motif-3 family as the trainer sees it (`llm_training.model_spec.ModelSpec`)."""

from __future__ import annotations

from llm_training.model_spec import ModelSpec, StateDictAdapter
from llm_training.motif import get_flavor, param_counts, training_flops_per_token
from llm_training.motif.activation_memory import estimate_activation_memory
from llm_training.motif.model import Motif3Model
from llm_training.motif.mtp import mtp_inputs
from llm_training.motif.optimizer_groups import motif_optimizer_rules
from llm_training.motif.parallelize import parallelize_motif
from llm_training.motif.state_dict_adapter import (
    export_hf_checkpoint,
    load_hf_checkpoint,
    run_hf_config,
)
from llm_training.motif.step_hooks import MotifStepHooks


def build_motif3(model_args, job_config) -> Motif3Model:
    """A Motif3Model for `model_args` with the configured attention backend and mHC backward, on the current default device
    (meta for the sharded build; parameters are initialised later by `init_weights`)."""
    k = job_config.kernels
    return Motif3Model(model_args, attention_backend=k.attention, mhc_backward=k.mhc_backward)


MOTIF3_SPEC = ModelSpec(
    name="motif3",
    get_flavor=get_flavor,
    build_model=build_motif3,
    parallelize=parallelize_motif,
    optimizer_rules=motif_optimizer_rules,
    state_dict_adapter=StateDictAdapter(run_hf_config, load_hf_checkpoint, export_hf_checkpoint),
    build_step_hooks=MotifStepHooks,
    head_weight=lambda model: model.lm_head.weight,
    num_mtp_modules=lambda model_args: model_args.num_nextn_predict_layers,
    mtp_inputs=mtp_inputs,
    flops_per_token=training_flops_per_token,
    param_counts=param_counts,
    activation_memory=estimate_activation_memory,
)
