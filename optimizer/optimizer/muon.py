"""Muon optimizer (docs/model-spec.md §8.1) for plain tensors and FSDP2 DTensor parameters (§8.2, §1.3).

Per matrix W [A, B] with gradient G (momentum mu, Nesterov):

    M <- mu M + G;   U = G + mu M  (Nesterov)  or  M;   O = NS5(U)
    W <- W - lr * wd * W - lr * 0.2 * sqrt(max(A, B)) * O          (Moonlight scale: same lr/wd as AdamW)

A parameter is a 2-D matrix, or a 3-D stack [E, out, in] of E independent expert matrices. A param group
may set `row_split = s`: each matrix's rows are cut into `s` equal blocks that are orthogonalised (and
scaled) separately — used for the fused expert `gate_up_proj` [E, 2I, H] (gate half, up half).

One step, in launches (docs/model-spec.md §8.1 arithmetic: momentum, norms, division and update in fp32; the NS
input stored and iterated in the NS dtype, bf16 on CUDA):
  1. Matrices are bucketed by their wide shape [min(r, c), max(r, c)] (r = rows / row_split) and lr: the same
     bucket takes `wq_a` of every layer, the gate and up halves of every expert stack, and `down_proj`
     [E, H, I] transposed next to `gate_up_proj`'s [I, H] halves; the Moonlight scale depends only on
     max(r, c), so `-lr * scale` is one number per bucket.
  2. Per parameter, one elementwise pass: momentum `M <- G + mu M` stored into M, and the Nesterov input
     `G + mu M` (fp32 arithmetic) written straight into the parameter's slots of the bucket's stack [N, m, k] in
     the NS dtype (tall ones through a transposed view): no intermediate tensor, no cast. On CUDA one tiled Triton
     kernel (`muon_kernels`); elsewhere two torch kernels.
  3. One Newton-Schulz per bucket (up to 2^27 elements; a parameter is never split): Frobenius norms
     accumulated in fp32, division in fp32 arithmetic in place on the stack, iterations in the NS dtype,
     every product one batched matmul over the N matrices; the last iteration's [N, m, m] factor carries
     `-lr * scale`, so the stack holds the finished update `D = -lr * scale * O`.
  4. Decay and update in one kernel per parameter: `W <- D + (1 - lr wd) W` (written into W, reading the bf16
     stack directly; fp32 arithmetic; the tiled Triton kernel on CUDA, a torch `add` elsewhere).

Placement rules (what decides the communication):
  * plain tensor or fully replicated DTensor: orthogonalise locally.
  * 3-D expert stack sharded along dim 0 (the expert dim): every rank holds whole experts, so NS runs
    locally per expert; no communication. FSDP2's uneven shards only mean some ranks hold fewer
    (possibly zero) experts; the DTensor's local tensor is already unpadded. The same holds for expert
    stacks sharded over expert-parallel ranks and then by FSDP2 (placements (_StridedShard(0), Shard(0))).
  * 2-D matrix sharded along dim 0 over one mesh dim: the FULL matrix is orthogonalised, never a shard.
    Each matrix gets one owner rank (greedy longest-processing-time over NS FLOPs, so deterministic from
    shapes alone). Matrices are processed in chunks of one wide shape (up to about `world` stacks of 2^27
    elements): an all-to-all sends every rank's rows of the Nesterov input (written straight into the send
    buffer in `comm_dtype`) to their owners, each owner places the rows of its matrices of the chunk into one
    stack and runs one batched NS, a second all-to-all returns each rank's rows of the result, and every rank
    applies decay + update to its local rows in one kernel (step 4).
    The gather of chunk i+1 is issued (async) before NS of chunk i, so communication overlaps compute,
    and the first gather is in flight while the local (unsharded / expert) matrices are orthogonalised.
    Every rank of the group must hold gradients for the same row-sharded parameters (FSDP2 guarantees
    it: its reduce-scatter produces every shard's gradient), since they join the same collectives.

State: `momentum_buffer` per parameter, created with `zeros_like(param)` — a DTensor with the parameter's
placements for DTensor parameters, so DCP saves/loads it sharded — in the parameter's dtype, or in
`momentum_dtype` (bf16 halves the state; the momentum arithmetic stays fp32 and only its store is rounded, the
way DeepSeek-V3 keeps AdamW's moments in bf16, arXiv 2412.19437 §3.3.2; a checkpoint saved with either dtype loads
under the other, cast on load). The buffer follows the spec's
`M = mu M + G` (torch.optim.Muon keeps the EMA `(1 - mu)` times this; NS is scale-invariant, so the updates
agree up to the 1e-7 epsilon).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from optimizer._dtensor import chunk_range, local, shard0_mesh_dims
from optimizer.newton_schulz import NS_COEFFICIENTS, NS_EPS, default_ns_dtype, orthogonalise_wide_

# A bucket's stack holds at most this many elements (a parameter larger than that gets a stack of its own).
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
class _Entry:
    """One parameter's matrices (`count` blocks [rows, cols], from its local tensor or, on the owner path,
    its full matrix) occupying slots [start, start + count) of a bucket stack [N, m, k] with m <= k."""

    param: torch.Tensor
    group: dict
    count: int
    rows: int
    cols: int
    start: int = 0
    owner: int = -1  # owner path only

    @property
    def transposed(self) -> bool:
        return self.rows > self.cols

    @property
    def wide_shape(self) -> tuple[int, int]:
        return min(self.rows, self.cols), max(self.rows, self.cols)

    def slots(self, stack: torch.Tensor) -> torch.Tensor:
        """This entry's matrices in `stack` as a [count, rows, cols] view (transposed view for tall ones)."""
        mine = stack[self.start : self.start + self.count]
        return mine.mT if self.transposed else mine

    def scale(self) -> float:
        return update_scale(self.rows, self.cols)


