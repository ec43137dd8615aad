"""The train loop on 2 gloo CPU ranks (FSDP2 + distributed Muon + QK-clip + expert-bias update): the sharded
model starts from the single-process initial weights; a SIGTERM
delivered to ONE rank stops BOTH at the same step with one complete checkpoint holding every rank's data
loader and RNG state (one key each), and the replicated state (fp32 params outside FSDP, expert biases) stays identical
on the ranks."""

import datetime
import os
import signal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llm_training.config import ConfigManager
from llm_training.config.job_config import PACKAGE_DIR
from llm_training.distributed import ParallelDims
from llm_training.distributed.utils import destroy_process_group

DEBUG_CPU_TOML = PACKAGE_DIR / "motif" / "train_configs" / "debug_cpu.toml"
SIGNAL_RANK, SIGNAL_STEP, STEPS = 1, 2, 5
INIT_CHECKED = ("embed_tokens.weight", "layers.0.self_attn.wq_a.weight", "layers.2.moe.experts.gate_up_proj")


def _config(dump_folder):
    return ConfigManager().parse_args([
        "--job.config_file", str(DEBUG_CPU_TOML), f"--job.dump_folder={dump_folder}", "--job.run_name=t",
        "--training.local_batch_size=1", "--training.global_batch_size=4", "--training.seq_len=32",
        f"--training.steps={STEPS}", "--training.deterministic", "--lr_scheduler.warmup_steps=1",
        "--checkpoint.interval=100", "--checkpoint.keep_latest_k=0", "--metrics.log_freq=1",
        "--optimizer.qk_clip_threshold=0.5",  # low, so that QK-clip really rescales weights
    ])  # fmt: skip


def _worker(rank, world, port, dump_folder, out_folder):
    from torch.distributed.tensor import DTensor

    from llm_training.distributed.utils import setup_distributed
    from llm_training.trainer import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=world)
        device, _ = setup_distributed("cpu", dims)  # the process group exists: builds the mesh only
        trainer = Trainer(_config(dump_folder), dims, device)
        assert trainer.accum == 2 and trainer.parallel.fsdp
        init = {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters() if n in INIT_CHECKED}

        def send_signal(module, args):
            if rank == SIGNAL_RANK and trainer.train_state.step == SIGNAL_STEP and trainer.stop_signal.received is None:
                os.kill(os.getpid(), signal.SIGTERM)  # only this rank is told to stop

        trainer.model.register_forward_pre_hook(send_signal)
        result = trainer.fit()
        plain = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not isinstance(p, DTensor)}
        buffers = {n: b.clone() for n, b in trainer.model.named_buffers() if n.endswith("expert_bias")}
        torch.save(
            {"init": init, "last_step": result.last_step, "stopped": result.stopped_by_signal, "losses": result.losses,
             "plain": plain, "expert_bias": buffers, "checkpoint": str(result.last_checkpoint)},
            os.path.join(out_folder, f"rank{rank}.pt"),
        )  # fmt: skip
    finally:
        destroy_process_group()


def _single_process_init(seed):
    from llm_training.motif import get_flavor
    from llm_training.motif.model import Motif3Model

    model = Motif3Model(get_flavor("motif3_debug"))
    torch.manual_seed(seed)
    model.init_weights()
    return dict(model.named_parameters())


def test_sigterm_on_one_rank_stops_all_ranks_at_the_same_step(tmp_path, free_port):
    from torch.distributed.checkpoint import FileSystemReader

    from llm_training.trainer.checkpoint import complete_steps

    out = tmp_path / "results"
    out.mkdir()
    mp.spawn(_worker, args=(2, free_port, str(tmp_path / "runs"), str(out)), nprocs=2, join=True)
    r0, r1 = (torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    # the sharded initial weights are the single-process ones (not the same random rows on every shard)
    reference = _single_process_init(_config(tmp_path).training.seed)
    assert sorted(r0["init"]) == sorted(INIT_CHECKED)
    for name in INIT_CHECKED:
        torch.testing.assert_close(r0["init"][name], reference[name].detach(), rtol=0, atol=0, msg=name)
    for r in (r0, r1):
        assert r["last_step"] == SIGNAL_STEP and r["stopped"], (r["last_step"], r["stopped"])
        assert sorted(r["losses"]) == list(range(1, SIGNAL_STEP + 1))
    assert r0["losses"] == r1["losses"]  # the reported loss is the global one
    folder = tmp_path / "runs" / "t" / "checkpoint"
    assert complete_steps(folder) == [SIGNAL_STEP] and r0["checkpoint"] == str(folder / f"step-{SIGNAL_STEP}")
    keys = set(FileSystemReader(r0["checkpoint"]).read_metadata().state_dict_metadata)
    assert {"dataloader.json", "rng.json"} <= keys  # one key each, holding the states of both ranks
    assert any(k.endswith("moe.expert_bias") for k in keys)
    # fp32 params kept outside FSDP2 (router gate, mHC, PolyNorm) and the expert biases: bitwise the same on
    # both ranks (summed gradients / all-reduced counts), and the biases did move away from their zero init
    assert r0["plain"].keys() == r1["plain"].keys() and any("router.gate" in n for n in r0["plain"])
    for name in r0["plain"]:
        torch.testing.assert_close(r0["plain"][name], r1["plain"][name], rtol=0, atol=0, msg=name)
    for name in r0["expert_bias"]:
        torch.testing.assert_close(r0["expert_bias"][name], r1["expert_bias"][name], rtol=0, atol=0, msg=name)
    assert any(b.abs().sum() > 0 for b in r0["expert_bias"].values())
