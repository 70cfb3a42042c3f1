"""The coordinator resolves `model:` the way the stages do: "tiny", a "tiny:key=value,..." spec (built by a child
process that has torch, into the same cache), a checkpoint directory, or a .gguf file."""
from __future__ import annotations

import json

import pytest

from coordinator.cli import resolve_model_dir
from pool.config import ConfigError, config_from_dict
from tests.conftest import TINY_TEST_CACHE


def test_a_tiny_spec_is_built_and_found(monkeypatch):
    monkeypatch.setenv("STRATA_CACHE", str(TINY_TEST_CACHE))
    path = resolve_model_dir(config_from_dict({"model": "tiny:arch=qwen3_moe,layers=2,hidden=32"}))
    conf = json.loads((path / "config.json").read_text())
    assert conf["architectures"] == ["Qwen3MoeForCausalLM"] and conf["num_hidden_layers"] == 2


def test_a_path_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        resolve_model_dir(config_from_dict({"model": str(tmp_path)}))
    with pytest.raises(ConfigError, match="is not a file"):
        resolve_model_dir(config_from_dict({"model": str(tmp_path / "x.gguf")}))
