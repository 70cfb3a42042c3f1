"""Few rows multiplied straight from a weight oneDNN has packed (csrc/cpu_packed_rows.c).

A decode step of a CPU stage multiplies a few rows by every weight of the stage, so it is bound by reading the
weights from memory. oneDNN's matmul reads a packed float32 weight for 1 to 4 rows at about half that pace: the
104M qwen3's 49 products of one decode step, weights streamed from memory, 2 threads, AMD EPYC (AVX-512): 1 row
23.1 ms through oneDNN (padded to 4 rows, stages/packed_linear.py rule 5), 11.5 ms here, which is the machine's
read rate of those 415 MB (docs/BENCHMARKS.md, "Few rows straight from the packed weights"). Here the packed memory
itself is read by a kernel that streams each panel once for all the rows of the step: no second copy of a weight.

Rules:
1. Only for float32 weights packed by stages/packed_linear.py, on a CPU with AVX-512 or with AVX2 and FMA
   (csrc/cpu_isa.h: the same sums either way), where oneDNN's packed memory has the layout the kernel reads:
   panels of 64 output columns, k-major, N rounded up to 64 and K to 16. That layout is checked once per process on
   seeded weights (with the kernel's products against F.linear for 1 to MAX_ROWS rows), and again for every weight
   at packing, its size and its whole memory against the plain weight (`panels`), so a weight oneDNN laid out
   otherwise keeps oneDNN for all of its products (with AVX2 and 2 threads oneDNN packs N of 129-192 as panels of
   16 columns, so a weight that narrow stays with it).
2. A product of at most MAX_ROWS rows (a decode step) is computed here; one of more rows (a prefill piece) by
   oneDNN, which multiplies many rows faster from the same memory. MAX_ROWS is 8 on a CPU with AVX-512 and 16 on
   one with AVX2 only, where the kernel's 3-row passes beat oneDNN up to 16 rows (the 104M qwen3's 48 products,
   streamed, AMD EPYC Zen 3: 16 rows 35.9 against 47.8 ms, 24 rows even).
3. Each output is one sum in k order, so a row's values do not depend on the other rows of a step of up to
   MAX_ROWS rows (no padding to a row count, packed_linear's rule 5, is needed); a step of more rows gets
   oneDNN's rounding, which differs from it by float32 rounding.
4. The panels are shared statically by torch's threads (`torch.get_num_threads()`, the libgomp torch loaded).
5. The library is compiled, cached, trusted and checked by the rules of stages/cpu_build.py; a failure leaves
   `available()` False with `unavailable_reason()` and oneDNN multiplies every row. `STRATA_CPU_KERNELS=0` turns
   it off; `STRATA_PACKED_ROWS=N` sets MAX_ROWS (0 turns it off, at most LIMIT_ROWS).
6. A weight's rows can be read back from its panels (`rows`, a gather by torch): the embedding of a stage whose
   lm_head is its embedding table (tied) reads the lm_head's packed memory instead of keeping a plain copy
   (stages/packed_linear.py rule 9).
7. bfloat16 weights too, on a CPU with AVX512_BF16 (`bf16_available()`, checked once as rule 1 checks float32):
   oneDNN's panels there hold pairs of k (`[panels][Kp / 2][64][2]`, K rounded up to 32, the padding zeros,
   checked with the rest of the memory). Each output is one float32 sum over the pairs in order (vdpbf16ps), the
   bias added in float32, rounded to bfloat16 to nearest even; rule 3 holds for it too. oneDNN read the 104M
   qwen3's 48 bfloat16 products at 19-22 GB/s for 1-4 rows (docs/BENCHMARKS.md, "bfloat16 rows").
"""
from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from pool.computable import cpu_flags
from stages import cpu_build
from stages.cpu_build import KernelRefused

