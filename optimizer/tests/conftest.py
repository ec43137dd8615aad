"""Shared fixtures for the optimizer tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    """Tiny matrices: intra-op threads only add overhead (100x on a busy CI core), so run single-threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
