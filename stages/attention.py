"""Attention through the chunk tables: write a step's new K/V into the pool, read each slot's context back.

This is the torch reference; a csrc kernel may replace either function with the same signature and layout. On a
CPU stage, `paged_attention` hands a decode group to the C kernel of stages/cpu_attention.py when that kernel
is usable (its rules 1 and 5); `cpu_kernel=False` keeps every group on the reference.

    pool (one layer)                       table of slot s (row s of kv.tables, int32)
    k[l]: [N + 1, C, kv_heads, head_dim]   [ 7 | 2 | 9 | N | N | ... ]   N = trash chunk
              ^ chunk   ^ cell               j=0 j=1 j=2 (unreserved)
    cell p of slot s  ->  k[l][tables[s, p // C], p % C]  (flat: chunk * C + p % C in k[l].view(-1, ...))

    write_kv:          token t (slot s, position p) -> its cell; int8 stores round(x / scale), scale =
                       absmax over head_dim / 127 per cell and head, in k_scale[l] / v_scale[l]
    paged_attention:   one scaled_dot_product_attention per group of the step (`StepBatch.groups`):
                         decode group   q [G, kv_heads, heads / kv_heads, head_dim]  (the query heads that
                                        share a kv head as its rows: no K/V repeated per head)
                                        k, v [G, kv_heads, L, head_dim]
                         prefill entry  q [1, heads, n, head_dim]   k, v [1, kv_heads, start + n, head_dim]
                       query at position p sees cell j iff j <= p (and j > p - window with a sliding window);
                       GQA: query head h reads kv head h // (heads / kv_heads).

Reading a group's context: the cells [lo, L) it can see (lo > 0 only under a sliding window) lie in logical
chunks [lo // C, ceil(L / C)) of each entry's table. They are taken as a view without any copy when the
group has one entry whose chunks are consecutive in the pool (the usual case for a lone conversation on a
fresh pool: lowest free chunk first); otherwise exactly those cells are gathered, one index_select per array
into a scratch buffer of the KV cache that every layer reuses (a fresh allocation per layer costs as much
as the copy on a CPU). Cells past an entry's own context are masked; a mask is built only when
some query would otherwise see a cell it must not (a decode group whose entries share one context needs
none, a prefill piece starting at 0 is plain causal).

Per-step values derived from the tables (cell addresses, chunk lists, masks) are kept in `batch.cache`:
every layer of a step shares them, so the tables must not change while a step runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from stages import cpu_attention
from stages.batch import AttentionGroup, StepBatch
from stages.kv_cache import KVCache

INT8_MAX = 127.0


def _flat(arr: torch.Tensor) -> torch.Tensor:
    """`[N + 1, C, ...]` -> `[(N + 1) * C, ...]`, a view: cell numbers index the first dimension."""
    return arr.view(-1, *arr.shape[2:])


def check_table_reach(kv: KVCache, batch: StepBatch) -> None:
    """No step may reach past a table: its cells there have no chunk (a kernel would send them to the trash)."""
    if batch.max_context > kv.table_chunks * kv.chunk_cells:
        raise ValueError(
            f"context {batch.max_context} exceeds a table of {kv.table_chunks} chunks x {kv.chunk_cells} cells"
        )


def token_cells(kv: KVCache, batch: StepBatch) -> torch.Tensor:
    """Flat cell number `[T]` of each new token: chunk tables[slot, pos // C], offset pos % C."""
    key = ("token_cells", id(kv))
    if key not in batch.cache:
        check_table_reach(kv, batch)
        c = kv.chunk_cells
        cells = []
        for slot, start, n, _ in batch.slots:
            row = kv.host_tables[slot]
            cells.extend(row[p // c] * c + p % c for p in range(start, start + n))
        batch.cache[key] = torch.tensor(cells, dtype=torch.int64).to(kv.device, non_blocking=True)
    return batch.cache[key]


class _Read:
    """Where a group's visible cells [lo, L) are: chunk ids to gather (or the first of a consecutive run),
    the offset of cell lo in the first chunk, and the mask (None: every query sees every cell read)."""

    def __init__(self, kv: KVCache, g: AttentionGroup, window: int | None) -> None:
        c = kv.chunk_cells
        if window is None:
            lo = 0
        elif g.kind == "decode":  # query p = ctx - 1 sees j > p - window
            lo = min(max(0, ctx - window) for ctx in g.contexts)
        else:  # the first query, p = start, sees the oldest cells
            lo = max(0, g.firsts[0] - window + 1)
        self.lo, self.length = lo, g.max_context - lo
        j0, j1 = lo // c, -(-g.max_context // c)
        self.offset, self.span = lo - j0 * c, j1 - j0
        rows = [kv.host_tables[s][j0:j1] for s in g.slots]
        self.first = rows[0][0] if len(rows) == 1 and rows[0] == list(range(rows[0][0], rows[0][0] + len(rows[0]))) \
            else None
        self.cells = None  # flat cell numbers [G * (L - lo)] when the cells are gathered
        if self.first is None:
            chunks = torch.tensor(rows, dtype=torch.int64).to(kv.device, non_blocking=True)  # [G, span]
            cells = chunks[:, :, None] * c + torch.arange(c, device=kv.device)
            self.cells = cells.view(len(rows), -1)[:, self.offset:self.offset + self.length].reshape(-1)
        self.causal = False
        self.mask = None
        if g.kind == "decode":
            if not (g.uniform and (window is None or lo == max(0, g.max_context - window))):
                self.mask = _mask(kv.device, g, lo, self.length, window)
        elif lo == 0 and g.firsts[0] == 0 and (window is None or window >= g.max_new):
            self.causal = True  # a prompt's first piece: plain causal (n queries over n cells)
        else:
            self.mask = _mask(kv.device, g, lo, self.length, window)

    def take(self, kv: KVCache, which: str, arr: torch.Tensor, n_entries: int) -> torch.Tensor:
        """`[G, L - lo, ...]` of `arr` (one layer's K, V or scales): a view, or the cells gathered into the
        cache's scratch buffer for `which` (valid until the next gather of the same array kind)."""
        if self.first is not None:
            block = arr.narrow(0, self.first, self.span).view(1, self.span * arr.shape[1], *arr.shape[2:])
            return block.narrow(1, self.offset, self.length)
        out = kv.scratch(which, (self.cells.numel(), *arr.shape[2:]), arr.dtype)
        torch.index_select(_flat(arr), 0, self.cells, out=out)
        return out.view(n_entries, self.length, *arr.shape[2:])


def _mask(device: torch.device, g: AttentionGroup, lo: int, length: int, window: int | None) -> torch.Tensor:
    """Bool `[G, 1, Q, L - lo]`: query i of entry e (position first_e + i) sees cell lo + j."""
    j = torch.arange(lo, lo + length)[None, None, :]
    p = torch.tensor(g.firsts)[:, None, None] + torch.arange(g.max_new)[None, :, None]
    mask = j <= p
    if window is not None:
        mask &= j > p - window
    return mask[:, None].to(device, non_blocking=True)


def _read(kv: KVCache, batch: StepBatch, index: int, window: int | None) -> _Read:
    key = ("read", id(kv), index, window)
    if key not in batch.cache:
        batch.cache[key] = _Read(kv, batch.groups[index], window)
    return batch.cache[key]


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [..., head_dim]` -> (int8 values, float32 scale `[...]`), scale = absmax / 127; all-zero -> zeros."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / INT8_MAX
    q = torch.round(xf / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None])
    return q.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 values times their per-(cell, head) scale, computed in float32, returned in `dtype`."""
    return (q.float() * scale[..., None]).to(dtype)


def encode_kv(kv: KVCache, k: torch.Tensor, v: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The arrays a step's new `k`, `v [T, kv_heads, head_dim]` are stored as: ("k", ...), ("v", ...) in the
    kv dtype, plus ("k_scale", ...), ("v_scale", ...) for int8 (module docstring)."""
    if kv.quantized:
        (qk, sk), (qv, sv) = quantize_int8(k), quantize_int8(v)
        return [("k", qk), ("v", qv), ("k_scale", sk), ("v_scale", sv)]
    if k.dtype != kv.dtype:
        k, v = k.to(kv.dtype), v.to(kv.dtype)
    return [("k", k), ("v", v)]


def store_kv(kv: KVCache, layer: int, cells: torch.Tensor, encoded: list[tuple[str, torch.Tensor]]) -> None:
    """Put `encoded` rows (from `encode_kv`) into flat `cells [T]` of local `layer`'s arrays."""
    for which, rows in encoded:
        _flat(getattr(kv, which)[layer]).index_copy_(0, cells, rows)


def write_kv(kv: KVCache, layer: int, batch: StepBatch, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store the step's new `k`, `v [T, kv_heads, head_dim]` of local `layer` in each token's cell."""
    store_kv(kv, layer, token_cells(kv, batch), encode_kv(kv, k, v))


def _context(kv: KVCache, layer: int, read: _Read, n_entries: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """K and V `[G, L - lo, kv_heads, head_dim]` in `dtype`: a group's visible cells read through its tables."""
    k, v = read.take(kv, "k", kv.k[layer], n_entries), read.take(kv, "v", kv.v[layer], n_entries)
    if kv.quantized:
        return (dequantize_int8(k, read.take(kv, "k_scale", kv.k_scale[layer], n_entries), dtype),
                dequantize_int8(v, read.take(kv, "v_scale", kv.v_scale[layer], n_entries), dtype))
    if k.dtype != dtype:
        k, v = k.to(dtype), v.to(dtype)
    return k, v


def _sdpa(kv: KVCache, layer: int, read: _Read, g: AttentionGroup, qg: torch.Tensor, scale: float) -> torch.Tensor:
    """One group's attention by `scaled_dot_product_attention` over its context read through the tables."""
    n_entries, (_, heads, head_dim) = len(g.entries), qg.shape
    k, v = _context(kv, layer, read, n_entries, qg.dtype)
    if g.kind == "decode":
        # One query per entry: the heads that share a kv head become that kv head's query rows
        # (head h = kv head h // group, as GQA reads), so K/V are never repeated per query head.
        o = F.scaled_dot_product_attention(
            qg.reshape(n_entries, kv.kv_heads, heads // kv.kv_heads, head_dim),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=read.mask,
            scale=scale,
        )
        return o.reshape(g.num_rows, heads * head_dim)
    o = F.scaled_dot_product_attention(
        qg.view(n_entries, g.max_new, heads, head_dim).transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=read.mask,
        is_causal=read.causal,
        scale=scale,
        enable_gqa=heads != kv.kv_heads,
    )
    return o.transpose(1, 2).reshape(g.num_rows, heads * head_dim)


def paged_attention(
    q: torch.Tensor,
    kv: KVCache,
    layer: int,
    batch: StepBatch,
    scale: float,
    sliding_window: int | None = None,
    cpu_kernel: bool = True,
) -> torch.Tensor:
    """Causal GQA attention of `q [T, heads, head_dim]` over each slot's context; returns `[T, heads * head_dim]`.

    The step's K/V must already be written (`write_kv`), so a token sees the new tokens before it in its own
    slot. One `scaled_dot_product_attention` call per group of the step (layout in the module docstring), or
    the CPU decode kernel for the decode group (`cpu_kernel`, module docstring).
    """
    check_table_reach(kv, batch)
    n_tokens, heads, head_dim = q.shape
    out = None
    kernel = cpu_kernel and cpu_attention.usable(kv, q)
    for index, g in enumerate(batch.groups):
        rows = g.rows
        qg = q[rows.start:rows.stop] if isinstance(rows, range) else q.index_select(0, rows)
        if g.kind == "decode" and kernel:
            o = cpu_attention.paged_decode(qg, kv, layer, batch, index, scale, sliding_window)
        else:
            o = _sdpa(kv, layer, _read(kv, batch, index, sliding_window), g, qg, scale)
        if isinstance(rows, range) and rows.start == 0 and rows.stop == n_tokens:
            return o  # one group holds the whole step, rows in order
        if out is None:
            out = q.new_empty(n_tokens, heads * head_dim)
        if isinstance(rows, range):
            out[rows.start:rows.stop] = o
        else:
            out.index_copy_(0, rows, o)
    return out
