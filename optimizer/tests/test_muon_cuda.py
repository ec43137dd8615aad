"""Muon on one GPU: the CUDA default step (bf16 stacks and NS, fp32 momentum / norms / division / update) against
the fp32 CPU step on a mixed set (attention-like wide and tall matrices sharing buckets, an expert stack, a
row-split gate|up stack, groups with different lr), and the batched CUDA step against a matrix-by-matrix CUDA
step in fp32 (same arithmetic, so fp32 rounding only)."""

import math

import pytest
import torch

from optimizer import Muon, newton_schulz

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = [(64, 256), (256, 64), (64, 256), (128, 128), (4, 96, 48), (3, 96, 48)]
ROW_SPLIT = [1, 1, 1, 1, 1, 2]


def _groups(params):
    return [
        {"params": [p for p, s in zip(params, ROW_SPLIT) if s == 1][:3], "lr": 0.02},
        {"params": [p for p, s in zip(params, ROW_SPLIT) if s == 1][3:], "lr": 0.01},
        {"params": [p for p, s in zip(params, ROW_SPLIT) if s == 2], "lr": 0.02, "row_split": 2},
    ]


def _updates(device, ns_dtype, steps=3):
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(steps)]
    params = [t.clone().to(device).requires_grad_() for t in init]
    opt = Muon(_groups(params), weight_decay=0.1, ns_dtype=ns_dtype)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(device)
        opt.step()
    return [(p.detach().cpu() - t) for p, t in zip(params, init)]


def test_cuda_bf16_step_close_to_cpu_fp32_step():
    ref = _updates("cpu", torch.float32)
    got = _updates("cuda", None)  # the CUDA default: bf16 NS
    for r, g in zip(ref, got):
        assert g.dtype == torch.float32
        assert float((g - r).norm() / r.norm()) < 3e-2


def test_cuda_fp32_batched_step_equals_per_matrix_step():
    got = _updates("cuda", torch.float32, steps=1)
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [torch.randn(s, generator=gen) for s in SHAPES]
    lrs = [0.02, 0.02, 0.02, 0.01, 0.01, 0.02]
    for t, g, lr, split, upd in zip(init, grads, lrs, ROW_SPLIT, got):
        rows, cols = t.shape[-2] // split, t.shape[-1]
        blocks = g.cuda().reshape(-1, rows, cols) * (1 + 0.95)  # Nesterov input of step 1: G + mu (mu M + G), M = 0
        ortho = torch.stack([newton_schulz(b, dtype=torch.float32) for b in blocks]).reshape(t.shape)
        expected = -lr * 0.1 * t.cuda() - lr * 0.2 * math.sqrt(max(rows, cols)) * ortho
        torch.testing.assert_close(upd.cuda(), expected, rtol=1e-4, atol=1e-6)
