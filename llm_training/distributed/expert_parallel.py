"""Expert parallelism, applied from outside the model (docs/architecture.md §5, docs/model-spec.md §6).

The MoE layer stays collective-free: it routes, sorts its rows by expert and calls
`moe.experts(x_rows_NH, tokens_per_expert_E)` with counts over ALL E experts. `apply_expert_parallel`
turns every `GroupedExperts` into the owner of E/ep consecutive experts (EP rank r holds experts
[r*L, (r+1)*L), L = E/ep) and patches its forward (the module tree and FQNs stay the same) into:

    dispatch:  exchange the per-expert counts, variable-split all-to-all of the rows (they are already
               grouped by destination rank, since each rank owns a contiguous expert range), permute the
               received rows from (source rank, local expert) order to (local expert, source rank) order
    compute:   the module's own forward on the local experts (it pads every expert group to the grouped
               GEMM's alignment itself, `group_multiple`), grouped GEMM + grouped PolyNorm
    combine:   inverse permutation, reverse all-to-all; the MoE then weights and combines the rows in its
               own order, exactly as on one rank

Backward runs the same all-to-alls in reverse (autograd through the functional collectives).

Expert parameters (gate_up_proj [E, 2I, H], down_proj [E, H, I], act_fn.weight [E, 3], act_fn.bias [E, 1])
become DTensors `Shard(0)` over the 1-D `ep` mesh, holding this rank's [L, ...] rows. Why DTensors and not
plain local tensors: the state dict keeps the global shapes and FQNs, so DCP reshards a checkpoint across
EP layouts and the HF export gathers full tensors with `full_tensor()`; FSDP2 applied afterwards over the
`dp_shard_mod_ep` mesh of the same root mesh (`ParallelDims.ep_mesh`) treats the `ep` placement like a TP
placement and shards dim 0 further (the expert module must be its own `fully_shard` group); Muon handles a
3-D Shard(0) stack locally per expert (no communication, `optimizer/muon.py`). The model reads the local
tensors through `to_local()` (layers/moe.py, layers/norms.py), a view, not a collective.

Gradients: the reverse all-to-all already sums every EP rank's tokens into the expert gradients, so
expert grads are summed only over the ranks holding the SAME experts, the non-EP data ranks
(dp_replicate x dp_shard_mod_ep; `expert_grad_mesh`). Everything else (router, shared expert, ...) is
summed over all data ranks as without EP. The MoE's `tokens_per_expert` are counted before dispatch over
all E experts from this rank's tokens, so a SUM all-reduce over all ranks gives the global counts for the
expert-bias update; the sequence-wise balance loss is computed per sequence on the rank that holds it.

Dispatchers: "all_to_all" (torch.distributed, any backend; default) and "deepep" (DeepEP V1 `Buffer`
normal kernels, CUDA + NVLink/RDMA only, imported lazily; `check_dispatcher_available`).
(Design borrowed from torchtitan's ExpertParallel and DeepEP's documented training usage; see
THIRD_PARTY_NOTICES.md.)
"""

from __future__ import annotations

import abc
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llm_training.errors import ConfigError

DISPATCHER_KEY = "[parallelism] expert_parallel_dispatcher"


# ---------------------------------------------------------------------------------------------- routing math
def exchange_counts(tokens_per_expert_E: torch.Tensor, group) -> torch.Tensor:
    """All-to-all of the per-expert row counts. Returns recv_counts_PL [P, L] (long): rows that source
    rank s sends to this rank's local expert l. `tokens_per_expert_E` counts this rank's rows per global
    expert (E = P * L)."""
    P = dist.get_world_size(group)
    send_PL = tokens_per_expert_E.detach().long().reshape(P, -1).contiguous()
    recv_PL = torch.empty_like(send_PL)
    dist.all_to_all_single(recv_PL, send_PL, group=group)
    return recv_PL


