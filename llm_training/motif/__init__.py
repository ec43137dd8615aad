"""The Motif-3 model family: flavor registry (name -> Motif3ModelArgs).

Production flavors use the published Motif-3-Beta shape (docs/model-spec.md §0.1); small flavors keep every
ratio and switch of it (GDLA groups of 4 signal + 1 noise heads with n_kv = n_noise, PolyNorm, sigmoid
top-k + 1 shared expert, mHC n=4, SWA period 4, 2 dense first layers, 1 MTP module) and shrink widths,
depth, expert count and vocabulary (§11).
"""

from __future__ import annotations

from llm_training.motif.args import (
    Motif3ModelArgs,
    ParamCounts,
    is_moe_layer,
    is_sliding_layer,
    param_counts,
    training_flops_per_token,
)

_MOTIF3_SEQ = Motif3ModelArgs()  # the published Motif-3-Beta shape at 4K context

MODEL_FLAVORS: dict[str, Motif3ModelArgs] = {
    # ~314B total / ~13B active, 4K pretraining. One MTP module, as in the published checkpoint.
    "motif3_seq": _MOTIF3_SEQ,
    # Same shape, 256K context: YaRN (factor 64 from 4K) + mscale^2 on the full-attention layers.
    "motif3_seq_256k_mtp1_sft": _MOTIF3_SEQ.replace(max_seq_len=262144, num_nextn_predict_layers=1),
    # Benchmark proxy: exact motif3_seq layer shapes and vocabulary, 4 layers (2 dense + 2 MoE), 64 experts.
    "motif3_proxy": _MOTIF3_SEQ.replace(num_hidden_layers=4, num_experts=64),
    # The same with 16 experts (2.91B): the benchmark proxy whose optimizer state and activations fit one 80 GiB H100.
    "motif3_proxy_16e": _MOTIF3_SEQ.replace(num_hidden_layers=4, num_experts=16),
    # ~2.0B total / ~0.77B active: one H200 with room for 4K x 8 sequences.
    "motif3_small": Motif3ModelArgs(
        hidden_size=1024,
        num_hidden_layers=16,
        intermediate_size=3072,
        num_experts=64,
        moe_intermediate_size=512,
        num_attention_heads=20,
        num_key_value_heads=4,
        num_noise_heads=4,
        head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=128,
        q_lora_rank=512,
        kv_lora_rank=256,
        max_seq_len=4096,
    ),
    # Tiny, every feature on (GDLA, sliding + full, mHC, dense + MoE, shared expert, MTP): CPU in seconds.
    "motif3_debug": Motif3ModelArgs(
        vocab_size=2048,
        hidden_size=64,
        num_hidden_layers=6,  # layers 0 and 4 full, the rest sliding; 0-1 dense, 2-5 MoE
        intermediate_size=128,
        num_experts=16,
        experts_top_k=4,
        moe_intermediate_size=32,
        num_attention_heads=10,  # 2 groups of [4 signal + 1 noise]
        num_key_value_heads=2,
        num_noise_heads=2,
        head_dim=24,
        qk_rope_head_dim=8,
        v_head_dim=16,
        q_lora_rank=32,
        kv_lora_rank=16,
        sliding_window=16,
        original_seq_len=256,
        max_seq_len=256,
        mhc_sinkhorn_iters=20,
    ),
}
# Without the MTP module: the like-for-like peers of torchtitan's DeepSeek-V3 in bench/bench_vs_torchtitan.py.
MODEL_FLAVORS["motif3_proxy_nomtp"] = MODEL_FLAVORS["motif3_proxy"].replace(num_nextn_predict_layers=0)
MODEL_FLAVORS["motif3_proxy_16e_nomtp"] = MODEL_FLAVORS["motif3_proxy_16e"].replace(num_nextn_predict_layers=0)
MODEL_FLAVORS["motif3_debug_nomtp"] = MODEL_FLAVORS["motif3_debug"].replace(num_nextn_predict_layers=0)


# motif3_small at 256K context (YaRN from 4K, as motif3_seq_256k_mtp1_sft): the one-GPU long-context benchmark
# (bench/bench_long_context.py).
MODEL_FLAVORS["motif3_small_256k"] = MODEL_FLAVORS["motif3_small"].replace(max_seq_len=262144)


def get_flavor(name: str) -> Motif3ModelArgs:
    """Look up a flavor; the error lists the valid names."""
    try:
        return MODEL_FLAVORS[name]
    except KeyError:
        raise KeyError(
            f"unknown model flavor {name!r}; valid flavors: {', '.join(sorted(MODEL_FLAVORS))} "
            f"(set [model] flavor or --model.flavor)"
        ) from None


__all__ = [
    "MODEL_FLAVORS",
    "Motif3ModelArgs",
    "ParamCounts",
    "get_flavor",
    "is_moe_layer",
    "is_sliding_layer",
    "param_counts",
    "training_flops_per_token",
]
