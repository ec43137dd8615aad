"""Repo-wide pytest setup: one intra-op thread per test process.

The CPU suite runs under pytest-xdist with one worker per core; letting each worker also spawn a full
set of intra-op threads oversubscribes the cores and makes small-model tests several times slower.
"""

import torch

torch.set_num_threads(1)


import os
import socket

import pytest


# MASTER_PORT blocks, one per pytest-xdist worker, below Linux's ephemeral range (32768-60999 by default). A port
# the kernel hands out as ephemeral, even one that was free a moment ago, can be taken by any outgoing connection
# before rank 0 binds it (gloo's own connections, another worker's): a fresh-clone CI run failed a two-rank test
# on EADDRINUSE that way (2026-12-06). Below that range only an explicit bind takes a port.
_PORT_BLOCK_START, _PORT_BLOCK_SIZE = 20000, 1000
_ports_handed_out: set[int] = set()


def _port_block() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # gw0, gw1, ... under xdist
    start = _PORT_BLOCK_START + _PORT_BLOCK_SIZE * int(worker.removeprefix("gw"))
    return range(start, start + _PORT_BLOCK_SIZE)


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 for MASTER_PORT in multi-process tests: from this xdist worker's own block below the
    ephemeral range, bindable now and not handed to an earlier test of this process."""
    for port in _port_block():
        if port in _ports_handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _ports_handed_out.add(port)
        return port
    raise RuntimeError(f"no free port left in {_port_block()} (conftest.free_port)")


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


def _forget_in_memory_triton_builds(monkeypatch) -> None:
    """Every Triton kernel of ours already imported gets an empty in-memory build cache for the test (restored after).

    A `JITFunction` keeps each specialization it built in memory and neither builds it again nor calls the compile
    hook the prebuild captures with; so whether a test sees a build submitted would depend on which tests its
    process ran before (the whole GPU suite on an H100 failed so, 2026-12-07: another test had built the bf16
    `_rms_bwd_dw_kernel` in the same xdist worker)."""
    import sys
    from collections import defaultdict

    from triton.runtime.jit import JITFunction

    for name, module in list(sys.modules.items()):
        if module is None or name.partition(".")[0] not in ("activation", "llm_training", "optimizer"):
            continue
        for value in list(vars(module).values()):
            for _wrapper in range(3):  # an autotuned or heuristics kernel wraps its JITFunction in `.fn`
                if isinstance(value, JITFunction) or not hasattr(value, "fn"):
                    break
                value = value.fn
            if isinstance(value, JITFunction):
                monkeypatch.setattr(value, "device_caches", defaultdict(value.create_binder))


@pytest.fixture
def triton_prebuild_stub(tmp_path, monkeypatch):
    """An active `activation.triton_prebuild` with one worker and a fresh Triton cache, on disk and in memory (see
    `_forget_in_memory_triton_builds`); on a machine without a GPU,
    a stub Triton driver (current device, stream, and an SM90 target: all a launch's specialization needs; Triton
    builds for SM90 with its bundled ptxas without a GPU). Yields (prebuild, "hit" / "build" for each compile that
    Triton's compile listener reports in this process). Skips without triton."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    import triton
    from activation import triton_prebuild
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    _forget_in_memory_triton_builds(monkeypatch)
    previous_driver = driver._active
    if not torch.cuda.is_available():
        driver.set_active(
            SimpleNamespace(
                get_current_device=lambda: 0,
                get_current_stream=lambda device=None: 0,
                get_current_target=lambda: GPUTarget("cuda", 90, 32),
            )
        )
    events = []
    previous_listener = triton.knobs.compilation.listener
    triton.knobs.compilation.listener = lambda *a, **k: events.append("hit" if k.get("cache_hit") else "build")
    pb = triton_prebuild.start_triton_prebuild(1)
    try:
        yield pb, events
    finally:
        pb.close()
        triton.knobs.compilation.listener = previous_listener
        driver._active = previous_driver
