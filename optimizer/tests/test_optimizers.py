"""OptimizersContainer.init_state / init_adamw_state: AdamW's state created before training equals what its first
step would have created, and training from it is bitwise the training from lazily created state (for each of torch's
AdamW implementations; the trainer builds the fused one). OptimizersContainer.step(grad_scale=s) equals scaling every
gradient by s and stepping."""

import copy

import pytest
import torch
from optimizer.optimizers import OptimizersContainer, init_adamw_state
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


IMPLS = ({"foreach": True}, {"foreach": False}, {"fused": True})


def _adamw(model: nn.Module, impl: dict) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, **impl)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(5, 8, generator=gen)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("impl", IMPLS, ids=lambda impl: next(iter(impl)) + str(next(iter(impl.values()))))
def test_init_adamw_state_is_the_zero_initial_state_and_changes_no_parameter(impl):
    model = _model()
    before = copy.deepcopy(model.state_dict())
    opt = _adamw(model, impl)
    init_adamw_state(opt)
    params = list(model.parameters())
    assert len(opt.state) == len(params)
    for p in params:
        state = opt.state[p]
        assert float(state["step"]) == 0.0
        assert torch.count_nonzero(state["exp_avg"]) == 0 and torch.count_nonzero(state["exp_avg_sq"]) == 0
        assert state["exp_avg"].shape == p.shape and p.grad is None
    assert [g["lr"] for g in opt.param_groups] == [3e-3, 3e-3]
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


@pytest.mark.parametrize("impl", IMPLS, ids=lambda impl: next(iter(impl)) + str(next(iter(impl.values()))))
def test_training_from_the_early_state_is_bitwise_the_lazy_one(impl):
    lazy_model = _model()
    early_model = copy.deepcopy(lazy_model)
    lazy, early = _adamw(lazy_model, impl), _adamw(early_model, impl)
    init_adamw_state(early)
    _train(lazy_model, lazy, 3)
    _train(early_model, early, 3)
    for (name, a), b in zip(lazy_model.state_dict().items(), early_model.state_dict().values()):
        assert torch.equal(a, b), name
    for p_lazy, p_early in zip(lazy_model.parameters(), early_model.parameters()):
        assert float(lazy.state[p_lazy]["step"]) == float(early.state[p_early]["step"]) == 3.0
        assert torch.equal(lazy.state[p_lazy]["exp_avg_sq"], early.state[p_early]["exp_avg_sq"])


def test_init_adamw_state_leaves_an_optimizer_with_state_or_gradients_alone():
    model = _model()
    opt = _adamw(model, {"fused": True})
    _train(model, opt, 1)
    steps = {id(p): float(s["step"]) for p, s in opt.state.items()}
    init_adamw_state(opt)  # already has state: no step, counters kept
    assert {id(p): float(s["step"]) for p, s in opt.state.items()} == steps

    fresh_model = _model()
    fresh = _adamw(fresh_model, {"fused": True})
    fresh_model(torch.randn(2, 8)).sum().backward()  # gradients of a real micro-batch are never replaced
    init_adamw_state(fresh)
    assert not fresh.state and all(p.grad is not None for p in fresh_model.parameters())


def test_container_init_state_is_idempotent():
    model = _model()
    container = OptimizersContainer(model, None, _adamw(model, {"fused": True}), grouping=None)
    container.init_state()
    moments = {p: s["exp_avg"] for p, s in container.adamw.state.items()}
    container.init_state()
    assert container.adamw.state.keys() == moments.keys()
    assert all(s["exp_avg"] is moments[p] for p, s in container.adamw.state.items())  # the same tensors, kept


@pytest.mark.parametrize("grad_scale", [1.0, 0.3])
def test_container_step_with_grad_scale_equals_scaled_gradients(grad_scale):
    """`step(grad_scale=s)` (how the trainer clips) equals multiplying every gradient by s and stepping: Muon (its
    momentum pass scales them: bitwise on CPU, where it scales a copy the same way) and the fused AdamW (which
    divides by 1/s: the rounding of 1/s and of the division, a few fp32 ulp of a gradient, reaches a parameter as at
    most ~lr * 1e-6 through Adam's normalised step, so rtol 1e-6 / atol 1e-8). Muon leaves its gradients as they
    are; the fused AdamW stores them divided (torch's grad_scale contract)."""
    from optimizer import GroupRule, build_optimizers

    rules = [GroupRule(r"^0\.weight$", "muon"), GroupRule(r"weight$", "adamw_decay"), GroupRule(r"", "adamw_no_decay")]

    def run(scale_in_step: bool):
        model = _model()
        opts = build_optimizers(model, rules, lr=3e-3, weight_decay=0.1, log=None)
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            model(torch.randn(5, 8, generator=gen)).square().mean().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            if scale_in_step:
                opts.step(grad_scale=grad_scale)
            else:
                for p in model.parameters():
                    p.grad.mul_(grad_scale)
                opts.step()
            after = {n: p.grad for n, p in model.named_parameters()}
            opts.zero_grad()
        return model, opts, grads, after

    model, opts, grads, after = run(scale_in_step=True)
    ref_model, ref_opts, _, _ = run(scale_in_step=False)
    assert opts.muon is not None and opts.adamw is not None and opts.adamw.defaults["fused"]
    assert not hasattr(opts.adamw, "grad_scale")  # the divisor lives for one step only
    assert torch.equal(after["0.weight"], grads["0.weight"])  # Muon: the gradient as it was
    torch.testing.assert_close(after["2.weight"], grads["2.weight"] * grad_scale, rtol=1e-6, atol=0)  # fused AdamW
    muon_param = dict(model.named_parameters())["0.weight"]
    ref_muon_param = dict(ref_model.named_parameters())["0.weight"]
    assert torch.equal(muon_param, ref_muon_param)
    assert torch.equal(
        opts.muon.state[muon_param]["momentum_buffer"], ref_opts.muon.state[ref_muon_param]["momentum_buffer"]
    )
    for (name, p), ref in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-8, msg=name)
