"""Ulysses context parallelism (DeepSpeed-Ulysses, docs/model-spec.md §10): an all-to-all turns the
sequence-sharded q/k/v [B, S/cp, H, D] into head-sharded [B, S, H/cp, D], any attention kernel runs on the
full sequence for the local heads, and the reverse all-to-all brings the output back to [B, S/cp, Hq, Dv].

Heads are split contiguously: cp rank c gets query heads [c Hq/cp, (c+1) Hq/cp) and KV heads
[c Hkv/cp, (c+1) Hkv/cp). With g = Hq/Hkv and Hkv % cp == 0, global query head h = c (Hkv/cp) g + h'
uses KV head h // g = c Hkv/cp + h' // g, i.e. local KV head h' // g: the kernel's GQA rule holds on the
shard unchanged. GDLA groups of [r signal + 1 noise] heads sit inside one KV head's g query heads, so they
stay whole; the differential combination runs after the reverse all-to-all anyway (sequence-sharded, with
the locally computed lambda and gate). The shared RoPE key is already concatenated into every KV head.

The all-to-alls are torch's functional `all_to_all_single_autograd` (differentiable; traceable by
torch.compile). Layout: contiguous (SequenceLayout), so the gathered sequence is in natural order.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd


def _all_to_all(x_PX: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Equal-split all-to-all along dim 0 (P = cp parts: part p goes to rank p, part p of the result came
    from rank p)."""
    return all_to_all_single_autograd(x_PX.contiguous(), None, None, group)  # waits on first use


def sequence_to_heads(x_BsHD: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, S/cp, H, D] (this rank's tokens, all heads) -> [B, S, H/cp, D] (all tokens, this rank's heads)."""
    cp = dist.get_world_size(group)
    B, Sl, H, D = x_BsHD.shape
    send_PBsHD = x_BsHD.reshape(B, Sl, cp, H // cp, D).permute(2, 0, 1, 3, 4)
    recv_PBsHD = _all_to_all(send_PBsHD, group)  # part p: rank p's tokens of our heads
    return recv_PBsHD.permute(1, 0, 2, 3, 4).reshape(B, cp * Sl, H // cp, D)


def heads_to_sequence(x_BShD: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, S, H/cp, D] -> [B, S/cp, H, D]; the inverse of sequence_to_heads."""
    cp = dist.get_world_size(group)
    B, S, h, D = x_BShD.shape
    send_PBshD = x_BShD.reshape(B, cp, S // cp, h, D).permute(1, 0, 2, 3, 4)
    recv_PBshD = _all_to_all(send_PBshD, group)  # part p: our tokens of rank p's heads
    return recv_PBshD.permute(1, 2, 0, 3, 4).reshape(B, S // cp, cp * h, D)


def ulysses_attention(
    kernel,
    q_BSHD: torch.Tensor,
    k_BSKD: torch.Tensor,
    v_BSKE: torch.Tensor,
    *,
    scale: float,
    window,
    metadata,
    record_max_logits: bool,
    group: dist.ProcessGroup,
    **kernel_options,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run the attention `kernel` (attention_backends signature) head-sharded on the full sequence.
    q/k/v: local [B, S/cp, ...] shards (contiguous layout); metadata: the AttentionMetadata of the FULL
    sequence (document ids [B, S] or None, block masks for length S), handed to the kernel as is.
    max_logits: full [Hq] vector, exact for this rank's heads and -inf elsewhere (a MAX all-reduce over
    the cp ranks, or the world, assembles it). `kernel_options` go to the kernel as they are (flash-attn-4's
    `keep_slot`: each rank keeps the result for its own heads)."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    Hq, Hkv = q_BSHD.shape[2], k_BSKD.shape[2]
    if Hkv % cp != 0:
        raise ValueError(f"Ulysses needs KV heads ({Hkv}) divisible by the context-parallel degree ({cp})")
    out_BShE, local_max = kernel(
        sequence_to_heads(q_BSHD, group),
        sequence_to_heads(k_BSKD, group),
        sequence_to_heads(v_BSKE, group),
        scale=scale,
        window=window,
        metadata=metadata,
        record_max_logits=record_max_logits,
        **kernel_options,
    )
    max_logits = None
    if local_max is not None:
        h = Hq // cp
        max_logits = torch.full((Hq,), float("-inf"), device=local_max.device, dtype=torch.float32)
        max_logits[rank * h : (rank + 1) * h] = local_max.float()
    return heads_to_sequence(out_BShE, group), max_logits
