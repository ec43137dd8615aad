"""parallelize_motif: FSDP2 on 2 gloo CPU ranks gives the same loss and gradients as one process on the
full batch (SUM gradient reduction + replicated fp32 params + the chunked loss on the root's lm_head);
activation checkpointing (full / selective) keeps values and gradients and the parameter names."""

import os
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llm_training.distributed import ParallelDims
from llm_training.distributed.fsdp import REDUCE_STREAMS
from llm_training.motif import get_flavor
from llm_training.motif.model import Motif3Model
from llm_training.motif.mtp import mtp_inputs
from llm_training.motif.parallelize import blocks, parallelize_motif
from llm_training.trainer.batch import prepare_batch
from llm_training.trainer.losses import count_labelled_tokens, micro_batch_loss
from llm_training.distributed.utils import destroy_process_group

ARGS = get_flavor("motif3_debug").replace(num_hidden_layers=3, router_aux_loss_coef=0.01)


def _config(ac_mode="none", compiled=False, cp_mode="ulysses", granularity="block", kernel_tuning="benchmark"):
    ns = types.SimpleNamespace
    return ns(
        activation_checkpoint=ns(mode=ac_mode, keep_full_attention=True),
        compile=ns(
            enable=compiled,
            components=["model"] if compiled else [],
            granularity=granularity,
            kernel_tuning=kernel_tuning,
        ),
        training=ns(mixed_precision_param="float32", mixed_precision_reduce="float32"),
        parallelism=ns(expert_parallel_dispatcher="all_to_all", context_parallel_mode=cp_mode),
    )