log = logging.getLogger("strata.stage")

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_packed_rows.c"
PANEL = 64  # output columns per panel (PANEL in the source)
K_ALIGN = 16  # K rounded up to this in a panel
LIMIT_ROWS = 64  # MAX_ROWS in the source: the most rows one call takes
DEFAULT_ROWS = 8  # rule 2 (1-8 rows: 1.1-2x oneDNN's pace on the machine above; 12 and more: not faster)
AVX2_DEFAULT_ROWS = 16  # rule 2 without AVX-512 (1-16 rows faster than oneDNN, 24 even; docs/BENCHMARKS.md)

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_SIGNATURES = {"strata_packed_rows": [_P, _L, _L, _P, _L, _L, _P, _P, _I], "strata_packed_rows_isa": [],
               "strata_packed_rows_bf16": [_P, _L, _L, _P, _L, _L, _P, _P, _I], "strata_packed_rows_bf16_isa": []}
K_ALIGN_BF16 = 32  # K rounded up to this in a bfloat16 panel (pairs of k)
_KERNEL = {torch.float32: "strata_packed_rows", torch.bfloat16: "strata_packed_rows_bf16"}  # by the weight's dtype


def _max_rows() -> int:
    raw = os.environ.get("STRATA_PACKED_ROWS")
    if raw is None:
        return DEFAULT_ROWS if "avx512f" in cpu_flags() else AVX2_DEFAULT_ROWS  # the width the kernel is built for
    if not raw.strip().isdigit() or int(raw) > LIMIT_ROWS:
        raise ValueError(f"STRATA_PACKED_ROWS must be a whole number of rows from 0 (off) to {LIMIT_ROWS}, "
                         f"got {raw!r}")
    return int(raw)


MAX_ROWS = _max_rows()


@dataclass(frozen=True)
class Panels:
    """A packed weight's memory in rule 1's layout: `packed` (kept alive here) at `address`, [n, k], k padded to kp;
    `raw` the same memory as a view: float32 [panels, kp, PANEL], bfloat16 [panels, kp / 2, PANEL, 2]."""
    packed: torch.Tensor
    address: int
    n: int
    k: int
    kp: int
    raw: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.raw.dtype


def build() -> Path:
    return cpu_build.build(SOURCE, "cpu_packed_rows")


@lru_cache(maxsize=1)
def _library() -> tuple[dict[str, object] | None, str | None]:
    """({name: function}, None), or (None, why not): built, loaded and checked once per process."""
    if MAX_ROWS == 0:
        return None, "STRATA_PACKED_ROWS=0"
    return cpu_build.load(build, _SIGNATURES, _self_check, "Packed-rows kernel")


def available() -> bool:
    return _library()[0] is not None


def unavailable_reason() -> str | None:
    return _library()[1]


@lru_cache(maxsize=1)
def _bf16() -> str | None:
    """Rule 7: None where bfloat16 weights are read here too, else why not (checked once per process)."""
    fns, why = _library()
    if fns is None:
        return why
    if fns["strata_packed_rows_bf16_isa"]() != 1:
        return "this CPU has no AVX512_BF16"
    try:
        _check(fns, torch.bfloat16)
    except KernelRefused as err:
        log.warning("Packed-rows kernel for bfloat16 unavailable, oneDNN multiplies: %s", err)
        return str(err)
    return None


def bf16_available() -> bool:
    return _bf16() is None


