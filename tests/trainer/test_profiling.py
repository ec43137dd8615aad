"""[profiling]: a torch profiler trace of steps start..end under the run folder (CPU here), and the config errors."""

import json

import pytest
import torch

from llm_training.config import ConfigError
from llm_training.distributed import ParallelDims
from llm_training.trainer import train

DIMS = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=1)


def test_trace_of_the_chosen_steps_is_written_under_the_run_folder(make_config):
    c = make_config(
        "--training.steps=3", "--checkpoint.enable=false", "--profiling.start_step=2", "--profiling.end_step=3"
    )
    result = train(c, DIMS, torch.device("cpu"))
    assert len(result.losses) == 3
    trace = c.run_folder / "profile" / "trace_rank0_steps2-3.json"
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"train step 2", "train step 3"} <= names and "train step 1" not in names
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the ops of the steps are in it
    assert list((c.run_folder / "profile").iterdir()) == [trace]  # no memory snapshot on CPU


def test_no_profiling_by_default_writes_nothing(make_config):
    c = make_config("--training.steps=2", "--checkpoint.enable=false")
    result = train(c, DIMS, torch.device("cpu"))
    assert len(result.losses) == 2 and result.run_folder.exists() and not (c.run_folder / "profile").exists()


def _recomputed_to_the_end() -> bool:
    """Whether a non-reentrant checkpoint's recompute runs its region to the end (a side effect after the region's
    last saved tensor happens again in the backward) or stops early (torch's default)."""
    from torch.utils.checkpoint import checkpoint

    calls = []

    def region(x):
        y = x.sin()  # saves x: the only tensor the backward needs
        calls.append(1)
        return y.clone()

    x = torch.randn(4, requires_grad=True)
    checkpoint(region, x, use_reentrant=False).sum().backward()
    return len(calls) == 2


@pytest.mark.parametrize("memory", [True, False])
def test_profiled_steps_recompute_whole_regions_only_while_memory_is_recorded(memory):
    """torch 2.11 loses the early-stop exception under the allocator's history (pytorch/pytorch#179536), so the
    profiler turns early stop off for the steps it records memory of, and leaves torch's default otherwise."""
    from types import SimpleNamespace

    from llm_training.trainer.profiling import StepProfiler

    profiling = SimpleNamespace(start_step=1, end_step=1, memory_snapshot=memory, ranks="0", folder="profile")
    profiler = StepProfiler(profiling, run_folder="unused", rank=0, device=torch.device("cuda"))
    assert not _recomputed_to_the_end()
    with profiler._whole_recomputes():
        assert _recomputed_to_the_end() == memory
    assert not _recomputed_to_the_end()


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--profiling.start_step=3", "--profiling.end_step=2"], r"\[profiling\] end_step = 2 needs"),
        (["--profiling.end_step=2"], r"\[profiling\] end_step = 2 needs start_step >= 1"),
        (["--profiling.memory_snapshot=true"], r"memory_snapshot = true .* set \[profiling\] start_step"),
        (
            ["--profiling.start_step=1", "--profiling.memory_snapshot=true"],
            r"memory_snapshot = true records the CUDA allocator: it needs \[training\] device = 'cuda'",
        ),
        (["--profiling.ranks=some"], r"ranks"),
    ],
)
def test_bad_profiling_values_are_config_errors_naming_the_key(make_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_config(*overrides)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_snapshot_and_its_peak_summary_on_cuda(make_config):
    """One GPU: the allocator history of the profiled steps is pickled beside the trace, with a summary of what held
    the memory at its peak by the code that allocated it (trainer/memory_peak.py)."""
    import pickle

    from llm_training.distributed.utils import destroy_process_group, setup_distributed

    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=1)
    device, created = setup_distributed("cuda", dims)
    try:
        c = make_config(
            "--training.device=cuda", "--training.mixed_precision_param=bfloat16", "--training.steps=2",
            "--checkpoint.enable=false", "--profiling.start_step=2", "--profiling.memory_snapshot=true",
        )  # fmt: skip
        train(c, dims, device)
    finally:
        if created:
            destroy_process_group()
    folder = c.run_folder / "profile"
    snapshot = pickle.loads((folder / "memory_rank0_steps2-2.pickle").read_bytes())
    assert snapshot["device_traces"][device.index or 0]  # the step's events were recorded
    summary = (folder / "memory_rank0_steps2-2.txt").read_text()
    assert summary.startswith("allocated GiB start") and "live at the allocated peak" in summary
    assert "llm_training/" in summary  # a site in our code holds part of the peak
