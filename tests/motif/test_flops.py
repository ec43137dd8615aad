"""training_flops_per_token against the hand-computed figures of docs/flops.md (both conventions), and
torchtitan's own count of its matched DeepSeek-V3 when torchtitan is installed."""

import importlib.util

import pytest

from llm_training.motif import get_flavor, training_flops_per_token

# docs/flops.md, "Worked numbers": every term added up by hand from the shapes.
HAND = {
    # flavor: (megatron = ours, torchtitan), seq 4096
    "motif3_proxy": (17_853_774_600, 13_058_963_184),
    "motif3_proxy_nomtp": (10_916_396_784, 13_058_963_184),
    "motif3_seq": (84_572_268_132, 105_802_826_316),
}


@pytest.mark.parametrize("flavor", sorted(HAND))
def test_both_conventions_match_the_hand_computed_numbers(flavor):
    ours, titan = HAND[flavor]
    assert training_flops_per_token(get_flavor(flavor), 4096, "megatron") == ours
    assert training_flops_per_token(get_flavor(flavor), 4096, "torchtitan") == titan


def test_the_mtp_head_is_counted_once_per_mtp_module():
    a = get_flavor("motif3_proxy")
    with_mtp = training_flops_per_token(a, 4096, "megatron")
    without = training_flops_per_token(a.replace(num_nextn_predict_layers=0), 4096, "megatron")
    head = 6 * a.hidden_size * a.vocab_size  # 5.41 GFLOP/token
    block = 6 * 251_151_876 + 6 * a.num_attention_heads * (a.head_dim + a.v_head_dim) * (a.sliding_window + 1)
    assert with_mtp - without == head + block


def test_unknown_convention_is_refused():
    with pytest.raises(ValueError, match="megatron"):
        training_flops_per_token(get_flavor("motif3_debug"), 64, "palm")


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan (bench extra) not installed")
def test_torchtitan_counts_its_matched_model_as_computed_by_hand():
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from bench_vs_torchtitan import matched_torchtitan_args, torchtitan_flops_per_token
    from torchtitan.config import JobConfig
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model

    args = matched_torchtitan_args("motif3_proxy_nomtp", 4096)
    job = JobConfig()
    job.training.seq_len = 4096
    args.update_from_config(job)
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    _, titan = args.get_nparams_and_flops(model, 4096)
    assert titan == 13_234_335_744  # docs/flops.md: N = 1,786,292,224 active non-embedding params
    flops = torchtitan_flops_per_token(titan, 4, 80, 320, 4096)
    assert flops == {"megatron": 11_976_044_544, "torchtitan": 13_234_335_744}
