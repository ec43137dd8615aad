"""CheckpointManager: round trip of model / optimizer / per-rank JSON states, atomic publish (a save killed
mid-way leaves the previous checkpoint loadable and its tmp dir ignored and cleaned), keep-last-N, async;
integrity (a truncated, deleted or bit-flipped file is found, named, and the previous checkpoint used) and
safe loading (a metadata pickle naming any other global is refused)."""

import hashlib
import json
import logging
import pickle
import random

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from llm_training.trainer.checkpoint import (
    COMPLETE_MARKER,
    CheckpointDamagedError,
    CheckpointManager,
    ModelState,
    RankStates,
    complete_steps,
    restore_rng_of_rank,
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
        "dataloader": RankStates(lambda: box["data"], lambda states: box.update(data=states[0])),
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
    state = json.loads(json.dumps(rng_state()))  # stored as JSON
    a = (random.random(), np.random.rand(), torch.rand(3))
    set_rng_state(state)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[:2] == b[:2] and torch.equal(a[2], b[2])


def test_rng_on_another_world_size_is_reseeded_per_rank():
    saved = [rng_state(), rng_state()]
    draws = []
    for rank in (0, 1, 2, 0):
        restore_rng_of_rank(saved, rank, world_size=3)
        draws.append(torch.rand(2))
    assert torch.equal(draws[0], draws[3])  # deterministic
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])  # distinct per rank


# ------------------------------------------------------------------------------------------- integrity
def _two_checkpoints(tmp_path, **kwargs):
    model, _, _, state = _setup(1)
    mgr = CheckpointManager(tmp_path, **kwargs)
    mgr.save(1, state)
    at_step_1 = _params(model)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    mgr.save(2, state)
    return mgr, at_step_1


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_bit_in_a_weight(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda d: _truncate(d / "__0_0.distcp"), "__0_0.distcp: "),
        (lambda d: (d / ".metadata").unlink(), ".metadata: missing"),
        (lambda d: _flip_a_bit_in_a_weight(d / "__0_0.distcp"), "__0_0.distcp: SHA-256 differs"),
        (lambda d: (d / COMPLETE_MARKER).write_text("step 2\n"), "unreadable completion marker"),
    ],
    ids=["truncated-shard", "deleted-metadata", "flipped-bit", "bad-marker"],
)
def test_damaged_newest_checkpoint_falls_back_to_the_previous(damage, named, tmp_path, caplog):
    mgr, at_step_1 = _two_checkpoints(tmp_path)
    damage(tmp_path / "step-2")
    model2, _, _, state2 = _setup(7)
    with caplog.at_level(logging.ERROR):
        assert mgr.load_latest(state2) == 1
    assert named in caplog.text and "step-2" in caplog.text
    assert all(torch.equal(v, _params(model2)[k]) for k, v in at_step_1.items())
    assert complete_steps(tmp_path) == [1]  # step-2 moved aside, so step 2 is saved again when reached
    assert [d.name.split(".damaged-")[0] for d in tmp_path.iterdir() if ".damaged-" in d.name] == ["step-2"]
    mgr.save(2, state2)
    assert complete_steps(tmp_path) == [1, 2]


def test_damaged_checkpoint_stops_the_run_when_asked(tmp_path):
    mgr, _ = _two_checkpoints(tmp_path, on_damaged="stop")
    _truncate(tmp_path / "step-2" / "__0_0.distcp")
    _, _, _, state2 = _setup(7)
    with pytest.raises(CheckpointDamagedError, match=r"step-2/__0_0.distcp: \d+ bytes.*on_damaged = 'fall_back'"):
        mgr.load_latest(state2)
    assert complete_steps(tmp_path) == [1, 2]  # nothing moved


def test_every_checkpoint_damaged_stops_the_run(tmp_path):
    mgr, _ = _two_checkpoints(tmp_path)
    for step in (1, 2):
        (tmp_path / f"step-{step}" / ".metadata").unlink()
    _, _, _, state2 = _setup(7)
    with pytest.raises(CheckpointDamagedError, match="every checkpoint in .* is damaged"):
        mgr.load_latest(state2)


def test_metadata_naming_another_global_is_refused(tmp_path, capsys):
    class Evil:
        def __reduce__(self):
            return (print, ("this must not run",))

    mgr, _ = _two_checkpoints(tmp_path)
    folder = tmp_path / "step-2"
    (folder / ".metadata").write_bytes(pickle.dumps(Evil()))
    marker = json.loads((folder / COMPLETE_MARKER).read_text())  # a consistent marker: only the unpickler stops it
    data = (folder / ".metadata").read_bytes()
    marker["files"][".metadata"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / COMPLETE_MARKER).write_text(json.dumps(marker))
    _, _, _, state2 = _setup(7)
    with pytest.raises(pickle.UnpicklingError, match="builtins.print, which is not a DCP metadata type"):
        mgr.load(2, state2)
    assert "this must not run" not in capsys.readouterr().out
