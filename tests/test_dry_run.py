"""The dry run (`--job.dry_run`, llm_training/dry_run.py): the setup of every rank under a fake process group on
meta, and its memory report, checked against numbers computed by hand from the unsharded model's shapes, against
the fit verdict, and on the two production examples at 32 ranks. The activation formula's own tests:
tests/motif/test_activation_memory.py."""

from __future__ import annotations

import math

import pytest
import torch

from llm_training.config import ConfigError, ConfigManager
from llm_training.dry_run import DOES_NOT_FIT, GIB, dry_run_world_size, format_report, measure_job, measure_rank
from llm_training.motif import get_flavor, param_counts
from llm_training.motif.model import Motif3Model
from llm_training.motif.spec import MOTIF3_SPEC
from llm_training.motif.state_dict_adapter import is_fp32_key
from llm_training.train import main
from optimizer import group_parameters

TRAIN_CONFIGS = "llm_training/motif/train_configs"


def parse(*argv: str):
    return ConfigManager().parse_args(list(argv))


def unsharded_debug_params() -> list[tuple[str, torch.Size]]:
    with torch.device("meta"):
        model = Motif3Model(get_flavor("motif3_debug"))
    return [(name, p.shape) for name, p in model.named_parameters()]


def ceil_split_rows(rows: int, world: int, rank: int) -> int:
    """Rows of a dim-0 split of `rows` over `world` ranks held by `rank` (ceil-sized chunks, the last ones short)."""
    chunk = math.ceil(rows / world)
    return max(0, min(chunk, rows - rank * chunk))


# ------------------------------------------------------------------------------- parameters, gradients, optimizer
@pytest.mark.parametrize("world", [4, 3])  # 4: every motif3_debug dim-0 splits evenly; 3: uneven shards
def test_debug_shards_are_the_ceil_split_of_each_tensor(world):
    c = parse(f"--job.dry_run_world_size={world}")
    for rank in (0, world - 1):
        r = measure_rank(c, world, rank)
        sharded = [(s[0], math.prod(s[1:])) for n, s in unsharded_debug_params() if not is_fp32_key(n)]
        replicated = sum(math.prod(s) for n, s in unsharded_debug_params() if is_fp32_key(n))
        local = sum(ceil_split_rows(rows, world, rank) * rest for rows, rest in sharded)
        padded = sum(math.ceil(rows / world) * rest for rows, rest in sharded)  # FSDP2 stores every shard padded
        assert r.params.sharded_local_numel == local
        assert r.params.sharded.numel == padded and r.params.sharded.bytes == 4 * padded  # fp32 master shards
        assert r.params.replicated.numel == replicated and r.params.replicated.bytes_by_dtype == {
            "float32": 4 * replicated
        }
        assert r.params.trainable.numel == padded + replicated  # a gradient for every parameter, same storage
    if world == 3:
        assert measure_rank(c, 3, 2).params.sharded_local_numel < measure_rank(c, 3, 0).params.sharded_local_numel


def test_optimizer_state_is_one_muon_momentum_and_two_adamw_moments_per_local_element():
    world, c = 4, parse("--job.dry_run_world_size=4")
    r = measure_rank(c, world, 0)
    with torch.device("meta"):
        model = Motif3Model(get_flavor("motif3_debug"))
    rules, forbidden = MOTIF3_SPEC.optimizer_rules(c.optimizer)
    grouping = group_parameters(model.named_parameters(), rules, forbidden)

    def local(name, p):
        return p.numel() if is_fp32_key(name) else ceil_split_rows(p.shape[0], world, 0) * math.prod(p.shape[1:])

    expected = {g: sum(local(n, p) for n, p, _ in items) for g, items in grouping.groups.items() if items}
    rows = {g.name: g for g in r.optimizer}
    assert set(rows) == {"Muon (muon)", "AdamW (adamw_decay)", "AdamW (adamw_no_decay)"}
    assert rows["Muon (muon)"].local_numel == expected["muon"]
    assert rows["Muon (muon)"].state_bytes == 1 * 4 * expected["muon"]
    for g in ("adamw_decay", "adamw_no_decay"):
        assert rows[f"AdamW ({g})"].local_numel == expected[g]
        assert rows[f"AdamW ({g})"].state_bytes == 2 * 4 * expected[g]
        assert rows[f"AdamW ({g})"].tensors == len(grouping.groups[g])


