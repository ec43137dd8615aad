"""Activation memory of one Motif-3 training micro-batch on one rank, estimated from the model args (for the
dry run, `llm_training/dry_run.py`; `MOTIF3_SPEC.activation_memory`).

What it counts, for T = local_batch_size x seq_len / cp tokens per rank: the tensors autograd keeps from the
forward for the backward, term by term as the layers save them, under the activation-checkpointing mode
(`distributed/activation_checkpoint.py`; the blocks are the trunk layers and the MTP modules):

    none        every block's saved tensors
    full        each block's input only; during a block's backward its forward runs again, so one block's saved
                tensors (the largest block's) exist on top
    selective   each block's input and the outputs of its matmuls and attention kernel (what the policy keeps);
                the rest of one block is recomputed on top during its backward
    long_context  as full, but an MoE block's routed-expert terms (rows, gate|up, activations, PolyNorm rstd,
                the sort order and its inverse, the experts' outputs) exist for one chunk of
                LONG_CONTEXT_MOE_CHUNK_TOKENS tokens at a time during its backward, not for all tokens; with
                `keep_full_attention`, each full-attention trunk layer also keeps its attention kernel's output
                n_h*d_v b and log-sum-exp n_h f until its backward (flash-attn-4's keep across the recompute)

Outside the blocks: the final norm's input and the final hidden (2H b per token). The loss's buffers are the
trainer's (the dry run adds them).

Saved tensors per token (elements; b = the compute dtype `[training] mixed_precision_param`, f = fp32,
i = int64; n = mhc_expansion_rate, K = experts_top_k, E = num_experts, I_e = moe_intermediate_size,
I_s = I_e x num_shared_experts, I = intermediate_size):
  block input                n*H b with mHC (H b without)
  mHC, each sub-layer        the projections [p, q, R] (2n + n^2) f and the norm's rstd 1 f; h_pre, h_post,
                             H_res (2n + n^2) f; the collapsed input of the sub-layer's norm H b; the sub-layer's
                             output H b (the stream update keeps it). The mid-block stream (after the attention
                             update) is not kept: the FFN side rebuilds it from the block input (layers/mhc/hyper_connections.py)
  attention (GDLA)           norm output H b; lambda_proj's fp32 input H f and lambda n_sig f; wq_a output and
                             c_q 2 q_lora b; wkv_a output (kv_lora + d_rope) b and kv_norm output kv_lora b; the
                             kernel's q n_h*d_qk, k n_kv*d_qk, v n_kv*d_v and output n_h*d_v b and its
                             log-sum-exp n_h f (what a fused kernel keeps; the CPU math fallback keeps the
                             S x S probabilities instead; flash-attn-4 repeats K/V to the query heads for its
                             kernel calls only, a transient of one layer: layers/attention/fa4.py);
                             gate logits n_sig*d_v b;
                             wo input n_sig*d_v b
  dense MLP (width I)        norm output H b; gate, up 2I b; activation output I b; PolyNorm rstd 3 f
                             (with hidden_clamp, as the shared expert: the pre-clamp gate, up 2I b more)
  MoE                        norm output H b; router: fp32 input H f, scores E f, weights 2K f, expert ids /
                             sort order / its inverse 3K i; routed experts: rows K*H b, gate|up K*2I_e b,
                             activation K*I_e b (each twice with hidden_clamp: before and after the clamp),
                             PolyNorm rstd 3K f, the experts' outputs K*H b (kept by the weighted combine,
                             which accumulates in fp32 but saves its input rows: layers/moe.py _WeightedCombine);
                             the shared expert as a dense MLP of width I_s with the clamp
  MTP module                 embedding H b, the concatenation [hidden; normed embedding] 2H b, input_proj
                             output H b, attention, the residual H b, dense MLP of width I, the residual H b
  selective keeps            matmul outputs (wq_a, wq_b, wkv_a, wkv_b, lambda_proj (f), wq_b_gate, wo, gate,
                             up, down, router (f), grouped GEMMs, input_proj) and the kernel's output and
                             log-sum-exp

What it ignores: temporaries that live within one op or one layer's forward/backward (the gradients of the
block being back-propagated, attention-kernel workspaces, expert-parallel all-to-all and context-parallel
exchange buffers, the mHC coefficient recomputation), per-token scalars (each norm's rstd, the rotary tables
gathered per position: a few f per token), routing imbalance (the routed-expert
terms assume every rank receives the balanced T*K expert rows; the busiest rank of an imbalanced step holds
more), the zero rows that pad expert groups for the grouped GEMM, what torch.compile fuses away (it can only
shrink the saved set) and allocator fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from llm_training.distributed.activation_checkpoint import LONG_CONTEXT_MOE_CHUNK_TOKENS
from llm_training.motif.args import Motif3ModelArgs, is_moe_layer, is_sliding_layer


class PerToken(NamedTuple):
    """Elements saved per token, by dtype class: compute dtype, fp32, int64."""

    b: int = 0
    f: int = 0
    i: int = 0

    def __add__(self, other: PerToken) -> PerToken:
        return PerToken(self.b + other.b, self.f + other.f, self.i + other.i)

    def bytes(self, compute_bytes: int) -> int:
        return self.b * compute_bytes + self.f * 4 + self.i * 8


class BlockTerms(NamedTuple):
    """One block per token: its input, everything it saves without AC, what selective AC keeps (input included),
    and the part of `all` that long_context AC holds for one token chunk only (the routed experts)."""

    input: PerToken
    all: PerToken
    selective: PerToken
    routed: PerToken = PerToken()


def attention_terms(a: Motif3ModelArgs) -> tuple[PerToken, PerToken]:
    """(saved without AC, kept by selective AC) of one GDLA layer, its norm's input excluded."""
    d_qk, gate = a.head_dim, a.num_signal_heads * a.v_head_dim
    gate_logits = gate if a.elementwise_attn_output_gate else 0
    saved = PerToken(
        b=a.hidden_size
        + 2 * a.q_lora_rank
        + (a.kv_lora_rank + a.qk_rope_head_dim)
        + a.kv_lora_rank
        + a.num_attention_heads * d_qk
        + a.num_key_value_heads * (d_qk + a.v_head_dim)
        + a.num_attention_heads * a.v_head_dim
        + gate_logits
        + gate,
        f=a.hidden_size + a.num_signal_heads + a.num_attention_heads,
    )
    kept = PerToken(
        b=a.q_lora_rank
        + a.num_attention_heads * d_qk
        + (a.kv_lora_rank + a.qk_rope_head_dim)
        + a.num_key_value_heads * (a.qk_nope_head_dim + a.v_head_dim)
        + gate_logits
        + a.num_attention_heads * a.v_head_dim
        + a.hidden_size,
        f=a.num_signal_heads + a.num_attention_heads,
    )
    return saved, kept


