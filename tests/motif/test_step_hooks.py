"""Motif's per-step hooks: the statistics a forward yields, QK-clip from the reduced max logits, the expert-bias
update from the reduced token counts, the mHC schedule, and the metrics they report."""

import copy

import pytest
import torch

from llm_training.config import ConfigManager
from llm_training.layers.mhc.hyper_connections import MHC
from llm_training.motif import get_flavor
from llm_training.motif.model import Motif3Model
from llm_training.motif.step_hooks import MotifStepHooks, apply_qk_clip, attention_layers, expert_load_imbalance

ARGS = get_flavor("motif3_debug")


@pytest.fixture(scope="module")
def debug_model():
    torch.manual_seed(0)
    model = Motif3Model(ARGS, attention_backend="reference")
    model.init_weights()
    return model


def _hooks(model, *overrides):
    return MotifStepHooks(model, ARGS, ConfigManager().parse_args(list(overrides)))


def _ids():
    return torch.randint(0, ARGS.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))


def test_forward_stats_shapes_and_ops(debug_model):
    model = copy.deepcopy(debug_model)
    hooks = _hooks(model)  # qk_clip_threshold defaults to 100: recording on
    with torch.no_grad():
        stats = hooks.forward_stats(model(_ids()))
    n_moe = sum(1 for layer in model.layers if layer.moe is not None)
    assert stats["tokens_per_expert"].op == "sum" and stats["tokens_per_expert"].value.shape == (n_moe, 16)
    assert stats["tokens_per_expert"].value.sum(-1).tolist() == [2 * 32 * ARGS.experts_top_k] * n_moe
    n_attn = len(attention_layers(model))
    assert stats["max_logits"].op == "max" and stats["max_logits"].value.shape == (n_attn * 10,)
    off = _hooks(model, "--optimizer.qk_clip_threshold=0")
    with torch.no_grad():
        assert "max_logits" not in off.forward_stats(model(_ids()))


def test_after_step_applies_qk_clip_and_bias_update_only_when_applied(debug_model):
    model = copy.deepcopy(debug_model)
    attn = model.layers[0].self_attn
    attn.wq_b.weight.data.mul_(30.0)  # large logits so the clip has work to do
    hooks = _hooks(model)
    with torch.no_grad():
        stats = {k: v.value for k, v in hooks.forward_stats(model(_ids())).items()}
    before = stats["max_logits"][: attn.n_heads].clone()
    hooks.qk_clip_threshold = tau = float(before.median())
    wq, bias = attn.wq_b.weight.clone(), model.layers[2].moe.expert_bias.clone()

    skipped = hooks.after_step(stats, applied=False)  # a non-finite step: metrics only
    assert skipped["qk_clip_events"] == 0 and torch.equal(attn.wq_b.weight, wq)
    assert torch.equal(model.layers[2].moe.expert_bias, bias)
    assert skipped["expert_imbalance"] == expert_load_imbalance(stats["tokens_per_expert"])

    applied = hooks.after_step(stats, applied=True)
    over = before > tau
    assert applied["qk_clip_events"] >= int(over.sum()) > 0
    counts = stats["tokens_per_expert"][0]
    want = bias + ARGS.load_balance_coeff * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(model.layers[2].moe.expert_bias, want, rtol=0, atol=0)
    with torch.no_grad():  # layer 0's input does not depend on any clipped weight: its new max logits are exact
        after = hooks.forward_stats(model(_ids()))["max_logits"].value[: attn.n_heads]
    torch.testing.assert_close(after[over], torch.full_like(after[over], tau), rtol=1e-4, atol=0)
    torch.testing.assert_close(after[~over], before[~over], rtol=1e-4, atol=0)


def test_apply_qk_clip_uses_each_layers_slice(debug_model):
    model = copy.deepcopy(debug_model)
    layers = attention_layers(model)
    logits = torch.full((sum(m.n_heads for _, m in layers),), 1.0)
    logits[10 + 3] = 400.0  # the second layer's head 3 only
    summary = apply_qk_clip(layers, logits, 100.0)
    assert summary.num_clipped_heads == 1 and summary.per_layer[layers[1][0]].num_clipped_heads == 1
    assert summary.max_logit == 400.0


def test_begin_step_schedules_mhc_h_post():
    args = ARGS.replace(mhc_h_post_alpha_start=0.5, mhc_h_post_alpha_end=0.0)
    model = Motif3Model(args)
    hooks = MotifStepHooks(model, args, ConfigManager().parse_args([]))
    hooks.begin_step(0.25)
    assert {m.h_post_alpha for m in model.modules() if isinstance(m, MHC)} == {0.375}


def test_expert_load_imbalance_is_worst_layer_max_over_mean():
    layers = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 2.0, 2.0]])
    assert expert_load_imbalance(layers) == 2.0
    assert expert_load_imbalance(torch.zeros(1, 4)) is None
