"""Ring attention for full (causal, no window) attention layers under context parallelism.

Each cp rank keeps its query chunks (SequenceLayout: zigzag in practice) and the K/V of its chunks travel
around the ring (rank c sends to c+1, receives from c-1) for cp steps; at every step each (query chunk,
key chunk) pair is computed by a block kernel (block_attention.py) unless it is causally invisible (key
chunk after query chunk: skipped), and the partials are merged with the log-sum-exp rule in fp32. The
next step's K/V transfer is posted before the current step's compute.

Backward (custom autograd.Function, a reverse pass of the same ring): the saved tensors are the local q,
k, v, the merged fp32 output O and lse (no per-block activations). For every visible pair the block is
recomputed with autograd and backpropagated with the upstream gradients of the merge,
dL/do_b = w_b dO and dL/dlse_b = w_b (dO . (o_b - O)) where w_b = exp(lse_b - lse); dQ accumulates
locally while dK/dV accumulators (fp32) travel around the ring with their K/V and arrive back at the owner
after cp steps. Recompute instead of a fused block backward keeps one interface for any block kernel
whose out and lse are differentiable (the fp32 reference; FlexAttention on CUDA), at the price of one more block
forward per pair. Which block kernel runs is the package's choice (`block_attention.block_attention_kernel`).

max_logits: the [Hq] max over this rank's queries (all keys); a MAX all-reduce over the cp ranks (the
trainer reduces over the world) gives the full-sequence value.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from llm_training.autograd_output import function_output
from llm_training.distributed.context_parallel.block_attention import BlockKernel, merge_partials
from llm_training.distributed.context_parallel.sharding import SequenceLayout


class _RingShift:
    """Post isend of `tensors` to the next cp rank and irecv of same-shaped buffers from the previous one;
    `wait()` returns the received tensors."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], group: dist.ProcessGroup):
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        nxt, prv = dist.get_global_rank(group, (rank + 1) % cp), dist.get_global_rank(group, (rank - 1) % cp)
        self.received = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors)
        ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, prv, group) for r in self.received]
        self.requests = dist.batch_isend_irecv(ops)

    def wait(self) -> tuple[torch.Tensor, ...]:
        for request in self.requests:
            request.wait()
        return self.received


