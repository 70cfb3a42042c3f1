"""Decode attention of a CPU stage through the chunk tables, in C (csrc/cpu_paged_decode.c).

The torch reference (`attention.paged_attention`) reads a decode group's context as a view when it is one run of
chunks and gathers it into a scratch buffer otherwise, then calls `scaled_dot_product_attention` on K/V whose
kv heads are interleaved cell by cell. On a CPU both halves cost more than the bytes: the gather copies the whole
context of every layer, and SDPA over the interleaved rows reads at a fraction of the memory bus (the 104M
qwen3 at 12,288 cells: 68 ms per decode token, 48 of them attention; docs/BENCHMARKS.md). The kernel reads each
K and V row of the pool once, in place, through the tables.

Rules:
1. Only for a decode group (one query token per entry) on a CPU pool of float32 K/V with float32 queries, int8
   K/V (the value times its per-cell, per-head scale, as the reference dequantizes) with float32 queries, or
   bfloat16 K/V with bfloat16 queries (a bfloat16 stage: the queries widened to float32, the output rounded back);
   an int8 or bfloat16 row is converted once per read, at most MAX_ROW values. Every other group, dtype or device
   goes through the torch reference, unchanged.
2. Same call and result as the reference for that group: entry e sees cells [lo_e, ctx_e), lo_e = max(0, ctx_e -
   window) under a sliding window; query head h reads kv head h // (heads / kv_heads). Values agree with the
   reference to float32 rounding (the order of the sums differs; bfloat16: to its rounding of the output); the
   tests and the first-use check hold it to that.
3. An entry's cells are cut into parts, scored in blocks inside one chunk with an online softmax, and the parts
   merged by their maxima (flash-decoding), so one long conversation still uses every thread: a part is the
   group's cells over 4 parts per thread, within [MIN_PART_CELLS, MAX_PART_CELLS], in whole blocks of 64.
   The threads are torch's (`torch.get_num_threads()`), run by the libgomp torch has loaded.
4. The library is compiled at first use for this CPU into the private kernel cache and loaded only when it can
   be trusted, by the rules of stages/cpu_build.py.
5. Before first use the library's result is compared with the reference on a seeded pool (several entries,
   scattered chunks, a sliding window); a compiler that is missing or fails, a refused cache, or a wrong result
   leaves `available()` False with `unavailable_reason()` saying why (logged once), and the reference runs.
   `STRATA_CPU_KERNELS=0` turns the kernel off.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from itertools import accumulate
from pathlib import Path

import torch

from stages import cpu_build
from stages.batch import AttentionGroup, StepBatch
from stages.cpu_build import KernelRefused
from stages.kv_cache import KVCache

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_paged_decode.c"
SYMBOL = "strata_paged_decode"
MIN_PART_CELLS, MAX_PART_CELLS = 128, 1024  # rule 3
BLOCK = 64  # BLOCK in the source
MAX_HEADS = 128  # MAX_HEADS in the source
MAX_ROW = 8192  # MAX_ROW in the source: kv_heads * head_dim of an int8 or bfloat16 pool
KV_KIND = {torch.float32: 0, torch.int8: 1, torch.bfloat16: 2}  # KV_F32, KV_INT8, KV_BF16 in the source

_P, _I = ctypes.c_void_p, ctypes.c_int
_ARGTYPES = [_P, _P, _P, _P, _P, _I, _P, ctypes.c_int64, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _I, _P, _P,
             _P, _I]


def build() -> Path:
    """The compiled library (rule 4, stages/cpu_build.py): the cached one, else compiled now."""
    return cpu_build.build(SOURCE, "cpu_paged_decode")


@lru_cache(maxsize=1)
def _library() -> tuple[object | None, str | None]:
    """(the kernel function, None), or (None, why not): built, loaded and checked once per process."""
    fns, why = cpu_build.load(build, {SYMBOL: _ARGTYPES}, lambda f: _self_check(f[SYMBOL]),
                              "CPU decode attention kernel")
    return (fns[SYMBOL] if fns else None), why


def available() -> bool:
    return _library()[0] is not None


def unavailable_reason() -> str | None:
    return _library()[1]


def usable(kv: KVCache, q: torch.Tensor) -> bool:
    """Rule 1 for this pool and these queries."""
    return q.device.type == "cpu" and takes(kv, q.dtype, q.shape[1])


def takes(kv: KVCache, q_dtype: torch.dtype, heads: int) -> bool:
    """Rule 1 for this pool and queries of `q_dtype`, `heads` heads (on the CPU)."""
    pair = (q_dtype, kv.dtype) in ((torch.float32, torch.float32), (torch.float32, torch.int8),
                                   (torch.bfloat16, torch.bfloat16))
    return (kv.device.type == "cpu" and pair and heads <= MAX_HEADS
            and (kv.dtype == torch.float32 or kv.kv_heads * kv.head_dim <= MAX_ROW) and available())


def plan(batch: StepBatch, kv: KVCache, index: int, window: int | None) -> "Plan":
    """The plan of decode group `batch.groups[index]` over `kv` under `window`: made once per step and shared by
    every layer, and by stages/decode_layer.py's call for the same group."""
    key = ("cpu_decode", id(kv), index, window)
    if key not in batch.cache:
        batch.cache[key] = Plan(batch.groups[index], window, torch.get_num_threads())
    return batch.cache[key]


