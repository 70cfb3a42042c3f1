"""stages/cpu_build.py rule 3: a library is rebuilt when its source or a csrc/ header it includes changes, and the
build it replaces is removed (the directory and file rules: tests/stages/test_cpu_attention.py)."""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess

import pytest

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


def _vectorized_lines(source, tmp_path) -> set[int]:
    """The lines of `source` where gcc, with the build's flags, reports a loop turned into vector code."""
    done = subprocess.run([os.environ.get("CC", "gcc"), *cpu_build.FLAGS, f"-I{cpu_build.CSRC}", str(source), "-o",
                           str(tmp_path / "probe.so"), "-fopt-info-vec-optimized"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.findall(rf"^{re.escape(str(source))}:(\d+):\d+: optimized: loop vectorized", done.stderr, re.M)
    return {int(n) for n in found}


def test_loops_that_call_exp_f_vectorize(tmp_path):
    """Rule 1's -fno-trapping-math: a loop calling csrc/cpu_exp.h's exp_f (its clamp compares floats), and the SiLU
    product of csrc/cpu_layer_ops.c, compile into vector code with the build's flags (without the flag gcc leaves
    both scalar: "control flow in loop")."""
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        pytest.skip("no C compiler")
    if "gcc" not in subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.lower():
        pytest.skip(f"{cc} is not gcc: the test reads gcc's vectorizer report (-fopt-info-vec)")
    probe = tmp_path / "probe.c"
    probe.write_text('#include "cpu_exp.h"\n'
                     "void softmax_part(const float *s, float *o, float top, int n) {\n"
                     "    for (int i = 0; i < n; i++) o[i] = exp_f(s[i] - top);\n"
                     "}\n")
    assert 3 in _vectorized_lines(probe, tmp_path)
    source = cpu_build.CSRC / "cpu_layer_ops.c"
    silu = [i + 1 for i, line in enumerate(source.read_text().splitlines()) if "exp_f(-g[i])" in line]
    assert len(silu) == 1 and silu[0] in _vectorized_lines(source, tmp_path)
