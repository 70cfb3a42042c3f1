"""Float weights of a CPU stage packed once, at load, into oneDNN's blocked layout for its matmul.

`F.linear` on a CPU runs the BLAS torch was built with (MKL), which re-lays-out the weight on every call and,
on CPUs it does not tune for, keeps to narrower vector code: a decode step of a few rows pays for it on every
weight of every layer. oneDNN (torch.ops.mkldnn, part of every torch CPU build with mkldnn) multiplies from a
weight packed once into its own blocked layout, for the CPU's widest instruction set. Measured on the 104M
qwen3's [3072, 768] projection, 2 threads of the CI box (AMD EPYC, AVX-512): 1 row 0.31 -> 0.11 ms, 4 rows
0.68 -> 0.16 ms, 32 rows 1.5 -> 0.76 ms, 512 rows 16.2 -> 11.0 ms (docs/BENCHMARKS.md, "Packed weights").

Rules:
1. Only on a CPU stage, float32 or bfloat16 weights, when torch has the oneDNN ops and they pass a check at
   first use (`available(dtype)`: a packed product equals F.linear on a seeded input to float rounding); anywhere
   else the weights stay plain tensors and nothing changes. `STRATA_PACKED_WEIGHTS=0` turns packing off.
2. `pack_layer(layer)` packs the 2-D weights a step multiplies through `quant_linear.linear` (PACKED: the fused
   projections, the linear-attention projections, the dense shared expert) and drops the row views of their
   parts (q_proj of qkv, ...), so the plain weight is freed: one copy of each weight is kept, never two. The
   routed experts (stacked [E, N, K], indexed per expert) and kept-quantized weights stay as they are.
3. One packing serves every number of rows (PACK_ROWS is only oneDNN's hint); a packed weight multiplies the
   same rows as F.linear to float32 rounding (summation order differs), which the oracle tests bound
   (tests/stages/test_packed_linear.py and the transformers comparisons of the served path).
4. `nbytes` is the plain weight's size (the blocked layout pads to its block, a few rows at most).
5. A product of fewer than MIN_ROWS rows is computed as MIN_ROWS rows, the extra rows zeros, and cut back:
   oneDNN multiplies 1 row with a kernel of its own, which sums a row in another order than its kernels for
   more rows (so a lone decode row would not get the values it gets in a step of several) and, on some CPUs,
   reads the weight slower (the 104M qwen3's 48 products of one decode step, weights streamed from memory, 2
   threads, AMD EPYC: 1 row 17.9 -> 16.0 ms padded to 4, where 4 rows take 15.3; docs/BENCHMARKS.md). Rows of
   a product are independent, so the real rows' values are those of a MIN_ROWS-row product. The padded input is
   a buffer kept per thread and width (`_padded`), its extra rows zeroed when a call of more rows left values
   in them, instead of a new padded tensor per product.
6. MIN_ROWS is 2 or 4, whichever multiplies one row faster on this CPU: `tune` times 1-row products over the
   stage's own packed weights (at most TUNE_BYTES of them, so they stream from memory as in a step) padded to
   each, in interleaved rounds, once per process, at the stage's load. On the AMD EPYC above 4 rows won; on an
   Intel Xeon (AVX-512, AMX) 2 rows (1 row padded to 4: 21.5 ms against 17.9 padded to 2, median of 6 rounds).
   Both keep a lone row's values those of a step of several. `STRATA_PACKED_MIN_ROWS=N` sets it instead (0
   turns padding off).
7. Where stages/packed_rows.py can read a weight's packed memory (float32 on AVX-512 or AVX2, bfloat16 on AVX512_BF16,
   oneDNN's panel layout checked against the plain weight at packing), a product of at most its MAX_ROWS rows is
   computed there instead, at the pace the weight streams from memory; rules 5-6 then serve only the weights it
   cannot read.
8. The packed memory is put into 2 MiB pages where the system allows (stages/huge_pages.py), so streaming it
   walks few TLB entries: `huge` is the bytes collapsed at packing, `memory` the (address, bytes) it holds.
9. A tied table on a stage that holds both the embedding and the lm_head (`pack_tied`) is packed like any weight
   where stages/packed_rows.py can read it, and the embedding then reads its rows from the packed memory
   (`PackedEmbedding`): still one copy, and the head's product at the memory's pace. Multiplied plain, by
   F.linear, a tied table [151936, 1024] (Qwen3-0.6B's) took 42 ms for 1 row and 129 ms for 4 (2 threads, AMD
   EPYC), packed 24 and 21 ms (docs/BENCHMARKS.md, "A tied table packed once"). Where packed_rows cannot read it,
   the table stays one plain tensor for both.
10. A float32 weight made for one product (a quantized weight dequantized for a prefill piece, stages/byte_rows.py
   rule 3) is multiplied by oneDNN straight from its plain layout (`dense`): on an AVX2 CPU torch's F.linear
   (MKL's sgemm) took 1.3-1.6x as long for a [3072, 768] or [6144, 768] weight by 128 rows (docs/BENCHMARKS.md,
   "8-bit activations"). Fewer than MIN_ROWS rows, or where packed float32 weights are not available here, F.linear.
"""
from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from functools import lru_cache

