"""Chunked linear cross-entropy, MTP target shift and global-batch loss normalisation."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llm_training.trainer.losses import (
    IGNORE_INDEX,
    chunk_bounds,
    count_labelled_tokens,
    default_chunk_tokens,
    linear_cross_entropy_segments,
    linear_cross_entropy_sum,
    micro_batch_loss,
    prebuild_chunk_kernel,
    shift_labels,
)


def test_default_chunk_is_a_power_of_two_within_its_2_gib():
    """Motif-3's vocabulary: 2^29 / 220160 = 2438 tokens fit; the chunk is the largest power of two of them (2048),
    so a power-of-two micro-batch splits into equal 2048-token chunks. A vocabulary too large for 128 tokens keeps
    what fits."""
    assert default_chunk_tokens(220160) == 2048
    assert default_chunk_tokens(32000) == 16384  # 16777 fit
    assert default_chunk_tokens(1 << 20) == 512
    assert default_chunk_tokens(3_000_000) == 128  # 178 fit
    assert default_chunk_tokens(5_000_000) == 107
    assert default_chunk_tokens(1 << 31) == 1


@pytest.mark.parametrize("tokens", [1, 127, 2048, 2049, 2431, 2432, 2433, 8190, 8192, 16384, 32768, 100_000])
def test_chunks_are_as_few_as_the_largest_allows_and_about_equal(tokens):
    """The chunk count of `max_chunk`-token chunks, every chunk whole 128-token tiles (the last may end in a partial
    one) and within one tile of the others: no short last chunk, whose GEMMs run far below the others' rate."""
    C = default_chunk_tokens(220160)
    ends = chunk_bounds(tokens, C)
    sizes = [b - a for a, b in zip((0, *ends[:-1]), ends)]
    assert ends[-1] == tokens and len(ends) == -(-tokens // C)
    assert all(0 < n <= C for n in sizes) and all(e % 128 == 0 for e in ends[:-1])
    full = sizes[:-1]
    if full:
        assert max(full) - min(full) <= 128  # whole tiles, one tile apart at most
        # the last: its share of tiles (the fewest; one fewer when every other chunk took an extra one), the final
        # tile maybe partial
        assert min(full) - 128 <= -(-sizes[-1] // 128) * 128 <= min(full)


def test_chunks_of_a_micro_batch_and_of_untiled_sizes():
    assert chunk_bounds(8192, 2432) == (2048, 4096, 6144, 8192)  # was 3 x 2432 + 896
    assert chunk_bounds(16384, 2432) == (2432, 4864, 7168, 9472, 11776, 14080, 16384)
    assert chunk_bounds(16384, default_chunk_tokens(220160)) == tuple(range(2048, 16385, 2048))  # an MTP micro-batch
    assert chunk_bounds(13, 4) == (4, 7, 10, 13)  # a max_chunk of no whole tiles: lengths one token apart
    assert chunk_bounds(0, 2432) == ()


@pytest.mark.gpu  # needs triton, which the GPU suite always has
def test_every_loss_chunk_launches_the_kernel_the_prebuild_builds(triton_prebuild_stub):
    """`prebuild_chunk_kernel` hands the CE chunk kernel at Motif-3's vocabulary to the Triton prebuild; the launch of
    a later chunk (labels and token weights sliced at 2 x 2048 tokens into the step's tensors) has the same
    specialization, so it adds no build: the one the worker made serves every chunk."""
    from activation.triton_prebuild import capture_launches

    from llm_training.trainer.cross_entropy_kernels import ce_chunk_and_grad

    pb, events = triton_prebuild_stub
    V, C = 220160, default_chunk_tokens(220160)
    prebuild_chunk_kernel(V, torch.bfloat16)
    assert [name for _m, name, _k in pb.futures] == ["_ce_chunk_kernel"]
    labels_T = torch.empty(5 * C, dtype=torch.long, device="meta")
    weights_T = torch.empty(5 * C, dtype=torch.float32, device="meta")
    logits_CV = torch.empty(C, V, dtype=torch.float32, device="meta")
    chunk = slice(2 * C, 3 * C)
    launch = lambda: ce_chunk_and_grad(logits_CV, labels_T[chunk], weights_T[chunk], torch.bfloat16, IGNORE_INDEX)
    capture_launches(launch, logits_CV)
    assert len(pb.futures) == 1 and pb.skipped == []
    assert [seconds > 0 for _name, seconds in pb.wait(timeout=300)] == [True] and events == []


def _reference_ce_sum(hidden, weight, labels):
    """Independent float64 reference: log-softmax of the full logits, summed over labelled tokens."""
    logits = hidden.double().reshape(-1, hidden.shape[-1]) @ weight.double().t()
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    y = labels.reshape(-1)
    keep = y != IGNORE_INDEX
    return -logp[keep].gather(1, y[keep][:, None]).sum()


def _inputs(T=37, H=8, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::5] = IGNORE_INDEX
    return hidden, weight, labels


def test_chunked_ce_matches_reference_values_and_grads():
    hidden, weight, labels = _inputs()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy_sum(h1, w1, labels, chunk_tokens=6)
    (loss * 0.7).backward()
    h2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = _reference_ce_sum(h2, w2, labels)
    (ref * 0.7).backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h1.grad.double(), h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w1.grad.double(), w2.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 7, 36, 37, 100])
