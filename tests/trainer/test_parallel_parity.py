"""The train step under every parallel layout equals one process (issue 10): motif3_debug (mHC, MTP, MoE, full +
sliding layers), Muon, QK-clip active, deterministic, on gloo CPU ranks. Every layout trains 10 steps on the SAME
synthetic global batches (4 packed rows of 64 tokens per step, documents crossing the context-parallel shard
boundaries and sliding-window layers reaching across them), each data rank taking its rows of them, and reports
the global loss of every step.

Layouts: 1 process | FSDP 2 | HSDP 2 x 1 (gradients reduced on the last micro-batch only, parameters gathered once
per step) | EP 2 | FSDP 2 x EP 2
(4 ranks) | Ulysses CP 2 | ring CP 2 | EP 2 x CP 2 (4 ranks).

Tolerance: 1e-6 relative on every step's loss (measured: at most 5e-8; 1-8 of the 10 steps bitwise equal). Not
bitwise: the layouts sum the same numbers in another order (FSDP2's reduce-scatter of gradients, the loss
all-reduce, ring attention's log-sum-exp merge, Ulysses' head split, the micro-batch split), and Muon's
Newton-Schulz step carries those last-bit differences into the weights of the next step. EP 2 x CP 2 also runs
selective activation checkpointing (recomputation must not change the values; the all-to-alls are saved).

Checkpoints: the FSDP 2 x EP 2 and the EP 2 x CP 2 runs save a DCP checkpoint after step 5 and export it to HF; one
process loads that checkpoint and its step 6 loss equals the 4-rank run's (same tolerance), and its HF export is
bitwise the 4-rank export (the same weights, gathered from the expert and FSDP shards).
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llm_training.config import ConfigManager
from llm_training.config.job_config import PACKAGE_DIR
from llm_training.distributed.utils import destroy_process_group

DEBUG_CPU_TOML = PACKAGE_DIR / "motif" / "train_configs" / "debug_cpu.toml"
STEPS, SEQ, ROWS, SAVE_STEP = 10, 64, 4, 5
RTOL = 1e-6
# document starts per row: documents cross the Ulysses boundary (32) and the zigzag chunk boundaries (16, 32, 48),
# some start fewer than W = 16 tokens before a boundary (the sliding window reaches into the other shard)
DOC_STARTS = ([0, 13, 30, 45], [0, 20, 50], [0, 7, 40, 60], [0, 33])

LAYOUTS = {  # name -> (world size, ParallelDims degrees, context_parallel_mode, activation_checkpoint mode)
    "single": (1, dict(dp_replicate=1, dp_shard=-1, cp=1, ep=1), "ulysses", "none"),
    "fsdp2": (2, dict(dp_replicate=1, dp_shard=-1, cp=1, ep=1), "ulysses", "none"),
    "replicate2": (2, dict(dp_replicate=2, dp_shard=1, cp=1, ep=1), "ulysses", "none"),
    "ep2": (2, dict(dp_replicate=1, dp_shard=-1, cp=1, ep=2), "ulysses", "none"),
    "fsdp2_ep2": (4, dict(dp_replicate=1, dp_shard=-1, cp=1, ep=2), "ulysses", "none"),
    "ulysses_cp2": (2, dict(dp_replicate=1, dp_shard=1, cp=2, ep=1), "ulysses", "none"),
    "ring_cp2": (2, dict(dp_replicate=1, dp_shard=1, cp=2, ep=1), "ring", "none"),
    "ep2_cp2": (4, dict(dp_replicate=1, dp_shard=2, cp=2, ep=2), "ulysses", "selective"),
}


def _config(dump_folder, cp_mode, ac_mode, checkpoint):
    return ConfigManager().parse_args([
        "--job.config_file", str(DEBUG_CPU_TOML), f"--job.dump_folder={dump_folder}", "--job.run_name=t",
        "--training.local_batch_size=1", f"--training.global_batch_size={ROWS}", f"--training.seq_len={SEQ}",
        f"--training.steps={STEPS}", "--training.deterministic", "--lr_scheduler.warmup_steps=2",
        f"--checkpoint.enable={str(checkpoint).lower()}", "--checkpoint.keep_latest_k=0",
        "--optimizer.qk_clip_threshold=0.05",  # low, so that QK-clip rescales (its max logits are MAX-reduced)
        f"--parallelism.context_parallel_mode={cp_mode}", f"--activation_checkpoint.mode={ac_mode}",
    ])  # fmt: skip


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """The step's [ROWS, SEQ] packed rows: labels are the next token inside each document (-100 on a document's
    last token and on its first two, a "prompt"), positions restart per document."""
    gen = torch.Generator().manual_seed(1000 + step)
    input_ids = torch.randint(3, 2048, (ROWS, SEQ), generator=gen)
    t = torch.arange(SEQ)
    starts = [torch.tensor(s) for s in DOC_STARTS]
    document_ids = torch.stack([(t[:, None] >= s[None]).sum(1) - 1 for s in starts])
    position_ids = torch.stack([t - s[d] for s, d in zip(starts, document_ids)])
    labels = torch.full_like(input_ids, -100)
    same_doc = document_ids[:, 1:] == document_ids[:, :-1]
    labels[:, :-1] = torch.where(same_doc, input_ids[:, 1:], -100)
    labels[position_ids < 2] = -100
    real_tokens = torch.full((ROWS,), SEQ)  # every row full: no padding
    return dict(
        input_ids=input_ids,
        labels=labels,
        position_ids=position_ids,
        document_ids=document_ids,
        real_tokens=real_tokens,
    )


def micro_batches(step: int, dims, rank: int) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches of the step: data rank r of D takes rows [r A, (r + 1) A), A = ROWS / D, one per
    micro-batch (the cp ranks of a data rank take the same rows and shard them)."""
    batch = global_batch(step)
    accum = ROWS // dims.dp_size
    first = dims.dp_rank(rank) * accum
    return [{k: v[row : row + 1] for k, v in batch.items()} for row in range(first, first + accum)]


