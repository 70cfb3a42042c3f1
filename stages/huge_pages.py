"""A CPU stage's packed weights in 2 MiB pages (Linux transparent huge pages).

A decode step streams every weight of the stage from memory once. In 4 KiB pages that is one TLB entry per 4 KiB
read (100,000 for the 104M qwen3's 415 MB), each a page walk once the TLB has cycled; in 2 MiB pages, 200. Measured on the 48 products of one decode step of that
model, one process holding the same weights twice, one copy collapsed into huge pages, interleaved rounds:
1 row 5-12% faster, 8 rows 4-7% (docs/BENCHMARKS.md, "Few rows straight from the packed weights").

Rules:
1. `advise(address, nbytes)` is called on a weight's packed memory once it is written: the whole 2 MiB pages
   inside it are advised MADV_HUGEPAGE, then collapsed at once (MADV_COLLAPSE, Linux 6.1 and later). The memory
   keeps its address and its values; only the pages under it change.
2. The edges of a weight that do not fill a 2 MiB page stay in small pages (about a quarter of the 104M qwen3's
   bytes: its smaller weights are not 2 MiB aligned). Memory torch allocated for anything else is left alone.
3. What the system refuses is not an error: a kernel without MADV_COLLAPSE leaves the advised pages to
   khugepaged (collapsed over the next minutes), a system whose transparent huge pages are `never` or that is
   not Linux leaves them small. `advise` returns the bytes collapsed now.
4. `STRATA_HUGE_PAGES=0` turns it off. The stage logs how much of its packed weights is in huge pages, read back
   from /proc/self/smaps (`resident`), not assumed.
"""
from __future__ import annotations

import ctypes
import os
import sys
from functools import lru_cache

PAGE = 2 << 20  # a huge page on x86-64 and arm64 with 4 KiB base pages
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("STRATA_HUGE_PAGES", "1") != "0"


@lru_cache(maxsize=1)
def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def interior(address: int, nbytes: int) -> tuple[int, int]:
    """The whole 2 MiB pages inside [address, address + nbytes): (start, end), empty when start >= end."""
    return -(-address // PAGE) * PAGE, (address + nbytes) // PAGE * PAGE


def advise(address: int, nbytes: int) -> int:
    """Rule 1: put the whole huge pages inside the range into huge pages; the bytes collapsed now (rule 3)."""
    lo, hi = interior(address, nbytes)
    if hi <= lo or not enabled():
        return 0
    madvise = _madvise()
    if madvise(lo, hi - lo, MADV_HUGEPAGE) != 0:
        return 0  # THP off in this kernel, or not for this memory
    return hi - lo if madvise(lo, hi - lo, MADV_COLLAPSE) == 0 else 0


def resident(ranges: list[tuple[int, int]]) -> int:
    """Bytes of the (address, nbytes) ranges that sit in huge pages now, from /proc/self/smaps (rule 4): the
    AnonHugePages of each mapping, counted up to the part of the mapping the ranges cover."""
    try:
        text = open("/proc/self/smaps", encoding="ascii", errors="replace").read()
    except OSError:
        return 0
    maps: list[tuple[int, int, int]] = []
    start = end = 0
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            a, b = head.split("-")
            start, end = int(a, 16), int(b, 16)
        elif head == "AnonHugePages:":
            kib = int(line.split()[1])
            if kib:
                maps.append((start, end, kib << 10))
    total = 0
    for start, end, huge in maps:
        covered = sum(max(0, min(end, a + n) - max(start, a)) for a, n in ranges)
        total += min(huge, covered)
    return total
