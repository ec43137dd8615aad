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


def _momentum_buffers(container) -> dict[int, torch.Tensor]:
    return {id(p): s["momentum_buffer"] for p, s in container.muon.state.items()}


def test_bf16_muon_momentum_from_the_config_and_across_a_resume(debug_model):
    """[optimizer] muon_momentum_dtype = bfloat16 gives bf16 momentum buffers (fp32 parameters); a state saved with
    fp32 momentum loads into it through the DCP state-dict path as bf16 (rounded), and the step after matches."""
    model32, model16 = copy.deepcopy(debug_model), copy.deepcopy(debug_model)
    opt32 = build_optimizers(model32, _config())
    _fake_grads(model32, 0)
    opt32.step()
    assert {b.dtype for b in _momentum_buffers(opt32).values()} == {torch.float32}

    opt16 = build_optimizers(model16, _config("--optimizer.muon_momentum_dtype=bfloat16"))
    model16.load_state_dict(model32.state_dict())
    opt16.load_state_dict(copy.deepcopy(opt32.state_dict()))
    by_name32 = {
        n: opt32.muon.state[p]["momentum_buffer"] for n, p in model32.named_parameters() if p in opt32.muon.state
    }
    for name, p in model16.named_parameters():
        if name in by_name32:
            buf = opt16.muon.state[p]["momentum_buffer"]
            assert buf.dtype == torch.bfloat16 and torch.equal(buf, by_name32[name].bfloat16()), name
    before = {n: p.detach().clone() for n, p in model32.named_parameters()}
    for m, o in ((model32, opt32), (model16, opt16)):
        _fake_grads(m, 1)
        o.step()
    assert {b.dtype for b in _momentum_buffers(opt16).values()} == {torch.bfloat16}
    for (name, a), b in zip(model32.named_parameters(), model16.parameters()):
        assert b.dtype == torch.float32
        step32, step16 = a.detach() - before[name], b.detach() - before[name]
        if name in by_name32:  # the Muon update from a bf16-rounded momentum: within 1e-2 (measured ~1.5e-3)
            assert float((step16 - step32).norm() / step32.norm()) < 1e-2, name
        else:  # AdamW's parameters take the same step
            torch.testing.assert_close(step16, step32, rtol=0, atol=0, msg=lambda msg: f"{name}: {msg}")
