"""The flash-attn-4 prebuild side process: which attention kinds it builds, when a rank starts it, its document
layouts, one run over the emulated kernels (CPU), the parent's handling of a failed side process, and on CUDA with
flash-attn-4 that a process calling the prebuilt kinds at other shapes builds nothing."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import runpy
import subprocess
import sys
import textwrap
import time
import warnings
from types import SimpleNamespace

import pytest
import torch

from llm_training.config import ConfigManager
from llm_training.layers.attention import fa4, fa4_prebuild
from llm_training.layers.attention.fa4_prebuild import (
    FA4_MANY_DOCUMENTS,
    Fa4AttentionKind,
    Fa4Prebuild,
    PrebuildPlan,
    document_layout,
    fa4_attention_kinds,
    prebuild_skip_reason,
)
from llm_training.motif import get_flavor
from llm_training.motif.model import Motif3Model
from tests.fa4_emulation import install_emulated_fa4

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _model(backend: str) -> Motif3Model:
    with torch.device("meta"):
        return Motif3Model(get_flavor("motif3_debug"), attention_backend=backend)


def test_kinds_are_the_distinct_windows_and_head_shapes_of_the_fa4_layers():
    args = get_flavor("motif3_debug")
    model = _model("fa4")
    kinds = fa4_attention_kinds(model, torch.device("cpu"))
    windows = {m.self_attn.window for m in [*model.layers, *model.mtp_layers]}
    assert {k.window for k in kinds} == windows and len(kinds) == len(windows) == 2
    for k in kinds:
        assert (k.n_heads, k.n_kv_heads) == (args.num_attention_heads, args.num_key_value_heads)
        assert (k.d_qk, k.d_v) == (args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim)
    # auto picks no fa4 on the CPU, and other backends never run it: nothing to build
    assert fa4_attention_kinds(_model("auto"), torch.device("cpu")) == []
    assert fa4_attention_kinds(_model("reference"), torch.device("cpu")) == []


def test_a_rank_prebuilds_only_a_compiled_half_precision_step_on_cuda_with_the_shared_cache(monkeypatch):
    def config(*overrides):
        return ConfigManager().parse_args(
            ["--compile.enable=true", "--training.mixed_precision_param=bfloat16", *overrides]
        )

    cuda, dims = torch.device("cuda", 0), SimpleNamespace(cp_enabled=False)
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert prebuild_skip_reason(config(), dims, cuda) is None
    assert "[compile] enable" in prebuild_skip_reason(config("--compile.enable=false"), dims, cuda)
    assert "not CUDA" in prebuild_skip_reason(config(), dims, torch.device("cpu"))
    assert "float32" in prebuild_skip_reason(config("--training.mixed_precision_param=float32"), dims, cuda)
    assert "context parallelism" in prebuild_skip_reason(config(), SimpleNamespace(cp_enabled=True), cuda)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert "local rank 0" in prebuild_skip_reason(config(), dims, cuda)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0")
    assert "cache_folder" in prebuild_skip_reason(config(), dims, cuda)


@pytest.mark.parametrize("documents,row_tokens", [(4, 2048), (FA4_MANY_DOCUMENTS + 4, 2048), (260, 64), (3, 7)])
def test_document_layout_packs_the_documents_asked_for(documents, row_tokens):
    rows, ids_BS = document_layout(documents, row_tokens)
    assert ids_BS.shape == (rows, row_tokens) and rows >= fa4_prebuild.PREBUILD_ROWS
    cu = fa4.document_cu_seqlens(ids_BS)
    lengths = (cu[1:] - cu[:-1]).tolist()
    # the varlen call sees at least the documents asked for (so a many-documents layout crosses FA4's threshold),
    # never a one-token document, and rows that each hold about the same count
    assert documents <= len(lengths) <= documents + rows and min(lengths) >= 2
    if documents > FA4_MANY_DOCUMENTS:
        assert len(lengths) > FA4_MANY_DOCUMENTS


def test_plan_survives_its_json_round_trip():
    kinds = [Fa4AttentionKind(80, 16, 192, 128, None, 0.07), Fa4AttentionKind(80, 16, 192, 128, 128, 0.07)]
    plan = PrebuildPlan("cuda:0", "bfloat16", 2048, kinds, many_documents=True)
    assert PrebuildPlan.from_json(plan.to_json()) == plan
    assert json.loads(plan.to_json())["kinds"][1]["window"] == 128


def test_side_process_runs_every_forward_then_every_backward_per_layout(monkeypatch, capsys):
    """The side process's body on the CPU over the emulated kernels: per document layout, the forwards of every
    kind come before the backwards (the order the first training step needs them), the many-documents layout
    hands FA4 more than 256 documents; QK-clip's max-logit kernel is not the side process's (the Triton prebuild
    builds it: `masks.prebuild_max_logits_kernels`)."""
    install_emulated_fa4(monkeypatch)
    interface = sys.modules["flash_attn.cute.interface"]
    calls = []
    for name in ("_flash_attn_fwd", "_flash_attn_bwd"):

        def record(*args, _kernel=getattr(interface, name), _name=name, **kwargs):
            calls.append((_name, kwargs["window_size_left"], len(kwargs["cu_seqlens_q"]) - 1))
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(interface, name, record)
    max_logits_calls = []
    masks = sys.modules["llm_training.layers.attention.masks"]
    real_max_logits = masks.attention_max_logits
    monkeypatch.setattr(
        masks, "attention_max_logits", lambda *a, **kw: max_logits_calls.append(1) or real_max_logits(*a, **kw)
    )
    kinds = [Fa4AttentionKind(4, 2, 16, 8, None, 0.25), Fa4AttentionKind(4, 2, 16, 8, 8, 0.25)]
    fa4_prebuild._run(PrebuildPlan("cpu", "float32", 160, kinds, many_documents=True))
    fwd, bwd = "_flash_attn_fwd", "_flash_attn_bwd"
    few, many = 2 * fa4_prebuild.PREBUILD_ROWS, FA4_MANY_DOCUMENTS + 2 * fa4_prebuild.PREBUILD_ROWS
    assert [(c[0], c[1]) for c in calls] == [(fwd, None), (fwd, 8), (bwd, None), (bwd, 8)] * 2
    assert {c[2] for c in calls[:4]} == {few} and min(c[2] for c in calls[4:]) >= many
    assert max_logits_calls == []
    lines = capsys.readouterr().out.splitlines()
    markers = [line for line in lines if line.startswith((fa4_prebuild.KERNEL_START, fa4_prebuild.KERNEL_DONE))]
    out = [line for line in lines if line not in markers]
    assert len(out) == 9 and out[0].startswith("few documents, full causal, 4/2 heads, head dims 16/8: forward")
    assert out[-1].startswith("done: 2 kind(s) x 2 document layout(s)")
    # every kernel call announced: its start, then its end, under the call's compile key
    starts, dones = markers[0::2], markers[1::2]
    keys = [m.removeprefix(fa4_prebuild.KERNEL_START) for m in starts]
    assert len(markers) == 2 * len(calls) and dones == [fa4_prebuild.KERNEL_DONE + key for key in keys]
    assert [key.split()[0] for key in keys] == ["forward", "forward", "backward", "backward"] * 2
    assert [key.split()[-3:] for key in keys[4:]] == [["over", str(FA4_MANY_DOCUMENTS), "documents"]] * 4
    assert len(set(keys)) == 8 and fa4._kernel_call_watcher is None  # back off once the run is over


def test_the_side_process_command_announces_its_kernel_calls(monkeypatch, capsys):
    """`python -m ...fa4_prebuild PLAN` runs the file as `__main__`, a second copy of the module beside the one `fa4`
    and the trainer import: its run still announces every kernel call (the GPU test found a switch that the copy set
    and the kernel calls never read)."""
    install_emulated_fa4(monkeypatch)
    plan = PrebuildPlan("cpu", "float32", 160, [Fa4AttentionKind(4, 2, 16, 8, None, 0.25)])
    monkeypatch.setattr(sys, "argv", ["fa4_prebuild", plan.to_json()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is imported already (it is, on purpose)
        with pytest.raises(SystemExit) as exited:
            runpy.run_module(fa4_prebuild.__name__, run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    starts = [line for line in lines if line.startswith(fa4_prebuild.KERNEL_START)]
    dones = [line for line in lines if line.startswith(fa4_prebuild.KERNEL_DONE)]
    assert exited.value.code == 0 and [s.split()[2] for s in starts] == ["forward", "backward"] and len(dones) == 2
    assert fa4._kernel_call_watcher is None


def test_training_asks_for_the_kernels_under_the_keys_the_side_process_announced(monkeypatch, capsys):
    """The training process's attention calls (other token counts, a compiled-graph-free eager call) name each
    kernel by the same compile key as the side process did, so it waits for the very kernels it needs."""
    install_emulated_fa4(monkeypatch)
    kinds = [Fa4AttentionKind(4, 2, 16, 8, None, 0.25), Fa4AttentionKind(4, 2, 16, 8, 8, 0.25)]
    fa4_prebuild._run(PrebuildPlan("cpu", "bfloat16", 160, kinds))
    announced = {
        line.removeprefix(fa4_prebuild.KERNEL_START)
        for line in capsys.readouterr().out.splitlines()
        if line.startswith(fa4_prebuild.KERNEL_START)
    }
    waits = []  # the keys a training process's watcher (`Fa4Prebuild`) would wait on
    monkeypatch.setattr(fa4, "_kernel_call_watcher", lambda event, key: event == "start" and waits.append(key))
    from llm_training.layers.attention.backends import build_attention_metadata

    B, S = 3, 96  # not the side process's rows
    docs_BS = (torch.arange(S) >= 40).long() + 2 * torch.arange(B)[:, None]
    for kind in kinds:
        meta = build_attention_metadata("fa4", docs_BS, [kind.window], B, S, torch.device("cpu"))
        q, k, v = (
            torch.randn(B, S, heads, dim, dtype=torch.bfloat16, requires_grad=True)
            for heads, dim in ((4, 16), (2, 16), (2, 8))
        )
        out, _ = fa4.fa4_attention(
            q, k, v, scale=kind.softmax_scale, window=kind.window, metadata=meta, record_max_logits=False
        )
        out.float().sum().backward()
    assert len(waits) == 4 and set(waits) == announced


_ANNOUNCER = textwrap.dedent(
    """
    import sys, time
    start, done = sys.argv[1:3]
    print(start + "forward K", flush=True)
    time.sleep(1.0)
    print(done + "forward K", flush=True)
    print(start + "backward K", flush=True)
    time.sleep(1.0)
    sys.exit(3)  # dies while building the backward
    """
)


def test_a_training_process_waits_only_for_a_kernel_the_side_process_is_building(monkeypatch, caplog):
    """A side process that announces a forward kernel, builds it for a second, then starts a backward and dies:
    the training process waits for the forward (built), not for a kernel never started, and stops waiting for the
    backward when the side process ends, without reaching its timeout."""
    popen = subprocess.Popen

    def announcer(command, **kwargs):  # the side process's command, replaced by the script above
        script = [sys.executable, "-c", _ANNOUNCER, fa4_prebuild.KERNEL_START, fa4_prebuild.KERNEL_DONE]
        return popen(script, **kwargs)

    monkeypatch.setattr(fa4_prebuild.subprocess, "Popen", announcer)
    prebuild = Fa4Prebuild(PrebuildPlan("cpu", "bfloat16", 64, [Fa4AttentionKind(4, 2, 16, 8, None, 0.25)]))
    assert fa4._kernel_call_watcher == prebuild._on_kernel_call  # the ops consult it while the side process runs

    def announced(key):
        deadline = time.monotonic() + 60
        while prebuild.kernels.get(key) is None and time.monotonic() < deadline:
            time.sleep(0.01)

    assert prebuild.wait_for_kernel("forward other") is False and prebuild.waited == {}  # never started
    fa4._kernel_call_watcher("start", "forward other")  # the training process calls it first: builds it itself
    fa4._kernel_call_watcher("start", "forward other")  # its later calls are not new builds
    announced("forward K")
    with caplog.at_level(logging.INFO, logger=fa4_prebuild.__name__):
        fa4._kernel_call_watcher("start", "forward K")  # what the ops call: the wait
    assert prebuild.kernels["forward K"] == "built" and prebuild.waited["forward K"] > 0
    assert any("waited" in r.getMessage() and "forward K kernel: it is built" in r.getMessage() for r in caplog.records)
    assert prebuild.wait_for_kernel("forward K") is True and len(prebuild.waited) == 1  # built: no second wait
    announced("backward K")
    start = time.perf_counter()
    assert prebuild.wait_for_kernel("backward K", timeout=60) is False  # the side process died building it
    assert time.perf_counter() - start < 30 and prebuild.wait(60) == [3]
    # the announcements are followed, not logged as the side process's output
    assert prebuild.lines == [] and not any(fa4_prebuild.KERNEL_START in r.getMessage() for r in caplog.records)
    summary = prebuild.summary()  # the harness's line
    assert summary.startswith("2 kernels announced (1 built, 1 building; side process exited 3)"), summary
    assert f"waited {prebuild.waited['forward K']:.1f} s for forward K, " in summary and "backward K" in summary
    assert prebuild.unbuilt_at_first_call == {"forward other": None}
    assert summary.endswith("; called before a side process built it: forward other (never announced: not in the plan)")
    prebuild._on_kernel_call("start", "backward K")  # the side process died building it: the training process builds it
    assert prebuild.summary().endswith(
        "; called before a side process built it: forward other (never announced: not in the plan), backward K "
        "(announced by a side process, not yet built by it)"
    )
    assert fa4._kernel_call_watcher is None  # the side process ended: the ops no longer consult it
    prebuild.close()


def test_kinds_with_other_kernels_get_side_processes_of_their_own():
    """Full causal and sliding kinds build side by side, one process each; windows of other widths (one kernel set)
    and the MTP layer's copy of a trunk kind stay in one process, in model order."""
    full, w128, w64 = (Fa4AttentionKind(80, 16, 192, 128, w, 0.07) for w in (None, 128, 64))
    other_heads = Fa4AttentionKind(40, 8, 192, 128, None, 0.07)
    plan = PrebuildPlan("cuda:0", "bfloat16", 2048, [w128, full, w64, other_heads], many_documents=True)
    parts = fa4_prebuild.side_process_plans(plan)
    assert [p.kinds for p in parts] == [[w128, w64], [full], [other_heads]]
    assert all(p.many_documents and p.row_tokens == 2048 and p.dtype == "bfloat16" for p in parts)