def _worker(rank, world, port, layout, dump_folder, out_file, save_step, resume, hf_dir):
    """Train `layout` on this rank (STEPS steps; or, with `resume`, resume from the run's latest checkpoint and
    train one step); save a checkpoint and export HF (fp32) to `hf_dir` after `save_step` (resume: right after loading)."""
    from llm_training.distributed import ParallelDims
    from llm_training.distributed.utils import setup_distributed
    from llm_training.trainer import Trainer

    torch.set_num_threads(1)  # spawned ranks do not run the root conftest
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        _, degrees, cp_mode, ac_mode = LAYOUTS[layout]
        dims = ParallelDims(world_size=world, **degrees)
        device, _ = setup_distributed("cpu", dims)
        config = _config(dump_folder, cp_mode, ac_mode, checkpoint=save_step is not None or resume)
        torch.use_deterministic_algorithms(True, warn_only=True)
        trainer = Trainer(config, dims, device)
        export = lambda: trainer.spec.state_dict_adapter.export_hf_checkpoint(trainer.model, hf_dir, torch.float32)
        last = STEPS
        if resume:  # the trainer's own resume (elastic: the checkpoint was written by another world size)
            trainer._resume_or_initial_load()
            last = trainer.train_state.step + 1
            export()
        losses, qk_clip_events = {}, 0
        sharded_at_forward = _probe_sharding(trainer.model) if trainer.parallel.fsdp else []
        while trainer.train_state.step < last:
            trainer.train_state.step += 1
            step = trainer.train_state.step
            rec = trainer.train_step(micro_batches(step, dims, rank))
            losses[step], qk_clip_events = rec.loss, qk_clip_events + rec.qk_clip_events
            if step == save_step:
                trainer._save(blocking=True)
                export()
        if rank == 0:
            result = {"losses": losses, "qk_clip_events": qk_clip_events}
            torch.save({**result, "defer_grad_sync": trainer.parallel.defer_grad_sync,
                        "sharded_at_forward": sharded_at_forward}, out_file)  # fmt: skip
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        if dist.is_initialized():
            destroy_process_group()


