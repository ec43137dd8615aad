"""`activation.triton_prebuild`: launches captured from fake / meta tensors are built by worker processes into
Triton's on-disk cache under the exact key the real launch looks up.

Without a GPU, Triton still builds for an SM90 target (its bundled ptxas); a stub driver stands in for the CUDA one
in this process (current device, stream and target), which is all a launch's specialization needs (the
`triton_prebuild_stub` fixture, conftest.py). The check that a
real launch loads what a worker built is Triton's own: its compile listener reports a cache hit. The CUDA test runs a
real custom op under torch.compile and counts the builds in the training process.
"""

import importlib.util
import os
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch
from activation import triton_prebuild
from torch._subclasses.fake_tensor import FakeTensorMode

HAS_TRITON = importlib.util.find_spec("triton") is not None


def needs_triton(test):
    """A test that runs wherever triton is installed (it builds for an SM90 target without a GPU), marked `gpu` so
    that the GPU suite (`pytest -m gpu`, whose machines always have triton) runs it: CI's CPU machine has none."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the gpu extra)")(test))


def _rms_launch_in_process(x, residual, w):
    """Build (no launch) `_rms_fwd_kernel` in this process for the launch `rms_norm_fwd(x, residual, w)` makes."""
    from activation import triton_kernels as K

    d = x.shape[1]
    block_d, num_warps = K._launch_config(d)
    spec = [triton_prebuild._as_spec_arg(t) for t in (x, residual, x, x, w, torch.empty(1, device="meta"))]
    K._rms_fwd_kernel.run(
        *spec, x.stride(0), residual.stride(0), d, x.stride(0), d, 1e-6,
        grid=(x.shape[0],), warmup=True, HAS_RESIDUAL=True, BLOCK_D=block_d, num_warps=num_warps,
    )  # fmt: skip


@needs_triton
def test_a_captured_launch_is_built_by_a_worker_and_then_loaded_from_the_cache(triton_prebuild_stub):
    from activation import triton_kernels as K

    pb, events = triton_prebuild_stub
    x = torch.empty(64, 4096, dtype=torch.bfloat16, device="meta")
    w = torch.empty(4096, dtype=torch.bfloat16, device="meta")
    triton_prebuild.capture_launches(lambda: K.rms_norm_fwd(x, x, w, 1e-6), x, what="rms")
    triton_prebuild.capture_launches(lambda: K.rms_norm_fwd(x, x, w, 1e-6), x, what="rms again")  # same key
    assert len(pb.futures) == 1 and pb.skipped == []
    [(name, seconds)] = pb.wait(timeout=300)
    assert name == "_rms_fwd_kernel" and seconds > 0
    assert events == []  # nothing was built in this process while capturing
    _rms_launch_in_process(x, x, w)
    assert events == ["hit"]
    assert "1 kernel builds handed to 1 workers (1 done, 0 failed, 0 still running)" in pb.summary()


@needs_triton
def test_a_worker_keys_its_build_with_the_ptxas_version_this_process_hashes(triton_prebuild_stub, monkeypatch):
    """Triton hashes the ptxas version it read first in a process (and caches it), while torch's inductor points
    TRITON_PTXAS_PATH at torch's own ptxas when it first compiles: a worker that read another version built under
    a key this process never looked up (the GPU suite's failure, session 25). Here this process's version changes
    after the worker started; the worker still builds under this process's key."""
    from activation import triton_kernels as K
    from triton.backends.nvidia.compiler import get_ptxas_version

    pb, events = triton_prebuild_stub
    assert pb.started[0].result(timeout=120) == []  # the worker has started (no modules to preload), before the change
    monkeypatch.setenv("TRITON_MOCK_PTX_VERSION", "the ptxas version as this process first read it")
    get_ptxas_version.cache_clear()
    try:
        # fp32: a specialization no other test holds in this process
        x = torch.empty(64, 1024, dtype=torch.float32, device="meta")
        w = torch.empty(1024, dtype=torch.float32, device="meta")
        triton_prebuild.capture_launches(lambda: K.rms_norm_fwd(x, x, w, 1e-6), x)
        pb.wait(timeout=300)
        _rms_launch_in_process(x, x, w)
        assert events == ["hit"], pb.summary()
    finally:
        get_ptxas_version.cache_clear()


@needs_triton
def test_a_workers_build_includes_the_kernels_launcher(triton_prebuild_stub, tmp_path, monkeypatch):
    """Triton compiles a launcher (a C module for the kernel's argument types) at a kernel's first launch, in the
    launching process: the worker builds it too, and this process then finds it in the cache (no C compiler run).
    Without a GPU, the launcher links against a stub libcuda and loads with lazy binding (it is never called)."""
    import json
    import shutil
    import subprocess
    import sys

    import triton
    from activation import triton_kernels as K
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia import driver as nvidia
    from triton.runtime import build

    if not torch.cuda.is_available():
        if shutil.which("cc") is None:
            pytest.skip("needs a C compiler (Triton builds launchers with one)")
        stub = tmp_path / "stub_libcuda"
        stub.mkdir()
        (stub / "stub.c").write_text("int stub_libcuda;\n")
        subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stub / "libcuda.so.1"),
                        str(stub / "stub.c")], check=True)  # fmt: skip
        monkeypatch.setenv("TRITON_LIBCUDA_PATH", str(stub))
    nvidia.libcuda_dirs.cache_clear()
    nvidia.library_dirs.cache_clear()
    pb = triton_prebuild.start_triton_prebuild(1)  # its worker starts with this environment
    flags = sys.getdlopenflags()
    try:
        x = torch.empty(16, 256, dtype=torch.bfloat16, device="meta")
        w = torch.empty(256, dtype=torch.bfloat16, device="meta")
        triton_prebuild.capture_launches(lambda: K.rms_norm_fwd(x, x, w, 1e-6), x)
        pb.wait(timeout=300)
        assert "launchers not built" not in pb.summary(), pb.summary()
        [data] = pb.captured.values()
        source, options = triton_prebuild._source(K._rms_fwd_kernel, json.loads(data))
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        compiler_runs = []
        real_build = build._build
        monkeypatch.setattr(build, "_build", lambda *a, **k: compiler_runs.append(a[0]) or real_build(*a, **k))
        sys.setdlopenflags(os.RTLD_LAZY | os.RTLD_LOCAL)
        nvidia.CudaLauncher(kernel.src, kernel.metadata)  # what the first launch does
        assert compiler_runs == []
    finally:
        sys.setdlopenflags(flags)
        pb.close()
        nvidia.libcuda_dirs.cache_clear()
        nvidia.library_dirs.cache_clear()