def test_chunk_boundaries_match_reference(chunk):
    """Chunks of 1 token, not dividing T, T - 1, exactly T, larger than T: same loss and gradients."""
    hidden, weight, labels = _inputs(T=37)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    linear_cross_entropy_sum(h1, w1, labels, chunk_tokens=chunk).backward()
    h2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    _reference_ce_sum(h2, w2, labels).backward()
    torch.testing.assert_close(h1.grad.double(), h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w1.grad.double(), w2.grad, rtol=1e-5, atol=1e-6)


def test_all_ignored_gives_zero_loss_and_grads():
    hidden, weight, labels = _inputs(T=12)
    labels[:] = IGNORE_INDEX
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy_sum(h, w, labels, chunk_tokens=5)
    loss.backward()
    assert loss.item() == 0.0 and not h.grad.any() and not w.grad.any()


def test_shared_pass_equals_separate_passes():
    """Main + two MTP heads in one pass (segments straddle chunk boundaries: 37 + 23 + 30 tokens, chunks of 16)
    == the weighted sum of three separate passes, in the total, the per-segment sums and every gradient."""
    g = torch.Generator().manual_seed(3)
    sizes, H, V = (37, 23, 30), 8, 50
    hiddens = [torch.randn(n, H, generator=g) for n in sizes]
    labels = [torch.randint(0, V, (n,), generator=g) for n in sizes]
    labels[1][::3] = IGNORE_INDEX
    weight = torch.randn(V, H, generator=g) * 0.5
    weights = [1 / 30, 0.3 / 40, torch.tensor(0.3 / 17)]
    h1 = [h.clone().requires_grad_() for h in hiddens]
    w1 = weight.clone().requires_grad_()
    total, sums = linear_cross_entropy_segments(h1, w1, labels, weights, chunk_tokens=16)
    (total * 0.5).backward()
    h2 = [h.clone().requires_grad_() for h in hiddens]
    w2 = weight.clone().requires_grad_()
    separate = [linear_cross_entropy_sum(h, w2, y, chunk_tokens=16) for h, y in zip(h2, labels)]
    (sum(float(w) * s for w, s in zip(weights, separate)) * 0.5).backward()
    assert not sums.requires_grad and sums.shape == (3,)
    torch.testing.assert_close(sums, torch.stack(separate).detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(
        total, sum(float(w) * s for w, s in zip(weights, separate)).detach(), rtol=1e-6, atol=1e-6
    )
    for a, b in zip(h1, h2):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-7)


def test_chunked_ce_all_ignored_chunk_and_no_grad():
    hidden, weight, labels = _inputs(T=12)
    labels[:6] = IGNORE_INDEX
    with torch.no_grad():
        loss = linear_cross_entropy_sum(hidden, weight, labels, chunk_tokens=6)
    torch.testing.assert_close(loss.double(), _reference_ce_sum(hidden, weight, labels), rtol=1e-5, atol=1e-5)