def test_bf16_muon_momentum_halves_the_muon_state():
    base = parse("--job.dry_run_world_size=4")
    half = parse("--job.dry_run_world_size=4", "--optimizer.muon_momentum_dtype=bfloat16")
    rows = {kind: {g.name: g for g in measure_rank(c, 4, 0).optimizer} for kind, c in (("fp32", base), ("bf16", half))}
    assert rows["bf16"]["Muon (muon)"].state_bytes * 2 == rows["fp32"]["Muon (muon)"].state_bytes > 0
    assert rows["bf16"]["AdamW (adamw_decay)"].state_bytes == rows["fp32"]["AdamW (adamw_decay)"].state_bytes


def test_fsdp_transients_of_the_debug_model():
    r = measure_rank(parse("--job.dry_run_world_size=4"), 4, 0)
    a = get_flavor("motif3_debug")
    kept = a.vocab_size * a.hidden_size + a.hidden_size  # the root: lm_head, final norm (the embedding reshards)
    moe_layer = sum(
        math.prod(s) for n, s in unsharded_debug_params() if n.startswith("layers.2.") and not is_fp32_key(n)
    )
    assert r.fsdp.kept_numel == kept and r.fsdp.kept_bytes == 2 * kept * 2  # bf16 params + grads
    # the largest group gathered at a time: at the debug shape the embedding's [V, H] outweighs a MoE layer
    largest = a.vocab_size * a.hidden_size
    assert moe_layer < largest
    assert r.fsdp.largest_block == "embed_tokens"
    assert r.fsdp.largest_block_numel == largest and not r.fsdp.gathered_for_the_step
    assert r.fsdp.all_gather_bytes == 2 * 2 * largest  # the group computing and the one prefetched, bf16
    assert r.fsdp.reduce_scatter_bytes == (2 + 4) * largest  # bf16 grads + the fp32 reduce-scatter input


def test_one_rank_shards_keep_every_group_gathered_for_the_step():
    """FSDP2 over one rank (here one GPU) gathers each group once per step and keeps it: all groups count."""
    r = measure_rank(parse("--job.dry_run_world_size=1"), 1, 0)
    blocks = sum(
        math.prod(s)
        for n, s in unsharded_debug_params()
        if n.startswith(("layers.", "mtp_layers.")) and not is_fp32_key(n)
    )
    assert r.fsdp.gathered_for_the_step and r.fsdp.blocks_numel == blocks
    assert r.fsdp.all_gather_bytes == 2 * blocks  # bf16


# ------------------------------------------------------------------------------- activations and loss buffers
def test_loss_buffers_and_tokens_follow_the_local_batch():
    r = measure_rank(parse("--job.dry_run_world_size=4", "--training.local_batch_size=2"), 4, 0)
    a = get_flavor("motif3_debug")
    assert r.activations.tokens == 2 * 256
    heads = 1 + a.num_nextn_predict_layers
    assert r.loss.kept_bytes == heads * 512 * a.hidden_size * 2 + a.vocab_size * a.hidden_size * 4
    # one fp32 [chunk, V] logits block of all 512 tokens (V = 2048 is far under the 2 GiB chunk), 4 bytes per
    # element, not 4 + 2: the bf16 gradient is written over it (trainer/cross_entropy_kernels.py)
    assert r.loss.chunk_bytes == 512 * 2048 * 4 and a.vocab_size == 2048


@pytest.mark.parametrize(
    "overrides, kept",
    [
        ((), True),  # long_context, attention auto (flash-attn-4 on the GPUs planned for)
        (("--activation_checkpoint.keep_full_attention=false",), False),
        (("--kernels.attention=sdpa",), False),  # only flash-attn-4 keeps
        (("--parallelism.context_parallel_degree=2",), True),  # Ulysses: each rank keeps its heads' result
        (("--parallelism.context_parallel_degree=2", "--parallelism.context_parallel_mode=ring"), False),
    ],
)
def test_long_context_counts_kept_full_attention_where_flash_attn_4_keeps(overrides, kept):
    """The dry run counts the full-attention layers' kept flash-attn-4 output under long_context where the
    layers keep it: the switch on, the kernel flash-attn-4, full attention not ring attention."""
    argv = ["--job.dry_run_world_size=2", "--activation_checkpoint.mode=long_context", *overrides]
    activations = measure_rank(parse(*argv), 2, 0).activations
    a = get_flavor("motif3_debug")
    assert ("kept full attention" in activations.block_bytes) == kept
    if kept:
        each = activations.tokens * a.num_attention_heads * (a.v_head_dim * 2 + 4)
        assert activations.block_bytes["kept full attention"] == (2, each)  # layers 0 and 4