_TWO_BUILDERS = textwrap.dedent(
    """
    import json, sys, time
    start, done, plan = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    name = "A" if plan["kinds"][0]["window"] is None else "B"
    print(name + " starts", flush=True)
    print(start + "forward " + name, flush=True)
    time.sleep(0.3)
    print(done + "forward " + name, flush=True)
    print(start + "backward " + name, flush=True)
    if name == "A":
        sys.exit(3)  # dies while building its backward
    time.sleep(120)  # still building when the test ends
    """
)


def test_a_wait_ends_with_the_side_process_that_announced_the_kernel(monkeypatch, caplog):
    """Two side processes (a full causal and a sliding kind): both forwards are followed; the wait for the backward
    that side process A was building ends when A dies, though B still runs; the summary says how each is; the
    warning about A quotes A's own output, not B's."""
    popen = subprocess.Popen
    started = []

    def builder(command, **kwargs):
        started.append(command[-1])
        script = [sys.executable, "-c", _TWO_BUILDERS, fa4_prebuild.KERNEL_START, fa4_prebuild.KERNEL_DONE]
        return popen([*script, command[-1]], **kwargs)

    monkeypatch.setattr(fa4_prebuild.subprocess, "Popen", builder)
    kinds = [Fa4AttentionKind(4, 2, 16, 8, None, 0.25), Fa4AttentionKind(4, 2, 16, 8, 8, 0.25)]
    with caplog.at_level(logging.INFO, logger=fa4_prebuild.__name__):
        prebuild = Fa4Prebuild(PrebuildPlan("cpu", "bfloat16", 64, kinds))
    assert [PrebuildPlan.from_json(plan).kinds for plan in started] == [[kinds[0]], [kinds[1]]]
    deadline = time.monotonic() + 60
    while len(prebuild.kernels) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prebuild.kernels == {
        "forward A": "built", "forward B": "built", "backward A": "building", "backward B": "building"
    }  # fmt: skip
    start = time.perf_counter()
    assert prebuild.wait_for_kernel("backward A", timeout=60) is False  # A died building it
    assert time.perf_counter() - start < 30 and prebuild.processes[1].poll() is None  # B still runs
    assert prebuild.summary().startswith(
        "4 kernels announced (2 built, 2 building; 2 side processes: exited 3, still running)"
    )
    assert fa4._kernel_call_watcher == prebuild._on_kernel_call  # B still builds: the ops still consult it
    prebuild.close()
    assert prebuild.wait(60) == [3, -15] and fa4._kernel_call_watcher is None
    assert sorted(prebuild.lines) == ["A starts", "B starts"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "[fa4 prebuild 1/2] the side process exited with 3 (A starts); training builds its flash-attn-4 kernels "
        "itself (3-15 s each in the first step)"
    ]