def test_chunked_ce_under_no_grad_skips_the_gradients(monkeypatch):
    """Evaluation (no_grad, parameters that require grad): the same losses, and no gradient is precomputed."""
    from llm_training.trainer import losses

    hidden, weight, labels = _inputs()
    weight.requires_grad_(True)
    expected = linear_cross_entropy_segments([hidden], weight, [labels], [0.5])

    def fail(*args, **kwargs):
        raise AssertionError("a weight gradient was computed under no_grad")

    monkeypatch.setattr(losses, "_accumulate_weight_grad", fail)
    with torch.no_grad():
        total, per_segment = linear_cross_entropy_segments([hidden], weight, [labels], [0.5])
    assert torch.equal(total, expected[0].detach()) and torch.equal(per_segment, expected[1])


class _LargestAllocation(TorchDispatchMode):
    """Records the largest tensor produced by any aten op (numel)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_chunked_ce_never_materialises_full_logits():
    T, H, V, chunk = 64, 8, 500, 8
    hidden, weight, labels = _inputs(T=T, H=H, V=V)
    hidden.requires_grad_()
    weight.requires_grad_()
    with _LargestAllocation() as mode:
        linear_cross_entropy_sum(hidden, weight, labels, chunk_tokens=chunk).backward()
    assert mode.largest <= max(chunk * V, V * H), mode.largest  # [chunk, V] blocks and the [V, H] grad only
    assert mode.largest < T * V


def test_shift_labels_and_mtp_targets():
    labels = torch.tensor([[1, 2, 3, 4, -100], [5, 6, -100, 7, 8]])
    assert shift_labels(labels, 1).tolist() == [[2, 3, 4, -100, -100], [6, -100, 7, 8, -100]]
    assert shift_labels(labels, 2).tolist() == [[3, 4, -100, -100, -100], [-100, 7, 8, -100, -100]]
    assert shift_labels(labels, 7).tolist() == [[-100] * 5, [-100] * 5]
    assert count_labelled_tokens([labels, shift_labels(labels, 1), shift_labels(labels, 2)]).tolist() == [8, 6, 4]


def test_mtp_targets_never_cross_packed_documents():
    # two documents per row: [0, 0, 0 | 1, 1] and [0, 0 | 1, 1, 1]; labels written by hand
    labels = torch.tensor([[1, 2, -100, 4, -100], [5, -100, 7, 8, -100]])
    docs = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]])
    # shift 1: position t takes labels[t+1] only when t+1 is in t's document
    # row 0: t=0 -> 2 (doc 0), t=1 -> -100, t=2 -> labels[3]=4 but doc 1 != 0 -> -100, t=3 -> -100
    # row 1: t=0 -> -100, t=1 -> labels[2]=7 but doc 1 != 0 -> -100, t=2 -> 8, t=3 -> -100
    assert shift_labels(labels, 1, docs).tolist() == [[2, -100, -100, -100, -100], [-100, -100, 8, -100, -100]]
    assert count_labelled_tokens([labels, shift_labels(labels, 1, docs)]).tolist() == [6.0, 2.0]
    # without document ids the cross-document targets would be kept
    assert shift_labels(labels, 1).tolist()[0][2] == 4


class _Out:
    def __init__(self, hidden, mtp_hidden, balance):
        self.hidden, self.mtp_hidden, self.balance_loss = hidden, mtp_hidden, balance


def test_accumulated_normalised_loss_equals_full_batch_mean():
    """Sum over micro-batches of micro_batch_loss == the full-batch mean CE (+ MTP mean, + mean balance),
    in value and in gradient, with uneven labelled-token counts per micro-batch."""
    g = torch.Generator().manual_seed(1)
    B, S, H, V = 4, 9, 6, 30
    hidden = torch.randn(B, S, H, generator=g)
    mtp_h = torch.randn(B, S, H, generator=g)
    weight = (torch.randn(V, H, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, 3:] = IGNORE_INDEX  # uneven counts
    labels[:, -1] = IGNORE_INDEX
    balance_per_mb = [torch.tensor(0.25, requires_grad=True), torch.tensor(0.75, requires_grad=True)]
    w_mtp = 0.3

    # reference: full batch, float64, plain mean over labelled tokens
    w64 = weight.detach().double().requires_grad_()
    ref_ce = _reference_ce_sum(hidden, w64, labels) / (labels != IGNORE_INDEX).sum()
    y_mtp = torch.full_like(labels, IGNORE_INDEX)
    y_mtp[:, :-1] = labels[:, 1:]
    ref_mtp = _reference_ce_sum(mtp_h, w64, y_mtp) / (y_mtp != IGNORE_INDEX).sum()
    ref = ref_ce + w_mtp * ref_mtp
    ref.backward()

    norms = sum(count_labelled_tokens([labels[sl], y_mtp[sl]]) for sl in (slice(0, 2), slice(2, 4)))
    total = 0.0
    for i, sl in enumerate((slice(0, 2), slice(2, 4))):
        out = _Out(hidden[sl], [mtp_h[sl]], balance_per_mb[i])
        loss = micro_batch_loss(out, weight, labels[sl], [y_mtp[sl]], norms, w_mtp, balance_scale=0.5, chunk_tokens=5)
        loss.total.backward()
        total += loss.total.item()
    torch.testing.assert_close(total, ref.item() + 0.5, rtol=1e-5, atol=1e-6)  # + mean balance 0.5
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-7)
    assert balance_per_mb[0].grad.item() == 0.5 and balance_per_mb[1].grad.item() == 0.5


def _rel_err(a, b):
    return ((a.double().cpu() - b).norm() / b.norm()).item()


def _bf16_case(device):
    """bf16 hidden/weight (mixed precision): matmuls in bf16, softmax in fp32; close to the fp64 reference
    computed from the same bf16-rounded inputs."""
    hidden, weight, labels = _inputs(T=300, H=64, V=5000)
    h = hidden.to(device, torch.bfloat16).requires_grad_()
    w = weight.to(device, torch.bfloat16).requires_grad_()
    loss = linear_cross_entropy_sum(h, w, labels.to(device), chunk_tokens=128)
    loss.backward()
    h64, w64 = h.detach().double().cpu().requires_grad_(), w.detach().double().cpu().requires_grad_()
    ref = _reference_ce_sum(h64, w64, labels)
    ref.backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss.double().cpu(), ref, rtol=1e-3, atol=0.0)
    assert _rel_err(h.grad, h64.grad) < 2e-2 and _rel_err(w.grad, w64.grad) < 2e-2


def test_bf16_linear_ce_close_to_fp64_reference_cpu():
    _bf16_case("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_has_fp32_out_gemms():
    """The fast path's GEMMs (bf16 x bf16 -> fp32 `mm` / `baddbmm` into an fp32 buffer) run on this torch."""
    from llm_training.trainer.losses import _fp32_out_gemms

    assert _fp32_out_gemms(torch.device("cuda")), "bf16 x bf16 -> fp32 GEMMs (mm / baddbmm out_dtype) unavailable"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_linear_ce_close_to_fp64_reference_cuda():
    """The CUDA path (fp32 logits out of the GEMM, weight gradient accumulated in fp32 inside it, or the
    fallback where torch lacks those GEMMs)."""
    _bf16_case("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_chunk_arithmetic_matches_eager_cuda():
    """`compiled=True` (the chunk's softmax / one-hot / weight / cast under torch.compile) == eager, two heads."""
    g = torch.Generator().manual_seed(5)
    hs = [torch.randn(n, 64, generator=g).cuda().to(torch.bfloat16) for n in (300, 200)]
    ys = [torch.randint(0, 5000, (n,), generator=g).cuda() for n in (300, 200)]
    ys[0][::4] = IGNORE_INDEX
    w = (torch.randn(5000, 64, generator=g) * 0.5).cuda().to(torch.bfloat16)
    results = []
    for compiled in (False, True):
        h1 = [h.clone().requires_grad_() for h in hs]
        w1 = w.clone().requires_grad_()
        total, sums = linear_cross_entropy_segments(
            h1, w1, ys, [1 / 225, 0.3 / 200], chunk_tokens=128, compiled=compiled
        )
        total.backward()
        results.append((total.detach(), sums, w1.grad.float(), torch.cat([h.grad for h in h1]).float()))
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager, rtol=2e-2, atol=1e-5)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=["fp32_weight", "bf16_weight"])
def test_head_grad_accumulator_hands_the_sum_over_at_the_end_of_the_step(weight_dtype):
    """Four micro-batches through one accumulator give the head weight the same gradient as four separate losses
    (summed by autograd). A bf16 weight (FSDP2's gathered copy) is handed two gradients: at the third backward (the
    sum of micro-batches 1 to 3) and the last (its own); an fp32 weight one, at the last backward: the fp32 buffer
    itself, no copy. Earlier backwards leave `weight.grad` untouched. The hidden gradients are each micro-batch's
    own. Between steps the accumulator holds nothing."""
    from llm_training.trainer.losses import HeadGradAccumulator

    first_hand_over = 2 if weight_dtype == torch.bfloat16 else 3
    micro = [_inputs(T=29, seed=s) for s in range(4)]
    micro = [(h.to(weight_dtype), w.to(weight_dtype), y) for h, w, y in micro]
    weight = micro[0][1].clone().requires_grad_()
    ref_w = weight.detach().clone().requires_grad_()
    ref_h, ref_after = [], []
    for hidden, _, labels in micro:
        h = hidden.clone().requires_grad_()
        linear_cross_entropy_segments([h], ref_w, [labels], [0.25], chunk_tokens=8)[0].backward()
        ref_h.append(h.grad)
        ref_after.append(ref_w.grad.clone())
    acc = HeadGradAccumulator()
    for step in range(2):  # a second step starts from an empty sum
        weight.grad = None
        acc.begin_step()
        for k, (hidden, _, labels) in enumerate(micro):
            h = hidden.clone().requires_grad_()
            # the sum of the micro-batches before this one (its address only: a reference would make autograd copy it)
            held = acc.buffer_VH.data_ptr() if acc.buffer_VH is not None else None
            total, _ = linear_cross_entropy_segments(
                [h], weight, [labels], [0.25], chunk_tokens=8, head_grad=acc.micro_batch(k, len(micro))
            )
            total.backward()
            torch.testing.assert_close(h.grad, ref_h[k], rtol=0, atol=0)
            if k < first_hand_over:
                assert weight.grad is None and acc.buffer_VH is not None, (step, k)
            else:  # after the hand-overs autograd holds every micro-batch so far
                if weight_dtype == torch.float32:  # one fp32 sum against autograd's sum of the four: fp32 rounding
                    torch.testing.assert_close(weight.grad, ref_after[k], rtol=1e-5, atol=1e-6)
                else:  # the reference sums four bf16-rounded gradients in bf16: a few bf16 ulps of the whole
                    assert _rel_err(weight.grad, ref_after[k]) < 1e-2
                assert acc.buffer_VH is None
        if weight_dtype == torch.float32:
            assert weight.grad.data_ptr() == held  # the sum itself: no scale, cast or copy pass
    with pytest.raises(ValueError, match="micro-batch 4 of 4"):
        acc.micro_batch(4, 4)


