"""Resuming a run on another number of ranks (gloo, CPU): 1 -> 2, 2 -> 4 and 2 -> 1.

One sequence per rank per step (the global batch follows the world size, to keep the test small).
Checked: the step count continues; the model and the optimizer state (Muon momentum, AdamW moments,
fp32 replicated params, expert biases) the resumed ranks start from are bitwise the saved ones, resharded;
and every record is trained exactly once per epoch across the changes (one document per row, `pad`, so a
record counts as trained once a returned batch holds it)."""

import datetime
import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import llm_training.data.dataloader as dataloader_module
from llm_training.config import ConfigManager
from llm_training.config.job_config import PACKAGE_DIR
from llm_training.distributed import ParallelDims
from llm_training.distributed.utils import destroy_process_group, setup_distributed

DEBUG_CPU_TOML = PACKAGE_DIR / "motif" / "train_configs" / "debug_cpu.toml"
NUM_RECORDS = 5  # one document per rank per step: A ends inside epoch 0, B inside epoch 1, C and D in epoch 2


def _config(dump_folder, data_path, steps):
    return ConfigManager().parse_args([
        "--job.config_file", str(DEBUG_CPU_TOML), f"--job.dump_folder={dump_folder}", "--job.run_name=t",
        f"--training.dataset_path={data_path}", "--huggingface_dataset.shuffle=false",
        "--huggingface_dataset.packing=pad", "--training.local_batch_size=1",
        "--training.seq_len=32", f"--training.steps={steps}", "--lr_scheduler.warmup_steps=1",
        "--checkpoint.interval=100", "--checkpoint.keep_latest_k=0", "--metrics.log_freq=1",
    ])  # fmt: skip


def _full(value):
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _full_state(trainer) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and optimizer-state tensor as a full tensor (collective)."""
    state = {f"model.{k}": v for k, v in trainer.model.state_dict().items()}
    state |= {f"optimizer.{k}": v for k, v in trainer.optimizers.state_dict().items() if torch.is_tensor(v)}
    return {k: _full(v).detach().clone() for k, v in state.items()}


def _phase(rank, world, port, dump_folder, data_path, steps, out_folder):
    """Train to `steps` (resuming from the checkpoint in dump_folder); save what the test checks."""
    from llm_training.trainer import Trainer

    torch.set_num_threads(1)  # up to 4 ranks share the CPU cores
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    trained, real_collate = [], dataloader_module.collate_rows

    def recording_collate(rows, seq_len, pad_id):
        trained.extend(doc.source for row in rows for doc in row)
        return real_collate(rows, seq_len, pad_id)

    dataloader_module.collate_rows = recording_collate
    try:
        dims = ParallelDims(1, -1, 1, 1, world)
        device, _ = setup_distributed("cpu", dims)  # builds the mesh on the gloo group (none in one process)
        trainer = Trainer(_config(dump_folder, data_path, steps), dims, device)
        trainer.dataloader.prefetch_batches = 0  # every batch made is a batch trained
        loaded, real_step = {}, trainer.train_step

        def step_capturing_the_loaded_state(micro_batches):  # before the first step: what the run resumed from
            if not loaded:
                loaded.update(_full_state(trainer))
            return real_step(micro_batches)

        trainer.train_step = step_capturing_the_loaded_state
        result = trainer.fit()
        final = _full_state(trainer)
        if rank == 0:
            torch.save({"loaded": loaded, "final": final}, os.path.join(out_folder, "state.pt"))
        with open(os.path.join(out_folder, f"rank{rank}.json"), "w") as f:
            json.dump({"start": result.start_step, "last": result.last_step, "trained": trained}, f)
    finally:
        dataloader_module.collate_rows = real_collate
        if world > 1:
            destroy_process_group()


def _run_phase(world, free_port, root, name, steps, resume_from=None):
    dump, out = root / name, root / f"{name}-out"
    out.mkdir()
    if resume_from is not None:
        shutil.copytree(root / resume_from / "t" / "checkpoint", dump / "t" / "checkpoint")
    args = (world, free_port, str(dump), str(root / "data.jsonl"), steps, str(out))
    if world == 1:
        _phase(0, *args)
    else:
        mp.spawn(_phase, args=args, nprocs=world, join=True)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    return ranks, torch.load(out / "state.pt", weights_only=True)


def _check_resumed(previous, resumed, start, last):
    prev_state = previous[1]
    ranks, state = resumed
    assert [(r["start"], r["last"]) for r in ranks] == [(start, last)] * len(ranks)  # the step count continues
    assert state["loaded"].keys() == prev_state["final"].keys()
    assert any(".momentum_buffer" in k for k in state["loaded"]) and any(".exp_avg_sq" in k for k in state["loaded"])
    assert any(k.endswith("expert_bias") for k in state["loaded"]) and any("router.gate" in k for k in state["loaded"])
    for key, saved in prev_state["final"].items():  # resharded bitwise
        torch.testing.assert_close(state["loaded"][key], saved, rtol=0, atol=0, msg=key)


def _check_data(phases):
    """Every record once per epoch that the last phase's ranks have all left, no record twice in any epoch."""
    trained = [tuple(src) for ranks in phases for r in ranks for src in r["trained"]]
    assert len(trained) == len(set(trained))  # nothing repeated
    finished = min(r["trained"][-1][0] for r in phases[-1])  # every rank of the last phase is past it
    assert finished >= 2  # epochs 0 and 1 both spanned a layout change
    for epoch in range(finished):
        assert sorted(g for e, g in trained if e == epoch) == list(range(NUM_RECORDS)), epoch  # nothing skipped


def test_resume_one_to_two_then_two_to_four_and_two_to_one(tmp_path, free_port):
    with open(tmp_path / "data.jsonl", "w") as f:
        for i in range(NUM_RECORDS):
            turns = [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
            f.write(json.dumps({"conversations": turns}) + "\n")
    a = _run_phase(1, free_port, tmp_path, "A", steps=2)
    assert [(r["start"], r["last"]) for r in a[0]] == [(0, 2)]

    b = _run_phase(2, free_port, tmp_path, "B", steps=4, resume_from="A")  # 1 -> 2
    _check_resumed(a, b, start=2, last=4)
    # A trained positions 0, 1 of epoch 0; B's ranks shared the rest of it (2, 4 | 3), then rank 1 went on
    # with its shard of epoch 1 (1, 3)
    assert [r["trained"] for r in a[0] + b[0]] == [[[0, 0], [0, 1]], [[0, 2], [0, 4]], [[0, 3], [1, 1]]]

    c = _run_phase(4, free_port, tmp_path, "C", steps=6, resume_from="B")  # 2 -> 4
    _check_resumed(b, c, start=4, last=6)
    _check_data([a[0], b[0], c[0]])

    d = _run_phase(1, free_port, tmp_path, "D", steps=9, resume_from="B")  # 2 -> 1
    _check_resumed(b, d, start=4, last=9)
    _check_data([a[0], b[0], d[0]])
