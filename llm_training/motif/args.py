"""Motif3ModelArgs: every architectural field of Motif-3 (docs/model-spec.md §0.1), plus derived sizes,
the layer-type rules, and parameter / FLOP counting from the args alone.

Field names follow the published HF `config.json` of Motif-3-Beta where one exists, so
`state_dict_adapter.args_from_hf_config` is a near-identity mapping.

Choices made where the spec is open (each is a named field, so it can be changed from a flavor):
  * `polynorm_init_weight` = 1/3 raw weight (docs/model-spec.md §0.1 "PolyNorm init": raw weights 1/3 each;
    the sigmoid is applied on top, so the effective start weight is sigmoid(1/3) ~= 0.583).
  * `lambda_init` = "zeros": lambda_proj zero-initialised => lambda = 0.5 at start (docs/model-spec.md §2.4 "Init").
  * `gate_init` = "zeros": wq_b_gate zero-initialised => output gate = 0.5 at start (docs/model-spec.md §2.4).
  * `mhc_identity_init` = False (published), i.e. alpha ~ N(0, 0.1^2), Phi xavier-uniform, b_res ~ N(0, 0.1^2).
  * `mhc_h_post_alpha_start` = 0.0 by default: the h_post coefficient is `1 + alpha_sched` with the schedule
    ending at `mhc_h_post_alpha_end` = 0 (published). The start value is not published; 0 means the
    coefficient is 1.0 throughout (the published end state). A warm-up from 1.0 can be set per flavor.
  * `mtp_feeds_post_norm_hidden` = True: MTP takes final_norm(collapsed main hidden) (§0.1 MTP wiring).
  * sliding-layer rule `layer_idx % sliding_window_period != 0` (§0.1, the code-authoritative rule).
  * `polynorm_output_scale_per_layer`: {"layer index": scale} overrides of `polynorm_output_scale` for one
    layer's MLP / MoE (routed and shared experts); MTP module k is layer `num_hidden_layers + k` (as in
    Motif's vLLM, docs/model-spec.md §0.2). Empty by default (the published checkpoint sets none we know of).
  * `hidden_clamp` / `polynorm_bias_clamp` may be None (no clamp), as in Motif's config.json.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


@dataclass
class Motif3ModelArgs:
    """Architecture of one Motif-3 flavor. Defaults are the published Motif-3-Beta shape (§0.1)."""

    # --- vocabulary / trunk ---
    vocab_size: int = 220160
    hidden_size: int = 4096
    num_hidden_layers: int = 53
    intermediate_size: int = 12288  # dense FFN width (first dense layers and the MTP block)
    n_dense_first_layers: int = 2
    interleave_moe_layer_step: int = 1
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-5  # model RMSNorms (input/post-attention/final/latent norms)
    initializer_range: float = 0.02
    max_seq_len: int = 4096  # training context of this flavor (HF: max_position_embeddings)

    # --- MoE ---
    num_experts: int = 384
    experts_top_k: int = 8
    num_shared_experts: int = 1
    moe_intermediate_size: int = 1280
    score_func: str = "sigmoid"  # "sigmoid" | "softmax"
    route_norm: bool = True
    route_scale: float = 2.0
    score_before_experts: bool = False
    load_balance_coeff: float = 1e-4  # aux-loss-free expert-bias update speed (gamma)
    router_aux_loss_coef: float = 0.0  # sequence-wise balance loss coefficient (alpha)

    # --- GDLA attention ---
    attention_cls: str = "gdla"
    num_attention_heads: int = 80  # signal + noise query heads
    num_key_value_heads: int = 16
    num_noise_heads: int = 16
    head_dim: int = 192  # qk head dim = nope + rope
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    q_lora_rank: int = 1024
    kv_lora_rank: int = 512
    elementwise_attn_output_gate: bool = True
    lambda_init: str = "zeros"  # "zeros" | "normal": lambda_proj init (spec open; zeros => lambda 0.5)
    gate_init: str = "zeros"  # "zeros" | "normal": wq_b_gate init (spec open; zeros => gate 0.5)

    # --- sliding window / RoPE ---
    sliding_window: int = 128  # W: a sliding layer sees W+1 keys including itself
    sliding_window_period: int = 4  # layers with idx % period != 0 are sliding
    rope_theta: float = 10000.0  # full-attention layers
    swa_rope_theta: float = 10000.0  # sliding-window layers (plain RoPE, never YaRN)
    original_seq_len: int = 4096  # YaRN is active on full layers iff max_seq_len > original_seq_len
    rope_factor: float = 64.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0

    # --- mHC ---
    mhc_enabled: bool = True
    mhc_expansion_rate: int = 4
    mhc_sinkhorn_iters: int = 20
    mhc_identity_init: bool = False
    mhc_h_post_alpha_start: float = 0.0  # h_post coefficient = 1 + alpha(t); alpha decays start -> end
    mhc_h_post_alpha_end: float = 0.0
    mhc_eps: float = 1e-6  # RMSNorm over the flattened n*H stream

    # --- PolyNorm MLPs ---
    hidden_act: str = "poly_norm"
    polynorm_sigmoid_weight: bool = True
    polynorm_output_scale: float = 0.5
    polynorm_output_scale_per_layer: dict = field(default_factory=dict)  # {"layer idx": scale}, JSON-style keys
    polynorm_bias_clamp: float | None = 0.5  # routed experts only; None = no clamp
    hidden_clamp: float | None = 1e6  # routed + shared experts: gate/up and routed output (1e6 => ~off)
    polynorm_eps: float = 1e-6
    polynorm_init_weight: float = 1.0 / 3.0  # raw weight init (sigmoid applied on top)

    # --- multi-token prediction ---
    num_nextn_predict_layers: int = 1
    mtp_feeds_post_norm_hidden: bool = True

    # ------------------------------------------------------------------ derived sizes
    @property
    def qk_nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def num_signal_heads(self) -> int:
        return self.num_attention_heads - self.num_noise_heads

    @property
    def signal_per_noise(self) -> int:
        """r: signal heads per noise head; a group is [r signal + 1 noise] query heads."""
        return self.num_signal_heads // self.num_noise_heads

    @property
    def yarn_active(self) -> bool:
        return self.max_seq_len > self.original_seq_len and self.rope_factor > 1.0

    @property
    def yarn_mscale(self) -> float:
        """m = 0.1 * mscale * ln(factor) + 1 (1.0 when YaRN is inactive)."""
        if not self.yarn_active:
            return 1.0
        return 0.1 * self.mscale * math.log(self.rope_factor) + 1.0

    def softmax_scale(self, layer_idx: int) -> float:
        """head_dim^-0.5, times mscale^2 on full-attention layers when YaRN is active (§0.1)."""
        scale = self.head_dim**-0.5
        if not is_sliding_layer(layer_idx, self) and self.yarn_active:
            scale *= self.yarn_mscale**2
        return scale

    def for_layer(self, layer_idx: int) -> "Motif3ModelArgs":
        """The args layer `layer_idx` is built with: `polynorm_output_scale` taken from
        `polynorm_output_scale_per_layer` when it names the layer (MTP module k is layer num_hidden_layers + k)."""
        scale = self.polynorm_output_scale_per_layer.get(str(layer_idx))
        return self if scale is None else dataclasses.replace(self, polynorm_output_scale=float(scale))

    def validate(self) -> None:
        """Raise ValueError naming the field when the shape is inconsistent."""
        errs = []
        if self.num_noise_heads <= 0 or self.num_signal_heads % self.num_noise_heads:
            errs.append(
                f"num_attention_heads - num_noise_heads ({self.num_signal_heads}) must be a positive "
                f"multiple of num_noise_heads ({self.num_noise_heads})"
            )
        elif self.num_attention_heads % self.num_key_value_heads or (
            (self.num_attention_heads // self.num_key_value_heads) % (self.signal_per_noise + 1)
        ):
            errs.append(
                "num_attention_heads / num_key_value_heads must be a multiple of the group size "
                f"(signal_per_noise + 1 = {self.signal_per_noise + 1}) so a signal/noise group shares K/V"
            )
        if not 0 < self.qk_rope_head_dim < self.head_dim or self.qk_rope_head_dim % 2:
            errs.append("qk_rope_head_dim must be even and smaller than head_dim")
        if self.experts_top_k > self.num_experts:
            errs.append(f"experts_top_k ({self.experts_top_k}) > num_experts ({self.num_experts})")
        if self.score_func not in ("sigmoid", "softmax"):
            errs.append(f"score_func must be 'sigmoid' or 'softmax', got {self.score_func!r}")
        if self.attention_cls != "gdla":
            errs.append(f"attention_cls must be 'gdla', got {self.attention_cls!r}")
        if self.hidden_act != "poly_norm":
            errs.append(f"hidden_act must be 'poly_norm', got {self.hidden_act!r}")
        if self.sliding_window_period < 1 or self.interleave_moe_layer_step < 1:
            errs.append("sliding_window_period and interleave_moe_layer_step must be >= 1")
        n_layers = self.num_hidden_layers + self.num_nextn_predict_layers
        for key, scale in self.polynorm_output_scale_per_layer.items():
            if not (isinstance(key, str) and key.isdigit() and int(key) < n_layers) or not isinstance(
                scale, (int, float)
            ):
                errs.append(
                    f"polynorm_output_scale_per_layer[{key!r}] = {scale!r}: keys must be layer indices as strings "
                    f"(0..{n_layers - 1}, MTP module k is num_hidden_layers + k) and values numbers"
                )
        for name in ("hidden_clamp", "polynorm_bias_clamp"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                errs.append(f"{name} must be positive or None (no clamp), got {getattr(self, name)!r}")
        for name in ("lambda_init", "gate_init"):
            if getattr(self, name) not in ("zeros", "normal"):
                errs.append(f"{name} must be 'zeros' or 'normal'")
        if errs:
            raise ValueError("invalid Motif3ModelArgs: " + "; ".join(errs))

    def replace(self, **changes) -> "Motif3ModelArgs":
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------- layer-type rules
def is_sliding_layer(layer_idx: int, args: Motif3ModelArgs) -> bool:
    """Sliding-window layer iff `layer_idx % sliding_window_period != 0` (0-based; layer 0 is full).

    This is the rule of the code that reproduces the reference model (§0.1). One vLLM architecture note
    states `(layer_idx + 1) % period != 0` instead; if that ever proves right, change this line only.
    MTP blocks do not use this rule: they are always sliding (§0.1), set directly by the MTP module.
    """
    return layer_idx % args.sliding_window_period != 0


def is_moe_layer(layer_idx: int, args: Motif3ModelArgs) -> bool:
    """Dense for the first `n_dense_first_layers`, then MoE iff (idx + 1) % interleave_moe_layer_step == 0."""
    if layer_idx < args.n_dense_first_layers:
        return False
    return (layer_idx + 1) % args.interleave_moe_layer_step == 0


# ---------------------------------------------------------------------- parameter counting
@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts computed from the args (trainable parameters; expert_bias buffers excluded)."""

    total: int  # main model (embedding, trunk, final norm, head), MTP excluded
    active: int  # per token in the main model: routed experts counted top_k of num_experts
    mtp: int  # all MTP modules (embedding and head are shared, not counted again)
    embedding: int  # input embedding table (a lookup: no FLOPs)
    lm_head: int

    @property
    def total_with_mtp(self) -> int:
        return self.total + self.mtp


