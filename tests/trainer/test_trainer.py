"""The train loop on CPU with motif3_debug: stop/resume reproduces the uninterrupted run exactly,
gradient accumulation matches the full batch, non-finite steps are skipped / abort without a checkpoint,
and the checkpoint holds what a resume needs."""

import json
import math

import pytest
import torch

from llm_training.distributed import ParallelDims
from llm_training.distributed.fsdp import REDUCE_STREAMS
from llm_training.trainer import NonFiniteLossError, Trainer, train
from llm_training.trainer.checkpoint import complete_steps
from llm_training.distributed.utils import destroy_process_group

DIMS = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=1)
CPU = torch.device("cpu")


class _Crash(Exception):
    pass


def _crash_at_step(trainer, step):
    """Forward hook that raises during step `step` (a simulated kill after the previous checkpoint)."""

    def hook(module, args, out):
        if trainer.train_state.step == step:
            raise _Crash(f"killed at step {step}")

    trainer.model.norm.register_forward_hook(hook)


def test_stop_and_resume_reproduces_uninterrupted_losses(make_config):
    """Muon + AdamW + LR schedule + data position + RNG + expert biases all restored: bitwise-equal losses."""
    steps = ("--training.steps=4", "--checkpoint.interval=2")
    full = train(make_config("--job.run_name=full", *steps), DIMS, CPU)
    assert sorted(full.losses) == [1, 2, 3, 4]

    crashed = Trainer(make_config("--job.run_name=resumed", *steps), DIMS, CPU)
    _crash_at_step(crashed, 3)
    with pytest.raises(_Crash):
        crashed.fit()
    assert complete_steps(crashed.checkpointer.folder) == [2]

    resumed = train(make_config("--job.run_name=resumed", *steps), DIMS, CPU)
    assert resumed.start_step == 2 and sorted(resumed.losses) == [3, 4]
    for step in (3, 4):
        assert resumed.losses[step] == full.losses[step], (step, resumed.losses[step], full.losses[step])
    assert complete_steps(resumed.checkpoint_folder) == [2, 4]


def test_resume_with_another_lr_warns_and_keeps_the_checkpoint_lr(make_config, caplog):
    steps = ("--training.steps=2", "--checkpoint.interval=2", "--optimizer.lr=1e-3")
    train(make_config("--job.run_name=lr", *steps), DIMS, CPU)
    resumed = Trainer(make_config("--job.run_name=lr", "--training.steps=3", "--optimizer.lr=5e-3"), DIMS, CPU)
    with caplog.at_level("WARNING"):
        resumed.fit()
    assert "lr = 0.005 differs from the resumed checkpoint's 0.001" in caplog.text
    initial = {g["initial_lr"] for opt in resumed.optimizers.optimizers for g in opt.param_groups}
    assert initial == {1e-3}


def test_gradient_accumulation_matches_one_big_micro_batch(make_config):
    one = train(
        make_config(
            "--job.run_name=a",
            "--training.local_batch_size=4",
            "--training.steps=2",
            "--checkpoint.enable=false",
            "--optimizer.name=adamw",
        ),
        DIMS,
        CPU,
    )
    acc = train(
        make_config(
            "--job.run_name=b",
            "--training.local_batch_size=2",
            "--training.global_batch_size=4",
            "--training.steps=2",
            "--checkpoint.enable=false",
            "--optimizer.name=adamw",
        ),
        DIMS,
        CPU,
    )
    for step in (1, 2):
        assert math.isclose(one.losses[step], acc.losses[step], rel_tol=1e-5), step


def _nan_at_steps(trainer, steps):
    def hook(module, args, out):
        if trainer.train_state.step in steps:
            return out * float("nan")

    trainer.model.norm.register_forward_hook(hook)


def test_nonfinite_step_is_skipped_and_counted(make_config):
    trainer = Trainer(
        make_config("--training.steps=4", "--checkpoint.enable=false", "--optimizer.name=adamw"), DIMS, CPU
    )
    _nan_at_steps(trainer, {2})
    before = {}

    def snapshot(module, args):
        if trainer.train_state.step == 3 and not before:
            before.update({k: v.clone() for k, v in trainer.model.state_dict().items()})

    trainer.model.register_forward_pre_hook(snapshot)
    weights_after_1 = {}
    orig_step = trainer.train_step

    def step_and_record(mbs):
        rec = orig_step(mbs)
        if trainer.train_state.step == 1:
            weights_after_1.update({k: v.clone() for k, v in trainer.model.state_dict().items()})
        return rec

    trainer.train_step = step_and_record
    result = trainer.fit()
    assert result.skipped_steps == 1 and math.isnan(result.losses[2])
    assert all(math.isfinite(result.losses[s]) for s in (1, 3, 4))
    # the skipped step changed nothing: the weights entering step 3 are those after step 1
    assert all(torch.equal(before[k], weights_after_1[k]) for k in before)
    assert trainer.lr_scheduler.last_step == 3  # the scheduler did not advance on the skipped step
    lines = [json.loads(x) for x in result.metrics_path.read_text().splitlines()]
    assert lines[-1]["skipped_steps"] == 1


