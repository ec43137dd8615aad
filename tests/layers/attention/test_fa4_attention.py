"""The flash-attn-4 backend: registry / `auto` selection, cu_seqlens from document ids, the errors without CUDA
or the package; the call glue (flattening, window convention, GQA layouts, lse layout) against an fp32
emulation of `flash_attn.cute` on CPU; and, on CUDA with flash-attn-4 installed, values and gradients vs the
reference backend."""

import sys
import types

import pytest
import torch

from llm_training.distributed.compile import compile_stats, reset_compile_stats
from llm_training.layers.attention import fa4
from llm_training.layers.attention.backends import (
    ATTENTION_BACKENDS,
    AttentionMetadata,
    build_attention_metadata,
    get_attention_backend,
    reference_attention,
    visibility_mask,
)
from tests.fa4_emulation import install_emulated_fa4


def _doc_ids(B, S, cuts):
    pos = torch.arange(S)
    ids = torch.zeros(S, dtype=torch.int32)
    for c in cuts:
        ids += (pos >= c).int()
    return ids.expand(B, S).contiguous()


# ------------------------------------------------------------------------ CPU: registry, metadata, errors
def test_fa4_is_registered_and_reads_cu_seqlens_only_with_documents():
    spec = get_attention_backend("fa4")
    cpu = torch.device("cpu")
    assert "fa4" in ATTENTION_BACKENDS
    assert spec.uses_varlen(True, cpu) and not spec.uses_varlen(False, cpu)
    assert not spec.uses_flex(128, True, cpu)


def test_document_cu_seqlens_match_document_ids():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 7, 7], [3, 3, 3, 3, 3, 3, 3, 3]])
    cu = fa4.document_cu_seqlens(ids)
    assert cu.dtype == torch.int32
    # row boundaries are document boundaries even when the id carries over (row 1 ends in 7, row 2 starts at 3;
    # an equal id across rows must split too)
    assert cu.tolist() == [0, 3, 5, 8, 14, 16, 24]
    same_id_rows = torch.zeros(2, 4, dtype=torch.int64)
    assert fa4.document_cu_seqlens(same_id_rows).tolist() == [0, 4, 8]
    # every flattened token lies in exactly the document its id says
    flat = ids.reshape(-1)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        assert (flat[a:b] == flat[a]).all()


def test_build_attention_metadata_for_fa4():
    docs = _doc_ids(2, 12, [5])
    meta = build_attention_metadata("fa4", docs, [None, 4], 2, 12, torch.device("cpu"))
    assert meta.flex_block_masks == {} and meta.cu_seqlens.tolist() == [0, 5, 12, 17, 24] and meta.max_seqlen == 12
    plain = build_attention_metadata("fa4", None, [None, 4], 2, 12, torch.device("cpu"))
    assert plain.cu_seqlens is None and plain.max_seqlen is None
    # cu_seqlens the caller computed on the host are taken as they are; a backend without varlen drops them
    host = fa4.document_cu_seqlens(docs)
    assert build_attention_metadata("fa4", docs, [None], 2, 12, "cpu", cu_seqlens=host).cu_seqlens is host
    assert build_attention_metadata("sdpa", docs, [None], 2, 12, "cpu", cu_seqlens=host).cu_seqlens is None


def test_auto_never_picks_fa4_on_cpu():
    docs = _doc_ids(1, 12, [5])
    meta = build_attention_metadata("auto", docs, [None, 3], 1, 12, torch.device("cpu"))
    assert not meta.auto_picks_fa4 and meta.cu_seqlens is None
    assert fa4.fa4_unavailable_reason("cpu") == "flash-attn-4 needs a CUDA device, got cpu"


def test_fa4_kernel_without_cuda_names_the_alternative():
    q = torch.randn(1, 8, 4, 16, dtype=torch.bfloat16)
    k = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
    v = torch.randn(1, 8, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="attention = 'auto' or 'flex'"):
        get_attention_backend("fa4").kernel(
            q, k, v, scale=0.25, window=None, metadata=AttentionMetadata(), record_max_logits=False
        )


