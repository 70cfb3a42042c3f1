"""llama.cpp's own HTTP server (`llama-server`), built from the llama.cpp sources that llama-cpp-python's sdist
vendors, for the `llama-server` peer of `strata bench peers`. A build-time tool of the benchmark only: cmake and a
C++ compiler build it, and nothing that installs, tests or serves Strata needs either.

    python -m stages.llama_server build [--version V] [--jobs N]   prints the binary's path (builds it if absent)
    python -m stages.llama_server path [--json FILE]               {"binary": path} or {"missing": note}
    python -m stages.bench_peers build-llama-server                the same build, from the peers' module

Rules:
- The binary is `<cache>/llama-server-<version>/llama-server`, <cache> being stages.tiny.tiny_cache_dir()
  ($STRATA_CACHE, else ~/.cache/strata); <version> is llama-cpp-python's (LLAMA_CPP_PYTHON, the version whose
  llama.cpp the in-process llama.cpp peer runs).
- A build is idempotent: with the binary in place it builds nothing and prints the path. It works in
  `<cache>/llama-server-<version>.build/` and moves the binary into place last (os.replace), so a failed or
  interrupted build leaves no binary behind; the next build reuses what the last one downloaded and compiled.
- The build is CPU only, Release, static libraries (the binary needs no .so beside it), GGML_NATIVE (this CPU's
  instruction set: a binary is for the machine that built it), no curl, OpenSSL or web UI download; only the
  `llama-server` target is built.
- Every failure raises BuildError naming the step that failed (no cmake, no compiler, the download, configure,
  compile) and the end of that step's output; the sources come from PyPI through pip, nothing else is fetched.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections import deque
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"
BUILD_COMMAND = "python -m stages.bench_peers build-llama-server"
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON", "-DGGML_CCACHE=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
)


class BuildError(RuntimeError):
    """A step of the build failed; the message names the step and ends with its output's tail."""


def cache_root() -> Path:
    from stages.tiny import tiny_cache_dir

    return tiny_cache_dir()


def binary_path(version: str = LLAMA_CPP_PYTHON) -> Path:
    """Where the built binary lives (it may not exist)."""
    return cache_root() / f"llama-server-{version}" / "llama-server"


def find_binary(version: str = LLAMA_CPP_PYTHON) -> Path | None:
    """The built binary, or None when it was never built."""
    path = binary_path(version)
    return path if path.is_file() and os.access(path, os.X_OK) else None


def _run(step: str, cmd: list[str], cwd: Path | None = None) -> None:
    """Run one build step, its output streamed to our stderr; raise BuildError (with the output's tail) when it
    fails."""
    print(f"llama-server build: {step}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    tail: deque[str] = deque(maxlen=40)
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stderr.write(line)
        tail.append(line)
    if proc.wait() != 0:
        raise BuildError(f"{step} failed (exit code {proc.returncode}): {' '.join(cmd)}\n{''.join(tail)}")


def _tools() -> str:
    """The cmake to use; BuildError when cmake or a C++ compiler is missing."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise BuildError("cmake is not installed (pip install cmake, or your system's package); it is needed only "
                         "to build llama-server for the benchmark")
    if not any(shutil.which(cxx) for cxx in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if cxx):
        raise BuildError("no C++ compiler found (g++ or clang++, or set CXX); it is needed only to build "
                         "llama-server for the benchmark")
    return cmake


def _sources(work: Path, version: str) -> Path:
    """vendor/llama.cpp of llama-cpp-python's sdist, downloaded with pip and unpacked under `work`."""
    src = work / "llama.cpp"
    if (src / "CMakeLists.txt").exists():
        return src
    dl = work / "sdist"
    tarballs = sorted(dl.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not tarballs:
        _run("download the sources", [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                                      "-d", str(dl), f"llama-cpp-python=={version}"])
        tarballs = sorted(dl.glob(f"llama_cpp_python-{version}.tar.gz"))
        if not tarballs:
            raise BuildError(f"download the sources: pip wrote no llama_cpp_python-{version}.tar.gz into {dl}")
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    tmp = work / "llama.cpp.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"llama-server build: unpack {prefix} from {tarballs[0].name}", file=sys.stderr, flush=True)
    with tarfile.open(tarballs[0]) as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix) and len(m.name) > len(prefix):
                m.name = m.name[len(prefix):]
                members.append(m)
        if not members:
            raise BuildError(f"unpack the sources: {tarballs[0]} has no {prefix}")
        tar.extractall(tmp, members=members, filter="data")
    tmp.rename(src)
    return src


def build(version: str = LLAMA_CPP_PYTHON, jobs: int | None = None) -> Path:
    """Build llama-server (module docstring) unless it is built; return the binary's path."""
    found = find_binary(version)
    if found is not None:
        return found
    cmake = _tools()
    target = binary_path(version)
    work = target.parent.with_name(target.parent.name + ".build")
    work.mkdir(parents=True, exist_ok=True)
    src = _sources(work, version)
    build_dir = work / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") and not (build_dir / "Makefile").exists() else []
    _run("configure (cmake)", [cmake, "-S", str(src), "-B", str(build_dir), *generator, *CMAKE_OPTIONS])
    _run("compile (cmake --build)", [cmake, "--build", str(build_dir), "--target", "llama-server",
                                     "-j", str(jobs or os.cpu_count() or 1)])
    built = build_dir / "bin" / "llama-server"
    if not built.is_file():
        raise BuildError(f"compile (cmake --build): the build finished but wrote no {built}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name("llama-server.partial")
    shutil.copy2(built, partial)
    os.replace(partial, target)
    return target


def missing_note(version: str = LLAMA_CPP_PYTHON) -> str:
    return f"llama-server is not built (no {binary_path(version)}); build it with `{BUILD_COMMAND}`"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stages.llama_server")
    p.add_argument("cmd", choices=["build", "path"])
    p.add_argument("--version", default=LLAMA_CPP_PYTHON, help="llama-cpp-python's version, whose sources to build")
    p.add_argument("--jobs", type=int, default=None, help="compile jobs (default: the CPU count)")
    p.add_argument("--json", default=None, help="path: write the answer as JSON to this file")
    args = p.parse_args(argv)
    if args.cmd == "path":
        found = find_binary(args.version)
        answer = {"binary": str(found)} if found else {"missing": missing_note(args.version)}
        if args.json:
            Path(args.json).write_text(json.dumps(answer))
        else:
            print(answer.get("binary") or answer["missing"])
        return 0 if found or args.json else 1
    try:
        print(build(args.version, args.jobs))
    except BuildError as err:
        print(f"llama-server build: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
