"""Dense PolyNorm MLP (docs/model-spec.md §1.1): down( s * PolyNorm(clamp(gate x)) * clamp(up x) ).

Used by the first dense layers, the MoE shared expert and the MTP block. `hidden_clamp` bounds the
gate/up pre-activations; as in Motif's vLLM (docs/model-spec.md §0.2) only the shared expert passes one (1e6 for
Motif-3, i.e. effectively off), the dense and MTP MLPs are not clamped. The PolyNorm bias is never clamped
here (only the routed experts clamp it).
"""

from __future__ import annotations

import torch
from torch import nn

from llm_training.layers.norms import PolyNorm


class FeedForward(nn.Module):
    """gate_proj/up_proj [I, H], down_proj [H, I], act_fn = PolyNorm (weight [3], bias [1], fp32)."""

    def __init__(self, hidden_size: int, intermediate_size: int, args, hidden_clamp: float | None = None):
        super().__init__()
        self.hidden_clamp = hidden_clamp  # None: no clamp
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = PolyNorm(
            args.polynorm_init_weight, args.polynorm_eps, args.polynorm_sigmoid_weight, args.polynorm_output_scale
        )

    def init_weights(self, init_std: float) -> None:
        for linear in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(linear.weight, mean=0.0, std=init_std)
        self.act_fn.init_weights()

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x_BSH), self.up_proj(x_BSH)
        if self.hidden_clamp is not None:
            c = self.hidden_clamp
            gate, up = gate.clamp(-c, c), up.clamp(-c, c)
        return self.down_proj(self.act_fn(gate, up))