def attention_param_count(a: Motif3ModelArgs) -> int:
    n_sig = a.num_signal_heads
    p = a.q_lora_rank * a.hidden_size + a.q_lora_rank  # wq_a + q_norm
    p += a.num_attention_heads * a.head_dim * a.q_lora_rank  # wq_b
    if a.elementwise_attn_output_gate:
        p += n_sig * a.v_head_dim * a.q_lora_rank  # wq_b_gate
    p += (a.kv_lora_rank + a.qk_rope_head_dim) * a.hidden_size + a.kv_lora_rank  # wkv_a + kv_norm
    p += a.num_key_value_heads * (a.qk_nope_head_dim + a.v_head_dim) * a.kv_lora_rank  # wkv_b
    p += n_sig * a.hidden_size  # lambda_proj
    p += a.hidden_size * n_sig * a.v_head_dim  # wo
    return p


def mlp_param_count(hidden: int, inter: int) -> int:
    """Dense PolyNorm MLP: gate, up, down + PolyNorm weight[3] and bias[1]."""
    return 3 * hidden * inter + 4


def expert_param_count(a: Motif3ModelArgs) -> int:
    """One routed expert: gate|up [2I, H], down [H, I], PolyNorm weight[3] + bias[1]."""
    return 3 * a.hidden_size * a.moe_intermediate_size + 4


