"""QK-clip's max-logit kernel (`layers.max_logits_kernels`) against the float64 per-query loop of test_attention:
causal, sliding windows, packed documents (a document starting inside a key block, one row without documents),
GQA, head dims that are not a multiple of the kernel's 64-column dots, lengths that are not a multiple of its
blocks; bf16 and fp32 inputs. On CUDA, or on the CPU under the Triton interpreter (tests/triton_kernels.py).
`document_starts`, the kernel's key-range bound, is pure torch and runs everywhere."""

import pytest
import torch

from llm_training.layers.attention.masks import attention_max_logits, document_starts
from tests.layers.attention.test_attention import loop_attention
from tests.triton_kernels import KERNEL_DEVICE, needs_triton_kernels


def test_document_starts():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5], [1, 2, 2, 1, 1, 1, 3, 3]])
    assert document_starts(docs).tolist() == [
        [0, 0, 0, 3, 3, 5, 5, 5],
        [0] * 8,
        [0, 1, 1, 3, 3, 3, 6, 6],  # an id that returns later is a new document (contiguous runs)
    ]
    assert document_starts(docs).dtype == torch.int32


CASES = [  # (B, S, Hq, Hkv, D)
    (2, 45, 4, 2, 24),  # S not a multiple of the 16-row blocks below, GQA 2
    (1, 70, 2, 1, 192),  # the GDLA head dim: three 64-column dots
    (2, 33, 3, 3, 5),  # a head dim under the dot's 16
]


def _docs(B, S):
    """Row 0: documents of 7, 20 and the rest (starts inside 16-key blocks); the others one document each."""
    docs = torch.zeros(B, S, dtype=torch.long)
    docs[0, 7:27] = 1
    docs[0, 27:] = 2
    return docs


def _run_kernel(q, k, scale, window, docs, **tiling):
    """The kernel on KERNEL_DEVICE (document starts derived as attention_masks does), its result on the CPU."""
    from llm_training.layers.attention.max_logits_kernels import max_logits

    dev = KERNEL_DEVICE
    docs = None if docs is None else docs.to(dev)
    starts = None if docs is None else document_starts(docs)
    return max_logits(
        q.to(dev), k.to(dev), scale=scale, window=window, document_ids=docs, document_starts=starts, **tiling
    ).cpu()


@pytest.mark.gpu
@needs_triton_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window", [None, 5, 20])
@pytest.mark.parametrize("with_docs", [False, True])
def test_kernel_matches_loop(case, window, with_docs, dtype):
    B, S, Hq, Hkv, D = case
    g = torch.Generator().manual_seed(sum(case))
    q = torch.randn(B, S, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, S, Hkv, D, generator=g).to(dtype)
    docs = _docs(B, S) if with_docs else None
    _, want = loop_attention(q.double(), k.double(), k[..., :1].double(), 0.3, window, docs)
    got = _run_kernel(q, k, 0.3, window, docs, block_m=16, block_n=16)
    assert got.dtype == torch.float32 and got.shape == (Hq,)
    # inputs exact in bf16 / fp32; fp32 accumulation over D terms (tf32 is not used: fp32 inputs take ieee dots)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@needs_triton_kernels
