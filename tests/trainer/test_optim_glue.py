"""Motif optimizer glue: grouping of the real model, build_optimizers from a JobConfig, DCP-style state dict
round trip (optimizers + scheduler), and model-level QK-clip through `attn.max_logits`."""

import copy

import pytest
import torch
from torch import nn

from llm_training.config import ConfigManager
from llm_training.motif import get_flavor
from llm_training.motif.model import Motif3Model
from llm_training.trainer.optim import apply_qk_clip, build_optimizers


@pytest.fixture(scope="module")
def debug_model():
    torch.manual_seed(0)
    model = Motif3Model(get_flavor("motif3_debug"), attention_backend="reference")
    model.init_weights()
    return model


def _config(*overrides):
    return ConfigManager().parse_args(list(overrides))


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


def _layer0_max_logits(model, input_ids):
    model(input_ids)
    return model.layers[0].self_attn.max_logits.clone()


def test_model_level_qk_clip(debug_model):
    model = copy.deepcopy(debug_model)
    attn = model.layers[0].self_attn
    attn.wq_b.weight.data.mul_(30.0)  # large logits so the clip has work to do
    model.set_record_max_logits(True)
    input_ids = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = _layer0_max_logits(model, input_ids)
        tau = float(before.median())
        over = before > tau
        wq_before, wkv_before = attn.wq_b.weight.clone(), attn.wkv_b.weight.clone()
        summary = apply_qk_clip(model, tau)
        assert summary.per_layer["layers.0.self_attn"].num_clipped_heads == int(over.sum()) > 0
        assert summary.num_clipped_heads >= int(over.sum())
        # layer 0's input does not depend on any clipped weight, so its new logits are exactly predictable
        after = _layer0_max_logits(model, input_ids)
    torch.testing.assert_close(after[over], torch.full_like(after[over], tau), rtol=1e-4, atol=0)
    torch.testing.assert_close(after[~over], before[~over], rtol=1e-4, atol=0)
    assert torch.equal(attn.wkv_b.weight[-attn.d_v :], wkv_before[-attn.d_v :])  # value rows untouched
    assert not torch.equal(attn.wq_b.weight, wq_before)


class _TinyAttention(nn.Module):
    """Carries the attributes apply_qk_clip reads from GDLAttention (layout, wq_b, wkv_b, max_logits)."""

    def __init__(self):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.d_nope, self.d_rope, self.d_v = 4, 2, 3, 2, 2
        gen = torch.Generator().manual_seed(0)
        self.wq_b = nn.Linear(6, 4 * 5, bias=False)
        self.wkv_b = nn.Linear(5, 2 * 5, bias=False)
        with torch.no_grad():
            self.wq_b.weight.copy_(torch.randn(20, 6, generator=gen))
            self.wkv_b.weight.copy_(torch.randn(10, 5, generator=gen))
        self.max_logits = None


def _qk_worker(rank, world, port, expected_q, expected_kv):
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = nn.Sequential(_TinyAttention())
        logits = torch.full((4,), 10.0)
        logits[rank] = 400.0 + 100 * rank  # each rank saw a different head blow up
        model[0].max_logits = logits
        summary = apply_qk_clip(model, 100.0, dist.group.WORLD)
        assert summary.num_clipped_heads == 2 and summary.max_logit == 500.0
        torch.testing.assert_close(model[0].wq_b.weight, expected_q, rtol=0, atol=0)
        torch.testing.assert_close(model[0].wkv_b.weight, expected_kv, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


def test_qk_clip_reduces_max_logits_over_data_ranks(free_port):
    import torch.multiprocessing as mp

    from optimizer import QKLayout, qk_clip_

    ref = _TinyAttention()
    qk_clip_(ref.wq_b.weight.data, ref.wkv_b.weight.data, torch.tensor([400.0, 500.0, 10.0, 10.0]),
             QKLayout(4, 2, 3, 2, 2), 100.0)  # fmt: skip
    port = free_port
    args = (2, port, ref.wq_b.weight.detach(), ref.wkv_b.weight.detach())
    mp.start_processes(_qk_worker, args=args, nprocs=2, join=True, start_method="fork")
