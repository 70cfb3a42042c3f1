"""Fixtures the coordinator's tests share. A module that defines `stack` (a running front on the fake engine,
with its own limits) gets `env` (the stack, its engine's script reset before each test) and the official
clients on it, `oai` and `ant`."""
from __future__ import annotations

import anthropic
import openai
import pytest

from coordinator.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_factory) -> Tokenizer:
    """The tiny checkpoint's tokenizer, built once per test module."""
    return Tokenizer.from_dir(tiny_model_factory())


@pytest.fixture
def env(stack):
    stack.engine.reset()
    return stack


@pytest.fixture
def oai(env) -> openai.OpenAI:
    return openai.OpenAI(base_url=env.url + "/v1", api_key="unused", max_retries=0, timeout=10)


@pytest.fixture
def ant(env) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=env.url, api_key="unused", max_retries=0, timeout=10)