def test_head_grad_accumulator_casts_an_fp32_weight_once_per_step():
    """bf16 hiddens against an fp32 head weight (one GPU: the head stays out of FSDP2): the weight is cast to bf16
    once per step, at its first micro-batch, not once per micro-batch; the copy is gone after the last forward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from llm_training.trainer.losses import HeadGradAccumulator

    class CountWeightCasts(TorchDispatchMode):
        def __init__(self, weight):
            super().__init__()
            self.weight, self.casts = weight, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() == self.weight.data_ptr():
                self.casts += 1
            return func(*args, **(kwargs or {}))

    micro = [_inputs(T=16, seed=s) for s in range(3)]
    weight = micro[0][1].clone().requires_grad_()
    acc = HeadGradAccumulator()
    acc.begin_step()
    with CountWeightCasts(weight) as counter:
        for k, (hidden, _, labels) in enumerate(micro):
            h = hidden.to(torch.bfloat16).requires_grad_()
            total, _ = linear_cross_entropy_segments([h], weight, [labels], [1.0], head_grad=acc.micro_batch(k, 3))
            assert (acc.weight_copy_VH is None) == (k == 2)
            total.backward()
    assert counter.casts == 1
    assert weight.grad.dtype == torch.float32


def test_head_grad_accumulation_under_fsdp2_deferred_bf16_reduction():
    """FSDP2 over one rank with bf16 parameters and fp32 reduction, gradient sync at the last of three micro-batches
    (the one-GPU training setup, here on gloo): the root group holds a norm beside the head. FSDP2 keeps the earlier
    micro-batches' gradients in fp32 and reduces a group only if its gradients share one dtype; the head's gradient,
    handed at the second-to-last micro-batch, is among them (handed only at the last, it was bf16 beside the norm's
    fp32 sum: "FSDP reduce-scatter expects uniform gradient dtype", session 35). The result matches the same three
    micro-batches without the accumulator to bf16 rounding of the per-micro-batch gradients."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from llm_training.trainer.losses import HeadGradAccumulator

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.Linear(8, 8)
            self.head = nn.Parameter(torch.randn(16, 8, generator=torch.Generator().manual_seed(0)))

        def forward(self, x):
            return self.norm(x)

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(5, 8, generator=g), torch.randint(0, 16, (5,), generator=g)) for _ in range(3)]
        grads = []
        for accumulate in (False, True):
            torch.manual_seed(0)
            model = Root()
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            fully_shard(model, mesh=mesh, mp_policy=mp)
            acc = HeadGradAccumulator() if accumulate else None
            for k, (x, y) in enumerate(data):
                last = k == len(data) - 1
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last)
                head_grad = acc.micro_batch(k, len(data)) if acc else None
                total, _ = linear_cross_entropy_segments([model(x)], model.head, [y], [1.0], head_grad=head_grad)
                total.backward()
            assert model.head.grad.dtype == torch.float32
            grads.append(model.head.grad.full_tensor())
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-2, atol=1e-2)
    finally:
        if created:
            dist.destroy_process_group()


