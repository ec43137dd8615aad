"""LR schedules at key steps vs closed forms, one scheduler over two optimizers, state round trip."""

import math

import pytest
import torch

from optimizer import LRScheduler

BASE = 0.01


def _opts():
    a = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=BASE)
    b = torch.optim.AdamW([torch.zeros(2, requires_grad=True)], lr=2 * BASE)
    return [a, b]


def _lrs(decay_type, steps, warmup=10, total=110, m=0.1, wsd=0.2):
    opts = _opts()
    sched = LRScheduler(opts, warmup, total, decay_type, m, wsd)
    out = []
    for _ in range(steps):
        out.append(opts[0].param_groups[0]["lr"] / BASE)
        assert opts[1].param_groups[0]["lr"] == pytest.approx(2 * BASE * out[-1])  # same factor, own base
        sched.step()
    return out


@pytest.mark.parametrize("decay_type", ["cosine", "linear", "wsd"])
def test_warmup_is_linear_and_reaches_one(decay_type):
    f = _lrs(decay_type, 12)
    assert f[0] == pytest.approx(0.1) and f[4] == pytest.approx(0.5) and f[9] == pytest.approx(1.0)


def test_cosine_key_steps():
    f = _lrs("cosine", 115)
    # decay steps s = 10..109, progress p = (s - 9) / 100
    assert f[59] == pytest.approx(0.1 + 0.9 * 0.5)  # p = 0.5: halfway
    assert f[34] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert f[109] == pytest.approx(0.1) and f[114] == pytest.approx(0.1)  # last step at min, then stays


def test_linear_key_steps():
    f = _lrs("linear", 111)
    assert f[10] == pytest.approx(1 - 0.9 * 0.01)
    assert f[59] == pytest.approx(0.55)
    assert f[109] == pytest.approx(0.1) and f[110] == pytest.approx(0.1)


def test_wsd_key_steps():
    f = _lrs("wsd", 111)  # 22 decay steps (0.2 * 110) at the end: s = 88..109
    assert all(v == pytest.approx(1.0) for v in f[9:88])
    assert f[88] == pytest.approx(1 - 0.9 / 22)
    assert f[98] == pytest.approx(1 - 0.9 * 11 / 22)
    assert f[109] == pytest.approx(0.1) and f[110] == pytest.approx(0.1)


def test_state_dict_round_trip():
    opts = _opts()
    sched = LRScheduler(opts, 10, 110, "cosine", 0.1)
    for _ in range(37):
        sched.step()
    saved = sched.state_dict()
    fresh_opts = _opts()
    fresh = LRScheduler(fresh_opts, 10, 110, "cosine", 0.1)
    fresh.load_state_dict(saved)
    assert fresh.get_last_lr() == pytest.approx(sched.get_last_lr())
    sched.step()
    fresh.step()
    assert fresh.get_last_lr() == pytest.approx(sched.get_last_lr())


def test_invalid_config_is_rejected():
    with pytest.raises(ValueError, match="decay_type"):
        LRScheduler(_opts(), 1, 10, "step")
    with pytest.raises(ValueError, match="warmup_steps"):
        LRScheduler(_opts(), 20, 10)
