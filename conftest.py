"""Repo-wide pytest setup: one intra-op thread per test process.

The CPU suite runs under pytest-xdist with one worker per core; letting each worker also spawn a full
set of intra-op threads oversubscribes the cores and makes small-model tests several times slower.
"""

import torch

torch.set_num_threads(1)
