"""Muon + AdamW behind one object: build both from grouping rules, step / zero_grad them together, and
save / load their state as one flat, FQN-keyed, DCP-friendly dict.

The state dict uses `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` with
`flatten_optimizer_state_dict=True` per optimizer and merges the results (keys such as
`state.<fqn>.momentum_buffer`, `param_groups.<fqn>.lr`); the two optimizers own disjoint parameters, so the
keys never collide, and loading hands the merged dict to each optimizer, which picks its own FQNs.
(Design follows torchtitan's OptimizersContainer.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from optimizer._dtensor import is_dtensor
from optimizer.grouping import GroupRule, ParamGrouping, group_parameters
from optimizer.muon import Muon

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class OptimizersContainer:
    """Holds `muon` (None when everything is AdamW) and `adamw` for one model."""

    def __init__(
        self, model: nn.Module, muon: Muon | None, adamw: torch.optim.Optimizer | None, grouping: ParamGrouping
    ):
        self.model = model
        self.muon = muon
        self.adamw = adamw
        self.grouping = grouping
        self.optimizers: list[torch.optim.Optimizer] = [o for o in (muon, adamw) if o is not None]

    def step(self, grad_scale: float = 1.0) -> None:
        """Step both optimizers, every gradient counted multiplied by `grad_scale` (the trainer's clipping
        coefficient, at most 1). Each optimizer applies it in its own pass over the gradients, so clipping costs no
        pass of its own: Muon in its momentum kernel, the fused AdamW as its `grad_scale` divisor (torch.optim's
        hook for GradScaler's unscaling; the fused kernel divides each gradient by it, in place)."""
        if self.muon is not None:
            self.muon.step(grad_scale=grad_scale)
        if self.adamw is not None:
            if grad_scale != 1.0:
                device = self.adamw.param_groups[0]["params"][0].device
                self.adamw.grad_scale = torch.full((), 1.0 / grad_scale, dtype=torch.float32, device=device)
            try:
                self.adamw.step()
            finally:
                self.adamw.__dict__.pop("grad_scale", None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def init_state(self) -> None:
        """Create every optimizer state tensor now, as its zero initial value, instead of in the first step.

        torch.optim creates AdamW's moments in its first `step()`, after the first step's forward and backward,
        where they land in the holes the freed activations left in the CUDA caching allocator. Created before
        training, the long-lived state sits beside the parameters, and a run that does not fit fails at startup
        rather than after its first (compiling) step: on one H200, motif3_proxy's first step now holds the whole
        state and reserves 108.6 GiB at its 105.0 GiB allocated peak (it used to reach that peak only in the
        second step). The values are exactly those of the lazy creation; calling this again is a no-op."""
        if self.muon is not None:
            self.muon.init_state()
        if self.adamw is not None:
            init_adamw_state(self.adamw)

    def state_dict(self) -> dict:
        self.init_state()  # cheap; spares DCP's warm-up step (a zero-grad step that leaves AdamW's step at 1)
        merged: dict = {}
        for opt in self.optimizers:
            merged.update(get_optimizer_state_dict(self.model, opt, options=_FLAT))
        return merged

    def load_state_dict(self, state_dict: dict) -> None:
        self.init_state()
        for opt in self.optimizers:
            set_optimizer_state_dict(self.model, opt, optim_state_dict=state_dict, options=_FLAT)


@torch.no_grad()
def init_adamw_state(adamw: torch.optim.Optimizer) -> None:
    """Make `adamw` (a torch.optim.AdamW without state) create its state now: one step over zero gradients at
    learning rate 0, then its step counters back to 0. Over zero gradients both moments stay exactly 0 and, at
    learning rate 0, neither the update nor the decoupled weight decay changes a parameter (p * (1 - 0 * wd),
    p - 0 * 0 / (0 + eps)), so the state equals what the first real step would have created, through torch's own
    code path (foreach or fused, plain or DTensor). Parameters that already have a gradient, or any state, leave
    the optimizer untouched."""
    params = [p for group in adamw.param_groups for p in group["params"] if p.requires_grad]
    if adamw.state or not params or any(p.grad is not None for p in params):
        return
    lrs = [group["lr"] for group in adamw.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in adamw.param_groups:
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        adamw.step()
    finally:
        for group, lr in zip(adamw.param_groups, lrs):
            group["lr"] = lr
        for p in params:
            p.grad = None
    for state in adamw.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            state["step"] = 0


def _adamw(groups: list[dict], lr: float, betas, eps: float, device: torch.device) -> torch.optim.AdamW:
    # torch's fused kernel on every device (CUDA and CPU, DTensor-aware): one pass per tensor list, and the one
    # implementation that takes the clipping coefficient as its grad_scale (`OptimizersContainer.step`). Except on
    # the meta device (llm_training's dry run builds the optimizers there to count their state), which torch's
    # fused check refuses; a meta optimizer never steps.
    impl = {} if device.type == "meta" else {"fused": True}
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, **impl)


def build_optimizers(
    model: nn.Module,
    rules: list[GroupRule],
    *,
    lr: float,
    weight_decay: float,
    use_muon: bool = True,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    adamw_betas: Iterable[float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    forbidden: Iterable[str] = (),
    ns_dtype: torch.dtype | None = None,
    comm_dtype: torch.dtype | None = None,
    muon_momentum_dtype: torch.dtype | None = None,
    log: Callable[[str], None] | None = print,
) -> OptimizersContainer:
    """Group `model.named_parameters()` by `rules` and build Muon (muon group) + AdamW (the rest) with one
    lr and weight decay (Muon's Moonlight scaling makes them shareable). `use_muon=False` sends the muon
    group to AdamW with decay (the AdamW baseline). Prints the grouping table via `log`."""
    grouping = group_parameters(model.named_parameters(), rules, forbidden)
    if not use_muon:
        grouping.groups["adamw_decay"] = grouping.groups["adamw_decay"] + grouping.groups["muon"]
        grouping.groups["muon"] = []
    if log is not None:
        log("optimizer parameter groups:\n" + grouping.table())
    muon = None
    if grouping.groups["muon"]:
        muon = Muon(
            grouping.muon_param_groups(),
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            comm_dtype=comm_dtype,
            momentum_dtype=muon_momentum_dtype,
        )
    # One AdamW group per (decay, DTensor or plain): foreach / fused kernels refuse a list that mixes
    # DTensors with plain tensors (FSDP2 with ignored_params, e.g. replicated fp32 router / mHC weights).
    adamw_groups = []
    for name, wd in (("adamw_decay", weight_decay), ("adamw_no_decay", 0.0)):
        for want_dtensor in (True, False):
            params = [p for _, p, _ in grouping.groups[name] if is_dtensor(p) == want_dtensor]
            if params:
                adamw_groups.append({"params": params, "weight_decay": wd})
    adamw = None
    if adamw_groups:
        adamw = _adamw(adamw_groups, lr, adamw_betas, adamw_eps, adamw_groups[0]["params"][0].device)
    return OptimizersContainer(model, muon, adamw, grouping)