def paged_decode(q: torch.Tensor, kv: KVCache, layer: int, batch: StepBatch, index: int, scale: float,
                 window: int | None) -> torch.Tensor:
    """Rule 2: `q [G, heads, head_dim]` of the decode group `batch.groups[index]` -> `[G, heads * head_dim]`,
    through the group's `plan` (its slots, contexts and parts)."""
    return _run(_library()[0], q, kv, layer, plan(batch, kv, index, window), scale)


def part_cells(cells: int, threads: int) -> int:
    """Rule 3: the part size for a group reading `cells` in all over `threads` threads."""
    per = -(-cells // (4 * threads))
    return min(MAX_PART_CELLS, max(MIN_PART_CELLS, -(-per // BLOCK) * BLOCK))


class Plan:
    """A decode group's arguments to the kernel: slots, contexts, first visible cells (int32 [3, G]), parts; and,
    made at the first layer's call and reused by the others, the arguments that stay the same over a step's
    layers (the tables, the work buffer of the parts)."""

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
        self._fixed: dict[tuple[int, int, int], tuple] = {}

    def fixed(self, kv: KVCache, heads: int, head_dim: int) -> tuple:
        """(work buffer, the kernel's arguments from the tables to the part sizes, parts' first indices)."""
        key = (id(kv), heads, head_dim)
        if key not in self._fixed:
            if not all(t.is_contiguous() for t in (*kv.k, *kv.v, kv.tables, *(kv.k_scale or ()),
                                                    *(kv.v_scale or ()))):
                raise ValueError("the CPU decode kernel needs contiguous pool arrays and tables")
            work = torch.empty(self.n_parts, heads * (head_dim + 2), dtype=torch.float32)
            ints = self.ints
            self._fixed[key] = (work, (kv.tables.data_ptr(), kv.tables.shape[1], ints[0].data_ptr(),
                                       ints[1].data_ptr(), ints[2].data_ptr(), self.entries, kv.kv_heads,
                                       heads // kv.kv_heads, head_dim, kv.chunk_cells),
                                (self.part, self.part_first.data_ptr(), work.data_ptr()),
                                kv)  # held: the addresses above stay its, and its id no other pool's
        return self._fixed[key][:3]


def _run(fn, q: torch.Tensor, kv: KVCache, layer: int, plan: Plan, scale: float) -> torch.Tensor:
    n, heads, head_dim = q.shape
    if n != plan.entries:
        raise ValueError(f"the decode group has {plan.entries} entries, the queries {n} rows")
    _, tables_on, parts = plan.fixed(kv, heads, head_dim)
    dtype = q.dtype
    q = q.float().contiguous()  # a bfloat16 stage's queries widened (rule 1)
    out = torch.empty(n, heads * head_dim, dtype=torch.float32)
    if kv.quantized:
        k_scale, v_scale = kv.k_scale[layer].data_ptr(), kv.v_scale[layer].data_ptr()
    else:
        k_scale = v_scale = None
    rc = fn(q.data_ptr(), kv.k[layer].data_ptr(), kv.v[layer].data_ptr(), k_scale, v_scale, KV_KIND[kv.dtype],
            *tables_on, float(scale), *parts, out.data_ptr(), plan.threads)
    if rc != 0:
        raise ValueError(f"the CPU decode kernel refused {n} entries x {heads} heads x {head_dim}")
    return out.to(dtype)


def _self_check(fn) -> None:
    """Rule 5: the library against the reference on a seeded pool."""
    from stages.attention import paged_attention, write_kv

    g = torch.Generator().manual_seed(0)
    c, chunks, kv_heads, heads, head_dim = 16, 40, 2, 6, 32
    batch = StepBatch.from_slots([[0, 190, 1, 1], [1, 5, 1, 1], [2, 77, 1, 1]])
    for kv_dtype in (torch.float32, "int8", torch.bfloat16):
        kv = KVCache(1, chunks, c, kv_heads, head_dim, kv_dtype, "cpu", n_slots=3, table_chunks=12)
        order = torch.randperm(chunks, generator=g).tolist()
        for s in range(3):
            kv.set_table(s, order[s * 12:(s + 1) * 12])
        write_kv(kv, 0, StepBatch.from_slots([[0, 0, 190, 0], [1, 0, 5, 0], [2, 0, 77, 0]]),  # the contexts
                 torch.randn(272, kv_heads, head_dim, generator=g), torch.randn(272, kv_heads, head_dim, generator=g))
        q = torch.randn(3, heads, head_dim, generator=g).to(torch.bfloat16 if kv_dtype == torch.bfloat16 else
                                                             torch.float32)
        write_kv(kv, 0, batch, torch.randn(3, kv_heads, head_dim, generator=g),
                 torch.randn(3, kv_heads, head_dim, generator=g))
        with torch.inference_mode():
            for window in (None, 50):
                want = paged_attention(q, kv, 0, batch, 0.2, window, cpu_kernel=False)
                got = _run(fn, q, kv, 0, Plan(batch.groups[0], window, 2, part=32), 0.2)  # several parts merged
                tol = (1e-4, 1e-5) if kv_dtype != torch.bfloat16 else (2e-2, 2e-2)
                if not torch.allclose(got.float(), want.float(), rtol=tol[0], atol=tol[1]):
                    raise KernelRefused(f"the compiled kernel disagrees with the torch reference by "
                                        f"{(got - want).abs().max().item():.2e} ({kv_dtype} pool, window {window})")