def _probe_sharding(model) -> list[bool]:
    """A list that gets, at the start of each forward of `model` (before FSDP2's own hooks), whether the first
    FSDP-managed parameter of block 0 is sharded (a DTensor) or still gathered from an earlier micro-batch."""
    from torch.distributed.tensor import DTensor

    name = next(f"layers.0.{n}" for n, p in model.layers[0].named_parameters() if isinstance(p, DTensor))
    seen = []
    model.register_forward_pre_hook(
        lambda *_: seen.append(isinstance(model.get_parameter(name), DTensor)), prepend=True
    )
    return seen


def run_layout(layout, tmp_path, port, save_step=None, resume_from=None, hf_dir=None) -> dict:
    """Run `layout` (spawned ranks; one process runs in this one) and return rank 0's results."""
    world = LAYOUTS[layout][0]
    out_file = tmp_path / f"{layout}{'_resume' if resume_from else ''}.pt"
    dump_folder = resume_from or (tmp_path / f"runs_{layout}")
    args = (world, port, layout, str(dump_folder), str(out_file), save_step, resume_from is not None, hf_dir)
    if world == 1:
        _worker(0, *args)
    else:
        mp.spawn(_worker, args=args, nprocs=world, join=True)
    return torch.load(out_file, weights_only=False)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    return run_layout("single", tmp_path_factory.mktemp("single"), port=None)


def _assert_same_losses(result, reference, layout):
    losses, expected = result["losses"], reference["losses"]
    assert sorted(losses) == list(range(1, STEPS + 1)), layout
    for step in expected:
        assert losses[step] == pytest.approx(expected[step], rel=RTOL), (layout, step, losses, expected)
    # QK-clip fired (the max logits of context-parallel ranks are MAX-reduced over the world) as often as on one
    # process
    assert result["qk_clip_events"] == reference["qk_clip_events"] > 0, (layout, result, reference)


@pytest.mark.parametrize("layout", ["fsdp2", "replicate2", "ep2", "ulysses_cp2", "ring_cp2"])
def test_layout_losses_equal_one_process(layout, single_process, tmp_path, free_port):
    result = run_layout(layout, tmp_path, free_port)
    _assert_same_losses(result, single_process, layout)
    # FSDP2 over one rank per shard group (HSDP 2 x 1): gradients reduced once per step, on the last micro-batch, and
    # the parameters gathered once per step: each step's second micro-batch (of 2 per rank) finds them gathered
    single_shard = layout == "replicate2"
    assert result["defer_grad_sync"] == single_shard, layout
    if layout in ("fsdp2", "replicate2"):
        want = [True, not single_shard] * STEPS
        assert result["sharded_at_forward"] == want, (layout, result["sharded_at_forward"])


@pytest.mark.parametrize("layout", ["fsdp2_ep2", "ep2_cp2"])
def test_losses_checkpoint_and_hf_export_reshard_to_one_process(layout, single_process, tmp_path, free_port):
    """A 4-rank layout (expert shards x FSDP shards, or x context-parallel ranks) trains like one process, and its
    step-5 DCP checkpoint resumes in one process with the same step-6 loss and the same exported weights."""
    from safetensors.torch import load_file

    hf_sharded, hf_single = tmp_path / f"hf_{layout}", tmp_path / "hf_single"
    sharded = run_layout(layout, tmp_path, free_port, save_step=SAVE_STEP, hf_dir=str(hf_sharded))
    _assert_same_losses(sharded, single_process, layout)
    resumed = run_layout("single", tmp_path, None, resume_from=tmp_path / f"runs_{layout}", hf_dir=str(hf_single))
    assert list(resumed["losses"]) == [SAVE_STEP + 1]
    assert resumed["losses"][SAVE_STEP + 1] == pytest.approx(sharded["losses"][SAVE_STEP + 1], rel=RTOL)
    files = sorted(p.name for p in hf_sharded.glob("*.safetensors"))
    assert files and files == sorted(p.name for p in hf_single.glob("*.safetensors"))
    for name in files:
        mine, ref = load_file(hf_sharded / name), load_file(hf_single / name)
        assert mine.keys() == ref.keys() and any(".experts." in k for k in ref)
        for key in ref:
            torch.testing.assert_close(mine[key], ref[key], rtol=0, atol=0, msg=key)
