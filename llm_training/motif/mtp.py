"""Multi-token prediction module (docs/model-spec.md §7 and the §0.1 "MTP wiring").

Module k (0-based) at position i predicts t_{i+k+2}:
    x = input_proj([h ; embed_norm(embed(t_{i+k+1}))])     h: final_norm(main hidden) for k = 0
    x = x + self_attn(input_layernorm(x))                  GDLA, always sliding window, swa RoPE, no YaRN
    x = x + mlp(post_attention_layernorm(x))               dense PolyNorm MLP of width intermediate_size
    out = final_layernorm(x)                               -> the shared lm_head
No mHC, no MoE, no norm on the incoming hidden. For k > 0 the incoming hidden is module k-1's `out`
(DeepSeek-V3 chains modules; feeding the normed output keeps every module's input on the same scale as
module 0's post-norm input — a choice, see docs/model-choices.md).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from llm_training.layers.attention.gdla import GDLAttention
from llm_training.layers.attention.backends import AttentionMetadata
from llm_training.layers.ffn import FeedForward
from llm_training.layers.norms import RMSNorm
from llm_training.layers.attention.rope import RotaryEmbedding


class MTPModule(nn.Module):
    def __init__(self, args, rope_sliding: RotaryEmbedding, attention_backend: str = "auto"):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.init_std = args.initializer_range
        self.embed_norm = RMSNorm(H, eps)
        self.input_proj = nn.Linear(2 * H, H, bias=False)
        self.input_layernorm = RMSNorm(H, eps)
        # Sliding layers never get the YaRN mscale^2 (§0.1), so the scale is the plain head_dim^-0.5.
        self.self_attn = GDLAttention(
            args,
            sliding=True,
            softmax_scale=args.head_dim**-0.5,
            rope=rope_sliding,
            attention_backend=attention_backend,
        )
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = FeedForward(H, args.intermediate_size, args)
        self.final_layernorm = RMSNorm(H, eps)

    def init_weights(self) -> None:
        self.embed_norm.init_weights()
        nn.init.normal_(self.input_proj.weight, mean=0.0, std=self.init_std)
        self.input_layernorm.init_weights()
        self.self_attn.init_weights()
        self.post_attention_layernorm.init_weights()
        self.mlp.init_weights(self.init_std)
        self.final_layernorm.init_weights()

    def forward(
        self,
        hidden_BSH: torch.Tensor,
        embedded_BSH: torch.Tensor,
        position_ids_BS: torch.Tensor,
        metadata: Optional[AttentionMetadata] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """hidden: the previous hidden at position i; embedded: embed(t_{i+k+1}). Returns (final-normed [B, S, H],
        the attention's max logits fp32 [n_h] when recording, else None)."""
        x = self.input_proj(torch.cat([hidden_BSH, self.embed_norm(embedded_BSH)], dim=-1))
        y, max_logits = self.self_attn(self.input_layernorm(x), position_ids_BS, metadata)
        x = x + y
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.final_layernorm(x), max_logits


def mtp_inputs(input_ids_BS: torch.Tensor, num_mtp: int) -> list[torch.Tensor]:
    """The token ids MTP module k (0-based) embeds at position i: t_{i+k+1}, [B, S] each. The last k+1
    positions have no such token (and no target); they repeat the row's last id (any valid id would do)."""
    B, S = input_ids_BS.shape
    out = []
    for k in range(num_mtp):
        shift = k + 1
        tail = input_ids_BS[:, -1:].expand(B, min(shift, S))
        out.append(torch.cat([input_ids_BS[:, shift:], tail], dim=1)[:, :S])
    return out
