"""Training losses: memory-lean linear + cross-entropy over a large vocabulary, MTP target shifting,
and the total step loss (CE + MTP + balance) with global-batch normalisation.

Normalisation convention (docs/architecture.md §2): every CE term is a SUM of per-token losses over the
labelled tokens of one micro-batch divided by a normaliser that the trainer computes once per step:
the number of labelled tokens in the whole global batch (all micro-batches, all data ranks). Summing
the per-micro-batch losses over micro-batches and (through the gradient reduction, which the
parallelizer sets to SUM) over data ranks then gives exactly the full-batch mean loss and gradient.

The lm_head never produces the full `[T, V]` fp32 logits: `linear_cross_entropy_segments` walks the tokens
in chunks inside one autograd Function that computes the gradients of each chunk in the forward (the
logits chunk is freed right away) and only scales them in the backward (the design of liger-kernel's fused
linear cross-entropy). The main head and every MTP head share ONE pass over the head weight: their tokens are
concatenated, each token carries its loss term's weight (1 / N_main, or mtp_loss_weight / (K N_k)), so one
fp32 `[V, H]` weight-gradient buffer and one chunk loop serve all of them.

On CUDA with bf16 inputs both GEMMs that touch fp32 do so inside cuBLAS: the logits chunk comes out of the
GEMM in fp32 (`mm(..., out_dtype=float32)`, fp32 accumulation, no bf16 logits and no cast copy), and each
chunk's weight gradient is accumulated into the fp32 buffer by the GEMM itself (`baddbmm(acc, g^T, h,
out_dtype=float32, out=acc)`: C = acc, beta = 1), with no per-chunk bf16 product, fp32 cast copy or `+=`.
Over the micro-batches of one optimizer step the training step lets the loss keep that buffer
(`HeadGradAccumulator`): the micro-batches' chunk GEMMs accumulate into it. A bf16 head weight (FSDP2's gathered
copy) gets two gradients per step (the sum up to the second-to-last micro-batch, then the last one's) instead of
one per micro-batch, each cast to bf16 and then cast back and added into FSDP2's fp32 accumulator; an fp32 head
weight (one GPU, where the vocabulary tables stay out of FSDP2: `motif/parallelize.py`) gets the buffer itself once,
at the last micro-batch, and its bf16 copy for the GEMMs is made once per step.
Where torch lacks those mixed-dtype GEMMs (CPU, or a torch whose CUDA build rejects them; probed once per
device) the chunk falls back to a bf16 GEMM, a cast and an fp32 add. Between the GEMMs, a chunk's CE and its
weighted logit gradient come from one Triton kernel on CUDA (`cross_entropy_kernels`: two fp32 reads and one
bf16 write of the chunk), from torch code elsewhere.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from activation.backend import TRITON_AVAILABLE
from activation.triton_prebuild import active_prebuild, capture_launches

from llm_training.distributed.utils import to_device_async
from llm_training.layers.attention.fa4 import document_cu_seqlens

IGNORE_INDEX = -100
# Elements of one fp32 logits chunk (chunk_tokens x vocab): 2^29 = 2 GiB. Large chunks keep the number of
# per-chunk [V, H] weight-gradient updates (a full pass over a [V, H] buffer each) small. Measured on one H200
# (bench/bench_loss.py, T 16384, V 220160, H 4096, fwd+bwd): 1 GiB 153.0 ms, 2 GiB 145.8 ms (+1.2 GiB peak),
# 4 GiB 144.8 ms (+4.2 GiB): 2 GiB takes nearly all of the gain.
_DEFAULT_CHUNK_ELEMENTS = 1 << 29
# Chunks are whole multiples of 128 tokens: the logits and hidden-gradient GEMMs tile rows by 128 (a part-empty
# last tile is a full tile's work), and chunk offsets that are multiples of 4 tokens keep every chunk's slice of
# the fp32 token weights 16-byte aligned, which Triton specialises the chunk kernel on (2438-token chunks put
# every other one 8 bytes off, and the kernel was built twice in every harness run; once since, on an H100).
_CHUNK_TOKEN_MULTIPLE = 128


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk: the largest power of two whose fp32 logits chunk is at most 2 GiB (2048 tokens at
    V = 220160; at least one 128-token tile). Power-of-two micro-batches then split into equal chunks: a 16384-token
    MTP micro-batch (main + MTP tokens) is 8 x 2048, where 2432-token chunks made it 2 x 2432 + 5 x 2304. Alone on one
    H100 (bench_head_gemms.py, session 41) the head's three GEMMs take 7.59 / 7.75 / 8.79 us per token at 2048 / 2304 /
    2432 rows; in the harness's MTP step the difference stayed within run-to-run noise (1381.1 / 1387.4 ms against
    1385.6 / 1384.7), with 0.3 GiB less reserved. Vocabularies so large that not even 128 tokens fit take what fits
    (at least one token)."""
    fit = max(1, _DEFAULT_CHUNK_ELEMENTS // vocab_size)
    return 1 << (fit.bit_length() - 1) if fit >= _CHUNK_TOKEN_MULTIPLE else fit


def chunk_bounds(tokens: int, max_chunk: int) -> tuple[int, ...]:
    """Where the chunks of `tokens` tokens end: as few chunks of at most `max_chunk` tokens as possible, of about
    equal length (whole 128-token tiles when `max_chunk` is, their lengths one tile apart at most; the last one
    takes a partial tile). A chunk GEMM of few rows runs far below the others' rate: at 8192 tokens per micro-batch
    and V = 220160, 2432-token chunks left an 896-token last chunk whose weight-gradient GEMM ran at 449 TF/s
    against 690 for the others (one H100, session-36 profile); balanced, that is 4 chunks of 2048."""
    if tokens <= 0:
        return ()
    tile = _CHUNK_TOKEN_MULTIPLE if max_chunk % _CHUNK_TOKEN_MULTIPLE == 0 else 1
    tiles = -(-tokens // tile)
    n = -(-tokens // max_chunk)
    per_chunk, longer = divmod(tiles, n)  # the first `longer` chunks take one tile more
    ends, at = [], 0
    for k in range(n):
        at += (per_chunk + (k < longer)) * tile
        ends.append(min(at, tokens))
    return tuple(ends)


def prebuild_chunk_kernel(vocab_size: int, compute_dtype: torch.dtype) -> None:
    """Hand the CUDA CE chunk kernel's launch at the training shape (a default chunk of `vocab_size` logits, the
    gradient in `compute_dtype`) to the active Triton prebuild (`activation.triton_prebuild`) as meta tensors: the
    loss is not compiled, so no fake call announces its kernel. Every chunk launches under the same specialization
    (chunks start at whole 128-token tiles). A no-op without triton or an active prebuild."""
    if not TRITON_AVAILABLE or active_prebuild() is None:
        return
    from llm_training.trainer.cross_entropy_kernels import ce_chunk_and_grad

    C = default_chunk_tokens(vocab_size)
    logits_CV = torch.empty(C, vocab_size, dtype=torch.float32, device="meta")
    labels_C = torch.empty(C, dtype=torch.long, device="meta")
    weights_C = torch.empty(C, dtype=torch.float32, device="meta")
    launch = lambda: ce_chunk_and_grad(logits_CV, labels_C, weights_C, compute_dtype, IGNORE_INDEX)
    capture_launches(launch, logits_CV, what="loss CE chunk")


@functools.cache
def _fp32_out_gemms(device: torch.device) -> bool:
    """Whether bf16 x bf16 -> fp32 GEMMs (`mm` with `out_dtype`, and `baddbmm` accumulating into an fp32 `out`)
    run on `device` and give the fp32 product: a tiny probe, once per device. CPU kernels do not exist (torch
    2.13); CUDA builds since torch 2.8 have them."""
    if device.type != "cuda":
        return False
    a = torch.randn(32, 16, device=device).to(torch.bfloat16)
    b = torch.randn(16, 8, device=device).to(torch.bfloat16)
    try:
        acc = torch.ones(1, 32, 8, device=device)
        torch.baddbmm(acc, a[None], b[None], out_dtype=torch.float32, out=acc)
        logits = torch.mm(a, b, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    ref = a.float() @ b.float()
    return bool(torch.allclose(acc[0], ref + 1, atol=1e-3) and torch.allclose(logits, ref, atol=1e-3))


class HeadGradAccumulator:
    """Sums the head weight's gradient over one optimizer step's micro-batches in the loss's own fp32 [V, H] buffer,
    and hands autograd two gradients per step: the sum of all micro-batches but the last, in the backward of the
    second-to-last, and the last micro-batch's own.

    Without it each micro-batch's backward hands autograd a [V, H] gradient in the weight's dtype (a scale-and-cast
    pass over the fp32 buffer), which FSDP2 (or autograd) casts back and adds into an fp32 accumulator (one more
    pass, a third for the add). With it the chunk GEMMs of the micro-batches before the second-to-last's hand-over
    accumulate into one buffer (the GEMM's C = buffer, beta = 1: no extra pass): at 4 micro-batches, 2 scale-and-cast
    passes, 1 cast and 1 add per step instead of 4, 1 and 3, and with several data ranks 2 reductions of the head's
    gradient instead of 4.

    Why a bf16 weight does not get one hand-over at the last micro-batch: over one rank FSDP2 defers the reduction
    to the last micro-batch and keeps the earlier micro-batches' gradients in its reduce dtype (fp32), and it reduces
    a group only if all of its gradients share one dtype. A head gradient handed at the last micro-batch only is
    still in the weight's dtype (bf16) beside the group's fp32 sums: FSDP2 asserts ("FSDP reduce-scatter expects
    uniform gradient dtype", one H100, session 35). Handed one micro-batch earlier, FSDP2 holds it in fp32 like the
    rest. An fp32 weight has no such neighbours to match: it gets the whole sum at the last micro-batch, as the fp32
    buffer itself (no scale, cast or copy pass: the upstream gradient is checked to be 1).

    It also holds the step's copy of an fp32 head weight in the GEMMs' dtype (`compute_weight`), made at the first
    micro-batch and dropped with the last one's forward.

    The training step's contract: `begin_step()` before a step; `micro_batch(index, count)` before each
    micro-batch's forward loss, whose total is back-propagated with upstream gradient 1 (checked on the device)
    before the next micro-batch's forward. Between steps it holds nothing."""

    def __init__(self):
        self.buffer_VH: torch.Tensor | None = None  # the fp32 sum of the step's micro-batches not yet handed over
        self.weight_copy_VH: torch.Tensor | None = None  # this step's copy of an fp32 head weight in the GEMMs' dtype
        self.index, self.count = 0, 1  # the current micro-batch of the step

    def begin_step(self) -> None:
        """Forget any partial sum and weight copy (a step that raised between micro-batches)."""
        self.buffer_VH = None
        self.weight_copy_VH = None

    def micro_batch(self, index: int, count: int) -> HeadGradAccumulator:
        """Mark micro-batch `index` of the step's `count`; returns self for `forward_loss(head_grad=...)`."""
        if not 0 <= index < count:
            raise ValueError(f"micro-batch {index} of {count}")
        self.index, self.count = index, count
        return self

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def hands_over(self, weight_dtype: torch.dtype) -> bool:
        """Whether this micro-batch's backward hands the sum (its own gradient included) to autograd: the last one
        for an fp32 weight, the last two for another dtype (class docstring)."""
        return self.last or (weight_dtype != torch.float32 and self.index == self.count - 2)

    def compute_weight(self, weight_VH: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`weight_VH` in `dtype`: the step's one copy (made at its first use, dropped after the last micro-batch's
        forward by the loss) when the dtypes differ, the weight itself when they agree."""
        if weight_VH.dtype == dtype:
            return weight_VH
        copy = self.weight_copy_VH
        if copy is None or copy.dtype != dtype or copy.shape != weight_VH.shape:
            copy = self.weight_copy_VH = weight_VH.detach().to(dtype)
        return copy


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """(sum_t w_t CE_t, per-segment sums of CE_t) for CE_t = CE(hidden[t] @ weight.T, labels[t]) over labels
    != -100, chunked over tokens. `segment_ends` cut the tokens into segments (main head, MTP heads);
    `token_weight_T` (fp32 [T]) is each token's weight in the differentiable total.

    Logits and their gradient matmuls run in the hidden's dtype (bf16 under mixed precision: tensor cores,
    fp32 accumulation); logits, log-softmax, losses and d(loss)/d(logits) are fp32; the weight gradient is
    accumulated in fp32. Forward computes, per chunk, the losses and the weighted gradients w.r.t. the hidden
    chunk and the weight (w_t (softmax - onehot)); backward multiplies the stored gradients by the incoming
    scalar. Peak extra memory: one `[chunk, V]` fp32 block (+ its compute-dtype gradient: written over that block
    by the CUDA kernel, `cross_entropy_kernels`; a buffer of its own elsewhere) + the input gradients.
    """

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, labels_T, token_weight_T, segment_ends, chunk_ends, compiled, head_grad):
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        head_grad = head_grad if needs_grad and ctx.needs_input_grad[1] else None
        chunk_fn = _chunk_function(hidden_TH.device, compiled)
        mm_dtype = hidden_TH.dtype
        w_VH = head_grad.compute_weight(weight_VH, mm_dtype) if head_grad is not None else weight_VH.to(mm_dtype)
        fp32_out = mm_dtype != torch.float32 and _fp32_out_gemms(hidden_TH.device)
        T = hidden_TH.shape[0]
        ce_T = torch.empty(T, dtype=torch.float32, device=hidden_TH.device)
        grad_hidden_TH = torch.empty_like(hidden_TH) if needs_grad else None
        partial_sum = head_grad.buffer_VH if head_grad is not None else None  # earlier micro-batches of the step
        if partial_sum is not None and partial_sum.shape != weight_VH.shape:
            raise RuntimeError(
                f"HeadGradAccumulator holds a {tuple(partial_sum.shape)} sum for a {tuple(weight_VH.shape)} head: "
                "call begin_step() before each optimizer step"
            )
        if partial_sum is not None or not needs_grad:
            grad_weight_VH = partial_sum
        else:
            grad_weight_VH = torch.empty(weight_VH.shape, dtype=torch.float32, device=weight_VH.device)
        for start, stop in zip((0, *chunk_ends[:-1]), chunk_ends):
            h_CH = hidden_TH[start:stop]
            if fp32_out:
                logits_CV = torch.mm(h_CH, w_VH.t(), out_dtype=torch.float32)
            else:
                logits_CV = (h_CH @ w_VH.t()).float()
            ce_T[start:stop], g_CV = chunk_fn(logits_CV, labels_T[start:stop], token_weight_T[start:stop], mm_dtype)
            del logits_CV
            if not needs_grad:
                continue
            torch.mm(g_CV, w_VH, out=grad_hidden_TH[start:stop])
            first = start == 0 and partial_sum is None
            _accumulate_weight_grad(grad_weight_VH, g_CV.t(), h_CH, first=first, fp32_out=fp32_out)
            del g_CV
        if head_grad is not None and head_grad.last:
            head_grad.weight_copy_VH = None  # the step's last GEMM with it has run
        if needs_grad:
            # with an accumulator, only the hand-over micro-batches give the weight a gradient (the sum so far)
            ctx.hands_weight_grad = head_grad is None or head_grad.hands_over(weight_VH.dtype)
            ctx.accumulates = head_grad is not None
            if head_grad is not None:
                head_grad.buffer_VH = None if ctx.hands_weight_grad else grad_weight_VH
            ctx.save_for_backward(grad_hidden_TH, grad_weight_VH if ctx.hands_weight_grad else None)
            ctx.weight_dtype = weight_VH.dtype
        total = (ce_T * token_weight_T).sum()
        bounds = [0, *segment_ends]
        per_segment = torch.stack([ce_T[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:])])
        ctx.mark_non_differentiable(per_segment)
        return total, per_segment

    @staticmethod
    def backward(ctx, grad_total, _grad_per_segment):
        grad_hidden_TH, grad_weight_VH = ctx.saved_tensors
        if ctx.accumulates:  # the sum over micro-batches is only right if each one is back-propagated with 1
            torch._assert_async(
                grad_total == 1, "HeadGradAccumulator: a micro-batch's loss total was back-propagated with an "
                "upstream gradient other than 1; call backward() on the total itself"
            )  # fmt: skip
        g_h = (grad_hidden_TH * grad_total.to(grad_hidden_TH.dtype)) if ctx.needs_input_grad[0] else None
        g_w = None
        if ctx.needs_input_grad[1] and ctx.hands_weight_grad:
            if ctx.accumulates and ctx.weight_dtype == grad_weight_VH.dtype:
                g_w = grad_weight_VH  # the upstream gradient is 1 (checked above): the fp32 sum as it is
            else:  # scale and cast in one kernel
                out = torch.empty_like(grad_weight_VH, dtype=ctx.weight_dtype)
                g_w = torch.mul(grad_weight_VH, grad_total, out=out)
        return g_h, g_w, None, None, None, None, None, None


def _accumulate_weight_grad(acc_VH: torch.Tensor, g_VC: torch.Tensor, h_CH: torch.Tensor, first: bool, fp32_out: bool):
    """acc (fp32) <- g @ h (first chunk) or acc + g @ h. With `fp32_out` the bf16 GEMM accumulates into the fp32
    buffer itself (C = acc, beta = 1); otherwise fp32 inputs use addmm, and other dtypes a product, a cast and
    an add (the fallback)."""
    if fp32_out:
        acc_1VH = acc_VH.unsqueeze(0)  # the same tensor as self and out: no copy of acc
        torch.baddbmm(acc_1VH, g_VC[None], h_CH[None], beta=0.0 if first else 1.0, out_dtype=torch.float32, out=acc_1VH)
    elif g_VC.dtype == torch.float32:
        torch.addmm(acc_VH, g_VC, h_CH, beta=0.0 if first else 1.0, out=acc_VH)
    elif first:
        acc_VH.copy_(g_VC @ h_CH)
    else:
        acc_VH += (g_VC @ h_CH).float()


def _chunk_ce_and_grad(logits_CV: torch.Tensor, y_C: torch.Tensor, w_C: torch.Tensor, grad_dtype: torch.dtype):
    """One chunk from its fp32 logits: (fp32 CE per token [C], zero on ignored rows; d(sum_t w_t CE_t)/d logits
    = w_t (softmax - onehot) [C, V] in `grad_dtype`, zero on ignored rows). The logits buffer is reused."""
    valid_C = y_C != IGNORE_INDEX
    lse_C = torch.logsumexp(logits_CV, dim=-1)
    safe_y_C = torch.where(valid_C, y_C, torch.zeros_like(y_C))
    target_logit_C = logits_CV.gather(1, safe_y_C[:, None]).squeeze(1)
    ce_C = (lse_C - target_logit_C) * valid_C
    grad_CV = (logits_CV - lse_C[:, None]).exp_()  # softmax; the logits buffer is free after this
    grad_CV.scatter_add_(1, safe_y_C[:, None], -torch.ones_like(lse_C[:, None]))  # - onehot
    return ce_C, grad_CV.mul_((w_C * valid_C)[:, None]).to(grad_dtype)


def _chunk_function(device: torch.device, compiled: bool):
    """How a chunk's CE and logit gradient are computed: on CUDA with triton, one fused kernel
    (`cross_entropy_kernels`); elsewhere the torch code, under torch.compile when `compiled`."""
    if device.type == "cuda" and TRITON_AVAILABLE:
        from llm_training.trainer.cross_entropy_kernels import ce_chunk_and_grad

        return functools.partial(ce_chunk_and_grad, ignore_index=IGNORE_INDEX)
    return _compiled_chunk_ce_and_grad() if compiled else _chunk_ce_and_grad


@functools.cache
def _compiled_chunk_ce_and_grad():
    """torch.compile'd `_chunk_ce_and_grad` (fuses the softmax / one-hot / weight / cast arithmetic of a chunk)."""
    return torch.compile(_chunk_ce_and_grad, dynamic=True)


def linear_cross_entropy_segments(
    hiddens: list[torch.Tensor],
    weight_VH: torch.Tensor,
    labels: list[torch.Tensor],
    weights: list[torch.Tensor | float],
    chunk_tokens: int | None = None,
    compiled: bool = False,
    head_grad: HeadGradAccumulator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over the head weight for several loss terms sharing it (main head + MTP heads).

    Term s: hidden `hiddens[s]` [..., H], labels `labels[s]` [...] (long, -100 = ignore), weight `weights[s]`
    (float or 0-dim tensor). Returns (sum_s weights[s] * CE_sum_s, a differentiable fp32 0-dim tensor; the
    per-term sums CE_sum_s, fp32 [S], detached). Same value and gradients as the weighted sum of separate
    `linear_cross_entropy_sum` calls, up to fp32 summation order. `chunk_tokens`: the longest chunk (default
    `default_chunk_tokens`; the chunks are `chunk_bounds`). `head_grad`: the step's accumulator of the head weight's
    gradient over micro-batches (`HeadGradAccumulator`), or None (each call hands its own gradient).
    """
    if not (len(hiddens) == len(labels) == len(weights)) or not hiddens:
        raise ValueError(f"{len(hiddens)} hidden tensors, {len(labels)} label tensors and {len(weights)} weights")
    h_TH = [h.reshape(-1, h.shape[-1]) for h in hiddens]
    y_T = [y.reshape(-1) for y in labels]
    device = h_TH[0].device
    token_weight_T = torch.cat(
        [torch.as_tensor(w, dtype=torch.float32, device=device).expand(h.shape[0]) for h, w in zip(h_TH, weights)]
    )
    ends, n = [], 0
    for h in h_TH:
        n += h.shape[0]
        ends.append(n)
    hidden_TH = h_TH[0] if len(h_TH) == 1 else torch.cat(h_TH)
    labels_T = y_T[0] if len(y_T) == 1 else torch.cat(y_T)
    chunk_ends = chunk_bounds(hidden_TH.shape[0], chunk_tokens or default_chunk_tokens(weight_VH.shape[0]))
    if not torch.is_grad_enabled():  # no backward will follow (evaluation): skip the gradients forward precomputes
        hidden_TH, weight_VH = hidden_TH.detach(), weight_VH.detach()
    return _ChunkedLinearCrossEntropy.apply(
        hidden_TH, weight_VH, labels_T, token_weight_T, tuple(ends), chunk_ends, compiled, head_grad
    )


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight_VH: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """Sum over labelled tokens of CE(hidden @ weight.T, labels): fp32 0-dim tensor (hidden [..., H], labels [...],
    long, -100 = ignore). `compiled`: the per-chunk softmax arithmetic under torch.compile."""
    total, _ = linear_cross_entropy_segments([hidden], weight_VH, [labels], [1.0], chunk_tokens, compiled)
    return total


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


def forward_loss(
    model,
    head_weight,
    cpu_batch,
    attention_document_ids,
    device: torch.device,
    normalisers: torch.Tensor,
    mtp_loss_weight: float,
    balance_scale: float,
    compiled: bool = False,
    head_grad: HeadGradAccumulator | None = None,
):
    """(model output, StepLoss) of one prepared micro-batch (`trainer.batch.PreparedBatch`, on the CPU) moved to
    `device`: the forward with the hidden states the fused loss needs, then `micro_batch_loss`. The training step
    and the validator both run a micro-batch through this. `attention_document_ids`: the whole sequences' document
    ids under context parallelism (`shard_batch`), else None. `head_weight(model)` gives the output projection
    (`ModelSpec.head_weight`); it is read AFTER the forward, when FSDP2 has gathered it (before, it is a shard).
    `head_grad`: the training step's `HeadGradAccumulator`, marked for this micro-batch.

    The micro-batch's move and metadata do not wait for the device, so the host can queue its forward while the
    device still runs the last one's backward: the tensors go through pinned memory (a pageable copy waits for the
    queue), and the documents' cu_seqlens, which varlen attention needs, are computed from the host's ids (from the
    device's, torch.nonzero would wait for the queue, once per micro-batch). Measured in the harness's profiled
    steps on one H100 (proxy_16e, session 40): the GPU's idle time per step 32.8 -> 14.0 ms without MTP, 50.0 -> 16.6
    ms with MTP + Muon; the unprofiled steps, whose host runs faster, moved within noise (849.4 -> 849.0, 1393.4 ->
    1391.8 ms)."""
    docs = cpu_batch.document_ids if attention_document_ids is None else attention_document_ids
    cu_seqlens = to_device_async(document_cu_seqlens(docs), device)
    b = cpu_batch.map(lambda x: to_device_async(x, device))
    if attention_document_ids is not None:
        attention_document_ids = to_device_async(attention_document_ids, device)
    out = model(
        b.input_ids,
        b.position_ids,
        b.document_ids,
        b.mtp_input_ids,
        return_hidden=True,
        attention_document_ids=attention_document_ids,
        attention_cu_seqlens=cu_seqlens,
    )
    loss = micro_batch_loss(
        out,
        head_weight(model),
        b.labels,
        b.mtp_labels,
        normalisers,
        mtp_loss_weight,
        balance_scale,
        compiled=compiled,
        head_grad=head_grad,
    )
    return out, loss


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
    head_grad: HeadGradAccumulator | None = None,
) -> StepLoss:
    """CE/N_main + mtp_loss_weight * mean_k(MTP_k/N_k) + balance_scale * out.balance_loss.

    `out` is the model output of `forward(..., return_hidden=True)`; `mtp_labels[k]` the targets of MTP module k
    (`PreparedBatch.mtp_labels`, already masked per document); `normalisers` the global labelled token counts
    from `count_labelled_tokens` summed over micro-batches and data ranks (clamped >= 1); `balance_scale` =
    1 / (micro-batches x data ranks), so the balance term adds up to its global mean. `head_grad`: see
    `linear_cross_entropy_segments`.
    """
    norms = normalisers.clamp(min=1).float()
    mtp_hidden = out.mtp_hidden or []
    k = len(mtp_hidden)
    if k and len(mtp_labels) != k:
        raise ValueError(f"{k} MTP hidden states but {len(mtp_labels)} MTP label tensors")
    # main CE / N_main + mtp_loss_weight * mean_k(MTP_k / N_k): one chunked pass over the head weight for all
    weights = [1.0 / norms[0]] + [mtp_loss_weight / (k * norms[i + 1]) for i in range(k)]
    total, sums = linear_cross_entropy_segments(
        [out.hidden, *mtp_hidden],
        lm_head_weight,
        [labels_BS, *mtp_labels[:k]],
        weights,
        chunk_tokens,
        compiled,
        head_grad,
    )
    ce = sums[0] / norms[0]
    mtp = (sums[1:] / norms[1:]).mean() if k else torch.zeros((), device=ce.device)
    balance = out.balance_loss
    if balance is None:
        balance = torch.zeros((), device=ce.device)
    balance = balance.float() * balance_scale
    if balance.requires_grad:
        total = total + balance
    return StepLoss(total=total, ce=ce.detach(), mtp=mtp.detach(), balance=balance.detach())
