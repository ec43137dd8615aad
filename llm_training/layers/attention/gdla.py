"""GDLA: Grouped Differential Latent Attention (docs/model-spec.md §2.4, §0.1).

MLA-style Q-LoRA / KV-LoRA with a decoupled RoPE key, GQA-shaped K/V, and a grouped differential
combination: query heads come in groups of [r signal + 1 noise] (r = args.signal_per_noise); query head h
uses KV head h // (n_h / n_kv); per group, out_signal_j - lambda_j * out_noise with a per-token,
per-signal-head lambda = sigmoid(x W_lambda^T) computed in fp32; then an element-wise output gate
sigmoid(wq_b_gate(c_Q)) and `wo` from n_sig * d_v. No per-head norm after the subtraction.

The softmax kernel is pluggable (`attention_backends.py`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from llm_training.autograd_output import function_output
from llm_training.layers.attention.backends import (
    AttentionMetadata,
    build_attention_metadata,
    get_attention_backend,
    runs_fa4,
)
from llm_training.layers.attention.fa4 import keep_slot_tensor
from llm_training.layers.attention.masks import window_tensor
from llm_training.layers.norms import RMSNorm
from llm_training.layers.projection import Fp32Projection
from llm_training.layers.attention.rope import RotaryEmbedding, apply_rope_interleaved


class GDLAttention(nn.Module):
    """One GDLA layer. `sliding` selects the window (args.sliding_window) vs causal full attention; the
    caller passes the matching RoPE table and softmax scale (args.softmax_scale for the trunk).
    forward(x, position_ids, metadata) -> (y [B, S, H], max_logits: fp32 [n_h] when `record_max_logits`, else
    None). The max logits are an output, never module state: an attribute set inside a compiled,
    activation-checkpointed block is a side effect dynamo cannot keep in the checkpoint's graph, so it breaks the
    graph and runs the whole block eagerly (tests/distributed/test_compile.py)."""

    def __init__(
        self, args, *, sliding: bool, softmax_scale: float, rope: RotaryEmbedding, attention_backend: str = "auto"
    ):
        super().__init__()
        H = args.hidden_size
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.n_noise, self.r = args.num_noise_heads, args.signal_per_noise
        self.n_sig = args.num_signal_heads
        self.d_nope, self.d_rope, self.d_v = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.window: Optional[int] = args.sliding_window if sliding else None
        # the same window in the tensor form that flash-attn-4's ops read when they run (`masks.window_tensor`):
        # a plain attribute on the CPU (no buffer: it follows no .to() and is no checkpoint state)
        self.window_tensor = window_tensor(self.window)
        # flash-attn-4's keep slot (`keep_output_across_recompute`), and the no-keep form that no-grad forwards pass
        # (nothing recomputes them): CPU scalars like the window, so one compiled graph serves every layer
        self.keep_slot = self.no_keep_slot = keep_slot_tensor(None)
        self.softmax_scale = softmax_scale
        self.rope = rope
        self.attention_backend = attention_backend
        self.kernel = get_attention_backend(attention_backend).kernel
        self.init_std, self.lambda_init, self.gate_init = args.initializer_range, args.lambda_init, args.gate_init
        self.record_max_logits = False

        self.wq_a = nn.Linear(H, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * (self.d_nope + self.d_rope), bias=False)
        self.wq_b_gate = (
            nn.Linear(args.q_lora_rank, self.n_sig * self.d_v, bias=False)
            if args.elementwise_attn_output_gate
            else None
        )
        self.wkv_a = nn.Linear(H, self.kv_lora_rank + self.d_rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, args.rms_norm_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, self.n_kv_heads * (self.d_nope + self.d_v), bias=False)
        self.lambda_proj = Fp32Projection(H, self.n_sig)
        self.wo = nn.Linear(self.n_sig * self.d_v, H, bias=False)

    def keep_output_across_recompute(self, slot: int) -> None:
        """Have flash-attn-4 keep this layer's forward result (out, lse) under `slot` (unique per layer) for the
        recompute of its checkpointed block, which then skips the kernel (layers/attention/fa4.py, "kept across a
        recompute"; set by "long_context" checkpointing on full-attention layers). Other kernels keep nothing."""
        self.keep_slot = keep_slot_tensor(slot)

    def init_weights(self) -> None:
        for linear in (self.wq_a, self.wq_b, self.wkv_a, self.wkv_b, self.wo):
            nn.init.normal_(linear.weight, mean=0.0, std=self.init_std)
        self.q_norm.init_weights()
        self.kv_norm.init_weights()
        for linear, how in ((self.lambda_proj, self.lambda_init), (self.wq_b_gate, self.gate_init)):
            if linear is None:
                continue
            if how == "zeros":
                nn.init.zeros_(linear.weight)
            else:
                nn.init.normal_(linear.weight, mean=0.0, std=self.init_std)

    def forward(
        self, x_BSH: torch.Tensor, position_ids_BS: torch.Tensor, metadata: Optional[AttentionMetadata] = None
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """`metadata`: the forward's shared AttentionMetadata (document ids, prebuilt masks); None when the
        layer runs on its own (one document per row), in which case it builds its own. Returns (y, max_logits)
        (class docstring)."""
        B, S, _ = x_BSH.shape
        if metadata is None:
            metadata = build_attention_metadata(
                self.attention_backend, None, [self.window], B, S, x_BSH.device, (self.d_nope + self.d_rope, self.d_v)
            )
        cos, sin = self.rope.cos_sin(position_ids_BS)

        c_q = self.q_norm(self.wq_a(x_BSH))  # [B, S, q_lora]
        q = self.wq_b(c_q).view(B, S, self.n_heads, self.d_nope + self.d_rope)
        q_nope, q_pe = q.split([self.d_nope, self.d_rope], dim=-1)
        q = torch.cat([q_nope, apply_rope_interleaved(q_pe, cos, sin)], dim=-1)

        kv_latent, k_pe = self.wkv_a(x_BSH).split([self.kv_lora_rank, self.d_rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv_latent)).view(B, S, self.n_kv_heads, self.d_nope + self.d_v)
        k_nope, v = kv.split([self.d_nope, self.d_v], dim=-1)
        k_pe = apply_rope_interleaved(k_pe.unsqueeze(2), cos, sin)  # one shared rope head
        k = torch.cat([k_nope, k_pe.expand(B, S, self.n_kv_heads, self.d_rope)], dim=-1)

        # An activation-checkpoint recompute runs this forward again inside the backward, on the same inputs: the
        # max logits of the first forward stand (the recompute's outputs are dropped), and the side pass is not
        # paid twice.
        record = self.record_max_logits and not _in_backward()
        # flash-attn-4 reads the window's tensor form when it runs, so torch.compile does not specialise on it: one
        # compiled attention graph for full and sliding layers (the int would be a constant: a graph per window)
        fa4 = runs_fa4(self.attention_backend, metadata, q.dtype)
        keep = {"keep_slot": self.keep_slot if torch.is_grad_enabled() else self.no_keep_slot} if fa4 else {}
        out, max_logits = self.kernel(
            q,
            k,
            v.contiguous(),
            scale=self.softmax_scale,
            window=self.window_tensor if fa4 else self.window,
            metadata=metadata,
            record_max_logits=record,
            **keep,
        )
        max_logits = max_logits.detach().float() if record else None

        lam = torch.sigmoid(self.lambda_proj(x_BSH))  # fp32 [B, S, n_sig]
        gate_logits = self.wq_b_gate(c_q) if self.wq_b_gate is not None else None
        y = grouped_differential(
            out.view(B, S, self.n_noise, self.r + 1, self.d_v), lam.view(B, S, self.n_noise, self.r), gate_logits
        )
        return self.wo(y.reshape(B, S, self.n_sig * self.d_v).to(x_BSH.dtype)), max_logits


def _in_backward() -> bool:
    """Whether this runs inside an autograd backward (an activation-checkpoint recompute); False while tracing
    with torch.compile (whose own recompute never re-runs Python)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def grouped_differential(
    out_BSGPD: torch.Tensor, lam_BSGR: torch.Tensor, gate_logits: Optional[torch.Tensor]
) -> torch.Tensor:
    """Per group g of P = r + 1 heads (r signal, then 1 noise): y_j = (O_j - lam_j O_noise) * sigmoid(gate_j),
    computed in fp32, returned in the attention output's dtype as [B, S, G, r, D]. `gate_logits` is the
    [B, S, G*r*D] output of wq_b_gate (None: no gate)."""
    return _GroupedDifferential.apply(out_BSGPD, lam_BSGR, gate_logits)


class _GroupedDifferential(torch.autograd.Function):
    """Saves the attention output, lambda and the gate logits as they are (bf16 / fp32) and recomputes
    the fp32 difference and sigmoid in backward, instead of keeping fp32 [B, S, n_sig, d_v] temporaries."""

    @staticmethod
    def _parts(out, lam, gate_logits):
        r, ct = lam.shape[-1], torch.promote_types(out.dtype, torch.float32)
        signal, noise = out[:, :, :, :r].to(ct), out[:, :, :, r:].to(ct)
        y = signal - lam.to(ct).unsqueeze(-1) * noise
        gate = None
        if gate_logits is not None:
            gate = torch.sigmoid(gate_logits.to(ct)).view(y.shape)
        return noise, y, gate

    @staticmethod
    def forward(ctx, out, lam, gate_logits):
        ctx.save_for_backward(out, lam, gate_logits)
        _, y, gate = _GroupedDifferential._parts(out, lam, gate_logits)
        return function_output(y if gate is None else y * gate, out.dtype)

    @staticmethod
    def backward(ctx, grad_BSGRD):
        out, lam, gate_logits = ctx.saved_tensors
        noise, y, gate = _GroupedDifferential._parts(out, lam, gate_logits)
        g = grad_BSGRD.to(y.dtype)
        d_gate_logits = None
        if gate is not None:
            if ctx.needs_input_grad[2]:
                d_gate_logits = (g * y * gate * (1 - gate)).reshape(gate_logits.shape).to(gate_logits.dtype)
            g = g * gate
        d_out = d_lam = None
        if ctx.needs_input_grad[0]:
            d_noise = -(lam.to(g.dtype).unsqueeze(-1) * g).sum(dim=3, keepdim=True)
            d_out = torch.cat([g, d_noise], dim=3).to(out.dtype)
        if ctx.needs_input_grad[1]:
            d_lam = -(g * noise).sum(dim=-1).to(lam.dtype)
        return d_out, d_lam, d_gate_logits