import torch
import torch.nn.functional as F

from stages import huge_pages, packed_rows

PACK_ROWS = 512  # oneDNN's batch hint at packing; any row count multiplies
PACKED = ("qkv.weight", "self_attn.o_proj.weight", "gate_up.weight", "mlp.down_proj.weight", "linear.in_proj",
          "linear_attn.out_proj.weight", "shared_expert.gate_up", "mlp.shared_expert.down_proj.weight")
PARTS = {  # the row views stages/model.py's _fuse leaves beside a fused weight
    "qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                   "self_attn.q_gate.weight"),
    "gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
DTYPES = (torch.float32, torch.bfloat16)
log = logging.getLogger("strata.stage")


TUNE_ROWS = (2, 4)  # rule 6's candidates
TUNE_BYTES = 512 << 20  # rule 6: weights timed at most (more than a CPU's last-level cache)


def _min_rows() -> int | None:
    """Rule 6's row count from STRATA_PACKED_MIN_ROWS; None when unset (`tune` decides)."""
    raw = os.environ.get("STRATA_PACKED_MIN_ROWS")
    if raw is None:
        return None
    if not raw.strip().isdigit():
        raise ValueError(f"STRATA_PACKED_MIN_ROWS must be a whole number of rows (0 turns padding off), got {raw!r}")
    return int(raw)


MIN_ROWS = 4 if _min_rows() is None else _min_rows()  # rules 5-6: until `tune` runs, 4
_tuned: dict | None = None  # rule 6: what `tune` measured, once per process
_pads = threading.local()  # rule 5's buffers: {(width, dtype, MIN_ROWS): [buffer of MIN_ROWS rows, rows last written]}


def _padded(x: torch.Tensor) -> torch.Tensor:
    """Rule 5: `x`'s rows followed by zero rows, MIN_ROWS in all, in this thread's buffer of its width."""
    rows, key = x.shape[0], (x.shape[1], x.dtype, MIN_ROWS)
    held = getattr(_pads, "bufs", None)
    if held is None:
        held = _pads.bufs = {}
    slot = held.get(key)
    if slot is None:
        with torch.inference_mode(False):  # a plain tensor: written inside inference mode and outside it
            slot = held[key] = [torch.zeros(MIN_ROWS, x.shape[1], dtype=x.dtype), 0]
    buf, last = slot
    buf[:rows].copy_(x)
    if last > rows:
        buf[rows:last].zero_()
    slot[1] = rows
    return buf


def _ops_present() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@lru_cache(maxsize=None)
def available(dtype: torch.dtype) -> bool:
    """Rule 1: packed weights of `dtype` work here (checked once per dtype and process)."""
    if os.environ.get("STRATA_PACKED_WEIGHTS", "1") == "0" or dtype not in DTYPES or not _ops_present():
        return False
    g = torch.Generator().manual_seed(0)
    w = torch.randn(80, 96, generator=g).to(dtype)
    b = torch.randn(80, generator=g).to(dtype)
    try:
        with torch.inference_mode():
            packed = PackedLinear(w)
            for rows in (1, 3, 37):
                x = torch.randn(rows, 96, generator=g).to(dtype)
                want = F.linear(x.double(), w.double(), b.double())
                got = packed(x, b).double()
                tol = 1e-4 if dtype == torch.float32 else 5e-2
                if got.shape != want.shape or not torch.allclose(got, want, rtol=tol, atol=tol * 10):
                    return False
    except (RuntimeError, TypeError):  # an op the build lacks, a CPU it cannot run on, a changed signature
        return False
    return True


def dense(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Rule 10: x [rows, K] by a plain float32 weight w [N, K] used once."""
    if w.dtype == torch.float32 and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] >= MIN_ROWS \
            and available(torch.float32):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w.contiguous(), None, "none", [], "")
    return F.linear(x, w)


class PackedLinear:
    """A `[N, K]` float weight in oneDNN's blocked layout; `linear(x, w, bias)` multiplies it (module docstring)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.shape = tuple(weight.shape)
        self.dtype = weight.dtype
        self.device = weight.device
        self.nbytes = weight.numel() * weight.element_size()  # rule 4
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)
        self.panels = packed_rows.panels(self.packed, weight)  # rule 7
        self.memory = packed_rows.memory(self.packed)
        self.huge = huge_pages.advise(*self.memory) if self.memory else 0  # rule 8

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        if bias is not None and bias.dtype != self.dtype:
            bias = bias.to(self.dtype)
        rows = x.shape[0]
        if self.panels is not None and x.dim() == 2 and 0 < rows <= packed_rows.MAX_ROWS:  # rule 7
            return packed_rows.multiply(self.panels, x, bias)
        if x.dim() == 2 and rows < MIN_ROWS:  # rule 5
            out = torch.ops.mkldnn._linear_pointwise(_padded(x), self.packed, bias, "none", [], "")
            return out[:rows]
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")


def huge_resident(weights: list["PackedLinear"]) -> tuple[int, int]:
    """Rule 8, read back: (bytes of `weights`' packed memory in huge pages now, their bytes in all), logged."""
    ranges = [w.memory for w in weights if w.memory]
    held, total = huge_pages.resident(ranges), sum(n for _, n in ranges)
    if total:
        log.info("packed weights: %.0f of %.0f MiB in 2 MiB pages (stages/huge_pages.py%s)", held / 2**20,
                 total / 2**20, "" if huge_pages.enabled() else "; STRATA_HUGE_PAGES=0")
    return held, total


def tune(weights: list["PackedLinear"], rounds: int = 5) -> dict:
    """Rule 6: set MIN_ROWS to the TUNE_ROWS count whose padded 1-row products over `weights` (in order, up to
    TUNE_BYTES) take the least time, median of `rounds` interleaved rounds; once per process. Returns what it
    measured ({"min_rows", "ms": {rows: median ms}, "bytes"}; "source": "environment" when the variable set it)."""
    global MIN_ROWS, _tuned
    if _tuned is not None:
        return _tuned
    chosen = _min_rows()
    if chosen is not None:
        MIN_ROWS = chosen
        _tuned = {"min_rows": chosen, "source": "environment"}
        return _tuned
    picked, total = [], 0
    weights = [w for w in weights if w.panels is None]  # rule 7's weights are never padded
    if not weights:
        _tuned = {"min_rows": MIN_ROWS, "source": "packed rows", "max_rows": packed_rows.MAX_ROWS}
        log.info("packed weights: products of up to %d rows read the packed memory (stages/packed_rows.py)",
                 packed_rows.MAX_ROWS)
        return _tuned
    for w in weights:
        if total >= TUNE_BYTES:
            break
        picked.append(w)
        total += w.nbytes
    if not picked:
        return {"min_rows": MIN_ROWS, "source": "default"}
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in picked}
    times: dict[int, list[float]] = {rows: [] for rows in TUNE_ROWS}
    with torch.inference_mode():
        for _ in range(rounds):
            for rows in TUNE_ROWS:
                MIN_ROWS = rows
                t0 = time.perf_counter()
                for w in picked:
                    w(inputs[w.shape[1]])
                times[rows].append(time.perf_counter() - t0)
    ms = {rows: round(statistics.median(t) * 1e3, 3) for rows, t in times.items()}
    MIN_ROWS = min(TUNE_ROWS, key=lambda rows: (ms[rows], rows))
    _tuned = {"min_rows": MIN_ROWS, "ms": ms, "bytes": total, "source": "timed"}
    log.info("packed weights: fewer than %d rows multiply as %d (1-row products over %d MB: %s ms)", MIN_ROWS,
             MIN_ROWS, total >> 20, ", ".join(f"padded to {r}: {ms[r]}" for r in TUNE_ROWS))
    return _tuned


