"""Distributed Muon on 2 NCCL ranks (2 GPUs) with FSDP2 (`fully_shard`) parameters vs single-process Muon on one GPU.

The CUDA twin of test_muon_distributed.py (same parameters, initial values and gradients, imported from it):
row-sharded 2-D matrices with uneven shards (13 rows -> 7 + 6; 3 rows -> 2 + 1; 9 rows -> 5 + 4; same-shape and
transposed matrices batched per owner; a 2-D row-split matrix) take the owner all-to-all path, the expert stack [3, 10, 6] (uneven on the expert dim: 2 + 1 experts) and the row-split
gate_up stack [5, 8, 6] take the local per-expert path. The reference runs in the test process on cuda:0.

Two precisions, each compared after STEPS steps:
- fp32 NS and fp32 all-to-all (`ns_dtype = comm_dtype = float32`, TF32 off in both): each owner
  orthogonalises exactly the matrix the single process sees, so the only differences are GEMM kernel
  choices (batched same-shape NS in the single process vs per-owner NS): fp32 rounding amplified by 5 NS
  iterations. Bound: atol 1e-5 (updates are ~1e-2 per entry per step, so a wrong shard, owner or scale fails
  by orders of magnitude).
- the CUDA defaults (`ns_dtype = comm_dtype = None` -> bf16 NS and a bf16 all-to-all): both sides cast the same
  fp32 Nesterov input to bf16, but differently batched bf16 GEMMs may round their outputs differently, which
  NS propagates: a few bf16 ulps (2^-8 ~ 4e-3 relative) of an update whose entries are at most
  lr x 0.2 sqrt(max(A, B)) x |O| <~ 0.03 x 1 x 1 per step; over 3 steps <= 3 x 0.03 x 4 x 4e-3 ~ 1.5e-3.
  Bound: atol 2e-3.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_muon_distributed import ROW_SPLIT, STEPS, _grads, _Holder, _init_params
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

WORLD = 2
# (ns_dtype, comm_dtype, atol) per precision case; see the module docstring for the bounds
CASES = {"fp32": (torch.float32, torch.float32, 1e-5), "cuda_default_bf16": (None, None, 2e-3)}

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA GPUs"),
]


def _muon(params_by_name, ns_dtype, comm_dtype):
    """Muon with the CPU test's grouping (gate_up in a row_split=2 group), at the given precisions."""
    from optimizer import Muon

    groups = [
        {"params": [p for k, p in params_by_name.items() if ROW_SPLIT.get(k, 1) == 1]},
        {"params": [p for k, p in params_by_name.items() if ROW_SPLIT.get(k, 1) == 2], "row_split": 2},
    ]
    return Muon(groups, lr=0.03, weight_decay=0.1, ns_dtype=ns_dtype, comm_dtype=comm_dtype)


def _single_gpu_result(ns_dtype, comm_dtype) -> dict[str, torch.Tensor]:
    """The reference: plain CUDA tensors in this process, each full matrix orthogonalised locally."""
    device = torch.device("cuda", 0)
    params = {k: v.to(device).requires_grad_() for k, v in _init_params().items()}
    opt = _muon(params, ns_dtype, comm_dtype)
    for step in range(STEPS):
        for k, g in _grads(step).items():
            params[k].grad = g.to(device)
        opt.step()
    return {k: p.detach().cpu() for k, p in params.items()}


def _worker(rank, port, expected_by_case):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1"
    )
    torch.set_float32_matmul_precision("highest")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=WORLD, device_id=device)
    try:
        mesh = init_device_mesh("cuda", (WORLD,))
        for case, (ns_dtype, comm_dtype, atol) in CASES.items():
            model = _Holder(_init_params()).to(device)
            fully_shard(model, mesh=mesh)
            params = dict(model.named_parameters())
            opt = _muon(params, ns_dtype, comm_dtype)
            for step in range(STEPS):
                for k, g in _grads(step).items():
                    params[k].grad = distribute_tensor(g.to(device), mesh, [Shard(0)])
                opt.step()
            for k, p in params.items():
                torch.testing.assert_close(p.full_tensor().cpu(), expected_by_case[case][k], rtol=0, atol=atol,
                                           msg=lambda m: f"{case} {k}: {m}")  # fmt: skip
                buf = opt.state[p]["momentum_buffer"]
                assert type(buf).__name__ == "DTensor" and buf.placements == p.placements, (case, k)
    finally:
        dist.destroy_process_group()


def test_fsdp2_nccl_muon_matches_single_gpu(free_port):
    torch.set_float32_matmul_precision("highest")
    expected_by_case = {case: _single_gpu_result(ns, comm) for case, (ns, comm, _) in CASES.items()}
    # the two precisions must really differ, or the bf16 case would not test the CUDA default path
    assert max((expected_by_case["fp32"][k] - expected_by_case["cuda_default_bf16"][k]).abs().max() for k in
               expected_by_case["fp32"]) > 0  # fmt: skip
    # spawn, not fork: CUDA is initialised in this process
    mp.start_processes(_worker, args=(free_port, expected_by_case), nprocs=WORLD, join=True, start_method="spawn")
