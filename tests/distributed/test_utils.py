"""distributed.utils: the gradient norm over parameters on different device meshes (an FSDP-like 1-D mesh, a second 2-D
mesh such as an expert mesh, and plain replicated tensors) on 2 gloo ranks, and the clipping coefficient from it, equal
torch's clipping of the full gradients in one process; device resolution names the key when CUDA is missing; the CUDA
allocator's settings reach the environment before CUDA starts, and the environment's own win."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llm_training.config import ConfigError
from llm_training.distributed.utils import (
    ALLOC_CONF_VARIABLES,
    apply_cuda_allocator_settings,
    clip_coefficient,
    destroy_process_group,
    grad_norm,
    resolve_device,
)

FULL_GRADS = {  # what the three kinds of parameters' full gradients are
    "fsdp": torch.arange(12.0).view(4, 3) - 5.0,
    "expert": torch.linspace(-2.0, 3.0, 16).view(2, 4, 2),
    "replicated": torch.tensor([0.5, -1.5, 2.0]),
}


def _clip(params, max_norm) -> float:
    """The trainer's use: the norm launched, read once on the host, the coefficient the optimizers apply, here
    applied to the gradients; returns the norm."""
    value = float(grad_norm(params))
    for p in params:
        p.grad.mul_(clip_coefficient(value, max_norm))
    return value


def _reference(max_norm):
    params = {n: torch.nn.Parameter(torch.zeros_like(g)) for n, g in FULL_GRADS.items()}
    for n, p in params.items():
        p.grad = FULL_GRADS[n].clone()
    norm = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm)
    return float(norm), {n: p.grad for n, p in params.items()}


def _worker(rank, world, port, max_norm, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fsdp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        expert_mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_shard_mod_ep", "ep"))
        params = []
        for name, mesh, placements in (
            ("fsdp", fsdp_mesh, [Shard(0)]),
            ("expert", expert_mesh, [Shard(1), Shard(0)]),
        ):
            p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(FULL_GRADS[name]), mesh, placements))
            p.grad = distribute_tensor(FULL_GRADS[name].clone(), mesh, placements)
            params.append(p)
        plain = torch.nn.Parameter(torch.zeros(3))
        plain.grad = FULL_GRADS["replicated"].clone()
        params.append(plain)
        norm = _clip(params, max_norm)
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params]
        out[rank] = (norm, grads)
    finally:
        destroy_process_group()


@pytest.mark.parametrize("max_norm", [1.0, 0.0, 100.0])  # 0: measure only; 100: above the norm (about 11.6)
def test_clip_grad_norm_over_two_meshes_and_plain_params(free_port, max_norm):
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_worker, args=(2, free_port, max_norm, out), nprocs=2, join=True)
    want_norm, want = (
        _reference(max_norm)
        if max_norm
        else (float(torch.stack([g.norm() for g in FULL_GRADS.values()]).norm()), FULL_GRADS)
    )
    for rank in range(2):
        norm, grads = out[rank]
        assert norm == pytest.approx(want_norm, rel=1e-6)
        for g, name in zip(grads, ("fsdp", "expert", "replicated")):
            torch.testing.assert_close(g, want[name], rtol=1e-6, atol=1e-6, msg=name)


def test_clip_coefficient_is_torchs_clamped_factor():
    """torch's max_norm / (norm + 1e-6) when the norm exceeds max_norm; exactly 1 within it (torch's
    clip_grads_with_norm_ would multiply every grad by 1), when clipping is off (max_norm 0) and for a non-finite
    norm (the trainer skips that step)."""
    assert clip_coefficient(2.0, 1.0) == pytest.approx(0.499999750000125, rel=1e-15)  # 1 / 2.000001, as a literal
    params = [torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(5))]
    for p, g in zip(params, (torch.full((4, 3), 0.1), torch.full((5,), -0.2))):
        p.grad = g
    norm = float(grad_norm(params))
    assert norm == pytest.approx(float(torch.cat([p.grad.flatten() for p in params]).norm()))
    torch.nn.utils.clip_grad_norm_(params, max_norm=norm * 0.99)
    assert float(grad_norm(params)) == pytest.approx(norm * clip_coefficient(norm, norm * 0.99), rel=1e-6)
    assert clip_coefficient(norm, 1.0) == 1.0  # norm ~0.58: within max_norm
    assert clip_coefficient(5.0, 0.0) == 1.0
    assert clip_coefficient(float("inf"), 1.0) == 1.0 and clip_coefficient(float("nan"), 1.0) == 1.0
    assert grad_norm([torch.nn.Parameter(torch.zeros(2))]).item() == 0.0  # no gradient at all


def test_resolve_device_cuda_without_gpu_names_the_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"\[training\] device = 'cuda'"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")


@pytest.fixture
def no_alloc_conf(monkeypatch):
    for name in ALLOC_CONF_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_allocator_settings_go_to_the_environment_before_cuda_starts(no_alloc_conf, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert apply_cuda_allocator_settings("expandable_segments:True") == "expandable_segments:True"
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"


@pytest.mark.parametrize("name", ALLOC_CONF_VARIABLES)
def test_the_environments_allocator_settings_win(no_alloc_conf, monkeypatch, name):
    monkeypatch.setenv(name, "max_split_size_mb:512")
    assert apply_cuda_allocator_settings("expandable_segments:True") == "max_split_size_mb:512"
    assert [os.environ.get(n) for n in ALLOC_CONF_VARIABLES].count("expandable_segments:True") == 0


def test_no_settings_or_cuda_already_started_leave_the_defaults(no_alloc_conf, monkeypatch, caplog):
    assert apply_cuda_allocator_settings("") is None and "PYTORCH_ALLOC_CONF" not in os.environ
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert apply_cuda_allocator_settings("expandable_segments:True") is None
    assert "PYTORCH_ALLOC_CONF" not in os.environ and "not applied: CUDA started" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_allocator_settings_reach_the_allocator():
    """In a fresh process (CUDA not started): the default setting gives expandable segments, empty does not."""
    import subprocess
    import sys

    code = (
        "import sys, torch; from llm_training.distributed.utils import apply_cuda_allocator_settings as a; "
        "a(sys.argv[1]); x = torch.empty(1 << 20, device='cuda'); "
        "print(any(s.get('is_expandable', False) for s in torch.cuda.memory_snapshot()))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ALLOC_CONF_VARIABLES}
    got = {
        value: subprocess.run(
            [sys.executable, "-c", code, value], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        for value in ("expandable_segments:True", "")
    }
    assert got == {"expandable_segments:True": "True", "": "False"}
