"""distributed/compile.py: regional compilation shares one graph among identical blocks, and the compiled model
computes the eager model's loss and gradients."""

import copy
import json
import os
import time

import pytest
import torch

from llm_training.distributed.compile import apply_compile, compile_progress, compile_stats, reset_compile_stats
from llm_training.motif import get_flavor
from llm_training.motif.model import Motif3Model
from llm_training.motif.parallelize import blocks

# layer 0 full attention, layers 1-3 sliding: two kinds of block, all dense, mHC on, no MTP
ARGS = get_flavor("motif3_debug").replace(
    num_hidden_layers=4, n_dense_first_layers=4, sliding_window_period=8, num_nextn_predict_layers=0
)


def _loss(model, ids):
    out = model(ids)
    return out.logits.float().logsumexp(-1).mean()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    reset_compile_stats()
    yield
    reset_compile_stats()


def test_identical_blocks_compile_once_and_match_eager():
    torch.manual_seed(0)
    eager = Motif3Model(ARGS)
    eager.init_weights()
    compiled = copy.deepcopy(eager)
    apply_compile(blocks(compiled), backend="aot_eager")
    ids = torch.randint(0, ARGS.vocab_size, (2, 32))
    for step in range(2):  # the second step must not compile anything new
        loss_c = _loss(compiled, ids)
        loss_c.backward()
        if step == 0:
            after_first = compile_stats()
    stats = compile_stats()
    assert stats["compiled_frames"] == after_first["compiled_frames"], stats
    # one compile per kind of block (full, sliding): the 3 sliding blocks share one graph, so the block forward
    # is compiled twice in all (1 recompile), not 4 times
    assert stats["compiled_frames"] == 2 and stats["recompiles"] == 1, stats
    assert stats["graph_breaks"] == 0, stats
    assert any("window" in r for r in stats["guard_failures"]), stats  # the full/sliding split is the reason
    loss_e = _loss(eager, ids)
    loss_e.backward()
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    for (name, p_c), (_, p_e) in zip(compiled.named_parameters(), eager.named_parameters(), strict=True):
        torch.testing.assert_close(p_c.grad / 2, p_e.grad, rtol=1e-4, atol=1e-6, msg=name)  # 2 steps of grads


@pytest.mark.parametrize("backend, mhc, graphs", [("auto", True, 7), ("fa4", True, 6), ("auto", False, 5)])
def test_sublayer_compile_shares_each_region_among_the_blocks_that_have_it(backend, mhc, graphs, monkeypatch):
    """apply_compile(sublayers=True): each block's `compile_regions()` compile apart, one graph per kind of region.
    With mHC those are the attention half and the feed-forward half's mHC-in, MLP / MoE and mHC-out steps, so
    motif3_proxy's pattern (full dense, sliding dense, sliding MoE x 2, + MTP, compiled whole) gives 2 attention +
    1 mHC-in + 2 feed-forward (dense, MoE) + 1 mHC-out + 1 MTP graphs: the mHC steps are one graph for dense and MoE
    blocks alike. The step matches eager. With flash-attn-4 (emulated here), whose ops read the window's tensor
    form when they run (`masks.window_tensor`), full and sliding attention are one half: one graph fewer; the int
    window of the other backends (auto is sdpa on the CPU) is a constant of the graph. Without mHC the regions are the
    two halves: 2 + 2 + 1 graphs. bf16 (CPU): the MoE's grouped GEMM traces only in bf16, as on the GPU; aot_eager
    runs the same ops, so the gap is bf16 rounding of reordered ops (measured 0 on the loss; bound: 2 bf16
    roundings, 2^-7)."""
    if backend == "fa4":
        from tests.fa4_emulation import install_emulated_fa4

        install_emulated_fa4(monkeypatch)
    args = get_flavor("motif3_debug").replace(num_hidden_layers=4, mhc_enabled=mhc)
    torch.manual_seed(0)
    eager = Motif3Model(args, attention_backend=backend)
    eager.init_weights()
    eager = eager.to(torch.bfloat16)
    halves = copy.deepcopy(eager)
    apply_compile(blocks(halves), backend="aot_eager", sublayers=True)
    regions = (
        ("attention_sublayer", "ffn_streams_in", "_ffn", "ffn_streams_out")
        if mhc
        else ("attention_sublayer", "ffn_sublayer")
    )
    assert all(b.compile_regions() == regions and all(r in vars(b) for r in regions) for b in halves.layers)
    assert "attention_sublayer" not in vars(halves.mtp_layers[0])  # MTP has no halves: compiled whole
    ids = torch.randint(0, args.vocab_size, (2, 32))
    losses = [_loss(m, ids) for m in (halves, eager)]
    for loss in losses:
        loss.backward()
    stats = compile_stats()
    assert stats["unique_graphs"] == graphs and stats["graph_breaks"] == 0, stats
    torch.testing.assert_close(losses[0], losses[1], rtol=2**-7, atol=0)
    grads = [
        torch.cat([p.grad.float().flatten() for p in m.parameters() if p.grad is not None]) for m in (halves, eager)
    ]
    assert ((grads[0] - grads[1]).norm() / grads[1].norm()).item() < 2**-7