def _visible_pairs(layout: SequenceLayout, rank: int, src: int):
    """(query slot, query chunk, key slot, key chunk) of the causally visible pairs between rank's queries
    and src's keys; key chunks after the query chunk are skipped."""
    for a, i in enumerate(layout.chunks(rank)):
        for b, j in enumerate(layout.chunks(src)):
            if j <= i:
                yield a, i, b, j


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, document_ids, layout, group, block_kernel, record_max_logits):
        rank, cp = dist.get_rank(group), layout.cp
        chunk = q.shape[1] // len(layout.chunks(rank))
        q_parts = q.split(chunk, dim=1)
        acc: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = [None] * len(q_parts)
        best = torch.full((q.shape[2],), float("-inf"), device=q.device, dtype=torch.float32)
        kv = (k, v)
        for step in range(cp):
            src = (rank - step) % cp
            shift = _RingShift(kv, group) if step < cp - 1 else None
            k_parts, v_parts = kv[0].split(chunk, dim=1), kv[1].split(chunk, dim=1)
            for a, i, b, j in _visible_pairs(layout, rank, src):
                out_b, lse_b, max_b = block_kernel(
                    q_parts[a],
                    k_parts[b],
                    v_parts[b],
                    scale=scale,
                    queries=range(i * chunk, (i + 1) * chunk),
                    keys=range(j * chunk, (j + 1) * chunk),
                    window=None,
                    document_ids=document_ids,
                    record_max_logits=record_max_logits,
                )
                acc[a] = merge_partials(acc[a], out_b, lse_b)
                if max_b is not None:
                    best = torch.maximum(best, max_b)
            if shift is not None:
                kv = shift.wait()
        out = torch.cat([o for o, _ in acc], dim=1)  # fp32 [B, S/cp, Hq, Dv]
        lse = torch.cat([s for _, s in acc], dim=2)  # fp32 [B, Hq, S/cp]
        ctx.save_for_backward(q, k, v, out, lse, document_ids)
        ctx.scale, ctx.layout, ctx.group, ctx.block_kernel, ctx.chunk = scale, layout, group, block_kernel, chunk
        ctx.mark_non_differentiable(best)
        return function_output(out, q.dtype), best  # out is saved for backward too

    @staticmethod
    def backward(ctx, d_out, _d_best):
        q, k, v, out, lse, document_ids = ctx.saved_tensors
        layout, group, chunk = ctx.layout, ctx.group, ctx.chunk
        rank, cp = dist.get_rank(group), layout.cp
        d_out = d_out.float()
        q_parts, out_parts, dout_parts = q.split(chunk, 1), out.split(chunk, 1), d_out.split(chunk, 1)
        lse_parts = lse.split(chunk, dim=2)
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = (k, v)
        dkv = (torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32))
        for step in range(cp):
            src = (rank - step) % cp
            shift = _RingShift(kv, group) if step < cp - 1 else None
            k_parts, v_parts = kv[0].split(chunk, dim=1), kv[1].split(chunk, dim=1)
            for a, i, b, j in _visible_pairs(layout, rank, src):
                dq_b, dk_b, dv_b = _block_grads(
                    ctx.block_kernel,
                    q_parts[a],
                    k_parts[b],
                    v_parts[b],
                    out_parts[a],
                    lse_parts[a],
                    dout_parts[a],
                    scale=ctx.scale,
                    queries=range(i * chunk, (i + 1) * chunk),
                    keys=range(j * chunk, (j + 1) * chunk),
                    document_ids=document_ids,
                )
                dq[:, a * chunk : (a + 1) * chunk] += dq_b
                dkv[0][:, b * chunk : (b + 1) * chunk] += dk_b
                dkv[1][:, b * chunk : (b + 1) * chunk] += dv_b
            dkv = _RingShift(dkv, group).wait()  # after the last step this hands each block back to its owner
            if shift is not None:
                kv = shift.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


def _block_grads(block_kernel, q, k, v, out, lse, d_out, *, scale, queries, keys, document_ids):
    """(dq, dk, dv) in fp32 of one block's share of the merged attention: recompute the block and
    backpropagate the merge's upstream gradients through its out and lse."""
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out_b, lse_b, _ = block_kernel(
            q,
            k,
            v,
            scale=scale,
            queries=queries,
            keys=keys,
            window=None,
            document_ids=document_ids,
            record_max_logits=False,
        )
        w_BHQ = torch.exp(lse_b.detach() - lse)  # the merged lse is finite: every query sees itself
        g_out = w_BHQ.transpose(1, 2).unsqueeze(-1) * d_out
        g_lse = w_BHQ * (d_out * (out_b.detach() - out)).sum(dim=-1).transpose(1, 2)
        grads = torch.autograd.grad((out_b, lse_b), (q, k, v), (g_out, g_lse))
    return tuple(g.float() for g in grads)


@torch.compiler.disable  # point-to-point ops and a Python loop over steps: runs eagerly inside a compiled block
def ring_attention(
    q_BSHD: torch.Tensor,
    k_BSKD: torch.Tensor,
    v_BSKE: torch.Tensor,
    *,
    scale: float,
    document_ids: Optional[torch.Tensor],
    record_max_logits: bool,
    layout: SequenceLayout,
    group: dist.ProcessGroup,
    block_kernel: BlockKernel,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Causal attention of this rank's queries (layout order) over the whole sequence; q/k/v are the local
    [B, S/cp, ...] shards, document_ids the FULL-sequence [B, S] ids (or None). Returns (out [B, S/cp, Hq,
    Dv] in q's dtype, this rank's partial max_logits [Hq] or None)."""
    out, best = _RingAttention.apply(
        q_BSHD, k_BSKD, v_BSKE, scale, document_ids, layout, group, block_kernel, record_max_logits
    )
    return out, (best if record_max_logits else None)
