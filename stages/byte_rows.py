"""Int4 planes held as bytes or half-bytes, and few rows multiplied by a C kernel (csrc/cpu_byte_rows.c).

GGUF's Q8_0, Q5_0, Q5_1 and Q5_K (and 8-bit GPTQ) arrive as two int4 planes (stages/quant_linear.py), the high
plane's scale 16 times the low one's: w = s * (lo + 16 hi) + b per group; Q4_0, Q4_1 and Q4_K (4-bit GPTQ, AWQ) as
one plane, w = s * v + b. torch's int4 kernel multiplies the planes one after the other, in bfloat16 only, and a
float32 stage dequantized the whole weight for every product: one decode step of the 104M qwen3 in Q8_0 read its
weights at a third of the machine's pace in bfloat16, and took 190-480 ms in float32 (docs/BENCHMARKS.md, "Byte
rows"). Here two planes are joined back into bytes, q = lo + 16 hi, one plane kept as nibble pairs, and a kernel
reads them once per step, in any compute dtype.

Rules:
1. On a CPU stage, a Planes is packed as a `ByteLinear` (`quant_linear.pack`) when the kernel is available and it
   has two planes, the high scale exactly 16 times the low one (`bits` 8: q uint8 [N, K], 1.25 bytes per value as
   the two planes took; groups a multiple of 32, or 16: Q6_K's sub-blocks, 1.5 bytes per value where the
   float32 weight it was dequantized to took 4), or one plane, groups a multiple of 32, and the compute dtype is
   float32 (`bits` 4: nibble pairs [N, K / 2], 0.75 bytes per value as the plane took in float32). The scale s of
   the (low) plane and the offset b are float32 [N, K / group] (rule 8: some formats keep no b, which takes 4
   bytes per group off these figures). One plane in bfloat16 keeps torch's int4 kernel: its bfloat16 scale and
   zero hold the plane in 0.625 bytes per value, and it multiplies 1 to 16 rows 1.2-1.4x faster than this kernel
   (docs/BENCHMARKS.md, "Byte rows"). Anything else keeps stages/quant_linear.py's packing.
2. A product of at most MAX_ROWS rows (a decode step) runs the kernel: x in float32, each output one float32 sum
   whose order does not depend on the other rows (the kernel's comment), rounded once to the compute dtype. It
   reads the exact weights (float32 scales); torch's int4 kernel rounds the scales to the compute dtype.
3. A product of more rows (a prefill piece) dequantizes the weight into the compute dtype in one pass of the
   library (s * q + b by one fused multiply-add, rounded once to a 16-bit dtype) and runs one GEMM (oneDNN's in
   float32: stages/packed_linear.py rule 10), as
   stages/quant_linear.py does: no second copy is kept. torch's own dequantize of one plane took 2.5 ms for a
   [3072, 768] Q4_K weight in bfloat16, more than the GEMM of 128 rows by it (1.7 ms).
4. The rows are shared statically by torch's threads (`torch.get_num_threads()`).
5. The library is compiled, cached, trusted and checked by the rules of stages/cpu_build.py (its first-use check:
   the kernel's products of 1 to MAX_ROWS rows against F.linear in float64 over the dequantized weight, and the
   dequantized weight in float32 and bfloat16 against torch's, on seeded weights of both widths with groups of 32
   and 128); a failure leaves `available()` False with `unavailable_reason()`, and the planes keep
   stages/quant_linear.py's packing. `STRATA_BYTE_ROWS=0` (or
   `STRATA_CPU_KERNELS=0`) turns it off.
6. The planes that stay stages/quant_linear.py's (one plane in bfloat16) are dequantized for a prefill piece by the
   library too (`int4pack_transposed`: torch's CPU packing read in place, the weight written transposed, [K, N], so
   each row block's values at a k are contiguous), in the same float32 operations as QuantLinear.dequantize's
   torch code, bit for bit (checked once per process on seeded planes packed by torch; else torch's code runs): a
   [3072, 768] Q4_K weight 2.06 -> 0.36 ms.
7. With `int8_activations` (engine.int8_activations, set by the stage on its ByteLinears), rule 2's product takes
   the rows of x quantized to 8 bits per block of 32 (d = absmax / 127, a = x / d rounded to nearest even) and
   multiplies them by integer dot products (`strata_byte_rows_q8`), as llama.cpp multiplies activations by its
   quantized weights: on an AVX2 CPU 1.7-2.2x the float kernel's pace for nibble pairs, 1.1-1.4x for
   bytes (docs/BENCHMARKS.md, "8-bit activations").
   The result is the exact product of the quantized rows to float32 rounding (`reference_q8`, in float64, is the
   first-use check's oracle), not of x: ~0.5% relative error on random rows. Each row is quantized alone, so a
   row's values still do not depend on the other rows of a step. Nibble pairs need K a multiple of 64 (the kernel
   takes two blocks a step); other weights and prefill pieces (rule 3) keep float activations.
8. A format whose offset is its scale times a fixed zero point (pool/gguf_meta.ZERO_POINTS: Q8_0 -128 s, Q6_K -32 s,
   Q5_0 -16 s, Q4_0 -8 s) keeps no offsets (`offset` None, `zero` the point): the kernels make each from its scale,
   exactly (a power of two), so the products are the same bit for bit, and a step reads 4 bytes per group fewer:
   Q8_0 1.125 bytes per value instead of 1.25, Q6_K 1.25 instead of 1.5, Q4_0 in float32 0.625 instead of 0.75.
   With 8-bit rows Q8_0's offsets cancel (b + 128 s = 0) and are not read at all.
"""
from __future__ import annotations