def test_a_failed_side_process_is_logged_and_leaves_training_alone(caplog):
    """A real side process (`python -m ...`) whose plan cannot run here (flash-attn-4 needs CUDA): the parent logs
    its output and a warning with the exit code; nothing raises."""
    plan = PrebuildPlan("cpu", "bfloat16", 64, [Fa4AttentionKind(4, 2, 16, 8, None, 0.25)])
    with caplog.at_level(logging.INFO, logger=fa4_prebuild.__name__):
        prebuild = Fa4Prebuild(plan)
        assert prebuild.wait(240) == [1]
    assert any("flash-attn-4 needs a CUDA device" in line for line in prebuild.lines)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        len(warnings) == 1
        and "exited with 1" in warnings[0]
        and "builds its flash-attn-4 kernels itself" in warnings[0]
    )
    prebuild.close()  # a finished process: nothing to stop


# ------------------------------------------------------------------------ CUDA + flash-attn-4
_CALLER = textwrap.dedent(
    """
    import json, sys
    import torch
    import cutlass.cute as cute
    import flash_attn.cute.interface  # noqa: F401  (its kernel functions call cute.compile to build)
    from llm_training.layers.attention.backends import build_attention_metadata
    from llm_training.layers.attention.fa4 import fa4_attention

    builds = []
    compile_ = cute.compile
    cute.compile = lambda *a, **kw: builds.append(1) or compile_(*a, **kw)
    plan, control = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    B, S, result = 3, 4096, {}
    pos = torch.arange(S)
    docs_BS = ((pos >= 1000).long() + (pos >= 3000).long() + 3 * torch.arange(B)[:, None]).cuda()  # 3 per row
    for label, kinds in (("prebuilt", plan["kinds"]), ("control", [control])):
        builds.clear()
        for kind in kinds:
            meta = build_attention_metadata("fa4", docs_BS, [kind["window"]], B, S, torch.device("cuda"))
            q, k, v = (
                torch.randn(B, S, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for heads, dim in ((kind["n_heads"], kind["d_qk"]), (kind["n_kv_heads"], kind["d_qk"]),
                                   (kind["n_kv_heads"], kind["d_v"]))
            )
            out, _ = fa4_attention(q, k, v, scale=kind["softmax_scale"], window=kind["window"], metadata=meta,
                                   record_max_logits=False)
            out.float().square().sum().backward()
        torch.cuda.synchronize()
        result[label] = len(builds)
    print(json.dumps(result))
    """
)


