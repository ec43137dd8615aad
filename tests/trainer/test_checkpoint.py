"""CheckpointManager: round trip of model / optimizer / per-rank blobs, atomic publish (a save killed
mid-way leaves the previous checkpoint loadable and its tmp dir ignored and cleaned), keep-last-N, async."""

import random

import pytest
import torch
import torch.distributed.checkpoint as dcp

from llm_training.trainer.checkpoint import (
    COMPLETE_MARKER,
    BlobState,
    CheckpointManager,
    ModelState,
    complete_steps,
    rng_state,
    set_rng_state,
)


class _Opt:
    """Stateful optimizer wrapper as the trainer passes it (FQN-keyed state)."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.opt)

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.opt, sd)


def _setup(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    model.register_buffer("bias_buf", torch.randn(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    box = {"data": {"position": seed, "rows": [[seed, 1], [2]]}}
    state = {
        "model": ModelState(model),
        "optimizer": _Opt(model, opt),
        "dataloader_dp_rank_0": BlobState(lambda: box["data"], lambda s: box.update(data=s)),
        "train_state": {"step": seed},
    }
    return model, opt, box, state


def _params(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_round_trip_restores_everything(tmp_path):
    model, opt, box, state = _setup(1)
    mgr = CheckpointManager(tmp_path, keep_latest_k=0)
    mgr.save(1, state)
    saved, saved_opt = _params(model), opt.state_dict()["state"][0]["exp_avg"].clone()
    model2, opt2, box2, state2 = _setup(2)
    assert mgr.latest_step() == 1
    mgr.load(1, state2)
    assert all(torch.equal(v, _params(model2)[k]) for k, v in saved.items())
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], saved_opt)
    assert box2["data"] == {"position": 1, "rows": [[1, 1], [2]]}
    assert state2["train_state"]["step"] == 1


def test_killed_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    model, _, _, state = _setup(1)
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, state)
    at_step_1 = _params(model)
    with torch.no_grad():
        model[0].weight.add_(1.0)

    real_save = dcp.save

    def dying_save(sd, checkpoint_id, **kw):  # write the files, then "die" before the publish
        real_save(sd, checkpoint_id=checkpoint_id, **kw)
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(dcp, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(2, state)
    monkeypatch.setattr(dcp, "save", real_save)
    leftovers = [d.name for d in tmp_path.iterdir() if ".tmp-" in d.name]
    assert len(leftovers) == 1 and leftovers[0].startswith("step-2.tmp-")
    (tmp_path / "step-3").mkdir()  # a step dir without the marker is not a checkpoint either
    assert complete_steps(tmp_path) == [1]

    mgr2 = CheckpointManager(tmp_path)  # a restarted job
    assert not [d for d in tmp_path.iterdir() if ".tmp-" in d.name]  # stale tmp cleaned
    assert mgr2.latest_step() == 1
    model2, _, _, state2 = _setup(5)
    mgr2.load(1, state2)
    assert all(torch.equal(v, _params(model2)[k]) for k, v in at_step_1.items())
    with pytest.raises(FileNotFoundError, match="incomplete"):
        mgr2.load(3, state2)


def test_keep_latest_k(tmp_path):
    _, _, _, state = _setup(1)
    mgr = CheckpointManager(tmp_path, keep_latest_k=2)
    for step in (1, 2, 3, 4):
        mgr.save(step, state)
    assert complete_steps(tmp_path) == [3, 4]
    assert sorted(d.name for d in tmp_path.iterdir()) == ["step-3", "step-4"]
    assert (tmp_path / "step-4" / COMPLETE_MARKER).is_file()


def test_async_save_publishes_on_wait(tmp_path):
    model, _, _, state = _setup(1)
    mgr = CheckpointManager(tmp_path, async_mode="async")
    mgr.save(1, state)
    mgr.save(2, state)  # waits for (and publishes) step 1 first
    mgr.close()
    assert complete_steps(tmp_path) == [1, 2]
    model2, _, _, state2 = _setup(3)
    mgr.load(2, state2)
    assert torch.equal(model2[0].weight, model[0].weight)


def test_rng_state_round_trip():
    state = rng_state()
    a = (random.random(), torch.rand(3))
    set_rng_state(state)
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])