def mlp_terms(hidden: int, width: int, clamped: bool) -> tuple[PerToken, PerToken]:
    """(saved, kept by selective) of one PolyNorm MLP of `width`, its input excluded."""
    saved = PerToken(b=(4 if clamped else 2) * width + width, f=3)
    kept = PerToken(b=2 * width + hidden)
    return saved, kept


def dense_terms(a: Motif3ModelArgs) -> tuple[PerToken, PerToken]:
    """(saved, kept) of a dense FFN sub-layer: its norm's output and the MLP."""
    saved, kept = mlp_terms(a.hidden_size, a.intermediate_size, clamped=False)
    return PerToken(b=a.hidden_size) + saved, kept


def routed_expert_terms(a: Motif3ModelArgs) -> PerToken:
    """What an MoE sub-layer's routed experts save per token (layers/moe.py `MoE._routed`): the sort order and
    its inverse, the gathered rows, gate|up and activations, PolyNorm rstd, the experts' outputs."""
    H, K, I = a.hidden_size, a.experts_top_k, a.moe_intermediate_size
    copies = 2 if a.hidden_clamp is not None else 1
    return PerToken(b=2 * K * H + copies * (K * 2 * I + K * I), f=3 * K, i=2 * K)


def moe_terms(a: Motif3ModelArgs) -> tuple[PerToken, PerToken]:
    """(saved, kept) of an MoE sub-layer: its norm's output, router, routed experts, shared expert."""
    H, K, E, I = a.hidden_size, a.experts_top_k, a.num_experts, a.moe_intermediate_size
    router = PerToken(f=H + E + 2 * K, i=K)  # fp32 input, scores, weights; the expert ids
    saved, kept = PerToken(b=H) + router + routed_expert_terms(a), PerToken(b=K * 2 * I + K * H, f=E)
    if a.num_shared_experts > 0:
        shared_saved, shared_kept = mlp_terms(H, I * a.num_shared_experts, clamped=a.hidden_clamp is not None)
        saved, kept = saved + shared_saved, kept + shared_kept
    return saved, kept


def mhc_sublayer_terms(a: Motif3ModelArgs) -> PerToken:
    """What one mHC-wrapped sub-layer adds (the shared block input excluded): the collapsed norm input and the
    sub-layer output H b each; projections, rstd and coefficients (2 (2n + n^2) + 1) f."""
    n = a.mhc_expansion_rate
    return PerToken(b=2 * a.hidden_size, f=2 * (2 * n + n * n) + 1)


