"""Compiling, caching and trusting the C libraries of a CPU stage (stages/cpu_attention.py, stages/cpu_ops.py).

Rules:
1. A library is compiled at first use with the C compiler (`$CC`, else `gcc`) for this CPU (`-march=native`),
   with `-fno-trapping-math` (no library reads the floating-point exception flags; without it gcc keeps a float
   comparison in a loop as a branch, so exp_f's clamp left the SiLU and softmax loops scalar: the SiLU-gated
   product of a 128-token piece of the 104M qwen3, 2 threads, 1.1 ms, vectorized 0.38 ms; the flag allows no
   reordering of arithmetic, so values are unchanged), into a private cache directory (`$STRATA_KERNEL_CACHE`,
   else `$XDG_CACHE_HOME/strata/kernels`, else `~/.cache/strata/kernels`): created 0700, used only when it is a
   real directory owned by this user and closed to others.
2. The library is written under a fresh name (created exclusively, 0600) and renamed into place, and loaded only
   when it is a regular file owned by this user that no one else can write.
3. Its name is `<stem>-<hash>.so`, the hash over the source, the files of csrc/ it includes (`#include "..."`,
   found in csrc/ wherever the source lies) and those they include in turn, the compiler's version, the flags and
   the CPU, so a changed source, header or machine builds anew; the builds of the same stem with other hashes are
   removed.
4. Anything that stops a build (no compiler, a failed compile, a refused directory or file) is `KernelRefused`
   with the reason; the caller falls back to its torch reference. `STRATA_CPU_KERNELS=0` turns every library
   off (`disabled()`).
5. `load` opens a built library, types its functions and runs the caller's first-use check; any failure there
   too is the reason the torch code runs, logged once.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from pool.computable import cpu_flags

log = logging.getLogger("strata.stage")

CSRC = Path(__file__).resolve().parent.parent / "csrc"
FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared")  # and -I csrc/
COMPILE_TIMEOUT_S = 120


class KernelRefused(RuntimeError):
    """A library cannot be built, trusted or checked here."""


def disabled() -> bool:
    """Rule 4's switch."""
    return os.environ.get("STRATA_CPU_KERNELS", "1") == "0"


def cache_dir() -> Path:
    """Rule 1's directory."""
    if os.environ.get("STRATA_KERNEL_CACHE"):
        return Path(os.environ["STRATA_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "strata" / "kernels"


def _private_dir(path: Path) -> Path:
    """`path`, created 0700 when missing; refused unless a real directory of this user closed to others."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise KernelRefused(f"kernel cache {path} is not a private directory of this user (mode "
                            f"{stat.filemode(st.st_mode)}, owner {st.st_uid}); set STRATA_KERNEL_CACHE")
    return path


def _trusted_file(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise KernelRefused(f"kernel library {path} is not a regular file of this user closed to others")
    return True


def _compiler_id(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelRefused(f"no C compiler ({cc}): {exc}") from None
    return out.splitlines()[0] if out else cc


def _cpu_id() -> str:
    return " ".join(sorted(cpu_flags())) or platform.processor() or platform.machine()


def _included(text: bytes, seen: dict[str, bytes] | None = None) -> dict[str, bytes]:
    """The sources of csrc/ that `text` includes (`#include "..."`), and those they include, in order: {name: text}."""
    seen = {} if seen is None else seen
    for name in re.findall(rb'^#include "([^"/]+)"', text, re.M):
        if name.decode() not in seen:
            seen[name.decode()] = body = (CSRC / name.decode()).read_bytes()
            _included(body, seen)
    return seen


def build(source: Path, stem: str, flags: tuple[str, ...] = ()) -> Path:
    """The compiled library of `source` (rules 1-3): the cached one, else compiled now; `flags` after FLAGS (the
    tests build a library without AVX-512 with them: `-mno-avx512f`)."""
    cc = os.environ.get("CC", "gcc")
    text = source.read_bytes()
    key = hashlib.sha256(b"\0".join([text, *_included(text).values(), _compiler_id(cc).encode(),
                                     " ".join(FLAGS + flags).encode(), _cpu_id().encode()])).hexdigest()[:16]
    directory = _private_dir(cache_dir())
    lib = directory / f"{stem}-{key}.so"
    if _trusted_file(lib):
        return lib
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=directory)  # O_EXCL, 0600
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, *flags, f"-I{CSRC}", str(source), "-o", tmp], capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            raise KernelRefused(f"{cc} failed on {source.name}: {done.stderr.strip()[-400:]}")
        os.chmod(tmp, 0o600)
        os.replace(tmp, lib)
        for old in directory.glob(f"{stem}-*.so"):  # builds of other sources or CPUs
            if old != lib:
                old.unlink(missing_ok=True)
    except subprocess.TimeoutExpired:
        raise KernelRefused(f"{cc} took over {COMPILE_TIMEOUT_S} s on {source.name}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _trusted_file(lib)
    return lib


def load(build_library: Callable[[], Path], signatures: dict[str, list], check: Callable[[dict], None],
         what: str) -> tuple[dict | None, str | None]:
    """Rule 5: ({name: function}, None), each function of `signatures` given its argument types and an int
    result and the set passed through `check` (which raises on a wrong result); or (None, why not)."""
    if disabled():
        return None, "STRATA_CPU_KERNELS=0"
    try:
        lib = ctypes.CDLL(str(build_library()))
        fns = {}
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            fns[name] = fn
        check(fns)
    except (RuntimeError, ValueError, OSError, AttributeError) as exc:  # KernelRefused is a RuntimeError
        log.warning("%s unavailable, using the torch code: %s", what, exc)
        return None, str(exc)
    return fns, None
