"""Regional torch.compile: `apply_compile(blocks)` compiles each repeated block in place (`Module.compile()`),
so parameter FQNs never change and identical blocks can share compiled code."""

from __future__ import annotations

from torch import nn


def apply_compile(blocks: list[nn.Module]) -> None:
    """torch.compile every block's forward in place."""
    for block in blocks:
        block.compile()
