"""Weights kept quantized: GGUF block formats held as int4 planes and multiplied by torch's weight-only int4 kernels.

A GGUF weight `[N, K]` stores its blocks along each row. Every format here is, per group of 32 weights of a row,

    w = sum_p c_p * s * v_p + b        v_p in 0..15 (a 4-bit plane), c_p in {1, 16}, s and b per group

Q4_0 (v = q, b = -8d), Q4_1 (b = m) and Q4_K (s = d * sc, b = -dmin * m per 32-weight sub-block) have one plane;
Q5_0, Q5_1, Q5_K (q = lo + 16 hi) and Q8_0 (q + 128 = lo + 16 hi) have two. Per plane that is exactly torch's
groupwise int4 form `(v - 8) * scale + zero` (group 32): scale_p = c_p * s, zero_p = 8 * scale_p, plus b on one
plane, and the planes' products are summed. Q6_K has the form with 16-weight sub-blocks (group 16: s = d * sc,
q = lo + 16 hi, hi 2 bits, b = -32 s), which torch's int4 kernels do not take: only a CPU stage's bytes
(stages/byte_rows.py) keep it; elsewhere `pack` dequantizes it at load (`strata config check` counts it so).

`Planes` is the decomposition, unpacked (uint8 values, float32 scales): rows are concatenated (fused qkv,
gate_up) and permuted (llama's q/k rows) before packing. `pack(planes, dtype, device)` makes a `QuantLinear`:
- CPU: each plane in `_convert_weight_to_int4pack_for_cpu`'s layout (rows padded to a multiple of 64), its
  scales_and_zeros `[K/32, N, 2]` in the compute dtype. A step of at most KERNEL_MAX_ROWS rows in bfloat16 runs
  `_weight_int4pack_mm_for_cpu` per plane (its cost grows with the rows, like a GEMV; its float32 path is a
  scalar reference, so float32 never takes it); any other step dequantizes the weight into the compute dtype
  from the same packed bytes and runs one F.linear (a GEMM): no second copy is kept. The layout (row blocks of 64
  or, where torch's kernel is built for AVX2, 32) is checked once against the packer (`cpu_block`); if a torch
  build packs otherwise, weights are dequantized at load.
  On a CPU where stages/byte_rows.py's kernel runs, two planes (and one plane in float32) are not packed here: `pack`
  makes them a ByteLinear (bytes or nibble pairs, float32 scale and offset per group; its rules).
- CUDA: `_convert_weight_to_int4pack` (tinygemm's layout) and `_weight_int4pack_mm` for every step (bfloat16).
The scales are rounded to the compute dtype once, at packing, so both CPU paths compute with the same weights.
In float32 that is the dequantized weight itself (to float32 rounding); in bfloat16 each scale carries up to
2^-9 relative error, well inside the 4-bit step of the format.

`QuantEmbedding` keeps the embedding table quantized (on a CPU stage with the byte-rows kernel as its bytes or
nibble pairs, elsewhere as nibble pairs and float32 scales); a lookup dequantizes only the rows asked for, exactly.

Memory per weight: 4 bits per plane plus a scale and a zero per 32 weights per plane in the compute dtype: a
one-plane format in bfloat16 takes 5 bits (0.31x of bfloat16), a two-plane one 10.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

from pool.computable import keeps_int4, native_16bit
from pool.gguf_meta import PLANE_COUNTS, PLANE_GROUPS
from stages import byte_rows, packed_linear

GROUP = 32
KERNEL_MAX_ROWS = 24  # CPU: up to this many rows the int4 kernel beats dequantize + GEMM (strata bench quant; with
# stages/byte_rows.py's dequantize the GEMM path wins from 24-32 rows, docs/BENCHMARKS.md "Byte rows")
PLANE_FORMATS = tuple(PLANE_COUNTS)
_ROW_BLOCK = 64  # rows are padded to this: a whole number of the CPU packer's row blocks (`cpu_block`)


@dataclass
class Planes:
    """w[n, k] = sum_p scales[p][n, k // 32] * values[p][n, k] + offset[n, k // 32] (module docstring)."""

    values: list[torch.Tensor]  # uint8 [N, K], 0..15
    scales: list[torch.Tensor]  # float32 [N, K / group]
    offset: torch.Tensor  # float32 [N, K / group]
    kind: str = ""  # the format it came from, for messages
    group: int = GROUP  # weights per scale along a row (GGUF: 32; GPTQ / AWQ: their group_size)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values[0].shape)  # type: ignore[return-value]

    def rows(self, index: torch.Tensor | slice) -> "Planes":
        """The planes of rows `index` (a slice or an index tensor), in that order."""
        return Planes([v[index] for v in self.values], [s[index] for s in self.scales], self.offset[index], self.kind,
                      self.group)

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 `[N, K]`."""
        n, k = self.shape
        w = self.offset.repeat_interleave(self.group, dim=1)
        for v, s in zip(self.values, self.scales):
            w = w + v.float() * s.repeat_interleave(self.group, dim=1)
        return w.reshape(n, k)


def cat_planes(parts: Sequence[Planes]) -> Planes:
    """Rows of `parts` one after another (as many planes and the same group size each)."""
    if len({(len(p.values), p.group) for p in parts}) != 1:
        raise ValueError(f"cannot fuse rows of {sorted({(len(p.values), p.group) for p in parts})} (planes, group)")
    values = [torch.cat([p.values[i] for p in parts]) for i in range(len(parts[0].values))]
    scales = [torch.cat([p.scales[i] for p in parts]) for i in range(len(parts[0].scales))]
    kinds = sorted({p.kind for p in parts})
    return Planes(values, scales, torch.cat([p.offset for p in parts]), "+".join(kinds), parts[0].group)


# --- GGUF blocks -> planes (the layouts of ggml's block_q* structs) ---

def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_0-style 16 bytes -> 32 values: the low nibbles are weights 0..15, the high ones 16..31."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _bits(qh: np.ndarray, n: int) -> np.ndarray:
    """Little-endian bytes `[blocks, n / 8]` -> bits `[blocks, n]`."""
    return np.unpackbits(qh, axis=1, bitorder="little")[:, :n]


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for the 8 sub-blocks of a K-quant superblock: (sc, m), each float32 [blocks, 8]."""
    q = scales.astype(np.uint16)
    sc = np.empty((q.shape[0], 8), np.uint16)
    m = np.empty_like(sc)
    sc[:, :4], m[:, :4] = q[:, 0:4] & 63, q[:, 4:8] & 63
    sc[:, 4:] = (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)
    m[:, 4:] = (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)
    return sc.astype(np.float32), m.astype(np.float32)


def _k_low(qs: np.ndarray) -> np.ndarray:
    """K-quant 128 bytes -> 256 4-bit values: per 64 weights, 32 bytes' low nibbles then their high nibbles."""
    q = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([q & 15, q >> 4], axis=2).reshape(-1, 256)


def _blocks_to_planes(kind: str, b: np.ndarray) -> tuple[list[np.ndarray], list[float], np.ndarray, np.ndarray]:
    """(values per plane [blocks, weights], plane multipliers, scale and offset [blocks, groups])."""
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        one = kind.endswith("_1")
        d = _f16(b, 0)
        base = -(16.0 if kind.startswith("Q5") else 8.0) * d if not one else _f16(b, 2)
        at = 4 if one else 2
        if kind.startswith("Q4"):
            return [_nibbles(b[:, at:at + 16])], [1.0], d, base
        hi = _bits(b[:, at:at + 4], 32)
        return [_nibbles(b[:, at + 4:at + 20]), hi], [1.0, 16.0], d, base
    if kind == "Q8_0":
        d = _f16(b, 0)
        u = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return [u & 15, u >> 4], [1.0, 16.0], d, -128.0 * d
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, m = _k_scales(b[:, 4:16])
        scale, base = d * sc, -(dmin * m)
        if kind == "Q4_K":
            return [_k_low(b[:, 16:144])], [1.0], scale, base
        qh = _bits(b[:, 16:48], 256).reshape(-1, 32, 8)  # [blocks, l, bit j]: weight l of sub-block j
        return [_k_low(b[:, 48:176]), qh.transpose(0, 2, 1).reshape(-1, 256)], [1.0, 16.0], scale, base
    if kind == "Q6_K":  # ql[128], qh[64], int8 scales[16], f16 d; per 128 weights ql 64 bytes, qh 32
        ql, qh = b[:, 0:128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 1, 32)
        lo = np.concatenate([ql & 15, ql >> 4], axis=2).reshape(-1, 256)  # weights 0-63 low nibbles, 64-127 high
        hi = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3  # weight 32 j + l: bits 2j of qh[l]
        scale = _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)
        return [lo, hi.reshape(-1, 256)], [1.0, 16.0], scale, -32.0 * scale
    raise ValueError(f"GGUF type {kind} has no int4-plane form")