def source_to_expert_order(recv_counts_PL: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Index [M] that reorders received rows from (source rank, local expert) blocks to (local expert,
    source rank) blocks: `x_local = x_recv[index]`. Inside a block the row order is kept. No host sync."""
    P, L = recv_counts_PL.shape
    device = recv_counts_PL.device
    counts_LP = recv_counts_PL.t().reshape(-1)  # blocks in local (expert-major) order
    local_block = torch.repeat_interleave(torch.arange(L * P, device=device), counts_LP, output_size=num_rows)
    local_start_LP = torch.cumsum(counts_LP, 0) - counts_LP
    recv_start_PL = torch.cumsum(recv_counts_PL.reshape(-1), 0) - recv_counts_PL.reshape(-1)
    recv_start_LP = recv_start_PL.view(P, L).t().reshape(-1)
    return torch.arange(num_rows, device=device) - local_start_LP[local_block] + recv_start_LP[local_block]


def inverse_permutation(index_M: torch.Tensor) -> torch.Tensor:
    """`inv` with inv[index[i]] = i, so `y[inv]` undoes `x[index]`."""
    return torch.empty_like(index_M).scatter_(0, index_M, torch.arange(index_M.numel(), device=index_M.device))


# ---------------------------------------------------------------------------------------------- dispatchers
class ExpertDispatcher(abc.ABC):
    """Moves expert-sorted rows to the ranks owning their experts and back.

    `dispatch(x_NH, tokens_per_expert_E)` -> (x_local_MH grouped by local expert, counts_L, route);
    `combine(y_local_MH, route)` -> y_NH in the caller's row order. Both are differentiable in the rows.
    """

    @abc.abstractmethod
    def dispatch(self, x_NH: torch.Tensor, tokens_per_expert_E: torch.Tensor):
        """Rows grouped by global expert (tokens_per_expert_E[e] rows for expert e) -> this rank's rows."""

    @abc.abstractmethod
    def combine(self, y_local_MH: torch.Tensor, route: Any) -> torch.Tensor:
        """Expert outputs of this rank's rows -> outputs of the rows given to `dispatch`, in their order."""


@dataclass
class _AllToAllRoute:
    send_splits: list[int]  # rows this rank sends to each EP rank
    recv_splits: list[int]  # rows this rank receives from each EP rank
    to_local: torch.Tensor  # [M]: x_local = x_recv[to_local]


class AllToAllDispatcher(ExpertDispatcher):
    """Counts all-to-all, then one variable-split all-to-all of the rows each way
    (`torch.distributed._functional_collectives.all_to_all_single_autograd`: its backward is the
    reverse all-to-all). One device-to-host copy of the split sizes per call (a data-dependent `.tolist()`):
    the expert-parallel forward runs eagerly under torch.compile (`_wrap_forward`)."""

    def __init__(self, group) -> None:
        self.group = group

    def dispatch(self, x_NH: torch.Tensor, tokens_per_expert_E: torch.Tensor):
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        recv_PL = exchange_counts(tokens_per_expert_E, self.group)
        send_P = tokens_per_expert_E.detach().long().view(recv_PL.shape).sum(1)
        send_splits, recv_splits = torch.stack([send_P, recv_PL.sum(1)]).tolist()
        x_recv = all_to_all_single_autograd(x_NH.contiguous(), recv_splits, send_splits, self.group)
        to_local = source_to_expert_order(recv_PL, sum(recv_splits))
        return x_recv[to_local], recv_PL.sum(0), _AllToAllRoute(send_splits, recv_splits, to_local)

    def combine(self, y_local_MH: torch.Tensor, route: _AllToAllRoute) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        y_recv = y_local_MH[inverse_permutation(route.to_local)]
        return all_to_all_single_autograd(y_recv.contiguous(), route.send_splits, route.recv_splits, self.group)


def _import_deep_ep():
    """The `deep_ep` module, or ConfigError with the reason it cannot be used."""
    try:
        return importlib.import_module("deep_ep")
    except Exception as exc:  # ImportError, or a broken build failing in its CUDA extension
        raise ConfigError(
            f"{DISPATCHER_KEY} = 'deepep' needs DeepEP, which cannot be imported here ({type(exc).__name__}: "
            f"{exc}); DeepEP is built from source in the CUDA image (docker/cuda/llm-training.Dockerfile; PyPI's "
            f"deep-ep is a stale placeholder). Use 'all_to_all' elsewhere."
        ) from exc


class _DeepEPDispatchFn(torch.autograd.Function):
    """DeepEP dispatch of rows (one expert per row); backward = combine of the gradients."""

    @staticmethod
    def forward(ctx, x_NH, topk_idx_N1, num_experts, buffer):
        layout = buffer.get_dispatch_layout(topk_idx_N1, num_experts)
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = layout
        recv_x, recv_idx, _, recv_per_expert, handle, _ = buffer.dispatch(
            x_NH,
            topk_idx=topk_idx_N1,
            topk_weights=torch.ones(topk_idx_N1.shape, dtype=torch.float32, device=x_NH.device),
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert,
        )
        ctx.buffer, ctx.handle = buffer, handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, handle, recv_per_expert

    @staticmethod
    def backward(ctx, grad_recv_x, *_):
        grad_x, _, _ = ctx.buffer.combine(grad_recv_x.contiguous(), ctx.handle)
        return grad_x, None, None, None


class _DeepEPCombineFn(torch.autograd.Function):
    """DeepEP combine (sum over the ranks each row went to: exactly one here); backward = cached dispatch."""

    @staticmethod
    def forward(ctx, y_recv_MH, handle, buffer):
        y_NH, _, _ = buffer.combine(y_recv_MH, handle)
        ctx.buffer, ctx.handle = buffer, handle
        return y_NH

    @staticmethod
    def backward(ctx, grad_y_NH):
        grad_recv, *_ = ctx.buffer.dispatch(grad_y_NH.contiguous(), handle=ctx.handle)
        return grad_recv, None, None


@dataclass
class _DeepEPRoute:
    handle: Any
    to_local: torch.Tensor


class DeepEPDispatcher(ExpertDispatcher):
    """DeepEP V1 normal (high-throughput) kernels: `Buffer.get_dispatch_layout` / `dispatch` / `combine`,
    intranode over NVLink and internode over RDMA. Each expert-sorted row is sent as a token with top-1
    routing to its expert, so rows keep the MoE's interface (a token routed to two experts on one rank is
    sent twice: DeepEP's per-token deduplication is not used). Rows must be bf16 on CUDA.
    NOT RUN in this repository's tests (no GPU, no DeepEP): written against DeepEP's documented API."""

    def __init__(self, group) -> None:
        self.deep_ep = _import_deep_ep()
        self.topk_dtype = getattr(self.deep_ep, "topk_idx_t", torch.int64)
        self.group = group
        self.buffer = None

    def _buffer(self, hidden_bytes: int):
        Buffer = self.deep_ep.Buffer
        size = self.group.size()
        nvl_bytes = rdma_bytes = 0
        for config in (Buffer.get_dispatch_config(size), Buffer.get_combine_config(size)):
            nvl_bytes = max(nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, size))
            rdma_bytes = max(rdma_bytes, config.get_rdma_buffer_size_hint(hidden_bytes, size))
        if self.buffer is None or self.buffer.num_nvl_bytes < nvl_bytes or self.buffer.num_rdma_bytes < rdma_bytes:
            self.buffer = Buffer(self.group, nvl_bytes, rdma_bytes)
        return self.buffer

    def dispatch(self, x_NH: torch.Tensor, tokens_per_expert_E: torch.Tensor):
        if x_NH.dtype != torch.bfloat16 or not x_NH.is_cuda:
            raise ValueError(
                f"{DISPATCHER_KEY} = 'deepep' needs bf16 rows on CUDA, got {x_NH.dtype} on {x_NH.device}; use "
                "'all_to_all' for fp32 / CPU runs"
            )
        if torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory:
            raise ConfigError(
                f"{DISPATCHER_KEY} = 'deepep' cannot run with training.deterministic: DeepEP rejects deterministic "
                "algorithms together with torch.utils.deterministic.fill_uninitialized_memory (the fill kernels race "
                "its communication stream); set training.deterministic = false or use 'all_to_all'"
            )
        E = tokens_per_expert_E.numel()
        L = E // self.group.size()
        expert_of_row = torch.repeat_interleave(
            torch.arange(E, device=x_NH.device), tokens_per_expert_E.long(), output_size=x_NH.shape[0]
        )
        buffer = self._buffer(x_NH.shape[1] * x_NH.element_size())
        recv_x, recv_idx, handle, recv_per_expert = _DeepEPDispatchFn.apply(
            x_NH.contiguous(), expert_of_row[:, None].to(self.topk_dtype), E, buffer
        )
        local_expert = recv_idx[:, 0].long()  # DeepEP gives received experts as local indices
        to_local = torch.argsort(local_expert, stable=True)
        counts_L = torch.tensor(recv_per_expert, dtype=torch.long, device=x_NH.device)
        if counts_L.numel() != L:
            raise RuntimeError(f"DeepEP returned counts for {counts_L.numel()} local experts, expected {L}")
        return recv_x[to_local], counts_L, _DeepEPRoute(handle, to_local)

    def combine(self, y_local_MH: torch.Tensor, route: _DeepEPRoute) -> torch.Tensor:
        y_recv = y_local_MH[inverse_permutation(route.to_local)]
        return _DeepEPCombineFn.apply(y_recv.contiguous(), route.handle, self.buffer)