@needs_triton
def test_a_worker_that_would_key_a_build_otherwise_fails_it_and_says_both_keys(triton_prebuild_stub, monkeypatch):
    """The worker checks its own key against the one this process looks up before it builds (a build nothing
    would load is a silent miss): the build fails, naming both keys, and the kernel builds in process."""
    from activation import triton_kernels as K

    pb, _events = triton_prebuild_stub
    real = triton_prebuild._process_build_state

    def state_of_a_process_with_other_settings(*args):
        return {**real(*args), "cache_key": "0" * 64}

    monkeypatch.setattr(triton_prebuild, "_process_build_state", state_of_a_process_with_other_settings)
    x = torch.empty(32, 512, dtype=torch.bfloat16, device="meta")
    w = torch.empty(512, dtype=torch.bfloat16, device="meta")
    triton_prebuild.capture_launches(lambda: K.rms_norm_fwd(x, x, w, 1e-6), x)
    [future] = pb.futures.values()
    with pytest.raises(RuntimeError, match="a worker keys this build [0-9a-f]{16}, the training process 0{16}"):
        future.result(timeout=300)
    assert "(0 done, 1 failed, 0 still running)" in pb.summary()


@needs_triton
def test_a_launch_the_capture_did_not_predict_builds_in_process(triton_prebuild_stub):
    """A pointer off 16 bytes (a storage offset of one bf16 element) is another specialization: no cache hit."""
    from activation import triton_kernels as K

    pb, events = triton_prebuild_stub
    # fp16: a specialization no other test holds in this process (a JITFunction keeps what it built in memory, and
    # such a launch is neither captured nor built again)
    x = torch.empty(64, 4096, dtype=torch.float16, device="meta")
    w = torch.empty(4096, dtype=torch.float16, device="meta")
    triton_prebuild.capture_launches(lambda: K.rms_norm_fwd(x, x, w, 1e-6), x)
    pb.wait(timeout=300)
    shifted = torch.empty(64 * 4096 + 1, dtype=torch.float16, device="meta")[1:].view(64, 4096)
    _rms_launch_in_process(shifted, x, w)
    assert events == ["build"]
    [unpredicted] = pb.unpredicted  # said in the summary, with the argument whose alignment differed
    assert unpredicted.startswith("_rms_fwd_kernel: attrs_") and "launched unpredicted" in pb.summary()


