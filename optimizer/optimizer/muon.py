"""Muon optimizer (model-spec §8.1) for plain tensors and FSDP2 DTensor parameters (§8.2, §1.3).

Per matrix W [A, B] with gradient G (momentum mu, Nesterov):

    M <- mu M + G;   U = G + mu M  (Nesterov)  or  M;   O = NS5(U)
    W <- W - lr * wd * W - lr * 0.2 * sqrt(max(A, B)) * O          (Moonlight scale: same lr/wd as AdamW)

A parameter is a 2-D matrix, or a 3-D stack [E, out, in] of E independent expert matrices. A param group
may set `row_split = s`: each matrix's rows are cut into `s` equal blocks that are orthogonalised (and
scaled) separately — used for the fused expert `gate_up_proj` [E, 2I, H] (gate half, up half).

Local matrices of the same shape (e.g. `wq_a` of every layer) are orthogonalised in one batched NS call
(up to 2^27 elements per batch), which turns thousands of tiny GPU kernels into a few large ones.

Placement rules (what decides the communication):
  * plain tensor or fully replicated DTensor: orthogonalise locally.
  * 3-D expert stack sharded along dim 0 (the expert dim): every rank holds whole experts, so NS runs
    locally per expert; no communication. FSDP2's uneven shards only mean some ranks hold fewer
    (possibly zero) experts; the DTensor's local tensor is already unpadded. The same holds for expert
    stacks sharded over expert-parallel ranks and then by FSDP2 (placements (_StridedShard(0), Shard(0))).
  * 2-D matrix sharded along dim 0 over one mesh dim: the FULL matrix is orthogonalised, never a shard.
    Each matrix gets one owner rank (greedy longest-processing-time over NS FLOPs, so deterministic from
    shapes alone). Matrices are processed in chunks of `world` matrices: an all-to-all sends every rank's
    rows of the Nesterov input to the owner (in `comm_dtype`), the owner runs NS, a second all-to-all
    returns each rank's rows of the result, and every rank applies decay + update to its local rows.
    The gather of chunk i+1 is issued (async) before NS of chunk i, so communication overlaps compute,
    and the first gather is in flight while the local (unsharded / expert) matrices are orthogonalised.
    Every rank of the group must hold gradients for the same row-sharded parameters (FSDP2 guarantees
    it: its reduce-scatter produces every shard's gradient), since they join the same collectives.

State: `momentum_buffer` per parameter, created with `zeros_like(param)` — a DTensor with the parameter's
placements for DTensor parameters, so DCP saves/loads it sharded. The buffer follows the spec's
`M = mu M + G` (torch.optim.Muon keeps the EMA `(1 - mu)` times this; NS is scale-invariant, so the updates
agree up to the 1e-7 epsilon).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from optimizer._dtensor import chunk_range, local, shard0_mesh_dims
from optimizer.newton_schulz import NS_COEFFICIENTS, NS_EPS, default_ns_dtype, newton_schulz

# Same-shape local updates are orthogonalised together in batches of at most this many elements.
_LOCAL_BATCH_ELEMENTS = 1 << 27

# Moonlight's RMS-matching factor: update RMS ~= 0.2, AdamW's typical update RMS.
MOONLIGHT_SCALE = 0.2


def update_scale(rows: int, cols: int) -> float:
    """Multiplier on lr for an orthogonalised [rows, cols] update: 0.2 * sqrt(max(rows, cols))."""
    return MOONLIGHT_SCALE * math.sqrt(max(rows, cols))


def _matrix_shape(shape: torch.Size, row_split: int) -> tuple[int, int]:
    rows, cols = shape[-2], shape[-1]
    return rows // row_split, cols


def _split_mesh_dims(p: torch.Tensor) -> list[int]:
    """Mesh dims that really split dim 0 of `p` (Shard(0) over more than one rank); a 1-rank FSDP2 mesh
    (single-GPU bf16 training) holds the full matrix, so it takes the local path. Expert stacks may also
    carry FSDP2's _StridedShard(0) over expert parallel: still whole experts per rank."""
    what = f"Muon parameter of shape {tuple(p.shape)}"
    return [d for d in shard0_mesh_dims(p, what, allow_strided=p.ndim == 3) if p.device_mesh.size(d) > 1]


def _ns_flops(shape: torch.Size, row_split: int, steps: int) -> float:
    """Approximate NS cost of one parameter (used only to balance owners)."""
    rows, cols = _matrix_shape(shape, row_split)
    small, big = min(rows, cols), max(rows, cols)
    batch = math.prod(shape[:-2]) * row_split
    return batch * steps * (4.0 * small * small * big + 2.0 * small**3)


@dataclass
class _ShardedItem:
    """A 2-D row-sharded parameter waiting for the owner pipeline."""

    param: torch.Tensor  # DTensor
    update_local: torch.Tensor  # [local_rows, B] Nesterov input on this rank
    group: dict
    flops: float
    owner: int = -1