def test_fa4_rejects_fp32(monkeypatch):
    monkeypatch.setattr(fa4, "fa4_unavailable_reason", lambda device: None)
    with pytest.raises(RuntimeError, match="bf16 / fp16 only"):
        fa4._check_inputs(torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8))


def test_config_accepts_fa4_and_the_environment_check_names_the_alternative():
    from llm_training.config import ConfigError, ConfigManager, validate_environment

    c = ConfigManager().parse_args(["--kernels.attention=fa4", "--training.device=cpu"])
    assert c.kernels.attention == "fa4"
    with pytest.raises(ConfigError, match="attention = 'fa4': flash-attn-4 needs a CUDA device.*'auto'"):
        validate_environment(c)


@pytest.fixture
def emulated_fa4(monkeypatch):
    install_emulated_fa4(monkeypatch)


def _reference_lse(q, k, scale, window, docs):
    Hq = q.shape[2]
    kf = k.float().repeat_interleave(Hq // k.shape[2], 2)
    logits = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * scale
    mask = visibility_mask(range(q.shape[1]), range(q.shape[1]), q.device, window=window, document_ids_BS=docs)
    return torch.logsumexp(logits.masked_fill(~mask, float("-inf")), dim=-1)


@pytest.mark.parametrize("layout", fa4.GQA_LAYOUTS)
@pytest.mark.parametrize("window,docs", [(None, False), (3, False), (None, True), (3, True)])
def test_fa4_glue_matches_reference_on_emulation(emulated_fa4, layout, window, docs):
    torch.manual_seed(0)
    B, S, Hq, Hkv = 2, 11, 6, 2
    q, k = torch.randn(B, S, Hq, 12, dtype=torch.float64), torch.randn(B, S, Hkv, 12, dtype=torch.float64)
    v = torch.randn(B, S, Hkv, 8, dtype=torch.float64)
    doc_ids = _doc_ids(B, S, [4, 9]) if docs else None
    meta = build_attention_metadata("fa4", doc_ids, [window], B, S, q.device)
    out, lse = fa4.fa4_attention_lse(q, k, v, scale=0.3, window=window, metadata=meta, gqa_layout=layout)
    ref, _ = reference_attention(q, k, v, scale=0.3, window=window, metadata=meta, record_max_logits=False)
    assert out.shape == (B, S, Hq, 8) and lse.shape == (B, Hq, S)
    tol = {"atol": 1e-5, "rtol": 1e-5}  # the reference and the emulation both compute in fp32
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(lse.float(), _reference_lse(q, k, 0.3, window, doc_ids), **tol)
    got, mx = get_attention_backend("fa4").kernel(
        q, k, v, scale=0.3, window=window, metadata=meta, record_max_logits=True
    )
    _, ref_mx = reference_attention(q, k, v, scale=0.3, window=window, metadata=meta, record_max_logits=True)
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(mx, ref_mx.float(), **tol)


@pytest.mark.parametrize("docs", [False, True])
def test_fa4_is_one_node_of_the_compiled_graph(emulated_fa4, docs):
    """Under torch.compile (fullgraph: no graph break allowed), flash-attn-4's kernels are opaque custom ops, called
    with real tensors at run time, never traced (dynamo in flash_attn.cute's Python broke the graph 49 times per
    step on the H200); the compiled attention, its max logits and its gradients equal eager's, and the backward
    gets no lse gradient when lse is unused (FA4's backward without the dlse term)."""
    from flash_attn.cute import interface

    calls = {"fwd": [], "bwd": []}  # per kernel call: (torch.compiler.is_compiling(), dlse given)
    inner_fwd, inner_bwd = interface._flash_attn_fwd, interface._flash_attn_bwd

    def spy_fwd(*args, **kwargs):
        calls["fwd"].append((torch.compiler.is_compiling(), None))
        return inner_fwd(*args, **kwargs)

    def spy_bwd(*args, **kwargs):
        calls["bwd"].append((torch.compiler.is_compiling(), kwargs.get("dlse") is not None))
        return inner_bwd(*args, **kwargs)

    interface._flash_attn_fwd, interface._flash_attn_bwd = spy_fwd, spy_bwd
    torch.manual_seed(2)
    B, S, Hq, Hkv = 2, 9, 4, 2
    leaves = [
        torch.randn(B, S, h, d, dtype=torch.float64, requires_grad=True) for h, d in ((Hq, 12), (Hkv, 12), (Hkv, 8))
    ]
    meta = build_attention_metadata("fa4", _doc_ids(B, S, [5]) if docs else None, [3], B, S, "cpu")

    def attention(q, k, v):
        out, mx = get_attention_backend("fa4").kernel(
            q, k, v, scale=0.3, window=3, metadata=meta, record_max_logits=True
        )
        return out.sin(), mx  # an op after the kernel, in the same graph

    want, want_mx = attention(*leaves)
    want_grads = torch.autograd.grad(want.square().sum(), leaves)
    reset_compile_stats()
    got, got_mx = torch.compile(attention, backend="aot_eager", fullgraph=True)(*leaves)
    got_grads = torch.autograd.grad(got.square().sum(), leaves)
    stats = compile_stats()
    reset_compile_stats()
    assert stats["unique_graphs"] == 1 and stats["graph_breaks"] == 0, stats
    assert calls == {"fwd": [(False, None)] * 2, "bwd": [(False, False)] * 2}, calls
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_mx, want_mx)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("mode,forward_calls", [("selective", 1), ("full", 2)])
def test_selective_checkpointing_keeps_the_fa4_output(emulated_fa4, mode, forward_calls, compiled):
    """Selective activation checkpointing keeps flash-attn-4's output, as it keeps the other attention kernels' (its
    forward runs once); full recomputes it in the backward (twice). Eager and compiled alike."""
    from flash_attn.cute import interface

    from llm_training.distributed.activation_checkpoint import apply_ac

    calls = []
    inner = interface._flash_attn_fwd
    interface._flash_attn_fwd = lambda *a, **kw: calls.append(1) or inner(*a, **kw)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(8, 4 * 6 + 2 * 6 + 2 * 4, dtype=torch.float64)

        def forward(self, x_BSH):
            B, S, _ = x_BSH.shape
            q, k, v = self.qkv(x_BSH).split([24, 12, 8], dim=-1)
            out, _ = fa4.fa4_attention(
                q.view(B, S, 4, 6), k.view(B, S, 2, 6), v.reshape(B, S, 2, 4), scale=0.4, window=None,
                metadata=AttentionMetadata(), record_max_logits=False,
            )  # fmt: skip
            return out.sin().sum()

    block = Block()
    apply_ac([block], mode)
    if compiled:
        block.compile(backend="aot_eager", fullgraph=True)
    block(torch.randn(2, 5, 8, dtype=torch.float64)).backward()
    torch._dynamo.reset()
    assert len(calls) == forward_calls