@needs_triton
def test_custom_op_fake_calls_submit_forward_and_backward_kernels(triton_prebuild_stub, monkeypatch):
    """What torch.compile does while tracing: the ops' fake implementations on fake CUDA tensors (the SM count the
    backward's launch reads comes from the CUDA device; an H100's on a machine without one)."""
    import activation.triton_ops  # noqa: F401 - registers torch.ops.activation.*
    from activation import triton_kernels as K

    if not torch.cuda.is_available():
        monkeypatch.setattr(K, "_num_sms", lambda device: 132)
    pb, events = triton_prebuild_stub
    with FakeTensorMode():
        x = torch.empty(256, 1024, dtype=torch.bfloat16, device="cuda")
        w = torch.empty(1024, dtype=torch.bfloat16, device="cuda")
        y, h, rstd = torch.ops.activation.rms_norm_fwd(x, x, w, 1e-6)
        torch.ops.activation.rms_norm_bwd(y, h, h, w, rstd)
    names = {name for _module, name, _key in pb.futures}
    assert names == {"_rms_fwd_kernel", "_rms_bwd_dx_kernel", "_rms_bwd_dw_kernel"}, names
    assert pb.skipped == []
    assert all(seconds > 0 for _name, seconds in pb.wait(timeout=300))
    assert events == []


def test_nothing_is_captured_without_an_active_prebuild_or_for_cpu_tensors(monkeypatch):
    ran = []
    monkeypatch.setattr(triton_prebuild, "_ACTIVE", None)
    triton_prebuild.capture_launches(lambda: ran.append(1), torch.empty(1, device="meta"))
    active = SimpleNamespace(capture=lambda launch, what: ran.append(what))
    monkeypatch.setattr(triton_prebuild, "_ACTIVE", active)
    triton_prebuild.capture_launches(lambda: ran.append(2), torch.empty(1))  # a CPU tensor: no CUDA launch to come
    triton_prebuild.capture_launches(lambda: ran.append(3), None, None)
    assert ran == []
    triton_prebuild.capture_launches(lambda: ran.append(4), None, torch.empty(1, device="meta"), what="meta")
    assert ran == ["meta"]


@needs_triton
def test_a_launch_that_reads_data_is_skipped_and_reported(triton_prebuild_stub):
    pb, _events = triton_prebuild_stub

    def reads_a_value():
        raise RuntimeError("cannot read a fake tensor's value")

    triton_prebuild.capture_launches(reads_a_value, torch.empty(1, device="meta"), what="grouped poly_norm_fwd")
    assert pb.futures == {} and pb.skipped == ["grouped poly_norm_fwd: RuntimeError: cannot read a fake tensor's value"]
    assert "not captured (built in process): grouped poly_norm_fwd" in pb.summary()


@needs_triton
def test_a_launch_waits_for_the_worker_building_its_kernel(triton_prebuild_stub):
    """Triton's pre-build hook, outside a capture, blocks until a pending worker build of the same key ends (the
    launch then loads it instead of building it a second time); other kernels pass straight through."""
    pb, _events = triton_prebuild_stub
    fn = SimpleNamespace(module="some.module", name="kernel")
    pending: Future = Future()
    pb.futures[(fn.module, fn.name, "key")] = pending
    threading.Timer(0.3, pending.set_result, args=(0.1,)).start()
    start = time.perf_counter()
    assert pb._compile_hook(key="other key", fn=fn, compile={}) is None
    assert time.perf_counter() - start < 0.2
    assert pb._compile_hook(key="key", fn=fn, compile={}) is None
    assert time.perf_counter() - start >= 0.25 and pending.done()