@functools.cache
def _triton_kernels():
    """`optimizer.muon_kernels` where triton imports, else None (imported at the first CUDA step)."""
    try:
        from optimizer import muon_kernels
    except ImportError:
        return None
    return muon_kernels


def _fused_kernels(strided: torch.Tensor, *contiguous: torch.Tensor):
    """The Triton kernels module when it takes this call (CUDA tensors in its layouts, see `muon_kernels`), else
    None: torch's kernels run."""
    if strided.device.type != "cuda":
        return None
    kernels = _triton_kernels()
    return kernels if kernels is not None and kernels.supported(strided, *contiguous) else None


def _momentum_and_nesterov(
    out: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, group: dict, grad_scale: float
) -> None:
    """With G = grad_scale * grad: M <- G + mu M (in place); out <- G + mu M (Nesterov, with M as stored) or M, in
    out's dtype, fp32 arithmetic, without an intermediate tensor on CUDA. All three [count, R, K] (out possibly a
    transposed view): on CUDA one Triton kernel (`muon_kernels`), elsewhere torch kernels (and a scaled copy of the
    gradient when grad_scale != 1)."""
    mu = group["momentum"]
    kernels = _fused_kernels(out, grad, buf)
    if kernels is not None:
        kernels.momentum_nesterov_(out, grad, buf, mu, group["nesterov"], grad_scale)
        return
    if grad_scale != 1.0:
        grad = grad * grad_scale
    torch.add(grad, buf, alpha=mu, out=buf)
    if group["nesterov"]:
        torch.add(grad, buf, alpha=mu, out=out)
    else:
        out.copy_(buf)


def _decay_and_update(p_local: torch.Tensor, delta: torch.Tensor, group: dict) -> None:
    """W <- delta + (1 - lr wd) W in one kernel (`delta` = -lr * scale * O, any float dtype, possibly a transposed
    view; fp32 arithmetic): Triton's on CUDA (`muon_kernels`), torch's elsewhere."""
    decay = 1.0 - group["lr"] * group["weight_decay"]
    kernels = _fused_kernels(delta, p_local)
    if kernels is not None:
        kernels.decay_update_(p_local, delta, decay)
    else:
        torch.add(delta, p_local, alpha=decay, out=p_local)


