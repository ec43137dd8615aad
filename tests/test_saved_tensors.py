"""llm_training/saved_tensors.py: what autograd saves, counted per storage."""

import torch

from llm_training.saved_tensors import saved_bytes, saved_storages


def test_counts_each_saved_storage_once_and_leaves_out_the_excluded():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def forward():
        y = x @ w  # saves x and w
        return (y * y[:, :1]).sum()  # saves y (and a view of y: the same storage)

    out, storages = saved_storages(forward)
    assert torch.isfinite(out)
    assert sorted(s.nbytes for s in storages.values()) == [4 * 8 * 4, 4 * 8 * 4, 8 * 8 * 4]  # x, y, w
    _, without_w = saved_bytes(forward, exclude=[w])
    assert without_w == 2 * 4 * 8 * 4
