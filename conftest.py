"""Repo-wide pytest setup: one intra-op thread per test process.

The CPU suite runs under pytest-xdist with one worker per core; letting each worker also spawn a full
set of intra-op threads oversubscribes the cores and makes small-model tests several times slower.
"""

import torch

torch.set_num_threads(1)


import socket  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago: MASTER_PORT for multi-process tests."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