def test_head_grad_accumulator_rejects_an_upstream_gradient_other_than_one():
    """Each micro-batch's weight gradient is added into the sum unscaled, so a backward with another upstream
    gradient (e.g. loss * 0.5) would be silently wrong: it is refused."""
    from llm_training.trainer.losses import HeadGradAccumulator

    hidden, weight, labels = _inputs()
    weight.requires_grad_()
    total, _ = linear_cross_entropy_segments([hidden], weight, [labels], [1.0], head_grad=HeadGradAccumulator())
    with pytest.raises(RuntimeError, match="upstream gradient other than 1"):
        (total * 0.5).backward()


def test_head_grad_accumulator_names_a_sum_left_from_another_head():
    """A partial sum of another shape (a step that raised between micro-batches, then a different model) is an
    error that says how to avoid it, not a broadcast."""
    from llm_training.trainer.losses import HeadGradAccumulator

    acc = HeadGradAccumulator()
    hidden, weight, labels = _inputs()
    weight.requires_grad_()
    linear_cross_entropy_segments([hidden], weight, [labels], [1.0], head_grad=acc.micro_batch(0, 4))
    other = torch.randn(weight.shape[0] + 1, weight.shape[1], requires_grad=True)
    with pytest.raises(RuntimeError, match=r"call begin_step\(\) before each optimizer step"):
        linear_cross_entropy_segments([hidden], other, [labels.clamp(max=0)], [1.0], head_grad=acc.micro_batch(1, 4))
    acc.begin_step()
    linear_cross_entropy_segments([hidden], other, [labels.clamp(max=0)], [1.0], head_grad=acc.micro_batch(1, 4))