def test_consecutive_nonfinite_steps_abort_without_checkpoint(make_config):
    trainer = Trainer(
        make_config(
            "--training.steps=5",
            "--training.max_consecutive_nonfinite=2",
            "--checkpoint.interval=1",
            "--optimizer.name=adamw",
        ),
        DIMS,
        CPU,
    )
    _nan_at_steps(trainer, {3, 4, 5})
    with pytest.raises(NonFiniteLossError, match="max_consecutive_nonfinite"):
        trainer.fit()
    assert complete_steps(trainer.checkpointer.folder) == [1, 2]  # nothing saved for steps 3 and 4


def test_checkpoint_contents_and_config(make_config):
    result = train(make_config("--training.steps=2", "--checkpoint.interval=1"), DIMS, CPU)
    import torch.distributed.checkpoint as dcp

    from llm_training.trainer.checkpoint import safe_dcp_load

    meta = dcp.FileSystemReader(str(result.last_checkpoint)).read_metadata()
    keys = set(meta.state_dict_metadata)
    assert "model.layers.2.moe.expert_bias" in keys and "model.lm_head.weight" in keys
    assert any(k.startswith("optimizer.state.") for k in keys)
    assert {
        "lr_scheduler.last_step",
        "train_state.step",
        "train_state.config_toml",
        "dataloader.json",  # every rank's data loader / RNG state under one key each (rank-independent)
        "rng.json",
    } <= keys
    state = {"train_state": {"step": 0, "config_toml": ""}}
    safe_dcp_load(state, result.last_checkpoint)
    assert state["train_state"]["step"] == 2 and "[training]" in state["train_state"]["config_toml"]


@pytest.mark.parametrize("fmt", ["hf", "dcp"])
def test_initial_load_path_sets_weights_when_no_checkpoint(make_config, tmp_path, fmt):
    from llm_training.convert import main as convert_main
    from llm_training.motif import get_flavor
    from llm_training.motif.model import Motif3Model
    from llm_training.motif.state_dict_adapter import export_hf_checkpoint

    torch.manual_seed(123)
    source = Motif3Model(get_flavor("motif3_debug"))
    source.init_weights()
    export_hf_checkpoint(source, tmp_path / "hf", dtype=torch.float32)
    path = tmp_path / "hf"
    if fmt == "dcp":
        assert convert_main(["hf-to-dcp", str(path), str(tmp_path / "dcp")]) == 0
        path = tmp_path / "dcp"
    trainer = Trainer(
        make_config(f"--checkpoint.initial_load_path={path}", f"--checkpoint.initial_load_format={fmt}"), DIMS, CPU
    )
    trainer._resume_or_initial_load()
    got = trainer.model.state_dict()
    assert all(torch.equal(v, got[k]) for k, v in source.state_dict().items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_fsdp_training_resumes_exactly(make_config):
    """One GPU: FSDP2 (1 rank) bf16 params / fp32 master; stop + resume gives the same losses. Two micro-batches
    per step: over one rank FSDP2 accumulates their gradients unsharded (bf16 from autograd, fp32 in FSDP2) and
    reduces at the last one only, the path of every one-GPU benchmark, which a gradient handed in another dtype or
    only by some micro-batches breaks (session 35: "FSDP reduce-scatter expects uniform gradient dtype")."""
    opts = (
        "--training.device=cuda",
        "--training.global_batch_size=4",  # local 2: two micro-batches
        "--training.mixed_precision_param=bfloat16",
        "--training.steps=4",
        "--checkpoint.interval=2",
    )
    from llm_training.distributed.utils import setup_distributed

    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=1)
    device, created = setup_distributed("cuda", dims)  # a 1-rank nccl group: FSDP2 needs one, even on one GPU
    try:
        full = train(make_config("--job.run_name=gpu_full", *opts), dims, device)
        assert all(math.isfinite(v) for v in full.losses.values())
        crashed = Trainer(make_config("--job.run_name=gpu_resumed", *opts), dims, device)
        _crash_at_step(crashed, 3)
        with pytest.raises(_Crash):
            crashed.fit()
        # FSDP2 over one rank reduces on the compute stream (parallelize_motif: nothing to overlap, memory to gain)
        ctx = crashed.model._get_fsdp_state()._comm_ctx
        assert all(getattr(ctx, name) == ctx.device_handle.current_stream() for name in REDUCE_STREAMS)
        resumed = train(make_config("--job.run_name=gpu_resumed", *opts), dims, device)
    finally:
        if created:
            destroy_process_group()
    for step in (3, 4):
        assert resumed.losses[step] == pytest.approx(full.losses[step], rel=1e-3), step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_step_reads_nothing_from_the_device_after_the_optimizer_launch(make_config):
    """Once `optimizers.step()` is launched the training step reads nothing from the GPU (torch's sync debug mode
    "error" raises on any synchronizing call from there to the end of the step: QK-clip, the expert-bias update,
    the step's record): such a read would wait for the whole optimizer step and leave the GPU idle through the
    host's step boundary. The step's host values are read once, before the launch."""
    from llm_training.distributed.utils import setup_distributed

    opts = (
        "--job.run_name=gpu_no_sync",
        "--training.device=cuda",
        "--training.global_batch_size=4",  # two micro-batches
        "--training.mixed_precision_param=bfloat16",
        "--training.steps=3",
        "--checkpoint.enable=false",
    )
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=1)
    device, created = setup_distributed("cuda", dims)
    try:
        trainer = Trainer(make_config(*opts), dims, device)
        launches, real_optimizer_step, real_train_step = [], trainer.optimizers.step, trainer.train_step

        def optimizer_step_then_no_reads(grad_scale):
            real_optimizer_step(grad_scale=grad_scale)
            launches.append(trainer.train_state.step)
            torch.cuda.set_sync_debug_mode("error")

        def train_step(micro_batches):
            try:
                return real_train_step(micro_batches)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        trainer.optimizers.step = optimizer_step_then_no_reads
        trainer.train_step = train_step
        result = trainer.fit()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        if created:
            destroy_process_group()
    assert len(launches) == 3 and all(math.isfinite(v) for v in result.losses.values())


