"""QK-clip: recompute the logits with an explicit q.k and check the clip rule of optimizer.qk_clip."""

import os

import pytest
import torch
import torch._dynamo  # noqa: F401 - DTensor imports it lazily; load once before forking ranks
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from optimizer import QKLayout, qk_clip_

L = QKLayout(n_heads=10, n_kv_heads=2, d_nope=4, d_rope=2, d_v=3)
Q_LORA, KV_LORA, T, SCALE = 8, 6, 12, 0.3


def _weights(seed=0):
    gen = torch.Generator().manual_seed(seed)
    wq_b = torch.randn(L.n_heads * (L.d_nope + L.d_rope), Q_LORA, generator=gen, dtype=torch.float64)
    wkv_b = torch.randn(L.n_kv_heads * (L.d_nope + L.d_v), KV_LORA, generator=gen, dtype=torch.float64)
    return wq_b, wkv_b


def _inputs(seed=1):
    gen = torch.Generator().manual_seed(seed)
    c_q = torch.randn(T, Q_LORA, generator=gen, dtype=torch.float64)
    c_kv = torch.randn(T, KV_LORA, generator=gen, dtype=torch.float64)
    k_rope = torch.randn(T, L.d_rope, generator=gen, dtype=torch.float64)  # shared rope key (wkv_a, untouched)
    return c_q, c_kv, k_rope


def _logits(wq_b, wkv_b, c_q, c_kv, k_rope):
    """[n_h, T, T] scaled logits, computed head by head with explicit dot products."""
    q = (c_q @ wq_b.T).view(T, L.n_heads, L.d_nope + L.d_rope)
    kv = (c_kv @ wkv_b.T).view(T, L.n_kv_heads, L.d_nope + L.d_v)
    group = L.n_heads // L.n_kv_heads
    out = torch.empty(L.n_heads, T, T, dtype=torch.float64)
    for h in range(L.n_heads):
        k_nope = kv[:, h // group, : L.d_nope]
        out[h] = SCALE * (q[:, h, : L.d_nope] @ k_nope.T + q[:, h, L.d_nope :] @ k_rope.T)
    return out


def _rows_q(h):
    return slice(h * (L.d_nope + L.d_rope), (h + 1) * (L.d_nope + L.d_rope))


def _boosted(heads_and_factors):
    wq_b, wkv_b = _weights()
    for h, f in heads_and_factors:
        wq_b[_rows_q(h)] *= f  # force a large logit on that head
    return wq_b, wkv_b


@pytest.mark.parametrize("boost", [[(3, 40.0)], [(1, 40.0), (3, 15.0)]])
def test_clipped_heads_hit_threshold_and_others_unchanged(boost):
    wq_b, wkv_b = _boosted(boost)
    inputs = _inputs()
    before = _logits(wq_b, wkv_b, *inputs)
    max_logits = before.amax(dim=(1, 2))
    boosted = [h for h, _ in boost]
    tau = 1.01 * max(max_logits[h] for h in range(L.n_heads) if h not in boosted).item()
    assert all(max_logits[h] > tau for h in boosted)
    new_q, new_kv = wq_b.clone(), wkv_b.clone()
    stats = qk_clip_(new_q, new_kv, max_logits, L, tau)
    assert stats.num_clipped_heads == len(boosted)
    assert stats.max_logit == pytest.approx(max_logits.max().item())
    after = _logits(new_q, new_kv, *inputs)
    for h in range(L.n_heads):
        if h in boosted:
            torch.testing.assert_close(after[h].max(), torch.tensor(tau, dtype=torch.float64), rtol=1e-12, atol=0)
            # every logit of a clipped head scales by the same gamma (rope part included)
            torch.testing.assert_close(after[h], before[h] * (tau / max_logits[h]), rtol=1e-10, atol=1e-12)
        else:
            torch.testing.assert_close(after[h], before[h], rtol=1e-10, atol=1e-12)
    # group 1 (heads 5-9, KV head 1) had no head over tau: its weights are untouched
    torch.testing.assert_close(new_q[_rows_q(5).start :], wq_b[_rows_q(5).start :], rtol=0, atol=0)
    kv1 = slice(L.d_nope + L.d_v, None)
    torch.testing.assert_close(new_kv[kv1], wkv_b[kv1], rtol=0, atol=0)
    # group 0: value rows untouched, key nope rows scaled by sqrt(min gamma)
    gmin = min(tau / max_logits[h].item() for h in boosted)
    torch.testing.assert_close(new_kv[L.d_nope : L.d_nope + L.d_v], wkv_b[L.d_nope : L.d_nope + L.d_v], rtol=0, atol=0)
    torch.testing.assert_close(new_kv[: L.d_nope], wkv_b[: L.d_nope] * gmin**0.5, rtol=1e-12, atol=0)


def test_nothing_over_threshold_is_a_no_op():
    wq_b, wkv_b = _weights()
    max_logits = _logits(wq_b, wkv_b, *_inputs()).amax(dim=(1, 2))
    new_q, new_kv = wq_b.clone(), wkv_b.clone()
    stats = qk_clip_(new_q, new_kv, max_logits, L, float(max_logits.max()) + 1.0)
    assert stats.num_clipped_heads == 0
    assert torch.equal(new_q, wq_b) and torch.equal(new_kv, wkv_b)


def test_rejects_bad_inputs():
    wq_b, wkv_b = _weights()
    with pytest.raises(ValueError, match="max_logits has shape"):
        qk_clip_(wq_b, wkv_b, torch.full((3,), 500.0), L, 100.0)
    with pytest.raises(FloatingPointError):
        qk_clip_(wq_b, wkv_b, torch.full((L.n_heads,), float("nan")), L, 100.0)


def _dtensor_worker(rank, world, port, max_logits, tau, expected_q, expected_kv):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (world,))
        wq_b, wkv_b = _boosted([(3, 40.0)])
        dq, dkv = distribute_tensor(wq_b, mesh, [Shard(0)]), distribute_tensor(wkv_b, mesh, [Shard(0)])
        qk_clip_(dq, dkv, max_logits, L, tau)
        torch.testing.assert_close(dq.full_tensor(), expected_q, rtol=0, atol=0)
        torch.testing.assert_close(dkv.full_tensor(), expected_kv, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


def test_row_sharded_dtensor_weights_match_plain(free_port):
    """wq_b (60 rows) and wkv_b (14 rows) sharded unevenly over 4 gloo ranks (forked, CPU only)."""
    wq_b, wkv_b = _boosted([(3, 40.0)])
    max_logits = _logits(wq_b, wkv_b, *_inputs()).amax(dim=(1, 2))
    tau = float(max_logits.sort().values[-2]) * 1.01
    qk_clip_(wq_b, wkv_b, max_logits, L, tau)
    port = free_port
    mp.start_processes(
        _dtensor_worker, args=(4, port, max_logits, tau, wq_b, wkv_b), nprocs=4, join=True, start_method="fork"
    )
