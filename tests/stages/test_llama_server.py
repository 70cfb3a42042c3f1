"""stages/llama_server.py without building anything: where the binary lives, that a build with the binary in
place runs nothing, and that a missing tool fails with a message naming it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages import llama_server


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_binary_lives_in_the_cache_by_version(cache: Path) -> None:
    assert llama_server.binary_path() == cache / f"llama-server-{llama_server.LLAMA_CPP_PYTHON}" / "llama-server"
    assert llama_server.binary_path("9.9.9") == cache / "llama-server-9.9.9" / "llama-server"
    assert llama_server.find_binary() is None
    assert llama_server.BUILD_COMMAND in llama_server.missing_note()


def _fake_binary(cache: Path) -> Path:
    path = llama_server.binary_path()
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_a_build_with_the_binary_in_place_runs_nothing(cache: Path, monkeypatch, capsys) -> None:
    path = _fake_binary(cache)

    def no_step(*a, **kw):  # noqa: ANN002, ANN003
        raise AssertionError("a build step ran")

    monkeypatch.setattr(llama_server.subprocess, "Popen", no_step)
    assert llama_server.find_binary() == path
    assert llama_server.build() == path
    assert llama_server.main(["build"]) == 0 and capsys.readouterr().out.strip() == str(path)


def test_path_answers_with_the_binary_or_the_build_command(cache: Path, tmp_path: Path, capsys) -> None:
    answer = tmp_path / "answer.json"
    assert llama_server.main(["path", "--json", str(answer)]) == 0
    assert json.loads(answer.read_text()) == {"missing": llama_server.missing_note()}
    assert llama_server.main(["path"]) == 1 and llama_server.BUILD_COMMAND in capsys.readouterr().out
    path = _fake_binary(cache)
    assert llama_server.main(["path", "--json", str(answer)]) == 0
    assert json.loads(answer.read_text()) == {"binary": str(path)}


def test_a_missing_tool_is_named(cache: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(llama_server.shutil, "which", lambda name: None)
    with pytest.raises(llama_server.BuildError, match="cmake is not installed .pip install cmake"):
        llama_server.build()
    assert llama_server.main(["build"]) == 1 and "cmake is not installed" in capsys.readouterr().err
    monkeypatch.setattr(llama_server.shutil, "which", lambda name: "/usr/bin/cmake" if name == "cmake" else None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(llama_server.BuildError, match="no C\\+\\+ compiler"):
        llama_server.build()
    assert not llama_server.binary_path().exists()


def test_a_failed_step_is_named_with_its_output(cache: Path) -> None:
    with pytest.raises(llama_server.BuildError, match="configure .cmake. failed .exit code 1.*\\nboom"):
        llama_server._run("configure (cmake)", ["sh", "-c", "echo boom; exit 1"])