def planes_from_gguf(kind: str, data: np.ndarray, shape: tuple[int, int]) -> Planes | None:
    """The planes of a GGUF tensor's raw blocks (`data`: its bytes, `shape`: [N, K] as Hugging Face shapes it),
    or None for a format without the int4-plane form (module docstring)."""
    if kind not in PLANE_FORMATS:
        return None
    import gguf

    n, k = shape
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    if k % block:
        return None
    b = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, size)
    values, mults, scale, base = _blocks_to_planes(kind, b)
    group = PLANE_GROUPS.get(kind, GROUP)
    groups = k // group
    scale = torch.from_numpy(np.ascontiguousarray(scale, np.float32)).reshape(n, groups)
    offset = torch.from_numpy(np.ascontiguousarray(base, np.float32)).reshape(n, groups)
    return Planes([torch.from_numpy(np.ascontiguousarray(v)).reshape(n, k) for v in values],
                  [scale * c for c in mults], offset, kind, group)


# --- packed weights ---

@lru_cache(maxsize=1)
def cpu_block() -> int:
    """The CPU packer's row block: `[N / block, K, block / 2]` bytes, rows [block * b, block * b + block / 2) in the
    low nibbles and the rest of the block in the high ones; 64 where torch's int4 kernel is built for AVX-512, 32
    for AVX2. `_cpu_values` reads that. Checked once against the packer itself; 0 when it packs otherwise."""
    try:
        q = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    except (RuntimeError, AttributeError):
        return 0
    return next((block for block in (64, 32) if torch.equal(_cpu_values(packed, 128, 64, block), q.float())), 0)