@pytest.mark.parametrize("window", [64, None])
def test_default_tilings_and_transposed_inputs(window):
    """The default tilings (64 x 64 for windows, 128 x 128 for full causal), and q / k given as non-contiguous
    views (as attention hands them over)."""
    g = torch.Generator().manual_seed(3)
    B, S, Hq, Hkv, D = 1, 150, 4, 2, 32
    q_BHSD = torch.randn(B, Hq, S, D, generator=g)
    k_BHSD = torch.randn(B, Hkv, S, D, generator=g)
    q, k = q_BHSD.transpose(1, 2), k_BHSD.transpose(1, 2)  # [B, S, H, D] views
    docs = torch.zeros(B, S, dtype=torch.long)
    docs[0, 90:] = 1
    _, want = loop_attention(q.double(), k.double(), k[..., :1].double(), 0.125, window, docs)
    assert not q.is_contiguous()
    got = _run_kernel(q, k, 0.125, window, docs)  # .to() keeps the strides
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the dispatch to the kernel is on CUDA")
def test_dispatch_on_cuda_compiles_and_matches_chunked_pass():
    """attention_max_logits on CUDA runs the kernel as a custom op: inside torch.compile (fullgraph) it gives the
    torch-ops side pass's value."""
    from llm_training.layers.attention.masks import chunked_max_logits

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 256, 8, 192, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 256, 2, 192, generator=g, device="cuda", dtype=torch.bfloat16)
    docs = torch.zeros(2, 256, dtype=torch.long, device="cuda")
    docs[1, 100:] = 1
    fn = torch.compile(
        lambda q, k, d: attention_max_logits(q, k, scale=0.07, window=128, document_ids=d), fullgraph=True
    )
    want = chunked_max_logits(q.float(), k.float(), scale=0.07, window=128, document_ids=docs)
    torch.testing.assert_close(fn(q, k, docs), want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@needs_triton_kernels
def test_custom_op_computes_document_starts_and_matches_loop():
    """The custom op attention_max_logits dispatches to on CUDA (here called directly, so it also runs under the
    interpreter): it derives the document starts itself."""
    from llm_training.layers.attention.masks import _max_logits_op, window_tensor

    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 45, 4, 24, generator=g).to(torch.bfloat16)
    k = torch.randn(2, 45, 2, 24, generator=g).to(torch.bfloat16)
    docs = _docs(2, 45)
    _, want = loop_attention(q.double(), k.double(), k[..., :1].double(), 0.3, 20, docs)
    dev = KERNEL_DEVICE
    got = _max_logits_op(q.to(dev), k.to(dev), docs.to(dev), 0.3, window_tensor(20))
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@needs_triton_kernels
def test_head_offsets_past_two_to_the_31():
    """Head-major views (head stride S x D) put the last heads past 2^31 elements at 256K tokens: the kernel's
    offsets are 64-bit. Built as strided views over a small buffer whose heads lie 1.1e9 elements apart."""
    from llm_training.layers.attention.max_logits_kernels import max_logits

    if KERNEL_DEVICE == "cuda":
        pytest.skip("the view spans ~4.4 GB of address space; the interpreter reads only the touched elements")
    g = torch.Generator().manual_seed(5)
    S, H, D, step = 16, 3, 16, 1_100_000_000  # head h at offset h * step: 2.2e9 for h = 2
    dense = torch.randn(H, S, D, generator=g).to(torch.bfloat16)
    want = torch.stack(
        [
            (dense[h].float() @ dense[h].float().T * 0.2)
            .masked_fill(torch.ones(S, S).triu(1).bool(), float("-inf"))
            .max()
            for h in range(H)
        ]
    )
    storage = torch.empty(2 * step + S * D, dtype=torch.bfloat16)  # untouched pages stay unallocated
    for h in range(H):
        storage[h * step : h * step + S * D] = dense[h].reshape(-1)
    q = storage.as_strided((1, S, H, D), (0, D, step, 1))
    got = max_logits(q, q, scale=0.2, window=None, document_ids=None, block_m=16, block_n=16)
    torch.testing.assert_close(got, want)