# ------------------------------------------------------------------------------- the verdict and the entrypoint
def test_fits_and_does_not_fit(capsys):
    base = ["--job.dry_run", "--job.dry_run_world_size=4"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "on 4 ranks" in out and "rank 0:" in out and "rank 3:" in out and "dry run: fits on every rank" in out
    assert main([*base, "--job.dry_run_gpu_memory_gib=0.05"]) == DOES_NOT_FIT
    assert "DOES NOT FIT, short by" in capsys.readouterr().out
    r = measure_rank(parse(*base), 4, 0)
    assert r.total_bytes == (
        r.params.sharded.bytes
        + r.params.replicated.bytes
        + r.params.trainable.bytes
        + sum(g.state_bytes for g in r.optimizer)
        + r.fsdp.kept_bytes
        + r.fsdp.all_gather_bytes
        + r.fsdp.reduce_scatter_bytes
        + r.activations.saved_bytes
        + max(r.loss.kept_bytes + r.loss.chunk_bytes, r.activations.recompute_bytes)
    )
    assert r.gpu_bytes == 178 * GIB and r.fits and r.headroom_bytes == r.gpu_bytes - r.total_bytes


def test_world_size_resolution(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert dry_run_world_size(parse("--job.dry_run_world_size=8")) == 8
    assert dry_run_world_size(parse("--parallelism.data_parallel_shard_degree=3")) == 3
    assert dry_run_world_size(parse("--parallelism.data_parallel_replicate_degree=2"), {"WORLD_SIZE": "6"}) == 6
    with pytest.raises(ConfigError, match="dry_run_world_size"):
        dry_run_world_size(parse())  # data_parallel_shard_degree = -1 leaves it open
    assert main(["--job.dry_run"]) == 2 and "dry_run_world_size" in capsys.readouterr().err
    assert main(["--job.dry_run", "--job.dry_run_world_size=3", "--training.global_batch_size=16"]) == 2  # 8x3 !| 16
    with pytest.raises(ConfigError, match="dry_run_gpu_memory_gib"):
        parse("--job.dry_run_gpu_memory_gib=0")


# ------------------------------------------------------------------------------- the production examples
@pytest.mark.parametrize("name", ["example_c4_pretrain.toml", "example_c4_sft.toml"])
def test_production_examples_at_32_ranks(name):
    """The shipped examples set up for 32 ranks (their [job] dry_run_world_size): every rank holds 1/32 of the
    sharded parameters (all their dims split evenly: dense over dp_shard x cp, experts over ep x the rest) plus the
    replicated fp32 ones; the last rank holds the same as rank 0. (Under expert parallelism the experts' fp32
    PolyNorm weights, [E, 4] per layer, are sharded over the ep ranks only: x 32 counts them 4x, hence the 1e-5.)"""
    c = parse(f"--job.config_file={TRAIN_CONFIGS}/{name}")
    parallel_dims, reports = measure_job(c)
    assert parallel_dims.world_size == 32 and [r.rank for r in reports] == [0, 31]
    args = get_flavor(c.model.flavor)
    for r in reports:
        total = param_counts(args).total_with_mtp
        assert abs(r.params.sharded_local_numel * 32 + r.params.replicated.numel - total) <= 1e-5 * total
        assert r.activations.tokens == c.training.local_batch_size * c.training.seq_len // parallel_dims.cp
        # EP 8: a block's own group (its experts are groups apart) is smaller than the embedding's [V, H]
        assert r.fsdp.largest_block == "embed_tokens"
    assert reports[0].total_bytes == reports[1].total_bytes
    text = format_report(c, parallel_dims, reports)
    assert "on 32 ranks" in text and "rank 31:" in text and ("fits on every rank" in text or "does NOT fit" in text)