def test_out_of_memory_names_step_and_config_keys(make_config):
    trainer = Trainer(
        make_config("--training.steps=3", "--checkpoint.enable=false", "--optimizer.name=adamw"), DIMS, CPU
    )

    def hook(module, args, out):
        if trainer.train_state.step == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    trainer.model.norm.register_forward_hook(hook)
    with pytest.raises(torch.OutOfMemoryError) as e:
        trainer.fit()
    msg = str(e.value)
    assert "step 2" in msg and "training.local_batch_size" in msg and "activation_checkpoint.mode" in msg


def test_run_started_from_an_hf_dir_records_its_config_for_export(make_config, tmp_path):
    """train_state.model_config_json of a run started from an HF directory is that directory's config.json
    (an unknown field kept) plus its path, from which `convert dcp-to-hf` exports and copies its files."""
    import json

    from llm_training.motif import get_flavor
    from llm_training.motif.model import Motif3Model
    from llm_training.motif.state_dict_adapter import SOURCE_DIR_KEY, export_hf_checkpoint

    source = Motif3Model(get_flavor("motif3_debug"))
    source.init_weights()
    export_hf_checkpoint(source, tmp_path / "hf", dtype=torch.float32)
    config = json.loads((tmp_path / "hf" / "config.json").read_text()) | {"release_note": "kept"}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    trainer = Trainer(make_config(f"--checkpoint.initial_load_path={tmp_path / 'hf'}"), DIMS, CPU)
    stored = json.loads(trainer.train_state.model_config_json)
    assert stored == config | {SOURCE_DIR_KEY: str((tmp_path / "hf").resolve())}


def test_each_step_counts_its_real_tokens(make_config):
    """The step record's real tokens are the loader rows' non-padding tokens (pad packing leaves a tail in every
    row), at most the padded count, and metrics.jsonl reports the packing efficiency they give."""
    trainer = Trainer(
        make_config(
            "--training.steps=2",
            "--checkpoint.enable=false",
            "--huggingface_dataset.packing=pad",
            "--training.seq_len=256",
        ),
        DIMS,
        CPU,
    )
    seen, recs, orig_step = [], [], trainer.train_step

    def step_and_record(mbs):
        seen.append(sum(int((mb["labels"] != -100).sum()) for mb in mbs))
        rec = orig_step(mbs)
        recs.append(rec)
        return rec

    trainer.train_step = step_and_record
    result = trainer.fit()
    for rec, labelled in zip(recs, seen):
        assert labelled < rec.real_tokens < rec.tokens  # padding excluded; every document has unlabelled tokens
    lines = [json.loads(x) for x in result.metrics_path.read_text().splitlines()]
    assert 0 < lines[-1]["packing_efficiency"] < 1