import ctypes
import logging
import os
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from pool.gguf_meta import ZERO_POINTS
from stages import cpu_build, packed_linear
from stages.cpu_build import KernelRefused

log = logging.getLogger("strata.stage")

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_byte_rows.c"
MAX_ROWS = 8  # rule 2 (BYTE_MAX_ROWS in the source)

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {"strata_byte_rows": [_P, _L, _L, _P, _I, _P, _P, _F, _L, _L, _P, _P, _I],
               "strata_byte_rows_q8": [_P, _L, _L, _P, _I, _P, _P, _F, _L, _L, _P, _P, _I], "strata_byte_rows_isa": [],
               "strata_byte_dequant": [_P, _I, _P, _P, _F, _L, _L, _L, _P, _I, _I],
               "strata_byte_dequant_rows": [_P, _I, _P, _P, _F, _P, _L, _L, _L, _L, _P, _I, _I],
               "strata_int4pack_dequant_t": [_P, _P, _L, _L, _L, _L, _L, _I, _P, _P, _I]}


def build() -> Path:
    return cpu_build.build(SOURCE, "cpu_byte_rows")


@lru_cache(maxsize=1)
def _library() -> tuple[dict[str, object] | None, str | None]:
    """({name: function}, None), or (None, why not): built, loaded and checked once per process."""
    if os.environ.get("STRATA_BYTE_ROWS", "1") == "0":
        return None, "STRATA_BYTE_ROWS=0"
    return cpu_build.load(build, _SIGNATURES, _self_check, "Byte-rows kernel")


def available() -> bool:
    return _library()[0] is not None


def unavailable_reason() -> str | None:
    return _library()[1]


def takes(planes, dtype: torch.dtype) -> bool:
    """Rule 1's forms: groups a multiple of 32 (or 16 with two planes) and K a multiple of 32; two planes whose high
    scale is exactly 16 times the low one, or one plane in float32."""
    sixteen = planes.group == 16 and len(planes.values) == 2
    if planes.shape[1] % planes.group or planes.shape[1] % 32 or (planes.group % 32 and not sixteen):
        return False
    if len(planes.values) == 1:
        return dtype == torch.float32
    return len(planes.values) == 2 and bool(torch.equal(planes.scales[1], planes.scales[0] * 16))