def mhc_param_count(a: Motif3ModelArgs) -> int:
    """One mHC module: RMSNorm gain [nH], proj_pre/post [n, nH], proj_res [n*n, nH], 3 alphas, biases."""
    if not a.mhc_enabled:
        return 0
    n, nh = a.mhc_expansion_rate, a.mhc_expansion_rate * a.hidden_size
    return nh * (1 + 2 * n + n * n) + 3 + 2 * n + n * n


def param_counts(a: Motif3ModelArgs) -> ParamCounts:
    H = a.hidden_size
    attn = attention_param_count(a)
    mhc = 2 * mhc_param_count(a)
    norms = 2 * H
    total = active = 0
    for i in range(a.num_hidden_layers):
        layer = attn + mhc + norms
        if is_moe_layer(i, a):
            router = a.num_experts * H
            shared = mlp_param_count(H, a.moe_intermediate_size * a.num_shared_experts) if a.num_shared_experts else 0
            total += layer + router + shared + a.num_experts * expert_param_count(a)
            active += layer + router + shared + a.experts_top_k * expert_param_count(a)
        else:
            dense = mlp_param_count(H, a.intermediate_size)
            total += layer + dense
            active += layer + dense
    emb = a.vocab_size * H
    head = 0 if a.tie_word_embeddings else a.vocab_size * H
    edge = emb + H + head  # embedding, final norm, lm_head
    mtp_one = H + 2 * H * H + attn + norms + mlp_param_count(H, a.intermediate_size) + H
    return ParamCounts(
        total=total + edge,
        active=active + edge,
        mtp=a.num_nextn_predict_layers * mtp_one,
        embedding=emb,
        lm_head=head,
    )