def _batch():
    """4 rows of 16 tokens, 2 packed documents per row, as the trainer prepares it (MTP inputs and targets)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, ARGS.vocab_size, (4, 16), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((4, 1), -100)], dim=1)
    labels[0, :5] = -100
    labels[:, 9] = -100  # the last token of the first document predicts nothing
    docs = (torch.arange(16) >= 10).long().expand(4, 16)
    pos = torch.cat([torch.arange(10), torch.arange(6)]).expand(4, 16)
    return prepare_batch({"input_ids": ids, "labels": labels, "position_ids": pos, "document_ids": docs}, 1, mtp_inputs)


def _reference_model():
    torch.manual_seed(0)
    m = Motif3Model(ARGS)
    m.init_weights()
    return m


def _loss_and_grads(model, b, normalisers, balance_scale, after_forward=lambda: None):
    out = model(b.input_ids, b.position_ids, b.document_ids, b.mtp_input_ids, return_hidden=True)
    after_forward()
    loss = micro_batch_loss(out, model.lm_head.weight, b.labels, b.mtp_labels, normalisers, 0.3, balance_scale)
    loss.total.backward()
    return loss.total.detach()


def _worker(rank, world, port, path, dp_replicate=1):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.tensor import DTensor

        dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=-1, cp=1, ep=1, world_size=world)
        dims.build_mesh("cpu")
        with torch.device("meta"):
            model = Motif3Model(ARGS)
        parallel = parallelize_motif(model, dims, _config(), torch.device("cpu"))
        model.to_empty(device="cpu")
        model.init_weights(buffer_device=torch.device("cpu"))
        set_model_state_dict(model, _reference_model().state_dict(), options=StateDictOptions(full_state_dict=True))
        # pure replication (dp_shard = 1) still needs FSDP2's gradient reduction (HSDP over a 1-rank shard dim)
        assert parallel.fsdp and isinstance(model.layers[0].self_attn.wq_b.weight, DTensor)
        assert not isinstance(model.layers[2].moe.router.gate.weight, DTensor)  # fp32, replicated
        # the input embedding is an FSDP2 group of its own (not in the root's flat gradient buffer)
        root_params = {id(fp.sharded_param) for fp in model._get_fsdp_state()._fsdp_param_group.fsdp_params}
        embedding_group = model.embed_tokens._get_fsdp_state()._fsdp_param_group
        assert id(model.embed_tokens.weight) not in root_params and root_params
        assert [fp.sharded_param for fp in embedding_group.fsdp_params] == [model.embed_tokens.weight]
        mine = _batch().map(lambda t: t[2 * rank : 2 * rank + 2])
        normalisers = count_labelled_tokens(mine.targets())
        dist.all_reduce(normalisers)

        def after_forward():  # the embedding (called once, MTP ids too) is resharded; the root keeps the head;
            # over a one-rank shard dim (HSDP 2 x 1) every other group stays gathered for the step (defer_grad_sync)
            assert isinstance(model.embed_tokens.weight, DTensor)
            assert isinstance(model.layers[0].self_attn.wq_b.weight, DTensor) == (not parallel.defer_grad_sync)
            assert not isinstance(model.lm_head.weight, DTensor)

        loss = _loss_and_grads(model, mine, normalisers, 1.0 / world, after_forward)
        dist.all_reduce(loss)
        parallel.sync_replicated_grads()
        ctx = model._get_fsdp_state()._comm_ctx  # two ranks: the reduction overlaps real communication on its stream
        assert all(getattr(ctx, name) != ctx.device_handle.current_stream() for name in REDUCE_STREAMS)
        grads = {
            n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()
        }
        if rank == 0:
            torch.save({"loss": loss, "grads": grads}, path)
    finally:
        destroy_process_group()


@pytest.mark.parametrize("dp_replicate", [1, 2], ids=["shard2", "replicate2"])
def test_fsdp2_two_gloo_ranks_match_single_process(tmp_path, dp_replicate, free_port):
    path = tmp_path / "rank0.pt"
    mp.spawn(_worker, args=(2, free_port, str(path), dp_replicate), nprocs=2, join=True)
    got = torch.load(path)
    ref_model = _reference_model()
    b = _batch()
    ref_loss = _loss_and_grads(ref_model, b, count_labelled_tokens(b.targets()), 1.0)
    torch.testing.assert_close(got["loss"], ref_loss, rtol=1e-5, atol=1e-6)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_values_grads_and_names(mode):
    b = _batch()
    norms = count_labelled_tokens(b.targets())
    ref = _reference_model()
    ref_loss = _loss_and_grads(ref, b, norms, 1.0)
    model = _reference_model()
    parallelize_motif(model, ParallelDims(1, 1, 1, 1, 1), _config(mode), torch.device("cpu"))
    assert list(model.state_dict()) == list(ref.state_dict())
    loss = _loss_and_grads(model, b, norms, 1.0)
    torch.testing.assert_close(loss, ref_loss)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


@pytest.mark.parametrize(
    ("granularity", "ac_mode", "halves"),
    [("block", "none", False), ("sublayer", "none", True), ("auto", "none", True), ("auto", "full", False)],
)
def test_compile_granularity_reaches_apply_compile(monkeypatch, granularity, ac_mode, halves):
    """auto = the halves without activation checkpointing (the H200 measurement in the [compile] granularity
    doc), whole blocks with it."""
    from llm_training.motif import parallelize

    calls = []
    monkeypatch.setattr(
        parallelize, "apply_compile", lambda blocks, sublayers, kernel_tuning: calls.append((len(blocks), sublayers))
    )
    parallelize_motif(Motif3Model(ARGS), ParallelDims(1, 1, 1, 1, 1), _config(ac_mode, True, granularity=granularity),
                      torch.device("cpu"))  # fmt: skip
    assert calls == [(ARGS.num_hidden_layers + ARGS.num_nextn_predict_layers, halves)]


@pytest.mark.parametrize(
    ("ac_mode", "tuning"), [("none", "heuristic"), ("long_context", "heuristic"), ("none", "benchmark")]
)
def test_compile_kernel_tuning_reaches_every_torch_compile_call(monkeypatch, ac_mode, tuning):
    """[compile] kernel_tuning reaches both ways a block is compiled: whole or by sublayer (`apply_compile`) and in
    pieces (`compile_in_pieces`, every block under long_context checkpointing)."""
    from llm_training.motif import parallelize

    seen = []
    monkeypatch.setattr(
        parallelize, "apply_compile", lambda blocks, sublayers, kernel_tuning: seen.append(kernel_tuning)
    )
    monkeypatch.setattr(
        parallelize, "compile_in_pieces", lambda blocks, kind, kernel_tuning: seen.append((len(blocks), kernel_tuning))
    )
    parallelize_motif(Motif3Model(ARGS), ParallelDims(1, 1, 1, 1, 1), _config(ac_mode, True, kernel_tuning=tuning),
                      torch.device("cpu"))  # fmt: skip
    n_blocks = ARGS.num_hidden_layers + ARGS.num_nextn_predict_layers
    pieces = n_blocks if ac_mode == "long_context" else 0
    assert seen == [(pieces, tuning), tuning]


def test_long_context_checkpointing_chunks_the_routed_experts_and_keeps_values_and_grads(monkeypatch):
    """long_context = full AC per block + the routed experts in checkpointed token chunks (a chunk smaller than
    the batch here, so the chunked path runs): same loss and gradients as no checkpointing, up to fp32 rounding
    of the differently shaped expert GEMMs."""
    from llm_training.distributed import activation_checkpoint
    from llm_training.layers.moe import MoE

    monkeypatch.setattr(activation_checkpoint, "LONG_CONTEXT_MOE_CHUNK_TOKENS", 24)
    b = _batch()
    norms = count_labelled_tokens(b.targets())
    ref = _reference_model()
    ref_loss = _loss_and_grads(ref, b, norms, 1.0)
    model = _reference_model()
    parallelize_motif(model, ParallelDims(1, 1, 1, 1, 1), _config("long_context"), torch.device("cpu"))
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes and all(m.sequence_chunk_tokens == 24 for m in moes)
    assert b.input_ids.numel() > 24
    loss = _loss_and_grads(model, b, norms, 1.0)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def _compiled_in_pieces_worker(rank, world, port, path, strategy):
    """One config (EP 2, or ring context parallelism over 2 ranks), full activation checkpointing: the loss and
    gradients of a step eagerly, then compiled (`aot_eager`: dynamo and AOT autograd's partition as inductor gets
    them, without C++ kernel builds), from the same weights; and whether each block's forward has compiled code."""
    import functools

    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor

    from llm_training.distributed import compile as compile_module
    from llm_training.distributed.context_parallel import shard_batch
    from llm_training.motif import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        parallelize.apply_compile = functools.partial(compile_module.apply_compile, backend="aot_eager")
        parallelize.compile_in_pieces = functools.partial(compile_module.compile_in_pieces, backend="aot_eager")
        ids = torch.randint(0, ARGS.vocab_size, (2, 64), generator=torch.Generator().manual_seed(3))
        labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
        docs = (torch.arange(64) >= 40).long().expand(2, 64)
        pos = torch.cat([torch.arange(40), torch.arange(24)]).expand(2, 64)
        batch = prepare_batch({"input_ids": ids, "labels": labels, "position_ids": pos, "document_ids": docs}, 1,
                              mtp_inputs)  # fmt: skip
        results = {}
        for compiled in (False, True):
            compile_module.reset_compile_stats()
            ep, cp = (2, 1) if strategy == "experts" else (1, 2)
            dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=cp, ep=ep, world_size=world)
            dims.build_mesh("cpu")
            with torch.device("meta"):
                model = Motif3Model(ARGS)
            config = _config("full", compiled, "ring" if strategy == "ring" else "ulysses")
            parallel = parallelize_motif(model, dims, config, torch.device("cpu"))
            model.to_empty(device="cpu")
            model.init_weights(buffer_device=torch.device("cpu"))
            set_model_state_dict(model, _reference_model().state_dict(), options=StateDictOptions(full_state_dict=True))
            mine, attention_docs = shard_batch(parallel.context_parallel, batch)
            out = model(mine.input_ids, mine.position_ids, mine.document_ids, mine.mtp_input_ids, return_hidden=True,
                        attention_document_ids=attention_docs)  # fmt: skip
            normalisers = count_labelled_tokens(mine.targets())
            dist.all_reduce(normalisers)
            loss = micro_batch_loss(out, model.lm_head.weight, mine.labels, mine.mtp_labels, normalisers, 0.3, 0.5)
            loss.total.backward()
            parallel.sync_replicated_grads()
            grads = [(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for p in model.parameters()]
            compiled_code = [
                bool(torch._dynamo.eval_frame._debug_get_cache_entry_list(b.forward._torchdynamo_orig_callable))
                for b in blocks(model)
                if "forward" in vars(b) and hasattr(b.forward, "_torchdynamo_orig_callable")
            ]
            results[compiled] = {"loss": loss.total.detach(), "grads": grads, "pieces": parallel.blocks_compiled_in_pieces,
                                 "stats": compile_module.compile_stats(), "compiled_code": compiled_code}  # fmt: skip
        if rank == 0:
            torch.save(results, path)
    finally:
        destroy_process_group()


@pytest.mark.parametrize("strategy", ["experts", "ring"])
def test_blocks_that_break_a_graph_compile_in_pieces_under_full_checkpointing(tmp_path, free_port, strategy):
    """Expert parallelism (the experts: their own FSDP2 group, fed by the all-to-all) and ring / halo context
    parallelism break a block's graph; with the checkpoint outside the compile (`compile_in_pieces`) those blocks
    still compile, in pieces, and the step keeps the eager loss and gradients: before, dynamo ran every such
    block eagerly under activation checkpointing. ARGS has a sliding dense and a sliding MoE block: the compiled
    code of each kind is kept apart, else a recompute ran the other kind's graph (CheckpointError)."""
    from llm_training.distributed.compile import compile_report

    path = tmp_path / "rank0.pt"
    mp.spawn(_compiled_in_pieces_worker, args=(2, free_port, str(path), strategy), nprocs=2, join=True)
    eager, compiled = (got := torch.load(path))[False], got[True]
    # the blocks compiled in pieces: under EP the one MoE layer, under ring CP every block (3 layers + MTP)
    assert compiled["pieces"] == (1 if strategy == "experts" else 4) and eager["pieces"] == 0
    assert len(compiled["compiled_code"]) == compiled["pieces"] and all(compiled["compiled_code"]), compiled
    stats = compiled["stats"]
    assert stats["graph_breaks"] > 0, stats  # the breaks are by design: the report names them without a warning
    line, warning = compile_report(stats, compiled["pieces"])
    assert warning is None and "compile in pieces" in line
    # aot_eager runs the eager ops, reordered by the partitioner's recompute: fp32 rounding only (measured <= 3e-6)
    torch.testing.assert_close(compiled["loss"], eager["loss"], rtol=1e-5, atol=1e-6)
    g_eager, g_compiled = (
        torch.cat([g.flatten() for g in eager["grads"]]),
        torch.cat([g.flatten() for g in compiled["grads"]]),
    )
    assert ((g_compiled - g_eager).norm() / g_eager.norm()).item() < 1e-4


def test_long_context_compiles_every_block_in_pieces_with_eager_expert_chunks(monkeypatch):
    """Compiled over their checkpoint, long_context blocks had the routed-expert chunks' checkpoints inside the
    block's graph: on the H200 the 64K-token step peaked at 61.2 GiB (36.6 eager) and 256K ran out of memory. Now
    every block compiles in pieces (checkpoint outside) around the eager chunks, with the eager loss and gradients
    (fp32 rounding of reordered ops under aot_eager: measured 1.5e-6)."""
    import functools

    from llm_training.distributed import activation_checkpoint
    from llm_training.distributed import compile as compile_module
    from llm_training.motif import parallelize

    monkeypatch.setattr(activation_checkpoint, "LONG_CONTEXT_MOE_CHUNK_TOKENS", 24)
    whole = []
    monkeypatch.setattr(parallelize, "apply_compile", lambda blocks, sublayers, kernel_tuning: whole.extend(blocks))
    monkeypatch.setattr(
        parallelize, "compile_in_pieces", functools.partial(compile_module.compile_in_pieces, backend="aot_eager")
    )
    compile_module.reset_compile_stats()
    b = _batch()
    norms = count_labelled_tokens(b.targets())
    ref = _reference_model()
    ref_loss = _loss_and_grads(ref, b, norms, 1.0)
    model = _reference_model()
    parallel = parallelize_motif(model, ParallelDims(1, 1, 1, 1, 1), _config("long_context", True), torch.device("cpu"))
    assert parallel.blocks_compiled_in_pieces == len(blocks(model)) and whole == []
    loss = _loss_and_grads(model, b, norms, 1.0)
    stats = compile_module.compile_stats()
    assert any("_routed_in_chunks" in r for r in stats["graph_break_reasons"]), stats  # the chunks ran eagerly
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    g = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    g_ref = torch.cat([p.grad.flatten() for p in ref.parameters() if p.grad is not None])
    assert ((g - g_ref).norm() / g_ref.norm()).item() < 1e-4


def _one_process_bf16_step(model, parallel, device):
    """Three micro-batches (rows 0-2 of `_batch`) of a model parallelized in one process, through the trainer's loss
    path (`HeadGradAccumulator`, deferred reduction), against the fp32 reference model on the same micro-batches:
    (loss, reference loss); the gradients are left on both models (the reference is returned too)."""
    from llm_training.trainer.losses import HeadGradAccumulator

    b = _batch()
    normalisers = count_labelled_tokens(b.targets())
    micro = [b.map(lambda t, k=k: t[k : k + 1]) for k in range(3)]
    acc = HeadGradAccumulator()
    acc.begin_step()
    total = 0.0
    for k, mb in enumerate(micro):
        parallel.set_gradient_sync(last_micro_batch=k == len(micro) - 1)
        mb = mb.map(lambda t: t.to(device))
        out = model(mb.input_ids, mb.position_ids, mb.document_ids, mb.mtp_input_ids, return_hidden=True)
        loss = micro_batch_loss(out, model.lm_head.weight, mb.labels, mb.mtp_labels, normalisers.to(device), 0.3,
                                1.0 / len(micro), head_grad=acc.micro_batch(k, len(micro)))  # fmt: skip
        loss.total.backward()
        total += float(loss.total.detach())
    parallel.sync_replicated_grads()
    ref = _reference_model()
    ref_total = 0.0
    for mb in micro:
        out = ref(mb.input_ids, mb.position_ids, mb.document_ids, mb.mtp_input_ids, return_hidden=True)
        ref_loss = micro_batch_loss(out, ref.lm_head.weight, mb.labels, mb.mtp_labels, normalisers, 0.3,
                                    1.0 / len(micro)).total  # fmt: skip
        ref_loss.backward()
        ref_total += float(ref_loss.detach())
    return total, ref_total, ref


def _check_one_process_tables(model, ref, total, ref_total):
    """The tables are plain fp32 parameters outside FSDP2 (the blocks and the root are FSDP2 groups) with fp32
    gradients equal to the fp32 model's to bf16 rounding of the compute: relative Frobenius difference < 3e-2 (the
    whole model in bf16 on CPU: 1.4e-2 for the embedding, 1.1e-2 for the head); the summed loss to 1e-3 (2e-5 in
    the CPU run of this path)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    assert not isinstance(model.embed_tokens, FSDPModule) and isinstance(model, FSDPModule)
    assert model.embed_tokens.grad_in_place  # its backward adds into the fp32 .grad (layers.embedding)
    assert isinstance(model.layers[0].self_attn.wq_b.weight, DTensor)
    assert abs(total - ref_total) < 1e-3 * abs(ref_total)
    for table, ref_table in ((model.embed_tokens, ref.embed_tokens), (model.lm_head, ref.lm_head)):
        assert not isinstance(table.weight, DTensor) and table.weight.dtype == torch.float32
        got = table.weight.grad
        assert got.dtype == torch.float32 and not isinstance(got, DTensor)
        assert float((got.cpu() - ref_table.weight.grad).norm() / ref_table.weight.grad.norm()) < 3e-2


def _one_process_model(device: str):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=1)
    dims.build_mesh(device)
    config = _config()
    config.training = types.SimpleNamespace(mixed_precision_param="bfloat16", mixed_precision_reduce="float32")
    with torch.device("meta"):
        model = Motif3Model(ARGS)
    parallel = parallelize_motif(model, dims, config, torch.device(device))
    model.to_empty(device=device)
    model.init_weights(buffer_device=torch.device(device))
    set_model_state_dict(model, _reference_model().state_dict(), options=StateDictOptions(full_state_dict=True))
    return model, parallel


def test_one_process_bf16_keeps_the_vocabulary_tables_out_of_fsdp2_on_gloo(monkeypatch):
    """The one-GPU setup's decisions on CPU: one gloo process, FSDP2 with bf16 parameters and fp32 reduction (what
    `fsdp_mixed_precision` gives on CUDA): the lookup hands the blocks bf16 from the fp32 table, and a step of three
    micro-batches gives the tables the fp32 model's gradients (`_check_one_process_tables`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from llm_training.motif import parallelize

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    monkeypatch.setattr(parallelize, "fsdp_mixed_precision", lambda *_: bf16)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, parallel = _one_process_model("cpu")
        assert model.embed_tokens(torch.tensor([[1, 2]])).dtype == torch.bfloat16
        total, ref_total, ref = _one_process_bf16_step(model, parallel, torch.device("cpu"))
        _check_one_process_tables(model, ref, total, ref_total)
    finally:
        if created:
            destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_process_keeps_the_vocabulary_tables_out_of_fsdp2(free_port):
    """The same on one GPU (`fsdp_mixed_precision` as it is on CUDA: bf16 parameters, fp32 reduction), through the
    CUDA loss (fp32-output GEMMs into the step's fp32 buffer, the Triton CE kernel)."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port}", rank=0, world_size=1)
    try:
        model, parallel = _one_process_model("cuda")
        assert model.embed_tokens(torch.tensor([[1, 2]], device="cuda")).dtype == torch.bfloat16
        total, ref_total, ref = _one_process_bf16_step(model, parallel, torch.device("cuda"))
        _check_one_process_tables(model, ref, total, ref_total)
    finally:
        if created:
            destroy_process_group()