def cpu_layout_ok() -> bool:
    """Whether `_cpu_values` reads the CPU packer's layout here (`cpu_block`)."""
    return cpu_block() != 0


def _cpu_values(packed: torch.Tensor, rows: int, k: int, block: int | None = None) -> torch.Tensor:
    """The 4-bit values of a CPU-packed plane as float32 `[rows, K]`: each nibble half of a row block converted
    as it is copied into place (no unpacked uint8 copy)."""
    block = block or cpu_block()
    p = packed.view(rows // block, k, block // 2)
    v = torch.empty(rows // block, 2, block // 2, k, dtype=torch.float32)
    v[:, 0].copy_((p & 15).transpose(1, 2))  # rows block * b .. block * b + block / 2 - 1
    v[:, 1].copy_((p >> 4).transpose(1, 2))  # the block's second half
    return v.view(rows, k)


def kernel_dtype_ok(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `pack` keeps weights quantized for this compute dtype and device (pool/computable.keeps_int4, the
    rule `strata config check` counts by; on the CPU also `cpu_layout_ok`)."""
    keeps = keeps_int4(str(dtype).removeprefix("torch."), device.type)
    return keeps and (device.type != "cpu" or cpu_layout_ok())


class QuantLinear:
    """A `[N, K]` weight kept as packed int4 planes (module docstring); `linear(x, w, bias)` multiplies it."""

    def __init__(self, planes: Planes, dtype: torch.dtype, device: torch.device | str) -> None:
        device = torch.device(device)
        self.shape = planes.shape
        self.kind, self.dtype, self.device, self.group = planes.kind, dtype, device, planes.group
        n, k = self.shape
        self.rows = -(-n // _ROW_BLOCK) * _ROW_BLOCK if device.type == "cpu" else n
        self.packed: list[torch.Tensor] = []
        self.scales_zeros: list[torch.Tensor] = []
        # b joins the zero of the plane where 8 * scale + b is smallest (Q8_0: the high plane, where it cancels to
        # 0), so rounding the zeros to the compute dtype costs least
        cost = torch.stack([(8 * s + planes.offset).abs() for s in planes.scales])
        home = cost.argmin(dim=0)
        for i, (v, s) in enumerate(zip(planes.values, planes.scales)):
            zero = 8 * s + torch.where(home == i, planes.offset, 0.0)
            sz = torch.stack([s, zero], dim=-1)  # [N, K/32, 2]
            if self.rows != n:
                v = F.pad(v, (0, 0, 0, self.rows - n))
                sz = F.pad(sz, (0, 0, 0, 0, 0, self.rows - n))
            self.scales_zeros.append(sz.transpose(0, 1).contiguous().to(device, dtype))
            if device.type == "cuda":
                pairs = (v[:, ::2] << 4 | v[:, 1::2]).to(device)
                tiles = 8 if k % 128 == 0 else 4 if k % 64 == 0 else 2
                self.packed.append(torch._convert_weight_to_int4pack(pairs, tiles))
            else:
                self.packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(v.to(torch.int32), 2))

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.packed) + sum(
            s.numel() * s.element_size() for s in self.scales_zeros)

    def dequantize(self) -> torch.Tensor:
        """The weight `[N, K]` in the compute dtype, from the packed bytes (CPU): the values in float32, scaled and
        shifted in place, one rounding to the compute dtype at the end (as the kernel rounds once)."""
        n, k = self.shape
        g = self.group
        wt = byte_rows.int4pack_transposed(self.packed, self.scales_zeros, self.rows, n, k, g, self.dtype) \
            if self.device.type == "cpu" else None
        if wt is not None:  # the same values, by stages/byte_rows.py's library (its rule 6), transposed
            # a GEMM reads the transposed view as fast, except a 16-bit one torch converts through float32: [3072,
            # 768] by 128 rows in bfloat16 on an AVX2 CPU 635 ms transposed, 37 ms contiguous
            native = self.dtype == torch.float32 or native_16bit(str(self.dtype).removeprefix("torch."))
            return wt.t() if native else wt.t().contiguous()
        out = None
        for p, sz in zip(self.packed, self.scales_zeros):
            w = _cpu_values(p, self.rows, k).view(self.rows, k // g, g)[:n]
            scale = sz[:, :n, 0].t().unsqueeze(-1).float()
            w.mul_(scale).add_(sz[:, :n, 1].t().unsqueeze(-1).float() - 8 * scale)
            out = w if out is None else out.add_(w)
        return out.reshape(n, k).to(self.dtype)  # type: ignore[union-attr]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n = self.shape[0]
        lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1])
        if self.device.type == "cuda":
            y = sum(torch._weight_int4pack_mm(x2.to(self.dtype), p, self.group, sz)
                    for p, sz in zip(self.packed, self.scales_zeros))
        elif x2.shape[0] <= KERNEL_MAX_ROWS and self.dtype == torch.bfloat16:
            y = sum(torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(self.dtype), p, self.group, sz)
                    for p, sz in zip(self.packed, self.scales_zeros))
            y = y[:, :n]
        else:
            y = packed_linear.dense(x2.to(self.dtype), self.dequantize())  # oneDNN in float32 (its rule 10)
        y = y.to(x.dtype)  # type: ignore[union-attr]
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, n)


class QuantEmbedding:
    """An embedding table `[V, H]` kept quantized; `lookup(ids)` dequantizes the rows asked for. On a CPU stage whose
    byte-rows kernel takes the planes (stages/byte_rows.py rule 1) it holds them as a ByteLinear's bytes or nibble
    pairs and a lookup is one call of the library over the rows (`ByteLinear.rows`: a decode step's row in ~20 us,
    where the torch ops below took ~200); elsewhere nibble pairs and float32 scales, dequantized by torch ops."""

    def __init__(self, planes: Planes, dtype: torch.dtype, device: torch.device | str) -> None:
        self.shape, self.kind, self.dtype, self.group = planes.shape, planes.kind, dtype, planes.group
        self.bytes = None
        if as_bytes(planes, dtype, torch.device(device)):
            self.bytes = byte_rows.ByteLinear(planes, dtype)
            return
        self.pairs = [(v[:, ::2] | v[:, 1::2] << 4).to(device) for v in planes.values]
        self.scales = [s.to(device) for s in planes.scales]
        self.offset = planes.offset.to(device)

    @property
    def nbytes(self) -> int:
        if self.bytes is not None:
            return self.bytes.nbytes
        return sum(p.numel() for p in self.pairs) + 4 * (sum(s.numel() for s in self.scales) + self.offset.numel())

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        k, flat = self.shape[1], ids.reshape(-1)
        if self.bytes is not None:
            return self.bytes.rows(flat).reshape(*ids.shape, k)
        w = self.offset[flat].repeat_interleave(self.group, dim=1)
        for p, s in zip(self.pairs, self.scales):
            b = p[flat]
            v = torch.stack((b & 15, b >> 4), dim=-1).reshape(-1, k)
            w = w + v.float() * s[flat].repeat_interleave(self.group, dim=1)
        return w.to(self.dtype).reshape(*ids.shape, k)


class RowStack:
    """Rows of several weights one after another, multiplied part by part and the outputs concatenated: a fused
    projection whose parts are stored in different formats (a Q4_K_M file keeps some attn_v in Q6_K)."""

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(weight_bytes(p) for p in self.parts)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.cat([linear(x, p) for p in self.parts], dim=-1)
        return y if bias is None else y + bias


def take_rows(w: "torch.Tensor | Planes", index: torch.Tensor) -> "torch.Tensor | Planes":
    """Rows `index` of a float weight or of kept-quantized planes (a copy)."""
    return w.rows(index) if isinstance(w, Planes) else w[index]


def fuse_rows(parts: Sequence[torch.Tensor | Planes]) -> torch.Tensor | Planes | RowStack:
    """The rows of `parts` as one weight: runs of Planes with as many planes are concatenated (packed as one),
    runs of float tensors too; a RowStack when more than one run remains."""
    runs: list[list] = []
    for p in parts:
        key = (len(p.values), p.group) if isinstance(p, Planes) else 0
        if runs and runs[-1][0] == key:
            runs[-1][1].append(p)
        else:
            runs.append([key, [p]])
    fused = [cat_planes(r) if key else torch.cat(r) for key, r in runs]
    return fused[0] if len(fused) == 1 else RowStack(fused)


Weight = Union[torch.Tensor, QuantLinear, "byte_rows.ByteLinear", RowStack]


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a float weight or a QuantLinear."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    return w(x, bias)


def embed(ids: torch.Tensor, table: torch.Tensor | QuantEmbedding) -> torch.Tensor:
    if isinstance(table, torch.Tensor):
        return F.embedding(ids, table)
    return table.lookup(ids)


def as_bytes(planes: Planes, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `planes` are held as a stages/byte_rows.py ByteLinear (its rule 1): on a CPU with its kernel, in the
    forms it takes. `pack` and QuantEmbedding both ask."""
    return device.type == "cpu" and byte_rows.available() and byte_rows.takes(planes, dtype)


def pack(planes: Planes | RowStack, dtype: torch.dtype, device: torch.device | str) -> Weight:
    """A QuantLinear (a RowStack of packed parts; on a CPU a stages/byte_rows.py ByteLinear where its rule 1 says),
    or the dequantized weight when this dtype / device has no kernel (`kernel_dtype_ok`)."""
    device = torch.device(device)
    if isinstance(planes, RowStack):
        return RowStack([pack(p, dtype, device) if isinstance(p, Planes) else p.to(device, dtype)
                         for p in planes.parts])
    if not kernel_dtype_ok(dtype, device):
        return planes.dequantize().to(device, dtype)
    if as_bytes(planes, dtype, device):
        return byte_rows.ByteLinear(planes, dtype)  # bytes or nibble pairs (stages/byte_rows.py rule 1)
    if planes.group % GROUP:  # Q6_K's groups of 16: torch's int4 kernels take groups of 32 and more
        return planes.dequantize().to(device, dtype)
    return QuantLinear(planes, dtype, device)


def weight_bytes(w: object) -> int:
    """Bytes a loaded weight takes (a tensor, a QuantLinear / QuantEmbedding, or a list of them)."""
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    if isinstance(w, (list, tuple)):
        return sum(weight_bytes(x) for x in w)
    return int(getattr(w, "nbytes", 0))
