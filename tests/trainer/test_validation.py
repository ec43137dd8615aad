"""The validation loop (trainer/validation.py): the training loss of held-out batches by a hand computation, no
gradients, the model's mode restored, the same batches at every evaluation, the same numbers on 2 gloo ranks (data
and context parallel) as on one process, and the val_* records the trainer writes at freq steps and at the end."""

from __future__ import annotations

import datetime
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from conftest import tiny_config
from llm_training.config.job_config import ASSETS_DIR
from llm_training.distributed import ParallelDims
from llm_training.trainer import Trainer, train
from llm_training.trainer.batch import prepare_batch
from llm_training.trainer.losses import IGNORE_INDEX
from llm_training.data import build_dataloader

DIMS = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=1)
CPU = torch.device("cpu")
VAL_DATA = ASSETS_DIR / "demo_chat_val.jsonl"


def validation_args(freq: int = 100, steps: int = 3) -> tuple[str, ...]:
    return (
        "--validation.enable",
        f"--validation.dataset_path={VAL_DATA}",
        f"--validation.freq={freq}",
        f"--validation.steps={steps}",
    )


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    config = tiny_config(tmp_path_factory.mktemp("val"), "--checkpoint.enable=false", *validation_args())
    return Trainer(config, DIMS, CPU)


def _ce_per_token(hidden, weight, labels) -> tuple[float, int]:
    """(sum of the float64 cross-entropy over labelled tokens, their count): full logits, F.cross_entropy."""
    logits = hidden.double().reshape(-1, hidden.shape[-1]) @ weight.double().t()
    total = F.cross_entropy(logits, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    return total.item(), int((labels != IGNORE_INDEX).sum())


@torch.no_grad()
def hand_validation_loss(trainer, raw_batches) -> tuple[float, float, int]:
    """(main CE per labelled token, mean over MTP modules of CE per labelled target, labelled tokens) of the
    batches, token-weighted over all of them."""
    main, mtp = [0.0, 0], [[0.0, 0] for _ in range(trainer.num_mtp)]
    weight = trainer.model.lm_head.weight
    for raw in raw_batches:
        b = prepare_batch(raw, trainer.num_mtp, trainer.spec.mtp_inputs)
        out = trainer.model(b.input_ids, b.position_ids, b.document_ids, b.mtp_input_ids, return_hidden=True)
        for acc, hidden, labels in [(main, out.hidden, b.labels), *zip(mtp, out.mtp_hidden, b.mtp_labels)]:
            ce, n = _ce_per_token(hidden, weight, labels)
            acc[0], acc[1] = acc[0] + ce, acc[1] + n
    mtp_loss = sum(s / n for s, n in mtp) / len(mtp) if mtp else 0.0
    return main[0] / main[1], mtp_loss, main[1]


def test_validation_loss_is_the_training_loss_of_the_first_batches_without_gradients(trainer):
    assert trainer.num_mtp >= 1  # motif3_debug has an MTP module: its loss is checked too
    fresh = build_dataloader(trainer.job_config, trainer.tokenizer, 0, 1, validation=True)
    expected_loss, expected_mtp, expected_tokens = hand_validation_loss(trainer, [fresh.next_batch() for _ in range(3)])

    trainer.model.train()
    result = trainer.validator.evaluate(trainer.model, step=7)
    assert result.step == 7 and result.tokens == expected_tokens > 0
    assert result.loss == pytest.approx(expected_loss, rel=1e-5)
    assert result.mtp_loss == pytest.approx(expected_mtp, rel=1e-5)
    assert result.metrics()["val_ppl"] == pytest.approx(math.exp(expected_loss), rel=1e-5)
    assert trainer.model.training
    assert all(p.grad is None for p in trainer.model.parameters())

    trainer.model.eval()  # a model in eval mode stays in it
    trainer.validator.evaluate(trainer.model, step=7)
    assert not trainer.model.training
    trainer.model.train()


def test_every_evaluation_reads_the_same_batches(trainer):
    first = trainer.validator.evaluate(trainer.model, step=1)
    again = trainer.validator.evaluate(trainer.model, step=1)
    assert (again.loss, again.mtp_loss, again.tokens) == (first.loss, first.mtp_loss, first.tokens)

    trainer.train_step([next(iter(trainer.dataloader))])  # the model changes; the validation batches do not
    after_step = trainer.validator.evaluate(trainer.model, step=2)
    assert after_step.tokens == first.tokens and after_step.loss != first.loss


def test_trainer_writes_val_records_every_freq_steps_and_at_the_end(make_config, caplog):
    config = make_config("--training.steps=5", "--checkpoint.enable=false", *validation_args(freq=2, steps=2))
    with caplog.at_level("INFO"):
        result = train(config, DIMS, CPU)
    records = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    validation = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in validation] == [2, 4, 5]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]  # the training records are unchanged
    for r in validation:
        assert 0 < r["val_loss"] < 20 and r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]))
        assert r["val_tokens"] > 0 and r["val_mtp_loss"] > 0
    assert f"validation step 4: loss {validation[1]['val_loss']:.4f}  ppl" in caplog.text


# ---------------------------------------------------------------------------------------------- 2 gloo ranks
PARALLEL_ROWS, PARALLEL_SEQ, PARALLEL_STEPS = 2, 64, 2
LAYOUTS = {  # name -> ParallelDims degrees of 2 ranks (each reads 2 / dp rows per batch)
    "fsdp2": dict(dp_replicate=1, dp_shard=-1, cp=1, ep=1),
    "ulysses_cp2": dict(dp_replicate=1, dp_shard=1, cp=2, ep=1),
}


def _parallel_config(dump_folder, dp_size: int):
    """One padded record per row, so 1 rank x 2 rows and 2 data ranks x 1 row evaluate the same rows."""
    return tiny_config(
        dump_folder,
        f"--training.local_batch_size={PARALLEL_ROWS // dp_size}",
        f"--training.seq_len={PARALLEL_SEQ}",
        "--huggingface_dataset.packing=pad",
        "--checkpoint.enable=false",
        *validation_args(steps=PARALLEL_STEPS),
    )


def _validation_worker(rank, world, port, layout, dump_folder, out_file):
    from llm_training.distributed.utils import destroy_process_group, setup_distributed

    torch.set_num_threads(1)  # spawned ranks do not run the root conftest
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        dims = ParallelDims(world_size=world, **LAYOUTS[layout])
        device, _ = setup_distributed("cpu", dims)
        trainer = Trainer(_parallel_config(dump_folder, dims.dp_size), dims, device)
        result = trainer.validator.evaluate(trainer.model, step=0)
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump({"loss": result.loss, "mtp_loss": result.mtp_loss, "tokens": result.tokens}, f)
    finally:
        destroy_process_group()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_give_the_validation_loss_of_one_process(layout, tmp_path, free_port):
    single = Trainer(_parallel_config(tmp_path / "single", dp_size=1), DIMS, CPU)
    expected = single.validator.evaluate(single.model, step=0)
    out_file = tmp_path / "two_ranks.json"
    mp.spawn(_validation_worker, args=(2, free_port, layout, tmp_path / layout, out_file), nprocs=2, join=True)
    got = json.loads(out_file.read_text())
    assert got["tokens"] == expected.tokens > 0
    assert got["loss"] == pytest.approx(expected.loss, rel=1e-6)
    assert got["mtp_loss"] == pytest.approx(expected.mtp_loss, rel=1e-6)
