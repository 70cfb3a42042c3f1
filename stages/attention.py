"""Attention through the chunk tables: write a step's new K/V into the pool, read each slot's context back.

This is the torch reference; a csrc kernel may replace either function with the same signature and layout.

    pool (one layer)                       table of slot s (row s of kv.tables, int32)
    k[l]: [N + 1, C, kv_heads, head_dim]   [ 7 | 2 | 9 | N | N | ... ]   N = trash chunk
              ^ chunk   ^ cell               j=0 j=1 j=2 (unreserved)
    cell p of slot s  ->  k[l][tables[s, p // C], p % C]  (flat: chunk * C + p % C in k[l].view(-1, ...))

    write_kv:          token t (slot s, position p) -> its cell; int8 stores round(x / scale), scale =
                       absmax over head_dim / 127 per cell and head, in k_scale[l] / v_scale[l]
    paged_attention:   for every entry b of the step, gather cells [0, L) of its slot (L = the step's longest
                       context; cells past the entry's own context are masked), dequantise, and run one
                       scaled_dot_product_attention over the padded batch:
                         q [B, heads, Q, head_dim]   k, v [B, kv_heads, L, head_dim]   mask [B, 1, Q, L]
                       query at position p sees cell j iff j <= p (and j > p - window with a sliding window);
                       GQA: query head h reads kv head h // (heads / kv_heads).

Cost of the padding: scores are B x Q x L per head, so a step that mixes a long prefill piece with decodes
pays Q rows for every decode entry (the rows are masked and dropped, never wrong). A varlen kernel avoids it.

Per-step index tensors derived from the tables (cell addresses, masks) are kept in `batch.cache`: every layer
of a step shares them, so the tables must not change while a step runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.batch import StepBatch
from stages.kv_cache import KVCache

INT8_MAX = 127.0


def _flat(arr: torch.Tensor) -> torch.Tensor:
    """`[N + 1, C, ...]` -> `[(N + 1) * C, ...]`, a view: cell numbers index the first dimension."""
    return arr.view(-1, *arr.shape[2:])


def token_cells(kv: KVCache, batch: StepBatch) -> torch.Tensor:
    """Flat cell number `[T]` of each new token: chunk tables[slot, pos // C], offset pos % C."""
    key = ("token_cells", id(kv))
    if key not in batch.cache:
        if batch.max_context > kv.table_chunks * kv.chunk_cells:
            raise ValueError(
                f"context {batch.max_context} exceeds a table of {kv.table_chunks} chunks x {kv.chunk_cells} cells"
            )
        c = kv.chunk_cells
        chunk = kv.tables[batch.token_slot, batch.positions // c].long()
        batch.cache[key] = chunk * c + batch.positions % c
    return batch.cache[key]


def context_cells(kv: KVCache, batch: StepBatch) -> torch.Tensor:
    """Flat cell numbers `[B, L]` of cells [0, L) of each entry's slot (past its context: masked later)."""
    key = ("context_cells", id(kv))
    if key not in batch.cache:
        c = kv.chunk_cells
        j = torch.arange(batch.max_context, device=kv.device)
        chunk = kv.tables[batch.slot_ids[:, None], (j // c)[None, :]].long()
        batch.cache[key] = chunk * c + (j % c)[None, :]
    return batch.cache[key]


def attention_mask(batch: StepBatch, sliding_window: int | None = None) -> torch.Tensor:
    """Bool `[B, 1, Q, L]`: query (b, i) at position p sees cell j iff j <= p (and j > p - window)."""
    key = ("mask", sliding_window)
    if key not in batch.cache:
        j = torch.arange(batch.max_context, device=batch.device)[None, None, :]
        p = batch.query_pos[:, :, None]
        mask = j <= p
        if sliding_window is not None:
            mask &= j > p - sliding_window
        batch.cache[key] = mask[:, None]
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


def write_kv(kv: KVCache, layer: int, batch: StepBatch, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store the step's new `k`, `v [T, kv_heads, head_dim]` of local `layer` in each token's cell."""
    cells = token_cells(kv, batch)
    if kv.quantized:
        for new, arr, scales in ((k, kv.k[layer], kv.k_scale[layer]), (v, kv.v[layer], kv.v_scale[layer])):
            q, s = quantize_int8(new)
            _flat(arr).index_copy_(0, cells, q)
            _flat(scales).index_copy_(0, cells, s)
    else:
        _flat(kv.k[layer]).index_copy_(0, cells, k.to(kv.dtype))
        _flat(kv.v[layer]).index_copy_(0, cells, v.to(kv.dtype))


def gather_context(kv: KVCache, layer: int, batch: StepBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[B, L, kv_heads, head_dim]` in `dtype`: every entry's cells [0, L) read through its table."""
    cells = context_cells(kv, batch)
    k, v = _flat(kv.k[layer])[cells], _flat(kv.v[layer])[cells]
    if kv.quantized:
        k = dequantize_int8(k, _flat(kv.k_scale[layer])[cells], dtype)
        v = dequantize_int8(v, _flat(kv.v_scale[layer])[cells], dtype)
    return k.to(dtype), v.to(dtype)


def paged_attention(
    q: torch.Tensor,
    kv: KVCache,
    layer: int,
    batch: StepBatch,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal GQA attention of `q [T, heads, head_dim]` over each slot's context; returns `[T, heads * head_dim]`.

    The step's K/V must already be written (`write_kv`), so a token sees the new tokens before it in its own
    slot. One `scaled_dot_product_attention` call for the whole step (layout in the module docstring).
    """
    n_tokens, heads, head_dim = q.shape
    k, v = gather_context(kv, layer, batch, q.dtype)
    qp = q[batch.query_index]  # [B, Q, heads, head_dim]
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=attention_mask(batch, sliding_window),
        scale=scale,
        enable_gqa=heads != kv.kv_heads,
    )
    out = out.transpose(1, 2)[batch.token_seq, batch.token_row]  # [T, heads, head_dim]
    return out.reshape(n_tokens, heads * head_dim)