def test_first_step_logs_what_compile_did_and_warns_on_graph_breaks(make_config, monkeypatch, caplog):
    """With [compile] enable, the first step of the run (only it) logs what dynamo compiled, and a warning naming
    the reasons when a graph broke (a break inside a checkpointed block runs the whole block eagerly). Dynamo's
    counters are stood in for here: the compile itself is tested in tests/distributed/test_compile.py."""
    from llm_training.motif import parallelize
    from llm_training.trainer import trainer as trainer_module

    stats = {
        "compiled_frames": 3, "unique_graphs": 1, "graph_breaks": 2, "recompiles": 1, "guard_failures": [],
        "compile_time_s": {"total_forward_s": 1.5, "total_backward_s": 0.5},
        "graph_break_reasons": ["2x Skip calling `torch.compiler.disable()`d function"],
    }  # fmt: skip
    monkeypatch.setattr(parallelize, "apply_compile", lambda blocks, sublayers=False, kernel_tuning="benchmark": None)
    monkeypatch.setattr(trainer_module, "compile_stats", lambda max_reasons=8: stats)
    with caplog.at_level("INFO"):
        train(make_config("--compile.enable", "--training.steps=2", "--checkpoint.interval=2"), DIMS, CPU)
    lines = [r for r in caplog.records if r.getMessage().startswith("[compile] ")]
    assert [r.levelname for r in lines] == ["INFO", "WARNING"], [r.getMessage() for r in lines]  # step 2: nothing
    assert lines[0].getMessage() == (
        "[compile] first step: 1 graphs from 3 frames (1 recompiles), 2 graph breaks; forward compile 1.5 s, "
        "backward 0.5 s"
    )
    assert "broke a graph 2 times" in lines[1].getMessage() and "2x Skip calling" in lines[1].getMessage()


def test_a_later_step_that_compiles_is_named_with_its_guard_failure(make_config, monkeypatch, caplog):
    """A compiled step after the first should compile nothing (each recompile costs that graph's compile again and,
    past dynamo's recompile limit, runs it eagerly): the trainer warns at the step that did, with the guard failures
    new since the step before (how a batch with another document count recompiled every block, before cu_seqlens'
    size was made dynamic). Dynamo's counters are stood in for, as above."""
    from llm_training.motif import parallelize
    from llm_training.trainer import trainer as trainer_module

    first = {
        "compiled_frames": 2, "unique_graphs": 2, "graph_breaks": 0, "recompiles": 1,
        "guard_failures": ["forward: 0/0: window is None"],
        "compile_time_s": {"total_forward_s": 1.5, "total_backward_s": 0.5}, "graph_break_reasons": [],
    }  # fmt: skip
    later = {**first, "compiled_frames": 4, "recompiles": 3}
    later["guard_failures"] = [*first["guard_failures"], "forward: 0/1: tensor 'cu_seqlens' size mismatch at index 0"]
    snapshots = iter([first, first, later, later])  # first step (snapshot and report), steps 2, 3, 4
    monkeypatch.setattr(parallelize, "apply_compile", lambda blocks, sublayers=False, kernel_tuning="benchmark": None)
    monkeypatch.setattr(trainer_module, "compile_stats", lambda max_reasons=8: next(snapshots))
    with caplog.at_level("INFO"):
        train(make_config("--compile.enable", "--training.steps=4", "--checkpoint.interval=4"), DIMS, CPU)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.getMessage().startswith("[compile] ")]
    assert lines[1:] == [
        (
            "WARNING",
            "[compile] step 3 compiled 2 more frame(s) (3 recompiles in all); guard failures new since then: "
            "forward: 0/1: tensor 'cu_seqlens' size mismatch at index 0 (TORCH_LOGS=recompiles prints them as they "
            "happen)",
        )
    ], lines


def test_the_kernel_prebuild_starts_as_soon_as_the_model_exists(make_config, monkeypatch):
    """flash-attn-4's side process starts from the freshly built model, before the parallelization, the weights'
    initialisation and the optimizer state (its head start over the first step's attention call), and the trainer
    keeps its handle. The side process itself is tested in tests/layers/attention/test_fa4_prebuild.py."""
    import dataclasses

    from llm_training.trainer import trainer as trainer_module

    events, handle = [], object()
    spec = trainer_module.MOTIF3_SPEC

    def record_parallelize(model, *args, **kwargs):
        events.append("parallelize")
        return spec.parallelize(model, *args, **kwargs)

    def record_prebuild(model, job_config, parallel_dims, device):
        events.append(("prebuild", type(model).__name__))
        return handle

    monkeypatch.setattr(trainer_module, "MOTIF3_SPEC", dataclasses.replace(spec, parallelize=record_parallelize))
    monkeypatch.setattr(trainer_module, "start_fa4_prebuild", record_prebuild)
    trainer = Trainer(make_config(), DIMS, CPU)
    assert events == [("prebuild", "Motif3Model"), "parallelize"]
    assert trainer.kernel_prebuild is handle