def _block_rows(total_rows: int, row_split: int, r0: int, r1: int):
    """Rows [r0, r1) of a [total_rows, C] matrix cut in `row_split` blocks: yields (block, first row in the
    block, first row in [r0, r1), count) for each block the range touches."""
    block_rows = total_rows // row_split
    for block in range(row_split):
        lo, hi = max(r0, block * block_rows), min(r1, (block + 1) * block_rows)
        if lo < hi:
            yield block, lo - block * block_rows, lo - r0, hi - lo


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
        momentum_dtype: torch.dtype | None = None,
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
        self.momentum_dtype = momentum_dtype  # None: the parameter's dtype
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
        if not local(p).is_contiguous():
            raise ValueError(
                f"Muon: parameter of shape {tuple(p.shape)} is not contiguous (the update is applied through a "
                "[matrices, rows, cols] view of it); make it contiguous before building the optimizer"
            )
        dims = _split_mesh_dims(p)
        if p.ndim == 2 and len(dims) > 1:
            raise ValueError(
                f"Muon: a 2-D parameter {tuple(p.shape)} sharded on dim 0 over several mesh dims "
                f"({tuple(p.placements)}) is not supported; shard over one mesh dim (FSDP2 / HSDP)"
            )

    def _ns_dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.ns_dtype or default_ns_dtype(t.device)

    def _update_stack(self, stack: torch.Tensor, entries: list[_Entry]) -> torch.Tensor:
        """NS of a bucket stack [N, m, k] (overwritten), times the bucket's -lr * scale: [N, m, k] in the NS
        dtype, the finished update of every matrix."""
        e = entries[0]
        scale = -e.group["lr"] * e.scale()
        return orthogonalise_wide_(stack, e.group["ns_steps"], self.ns_coefficients, self.eps, out_scale=scale)

    def _new_stack(self, entries: list[_Entry], device: torch.device) -> torch.Tensor:
        """An uninitialised stack for `entries` (wide shape shared), setting each entry's start slot."""
        n = 0
        for e in entries:
            e.start, n = n, n + e.count
        m, k = entries[0].wide_shape
        ns_dtype = self.ns_dtype or default_ns_dtype(device)
        return torch.empty(n, m, k, device=device, dtype=ns_dtype)

    def init_state(self) -> None:
        """Create the zero momentum buffers of every parameter without stepping. DCP's
        `set/get_optimizer_state_dict` would otherwise initialise state with a full zero-grad step
        (every NS and all-to-all of a real step)."""
        for group in self.param_groups:
            for p in group["params"]:
                self._ensure_momentum(p)

    def _ensure_momentum(self, p: torch.Tensor) -> None:
        """The zero momentum buffer of `p` (a DTensor like `p` for DTensor parameters), in `momentum_dtype`."""
        if "momentum_buffer" not in self.state[p]:
            dtype = self.momentum_dtype or p.dtype
            self.state[p]["momentum_buffer"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)

    def kernel_launches(self) -> list[tuple[str, Callable[[], None]]]:
        """(label, launch) for each specialisation of the Triton elementwise kernels (`muon_kernels`) that this
        optimizer's step will launch, each launch running the kernels on meta tensors of a parameter's layout and
        dtypes: for a Triton prebuild to build them ahead of the first step (llm_training's trainer hands them to
        `activation.triton_prebuild.capture_launches`). Empty off CUDA or without triton. Assumes each gradient has
        its parameter's dtype (FSDP2's fp32 reduction of fp32 parameters); what Triton specialises on besides the
        dtypes and constexprs is whether each size is 1 or a multiple of 16, so one launch stands for all
        parameters that agree on those."""
        kernels = _triton_kernels()
        launches: dict[tuple, tuple[str, Callable[[], None]]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if kernels is None or local(p).device.type != "cuda":
                    continue
                rows, cols = _matrix_shape(p.shape, group["row_split"])
                if p.ndim == 2 and _split_mesh_dims(p):  # the owner path: the local rows, into the send buffer
                    shape, transposed = (1, *local(p).shape), False
                    stack_dtype = self.comm_dtype or self._ns_dtype(local(p))
                else:
                    shape, transposed = (local(p).shape[:-2].numel() * group["row_split"], rows, cols), rows > cols
                    stack_dtype = self._ns_dtype(local(p))
                buf_dtype = self.momentum_dtype or p.dtype
                sizes = tuple((n == 1, n % 16 == 0) for n in shape[1:])
                key = (sizes, transposed, p.dtype, buf_dtype, stack_dtype, group["nesterov"])
                if shape[0] == 0 or key in launches:
                    continue

                def launch(shape=shape, transposed=transposed, dtypes=(p.dtype, buf_dtype, stack_dtype), group=group):
                    grad, buf, w = (
                        torch.empty(shape, dtype=d, device="meta") for d in (dtypes[0], dtypes[1], dtypes[0])
                    )
                    count, r, c = shape
                    slots = torch.empty((count, c, r) if transposed else shape, dtype=dtypes[2], device="meta")
                    slots = slots.mT if transposed else slots
                    kernels.momentum_nesterov_(slots, grad, buf, group["momentum"], group["nesterov"])
                    kernels.decay_update_(w, slots, 1.0)

                layout = "transposed" if transposed else "rows"
                launches[key] = (f"Muon elementwise {list(shape)} {layout} {p.dtype}/{buf_dtype}/{stack_dtype}", launch)
        return list(launches.values())

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim's load, then the momentum buffers back in `momentum_dtype` (torch.optim casts floating-point
        state to the parameter's dtype on load)."""
        super().load_state_dict(state_dict)
        if self.momentum_dtype is not None:
            for state in self.state.values():
                buf = state.get("momentum_buffer")
                if buf is not None and buf.dtype != self.momentum_dtype:
                    state["momentum_buffer"] = buf.to(self.momentum_dtype)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0):
        """One Muon step over the parameters with a gradient; every gradient counts multiplied by `grad_scale` (the
        trainer's clipping coefficient: applied in the momentum pass, so the gradients themselves stay as they
        are)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sharded: dict[tuple, list[_Entry]] = {}
        buckets: dict[tuple, list[_Entry]] = {}
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                self._ensure_momentum(p)
            split = group["row_split"]
            for p in params:
                rows, cols = _matrix_shape(p.shape, split)
                mesh_dims = _split_mesh_dims(p)
                if p.ndim == 3 or not mesh_dims:
                    entry = _Entry(p, group, local(p).shape[:-2].numel() * split, rows, cols)
                    if entry.count:  # an expert shard may hold zero experts
                        key = (entry.wide_shape, local(p).device, group["ns_steps"], group["lr"])
                        buckets.setdefault(key, []).append(entry)
                else:
                    key = (id(p.device_mesh), mesh_dims[0])
                    sharded.setdefault(key, []).append(_Entry(p, group, split, rows, cols))
        # start every sharded pipeline (its first all-to-all is in flight during the local NS), then finish them
        pipelines = [self._sharded_pipeline(entries, grad_scale) for entries in sharded.values()]
        for pipeline in pipelines:
            next(pipeline)
        for entries in buckets.values():
            for batch in _batches(entries):
                self._step_local(batch, grad_scale)
        for pipeline in pipelines:
            for _ in pipeline:
                pass
        return loss

    def _step_local(self, entries: list[_Entry], grad_scale: float) -> None:
        """One bucket batch: momentum + Nesterov inputs into the stack, one NS (update scale folded in), one
        decay + update kernel per parameter."""
        stack = self._new_stack(entries, local(entries[0].param).device)
        for e in entries:
            shape = (e.count, e.rows, e.cols)
            grad, buf = local(e.param.grad).reshape(shape), local(self.state[e.param]["momentum_buffer"]).view(shape)
            _momentum_and_nesterov(e.slots(stack), grad, buf, e.group, grad_scale)
        delta = self._update_stack(stack, entries)
        for e in entries:
            _decay_and_update(local(e.param).view(e.count, e.rows, e.cols), e.slots(delta), e.group)

    # ------------------------------------------------------------------ distributed (owner) path
    def _sharded_pipeline(self, entries: list[_Entry], grad_scale: float):
        """Owner pipeline for row-sharded 2-D matrices of one mesh group (see module doc). A generator: it
        pauses once, right after issuing the first gather, so the caller can overlap other work."""
        p0 = entries[0].param
        mesh_dim = _split_mesh_dims(p0)[0]
        pg = p0.device_mesh.get_group(mesh_dim)
        world, me = p0.device_mesh.size(mesh_dim), p0.device_mesh.get_local_rank(mesh_dim)
        # Greedy LPT owner assignment; the order depends only on shapes, so every rank agrees.
        flops = [_ns_flops(e.param.shape, e.group["row_split"], e.group["ns_steps"]) for e in entries]
        order = sorted(range(len(entries)), key=lambda i: (-flops[i], i))
        load = [0.0] * world
        for i in order:
            owner = min(range(world), key=lambda r: (load[r], r))
            entries[i].owner = owner
            load[owner] += flops[i]
        # Chunks: same wide shape (one batched NS per owner), at most about `world` stacks' worth of elements.
        by_shape: dict[tuple, list[_Entry]] = {}
        for i in order:
            e = entries[i]
            by_shape.setdefault((e.wide_shape, e.group["ns_steps"], e.group["lr"]), []).append(e)
        chunks = []
        for same in by_shape.values():
            per_chunk = world * max(1, _LOCAL_BATCH_ELEMENTS // same[0].param.numel())
            chunks += [same[i : i + per_chunk] for i in range(0, len(same), per_chunk)]
        comm_dtype = self.comm_dtype or self._ns_dtype(p0)
        device = local(p0).device

        def rows_of(e: _Entry, rank: int) -> tuple[int, int]:
            return chunk_range(e.param.shape[0], world, rank)

        def numel_on(e: _Entry, rank: int) -> int:
            r0, r1 = rows_of(e, rank)
            return (r1 - r0) * e.param.shape[1]

        def all_to_all(send: torch.Tensor, in_split: list[int], out_split: list[int]):
            recv = send.new_empty(sum(out_split))
            work = dist.all_to_all_single(recv, send, out_split, in_split, group=pg, async_op=True)
            return work, recv, out_split

        def launch_gather(chunk):
            """Every rank's rows of the Nesterov input, written straight into the send buffer, to the owner."""
            in_split = [sum(numel_on(e, me) for e in chunk if e.owner == dst) for dst in range(world)]
            out_split = [sum(numel_on(e, src) for e in chunk if e.owner == me) for src in range(world)]
            send = torch.empty(sum(in_split), dtype=comm_dtype, device=device)
            offset = 0
            for dst in range(world):
                for e in (e for e in chunk if e.owner == dst):
                    g, buf = local(e.param.grad), local(self.state[e.param]["momentum_buffer"])
                    slot = send[offset : offset + g.numel()].view(1, *g.shape)
                    _momentum_and_nesterov(slot, g.unsqueeze(0), buf.unsqueeze(0), e.group, grad_scale)
                    offset += g.numel()
            return all_to_all(send, in_split, out_split)

        def orthogonalise_owned(chunk, recv, out_split):
            """Place each owned matrix's rows from every rank into one stack and orthogonalise it."""
            owned = [e for e in chunk if e.owner == me]
            if not owned:
                return owned, None
            stack = self._new_stack(owned, device)
            pieces = torch.split(recv, out_split)
            for src in range(world):
                offset = 0
                for e in owned:
                    (r0, r1), cols = rows_of(e, src), e.param.shape[1]
                    rows_from_src = pieces[src][offset : offset + (r1 - r0) * cols].view(r1 - r0, cols)
                    offset += (r1 - r0) * cols
                    slots = e.slots(stack)
                    for block, at, first, n in _block_rows(e.param.shape[0], e.count, r0, r1):
                        slots[block, at : at + n].copy_(rows_from_src[first : first + n])
            return owned, self._update_stack(stack, owned)

        def launch_scatter(chunk, owned, ortho):
            """Each rank's rows of the owned results back to it."""
            in_split = [sum(numel_on(e, dst) for e in owned) for dst in range(world)]
            out_split = [sum(numel_on(e, me) for e in chunk if e.owner == src) for src in range(world)]
            send = torch.empty(sum(in_split), dtype=comm_dtype, device=device)
            offset = 0
            for dst in range(world):
                for e in owned:
                    (r0, r1), cols = rows_of(e, dst), e.param.shape[1]
                    rows_to_dst = send[offset : offset + (r1 - r0) * cols].view(r1 - r0, cols)
                    offset += (r1 - r0) * cols
                    slots = e.slots(ortho)
                    for block, at, first, n in _block_rows(e.param.shape[0], e.count, r0, r1):
                        rows_to_dst[first : first + n].copy_(slots[block, at : at + n])
            return all_to_all(send, in_split, out_split)

        def apply_received(chunk, recv, out_split):
            pieces = torch.split(recv, out_split)
            for src in range(world):
                offset = 0
                for e in (e for e in chunk if e.owner == src):
                    p_local = local(e.param)
                    ortho_local = pieces[src][offset : offset + p_local.numel()].view(p_local.shape)
                    offset += p_local.numel()
                    _decay_and_update(p_local.unsqueeze(0), ortho_local.unsqueeze(0), e.group)

        gathers = [launch_gather(chunks[0])]
        yield
        scatters = []
        for i, chunk in enumerate(chunks):
            if i + 1 < len(chunks):
                gathers.append(launch_gather(chunks[i + 1]))  # overlaps the NS below
            work, recv, out_split = gathers[i]
            work.wait()
            scatters.append((chunk, launch_scatter(chunk, *orthogonalise_owned(chunk, recv, out_split))))
        for chunk, (work, recv, out_split) in scatters:
            work.wait()
            apply_received(chunk, recv, out_split)


def _batches(entries: list[_Entry]):
    """Split a bucket into stacks of at most `_LOCAL_BATCH_ELEMENTS` elements (whole parameters)."""
    batch, size = [], 0
    for e in entries:
        n = e.count * e.rows * e.cols
        if batch and size + n > _LOCAL_BATCH_ELEMENTS:
            yield batch
            batch, size = [], 0
        batch.append(e)
        size += n
    if batch:
        yield batch
