"""Decode attention of a CPU stage through the chunk tables, in C (csrc/cpu_paged_decode.c).

The torch reference (`attention.paged_attention`) reads a decode group's context as a view when it is one run of
chunks and gathers it into a scratch buffer otherwise, then calls `scaled_dot_product_attention` on K/V whose
kv heads are interleaved cell by cell. On a CPU both halves cost more than the bytes: the gather copies the whole
context of every layer, and SDPA over the interleaved rows reads at a fraction of the memory bus (the 104M
qwen3 at 12,288 cells: 68 ms per decode token, 48 of them attention; docs/BENCHMARKS.md). The kernel reads each
K and V row of the pool once, in place, through the tables.

Rules:
1. Only for a decode group (one query token per entry) on a CPU pool of float32 or int8 K/V (int8: the value
   times its per-cell, per-head scale, as the reference dequantizes; each row converted once per read, at most
   MAX_ROW values) with float32 queries; every other group, dtype or device goes through the torch reference,
   unchanged.
2. Same call and result as the reference for that group: entry e sees cells [lo_e, ctx_e), lo_e = max(0, ctx_e -
   window) under a sliding window; query head h reads kv head h // (heads / kv_heads). Values agree with the
   reference to float32 rounding (the order of the sums differs); the tests and the first-use check hold it to
   that.
3. An entry's cells are cut into parts, scored in blocks inside one chunk with an online softmax, and the parts
   merged by their maxima (flash-decoding), so one long conversation still uses every thread: a part is the
   group's cells over 4 parts per thread, within [MIN_PART_CELLS, MAX_PART_CELLS], in whole blocks of 64.
   The threads are torch's (`torch.get_num_threads()`), run by the libgomp torch has loaded.
4. The library is compiled at first use with the C compiler (`$CC`, else `gcc`) for this CPU (`-march=native`)
   into a private cache directory (`$STRATA_KERNEL_CACHE`, else `$XDG_CACHE_HOME/strata/kernels`, else
   `~/.cache/strata/kernels`): created 0700, used only when it is a real directory owned by this user and closed
   to others, the library written under a fresh name (created exclusively, 0600) and renamed into place, loaded
   only when it is a regular file owned by this user that no one else can write. Its name carries a hash of the
   source, the compiler's version, the flags and the CPU, so a changed source or machine builds anew (and the
   builds of other hashes are removed).
5. Before first use the library's result is compared with the reference on a seeded pool (several entries,
   scattered chunks, a sliding window); a compiler that is missing or fails, a refused cache, or a wrong result
   leaves `available()` False with `unavailable_reason()` saying why (logged once), and the reference runs.
   `STRATA_CPU_KERNELS=0` turns the kernel off.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import stat
import subprocess
import tempfile
from functools import lru_cache
from itertools import accumulate
from pathlib import Path

import torch

from stages.batch import AttentionGroup, StepBatch
from stages.kv_cache import KVCache

log = logging.getLogger("strata.stage")

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_paged_decode.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
SYMBOL = "strata_paged_decode"
MIN_PART_CELLS, MAX_PART_CELLS = 128, 1024  # rule 3
BLOCK = 64  # BLOCK in the source
MAX_HEADS = 128  # MAX_HEADS in the source
MAX_ROW = 8192  # MAX_ROW in the source: kv_heads * head_dim of an int8 pool
COMPILE_TIMEOUT_S = 120

_P, _I = ctypes.c_void_p, ctypes.c_int
_ARGTYPES = [_P, _P, _P, _P, _P, _I, _P, ctypes.c_int64, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _I, _P, _P,
             _P, _I]


class KernelRefused(RuntimeError):
    """The library cannot be built, trusted or checked here (rules 4-5)."""


def cache_dir() -> Path:
    """Rule 4's directory."""
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
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build() -> Path:
    """The compiled library (rule 4): the cached one, else compiled now."""
    cc = os.environ.get("CC", "gcc")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, _compiler_id(cc).encode(), " ".join(FLAGS).encode(),
                                     _cpu_id().encode()])).hexdigest()[:16]
    directory = _private_dir(cache_dir())
    lib = directory / f"cpu_paged_decode-{key}.so"
    if _trusted_file(lib):
        return lib
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=directory)  # O_EXCL, 0600
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            raise KernelRefused(f"{cc} failed on {SOURCE.name}: {done.stderr.strip()[-400:]}")
        os.chmod(tmp, 0o600)
        os.replace(tmp, lib)
        for old in directory.glob("cpu_paged_decode-*.so"):  # builds of other sources or CPUs
            if old != lib:
                old.unlink(missing_ok=True)
    except subprocess.TimeoutExpired:
        raise KernelRefused(f"{cc} took over {COMPILE_TIMEOUT_S} s on {SOURCE.name}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _trusted_file(lib)
    return lib


@lru_cache(maxsize=1)
def _library() -> tuple[object | None, str | None]:
    """(the kernel function, None), or (None, why not): built, loaded and checked once per process."""
    if os.environ.get("STRATA_CPU_KERNELS", "1") == "0":
        return None, "STRATA_CPU_KERNELS=0"
    try:
        fn = getattr(ctypes.CDLL(str(build())), SYMBOL)
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
        _self_check(fn)
    except (RuntimeError, ValueError, OSError, AttributeError) as exc:  # KernelRefused is a RuntimeError
        log.warning("CPU decode attention kernel unavailable, using the torch reference: %s", exc)
        return None, str(exc)
    return fn, None


def available() -> bool:
    return _library()[0] is not None


def unavailable_reason() -> str | None:
    return _library()[1]


def usable(kv: KVCache, q: torch.Tensor) -> bool:
    """Rule 1 for this pool and these queries."""
    return (kv.device.type == "cpu" and q.device.type == "cpu" and q.dtype == torch.float32
            and kv.dtype in (torch.float32, torch.int8) and q.shape[1] <= MAX_HEADS
            and (not kv.quantized or kv.kv_heads * kv.head_dim <= MAX_ROW) and available())


def paged_decode(q: torch.Tensor, kv: KVCache, layer: int, batch: StepBatch, index: int, scale: float,
                 window: int | None) -> torch.Tensor:
    """Rule 2: `q [G, heads, head_dim]` of the decode group `batch.groups[index]` -> `[G, heads * head_dim]`.
    The group's plan (its slots, contexts and parts) is made once per step and shared by every layer."""
    key = ("cpu_decode", id(kv), index, window)
    if key not in batch.cache:
        batch.cache[key] = Plan(batch.groups[index], window, torch.get_num_threads())
    return _run(_library()[0], q, kv, layer, batch.cache[key], scale)


def part_cells(cells: int, threads: int) -> int:
    """Rule 3: the part size for a group reading `cells` in all over `threads` threads."""
    per = -(-cells // (4 * threads))
    return min(MAX_PART_CELLS, max(MIN_PART_CELLS, -(-per // BLOCK) * BLOCK))


class Plan:
    """A decode group's arguments to the kernel: slots, contexts, first visible cells (int32 [3, G]), parts."""

    def __init__(self, g: AttentionGroup, window: int | None, threads: int, part: int | None = None) -> None:
        if g.kind != "decode":
            raise ValueError(f"the CPU decode kernel takes a decode group, not a {g.kind} one")
        lens = list(g.contexts)
        los = [max(0, c - window) if window is not None else 0 for c in lens]
        self.entries, self.threads = len(lens), threads
        self.part = part or part_cells(sum(lens) - sum(los), threads)
        counts = [-(-(c - lo // self.part * self.part) // self.part) for c, lo in zip(lens, los)]
        first = [0, *accumulate(counts)]
        self.n_parts = first[-1]
        self.ints = torch.tensor([list(g.slots), lens, los], dtype=torch.int32)
        self.part_first = torch.tensor(first, dtype=torch.int32)


def _run(fn, q: torch.Tensor, kv: KVCache, layer: int, plan: Plan, scale: float) -> torch.Tensor:
    n, heads, head_dim = q.shape
    if n != plan.entries:
        raise ValueError(f"the decode group has {plan.entries} entries, the queries {n} rows")
    work = kv.scratch("cpu_decode_work", (plan.n_parts, heads * (head_dim + 2)), torch.float32)
    q = q.contiguous()
    out = torch.empty(n, heads, head_dim, dtype=torch.float32)
    k, v, tables = kv.k[layer], kv.v[layer], kv.tables
    scales = (kv.k_scale[layer], kv.v_scale[layer]) if kv.quantized else ()
    if not all(t.is_contiguous() for t in (k, v, tables, *scales)):
        raise ValueError("the CPU decode kernel needs contiguous pool arrays and tables")
    k_scale, v_scale = (t.data_ptr() for t in scales) if scales else (None, None)
    ints = plan.ints
    rc = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), k_scale, v_scale, int(kv.quantized), tables.data_ptr(),
            tables.shape[1], ints[0].data_ptr(), ints[1].data_ptr(), ints[2].data_ptr(), n, kv.kv_heads,
            heads // kv.kv_heads, head_dim, kv.chunk_cells, float(scale), plan.part, plan.part_first.data_ptr(),
            work.data_ptr(), out.data_ptr(), plan.threads)
    if rc != 0:
        raise ValueError(f"the CPU decode kernel refused {n} entries x {heads} heads x {head_dim}")
    return out.view(n, heads * head_dim)


def _self_check(fn) -> None:
    """Rule 5: the library against the reference on a seeded pool."""
    from stages.attention import paged_attention, write_kv

    g = torch.Generator().manual_seed(0)
    c, chunks, kv_heads, heads, head_dim = 16, 40, 2, 6, 32
    batch = StepBatch.from_slots([[0, 190, 1, 1], [1, 5, 1, 1], [2, 77, 1, 1]])
    for kv_dtype in (torch.float32, "int8"):
        kv = KVCache(1, chunks, c, kv_heads, head_dim, kv_dtype, "cpu", n_slots=3, table_chunks=12)
        order = torch.randperm(chunks, generator=g).tolist()
        for s in range(3):
            kv.set_table(s, order[s * 12:(s + 1) * 12])
        write_kv(kv, 0, StepBatch.from_slots([[0, 0, 190, 0], [1, 0, 5, 0], [2, 0, 77, 0]]),  # the contexts
                 torch.randn(272, kv_heads, head_dim, generator=g), torch.randn(272, kv_heads, head_dim, generator=g))
        q = torch.randn(3, heads, head_dim, generator=g)
        write_kv(kv, 0, batch, torch.randn(3, kv_heads, head_dim, generator=g),
                 torch.randn(3, kv_heads, head_dim, generator=g))
        with torch.inference_mode():
            for window in (None, 50):
                want = paged_attention(q, kv, 0, batch, 0.2, window, cpu_kernel=False)
                got = _run(fn, q, kv, 0, Plan(batch.groups[0], window, 2, part=32), 0.2)  # several parts merged
                if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                    raise KernelRefused(f"the compiled kernel disagrees with the torch reference by "
                                        f"{(got - want).abs().max().item():.2e} ({kv_dtype} pool, window {window})")