@pytest.mark.gpu
@needs_triton_kernels
@pytest.mark.parametrize("edge", ["diagonal", "window", "document"])
@pytest.mark.parametrize("i", [30, 32])  # the visible pair inside one 16-key block, or across a block edge
def test_the_edge_pair_counts_and_the_pair_beyond_it_does_not(edge, i):
    """One large visible logit exactly at an edge of the visible range and larger ones just past it: the max is
    the edge pair's (a random-data max would hide a dropped edge pair or an extra pair beyond it)."""

    S, D, W = 48, 16, 5
    g = torch.Generator().manual_seed(i)
    q = torch.randn(1, S, 1, D, generator=g) * 0.01
    k = torch.randn(1, S, 1, D, generator=g) * 0.01
    e = torch.zeros(D)
    e[0] = 1.0
    q[0, i, 0] = 10 * e
    j_edge, j_beyond = {"diagonal": (i, i + 1), "window": (i - W, i - W - 1), "document": (i - 3, i - 4)}[edge]
    k[0, j_edge, 0] = 3 * e  # logit 30, visible
    k[0, j_beyond, 0] = 5 * e  # logit 50, not visible from row i (other rows see it at ~0.05 x 5)
    window = W if edge == "window" else None
    docs = None
    if edge == "document":
        docs = torch.zeros(1, S, dtype=torch.long)
        docs[0, i - 3 :] = 1  # row i's document starts at its edge key
    got = _run_kernel(q, k, 0.5, window, docs, block_m=16, block_n=16)
    torch.testing.assert_close(got, torch.tensor([15.0]), atol=1e-3, rtol=1e-4)


@pytest.mark.gpu  # needs triton, which the GPU suite always has
def test_the_prebuild_hands_over_one_build_per_window(triton_prebuild_stub):
    """`prebuild_max_logits_kernels` (the trainer's call at start-up) gives the workers one build per distinct
    (heads, head dim, window), each for the training shape, and the workers build them (for the stub's SM90 target
    without a GPU); nothing is built in this process, and a second call adds nothing."""
    from types import SimpleNamespace

    from llm_training.layers.attention.masks import prebuild_max_logits_kernels

    pb, events = triton_prebuild_stub
    kinds = [SimpleNamespace(n_heads=6, n_kv_heads=2, d_qk=160, window=w) for w in (None, 96, None)]
    prebuild_max_logits_kernels(kinds, 2, 384, torch.bfloat16)
    prebuild_max_logits_kernels(kinds[:1], 2, 384, torch.bfloat16)
    assert [name for _module, name, _key in pb.futures] == ["_max_logits_kernel"] * 2 and pb.skipped == []
    assert all(seconds > 0 for _name, seconds in pb.wait(timeout=300)) and events == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares with a real launch on CUDA")
def test_the_prebuilt_kernels_serve_the_launches_of_training(triton_prebuild_stub):
    """`prebuild_max_logits_kernels` hands the workers one build per distinct (heads, head dim, window) of the
    attention kinds; the launches attention then makes at that shape (q and k as GDLA builds them, a concat of
    the no-rope and rope parts; packed documents; the window in its tensor form) load those builds: no build in
    this process, nothing launched that the prebuild did not predict."""
    from types import SimpleNamespace

    from llm_training.layers.attention.masks import prebuild_max_logits_kernels, window_tensor

    pb, events = triton_prebuild_stub
    B, S, Hq, Hkv, d_nope, d_rope = 2, 384, 6, 2, 128, 32  # a shape no other test here builds
    kinds = [SimpleNamespace(n_heads=Hq, n_kv_heads=Hkv, d_qk=d_nope + d_rope, window=w) for w in (None, 96, None)]
    prebuild_max_logits_kernels(kinds, B, S, torch.bfloat16)
    assert [name for _module, name, _key in pb.futures] == ["_max_logits_kernel"] * 2 and pb.skipped == []
    assert all(seconds > 0 for _name, seconds in pb.wait(timeout=300)) and events == []
    g = torch.Generator(device="cuda").manual_seed(3)
    parts = [torch.randn(B, S, h, d, generator=g, device="cuda", dtype=torch.bfloat16) for h in (Hq, Hkv)
             for d in (d_nope, d_rope)]  # fmt: skip
    q, k = torch.cat(parts[:2], dim=-1), torch.cat(parts[2:], dim=-1)
    docs = (torch.arange(S, device="cuda") >= 200).long() + 2 * torch.arange(B, device="cuda")[:, None]
    for window in (None, 96):
        attention_max_logits(q, k, scale=0.1, window=window_tensor(window), document_ids=docs)
    torch.cuda.synchronize()
    assert events == ["hit", "hit"] and pb.unpredicted == [], (events, pb.unpredicted)
