"""Block attention with log-sum-exp: key blocks merged with the LSE rule equal one attention over all keys
(reference_attention), also with documents and windows and rows that see nothing in one block; gradients
through out and lse (gradcheck, float64)."""

import math

import pytest
import torch

from llm_training.distributed.context_parallel.block_attention import (
    flex_block_attention,
    merge_partials,
    reference_block_attention,
)
from llm_training.layers.attention.backends import AttentionMetadata, reference_attention


def _qkv(B=2, S=24, Hq=10, Hkv=2, D=6, E=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, S, h, d, generator=g, dtype=dtype) for h, d in ((Hq, D), (Hkv, D), (Hkv, E)))


@pytest.mark.parametrize("window", [None, 5])
def test_merged_key_blocks_equal_full_attention(window):
    q, k, v = _qkv()
    S = q.shape[1]
    docs = torch.tensor([[0] * 7 + [1] * 11 + [2] * 6, [0] * 24])
    queries = range(12, 24)
    expected, expected_max = reference_attention(
        q, k, v, scale=0.4, window=window, metadata=AttentionMetadata(document_ids=docs), record_max_logits=True
    )
    acc, best = None, torch.full((10,), -math.inf)
    # documents: rows 0-6, 7-17, 18-23 in batch row 0, so queries 18-23 see nothing in the first key block
    for keys in (range(0, 12), range(12, 24)):
        out, lse, mx = reference_block_attention(
            q[:, 12:], k[:, keys.start : keys.stop], v[:, keys.start : keys.stop], scale=0.4, queries=queries,
            keys=keys, window=window, document_ids=docs, record_max_logits=True,
        )  # fmt: skip
        assert torch.isfinite(out).all()
        acc, best = merge_partials(acc, out, lse), torch.maximum(best, mx)
    torch.testing.assert_close(acc[0], expected[:, 12:], atol=1e-6, rtol=1e-5)
    # the per-row lse is the logsumexp of the visible scaled logits
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(5, dim=2)) * 0.4
    i, j = torch.arange(S)[:, None], torch.arange(S)[None]
    visible = (
        (j <= i)
        & ((j >= i - window) if window is not None else True)
        & (docs[:, None, :, None] == docs[:, None, None, :])
    )
    torch.testing.assert_close(acc[1], logits.masked_fill(~visible, -math.inf).logsumexp(-1)[:, :, 12:])
    # max_logits over the query rows 12..23 only; the full-sequence value is the max over all rows
    assert (best <= expected_max + 1e-6).all()


def test_rows_without_visible_keys_give_zero_and_minus_inf_without_nan_gradients():
    q, k, v = (t.requires_grad_() for t in _qkv(S=8))
    docs = torch.tensor([[0] * 4 + [1] * 4] * 2)
    # queries 4..7 (document 1) against keys 0..3 (document 0): nothing visible
    out, lse, _ = reference_block_attention(
        q[:, 4:], k[:, :4], v[:, :4], scale=1.0, queries=range(4, 8), keys=range(0, 4), window=None,
        document_ids=docs, record_max_logits=False,
    )  # fmt: skip
    assert (out == 0).all() and (lse == -math.inf).all()
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_gradients_of_out_and_lse_gradcheck():
    q, k, v = (t.requires_grad_() for t in _qkv(B=1, S=6, Hq=4, Hkv=2, D=3, E=2, dtype=torch.float64))
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])

    def out_and_lse(q, k, v):  # queries 2..5 against all keys: row 2 is cut by the document, 5 by the window
        out, lse, _ = reference_block_attention(
            q[:, 2:], k, v, scale=0.7, queries=range(2, 6), keys=range(0, 6), window=1, document_ids=docs,
            record_max_logits=False,
        )  # fmt: skip
        return out, lse

    assert torch.autograd.gradcheck(out_and_lse, (q, k, v))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("keys", [range(16, 48), range(16)])  # the second: nothing visible to any query
def test_flex_block_matches_the_reference_forward(keys):
    q, k, v = _qkv(S=64)
    docs = torch.tensor([[0] * 20 + [1] * 30 + [2] * 14, [0] * 64])
    kw = dict(scale=0.3, queries=range(32, 48), keys=keys, window=16, document_ids=docs, record_max_logits=False)
    kv = (k[:, keys.start : keys.stop], v[:, keys.start : keys.stop])
    flex_out, flex_lse, _ = flex_block_attention(q[:, 32:48], *kv, **kw)
    ref_out, ref_lse, _ = reference_block_attention(q[:, 32:48], *kv, **kw)
    torch.testing.assert_close(flex_out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex_lse, ref_lse, atol=1e-5, rtol=1e-5)
