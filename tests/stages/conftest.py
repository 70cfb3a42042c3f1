"""The `local` fixture: in-process stage runners (tests/stages/harness.py), closed after each test."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.stages.harness import Local, make_cfg


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("qwen3", layers=4, hidden=64, heads=4, kv_heads=2, seed=3)


@pytest.fixture
def local(model_dir, tmp_path):
    """local(ranges, pool=True, **engine) -> Local over the module's `model_dir`."""
    made: list[Local] = []

    def make(ranges: list[list[int]], pool: bool = True, **engine: object) -> Local:
        made.append(Local(make_cfg(model_dir, ranges, pool, **engine), tmp_path, tag=str(len(made)) if made else ""))
        return made[-1]

    yield make
    for m in made:
        m.close()
