"""Normalisation modules (parameters only; the math is the `activation` package's, fp32 inside).

RMSNorm: gain `weight [D]`. PolyNorm: raw weights `weight [3]` and `bias [1]`, kept fp32 (docs/model-spec.md §1.1).
GroupedPolyNorm: per-expert `weight [E, 3]`, `bias [E, 1]` for the routed experts.
"""

from __future__ import annotations

import torch
from torch import nn

from activation import fused_mul_poly_norm, grouped_poly_norm, rms_norm

from llm_training.dtensor_views import local_tensor


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32, returned in x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class PolyNorm(nn.Module):
    """PolyNorm gate activation fused with the up-projection product (FusedMulPolyNorm, §1.1):
    `(PolyNorm(gate) * up)` in fp32, cast to gate's dtype, times `output_scale`."""

    def __init__(self, init_weight: float, eps: float, sigmoid_weight: bool, output_scale: float):
        super().__init__()
        self.init_weight, self.eps = init_weight, eps
        self.sigmoid_weight, self.output_scale = sigmoid_weight, output_scale
        self.weight = nn.Parameter(torch.empty(3, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def init_weights(self) -> None:
        nn.init.constant_(self.weight, self.init_weight)
        nn.init.zeros_(self.bias)

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return fused_mul_poly_norm(
            gate,
            up,
            self.weight.float(),
            self.bias.float(),
            eps=self.eps,
            sigmoid_weight=self.sigmoid_weight,
            output_scale=self.output_scale,
        )


class GroupedPolyNorm(nn.Module):
    """Per-expert PolyNorm fused with the up product, for rows sorted by expert (`offs` = cumulative
    row ends, int32). The routed experts' bias is clamped to +-bias_clamp in the forward."""

    def __init__(
        self,
        num_experts: int,
        init_weight: float,
        eps: float,
        sigmoid_weight: bool,
        output_scale: float,
        bias_clamp: float | None,
    ):
        super().__init__()
        self.init_weight, self.eps = init_weight, eps
        self.sigmoid_weight, self.output_scale, self.bias_clamp = sigmoid_weight, output_scale, bias_clamp
        self.weight = nn.Parameter(torch.empty(num_experts, 3, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(num_experts, 1, dtype=torch.float32))

    def init_weights(self) -> None:
        nn.init.constant_(self.weight, self.init_weight)
        nn.init.zeros_(self.bias)

    def forward(self, gate_NI: torch.Tensor, up_NI: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        return grouped_poly_norm(
            gate_NI,
            local_tensor(self.weight).float(),  # EP: this rank's experts
            local_tensor(self.bias).float(),
            offs_E,
            eps=self.eps,
            sigmoid_weight=self.sigmoid_weight,
            bias_clamp=self.bias_clamp,
            up=up_NI,
            output_scale=self.output_scale,
        )