def packable(w: object) -> bool:
    """A plain 2-D float weight on the CPU that rule 1 allows packing."""
    return (isinstance(w, torch.Tensor) and w.dim() == 2 and w.device.type == "cpu" and w.dtype in DTYPES
            and available(w.dtype))


def pack_layer(layer: dict) -> dict:
    """Rule 2: the layer's PACKED weights packed, the row views of their parts dropped (in place; returned)."""
    for name in PACKED:
        w = layer.get(name)
        if not packable(w):
            continue
        base = w.untyped_storage().data_ptr()
        for key in PARTS.get(name, ()):
            part = layer.get(key)
            if isinstance(part, torch.Tensor) and part.untyped_storage().data_ptr() == base:
                del layer[key]  # a row view of the fused weight: it would keep the plain copy alive
        layer[name] = PackedLinear(w)
    return layer


def pack_weight(w: object) -> object:
    """One weight (the lm_head) packed when it is packable, else unchanged."""
    return PackedLinear(w) if packable(w) else w


class PackedEmbedding:
    """Rule 9: the embedding of a tied table, its rows read from the lm_head's packed panels."""

    nbytes = 0  # the table's bytes are the lm_head's

    def __init__(self, head: PackedLinear) -> None:
        if head.panels is None:
            raise ValueError("a tied table's embedding reads the packed panels, and this weight has none")
        self.head, self.shape, self.dtype = head, head.shape, head.dtype

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return packed_rows.rows(self.head.panels, ids)


def pack_tied(table: object) -> tuple[object, object]:
    """Rule 9: (lm_head, embedding) for a tied table: packed and read from its panels, else (table, table)."""
    if not packable(table):
        return table, table
    head = PackedLinear(table)
    if head.panels is None:
        return table, table  # the packed copy is dropped with `head`
    return head, PackedEmbedding(head)