DISPATCHERS: dict[str, type[ExpertDispatcher]] = {"all_to_all": AllToAllDispatcher, "deepep": DeepEPDispatcher}


def check_dispatcher_available(name: str) -> None:
    """For config validation: ConfigError when `name` is unknown or its library cannot be imported."""
    if name not in DISPATCHERS:
        raise ConfigError(f"{DISPATCHER_KEY} must be one of {sorted(DISPATCHERS)}, got {name!r}")
    if name == "deepep":
        _import_deep_ep()


# ---------------------------------------------------------------------------------------------- applying EP
@dataclass
class ExpertParallelPlan:
    """What apply_expert_parallel did: the EP mesh, the dispatcher and the FQNs of the sharded expert
    parameters (their grads are summed over `expert_grad_mesh` only, never over the EP ranks)."""

    ep_mesh: Any  # 1-D DeviceMesh
    dispatcher: ExpertDispatcher
    expert_param_names: list[str] = field(default_factory=list)


def _as_1d_mesh(ep_mesh_or_group):
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(ep_mesh_or_group, DeviceMesh):
        if ep_mesh_or_group.ndim != 1:
            raise ValueError(f"expert parallel needs a 1-D EP mesh, got dims {ep_mesh_or_group.mesh_dim_names}")
        return ep_mesh_or_group
    device_type = "cuda" if dist.get_backend(ep_mesh_or_group) == "nccl" else "cpu"
    return DeviceMesh.from_group(ep_mesh_or_group, device_type, mesh_dim_names=("ep",))