def _bf16_accumulated_case(device):
    """Three bf16 micro-batches through a `HeadGradAccumulator` (on CUDA: each chunk's bf16 GEMM accumulating
    into the step's fp32 buffer, the second micro-batch's into the first's): the head weight's gradient, rounded to
    bf16 twice (the sum of the first two, the last), is as close to the fp64 reference of the three summed losses as one micro-batch's is to its own (the bound of
    `_bf16_case`)."""
    from llm_training.trainer.losses import HeadGradAccumulator

    micro = [_inputs(T=150, H=64, V=5000, seed=s) for s in range(3)]
    w = micro[0][1].to(device, torch.bfloat16).requires_grad_()
    w64 = w.detach().double().cpu().requires_grad_()
    acc = HeadGradAccumulator()
    acc.begin_step()
    for k, (hidden, _, labels) in enumerate(micro):
        h = hidden.to(device, torch.bfloat16)
        total, _ = linear_cross_entropy_segments(
            [h], w, [labels.to(device)], [1.0], chunk_tokens=128, head_grad=acc.micro_batch(k, 3)
        )
        total.backward()
        _reference_ce_sum(h.double().cpu(), w64, labels).backward()
    assert w.grad.dtype == torch.bfloat16 and _rel_err(w.grad, w64.grad) < 2e-2


