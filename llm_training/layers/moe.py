"""Mixture of experts (docs/model-spec.md §6, §0.1): token-choice router with an aux-loss-free expert bias,
stacked routed experts run with `torch._grouped_mm` (per-expert loop fallback), one shared expert, an
optional sequence-wise balance loss, and the expert-bias update rule.

Router: fp32 logits u . e_i; scores s = sigmoid (or softmax over E); the top-k is chosen on s + expert_bias
(selection only); weights = selected s, renormalised s / sum (no epsilon, as Motif's vLLM) when route_norm,
times route_scale,
multiplied onto the expert OUTPUTS (or inputs when score_before_experts). Weighted outputs are combined in
fp32 and cast back.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llm_training.dtensor_views import local_tensor
from llm_training.layers.ffn import FeedForward
from llm_training.layers.norms import GroupedPolyNorm
from llm_training.layers.projection import Fp32Projection


class RouterStats(NamedTuple):
    """Per MoE layer and forward: local token counts per expert (float32 [E], detached) and the
    sequence-wise balance loss (already times router_aux_loss_coef; None when the coefficient is 0)."""

    tokens_per_expert: torch.Tensor
    balance_loss: Optional[torch.Tensor]


class TokenChoiceRouter(nn.Module):
    """`gate` [E, H] fp32; returns routing weights [T, K] fp32, expert ids [T, K] and all scores [T, E]."""

    def __init__(self, args):
        super().__init__()
        self.top_k, self.score_func = args.experts_top_k, args.score_func
        self.route_norm, self.route_scale = args.route_norm, args.route_scale
        self.gate = Fp32Projection(args.hidden_size, args.num_experts)

    def init_weights(self, init_std: float) -> None:
        nn.init.normal_(self.gate.weight, mean=0.0, std=init_std)

    def forward(self, x_TH: torch.Tensor, expert_bias_E: torch.Tensor):
        logits = self.gate(x_TH)  # fp32 [T, E]
        scores = torch.sigmoid(logits) if self.score_func == "sigmoid" else torch.softmax(logits, dim=-1)
        _, expert_ids = torch.topk(scores.detach() + expert_bias_E, self.top_k, dim=-1)  # bias: selection only
        weights = scores.gather(-1, expert_ids)
        if self.route_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.route_scale, expert_ids, scores


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (torch._grouped_mm's CPU backward
    rejects the stride-0 gradients that e.g. `.sum()` produces)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _gather_sum(src_RH: torch.Tensor, row_TK: torch.Tensor, weight_TK: Optional[torch.Tensor]) -> torch.Tensor:
    """out[t] = sum_k weight[t, k] src[row[t, k]] (weight None: a plain sum), accumulated in fp32 (or wider): one
    gather per k and no atomic scatter (under compile, one fused kernel reading each row once)."""
    acc = torch.promote_types(src_RH.dtype, torch.float32)
    out_TH = None
    for k in range(row_TK.shape[1]):
        term = src_RH[row_TK[:, k]].to(acc)
        if weight_TK is not None:
            term = term * weight_TK[:, k, None].to(acc)
        out_TH = term if out_TH is None else out_TH + term
    return out_TH


class _DispatchRows(torch.autograd.Function):
    """x_rows[r] = x[order[r] // K]: each token copied to its K expert-sorted rows. The backward sums each token's
    K row gradients by gathering them through `row_of_flat` (the inverse of `order`), in fp32, where autograd's own
    backward of the gather would be an atomic scatter-add into a zero buffer."""

    @staticmethod
    def forward(ctx, x_TH, token_of_row_R, row_of_flat_TK):
        ctx.save_for_backward(row_of_flat_TK)
        return x_TH[token_of_row_R]

    @staticmethod
    def backward(ctx, g_RH):
        (row_of_flat_TK,) = ctx.saved_tensors
        return _gather_sum(g_RH, row_of_flat_TK, None).to(g_RH.dtype), None, None


class _WeightedCombine(torch.autograd.Function):
    """out[t] = sum_k w[t, k] y[row_of_flat[t, k]], accumulated in fp32 and returned in `out_dtype` ([T, H] from
    the expert-output rows y [T*K, H] in expert order, the routing weights w fp32 [T, K] (None: a plain sum),
    `row_of_flat` [T, K] the row of each (token, k) pair and `order` [T*K] its inverse, the (token, k) flat index
    of each row). Gathers, no atomic scatter, in both directions. Saves y in its own dtype (bf16 under mixed
    precision), w and the two index tensors: no fp32 [T*K, H] tensor (the plain ops `y.float() * w` then
    `index_add` kept two in eager mode, ~256 KB per token per MoE layer at H 4096, top-8)."""

    @staticmethod
    def forward(ctx, y_RH, w_TK, row_of_flat_TK, order_R, out_dtype):
        ctx.save_for_backward(y_RH, w_TK, row_of_flat_TK, order_R)
        return _gather_sum(y_RH, row_of_flat_TK, w_TK).to(out_dtype)

    @staticmethod
    def backward(ctx, g_TH):
        y_RH, w_TK, row_of_flat_TK, order_R = ctx.saved_tensors
        K = row_of_flat_TK.shape[1]
        g_RH = g_TH.to(torch.promote_types(y_RH.dtype, torch.float32))[order_R // K]  # each row's token's grad
        dy = dw = None
        if ctx.needs_input_grad[0]:
            dy = (g_RH if w_TK is None else g_RH * w_TK.reshape(-1)[order_R, None]).to(y_RH.dtype)
        if ctx.needs_input_grad[1]:
            dw_R = (g_RH * y_RH.to(g_RH.dtype)).sum(-1)
            dw = dw_R[row_of_flat_TK].to(w_TK.dtype)  # back to (token, k) order
        return dy, dw, None, None, None


def grouped_mm_supported(x_NK: torch.Tensor, *weights_EOK: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm(x, w.transpose(-2, -1))` runs for these operands: present in this torch;
    on CUDA only bf16 on SM90+, on CPU fp32/bf16/fp16; every non-unit stride a multiple of 16 bytes (the
    kernel's alignment rule)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if torch.compiler.is_compiling() and x_NK.dtype != torch.bfloat16:
        return False  # the op's fake-tensor rule only accepts bf16
    if x_NK.is_cuda:
        if x_NK.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x_NK.device)[0] < 9:
            return False
    elif x_NK.device.type != "cpu" or x_NK.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False  # the CPU kernel rejects float64 (float64 models take the loop)
    if any(w.dtype != x_NK.dtype for w in weights_EOK):
        return False
    for t in (x_NK, *(w.transpose(-2, -1) for w in weights_EOK)):
        if any(st != 1 and (st * t.element_size()) % 16 for st in t.stride()):
            return False
    return True


def pad_token_groups(x_NH: torch.Tensor, counts_E: torch.Tensor, multiple: int):
    """Copy expert-sorted rows into a zero buffer where every expert's group starts at a multiple of
    `multiple` rows. Returns (padded rows [R, H], padded counts [E], index of each original row in the padded
    buffer [N]), R = N + E*(multiple-1) rounded up to a multiple of `multiple`: the worst case of the padded
    groups, so no host sync is needed (every size is static). R itself is a multiple too because the FP8 grouped
    GEMMs' weight gradient contracts over all R rows of the transposed operand, whose row stride (R bytes in
    FP8) must be a multiple of 16: R = 632 crashed torch._scaled_grouped_mm (8 experts, 512 rows, multiple 16)."""
    N, E = x_NH.shape[0], counts_E.shape[0]
    counts = counts_E.long()
    padded = (counts + multiple - 1) // multiple * multiple
    start = torch.cumsum(counts, 0) - counts
    start_padded = torch.cumsum(padded, 0) - padded
    expert_of_row = torch.repeat_interleave(torch.arange(E, device=x_NH.device), counts, output_size=N)
    rows = torch.arange(N, device=x_NH.device) - start[expert_of_row] + start_padded[expert_of_row]
    buf = x_NH.new_zeros(-(-(N + E * (multiple - 1)) // multiple) * multiple, x_NH.shape[1])
    return buf.index_copy(0, rows, x_NH), padded, rows


class GroupedExperts(nn.Module):
    """Routed experts stacked: gate_up_proj [E, 2I, H] (gate half first), down_proj [E, H, I], and a
    per-expert PolyNorm act_fn (weight [E, 3], bias [E, 1], bias clamped to +-polynorm_bias_clamp).
    As in Motif's vLLM (docs/model-spec.md §0.2), gate/up and the activation output are clamped to +-hidden_clamp."""

    def __init__(self, args):
        super().__init__()
        E, H, I = args.num_experts, args.hidden_size, args.moe_intermediate_size
        self.num_experts, self.intermediate_size, self.hidden_clamp = E, I, args.hidden_clamp
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))
        self.act_fn = GroupedPolyNorm(
            E,
            args.polynorm_init_weight,
            args.polynorm_eps,
            args.polynorm_sigmoid_weight,
            args.polynorm_output_scale,
            args.polynorm_bias_clamp,
        )
        self.use_grouped_mm = True  # falls back to the loop by itself when grouped_mm cannot run

    def init_weights(self, init_std: float) -> None:
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=init_std)
        nn.init.normal_(self.down_proj, mean=0.0, std=init_std)
        self.act_fn.init_weights()

    def forward(
        self, x_NH: torch.Tensor, tokens_per_expert_E: torch.Tensor, group_multiple: Optional[int] = None
    ) -> torch.Tensor:
        """x_NH: rows sorted by expert, expert e owning tokens_per_expert[e] consecutive rows.

        On the grouped-GEMM path each expert's row group is padded with zero rows to a multiple of
        `group_multiple` (default: 16 bytes of rows, i.e. 8 for bf16 on CUDA, where the weight-gradient
        GEMM slices the token dim; 1 on CPU); padded rows are dropped from the result.
        """
        gate_up_w, down_w = local_tensor(self.gate_up_proj), local_tensor(self.down_proj)  # EP: local experts
        grouped = self.use_grouped_mm and grouped_mm_supported(x_NH, gate_up_w, down_w)
        if group_multiple is None:
            group_multiple = max(1, 16 // x_NH.element_size()) if (grouped and x_NH.is_cuda) else 1
        rows = None
        counts = tokens_per_expert_E
        if group_multiple > 1:
            x_NH, counts, rows = pad_token_groups(x_NH, tokens_per_expert_E, group_multiple)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        matmul = self._grouped_matmul if grouped else self._looped_matmul
        gate_up = matmul(x_NH, gate_up_w, offs, counts)
        c = self.hidden_clamp
        if c is not None:
            gate_up = gate_up.clamp(-c, c)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        h = self.act_fn(gate, up, offs)
        if c is not None:  # Motif clamps (P(gate) * up) to +-c before the output scale: the same bound, scaled
            bound = c * abs(self.act_fn.output_scale)
            h = h.clamp(-bound, bound)
        out = matmul(h, down_w, offs, counts)
        return out if rows is None else out[rows]

    @staticmethod
    def _grouped_matmul(x_NK, w_EOK, offs, counts):
        return _ContiguousGrad.apply(torch._grouped_mm(x_NK, w_EOK.transpose(-2, -1), offs=offs))

    @staticmethod
    @torch.compiler.disable  # host values: compiled, every new set of counts would recompile (guards on each value)
    def _looped_matmul(x_NK, w_EOK, offs, counts):
        # counts go to the host once per call: the price of the fallback path. Rows past the last group
        # (padding) give 0, as with torch._grouped_mm.
        sizes = counts.tolist()
        chunks = x_NK[: sum(sizes)].split(sizes, dim=0)
        outs = [F.linear(chunk, w_EOK[e]) for e, chunk in enumerate(chunks)]
        outs.append(x_NK.new_zeros(x_NK.shape[0] - sum(sizes), w_EOK.shape[1]))
        return torch.cat(outs, dim=0)


class MoE(nn.Module):
    """Router + expert_bias buffer + routed experts + shared expert(s). forward -> (out, RouterStats)."""

    def __init__(self, args):
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.experts_top_k
        self.score_before_experts = args.score_before_experts
        self.aux_loss_coef = args.router_aux_loss_coef
        self.router = TokenChoiceRouter(args)
        self.register_buffer("expert_bias", torch.empty(args.num_experts, dtype=torch.float32), persistent=True)
        self.experts = GroupedExperts(args)
        self.shared_experts = (
            FeedForward(args.hidden_size, args.moe_intermediate_size * args.num_shared_experts, args, args.hidden_clamp)
            if args.num_shared_experts > 0
            else None
        )
        # Set by context parallelism (distributed/context_parallel/__init__.py) when each row is one shard of a longer
        # sequence: `.degree` shards per sequence and `.sum(x)` over them, for the sequence-wise balance loss.
        self.sequence_shards = None
        # Set by the long_context activation-checkpointing mode (distributed/activation_checkpoint.py): run the
        # routed experts over token chunks of this size, each checkpointed (None: all tokens at once).
        self.sequence_chunk_tokens: Optional[int] = None

    def init_weights(self, init_std: float, buffer_device: Optional[torch.device] = None) -> None:
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        if buffer_device is not None and self.expert_bias.device != torch.device(buffer_device):
            self.expert_bias = torch.zeros(self.num_experts, dtype=torch.float32, device=buffer_device)
        else:
            with torch.no_grad():
                self.expert_bias.zero_()

    def _rows_per_expert(self, flat_ids: torch.Tensor) -> torch.Tensor:
        """Rows routed to each expert, long [E] (scatter_add: a static shape, compile-friendly, unlike bincount)."""
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat_ids.device)
        return counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))

    def _routed(self, x_TH, weights_TK, expert_ids_TK, tokens_per_expert=None) -> torch.Tensor:
        """The routed experts' combined output [T, H] (x's dtype) of tokens `x_TH` with their routing;
        `tokens_per_expert` (long [E], counted from `expert_ids_TK`) when the caller has it already."""
        T, K = expert_ids_TK.shape
        flat_ids = expert_ids_TK.reshape(-1)
        if tokens_per_expert is None:
            tokens_per_expert = self._rows_per_expert(flat_ids)
        order = torch.argsort(flat_ids, stable=True)  # the (token, k) of each row: grouped by expert, token order kept
        rows = torch.arange(T * K, device=order.device)
        row_of_flat = torch.empty_like(order).scatter_(0, order, rows).view(T, K)  # inverse permutation
        x_rows = _DispatchRows.apply(x_TH, order // K, row_of_flat)
        if self.score_before_experts:
            row_weight = weights_TK.reshape(-1)[order]  # fp32 [T*K]
            x_rows = (x_rows.float() * row_weight[:, None]).to(x_TH.dtype)
        y_rows = self.experts(x_rows, tokens_per_expert)
        combine_weight = None if self.score_before_experts else weights_TK  # weighted before: a plain sum
        return _WeightedCombine.apply(y_rows, combine_weight, row_of_flat, order, x_TH.dtype)

    # Eager under torch.compile, so each chunk's checkpoint is a real one. Compiled inside a checkpointed block's
    # graph, the long-context step peaked at 61.2 GiB at 64K tokens (36.6 eager) and ran out of memory at 256K
    # (motif3_small_256k, H200, 2026-12-05); parallelize_motif compiles long_context blocks in pieces around this.
    @torch.compiler.disable
    def _routed_in_chunks(self, x_TH, weights_TK, expert_ids_TK, chunk: int) -> torch.Tensor:
        """Long sequences: the routed rows, expert activations and fp32 combine buffers scale with tokens x K; run
        them over token chunks of `chunk` tokens, each checkpointed, so that a backward holds one chunk's (the math
        per token is unchanged: routing is per token and a token's K rows stay in its chunk)."""
        from torch.utils.checkpoint import checkpoint

        return torch.cat(
            [
                checkpoint(self._routed, x_c, w_c, ids_c, use_reentrant=False)
                for x_c, w_c, ids_c in zip(x_TH.split(chunk), weights_TK.split(chunk), expert_ids_TK.split(chunk))
            ]
        )

    def forward(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        B, S, H = x_BSH.shape
        x_TH = x_BSH.reshape(-1, H)
        weights_TK, expert_ids_TK, scores_TE = self.router(x_TH, self.expert_bias)
        tokens_per_expert = self._rows_per_expert(expert_ids_TK.reshape(-1))
        chunk = self.sequence_chunk_tokens
        if chunk is None or x_TH.shape[0] <= chunk:
            out = self._routed(x_TH, weights_TK, expert_ids_TK, tokens_per_expert)
        else:
            out = self._routed_in_chunks(x_TH, weights_TK, expert_ids_TK, chunk)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_TH)

        balance = None
        if self.aux_loss_coef > 0:
            balance = self.aux_loss_coef * sequence_balance_loss(
                scores_TE.view(B, S, -1),
                expert_ids_TK.view(B, S, -1),
                self.num_experts,
                self.top_k,
                self.sequence_shards,
            )
        stats = RouterStats(tokens_per_expert.detach().float(), balance)
        return out.view(B, S, H), stats


def sequence_balance_loss(
    scores_BSE: torch.Tensor, expert_ids_BSK: torch.Tensor, num_experts: int, top_k: int, sequence_shards=None
) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balance loss (without its alpha), averaged over the B rows:
    sum_i f_i P_i with f_i = E / (K S) * #{t: i in TopK(t)} (no grad) and P_i = mean_t s_ti / sum_j s_tj.

    With `sequence_shards` (context parallelism: each row is one of `degree` shards of a sequence of length
    S = degree x local length), f is computed from the counts summed over the shards (the whole sequence's
    frequencies) and P is this shard's part of the sequence mean (local mean / degree): the loss is then this
    shard's part of the sequence's loss, and the SUM over the shards (the trainer's world sum) is exactly the
    single-sequence value, with the exact gradient (f carries none)."""
    B, S, _ = scores_BSE.shape
    counts = torch.zeros(B, num_experts, device=scores_BSE.device, dtype=torch.float32)
    counts.scatter_add_(
        1, expert_ids_BSK.reshape(B, -1), torch.ones(B, S * top_k, device=scores_BSE.device, dtype=torch.float32)
    )
    p = (scores_BSE / scores_BSE.sum(dim=-1, keepdim=True)).mean(dim=1)
    if sequence_shards is not None:
        counts, S, p = sequence_shards.sum(counts), S * sequence_shards.degree, p / sequence_shards.degree
    f = counts * (num_experts / (top_k * S))
    return (f.detach() * p).sum(dim=-1).mean()


@torch.no_grad()
def update_expert_bias(model: nn.Module, global_tokens_per_expert_LE: torch.Tensor, coeff: float) -> None:
    """Aux-loss-free balancing, after the optimizer step: for each MoE layer l (in model order, matching
    `out.router_stats`), b_l += coeff * sign(mean(c_l) - c_l) in fp32, where c_l are the token counts of the
    whole step over ALL ranks (the trainer reduces them once per step; layers issue no collectives)."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    counts = global_tokens_per_expert_LE
    if counts.dim() != 2 or len(moes) != counts.shape[0]:
        raise ValueError(
            f"update_expert_bias: model has {len(moes)} MoE layers but got token counts of shape "
            f"{tuple(counts.shape)} (expected [{len(moes)}, num_experts], stacked from out.router_stats)"
        )
    if not moes:
        return
    counts = counts.detach().float().to(moes[0].expert_bias.device)
    delta = coeff * torch.sign(counts.mean(dim=-1, keepdim=True) - counts)
    for moe, d in zip(moes, delta):
        moe.expert_bias.add_(d.to(moe.expert_bias.device))