class Muon(torch.optim.Optimizer):
    """Muon with Nesterov momentum, Moonlight update scaling and decoupled weight decay.

    Args:
        params: parameters or param-group dicts (group keys: lr, weight_decay, momentum, nesterov,
            ns_steps, row_split).
        lr, weight_decay, momentum, nesterov, ns_steps: per-group defaults (§8.1).
        ns_coefficients, eps: Newton-Schulz quintic coefficients and normalisation epsilon.
        ns_dtype: dtype NS runs in; None = bf16 on CUDA, fp32 on CPU.
        comm_dtype: dtype of the all-to-all payload for sharded matrices; None = the NS dtype.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = NS_EPS,
        ns_dtype: torch.dtype | None = None,
        comm_dtype: torch.dtype | None = None,
    ) -> None:
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1 or ns_steps < 1:
            raise ValueError(
                f"Muon: invalid hyperparameters lr={lr}, weight_decay={weight_decay}, "
                f"momentum={momentum} (needs 0 <= momentum < 1), ns_steps={ns_steps} (needs >= 1)"
            )
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, row_split=1
        )
        super().__init__(params, defaults)
        self.ns_coefficients = tuple(ns_coefficients)
        self.eps = eps
        self.ns_dtype = ns_dtype
        self.comm_dtype = comm_dtype
        for group in self.param_groups:
            for p in group["params"]:
                self._check_param(p, group["row_split"])

    @staticmethod
    def _check_param(p: torch.Tensor, row_split: int) -> None:
        if p.ndim not in (2, 3):
            raise ValueError(
                f"Muon takes 2-D matrices or 3-D expert stacks [E, out, in]; got shape {tuple(p.shape)} "
                "(route other parameters to AdamW in the grouping rules)"
            )
        if p.shape[-2] % row_split:
            raise ValueError(f"Muon: row_split={row_split} does not divide the rows of shape {tuple(p.shape)}")
        dims = _split_mesh_dims(p)
        if p.ndim == 2 and len(dims) > 1:
            raise ValueError(
                f"Muon: a 2-D parameter {tuple(p.shape)} sharded on dim 0 over several mesh dims "
                f"({tuple(p.placements)}) is not supported; shard over one mesh dim (FSDP2 / HSDP)"
            )

    # ------------------------------------------------------------------ math on one (local) block
    def _orthogonalise(self, u: torch.Tensor, row_split: int, ns_steps: int) -> torch.Tensor:
        """NS of every [rows/row_split, cols] block of `u` [..., rows, cols]; same shape as `u`."""
        rows, cols = u.shape[-2], u.shape[-1]
        blocks = u.reshape(*u.shape[:-2], row_split, rows // row_split, cols)
        out = newton_schulz(blocks, ns_steps, self.ns_coefficients, self.eps, self._ns_dtype(u))
        return out.reshape(u.shape)

    def _ns_dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.ns_dtype or default_ns_dtype(t.device)

    @staticmethod
    def _apply(p_local: torch.Tensor, ortho: torch.Tensor, group: dict, full_shape: torch.Size) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        rows, cols = _matrix_shape(full_shape, group["row_split"])
        if wd:
            p_local.mul_(1.0 - lr * wd)
        p_local.add_(ortho.to(p_local.dtype), alpha=-lr * update_scale(rows, cols))

    def init_state(self) -> None:
        """Create the zero momentum buffers of every parameter without stepping. DCP's
        `set/get_optimizer_state_dict` would otherwise initialise state with a full zero-grad step
        (every NS and all-to-all of a real step)."""
        for group in self.param_groups:
            for p in group["params"]:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sharded: dict[tuple, list[_ShardedItem]] = {}
        local_buckets: dict[tuple, list[tuple[torch.Tensor, torch.Tensor, dict]]] = {}
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                g, m = local(p.grad), local(state["momentum_buffer"])
                m.mul_(mu).add_(g)
                update = g.add(m, alpha=mu) if group["nesterov"] else m
                mesh_dims = _split_mesh_dims(p)
                if p.ndim == 3 or not mesh_dims:
                    key = (tuple(update.shape), update.dtype, update.device, group["row_split"], group["ns_steps"])
                    bucket = local_buckets.setdefault(key, [])
                    if bucket and (len(bucket) + 1) * update.numel() > _LOCAL_BATCH_ELEMENTS:
                        self._step_local(bucket)
                        bucket.clear()
                    bucket.append((p, update, group))
                else:
                    key = (id(p.device_mesh), mesh_dims[0])
                    flops = _ns_flops(p.shape, group["row_split"], group["ns_steps"])
                    sharded.setdefault(key, []).append(_ShardedItem(p, update, group, flops))
        # start every sharded pipeline (its first all-to-all is in flight during the local NS), then finish them
        pipelines = [self._sharded_pipeline(items) for items in sharded.values()]
        for pipeline in pipelines:
            next(pipeline)
        for bucket in local_buckets.values():
            self._step_local(bucket)
        for pipeline in pipelines:
            for _ in pipeline:
                pass
        return loss

    def _step_local(self, bucket: list[tuple[torch.Tensor, torch.Tensor, dict]]) -> None:
        """NS of same-shape local updates as one batched call (few large kernels instead of many tiny
        ones), then decay + update per parameter."""
        _, first_update, first_group = bucket[0]
        stacked = first_update[None] if len(bucket) == 1 else torch.stack([u for _, u, _ in bucket])
        ortho = self._orthogonalise(stacked, first_group["row_split"], first_group["ns_steps"])
        for (p, _, group), o in zip(bucket, ortho):
            self._apply(local(p), o, group, p.shape)

    # ------------------------------------------------------------------ distributed (owner) path
    def _sharded_pipeline(self, items: list[_ShardedItem]):
        """Owner pipeline for row-sharded 2-D matrices of one mesh group (see module doc). A generator: it
        pauses once, right after issuing the first gather, so the caller can overlap other work."""
        p0 = items[0].param
        mesh_dim = _split_mesh_dims(p0)[0]
        pg = p0.device_mesh.get_group(mesh_dim)
        world, me = p0.device_mesh.size(mesh_dim), p0.device_mesh.get_local_rank(mesh_dim)
        # Greedy LPT owner assignment; the order depends only on shapes, so every rank agrees.
        order = sorted(range(len(items)), key=lambda i: (-items[i].flops, i))
        load = [0.0] * world
        for i in order:
            owner = min(range(world), key=lambda r: (load[r], r))
            items[i].owner = owner
            load[owner] += items[i].flops
        ordered = [items[i] for i in order]
        chunks = [ordered[i : i + world] for i in range(0, len(ordered), world)]
        comm_dtype = self.comm_dtype or self._ns_dtype(p0)

        device = local(p0).device

        def rows_of(item: _ShardedItem, rank: int) -> tuple[int, int]:
            return chunk_range(item.param.shape[0], world, rank)

        def numel_on(item: _ShardedItem, rank: int) -> int:
            r0, r1 = rows_of(item, rank)
            return (r1 - r0) * item.param.shape[1]

        def exchange(sends: list[torch.Tensor], in_split: list[int], out_split: list[int]):
            send = torch.cat(sends).to(comm_dtype) if sends else torch.empty(0, dtype=comm_dtype, device=device)
            recv = send.new_empty(sum(out_split))
            work = dist.all_to_all_single(recv, send, out_split, in_split, group=pg, async_op=True)
            return work, recv, out_split

        def launch_gather(chunk):
            sends, in_split, out_split = [], [], []
            for dst in range(world):
                mine = [it.update_local.reshape(-1) for it in chunk if it.owner == dst]
                sends.extend(mine)
                in_split.append(sum(t.numel() for t in mine))
            for src in range(world):
                out_split.append(sum(numel_on(it, src) for it in chunk if it.owner == me))
            return exchange(sends, in_split, out_split)

        def orthogonalise_owned(chunk, recv, out_split):
            """Assemble each owned full matrix from the ranks' rows, NS it; returns {item index: O}."""
            pieces = list(torch.split(recv, out_split))
            owned = [it for it in chunk if it.owner == me]
            full_rows: dict[int, list[torch.Tensor]] = {id(it): [] for it in owned}
            for src in range(world):
                offset = 0
                for it in owned:
                    n, cols = numel_on(it, src), it.param.shape[1]
                    full_rows[id(it)].append(pieces[src][offset : offset + n].view(n // cols, cols))
                    offset += n
            return {
                id(it): self._orthogonalise(torch.cat(full_rows[id(it)]), it.group["row_split"], it.group["ns_steps"])
                for it in owned
            }

        def launch_scatter(chunk, ortho_owned):
            sends, in_split, out_split = [], [], []
            owned = [it for it in chunk if it.owner == me]
            for dst in range(world):
                mine = [ortho_owned[id(it)][slice(*rows_of(it, dst))].reshape(-1) for it in owned]
                sends.extend(mine)
                in_split.append(sum(t.numel() for t in mine))
            for src in range(world):
                out_split.append(sum(it.update_local.numel() for it in chunk if it.owner == src))
            return exchange(sends, in_split, out_split)

        def apply_received(chunk, recv, out_split):
            pieces = list(torch.split(recv, out_split))
            for src in range(world):
                offset = 0
                for it in chunk:
                    if it.owner != src:
                        continue
                    n = it.update_local.numel()
                    ortho_local = pieces[src][offset : offset + n].view(it.update_local.shape)
                    offset += n
                    self._apply(local(it.param), ortho_local, it.group, it.param.shape)

        gathers = [launch_gather(chunks[0])]
        yield
        scatters = []
        for i, chunk in enumerate(chunks):
            if i + 1 < len(chunks):
                gathers.append(launch_gather(chunks[i + 1]))  # overlaps the NS below
            work, recv, out_split = gathers[i]
            work.wait()
            scatters.append((chunk, launch_scatter(chunk, orthogonalise_owned(chunk, recv, out_split))))
        for chunk, (work, recv, out_split) in scatters:
            work.wait()
            apply_received(chunk, recv, out_split)