def test_fa4_custom_ops_pass_opcheck(emulated_fa4):
    """The schema, fake (meta) functions and autograd registration of llm_training::fa4_fwd / fa4_bwd agree with
    their kernels (torch.library.opcheck), dense and varlen."""
    from llm_training.layers.attention.masks import window_tensor

    torch.manual_seed(4)
    q = torch.randn(2, 6, 4, 12, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 6, 2, 12, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 6, 2, 8, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 4, 6, 12], dtype=torch.int32)
    full, window = window_tensor(None), window_tensor(3)  # the ops take the window's tensor form
    no_keep, keep = fa4.keep_slot_tensor(None), fa4.keep_slot_tensor(7)  # and the keep slot's
    cases = [
        (q, k, v, None, None, 0.3, full, 2, no_keep),
        (q, k, v, None, None, 0.3, full, 2, keep),
        (q, k, v, None, None, 0.3, window, 2, no_keep),
        (*(x.detach().reshape(12, x.shape[2], -1).requires_grad_() for x in (q, k, v)), cu, 6, 0.3, window, 2, keep),
    ]
    for args in cases:
        torch.library.opcheck(torch.ops.llm_training.fa4_fwd.default, args)
        out, lse = torch.ops.llm_training.fa4_fwd(*args)
        dout, dlse = torch.randn_like(out), torch.randn_like(lse)
        plain = [x.detach() for x in args[:3]]
        bwd_args = (dout, dlse, *plain, out.detach(), lse.detach(), *args[3:-1])
        torch.library.opcheck(torch.ops.llm_training.fa4_bwd.default, bwd_args)
    fa4._KEPT.clear()  # the keep cases' forwards stored results no recompute takes