def _shard_parameter(module: nn.Module, name: str, mesh) -> None:
    """Replace `module.<name>` by a DTensor Shard(0) holding this rank's rows of it (a copy: the full
    tensor is freed). The values are the full tensor's rows, so a model initialised in full first
    (CPU) keeps single-process weights; on meta the shard is meta too, to be initialised later."""
    from torch.distributed.tensor import DTensor, Shard

    full = getattr(module, name)
    P, rank = mesh.size(), mesh.get_local_rank()
    rows = full.shape[0] // P
    local = full.detach()[rank * rows : (rank + 1) * rows].clone()
    shard = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
    setattr(module, name, nn.Parameter(shard, requires_grad=full.requires_grad))


def _wrap_forward(experts: nn.Module, dispatcher: ExpertDispatcher) -> None:
    inner: Callable = experts.forward

    # Eager under torch.compile: the rows this rank receives change every step (a static-shape compile would
    # recompile each time, a dynamic one could hand a checkpoint's recompute another graph than its forward ran:
    # distributed.compile.compile_in_pieces), the split sizes are host values, and the experts are their own FSDP2
    # group, whose hooks dynamo does not trace anyway. The GEMMs are the same grouped GEMMs eagerly.
    @torch.compiler.disable
    @functools.wraps(inner)
    def forward(x_NH: torch.Tensor, tokens_per_expert_E: torch.Tensor, group_multiple=None) -> torch.Tensor:
        x_local, counts_L, route = dispatcher.dispatch(x_NH, tokens_per_expert_E)
        y_local = inner(x_local, counts_L, group_multiple)
        return dispatcher.combine(y_local, route)

    experts.forward = forward