def trunk_block_terms(a: Motif3ModelArgs, moe: bool) -> BlockTerms:
    """One trunk layer (attention + dense MLP or MoE), with or without mHC."""
    H, n = a.hidden_size, a.mhc_expansion_rate
    attn_saved, attn_kept = attention_terms(a)
    ffn_saved, ffn_kept = moe_terms(a) if moe else dense_terms(a)
    if a.mhc_enabled:
        block_input = PerToken(b=n * H)
        saved = block_input + mhc_sublayer_terms(a) + attn_saved + mhc_sublayer_terms(a) + ffn_saved
    else:
        block_input = PerToken(b=H)  # also the attention norm's input
        saved = block_input + attn_saved + PerToken(b=H) + ffn_saved  # + the residual the FFN norm reads
    return BlockTerms(
        block_input, saved, block_input + attn_kept + ffn_kept, routed_expert_terms(a) if moe else PerToken()
    )


def mtp_block_terms(a: Motif3ModelArgs) -> BlockTerms:
    """One MTP module (no mHC, dense MLP); its incoming hidden is the trunk's final hidden (counted outside)."""
    H = a.hidden_size
    attn_saved, attn_kept = attention_terms(a)
    mlp_saved, mlp_kept = dense_terms(a)
    block_input = PerToken(b=H)  # embed(t_{i+k+1}), the embedding norm's input
    before_attention = PerToken(b=2 * H + H)  # [hidden; normed embedding] (input_proj's input), input_proj output
    residuals = PerToken(b=2 * H)  # the inputs of the post-attention and final norms
    saved = block_input + before_attention + attn_saved + mlp_saved + residuals
    return BlockTerms(block_input, saved, block_input + PerToken(b=H) + attn_kept + mlp_kept)


@dataclass(frozen=True)
class ActivationEstimate:
    """Estimated activation bytes of the model's forward for one micro-batch on one rank (module docstring)."""

    tokens: int  # per rank and micro-batch
    ac_mode: str
    block_bytes: dict[str, tuple[int, int]]  # block kind -> (count, bytes each keeps until its backward)
    recompute_bytes: int  # one block re-materialised during its backward (0 without AC)
    outside_blocks_bytes: int  # final norm input + final hidden

    @property
    def saved_bytes(self) -> int:
        """Everything the forward keeps for the backward: every block's share and the tensors outside them."""
        return sum(count * each for count, each in self.block_bytes.values()) + self.outside_blocks_bytes


def kept_attention_terms(a: Motif3ModelArgs) -> PerToken:
    """What a full-attention layer keeps across its block's recompute under long_context with
    keep_full_attention: the kernel's output and log-sum-exp (layers/attention/fa4.py)."""
    return PerToken(b=a.num_attention_heads * a.v_head_dim, f=a.num_attention_heads)


def estimate_activation_memory(
    a: Motif3ModelArgs, tokens: int, ac_mode: str, compute_dtype: torch.dtype, keep_full_attention: bool = False
) -> ActivationEstimate:
    """Activation estimate for `tokens` tokens per rank (local_batch_size x seq_len / cp) under `ac_mode`;
    `keep_full_attention` ([activation_checkpoint]) counts under long_context only, where it applies."""
    nb = torch.empty((), dtype=compute_dtype).element_size()
    n_moe = sum(is_moe_layer(i, a) for i in range(a.num_hidden_layers))
    kinds = {
        "dense layer": (a.num_hidden_layers - n_moe, trunk_block_terms(a, moe=False)),
        "MoE layer": (n_moe, trunk_block_terms(a, moe=True)),
        "MTP module": (a.num_nextn_predict_layers, mtp_block_terms(a)),
    }
    kept = {
        "none": lambda t: t.all,
        "full": lambda t: t.input,
        "selective": lambda t: t.selective,
        "long_context": lambda t: t.input,
    }[ac_mode]
    present = {name: (count, terms) for name, (count, terms) in kinds.items() if count > 0}
    block_bytes = {name: (count, tokens * kept(t).bytes(nb)) for name, (count, t) in present.items()}

    def recomputed(t: BlockTerms) -> int:
        if ac_mode != "long_context":
            return tokens * (t.all.bytes(nb) - kept(t).bytes(nb))
        chunk = min(tokens, LONG_CONTEXT_MOE_CHUNK_TOKENS)
        return tokens * (t.all.bytes(nb) - t.input.bytes(nb) - t.routed.bytes(nb)) + chunk * t.routed.bytes(nb)

    recompute = 0 if ac_mode == "none" else max(recomputed(t) for _, t in present.values())
    n_full = sum(not is_sliding_layer(i, a) for i in range(a.num_hidden_layers))
    if ac_mode == "long_context" and keep_full_attention and n_full > 0:  # beside the blocks' inputs
        block_bytes["kept full attention"] = (n_full, tokens * kept_attention_terms(a).bytes(nb))
    return ActivationEstimate(
        tokens=tokens,
        ac_mode=ac_mode,
        block_bytes=block_bytes,
        recompute_bytes=recompute,
        outside_blocks_bytes=tokens * 2 * a.hidden_size * nb,
    )
