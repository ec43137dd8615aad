"""Sliding-window attention under context parallelism: each local chunk needs, besides itself, only the
last W keys of the chunk before it (the halo), so one neighbour exchange replaces the ring.

With the zigzag layout rank c holds chunks c and 2cp-1-c: chunk c's halo comes from rank c-1 (its first
chunk), chunk 2cp-1-c's from rank c+1 (its second chunk; for c = cp-1 it is this rank's own first
chunk), and chunk 0 has none. Requires W <= chunk length (a query at a chunk's start reaches back W keys,
all inside the previous chunk); check_context_parallel validates it.

`HaloExchange` is an autograd.Function: forward sends every chunk's last W rows to the owner of the next
chunk, backward sends the halo's gradient back and adds it to those rows. The attention itself is a block
kernel over [halo, chunk] with autograd as usual.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from llm_training.distributed.context_parallel.block_attention import BlockKernel
from llm_training.distributed.context_parallel.sharding import SequenceLayout


def _exchange(sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]], group) -> None:
    """Blocking point-to-point exchange; entries are (tensor, cp peer, tag = the chunk that needs it)."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, p), group, tag) for t, p, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, p), group, tag) for t, p, tag in recvs]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


class HaloExchange(torch.autograd.Function):
    """x [B, S/cp, ...] (layout order) -> one halo [B, W or 0, ...] per local chunk: the last `window` rows
    of the previous global chunk (empty for chunk 0)."""

    @staticmethod
    def forward(ctx, x, window, layout, group):
        rank = dist.get_rank(group)
        chunks = layout.chunks(rank)
        chunk = x.shape[1] // len(chunks)

        def tail(slot):  # the last `window` rows of local chunk `slot`
            return x[:, (slot + 1) * chunk - window : (slot + 1) * chunk]

        halos: list[torch.Tensor] = []
        sends, recvs = [], []
        for slot, c in enumerate(chunks):
            if c + 1 < layout.num_chunks and layout.owner(c + 1)[0] != rank:
                sends.append((tail(slot), layout.owner(c + 1)[0], c + 1))
            if c == 0:
                halos.append(x[:, :0].clone())
                continue
            owner, owner_slot = layout.owner(c - 1)
            if owner == rank:
                halos.append(tail(owner_slot).clone())
            else:
                halos.append(x.new_empty(tail(slot).shape))
                recvs.append((halos[-1], owner, c))
        _exchange(sends, recvs, group)
        ctx.window, ctx.layout, ctx.group, ctx.chunk = window, layout, group, chunk
        ctx.x_like = (x.shape, x.dtype, x.device)
        return tuple(halos)

    @staticmethod
    def backward(ctx, *d_halos):
        window, layout, group, chunk = ctx.window, ctx.layout, ctx.group, ctx.chunk
        rank = dist.get_rank(group)
        chunks = layout.chunks(rank)
        shape, dtype, device = ctx.x_like
        dx = torch.zeros(shape, dtype=dtype, device=device)

        def tail(slot):
            return dx[:, (slot + 1) * chunk - window : (slot + 1) * chunk]

        sends, recvs = [], []
        for slot, c in enumerate(chunks):
            if c > 0:
                d = d_halos[slot] if d_halos[slot] is not None else torch.zeros_like(tail(slot))
                owner, owner_slot = layout.owner(c - 1)
                if owner == rank:
                    tail(owner_slot).add_(d)
                else:
                    sends.append((d, owner, c - 1))
            if c + 1 < layout.num_chunks and layout.owner(c + 1)[0] != rank:
                recvs.append((dx.new_empty(tail(slot).shape), layout.owner(c + 1)[0], c, slot))
        _exchange(sends, [(t, p, tag) for t, p, tag, _ in recvs], group)
        for t, _, _, slot in recvs:
            tail(slot).add_(t)
        return dx, None, None, None


@torch.compiler.disable  # point-to-point ops: runs eagerly inside a compiled block
def halo_attention(
    q_BSHD: torch.Tensor,
    k_BSKD: torch.Tensor,
    v_BSKE: torch.Tensor,
    *,
    scale: float,
    window: int,
    document_ids: Optional[torch.Tensor],
    record_max_logits: bool,
    layout: SequenceLayout,
    group: dist.ProcessGroup,
    block_kernel: BlockKernel,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Sliding-window attention of this rank's chunks; q/k/v are the local [B, S/cp, ...] shards,
    document_ids the FULL-sequence [B, S] ids (or None). Returns (out [B, S/cp, Hq, Dv] in q's dtype,
    this rank's partial max_logits [Hq] or None)."""
    rank = dist.get_rank(group)
    chunks = layout.chunks(rank)
    chunk = q_BSHD.shape[1] // len(chunks)
    if window > chunk:
        raise ValueError(
            f"halo attention needs sliding_window ({window}) <= the context-parallel chunk length ({chunk})"
        )
    k_halos = HaloExchange.apply(k_BSKD, window, layout, group)
    v_halos = HaloExchange.apply(v_BSKE, window, layout, group)
    outs, best = [], None
    for slot, c in enumerate(chunks):
        rows = slice(slot * chunk, (slot + 1) * chunk)
        out, _, max_logits = block_kernel(
            q_BSHD[:, rows],
            torch.cat([k_halos[slot], k_BSKD[:, rows]], dim=1),
            torch.cat([v_halos[slot], v_BSKE[:, rows]], dim=1),
            scale=scale,
            queries=range(c * chunk, (c + 1) * chunk),
            keys=range(c * chunk - k_halos[slot].shape[1], (c + 1) * chunk),
            window=window,
            document_ids=document_ids,
            record_max_logits=record_max_logits,
        )
        outs.append(out)
        if max_logits is not None:
            best = max_logits if best is None else torch.maximum(best, max_logits)
    return torch.cat(outs, dim=1).to(q_BSHD.dtype), best