def _fresh_fa4_cache_env(cache_dir) -> dict[str, str]:
    """The environment of a child process that uses flash-attn-4 with its persistent cache in `cache_dir` and imports
    this repository (skips the test where flash-attn-4 cannot run)."""
    reason = fa4.fa4_unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"flash-attn-4 unavailable: {reason}")
    env = {
        **os.environ,
        "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1",
        "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(cache_dir),
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    return env


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prebuilt_kernels_load_without_a_build_at_other_shapes(tmp_path):
    """The prebuild (2 rows of 2048 tokens) into a fresh persistent cache, then another process calling the same
    kinds at 3 rows of 4096 tokens with 3 documents each, as the training process does: flash-attn-4 builds no
    kernel for them; a kind that was not prebuilt (the control) does build, so the count is live."""
    env = _fresh_fa4_cache_env(tmp_path)
    kinds = [Fa4AttentionKind(16, 4, 192, 128, None, 0.07), Fa4AttentionKind(16, 4, 192, 128, 128, 0.07)]
    plan = PrebuildPlan("cuda:0", "bfloat16", 2048, kinds)
    built = subprocess.run(
        [sys.executable, "-m", fa4_prebuild.__name__, plan.to_json()], env=env, capture_output=True, text=True,
        timeout=280,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    assert built.stdout.splitlines()[-1].startswith("done: 2 kind(s) x 1 document layout(s)")
    # the control differs in a field of the compile key: equal head dims (native GQA); a window of another width
    # would not (the key holds whether there is a window, not its width: it loaded the window-128 kernels on the H100)
    control = dataclasses.asdict(Fa4AttentionKind(16, 4, 128, 128, None, 0.07))
    called = subprocess.run(
        [sys.executable, "-c", _CALLER, plan.to_json(), json.dumps(control)], env=env, capture_output=True, text=True,
        timeout=280,
    )  # fmt: skip
    assert called.returncode == 0, called.stdout + called.stderr
    builds = json.loads(called.stdout.splitlines()[-1])
    assert builds["prebuilt"] == 0 and builds["control"] > 0, builds


_WAITER = textwrap.dedent(
    """
    import json, sys, time
    import torch
    import cutlass.cute as cute
    import flash_attn.cute.interface  # noqa: F401
    from llm_training.layers.attention import fa4, fa4_prebuild
    from llm_training.layers.attention.backends import build_attention_metadata

    plan = fa4_prebuild.PrebuildPlan.from_json(sys.argv[1])
    (kind,) = plan.kinds
    prebuild = fa4_prebuild.Fa4Prebuild(plan)
    deadline = time.monotonic() + 240
    while not prebuild.kernels and prebuild.processes[0].poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    announced = list(prebuild.kernels)
    builds = []
    compile_ = cute.compile
    cute.compile = lambda *a, **kw: builds.append(1) or compile_(*a, **kw)
    B, S = 2, 4096
    docs_BS = ((torch.arange(S) >= 1500).long() + 2 * torch.arange(B)[:, None]).cuda()
    meta = build_attention_metadata("fa4", docs_BS, [None], B, S, torch.device("cuda"))
    q = torch.randn(B, S, kind.n_heads, kind.d_qk, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, S, kind.n_kv_heads, kind.d_qk, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, S, kind.n_kv_heads, kind.d_v, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        fa4.fa4_attention(q, k, v, scale=kind.softmax_scale, window=None, metadata=meta, record_max_logits=False)
    torch.cuda.synchronize()
    prebuild.close()
    print(json.dumps({"announced": announced, "builds": len(builds), "waited": prebuild.waited}))
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_kernel_the_side_process_is_building_is_waited_for_not_built(tmp_path):
    """A process starts the side process on a fresh persistent cache and, as soon as the side process announces its
    first kernel (the forward), calls that attention itself: it waits for the side process's build and loads the
    kernel, building none of its own."""
    env = _fresh_fa4_cache_env(tmp_path)
    plan = PrebuildPlan("cuda:0", "bfloat16", 2048, [Fa4AttentionKind(16, 4, 192, 128, None, 0.07)])
    called = subprocess.run(
        [sys.executable, "-c", _WAITER, plan.to_json()], env=env, capture_output=True, text=True, timeout=400
    )
    assert called.returncode == 0, called.stdout + called.stderr
    result = json.loads(called.stdout.splitlines()[-1])
    (key,) = result["announced"]
    assert key.startswith("forward bfloat16 16/") and key.endswith("head dims 192/128 causal varlen"), key
    assert result["builds"] == 0 and list(result["waited"]) == [key], result