def memory(packed: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of an opaque oneDNN tensor's memory, or None with a torch that cannot tell."""
    try:
        return torch.ops.mkldnn.data_ptr(packed), torch.ops.mkldnn._nbytes(packed)
    except (AttributeError, RuntimeError):  # a torch without these ops
        return None


def _layout(packed: torch.Tensor, weight: torch.Tensor) -> Panels | None:
    """Rule 1's check of one weight: `packed`'s memory is `weight` in panels, else None."""
    bf16 = weight.dtype == torch.bfloat16
    if (weight.dtype != torch.float32 and not bf16) or weight.dim() != 2 \
            or getattr(packed, "layout", None) != torch._mkldnn:
        return None
    n, k = weight.shape
    align = K_ALIGN_BF16 if bf16 else K_ALIGN
    kp, np_ = -(-k // align) * align, -(-n // PANEL) * PANEL
    held = memory(packed)
    if held is None:
        return None
    address, nbytes = held
    if nbytes != np_ * kp * weight.element_size() or address % 64:
        return None
    raw = torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=weight.dtype)
    weight = weight.detach()
    if bf16:  # pairs of k, the padding zeros (the kernel multiplies an odd K's last pair by them)
        raw = raw.view(np_ // PANEL, kp // 2, PANEL, 2)
        padded = weight.new_zeros(np_, kp)
        padded[:n, :k] = weight
        same = torch.equal(raw, padded.view(np_ // PANEL, PANEL, kp // 2, 2).transpose(1, 2))
        return Panels(packed, address, n, k, kp, raw) if same else None
    raw = raw.view(np_ // PANEL, kp, PANEL)
    full = n // PANEL
    same = torch.equal(raw[:full, :k], weight[:full * PANEL].view(full, PANEL, k).transpose(1, 2))
    if same and n % PANEL:
        same = torch.equal(raw[full, :k, :n % PANEL], weight[full * PANEL:].t())
    return Panels(packed, address, n, k, kp, raw) if same else None


def panels(packed: torch.Tensor, weight: torch.Tensor) -> Panels | None:
    """Rule 1: `packed` (oneDNN's packing of `weight`) as the kernel reads it, or None where it cannot."""
    if not (weight.dtype == torch.float32 and available() or weight.dtype == torch.bfloat16 and bf16_available()):
        return None
    return _layout(packed, weight)


def multiply(p: Panels, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows <= MAX_ROWS, k] in the weight's dtype times the packed weight (+ bias [n]) -> [rows, n] (rules
    2-4)."""
    x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    out = torch.empty(x.shape[0], p.n, dtype=p.dtype)
    name = _KERNEL[p.dtype]
    rc = _library()[0][name](x.data_ptr(), x.shape[0], p.k, p.address, p.n, p.kp,
                             None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"{name} refused a product of {x.shape[0]} rows by [{p.n}, {p.k}] ({rc})")
    return out


def rows(p: Panels, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight, [len(ids), k], read from its panels (rule 6): the plain weight's values."""
    ids = ids.reshape(-1)
    if p.dtype == torch.bfloat16:
        return p.raw[ids // PANEL, :, ids % PANEL].reshape(len(ids), p.kp)[:, :p.k]
    return p.raw[ids // PANEL, :p.k, ids % PANEL]


def _self_check(fns: dict[str, object]) -> None:
    """Rule 1: oneDNN's layout here, and the kernel's products against F.linear, on seeded weights."""
    from stages.packed_linear import _ops_present

    if fns["strata_packed_rows_isa"]() == 0:
        raise KernelRefused("this CPU has neither AVX-512 nor AVX2 with FMA")
    if not _ops_present():
        raise KernelRefused("torch has no oneDNN linear ops")
    _check(fns, torch.float32)


def _check(fns: dict[str, object], dtype: torch.dtype) -> None:
    """Rules 1 and 7 for one dtype: oneDNN packs seeded weights in the layout read here (odd K and N that are not
    whole panels among them), and the kernel's products of 1 to MAX_ROWS rows are F.linear's in double to the
    dtype's rounding."""
    from stages.packed_linear import PACK_ROWS

    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    name = _KERNEL[dtype]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    with torch.inference_mode():
        for n, k in ((64, 64), (80, 96), (200, 201)):
            w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
            p = _layout(packed, w)
            if p is None:
                raise KernelRefused(f"oneDNN does not pack a {dtype} [{n}, {k}] weight here as {PANEL}-column "
                                    "panels")
            for rows in sorted({1, 2, 5, 7, MAX_ROWS}):
                x = torch.randn(rows, k, generator=g).to(dtype)
                out = torch.empty(rows, n, dtype=dtype)
                if fns[name](x.data_ptr(), rows, k, p.address, n, p.kp, b.data_ptr(), out.data_ptr(), threads) != 0:
                    raise KernelRefused(f"{name} refused {rows} rows of [{n}, {k}]")
                want = F.linear(x.double(), w.double(), b.double())
                if not torch.allclose(out.double(), want, rtol=tol, atol=10 * tol):
                    raise KernelRefused(f"{name} disagrees with F.linear by "
                                        f"{(out.double() - want).abs().max().item():.2e}")
