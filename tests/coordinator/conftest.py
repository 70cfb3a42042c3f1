"""Fixtures the coordinator's tests share."""
from __future__ import annotations

import pytest

from coordinator.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_factory) -> Tokenizer:
    """The tiny checkpoint's tokenizer, built once per test module."""
    return Tokenizer.from_dir(tiny_model_factory())
