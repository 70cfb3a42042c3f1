"""Fixtures shared by every test package.

`tiny_model_factory(arch="qwen3", **kw) -> Path` returns a tiny checkpoint directory (see
`stages.tiny.make_tiny_model` for the keywords; its defaults fill the rest). Checkpoints are built once
per spec into a cache under the system temp dir, keyed by the spec and the tiny module's source, and
shared by all tests, sessions and concurrent test processes (the build is atomic). Treat the directories
as read-only.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # plain `pytest` (not `python -m pytest`) from anywhere
    sys.path.insert(0, str(ROOT))

TINY_TEST_CACHE = Path(tempfile.gettempdir()) / "strata-test-tiny"


@pytest.fixture(scope="session")
def tiny_model_factory() -> Callable[..., Path]:
    from stages.tiny import ensure_tiny

    def factory(arch: str = "qwen3", **kw: Any) -> Path:
        return ensure_tiny({"arch": arch, **kw}, cache_dir=TINY_TEST_CACHE)

    return factory