@needs_triton
def test_workers_start_with_the_prebuild_and_import_the_kernel_modules(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    pb = triton_prebuild.start_triton_prebuild(2, preload=("activation.triton_kernels", "no.such.module"))
    try:
        assert len(pb.started) == 2  # submitted at start: the pool spawns its processes then
        for started in pb.started:
            assert started.result(timeout=120) == ["activation.triton_kernels"]
    finally:
        pb.close()


@needs_triton
def test_the_cache_folder_is_pinned_where_nothing_chose_one(tmp_path, monkeypatch):
    """Inductor sets TRITON_CACHE_DIR to a folder of its own when it is unset at its first compile: the prebuild pins
    Triton's choice first, so the training process later reads the folder its workers wrote."""
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    pb = triton_prebuild.start_triton_prebuild(1)
    try:
        assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / ".triton" / "cache")
    finally:
        pb.close()
        os.environ.pop("TRITON_CACHE_DIR", None)


@needs_triton
def test_close_restores_the_hook_and_deactivates(tmp_path, monkeypatch):
    from triton import knobs

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    before = knobs.runtime.jit_cache_hook
    pb = triton_prebuild.start_triton_prebuild(1)
    assert triton_prebuild.active_prebuild() is pb and knobs.runtime.jit_cache_hook == pb._compile_hook
    pb.close()
    assert triton_prebuild.active_prebuild() is None and knobs.runtime.jit_cache_hook is before
    assert triton_prebuild.start_triton_prebuild(0) is None and triton_prebuild.active_prebuild() is None


def test_symbolic_shapes_are_not_captured(monkeypatch):
    """Under dynamic shapes the launch code would run on symbols (and could add guards to the graph): skipped."""
    from torch.fx.experimental.proxy_tensor import make_fx

    ran, skipped = [], []
    monkeypatch.setattr(triton_prebuild, "_ACTIVE", SimpleNamespace(capture=lambda launch, what: ran.append(what),
                                                                    skipped=skipped))  # fmt: skip

    def f(x):
        triton_prebuild.capture_launches(lambda: None, x, what="op")
        return x * 2

    make_fx(f, tracing_mode="symbolic")(torch.empty(64, 32, device="meta"))
    assert ran == [] and skipped == ["op: symbolic shapes"]
    make_fx(f, tracing_mode="fake")(torch.empty(64, 32, device="meta"))
    assert ran == ["op"]


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA + triton")
def test_compiled_norm_launches_load_the_workers_kernels_on_cuda(triton_prebuild_stub, monkeypatch):
    """torch.compile (static shapes) traces a fused-add RMSNorm, whose forward and backward ops' fake calls submit
    their kernels; the compiled run's forward and backward then build none of them (nor their launchers) in this
    process: every compile of these kernels Triton reports here is a cache hit of a worker's build, the C compiler
    never runs for a launcher, and the gradients equal the eager ones.
    fp16 at width 2816: a specialization no other test of the suite builds (a JITFunction keeps its builds in memory
    for the process, and a launch it already holds is neither captured nor compiled again)."""
    import activation
    import triton
    from triton.runtime import build

    pb, _events = triton_prebuild_stub
    launchers_built = []
    real_build = build._build
    monkeypatch.setattr(
        build, "_build", lambda name, *a, **k: launchers_built.append(name) or real_build(name, *a, **k)
    )
    ours = []
    triton.knobs.compilation.listener = lambda *a, src=None, cache_hit=False, **k: ours.append(
        (getattr(getattr(src, "fn", None), "__name__", ""), "hit" if cache_hit else "build")
    )
    torch._dynamo.reset()
    x = torch.randn(512, 2816, device="cuda", dtype=torch.float16, requires_grad=True)
    r = torch.randn_like(x)
    w = torch.ones(2816, device="cuda", dtype=torch.float16)

    def f(x, r, w):
        y, h = activation.fused_add_rms_norm(x, r, w, 1e-6)
        return (y.float() * 2 + h.float()).sum()

    (grad_compiled,) = torch.autograd.grad(torch.compile(f, backend="aot_eager", dynamic=False)(x, r, w), x)
    submitted = {name for _m, name, _k in pb.futures}
    assert {"_rms_fwd_kernel", "_rms_bwd_dx_kernel", "_rms_bwd_dw_kernel"} <= submitted, pb.summary()
    rms = [(name, how) for name, how in ours if name.startswith("_rms_")]
    assert len(rms) == 3 and {how for _n, how in rms} == {"hit"}, (rms, pb.summary())
    assert "__triton_launcher" not in launchers_built, pb.summary()
    (grad_eager,) = torch.autograd.grad(f(x, r, w), x)
    assert torch.equal(grad_compiled, grad_eager)
