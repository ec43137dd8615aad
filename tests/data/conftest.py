"""Fixtures for the data tests (the bundled tokenizer, loaded two ways)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from llm_training.data import BUNDLED_TOKENIZER_PATH, build_tokenizer


@pytest.fixture(scope="session")
def hf_tokenizer():
    return build_tokenizer(BUNDLED_TOKENIZER_PATH)


@pytest.fixture(scope="session")
def raw_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(BUNDLED_TOKENIZER_PATH / "tokenizer.json"))