def apply_expert_parallel(model: nn.Module, ep_mesh_or_group, dispatcher: str = "all_to_all") -> ExpertParallelPlan:
    """Shard every GroupedExperts of `model` over the EP ranks and route its rows through `dispatcher`.

    `ep_mesh_or_group`: the 1-D "ep" mesh (`parallel_dims.ep_mesh["ep"]`, so FSDP2 can later shard the
    experts over `ep_mesh["dp_shard_mod_ep"]` of the same root mesh) or an EP process group (its mesh is
    then built on CUDA for NCCL, on CPU otherwise). Call before FSDP2 and before `init_weights` /
    checkpoint loading on a meta model, or on a fully initialised model (its rows are kept).
    """
    from llm_training.layers.moe import GroupedExperts

    check_dispatcher_available(dispatcher)
    mesh = _as_1d_mesh(ep_mesh_or_group)
    P = mesh.size()
    disp = DISPATCHERS[dispatcher](mesh.get_group())
    names = []
    for fqn, module in model.named_modules():
        if not isinstance(module, GroupedExperts):
            continue
        if module.num_experts % P:
            raise ConfigError(
                f"[parallelism] expert_parallel_degree = {P} must divide num_experts = {module.num_experts} "
                f"({fqn}); pick a divisor of {module.num_experts}"
            )
        for sub_name, sub in [("", module), ("act_fn", module.act_fn)]:
            for name, _ in list(sub.named_parameters(recurse=False)):
                _shard_parameter(sub, name, mesh)
                names.append(".".join(part for part in (fqn, sub_name, name) if part))
        _wrap_forward(module, disp)
    return ExpertParallelPlan(mesh, disp, names)


def expert_grad_mesh(parallel_dims):
    """The mesh over which expert-parameter grads are summed and FSDP2 shards the experts: the non-EP data
    ranks of `parallel_dims.ep_mesh`, `("dp_replicate", "dp_shard_mod_ep")` with replication (HSDP) else
    `"dp_shard_mod_ep"` (the rule the dense FSDP2 mesh follows). Size 1 when one EP group holds every
    expert once: nothing to sum, but FSDP2 over it still gives CUDA's bf16 mixed precision."""
    mesh = parallel_dims.ep_mesh
    if mesh is None:
        raise ValueError("expert_grad_mesh: parallel_dims.build_mesh() has not been called")
    return mesh["dp_replicate", "dp_shard_mod_ep"] if parallel_dims.dp_replicate_enabled else mesh["dp_shard_mod_ep"]


@torch.no_grad()
def sum_expert_grads(model: nn.Module, names: list[str], grad_mesh) -> None:
    """SUM-all-reduce, over `grad_mesh` (`expert_grad_mesh`: the non-EP data ranks), the gradients of
    EP-sharded expert parameters that FSDP2 does not reduce itself (the fp32 grouped-PolyNorm `act_fn`
    kept outside FSDP2 as `ignored_params`). Works on the local [L, ...] shards in one flat buffer; a
    no-op on a 1-rank mesh."""
    from llm_training.dtensor_views import local_tensor

    if grad_mesh.size() == 1 or not names:
        return
    params = [model.get_parameter(name) for name in names]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [local_tensor(p.grad) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    for dim in range(grad_mesh.ndim):  # a sum over each dim in turn is the sum over all of them
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=grad_mesh.get_group(dim))
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
