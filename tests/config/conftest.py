"""Fixtures of the config tests."""

import logging

import pytest

import llm_training.train as train_module


@pytest.fixture
def entrypoint_without_setup(monkeypatch):
    """main() in one process, failing the test if it reaches process-group or training work."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)

    def reached(what):
        def fail(*args, **kwargs):
            raise AssertionError(f"{what} was reached: the config error was not found up front")

        return fail

    monkeypatch.setattr(train_module, "setup_distributed", reached("setup_distributed"))
    monkeypatch.setattr(train_module, "run", reached("run"))
    handlers, level = logging.root.handlers[:], logging.root.level
    yield
    logging.root.handlers[:] = handlers
    logging.root.setLevel(level)
