"""The csrc/ CUDA kernels behind the same seams as the torch reference in `stages/attention.py`.

    kv_write(kv, layer, batch, k, v)                      same call and effect as attention.write_kv
    paged_decode(q, kv, layer, batch, scale, window)      same call and result as attention.paged_attention,
                                                          for a step whose entries all read one token (decode)

Both take torch CUDA tensors and launch on torch's current stream of the tensors' device, so they order with
the torch work around them without a host sync. They are not wired into the model yet (that
waits for a GPU run); csrc/README.md says how `stages/model.py` would call them.

Loading. cupy is optional (the `[cuda]` extra): without it, or without a CUDA device, `available()` is False,
`unavailable_reason()` says why, and the seams raise `KernelsUnavailable` (no silent fallback: the caller
chooses the torch reference). Each kernel is a template over its dtypes, head_dim and GQA group; a variant is
compiled by NVRTC through `cupy.RawModule` the first time it is asked for and kept for the process (cupy also
keeps the binary in its on-disk kernel cache). `dtypes.cuh` is pasted into each source before compiling, so
the text cupy hashes for that cache is the whole program.

Arguments go to the kernels as raw device addresses of tensors checked here (device, dtype, shape,
contiguity), not through `__cuda_array_interface__` or DLPack: cupy synchronises the host with the producer's
stream when it imports an array interface (CUPY_CUDA_ARRAY_INTERFACE_SYNC), which would stall every layer,
and cupy has no bfloat16 dtype to import a bf16 pool or q as.

Block sizes: kv_write runs one warp per (token, kv head) row, 4 rows per block; paged_decode one block of
4 warps per (entry, kv head, partition), its lanes splitting head_dim (head_dim / 32 elements each, rounded
up); the merge kernel one thread per element of head_dim (`reduce_threads`). `decode_splits` cuts the longest
context into partitions so that the grid has about two blocks per SM.
"""
from __future__ import annotations

import functools
import math
import re
from pathlib import Path

import numpy as np
import torch

from stages.attention import check_table_reach
from stages.batch import StepBatch
from stages.kv_cache import KVCache

try:  # the [cuda] extra
    import cupy
except ImportError as exc:  # pragma: no cover - depends on the install
    cupy = None
    _CUPY_ERROR = f"cupy is not installed ({exc}); install the [cuda] extra"
else:
    _CUPY_ERROR = None

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = ("kv_write.cu", "paged_decode.cu")
NVRTC_OPTIONS = ("-std=c++17",)

MAX_HEAD_DIM = 256
WRITE_WARPS = 4  # kWriteWarps in kv_write.cu
DECODE_WARPS = 4  # kDecodeWarps in paged_decode.cu
MIN_PARTITION_CELLS = 256
STATIC_SHARED_BYTES = 48 * 1024

# torch dtype -> the element type's name in csrc/dtypes.cuh
CUDA_TYPES = {torch.float32: "float", torch.float16: "f16_t", torch.bfloat16: "bf16_t", torch.int8: "i8_t"}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class KernelsUnavailable(RuntimeError):
    """cupy or a CUDA device is missing, or the tensors are not on a CUDA device; use stages.attention."""


def unavailable_reason() -> str | None:
    """Why the kernels cannot run in this process, or None when they can."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if cupy is None:
        return _CUPY_ERROR
    missing = [name for name in SOURCES if not (CSRC / name).is_file()]
    if missing:
        return f"kernel sources missing from {CSRC}: {', '.join(missing)}"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "cupy sees no CUDA device"
    except Exception as exc:  # cupy raises its own CUDARuntimeError without a driver
        return f"cupy cannot reach a CUDA device: {exc}"
    return None


def available() -> bool:
    """True when cupy and a CUDA device are present, so `kv_write` and `paged_decode` can run."""
    return unavailable_reason() is None


def kernel_source(name: str) -> str:
    """The text of `csrc/<name>` with each `#include "x.cuh"` of a csrc header replaced by that header."""

    def paste(match: re.Match) -> str:
        return (CSRC / match.group(1)).read_text()

    return re.sub(r'^#include "([\w.]+\.cuh)"$', paste, (CSRC / name).read_text(), flags=re.M)


def kv_write_expression(in_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> str:
    """The template instance of kv_write for new rows in `in_dtype` stored in a `kv_dtype` pool."""
    return f"kv_write<{CUDA_TYPES[in_dtype]}, {CUDA_TYPES[kv_dtype]}, {head_dim}>"


def paged_decode_expressions(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, group: int) -> tuple[str, str]:
    """The template instances (partial kernel, merge kernel) of paged_decode."""
    q, kv = CUDA_TYPES[q_dtype], CUDA_TYPES[kv_dtype]
    return f"paged_decode_partial<{q}, {kv}, {head_dim}, {group}>", f"paged_decode_reduce<{q}, {head_dim}>"


def reduce_threads(head_dim: int) -> int:
    """Threads of the merge kernel: head_dim rounded up to a warp (one thread per element)."""
    return 32 * math.ceil(head_dim / 32)


def decode_shared_bytes(head_dim: int, group: int) -> int:
    """Static shared memory of one paged_decode block: each warp's max, sum and accumulator per query head."""
    return DECODE_WARPS * group * (head_dim + 2) * 4


