"""stages/cpu_build.py rule 3: a library is rebuilt when its source or a csrc/ header it includes changes, and the
build it replaces is removed (the directory and file rules: tests/stages/test_cpu_attention.py)."""
from __future__ import annotations

import ctypes

from stages import cpu_build


def _sources(tmp_path, monkeypatch, csrc_files: dict[str, str], source: str):
    """csrc/ holding `csrc_files` and lib.c holding `source` under tmp_path, the build pointed at them and at a
    fresh kernel cache: (csrc, lib.c)."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for name, text in csrc_files.items():
        (csrc / name).write_text(text)
    lib = tmp_path / "lib.c"
    lib.write_text(source)
    monkeypatch.setattr(cpu_build, "CSRC", csrc)
    monkeypatch.setenv("STRATA_KERNEL_CACHE", str(tmp_path / "kernels"))
    return csrc, lib


def test_a_changed_header_builds_a_new_library_and_removes_the_old(tmp_path, monkeypatch):
    csrc, source = _sources(tmp_path, monkeypatch, {"part.h": "static inline int part(void) { return 1; }\n"},
                            '#include "part.h"\nint answer(void) { return part(); }\n')
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


def test_a_header_included_by_a_header_is_part_of_the_hash(tmp_path, monkeypatch):
    """Rule 3: a source that includes another source (csrc/cpu_decode_layer.c includes cpu_byte_rows.c, which
    includes cpu_isa.h) is built anew when the innermost file changes."""
    csrc, source = _sources(tmp_path, monkeypatch,
                            {"inner.h": "static inline int inner(void) { return 1; }\n",
                             "outer.c": '#include "inner.h"\nstatic int outer(void) { return inner() * 10; }\n'},
                            '#include "outer.c"\nint answer(void) { return outer(); }\n')
    first = cpu_build.build(source, "lib")
    assert ctypes.CDLL(str(first)).answer() == 10
    (csrc / "inner.h").write_text("static inline int inner(void) { return 2; }\n")
    second = cpu_build.build(source, "lib")
    assert second != first and ctypes.CDLL(str(second)).answer() == 20
    assert list(cpu_build._included(source.read_bytes())) == ["outer.c", "inner.h"]


def test_flags_are_part_of_the_hash(tmp_path, monkeypatch):
    """Rule 3: the same source built with other flags is another library (the tests' builds without AVX-512)."""
    _, source = _sources(tmp_path, monkeypatch, {},
                         "int answer(void) {\n#ifdef EXTRA\n    return 2;\n#else\n    return 1;\n#endif\n}\n")
    plain, extra = cpu_build.build(source, "lib"), cpu_build.build(source, "lib", ("-DEXTRA",))
    assert plain != extra and ctypes.CDLL(str(extra)).answer() == 2
