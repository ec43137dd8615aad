"""prepare_batch: the MTP inputs and targets are shifted per packed document before the model, and every tensor
of the prepared batch is [B, S] and sliced together."""

import torch

from llm_training.motif.mtp import mtp_inputs
from llm_training.trainer.batch import prepare_batch


def _raw():
    # two rows; row 0 packs documents [0, 0, 0 | 1, 1], row 1 [0, 0 | 1, 1, 1]; labels written by hand
    ids = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    labels = torch.tensor([[11, 12, -100, 14, -100], [21, -100, 23, 24, -100]])
    docs = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]])
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]])
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "document_ids": docs}


def test_mtp_inputs_and_targets_by_hand():
    b = prepare_batch(_raw(), num_mtp=2, mtp_inputs=mtp_inputs)
    # module k embeds t_{i+k+1}; the last k+1 positions repeat the row's last id
    assert b.mtp_input_ids[0].tolist() == [[11, 12, 13, 14, 14], [21, 22, 23, 24, 24]]
    assert b.mtp_input_ids[1].tolist() == [[12, 13, 14, 14, 14], [22, 23, 24, 24, 24]]
    # module k predicts labels[t + k + 1], -100 when that position is in another document
    assert b.mtp_labels[0].tolist() == [[12, -100, -100, -100, -100], [-100, -100, 24, -100, -100]]
    assert b.mtp_labels[1].tolist() == [[-100, -100, -100, -100, -100], [-100, -100, -100, -100, -100]]
    assert [t.shape for t in b.targets()] == [(2, 5)] * 3


def test_map_applies_to_every_tensor_alike():
    b = prepare_batch(_raw(), num_mtp=1, mtp_inputs=mtp_inputs)
    cut = b.map(lambda t: t[:, 1:4])  # e.g. one context-parallel shard of the sequence
    assert cut.input_ids.tolist() == [[11, 12, 13], [21, 22, 23]]
    assert cut.document_ids.tolist() == [[0, 0, 1], [0, 1, 1]]
    assert cut.mtp_input_ids[0].tolist() == [[12, 13, 14], [22, 23, 24]]
    assert cut.mtp_labels[0].tolist() == [[-100, -100, -100], [-100, 24, -100]]
    assert cut.position_ids.tolist() == [[1, 2, 0], [1, 0, 1]]