def decode_splits(span: int, blocks: int, sm_count: int) -> tuple[int, int]:
    """(partitions S, cells per partition P) for a step whose widest entry reads `span` cells.

    Rule: enough partitions that `blocks * S` (blocks = entries x kv heads) reaches two blocks per SM, but no
    partition under MIN_PARTITION_CELLS unless the span itself is shorter (a partition's fixed cost, its
    merge, should stay small beside its reads); P = ceil(span / S) and S is then recomputed so the widest
    entry's last partition is not empty. S * P >= span always.
    """
    if span < 1 or blocks < 1:
        raise ValueError(f"span and blocks must be positive, got {span}, {blocks}")
    wanted = max(1, math.ceil(2 * sm_count / blocks))
    splits = max(1, min(wanted, span // MIN_PARTITION_CELLS))
    cells = math.ceil(span / splits)
    return math.ceil(span / cells), cells


@functools.lru_cache(maxsize=None)
def _function(source: str, expression: str, device_index: int):
    """Compile (once per process and device) the module of `source` holding `expression`; return that kernel.

    Called inside `cupy.cuda.Device(device_index)`: cupy loads a module into the current device's context.
    """
    module = cupy.RawModule(code=kernel_source(source), options=NVRTC_OPTIONS, name_expressions=(expression,))
    return module.get_function(expression)


def _launch(device: torch.device, source: str, expression: str, grid: tuple, block: tuple, args: tuple) -> None:
    """Launch on torch's current stream of `device`, so the kernel orders with the torch work around it."""
    stream = torch.cuda.current_stream(device).cuda_stream
    with cupy.cuda.Device(device.index):
        function = _function(source, expression, device.index)
        with cupy.cuda.ExternalStream(stream):
            function(grid, block, args)


def _require(kv: KVCache) -> torch.device:
    """The pool's CUDA device, or KernelsUnavailable naming the reason."""
    reason = unavailable_reason()
    if reason is None and kv.device.type != "cuda":
        reason = f"the pool is on {kv.device}, not a CUDA device"
    if reason is not None:
        raise KernelsUnavailable(f"csrc kernels cannot run: {reason}; use stages.attention instead")
    index = kv.device.index if kv.device.index is not None else torch.cuda.current_device()
    return torch.device("cuda", index)


def _on(device: torch.device, name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` as a contiguous tensor on `device` (a copy only when it is not one already), dtype checked."""
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the pool on {device}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype}")
    return t.contiguous()


def _check_table_reach(kv: KVCache, batch: StepBatch) -> None:
    """The reference's rule (no step may reach past a table), and a head_dim the kernels were built for."""
    check_table_reach(kv, batch)
    if kv.head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {kv.head_dim} is over the kernels' limit of {MAX_HEAD_DIM}")


def _scales(kv: KVCache, layer: int) -> tuple[int, int]:
    """Addresses of a layer's int8 scale arrays, 0 (null) for a float pool."""
    if not kv.quantized:
        return 0, 0
    return kv.k_scale[layer].data_ptr(), kv.v_scale[layer].data_ptr()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def kv_write(kv: KVCache, layer: int, batch: StepBatch, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store the step's new `k`, `v [T, kv_heads, head_dim]` of local `layer` in each token's cell.

    Same effect as `attention.write_kv`, bit for bit: float pools get `k.to(kv.dtype)`, int8 pools torch
    CUDA's int8 rounding (csrc/kv_write.cu). Positions past the reserved chunks land in the trash chunk,
    through the table, as in the reference. k and v share one float dtype (the model's).
    """
    _check_table_reach(kv, batch)
    shape = (batch.num_tokens, kv.kv_heads, kv.head_dim)
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != shape or t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} is {t.dtype} {tuple(t.shape)}, expected a float dtype and shape {shape}")
    if k.dtype != v.dtype:
        raise ValueError(f"k is {k.dtype} and v {v.dtype}; the kernel reads both in one dtype")
    device = _require(kv)
    k, v = _on(device, "k", k), _on(device, "v", v)
    token_slot = _on(device, "batch.token_slot", batch.token_slot, torch.int64)
    positions = _on(device, "batch.positions", batch.positions, torch.int64)
    tables = _on(device, "kv.tables", kv.tables, torch.int32)
    k_scale, v_scale = _scales(kv, layer)
    rows = batch.num_tokens * kv.kv_heads
    args = (
        k.data_ptr(), v.data_ptr(), kv.k[layer].data_ptr(), kv.v[layer].data_ptr(), k_scale, v_scale,
        tables.data_ptr(), token_slot.data_ptr(), positions.data_ptr(),
        np.int32(batch.num_tokens), np.int32(kv.kv_heads), np.int32(kv.chunk_cells), np.int32(kv.table_chunks),
        np.int32(kv.trash),
    )
    expression = kv_write_expression(k.dtype, kv.dtype, kv.head_dim)
    _launch(device, "kv_write.cu", expression, (math.ceil(rows / WRITE_WARPS), 2), (WRITE_WARPS * 32,), args)


def paged_decode(
    q: torch.Tensor,
    kv: KVCache,
    layer: int,
    batch: StepBatch,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Decode attention of `q [B, heads, head_dim]` (one token per entry) over each slot's context.

    Returns `[B, heads * head_dim]` in q's dtype, what `attention.paged_attention` returns for the same step
    (fp32 accumulation here, so low-precision results agree within rounding, not bit for bit). The step's K/V
    must already be written. Refuses a step with an entry of more than one new token: that is the torch path.
    """
    _check_table_reach(kv, batch)
    if batch.max_new != 1:
        raise ValueError(f"paged_decode reads one token per entry; this step has entries of up to {batch.max_new}")
    n_seqs, head_dim = batch.num_seqs, kv.head_dim
    if q.dim() != 3 or q.shape[0] != n_seqs or q.shape[2] != head_dim or q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q is {q.dtype} {tuple(q.shape)}, expected a float dtype and [{n_seqs}, heads, {head_dim}]")
    heads = q.shape[1]
    if heads % kv.kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv.kv_heads} kv heads evenly")
    group = heads // kv.kv_heads
    if decode_shared_bytes(head_dim, group) > STATIC_SHARED_BYTES:
        raise ValueError(f"head_dim {head_dim} with {group} query heads per kv head is over a block's shared memory")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"a sliding window must be positive, got {sliding_window}")
    device = _require(kv)
    q = _on(device, "q", q)
    slot_ids = _on(device, "batch.slot_ids", batch.slot_ids, torch.int64)
    context_lens = _on(device, "batch.context_lens", batch.context_lens, torch.int64)
    tables = _on(device, "kv.tables", kv.tables, torch.int32)

    window = sliding_window or 0
    span = max(min(start + n, window) if window else start + n for _, start, n, _ in batch.slots)
    splits, cells = decode_splits(span, n_seqs * kv.kv_heads, _sm_count(device.index))
    out = torch.empty(n_seqs, heads * head_dim, dtype=q.dtype, device=device)
    parts = []
    if splits > 1:
        rows = n_seqs * heads * splits
        parts = [torch.empty(n, dtype=torch.float32, device=device) for n in (rows, rows, rows * head_dim)]
    part_ptrs = [t.data_ptr() for t in parts] or [0, 0, 0]
    k_scale, v_scale = _scales(kv, layer)
    partial, merge = paged_decode_expressions(q.dtype, kv.dtype, head_dim, group)
    args = (
        q.data_ptr(), kv.k[layer].data_ptr(), kv.v[layer].data_ptr(), k_scale, v_scale,
        tables.data_ptr(), slot_ids.data_ptr(), context_lens.data_ptr(), out.data_ptr(), *part_ptrs,
        np.int32(kv.kv_heads), np.int32(kv.chunk_cells), np.int32(kv.table_chunks), np.int32(window),
        np.int32(cells), np.float32(scale),
    )
    _launch(device, "paged_decode.cu", partial, (n_seqs, kv.kv_heads, splits), (DECODE_WARPS * 32,), args)
    if splits > 1:
        merge_args = (*part_ptrs, out.data_ptr(), np.int32(splits))
        _launch(device, "paged_decode.cu", merge, (n_seqs * heads,), (reduce_threads(head_dim),), merge_args)
    return out
