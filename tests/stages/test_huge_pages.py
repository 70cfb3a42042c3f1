"""stages/huge_pages.py: packed weights collapsed into 2 MiB pages, read back from /proc/self/smaps."""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from stages import huge_pages, packed_linear
from stages.packed_linear import PackedLinear

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (the bracketed word), or None where there is none."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


def kernel() -> tuple[int, int]:
    major, minor = os.uname().release.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def packed(n: int = 2048, k: int = 2048) -> tuple[PackedLinear, torch.Tensor]:
    if not packed_linear.available(torch.float32):
        pytest.skip("no oneDNN packed weights in this torch")
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3)) / k ** 0.5
    return PackedLinear(w), w


def test_interior_is_the_whole_huge_pages_inside_a_range():
    page = huge_pages.PAGE
    assert huge_pages.interior(0, 3 * page) == (0, 3 * page)
    assert huge_pages.interior(1, 3 * page) == (page, 3 * page)
    assert huge_pages.interior(page - 64, 128) == (page, page)  # empty: no whole page inside
    assert huge_pages.interior(page - 64, page + 128) == (page, 2 * page)
    lo, hi = huge_pages.interior(12345, 5 * page)
    assert lo % page == 0 and hi % page == 0 and 12345 <= lo < hi <= 12345 + 5 * page


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_a_packed_weight_sits_in_huge_pages_and_multiplies_the_same():
    if thp_mode() in (None, "never"):
        pytest.skip(f"transparent huge pages are {thp_mode() or 'absent'} here")
    w, plain = packed()
    address, nbytes = w.memory
    lo, hi = huge_pages.interior(address, nbytes)
    assert hi - lo >= 7 * huge_pages.PAGE  # 16 MiB hold at least 7 whole huge pages
    if kernel() < (6, 1):
        pytest.skip("this kernel has no MADV_COLLAPSE (khugepaged collapses the advised pages later)")
    assert w.huge == hi - lo
    held, total = packed_linear.huge_resident([w])
    assert total == nbytes
    assert held >= w.huge  # read back from smaps, not taken from advise's answer
    x = torch.randn(5, plain.shape[1], generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        for rows in (1, 5):
            got = w(x[:rows]).double()
            want = F.linear(x[:rows].double(), plain.double())
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_switched_off_nothing_is_advised(monkeypatch):
    region = mmap.mmap(-1, 8 * huge_pages.PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # fresh, never advised
    region.write(b"\x01" * len(region))  # faulted in, in small pages
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    monkeypatch.setenv("STRATA_HUGE_PAGES", "0")
    assert huge_pages.advise(address, len(region)) == 0
    if thp_mode() == "madvise":  # only advised memory gets huge pages: this region's stay small
        assert huge_pages.resident([(address, len(region))]) == 0
    monkeypatch.setenv("STRATA_HUGE_PAGES", "1")
    lo, hi = huge_pages.interior(address, len(region))
    done = huge_pages.advise(address, len(region))
    if thp_mode() in (None, "never") or done == 0:
        return  # nothing to compare against here
    assert done == hi - lo and huge_pages.resident([(address, len(region))]) >= done
    assert region[:4] == b"\x01" * 4 and region[-4:] == b"\x01" * 4  # the values stay


def test_resident_counts_only_the_ranges_asked_about():
    assert huge_pages.resident([]) == 0
    assert huge_pages.resident([(4096, 4096)]) == 0  # the zero page: never mapped
