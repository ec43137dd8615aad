"""Optimizer glue: Motif's grouping of the real model (the spec's rules), build_optimizers from a JobConfig, and a
DCP-style state dict round trip (optimizers + scheduler)."""

import copy

import pytest
import torch
from torch import nn

from llm_training.config import ConfigManager
from llm_training.motif import get_flavor
from llm_training.motif.model import Motif3Model
from llm_training.motif.optimizer_groups import motif_optimizer_rules
from llm_training.trainer.optim import build_optimizers as _build_optimizers


@pytest.fixture(scope="module")
def debug_model():
    torch.manual_seed(0)
    model = Motif3Model(get_flavor("motif3_debug"), attention_backend="reference")
    model.init_weights()
    return model


def _config(*overrides):
    return ConfigManager().parse_args(list(overrides))


def build_optimizers(model, job_config):
    """The trainer's call: the generic builder with Motif's grouping rules for this [optimizer] section."""
    return _build_optimizers(model, job_config, *motif_optimizer_rules(job_config.optimizer))


def _group_of(container):
    return {name: g for g, items in container.grouping.groups.items() for name, _, _ in items}


def test_motif_grouping(debug_model):
    groups = _group_of(build_optimizers(debug_model, _config()))
    trainable = {n for n, p in debug_model.named_parameters() if p.requires_grad}
    assert set(groups) == trainable  # every parameter lands in exactly one group
    expected = {
        "layers.0.self_attn.wq_b.weight": "muon",
        "layers.0.self_attn.wkv_a.weight": "muon",
        "layers.0.self_attn.wq_b_gate.weight": "muon",
        "layers.0.mlp.down_proj.weight": "muon",
        "layers.2.moe.experts.gate_up_proj": "muon",
        "layers.2.moe.experts.down_proj": "muon",
        "layers.2.moe.shared_experts.up_proj.weight": "muon",
        "mtp_layers.0.input_proj.weight": "muon",
        "mtp_layers.0.self_attn.wo.weight": "muon",
        "embed_tokens.weight": "adamw_decay",
        "lm_head.weight": "adamw_decay",
        "layers.2.moe.router.gate.weight": "adamw_decay",
        "layers.0.mhc_attn.proj_res.weight": "adamw_decay",
        "layers.0.self_attn.lambda_proj.weight": "adamw_decay",
        "norm.weight": "adamw_no_decay",
        "layers.0.self_attn.kv_norm.weight": "adamw_no_decay",
        "layers.2.moe.experts.act_fn.weight": "adamw_no_decay",
        "layers.0.mlp.act_fn.bias": "adamw_no_decay",
        "layers.0.mhc_ffn.alpha_res": "adamw_no_decay",
        "layers.0.mhc_ffn.bias_res": "adamw_no_decay",
        "layers.0.mhc_ffn.norm.weight": "adamw_no_decay",
        "mtp_layers.0.embed_norm.weight": "adamw_no_decay",
    }
    assert {k: groups[k] for k in expected} == expected
    assert all("expert_bias" not in n for n in groups)
    # the gate_up stack is orthogonalised in two halves
    container = build_optimizers(debug_model, _config())
    split2 = [g for g in container.muon.param_groups if g["row_split"] == 2][0]["params"]
    assert {id(p) for p in split2} == {id(m.gate_up_proj) for m in debug_model.modules() if hasattr(m, "gate_up_proj")}


def test_flags_and_adamw_baseline(debug_model):
    flipped = _group_of(
        build_optimizers(
            debug_model,
            _config(
                "--optimizer.router_in_muon",
                "true",
                "--optimizer.mhc_proj_in_muon",
                "true",
                "--optimizer.lambda_in_muon",
                "true",
            ),
        )
    )
    for name in (
        "layers.2.moe.router.gate.weight",
        "layers.0.mhc_attn.proj_pre.weight",
        "layers.0.self_attn.lambda_proj.weight",
    ):
        assert flipped[name] == "muon"
    adamw = build_optimizers(debug_model, _config("--optimizer.name", "adamw"))
    assert adamw.muon is None and isinstance(adamw.adamw, torch.optim.AdamW)
    wd = {id(p): g["weight_decay"] for g in adamw.adamw.param_groups for p in g["params"]}
    assert wd[id(debug_model.layers[0].self_attn.wq_b.weight)] == pytest.approx(0.1)
    assert wd[id(debug_model.norm.weight)] == 0.0


def test_expert_bias_parameter_is_rejected():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = nn.Module()
            self.moe.expert_bias = nn.Parameter(torch.zeros(4))

    with pytest.raises(ValueError, match="expert_bias"):
        build_optimizers(Bad(), _config())


def _fake_grads(model, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-2


def test_state_dict_round_trip(debug_model):
    cfg = _config("--lr_scheduler.warmup_steps", "2", "--training.steps", "10")
    model = copy.deepcopy(debug_model)
    opt = build_optimizers(model, cfg)
    for seed in range(3):
        _fake_grads(model, seed)
        opt.step()
        opt.lr_scheduler.step()
    optim_sd, sched_sd = opt.state_dict(), opt.lr_scheduler.state_dict()
    assert any(k.endswith("momentum_buffer") for k in optim_sd) and any(k.endswith("exp_avg_sq") for k in optim_sd)

    resumed = copy.deepcopy(model)
    opt2 = build_optimizers(resumed, cfg)
    opt2.load_state_dict(copy.deepcopy(optim_sd))  # a save/load gives fresh tensors (the dict aliases opt's state)
    opt2.lr_scheduler.load_state_dict(sched_sd)
    assert opt2.lr_scheduler.get_last_lr() == pytest.approx(opt.lr_scheduler.get_last_lr())
    for m, o in ((model, opt), (resumed, opt2)):
        _fake_grads(m, 99)
        o.step()
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda msg: f"{name}: {msg}")