@pytest.mark.parametrize("mode", ["full", "selective", "long_context"])
def test_checkpointed_blocks_compile_whole_with_flash_attn_4(mode, monkeypatch):
    """Under activation checkpointing every block still compiles as one graph per kind of block, with the fa4
    backend too (emulated here) and on the steps that record max logits for QK-clip. A graph break inside a
    checkpointed region makes dynamo skip the whole block: before fa4 became a custom op and the max logits a
    block output instead of a module attribute (a side effect), every run with compile, full / long_context AC,
    fa4 (the H200 and B200) and QK-clip on ran its blocks eagerly. Loss, gradients and max logits equal the eager
    model's."""
    from llm_training.distributed.activation_checkpoint import apply_ac
    from tests.fa4_emulation import install_emulated_fa4

    install_emulated_fa4(monkeypatch)
    torch.manual_seed(0)
    eager = Motif3Model(ARGS, attention_backend="fa4")
    eager.init_weights()
    compiled = copy.deepcopy(eager)
    apply_ac(blocks(compiled), mode)
    apply_compile(blocks(compiled), backend="aot_eager")
    ids = torch.randint(0, ARGS.vocab_size, (2, 32))
    for record in (False, True):
        outs = {}
        for name, model in (("compiled", compiled), ("eager", eager)):
            model.set_record_max_logits(record)
            out = model(ids)
            out.logits.float().logsumexp(-1).mean().backward()
            outs[name] = out
        torch.testing.assert_close(outs["compiled"].logits, outs["eager"].logits, rtol=1e-5, atol=1e-6)
        if record:
            for got, want in zip(outs["compiled"].max_logits, outs["eager"].max_logits, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        else:
            assert outs["compiled"].max_logits is None
    stats = compile_stats()
    # one graph for full and sliding blocks (fa4 reads the window's tensor form when it runs), with and without
    # recording (the record flag is a guard): 2 graphs, no break
    assert stats["unique_graphs"] == 2 and stats["graph_breaks"] == 0, stats
    for (name, p_c), (_, p_e) in zip(compiled.named_parameters(), eager.named_parameters(), strict=True):
        torch.testing.assert_close(p_c.grad, p_e.grad, rtol=1e-4, atol=1e-6, msg=name)


def _fa4_models_on_cuda():
    """(args, eager model, a copy to compile): ARGS at head dims FA4's backward compiles, fa4 backend, bf16 on CUDA;
    skips the test where flash-attn-4 cannot run."""
    from llm_training.layers.attention.fa4 import fa4_unavailable_reason

    reason = fa4_unavailable_reason("cuda")
    if reason is not None:
        pytest.skip(reason)
    args = ARGS.replace(head_dim=96, qk_rope_head_dim=32, v_head_dim=64)
    torch.manual_seed(0)
    eager = Motif3Model(args, attention_backend="fa4")
    eager.init_weights()
    eager = eager.to(device="cuda", dtype=torch.bfloat16)
    return args, eager, copy.deepcopy(eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checkpointed_blocks_compile_whole_on_cuda_with_flash_attn_4():
    """The CPU test above on the GPU path: real flash-attn-4, inductor, bf16, full activation checkpointing, a step
    without and one with max-logit recording. Every block compiles (2 graphs: full and sliding share one, recording
    or not), nothing breaks, and the compiled logits and max logits are the eager model's up to bf16 rounding (the two
    round at different points: inductor fuses; relative error about 10 roundings of 2^-9 deep, bound 3e-2)."""
    from llm_training.distributed.activation_checkpoint import apply_ac

    args, eager, compiled = _fa4_models_on_cuda()
    apply_ac(blocks(compiled), "full")
    apply_compile(blocks(compiled))
    ids = torch.randint(0, args.vocab_size, (2, 256), device="cuda")

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    for record in (False, True):
        outs = {}
        for name, model in (("compiled", compiled), ("eager", eager)):
            model.set_record_max_logits(record)
            outs[name] = model(ids)
            outs[name].logits.float().logsumexp(-1).mean().backward()
        assert rel(outs["compiled"].logits, outs["eager"].logits) < 3e-2
        if record:
            for got, want in zip(outs["compiled"].max_logits, outs["eager"].max_logits, strict=True):
                assert rel(got, want) < 3e-2
    stats = compile_stats()
    assert stats["unique_graphs"] == 2 and stats["graph_breaks"] == 0, stats  # full = sliding, record or not
    # all gradients as one vector (some mHC gradients are ~0 at init: alone, their relative error is noise); the
    # backward rounds about twice as often as the forward: bound 6e-2
    grads = [torch.cat([p.grad.float().flatten() for p in m.parameters()]) for m in (compiled, eager)]
    assert rel(*grads) < 6e-2


def _packed_documents(n_docs: int, batch: int, seq_len: int, device="cpu") -> torch.Tensor:
    """Document ids [batch, seq_len]: `n_docs` documents of about equal length per row."""
    return (torch.arange(seq_len, device=device) * n_docs // seq_len).expand(batch, seq_len).contiguous()


def test_a_new_document_count_compiles_nothing_new(monkeypatch):
    """With documents, flash-attn-4's varlen kernels read cu_seqlens [N + 1], N the micro-batch's document count,
    which packed chat data changes from batch to batch. Compiled code must not specialise on N: before
    `build_attention_metadata` marked that size dynamic, every compiled block compiled again at the first batch
    with another N (the frames doubled here, the whole attention graph of every kind twice in a real run's first
    steps). Emulated fa4, aot_eager; the outputs equal the eager model's."""
    from tests.fa4_emulation import install_emulated_fa4

    install_emulated_fa4(monkeypatch)
    torch.manual_seed(0)
    eager = Motif3Model(ARGS, attention_backend="fa4")
    eager.init_weights()
    compiled = copy.deepcopy(eager)
    apply_compile(blocks(compiled), backend="aot_eager")
    ids = torch.randint(0, ARGS.vocab_size, (2, 32))
    frames = []
    for n_docs in (2, 3, 5):
        docs = _packed_documents(n_docs, *ids.shape)
        got, want = compiled(ids, document_ids=docs), eager(ids, document_ids=docs)
        got.logits.float().logsumexp(-1).mean().backward()
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)
        frames.append(compile_stats()["compiled_frames"])
    assert frames == [1, 1, 1], frames  # full and sliding blocks share one graph (fa4's window tensor)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_new_document_count_compiles_nothing_new_on_cuda():
    """The CPU test above with real flash-attn-4's varlen kernels, inductor and bf16: batches of 2, 3 and 5
    documents per row run the graphs the first one compiled, and the compiled logits are the eager model's up to
    bf16 rounding (bound as in the whole-block test above, 3e-2)."""
    args, eager, compiled = _fa4_models_on_cuda()
    apply_compile(blocks(compiled))
    ids = torch.randint(0, args.vocab_size, (2, 256), device="cuda")
    frames = []
    for n_docs in (2, 3, 5):
        docs = _packed_documents(n_docs, *ids.shape, device="cuda")
        with torch.no_grad():
            want = eager(ids, document_ids=docs).logits.float()
        got = compiled(ids, document_ids=docs).logits
        got.float().logsumexp(-1).mean().backward()
        assert ((got.float() - want).norm() / want.norm()).item() < 3e-2
        frames.append(compile_stats()["compiled_frames"])
    assert frames == [1, 1, 1], frames


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_expert_parallel_moe_blocks_compile_in_pieces_on_cuda(free_port):
    """The GPU path of `compile_in_pieces`: expert parallelism over a one-rank NCCL group (the experts' forward,
    dispatch and combine, runs eagerly: a break in every MoE block), real flash-attn-4, inductor, bf16, full
    activation checkpointing outside the compiled MoE blocks, over the dense ones. Every MoE block has compiled
    code, and logits and gradients are the eager model's up to bf16 rounding (bounds as in the whole-block test
    above: 3e-2 forward, 6e-2 gradients)."""
    import torch.distributed as dist

    from llm_training.distributed.activation_checkpoint import apply_ac
    from llm_training.distributed.compile import compile_in_pieces
    from llm_training.distributed.expert_parallel import apply_expert_parallel
    from llm_training.layers.attention.fa4 import fa4_unavailable_reason
    from llm_training.motif.parallelize import block_kind

    reason = fa4_unavailable_reason("cuda")
    if reason is not None:
        pytest.skip(reason)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port}", rank=0, world_size=1)
    try:
        # 5 layers: full dense, sliding dense, sliding MoE x 2, full MoE; head dims FA4's backward compiles
        args = get_flavor("motif3_debug").replace(
            num_hidden_layers=5, num_nextn_predict_layers=0, head_dim=96, qk_rope_head_dim=32, v_head_dim=64
        )
        torch.manual_seed(0)
        eager = Motif3Model(args, attention_backend="fa4")
        eager.init_weights()
        eager = eager.to(device="cuda", dtype=torch.bfloat16)
        compiled = copy.deepcopy(eager)
        for model in (eager, compiled):
            apply_expert_parallel(model, dist.group.WORLD)
        moe_blocks = [b for b in blocks(compiled) if b.moe is not None]
        compile_in_pieces(moe_blocks, block_kind)
        apply_ac(blocks(compiled), "full")
        apply_compile([b for b in blocks(compiled) if b.moe is None])
        ids = torch.randint(0, args.vocab_size, (2, 256), device="cuda")
        outs = {}
        for name, model in (("compiled", compiled), ("eager", eager)):
            outs[name] = model(ids)
            outs[name].logits.float().logsumexp(-1).mean().backward()

        def rel(a, b):
            return ((a.float() - b.float()).norm() / b.float().norm()).item()

        assert rel(outs["compiled"].logits, outs["eager"].logits) < 3e-2
        stats = compile_stats()
        assert stats["graph_breaks"] > 0, stats  # at each MoE block's experts
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list
        assert all(entries(b.forward.__wrapped__._torchdynamo_orig_callable) for b in moe_blocks)
        grads = [
            torch.cat([(g.full_tensor() if hasattr(g, "full_tensor") else g).float().flatten() for g in grads_of])
            for grads_of in ([p.grad for p in m.parameters()] for m in (compiled, eager))
        ]
        assert rel(*grads) < 6e-2
    finally:
        if created:
            dist.destroy_process_group()


def test_compile_stats_count_a_recompile_and_its_reason():
    class Scaled(torch.nn.Module):
        def __init__(self, scale: int):
            super().__init__()
            self.lin, self.scale = torch.nn.Linear(8, 8), scale

        def forward(self, x):
            return self.lin(x) * self.scale

    mods = [Scaled(1), Scaled(1), Scaled(2)]
    apply_compile(mods, backend="eager")
    x = torch.randn(2, 8, requires_grad=True)  # every module sees a grad-requiring input
    for m in mods:
        x = m(x)
    stats = compile_stats()
    assert stats["compiled_frames"] == 2 and stats["unique_graphs"] == 2 and stats["recompiles"] == 1, stats
    assert any("scale == 1" in r for r in stats["guard_failures"]), stats


def test_compile_time_is_split_by_frame_with_its_backward():
    """Two kinds of block compiled by inductor on the CPU: one entry per frame compile (the second kind is a
    recompile of the same code), each with its forward's seconds split into dynamo and the backend, and the
    backward graph's compile (at the first backward) under its forward's compile id; slowest first; the report's
    line names them."""
    from llm_training.distributed.compile import compile_by_frame, compile_report

    class Gated(torch.nn.Module):
        def __init__(self, gate: bool):
            super().__init__()
            self.lin, self.gate = torch.nn.Linear(8, 8), gate

        def forward(self, x):
            y = self.lin(x)
            return torch.sigmoid(y) * y if self.gate else torch.relu(y)

    reset_compile_stats()
    mods = [Gated(True), Gated(False)]
    apply_compile(mods, backend="inductor")
    x = torch.randn(2, 8, requires_grad=True)
    # Caches off: a cache hit loads the backward with its forward, so no backward compile would be recorded.
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        for m in mods:
            x = m(x)
        x.sum().backward()
    frames = compile_by_frame()
    assert sorted(f["frame"].rsplit(" ", 1)[1] for f in frames) == ["0/0", "0/1"], frames
    for f in frames:
        assert f["frame"].startswith("forward (test_compile.py:") and f["ops"] >= 2, f
        assert f["forward_s"] > 0 and f["backward_s"] > 0 and f["backend_s"] > 0, f
        assert abs(f["dynamo_s"] + f["backend_s"] - f["forward_s"]) <= 3e-6, f  # three values rounded to 1 us
        assert f["kernels"] == 0, f  # inductor's CPU kernels are C++, not Triton
    totals = [f["forward_s"] + f["backward_s"] for f in frames]
    assert totals == sorted(totals, reverse=True)
    stats = compile_stats()
    assert stats["compile_by_frame"] == frames
    line, _ = compile_report(stats)
    assert "; by frame, forward + backward: forward (test_compile.py:" in line and " ops; dynamo " in line
    reset_compile_stats()
    assert compile_by_frame() == []


def test_compile_by_frame_reads_torch_2_11s_records_on_cuda(monkeypatch):
    """Records as torch 2.11 keeps them on CUDA for two blocks, one a recompile of the other (the values two H100
    probes printed, 2026-12-06): per frame a compile record with the frame's fields and the Triton kernels it built,
    a backward compile record, and "runtime" records (the graph's first run: Triton autotuning) without the frame's
    fields. The frame keeps its name and ops, each kind of record goes to its own field, and the kernels are counted
    over forward and backward."""
    from types import SimpleNamespace

    from llm_training.distributed import compile as compile_module

    def record(compile_id, is_forward, duration_us, is_runtime=False, frame=None, kernels_us=()):
        fields = dict(co_name=None, co_filename=None, co_firstlineno=None, graph_op_count=None,
                      entire_frame_compile_time_s=None, backend_compile_time_s=None)  # fmt: skip
        if frame is not None:
            ops, entire_s, backend_s = frame
            fields.update(co_name="forward", co_filename="/x/block.py", co_firstlineno=6, graph_op_count=ops,
                          entire_frame_compile_time_s=entire_s, backend_compile_time_s=backend_s)  # fmt: skip
        built = json.dumps([[f"triton_kernel_{i}", us] for i, us in enumerate(kernels_us)]) if kernels_us else None
        return SimpleNamespace(compile_id=compile_id, is_forward=is_forward, is_runtime=is_runtime,
                               duration_us=duration_us, triton_compile_time_us=sum(kernels_us) or None,
                               triton_kernel_compile_times_us=built, **fields)  # fmt: skip

    records = [
        record("0/0", True, 3336096, frame=(5, 3.336096, 3.100909), kernels_us=(374088,)),
        record("0/1", True, 377997, frame=(3, 0.377997, 0.318279), kernels_us=(96476,)),
        record("0/1", False, 312578, kernels_us=(101327, 62129, 55247)),
        record("0/1", False, 10761, is_runtime=True),
        record("0/0", False, 327112, kernels_us=(149306, 60421)),
        record("0/0", True, 44414, is_runtime=True),
    ]
    monkeypatch.setattr("torch._dynamo.utils.get_compilation_metrics", lambda: records)
    first, second = compile_module.compile_by_frame()
    assert first == {"frame": "forward (block.py:6) 0/0", "ops": 5, "forward_s": 3.336096, "dynamo_s": 0.235187,
                     "backend_s": 3.100909, "backward_s": 0.327112, "kernels": 3, "triton_s": 0.583815,
                     "first_run_s": 0.044414}  # fmt: skip
    assert second["frame"] == "forward (block.py:6) 0/1" and (second["ops"], second["kernels"]) == (3, 4)
    assert (second["forward_s"], second["backward_s"], second["first_run_s"]) == (0.377997, 0.312578, 0.010761)


def test_compile_stats_name_the_graph_break_reason():
    class Breaks(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            torch._dynamo.graph_break()
            return y + 1

    reset_compile_stats()
    mod = Breaks()
    apply_compile([mod], backend="eager")
    mod(torch.randn(4))
    stats = compile_stats()
    assert stats["graph_breaks"] == 1, stats
    assert len(stats["graph_break_reasons"]) == 1 and stats["graph_break_reasons"][0].startswith("1x "), stats
    assert "graph_break" in stats["graph_break_reasons"][0], stats


def test_compile_time_breakdown_counts_the_forward_and_backward_compiles():
    class Sine(torch.nn.Module):  # a frame of ours (dynamo does not compile torch.nn's own forwards at top level)
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x).sin()

    reset_compile_stats()
    mod = Sine()
    apply_compile([mod], backend="aot_eager")
    assert all(v == 0 for v in compile_stats()["compile_time_s"].values())
    mod(torch.randn(2, 8, requires_grad=True)).sum().backward()
    times = compile_stats()["compile_time_s"]
    assert times["total_forward_s"] > 0 and times["dynamo_trace_s"] > 0 and times["aot_joint_trace_s"] > 0, times
    assert times["dynamo_trace_s"] <= times["total_forward_s"], times


def test_compile_progress_logs_while_the_body_runs_and_stops_after():
    lines: list[str] = []
    with compile_progress(lines.append, interval_s=0.05):
        time.sleep(0.3)
    n = len(lines)
    time.sleep(0.15)
    assert n >= 2 and len(lines) == n, lines  # reported during the body, silent once it ended
    assert all(ln.startswith("[compile] ") and "into the first step" in ln for ln in lines), lines


def test_kernel_caches_go_to_the_run_folder_unless_the_environment_names_them(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir

    from llm_training.distributed.compile import CACHE_SWITCHES, KERNEL_CACHE_VARIABLES, use_kernel_caches

    names = [name for name, _ in KERNEL_CACHE_VARIABLES] + list(CACHE_SWITCHES)
    assert "TRITON_CACHE_AUTOTUNING" in CACHE_SWITCHES  # torchao's autotuned FP8 kernels tune once per cache
    for name in names:  # set, then delete: monkeypatch restores each variable as it was, set or not
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert use_kernel_caches(None) == {} and not any(name in os.environ for name in names)
    folder = tmp_path / "run" / "compile_cache"
    root = str(folder.resolve())
    assert use_kernel_caches(folder) == {
        "TORCHINDUCTOR_CACHE_DIR": root,
        "TRITON_CACHE_DIR": f"{root}/triton",
        "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": f"{root}/flash_attn_cute",
    }
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    assert cache_dir() == root and triton_cache_dir(0).startswith(root)  # inductor reads them as it compiles
    # what the environment sets wins, including flash-attn-4's cache left off
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0")
    monkeypatch.setenv("TRITON_CACHE_DIR", "")  # empty counts as unset
    got = use_kernel_caches(tmp_path / "other")
    assert got["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert got["TRITON_CACHE_DIR"] == str((tmp_path / "other").resolve() / "triton")
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "0"


def test_compile_report_warns_when_nothing_compiled_or_a_graph_broke():
    from llm_training.distributed.compile import compile_report

    times = {"total_forward_s": 12.0, "total_backward_s": 3.5}
    clean = {"compiled_frames": 4, "unique_graphs": 4, "graph_breaks": 0, "recompiles": 2, "compile_time_s": times}
    line, warning = compile_report({**clean, "graph_break_reasons": []})
    assert warning is None
    assert line == (
        "[compile] first step: 4 graphs from 4 frames (2 recompiles), 0 graph breaks; forward compile 12.0 s, "
        "backward 3.5 s"
    )
    eager = {**clean, "unique_graphs": 0, "graph_breaks": 2, "graph_break_reasons": ["2x Skip calling f"]}
    _, warning = compile_report(eager)
    assert "compiled no graph: the blocks ran eagerly" in warning and "reasons: 2x Skip calling f" in warning
    _, warning = compile_report({**clean, "graph_breaks": 1, "graph_break_reasons": ["1x data-dependent"]})
    assert "broke a graph 1 times" in warning and "1x data-dependent" in warning
    # blocks compiled in pieces break by design: named in the line, no warning; no graph at all still warns
    pieces = {**clean, "graph_breaks": 3, "graph_break_reasons": ["3x Skip calling f"]}
    line, warning = compile_report(pieces, blocks_in_pieces=2)
    assert warning is None and line.endswith(
        "; 2 blocks compile in pieces around what dynamo cannot trace: 3x Skip calling f"
    )
    _, warning = compile_report(eager, blocks_in_pieces=2)
    assert "compiled no graph" in warning


def test_compile_in_pieces_keeps_each_kind_of_block_apart_under_full_checkpointing():
    """`compile_in_pieces` (the checkpoint outside the compile) on blocks whose graphs break: on CPU fp32 the MoE's
    expert GEMMs are a host loop dynamo does not trace (`GroupedExperts._looped_matmul`), standing in for the
    expert-parallel experts. Blocks of one kind share one copy of the forward's code, kinds get their own; two
    steps with full checkpointing keep the eager loss and gradients. With one code for all kinds, the sliding MoE
    block's first piece (cut at the experts, so it never guards on dense vs MoE) also matches the sliding dense
    block, and the recompute ran it there: CheckpointError, "recomputed values ... have different metadata"."""
    from llm_training.distributed.activation_checkpoint import apply_ac
    from llm_training.distributed.compile import compile_in_pieces
    from llm_training.motif.parallelize import block_kind

    args = get_flavor("motif3_debug").replace(num_hidden_layers=4, num_nextn_predict_layers=0)  # full d, sliding d/m/m
    torch.manual_seed(0)
    eager = Motif3Model(args)
    eager.init_weights()
    model = copy.deepcopy(eager)
    compile_in_pieces(blocks(model), block_kind, backend="aot_eager")
    codes = [b.forward._torchdynamo_orig_callable.__func__.__code__ for b in blocks(model)]
    apply_ac(blocks(model), "full")
    kinds = [block_kind(b) for b in blocks(model)]
    assert kinds == ["TransformerBlock_full_dense", "TransformerBlock_window16_dense"] + 2 * [
        "TransformerBlock_window16_moe"
    ]
    assert len({id(c) for c in codes}) == 3 and codes[2] is codes[3]
    assert codes[3].co_name == "forward_TransformerBlock_window16_moe"
    ids = torch.randint(0, args.vocab_size, (2, 32))
    for _ in range(2):
        model(ids, return_hidden=True).hidden.float().pow(2).mean().backward()
    eager(ids, return_hidden=True).hidden.float().pow(2).mean().mul(2).backward()
    stats = compile_stats()
    assert stats["graph_breaks"] > 0 and stats["recompiles"] == 0, stats  # each kind its own code: no recompile
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters()) if q.grad is not None]
    assert all(g is not None for g, _ in pairs)  # the same parameters got gradients (the head has none: hidden out)
    g, g_eager = (torch.cat([t.flatten() for t in ts]) for ts in zip(*pairs))
    assert ((g - g_eager).norm() / g_eager.norm()).item() < 1e-4  # fp32 rounding of reordered ops (measured 3e-6)


def test_compile_in_pieces_refuses_a_forward_already_wrapped():
    from llm_training.distributed.activation_checkpoint import apply_ac
    from llm_training.distributed.compile import compile_in_pieces

    model = Motif3Model(ARGS)
    apply_ac(blocks(model), "full")
    with pytest.raises(ValueError, match="already wrapped; compile first"):
        compile_in_pieces(blocks(model), lambda b: "any", backend="aot_eager")


def test_compile_in_pieces_recomputes_a_shape_with_the_graph_its_forward_ran():
    """Two sequence lengths in one step (a block's frame sees a second shape before the first one's recompute):
    `compile_in_pieces` compiles static graphs, one per shape, so each recompute runs its forward's graph. With
    automatic dynamic shapes the second shape compiles a dynamic graph that the first shape's recompute then ran
    (CheckpointError, checked when this test was written)."""
    from llm_training.distributed.activation_checkpoint import apply_ac
    from llm_training.distributed.compile import compile_in_pieces
    from llm_training.motif.parallelize import block_kind

    args = get_flavor("motif3_debug").replace(num_hidden_layers=1, num_nextn_predict_layers=0)  # one full block
    torch.manual_seed(0)
    eager = Motif3Model(args)
    eager.init_weights()
    model = copy.deepcopy(eager)
    compile_in_pieces(blocks(model), block_kind, backend="aot_eager")
    apply_ac(blocks(model), "full")
    batches = [torch.randint(0, args.vocab_size, (2, S)) for S in (32, 48)]
    for m in (model, eager):
        sum(m(ids, return_hidden=True).hidden.float().pow(2).mean() for ids in batches).backward()
    assert compile_stats()["recompiles"] == 1  # a static graph per shape
    for p, q in zip(model.parameters(), eager.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_compile_workers_start_only_where_inductor_has_a_pool(monkeypatch):
    """`start_compile_workers` asks torch to start inductor's worker pool (`maybe_warm_pool`, which honours
    TORCH_WARM_POOL) when Triton is installed, and does nothing without it (inductor then has no pool)."""
    import torch._inductor.async_compile as async_compile
    import torch.utils._triton as triton_utils

    from llm_training.distributed.compile import start_compile_workers

    warmed = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: warmed.append(1))
    monkeypatch.setattr(triton_utils, "has_triton_package", lambda: False)
    assert start_compile_workers() is False and warmed == []
    monkeypatch.setattr(triton_utils, "has_triton_package", lambda: True)
    assert start_compile_workers() is True and warmed == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compile_workers_are_ready_before_the_first_graph_on_cuda():
    """After `start_compile_workers` (what the Trainer calls first when it compiles on CUDA), inductor's pool comes
    up without any graph compiled: its kernels are then built by the workers, not one by one in this process."""
    from torch._inductor.async_compile import AsyncCompile

    from llm_training.distributed.compile import start_compile_workers

    assert start_compile_workers()
    AsyncCompile.wait_pool_ready(timeout=120)
    assert AsyncCompile.use_process_pool()


def test_kernel_tuning_options_are_inductor_settings_and_only_for_inductor():
    """[compile] kernel_tuning = heuristic turns inductor's pointwise autotuning off and filters reduction
    configurations to one; every key is one this torch's inductor config has (torch.compile refuses unknown ones);
    "benchmark" and other backends pass nothing; an unknown value names the key and the choices."""
    import torch._inductor.config as inductor_config

    from llm_training.distributed.compile import inductor_options

    options = inductor_options("inductor", "heuristic")["options"]
    assert options["triton.autotune_pointwise"] is False
    if hasattr(inductor_config.test_configs, "force_filter_reduction_configs"):  # torch 2.11 and 2.13 have it
        assert options["test_configs.force_filter_reduction_configs"] is True
    else:
        assert "test_configs.force_filter_reduction_configs" not in options
    assert set(options) <= set(inductor_config.get_config_copy())
    assert inductor_options("inductor", "benchmark") == {}
    assert inductor_options("aot_eager", "heuristic") == {}
    with pytest.raises(ValueError, match=r"\[compile\] kernel_tuning = 'fastest'.*benchmark, heuristic"):
        inductor_options("inductor", "fastest")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tuning", ["benchmark", "heuristic"])
def test_kernel_tuning_reaches_the_generated_kernels_on_cuda(tuning):
    """A compiled block's generated Triton kernels carry the setting (a pointwise kernel's inductor_meta has
    autotune_pointwise False under heuristic, True under benchmark), and the values are the eager block's up to
    fp32 rounding of a differently ordered reduction. Each row sums 1000 silu terms to about 180 (at most ~225);
    reordering an fp32 sum of n terms moves it by about sqrt(n) * 2^-24 * |sum|, 3e-4 here (3.4e-5 measured against
    fp64 on the CPU), where the bound allows atol 1e-4 + rtol 1e-5 * |sum|, about 1.9e-3."""
    from torch._inductor.utils import run_and_get_code

    from llm_training.distributed.compile import inductor_options

    def block(x, w):
        return torch.nn.functional.silu(x * w).sum(-1) + x.square().mean(-1)

    x = torch.randn(512, 1000, device="cuda")
    w = torch.randn(1000, device="cuda")
    fn = torch.compile(block, backend="inductor", **inductor_options("inductor", tuning))
    got, sources = run_and_get_code(fn, x, w)
    torch.testing.assert_close(got, block(x, w), rtol=1e-5, atol=1e-4)
    code = "\n".join(sources)
    assert f"'autotune_pointwise': {tuning == 'benchmark'}" in code