def nibbles(v: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] as [N, K / 2] bytes: per block of 32, value j in the low nibble of byte j and value
    16 + j in its high nibble (the kernel's layout)."""
    n, k = v.shape
    blocks = v.view(n, k // 32, 2, 16)
    return (blocks[:, :, 0] | blocks[:, :, 1] << 4).reshape(n, k // 2).contiguous()


def unpack(q: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """The values of `q` as uint8 [N, K]."""
    if bits == 8:
        return q
    blocks = q.view(q.shape[0], k // 32, 1, 16)
    return torch.cat([blocks & 15, blocks >> 4], dim=2).view(q.shape[0], k)


def q8_takes(bits: int, k: int) -> bool:
    """Rule 7's forms: bytes, or nibble pairs whose K is a multiple of 64."""
    return bits == 8 or k % 64 == 0


def _multiply(fns: dict, x: torch.Tensor, q: torch.Tensor, bits: int, s: torch.Tensor, b: torch.Tensor | None,
              group: int, bias: torch.Tensor | None, int8: bool = False, zero: float = 0.0) -> torch.Tensor:
    """The kernel's product: x float32 [rows <= MAX_ROWS, K] -> float32 [rows, N]; `int8`: rule 7's; b None: the
    offsets are -zero * s (rule 8)."""
    n, k = q.shape[0], x.shape[1]
    if q.shape[1] * 8 != k * bits:
        raise ValueError(f"{bits}-bit rows of {q.shape[1]} bytes do not hold {k} values")
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    if x.shape[0] == 0:  # the kernel refuses 0 rows; the product of none is empty
        return out
    name = "strata_byte_rows_q8" if int8 else "strata_byte_rows"
    rc = fns[name](x.data_ptr(), x.shape[0], k, q.data_ptr(), bits, s.data_ptr(), None if b is None else b.data_ptr(),
                   zero, n, group, None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"{name} refused a product of {x.shape[0]} rows by [{n}, {k}] ({rc})")
    return out


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule 7's rows of 8 bits: x float32 [rows, K] -> (a [rows, K / 32, 32] as float32 integers, d [rows, K / 32]),
    the kernel's operations in float32: d = absmax / 127, a = x * (1 / d) rounded to nearest even (0 where d is 0)."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    return torch.round(xb * inv.unsqueeze(-1)).clamp(-127, 127), d


def reference_q8(x: torch.Tensor, values: torch.Tensor, s: torch.Tensor, b: torch.Tensor, group: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """Rule 7's product in float64: the quantized rows of x by the weight s * values + b (values uint8 [N, K]),
    exact up to the last rounding."""
    a, d = quantize_q8(x)
    rows, n = d.shape[0], values.shape[0]
    a16, d16 = a.double().view(rows, -1, 16), d.double().repeat_interleave(2, 1)  # by halves of blocks
    dots = torch.einsum("mhj,nhj->mnh", a16, values.double().view(n, -1, 16))  # exact integers
    per = group // 16
    sd = s.double().repeat_interleave(per, 1).unsqueeze(0) * d16.unsqueeze(1)  # [rows, N, halves]
    sums = (d16 * a16.sum(-1)).view(rows, -1, per).sum(-1)  # [rows, groups]
    y = (sd * dots).sum(-1) + sums @ b.double().t()
    return y if bias is None else y + bias.double()


class ByteLinear:
    """A `[N, K]` weight of int4 planes held as bytes or nibble pairs (rule 1); `quant_linear.linear(x, w, bias)`
    multiplies it."""

    def __init__(self, planes, dtype: torch.dtype) -> None:
        self.shape = planes.shape
        self.kind, self.dtype, self.device, self.group = planes.kind, dtype, torch.device("cpu"), planes.group
        if len(planes.values) == 2:
            lo, hi = planes.values
            self.bits, self.q = 8, (lo.to(torch.int32) + 16 * hi.to(torch.int32)).to(torch.uint8).contiguous()
        else:
            self.bits, self.q = 4, nibbles(planes.values[0].to(torch.uint8))
        self.scale = planes.scales[0].to(torch.float32).contiguous()
        zero = ZERO_POINTS.get(planes.kind)  # rule 8
        if zero is not None and torch.equal(planes.offset.float(), -zero * self.scale):
            self.offset, self.zero = None, float(zero)
        else:
            self.offset, self.zero = planes.offset.to(torch.float32).contiguous(), 0.0
        self._int8 = False

    @property
    def int8_activations(self) -> bool:
        """Rule 7: decode rows multiplied as 8-bit rows (set by the stage; False where the form does not take it)."""
        return self._int8

    @int8_activations.setter
    def int8_activations(self, on: bool) -> None:
        self._int8 = bool(on) and q8_takes(self.bits, self.shape[1])

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * (self.scale.numel() + (0 if self.offset is None else self.offset.numel()))

    @property
    def offsets(self) -> torch.Tensor:
        """The offset of every group, float32 [N, K / group], held or (rule 8) made from the scales."""
        return self.offset if self.offset is not None else -self.zero * self.scale

    def dequantize(self) -> torch.Tensor:
        """The weight `[N, K]` in the compute dtype (rule 3): s * q + b by one fused multiply-add in float32, rounded
        once to a 16-bit dtype, in one pass of the library (bfloat16 or float32; float16 from float32)."""
        n, k = self.shape
        direct = self.dtype == torch.bfloat16
        out = torch.empty(n, k, dtype=torch.bfloat16 if direct else torch.float32)
        rc = _library()[0]["strata_byte_dequant"](self.q.data_ptr(), self.bits, self.scale.data_ptr(),
                                                  None if self.offset is None else self.offset.data_ptr(), self.zero,
                                                  n, k, self.group, out.data_ptr(), int(direct),
                                                  torch.get_num_threads() if n > 1 else 1)
        if rc != 0:
            raise ValueError(f"strata_byte_dequant refused a [{n}, {k}] weight of {self.bits}-bit rows ({rc})")
        return out.to(self.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (1-D) of the weight, `[len(ids), K]` in the compute dtype, as `dequantize` makes them (an
        embedding table's lookup: stages/quant_linear.py QuantEmbedding), read in place by the library."""
        n, k = self.shape
        ids = ids.to(torch.int64).contiguous()
        direct = self.dtype == torch.bfloat16
        out = torch.empty(len(ids), k, dtype=torch.bfloat16 if direct else torch.float32)
        if not len(ids):
            return out.to(self.dtype)
        rc = _library()[0]["strata_byte_dequant_rows"](
            self.q.data_ptr(), self.bits, self.scale.data_ptr(), None if self.offset is None else self.offset.data_ptr(),
            self.zero, ids.data_ptr(), len(ids), n, k, self.group, out.data_ptr(), int(direct),
            torch.get_num_threads() if len(ids) > 1 else 1)
        if rc == -1:
            raise IndexError(f"rows {ids.min().item()}..{ids.max().item()} of a weight of {n} rows")
        if rc != 0:
            raise ValueError(f"strata_byte_dequant_rows refused {len(ids)} rows of a [{n}, {k}] weight ({rc})")
        return out.to(self.dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n = self.shape[0]
        lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1])
        if x2.shape[0] <= MAX_ROWS:
            y = _multiply(_library()[0], x2.to(self.dtype).float().contiguous(), self.q, self.bits, self.scale,
                          self.offset, self.group, None, self._int8, self.zero).to(self.dtype)
        else:
            y = packed_linear.dense(x2.to(self.dtype), self.dequantize())
        y = y.to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, n)


def _dequant_t(fns: dict, packed: torch.Tensor, sz: torch.Tensor, rows: int, n: int, k: int, group: int, first: bool,
               acc: torch.Tensor | None, out16: torch.Tensor | None, threads: int) -> None:
    """One plane into `acc` float32 [K, N] (or, the last, rounded into `out16` bfloat16 [K, N]): the library's call."""
    from stages.quant_linear import cpu_block  # quant_linear imports this module

    if fns["strata_int4pack_dequant_t"](packed.data_ptr(), sz.data_ptr(), rows, cpu_block(), n, k, group, int(first),
                                       None if acc is None else acc.data_ptr(),
                                       None if out16 is None else out16.data_ptr(), threads) != 0:
        raise ValueError(f"strata_int4pack_dequant_t refused a [{n}, {k}] weight of {rows} packed rows")


def int4pack_transposed(packed: list[torch.Tensor], scales_zeros: list[torch.Tensor], rows: int, n: int, k: int,
                        group: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Rule 6: the sum of torch-packed CPU int4 planes (stages/quant_linear.py's QuantLinear) dequantized as [K, N],
    the weight transposed, in `dtype` (bfloat16 rounded in the library, any other from float32); None where the
    library or its check of torch's layout says no."""
    if not _int4pack_ok():
        return None
    fns = _library()[0]
    acc = torch.empty(k, n, dtype=torch.float32) if len(packed) > 1 or dtype != torch.bfloat16 else None
    out16 = torch.empty(k, n, dtype=torch.bfloat16) if dtype == torch.bfloat16 else None
    for i, (p, sz) in enumerate(zip(packed, scales_zeros)):
        last = out16 is not None and i == len(packed) - 1
        _dequant_t(fns, p, sz.to(torch.float32).contiguous(), rows, n, k, group, i == 0, acc, out16 if last else None,
                   torch.get_num_threads())
    return out16 if out16 is not None else acc.to(dtype)


@lru_cache(maxsize=1)
def _int4pack_ok() -> bool:
    """Rule 6's check, once per process: seeded planes packed by torch's CPU packer, dequantized here and by
    torch's ops in QuantLinear.dequantize's order, equal bit for bit."""
    from stages.quant_linear import cpu_block  # quant_linear imports this module

    fns = _library()[0]
    if fns is None or not cpu_block():
        return False
    g = torch.Generator().manual_seed(1)
    try:
        for n, k, group in ((64, 64, 32), (100, 256, 128)):
            rows = -(-n // 64) * 64
            packed, szs, ws = [], [], []
            for _ in range(2):
                v = torch.randint(0, 16, (rows, k), dtype=torch.int32, generator=g)
                sz = torch.randn(k // group, rows, 2, generator=g)
                packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(v, 2))
                szs.append(sz)
                scale = sz[..., 0].t()[:n].repeat_interleave(group, 1)
                zero = sz[..., 1].t()[:n].repeat_interleave(group, 1)
                ws.append(v[:n].float() * scale + (zero - 8 * scale))
            first, acc = ws[0], ws[0] + ws[1]
            both, one = torch.empty(k, n), torch.empty(k, n)
            both16, one16 = torch.empty(k, n, dtype=torch.bfloat16), torch.empty(k, n, dtype=torch.bfloat16)
            for i, acc_to, out16 in ((0, both, None), (1, both, None),  # two planes in float32
                                     (0, one, None), (1, one, both16),  # two planes, the sum rounded to bfloat16
                                     (0, None, one16)):  # one plane straight to bfloat16
                _dequant_t(fns, packed[i], szs[i].contiguous(), rows, n, k, group, i == 0, acc_to, out16, 2)
            if not (torch.equal(both.t(), acc) and torch.equal(both16.t(), acc.bfloat16())
                    and torch.equal(one16.t(), first.bfloat16())):
                raise KernelRefused("strata_int4pack_dequant_t disagrees with torch's dequantize")
    except (RuntimeError, ValueError, AttributeError) as err:  # KernelRefused, a refusal, a torch without the packer
        log.warning("torch's int4 planes dequantized by torch: %s", err)
        return False
    return True


def _self_check(fns: dict[str, object]) -> None:
    """Rule 5: the kernel's products of 1 to MAX_ROWS rows against F.linear in float64 over the same weight."""
    if fns["strata_byte_rows_isa"]() == 0:
        raise KernelRefused("this CPU has neither AVX-512 nor AVX2 with FMA")
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        # (rows, K, group, bits, zero point: 0 for offsets of their own, else rule 8's)
        for n, k, group, bits, zero in ((64, 64, 32, 8, 0), (37, 256, 128, 8, 0), (130, 96, 32, 8, 128),
                                        (48, 320, 32, 8, 0), (40, 96, 16, 8, 0), (40, 288, 16, 8, 32),
                                        (64, 64, 32, 4, 0), (37, 256, 128, 4, 0), (130, 96, 32, 4, 8),
                                        (48, 320, 32, 4, 0), (24, 320, 32, 4, 8)):
            v = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g)
            q = v if bits == 8 else nibbles(v)
            s = torch.rand(n, k // group, generator=g) * 0.01
            own = torch.randn(n, k // group, generator=g) * 0.1
            b, offsets = (own, own) if not zero else (None, -zero * s)
            bias = torch.randn(n, generator=g)
            w = (v.double().view(n, -1, group) * s.double().unsqueeze(-1) + offsets.double().unsqueeze(-1)).view(n, k)
            for dtype in (torch.float32, torch.bfloat16):
                out = torch.empty(n, k, dtype=dtype)
                if fns["strata_byte_dequant"](q.data_ptr(), bits, s.data_ptr(), None if b is None else b.data_ptr(),
                                              zero, n, k, group, out.data_ptr(), int(dtype == torch.bfloat16), 1) != 0:
                    raise KernelRefused("strata_byte_dequant refused a weight")
                if not torch.equal(out, w.float().to(dtype)):  # s * q + b exact in float64, then one rounding
                    raise KernelRefused(f"strata_byte_dequant disagrees with torch in {dtype} ({bits} bits)")
                ids = torch.tensor([n - 1, 0, n // 2, n - 1])
                picked = torch.empty(len(ids), k, dtype=dtype)
                if (fns["strata_byte_dequant_rows"](q.data_ptr(), bits, s.data_ptr(), None if b is None else b.data_ptr(),
                                                    zero, ids.data_ptr(), len(ids), n, k, group, picked.data_ptr(),
                                                    int(dtype == torch.bfloat16), 2) != 0
                        or not torch.equal(picked, out[ids])):
                    raise KernelRefused(f"strata_byte_dequant_rows disagrees with strata_byte_dequant in {dtype}")
            for rows in range(1, MAX_ROWS + 1):
                x = torch.randn(rows, k, generator=g)
                got = _multiply(fns, x, q, bits, s, b, group, bias, zero=zero).double()
                want = F.linear(x.double(), w, bias.double())
                if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
                    raise KernelRefused(f"strata_byte_rows disagrees with F.linear by "
                                        f"{(got - want).abs().max().item():.2e} ({bits} bits)")
                if q8_takes(bits, k):  # rule 7
                    got = _multiply(fns, x, q, bits, s, b, group, bias, True, zero).double()
                    want = reference_q8(x, v, s, offsets, group, bias)
                    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
                        raise KernelRefused(f"strata_byte_rows_q8 disagrees with its reference by "
                                            f"{(got - want).abs().max().item():.2e} ({bits} bits)")