def test_bf16_head_grad_accumulation_close_to_fp64_reference_cpu():
    _bf16_accumulated_case("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_head_grad_accumulation_close_to_fp64_reference_cuda():
    _bf16_accumulated_case("cuda")


def _packed_micro_batch(vocab: int, num_mtp: int):
    """A CPU micro-batch of two rows packing 3 and 2 documents (the data loader's dict, prepared)."""
    from llm_training.motif.mtp import mtp_inputs
    from llm_training.trainer.batch import prepare_batch

    g = torch.Generator().manual_seed(0)
    docs = torch.tensor([[0] * 10 + [1] * 12 + [2] * 10, [3] * 20 + [4] * 12])
    position_ids = torch.cat([torch.arange((row == d).sum()) for row in docs for d in row.unique()]).view(2, 32)
    ids = torch.randint(0, vocab, (2, 32), generator=g)
    raw = {"input_ids": ids, "labels": ids.roll(-1, 1), "position_ids": position_ids, "document_ids": docs}
    return prepare_batch(raw, num_mtp, mtp_inputs)


def test_forward_loss_hands_the_model_the_documents_cu_seqlens_computed_on_the_host(monkeypatch):
    """forward_loss computes varlen attention's cu_seqlens from the host's document ids and the model's attention
    metadata takes them: on CUDA the device's ids would cost a host sync per micro-batch (torch.nonzero), which
    stalls the queue between micro-batches. The model, whose own computation is disabled here, gives the logits of
    a forward that computes them itself. flash-attn-4 is emulated on the CPU (tests/fa4_emulation.py)."""
    from llm_training.layers.attention import fa4
    from llm_training.motif import get_flavor
    from llm_training.motif.model import Motif3Model
    from llm_training.trainer.losses import forward_loss
    from tests.fa4_emulation import install_emulated_fa4

    install_emulated_fa4(monkeypatch)
    args = get_flavor("motif3_debug")
    torch.manual_seed(0)
    model = Motif3Model(args, attention_backend="fa4")
    model.init_weights()
    batch = _packed_micro_batch(args.vocab_size, len(model.mtp_layers))
    expected_cu = fa4.document_cu_seqlens(batch.document_ids)
    assert expected_cu.tolist() == [0, 10, 22, 32, 52, 64]
    with torch.no_grad():
        own = model(batch.input_ids, batch.position_ids, batch.document_ids, batch.mtp_input_ids)

    handed = []
    real_forward = model.forward

    def forward(*a, **kw):
        handed.append(kw["attention_cu_seqlens"])
        return real_forward(*a, **kw)

    def no_device_cu_seqlens(document_ids_BS):
        raise AssertionError("the model computed cu_seqlens from its own ids")

    monkeypatch.setattr(model, "forward", forward)
    monkeypatch.setattr(fa4, "document_cu_seqlens", no_device_cu_seqlens)  # what the metadata would call
    normalisers = count_labelled_tokens(batch.targets())
    with torch.no_grad():
        out, loss = forward_loss(
            model, lambda m: m.lm_head.weight, batch, None, torch.device("cpu"), normalisers, 0.3, 0.0
        )
    assert len(handed) == 1 and handed[0].tolist() == expected_cu.tolist()
    assert torch.isfinite(loss.total)
    torch.testing.assert_close(out.hidden, own.hidden, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_micro_batch_moves_and_its_attention_metadata_wait_for_nothing_on_cuda():
    """On CUDA the micro-batch's move (pinned, non-blocking) and its varlen metadata from host-computed cu_seqlens
    make no synchronizing call (torch's sync debug mode "error" raises on one), so the host queues the next
    micro-batch while the device still runs the last one's backward. The device's own cu_seqlens would sync."""
    from llm_training.distributed.utils import to_device_async
    from llm_training.layers.attention.backends import build_attention_metadata
    from llm_training.layers.attention.fa4 import document_cu_seqlens

    device = torch.device("cuda")
    batch = _packed_micro_batch(1000, 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moved = batch.map(lambda x: to_device_async(x, device))
        cu = to_device_async(document_cu_seqlens(batch.document_ids), device)
        meta = build_attention_metadata("fa4", moved.document_ids, [None, 8], 2, 32, device, cu_seqlens=cu)
        with pytest.raises(RuntimeError, match="synchroniz"):
            build_attention_metadata("fa4", moved.document_ids, [None, 8], 2, 32, device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert meta.cu_seqlens is cu and cu.tolist() == [0, 10, 22, 32, 52, 64]
    assert torch.equal(moved.input_ids.cpu(), batch.input_ids) and moved.mtp_labels[0].device.type == "cuda"