def test_fa4_layouts_give_the_emulated_kernel_a_differentiable_case(emulated_fa4):
    """GQA with qk != v head dims reaches FA4 either as MHA (expand_kv) or with equal head dims (pad_v); both
    back-propagate to the GQA-shaped inputs like the reference."""
    torch.manual_seed(1)
    q = torch.randn(1, 7, 4, 12, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 7, 2, 12, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 7, 2, 8, dtype=torch.float64, requires_grad=True)
    meta = AttentionMetadata()
    ref, _ = reference_attention(q, k, v, scale=0.3, window=2, metadata=meta, record_max_logits=False)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for layout in fa4.GQA_LAYOUTS:
        out, _ = fa4.fa4_attention_lse(q, k, v, scale=0.3, window=2, metadata=meta, gqa_layout=layout)
        for a, b in zip(torch.autograd.grad(out.square().sum(), (q, k, v)), ref_grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unknown FA4 GQA layout"):
        fa4.fa4_attention_lse(q, k, v, scale=0.3, window=2, metadata=meta, gqa_layout="nope")


@pytest.mark.parametrize("docs", [False, True])
def test_expand_kv_saves_the_kv_heads_only_and_differentiates_out_and_lse(emulated_fa4, docs):
    """expand_kv: the forward kernel gets the KV-head K/V as they are (FA4's forward does GQA at unequal head
    dims) and only the backward's kernel call gets them repeated to the query heads; what autograd keeps for the
    backward is the KV-head K/V (never a [.., Hq, D] copy), and the gradients through out and lse match the
    reference's."""
    torch.manual_seed(3)
    B, S, Hq, Hkv = 2, 10, 6, 2
    leaves = [
        torch.randn(B, S, h, d, dtype=torch.float64, requires_grad=True) for h, d in ((Hq, 12), (Hkv, 12), (Hkv, 8))
    ]
    doc_ids = _doc_ids(B, S, [6]) if docs else None
    meta = build_attention_metadata("fa4", doc_ids, [None], B, S, "cpu")
    interface = sys.modules["flash_attn.cute.interface"]
    kernel_kv_heads = {}  # pass -> (K heads, V heads) the kernel was called with

    def spy(name, kernel):
        def call(q, k, v, *args, **kwargs):
            kernel_kv_heads[name] = (k.shape[-2], v.shape[-2])
            return kernel(q, k, v, *args, **kwargs)

        return call

    interface._flash_attn_fwd = spy("forward", interface._flash_attn_fwd)
    interface._flash_attn_bwd = spy("backward", interface._flash_attn_bwd)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out, lse = fa4.fa4_attention_lse(*leaves, scale=0.3, window=None, metadata=meta, gqa_layout="expand_kv")
    heads_and_dim = [shape[-2:] for shape in saved]
    assert heads_and_dim.count((Hkv, 12)) == 1 and heads_and_dim.count((Hkv, 8)) == 1  # k and v as given
    assert heads_and_dim.count((Hq, 12)) == 1 and heads_and_dim.count((Hq, 8)) == 1  # q and out: no repeated k, v
    q, k, v = leaves
    got = torch.autograd.grad(out.square().sum() + lse.sin().sum(), leaves)
    assert kernel_kv_heads == {"forward": (Hkv, Hkv), "backward": (Hq, Hq)}
    ref_out, _ = reference_attention(q, k, v, scale=0.3, window=None, metadata=meta, record_max_logits=False)
    ref_lse = _reference_lse(q, k, 0.3, None, doc_ids)
    want = torch.autograd.grad(ref_out.square().sum() + ref_lse.sin().sum(), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_motif3_model_on_the_fa4_backend_matches_the_reference_backend(emulated_fa4):
    """The whole model (sliding + full layers, packed documents, MTP, max logits) with attention_backend fa4
    through the emulated kernel: the metadata's cu_seqlens reach every layer and the outputs are the
    reference backend's."""
    from llm_training.motif import get_flavor
    from llm_training.motif.model import Motif3Model

    torch.manual_seed(0)
    a = get_flavor("motif3_debug")
    models = {name: Motif3Model(a, attention_backend=name) for name in ("fa4", "reference")}
    models["fa4"].init_weights()
    models["reference"].load_state_dict(models["fa4"].state_dict())
    B, S = 2, 40
    ids = torch.randint(0, a.vocab_size, (B, S))
    docs = _doc_ids(B, S, [13, 29])
    pos = torch.cat([torch.arange(13), torch.arange(16), torch.arange(11)]).expand(B, S)
    outs = {}
    for name, model in models.items():
        model.set_record_max_logits(True)
        outs[name] = model(ids, position_ids=pos, document_ids=docs)
    got, want = outs["fa4"], outs["reference"]
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.mtp_logits[0], want.mtp_logits[0], atol=1e-4, rtol=1e-4)
    for g, w in zip(got.max_logits, want.max_logits):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------ GPU: the real kernel
def _require_fa4():
    reason = fa4.fa4_unavailable_reason("cuda")
    if reason is not None:
        pytest.skip(reason)


def _gdla_like(B, S, Hq, Hkv, requires_grad=True, seed=0):
    torch.manual_seed(seed)
    make = lambda h, d: torch.randn(B, S, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad)  # noqa: E731
    return make(Hq, 192), make(Hkv, 192), make(Hkv, 128)


@pytest.mark.parametrize("layout", fa4.GQA_LAYOUTS)
@pytest.mark.parametrize("window,docs", [(None, False), (128, False), (None, True), (128, True)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fa4_matches_reference_bf16(layout, window, docs):
    _require_fa4()
    B, S, Hq, Hkv = 2, 1024, 10, 2
    q, k, v = _gdla_like(B, S, Hq, Hkv)
    doc_ids = _doc_ids(B, S, [300, 700]).cuda() if docs else None
    meta = build_attention_metadata("fa4", doc_ids, [window], B, S, q.device)
    out, lse = fa4.fa4_attention_lse(q, k, v, scale=192**-0.5, window=window, metadata=meta, gqa_layout=layout)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref, _ = reference_attention(q, k, v, scale=192**-0.5, window=window, metadata=meta, record_max_logits=False)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(
        lse, _reference_lse(q.detach(), k.detach(), 192**-0.5, window, doc_ids), atol=2e-2, rtol=1e-3
    )
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fa4_backend_and_auto_on_gpu_with_max_logits():
    _require_fa4()
    B, S = 1, 512
    q, k, v = _gdla_like(B, S, 10, 2, requires_grad=False)
    doc_ids = _doc_ids(B, S, [200]).cuda()
    for name in ("fa4", "auto"):
        meta = build_attention_metadata(name, doc_ids, [128], B, S, q.device)
        assert meta.cu_seqlens is not None and meta.flex_block_masks == {}
        assert meta.auto_picks_fa4 == (name == "auto")
        out, mx = get_attention_backend(name).kernel(
            q, k, v, scale=0.1, window=128, metadata=meta, record_max_logits=True
        )
        ref, ref_mx = reference_attention(q, k, v, scale=0.1, window=128, metadata=meta, record_max_logits=True)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(mx, ref_mx, atol=5e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fa4_under_torch_compile():
    _require_fa4()
    q, k, v = _gdla_like(1, 512, 10, 2)
    meta = AttentionMetadata()

    def f(q, k, v):
        return fa4.fa4_attention(q, k, v, scale=0.1, window=128, metadata=meta, record_max_logits=False)[0]

    eager = f(q, k, v)
    eager_grads = torch.autograd.grad(eager.float().sum(), (q, k, v))
    compiled = torch.compile(f, fullgraph=True)(q, k, v)  # flash-attn-4 inside the graph: no graph break
    compiled_grads = torch.autograd.grad(compiled.float().sum(), (q, k, v))
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)


def test_auto_picks_fa4_only_for_head_dims_its_backward_compiles(monkeypatch):
    """flash-attn-4 b36's SM90 backward failed to compile for motif3_debug's qk 24 / v 16 on the H200: auto then
    takes its other kernels (no varlen cu_seqlens), and the fa4 backend names the dims and the alternative."""
    monkeypatch.setattr(fa4, "fa4_usable", lambda device: True)
    cuda = torch.device("cuda")  # only the device type is read: no mask or cu_seqlens is built for these cases
    picks = {
        dims: build_attention_metadata("auto", None, [None], 1, 8, cuda, dims).auto_picks_fa4
        for dims in [(24, 16), (192, 128), (24, 24), (64, 128), (32, 128), None]
    }
    assert picks == {(24, 16): False, (192, 128): True, (24, 24): True, (64, 128): True, (32, 128): False, None: True}
    monkeypatch.setattr(fa4, "fa4_unavailable_reason", lambda device: None)
    q, v = torch.zeros(1, 8, 10, 24, dtype=torch.bfloat16), torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"qk head dim 24 with v head dim 16.*attention = 'auto' or 'flex'"):
        fa4._check_inputs(q, v)


def test_auto_warns_once_when_flash_attn_4_is_missing_on_a_gpu_it_supports(monkeypatch, caplog):
    """An SM90 / SM100 GPU without an importable flash_attn.cute: backend auto runs FlexAttention / SDPA, and says
    so once per device (a machine without the wheel ran 256K tokens on FlexAttention without a word)."""
    from llm_training.layers.attention import backends

    monkeypatch.setattr(fa4, "fa4_usable", lambda device: False)
    monkeypatch.setattr(fa4, "fa4_missing_reason", lambda device: "ImportError: No module named 'flash_attn'")
    backends._warn_auto_without_fa4.cache_clear()
    cuda = torch.device("cuda")  # only the device type is read: no mask or cu_seqlens is built for this case
    with caplog.at_level("WARNING", logger=backends.__name__):
        for _ in range(3):
            assert not build_attention_metadata("auto", None, [None], 1, 8, cuda, (192, 128)).auto_picks_fa4
    warnings = [r.getMessage() for r in caplog.records if "flash-attn-4" in r.getMessage()]
    assert len(warnings) == 1 and "No module named 'flash_attn'" in warnings[0] and "FlexAttention" in warnings[0]
    backends._warn_auto_without_fa4.cache_clear()
    monkeypatch.setattr(fa4, "fa4_missing_reason", lambda device: None)  # another GPU, or the import works
    caplog.clear()
    build_attention_metadata("auto", None, [None], 1, 8, cuda, (192, 128))
    assert not caplog.records
    backends._warn_auto_without_fa4.cache_clear()


def test_missing_reason_is_none_off_the_gpus_flash_attn_4_supports(monkeypatch):
    assert fa4.fa4_missing_reason("cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert fa4.fa4_missing_reason("cuda") is None  # an A100: FA4 has no kernels for it, nothing is missing
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fa4, "fa4_import_error", lambda: "ImportError: x")
    assert fa4.fa4_missing_reason("cuda") == "ImportError: x"


def test_a_flash_attn_4_without_the_kernel_functions_counts_as_not_importable(monkeypatch):
    """fa4 calls flash_attn.cute.interface's forward / backward kernel functions: a flash-attn-4 that imports but
    lacks them (another version) is reported missing, so backend auto falls back instead of failing at the call."""
    package, cute, interface = (
        types.ModuleType(n) for n in ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface")
    )
    package.cute, cute.interface = cute, interface
    interface._flash_attn_fwd = lambda *a, **k: None  # the backward function is missing
    for name, module in (("flash_attn", package), ("flash_attn.cute", cute), ("flash_attn.cute.interface", interface)):
        monkeypatch.setitem(sys.modules, name, module)
    fa4.fa4_import_error.cache_clear()
    try:
        error = fa4.fa4_import_error()
    finally:
        fa4.fa4_import_error.cache_clear()
    assert error is not None and error.startswith("ImportError") and "_flash_attn_bwd" in error
    interface._flash_attn_bwd = lambda *a, **k: None
    try:
        assert fa4.fa4_import_error() is None
    finally:
        fa4.fa4_import_error.cache_clear()
