"""Weight holders that are deliberately NOT `nn.Linear`.

Module-swapping converters (FP8 / MXFP8, `llm_training.quantization`) replace `nn.Linear` modules. Some
projections must never be converted, and some weights are never run through their module's forward (the
chunked loss multiplies `lm_head.weight` itself), so a swap would silently miss them or change their numerics.
Each such weight lives in one of these classes instead, with the same parameter name (`<module>.weight`),
so checkpoints and optimizer rules are unaffected:

  * `Fp32Projection`: a bias-free projection computed in fp32 whatever the weight's or input's dtype (router
    gate, GDLA lambda_proj, mHC proj_pre / proj_post / proj_res; model-spec §6, §2.4, §4.2).
  * `OutputHead`: the vocabulary projection; its weight is read directly by the fused/chunked loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Fp32Projection(nn.Module):
    """y = x W^T with x and W upcast to fp32 (fp32 output). weight [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, compute=fp32"


class OutputHead(nn.Module):
    """Logits = hidden W^T in the hidden's dtype. weight [vocab_size, hidden_size]; training reads it directly
    (the chunked / fused cross-entropy never materialises the logits)."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}"
