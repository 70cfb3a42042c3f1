"""stages/cpu_build.py rule 3: a library is rebuilt when its source or a csrc/ header it includes changes, and the
build it replaces is removed (the directory and file rules: tests/stages/test_cpu_attention.py)."""
from __future__ import annotations

import ctypes

from stages import cpu_build


def test_a_changed_header_builds_a_new_library_and_removes_the_old(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "part.h").write_text("static inline int part(void) { return 1; }\n")
    source = tmp_path / "lib.c"
    source.write_text('#include "part.h"\nint answer(void) { return part(); }\n')
    monkeypatch.setattr(cpu_build, "CSRC", csrc)
    monkeypatch.setenv("STRATA_KERNEL_CACHE", str(tmp_path / "kernels"))
    first = cpu_build.build(source, "lib")
    assert cpu_build.build(source, "lib") == first
    assert ctypes.CDLL(str(first)).answer() == 1
    (csrc / "part.h").write_text("static inline int part(void) { return 2; }\n")
    second = cpu_build.build(source, "lib")
    assert second != first and not first.exists()
    assert ctypes.CDLL(str(second)).answer() == 2
    source.write_text('#include "part.h"\nint answer(void) { return part() + 1; }\n')
    third = cpu_build.build(source, "lib")
    assert third != second and [p.name for p in (tmp_path / "kernels").iterdir()] == [third.name]
