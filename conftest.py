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


@pytest.fixture(autouse=True)
def _no_leaked_allocator_settings():
    """The entrypoint puts [training] cuda_allocator into PYTORCH_ALLOC_CONF for its process (and its children):
    a variable that was absent before a test that runs it in-process is removed again afterwards (one the user set
    stays)."""
    import os

    from llm_training.distributed.utils import ALLOC_CONF_VARIABLES

    absent = [name for name in ALLOC_CONF_VARIABLES if name not in os.environ]
    yield
    for name in absent:
        os.environ.pop(name, None)
