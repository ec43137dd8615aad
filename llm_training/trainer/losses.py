"""Training losses: memory-lean linear + cross-entropy over a large vocabulary, MTP target shifting,
and the total step loss (CE + MTP + balance) with global-batch normalisation.

Normalisation convention (ARCHITECTURE.md §2): every CE term is a SUM of per-token losses over the
labelled tokens of one micro-batch divided by a normaliser that the trainer computes once per step:
the number of labelled tokens in the whole global batch (all micro-batches, all data ranks). Summing
the per-micro-batch losses over micro-batches and (through the gradient reduction, which the
parallelizer sets to SUM) over data ranks then gives exactly the full-batch mean loss and gradient.

The lm_head never produces the full `[T, V]` fp32 logits: `chunked_linear_cross_entropy` walks the tokens
in chunks inside one autograd Function that computes the gradients of each chunk in the forward (the
logits chunk is freed right away) and only scales them in the backward. The same design is used by
liger-kernel's fused linear cross-entropy, which we call on CUDA when it is importable.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100
# Elements of one fp32 logits chunk (chunk_tokens x vocab): 2^28 = 1 GiB. Large chunks keep the number of
# per-chunk [V, H] weight-gradient updates (a full pass over a [V, H] buffer each) small.
_DEFAULT_CHUNK_ELEMENTS = 1 << 28


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk so that one fp32 logits chunk stays around 1 GiB (1219 tokens at V = 220160)."""
    return max(1, _DEFAULT_CHUNK_ELEMENTS // vocab_size)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_t CE(hidden[t] @ weight.T, labels[t]) over labels != -100, chunked over tokens.

    Matmuls run in the hidden's dtype (bf16 under mixed precision: tensor cores, fp32 accumulation); the
    log-softmax, the loss and d(loss)/d(logits) are fp32; the weight gradient is accumulated in fp32.
    Forward computes, per chunk, the loss and the gradients w.r.t. the hidden chunk and the weight
    (softmax - onehot); backward multiplies the stored gradients by the incoming scalar.
    Peak extra memory: one `[chunk, V]` fp32 block (+ its low-precision copy) + grad buffers of the inputs.
    """

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, labels_T, chunk_tokens: int, compiled: bool):
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        chunk_fn = _compiled_chunk_loss_and_grad() if compiled else _chunk_loss_and_grad
        mm_dtype = hidden_TH.dtype
        w_VH = weight_VH.to(mm_dtype)
        T = hidden_TH.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=hidden_TH.device)
        grad_hidden_TH = torch.empty_like(hidden_TH) if needs_grad else None
        grad_weight_VH = torch.zeros_like(weight_VH, dtype=torch.float32) if needs_grad else None
        for start in range(0, T, chunk_tokens):
            h_CH = hidden_TH[start : start + chunk_tokens]
            y_C = labels_T[start : start + chunk_tokens]
            chunk_loss, grad_logits_CV = chunk_fn(h_CH, w_VH, y_C)
            loss += chunk_loss
            if needs_grad:
                g_CV = grad_logits_CV.to(mm_dtype)
                del grad_logits_CV
                grad_hidden_TH[start : start + chunk_tokens] = g_CV @ w_VH
                if mm_dtype == torch.float32:
                    grad_weight_VH.addmm_(g_CV.t(), h_CH)
                else:
                    grad_weight_VH += (g_CV.t() @ h_CH).float()
        if needs_grad:
            ctx.save_for_backward(grad_hidden_TH, grad_weight_VH)
            ctx.weight_dtype = weight_VH.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden_TH, grad_weight_VH = ctx.saved_tensors
        g_h = (grad_hidden_TH * grad_loss.to(grad_hidden_TH.dtype)) if ctx.needs_input_grad[0] else None
        g_w = (grad_weight_VH * grad_loss).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return g_h, g_w, None, None, None


def _chunk_loss_and_grad(h_CH: torch.Tensor, w_VH: torch.Tensor, y_C: torch.Tensor):
    """One chunk: (fp32 sum of CE over labelled rows, fp32 d(sum CE)/d logits [C, V] = softmax - onehot,
    zero on ignored rows). The logits matmul runs in the inputs' dtype, everything after it in fp32."""
    valid_C = y_C != IGNORE_INDEX
    logits_CV = (h_CH @ w_VH.t()).float()
    lse_C = torch.logsumexp(logits_CV, dim=-1)
    safe_y_C = torch.where(valid_C, y_C, torch.zeros_like(y_C))
    target_logit_C = logits_CV.gather(1, safe_y_C[:, None]).squeeze(1)
    loss = ((lse_C - target_logit_C) * valid_C).sum()
    valid_C1 = valid_C[:, None].to(logits_CV.dtype)
    grad_CV = (logits_CV - lse_C[:, None]).exp_()  # softmax; the logits buffer is free after this
    grad_CV.scatter_add_(1, safe_y_C[:, None], -torch.ones_like(valid_C1))  # - onehot
    return loss, grad_CV.mul_(valid_C1)


@functools.cache
def _compiled_chunk_loss_and_grad():
    """torch.compile'd `_chunk_loss_and_grad` (fuses the softmax / one-hot arithmetic of a chunk)."""
    return torch.compile(_chunk_loss_and_grad, dynamic=True)


@functools.cache
def _liger_loss_fn():
    """liger-kernel's fused linear CE (reduction='sum'), or None when it is not importable."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception:  # ImportError, or triton missing/broken
        return None
    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight_VH: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int | None = None,
    use_liger: bool = True,
    compiled: bool = False,
) -> torch.Tensor:
    """Sum over labelled tokens of CE(hidden @ weight.T, labels): fp32 0-dim tensor.

    hidden [..., H] and labels [...] (long, -100 = ignore) are flattened to tokens. On CUDA with
    liger-kernel importable (and `use_liger`), liger's fused kernel is used; otherwise the chunked
    PyTorch implementation above (`compiled`: its per-chunk arithmetic under torch.compile).
    """
    hidden_TH = hidden.reshape(-1, hidden.shape[-1])
    labels_T = labels.reshape(-1)
    if use_liger and hidden_TH.is_cuda:
        liger = _liger_loss_fn()
        if liger is not None:
            return liger(weight_VH, hidden_TH, labels_T).float()
    chunk = chunk_tokens or default_chunk_tokens(weight_VH.shape[0])
    return _ChunkedLinearCrossEntropy.apply(hidden_TH, weight_VH, labels_T, chunk, compiled)


def shift_labels(labels_BS: torch.Tensor, shift: int, document_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
    """`out[:, t] = labels[:, t + shift]`, the last `shift` columns -100 (MTP targets).

    With `document_ids_BS`, a target from another packed document than position t is -100 too, so an MTP
    module never predicts across a document boundary, whatever the data's label layout.
    """
    if shift == 0:
        return labels_BS
    out = torch.full_like(labels_BS, IGNORE_INDEX)
    if shift < labels_BS.shape[1]:
        shifted = labels_BS[:, shift:]
        if document_ids_BS is not None:
            same_doc = document_ids_BS[:, shift:] == document_ids_BS[:, :-shift]
            shifted = torch.where(same_doc, shifted, IGNORE_INDEX)
        out[:, :-shift] = shifted
    return out


def count_labelled_tokens(targets: list[torch.Tensor]) -> torch.Tensor:
    """float64 [len(targets)] counts of labelled (!= -100) tokens of each target tensor (main CE, then each MTP
    module's targets: `PreparedBatch.targets()`)."""
    return torch.stack([(y != IGNORE_INDEX).sum() for y in targets]).to(torch.float64)


@dataclass
class StepLoss:
    """One micro-batch's contribution to the global-batch loss (each term already normalised)."""

    total: torch.Tensor  # what backward() is called on
    ce: torch.Tensor  # detached
    mtp: torch.Tensor  # detached, mean over MTP modules (0 without MTP)
    balance: torch.Tensor  # detached


def micro_batch_loss(
    out,
    lm_head_weight: torch.Tensor,
    labels_BS: torch.Tensor,
    mtp_labels: list[torch.Tensor],
    normalisers: torch.Tensor,
    mtp_loss_weight: float,
    balance_scale: float,
    chunk_tokens: int | None = None,
    compiled: bool = False,
) -> StepLoss:
    """CE/N_main + mtp_loss_weight * mean_k(MTP_k/N_k) + balance_scale * out.balance_loss.

    `out` is the model output of `forward(..., return_hidden=True)`; `mtp_labels[k]` the targets of MTP module k
    (`PreparedBatch.mtp_labels`, already masked per document); `normalisers` the global labelled token counts
    from `count_labelled_tokens` summed over micro-batches and data ranks (clamped >= 1); `balance_scale` =
    1 / (micro-batches x data ranks), so the balance term adds up to its global mean.
    """
    norms = normalisers.clamp(min=1).float()
    ce = linear_cross_entropy_sum(out.hidden, lm_head_weight, labels_BS, chunk_tokens, compiled=compiled) / norms[0]
    total = ce
    mtp = torch.zeros((), device=ce.device)
    mtp_hidden = out.mtp_hidden or []
    if mtp_hidden:
        terms = [
            linear_cross_entropy_sum(h, lm_head_weight, y, chunk_tokens, compiled=compiled) / norms[k + 1]
            for k, (h, y) in enumerate(zip(mtp_hidden, mtp_labels, strict=True))
        ]
        mtp = torch.stack(terms).mean()
        total = total + mtp_loss_weight * mtp
    balance = out.balance_loss
    if balance is None:
        balance = torch.zeros((), device=ce.device)
    balance = balance.float() * balance_scale
    if balance.requires_grad:
        total = total + balance
    return StepLoss(total=total, ce=ce.detach(), mtp=mtp.detach(), balance=balance.detach())