# ---------------------------------------------------------------------- FLOP counting
def attention_keys_per_query(sliding: bool, seq_len: int, a: Motif3ModelArgs, causal_halved: bool) -> float:
    """Average number of keys a query attends to (for FLOP counting).

    Sliding layers: W+1 keys (fewer at the start of a sequence, ignored when seq_len >> W).
    Full layers: seq_len/2 with the causal halving (Megatron), seq_len without (torchtitan).
    """
    if not causal_halved:
        return float(seq_len)
    if sliding:
        return float(min(a.sliding_window + 1, seq_len))
    return seq_len / 2


def training_flops_per_token(a: Motif3ModelArgs, seq_len: int, convention: str = "megatron") -> float:
    """Training FLOPs per token (forward + backward = 3 x forward); docs/flops.md states both formulas.

    convention "megatron" (ours: the work the step really does): 6 x active matmul params (embedding lookup
      excluded) + 6 x H x V per MTP module for its output head (the head weight is shared, so it is not in
      `pc.mtp`, but each MTP module runs one more full-vocabulary GEMM), plus attention with causal halving
      and the true sliding-window width on every block, MTP blocks (sliding) included.
    convention "torchtitan": 6 x active params (embedding excluded, MTP excluded) plus full (unmasked)
      attention on every trunk layer: 6 * n_heads * (d_qk + d_v) * seq_len per layer
      (torchtitan.models.utils.get_moe_model_nparams_and_flops).
    """
    if convention not in ("megatron", "torchtitan"):
        raise ValueError(f"unknown FLOP convention {convention!r}; use 'megatron' or 'torchtitan'")
    pc = param_counts(a)
    matmul_params = pc.active - pc.embedding
    halved = convention == "megatron"
    layer_is_sliding = [is_sliding_layer(i, a) for i in range(a.num_hidden_layers)]
    if convention == "megatron":
        matmul_params += pc.mtp + a.num_nextn_predict_layers * a.hidden_size * a.vocab_size
        layer_is_sliding += [True] * a.num_nextn_predict_layers  # MTP blocks are sliding-window
    per_key = 6 * a.num_attention_heads * (a.head_dim + a.v_head_dim)
    attn = sum(per_key * attention_keys_per_query(s, seq_len, a, halved) for s in layer_is_sliding)
    return 6.0 * matmul_params + attn
