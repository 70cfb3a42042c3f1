"""Attention over a context in pieces, merged exactly: the torch reference of split-K (flash-decoding).

A context that does not fit the device window at once (stages/window.py) is attended piece by piece: each
piece is a set of cells already in frames, and gives, per query row and head, a partial

    m    running max of the scores over the piece's visible cells (-inf when it sees none)
    l    sum of exp(score - m) over them (0 when none)
    acc  sum of exp(score - m) * v over them                       [.., head_dim]

which `merge` combines without loss: with M = max(m1, m2), a_i = exp(m_i - M),

    m = M    l = l1 * a1 + l2 * a2    acc = acc1 * a1 + acc2 * a2          output = acc / l

This is the shape csrc/paged_decode.cu's partitions and paged_decode_reduce use (there in base 2). Every query
sees at least its own cell in one of the pieces, so the final l is positive.

A piece is given per entry of the step as the flat frame cells it reads and their positions in the entry's
context (`Piece`); entries are padded to the longest cell list of the piece with the cell `pad` (the trash
frame's first cell) and a position that no query sees. Visibility is the reference's rule: query at position p
sees cell j iff j <= p (and j > p - window under a sliding window). Scores and sums are in float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.attention import dequantize_int8
from stages.batch import StepBatch
from stages.kv_cache import KVCache

NEVER = 1 << 62  # the position of a padding cell: no query sees it


@dataclass
class Partial:
    """m, l `[B, heads, Q]` and acc `[B, heads, Q, head_dim]`, float32, per entry / head / query row."""

    m: torch.Tensor
    l: torch.Tensor
    acc: torch.Tensor


@dataclass
class Piece:
    """Cells one piece reads: `cells[b]` flat frame cells of entry b, `positions[b]` their context positions."""

    cells: list[list[int]]
    positions: list[list[int]]

    def tensors(self, pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cells, positions) `[B, M]` int64, padded with `pad` at position NEVER."""
        width = max(1, max(len(c) for c in self.cells))
        cells = [c + [pad] * (width - len(c)) for c in self.cells]
        positions = [p + [NEVER] * (width - len(p)) for p in self.positions]
        return (torch.tensor(cells, dtype=torch.int64).to(device, non_blocking=True),
                torch.tensor(positions, dtype=torch.int64).to(device, non_blocking=True))


def _gather(kv: KVCache, layer: int, which: str, cells: torch.Tensor) -> torch.Tensor:
    """`[B, M, kv_heads, head_dim]` float32: K or V of `cells [B, M]` in one layer of `kv` (dequantised)."""
    arr = getattr(kv, which)[layer]
    flat = cells.reshape(-1)
    x = arr.view(-1, *arr.shape[2:]).index_select(0, flat)
    if kv.quantized:
        scales = getattr(kv, which + "_scale")[layer]
        x = dequantize_int8(x, scales.view(-1, scales.shape[-1]).index_select(0, flat), torch.float32)
    return x.float().view(*cells.shape, kv.kv_heads, kv.head_dim)


def partial_attention(q: torch.Tensor, kv: KVCache, layer: int, batch: StepBatch, piece: Piece, scale: float,
                      window: int | None = None) -> Partial:
    """The partial of `q [T, heads, head_dim]` (the step's rows) over the cells of `piece` in `kv`'s frames."""
    cells, pos = piece.tensors(kv.trash * kv.chunk_cells, kv.device)
    n_seqs, queries = batch.num_seqs, batch.max_new
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // kv.kv_heads
    qp = q.float()[batch.query_index].transpose(1, 2)  # [B, heads, Q, hd]
    k = _gather(kv, layer, "k", cells).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)  # [B, heads, M, hd]
    v = _gather(kv, layer, "v", cells).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    scores = torch.matmul(qp, k.transpose(-1, -2)) * scale  # [B, heads, Q, M]
    qpos = batch.query_pos[:, None, :, None]  # [B, 1, Q, 1]
    cpos = pos[:, None, None, :]  # [B, 1, 1, M]
    seen = cpos <= qpos
    if window is not None:
        seen &= cpos > qpos - window
    scores = scores.masked_fill(~seen, float("-inf"))
    m = scores.amax(dim=-1)  # [B, heads, Q]
    p = torch.exp(scores - torch.where(torch.isinf(m), 0.0, m)[..., None])  # masked scores -> exp(-inf) = 0
    assert p.shape == (n_seqs, heads, queries, cells.shape[1])
    return Partial(m, p.sum(dim=-1), torch.matmul(p, v))


def merge(a: Partial | None, b: Partial) -> Partial:
    """The partial over both pieces' cells (module docstring); `a` None is the empty partial."""
    if a is None:
        return b
    m = torch.maximum(a.m, b.m)
    safe = torch.where(torch.isinf(m), 0.0, m)
    wa, wb = torch.exp(a.m - safe), torch.exp(b.m - safe)  # exp(-inf) = 0 for a piece that saw nothing
    return Partial(m, a.l * wa + b.l * wb, a.acc * wa[..., None] + b.acc * wb[..., None])


def finish(p: Partial, batch: StepBatch, dtype: torch.dtype) -> torch.Tensor:
    """The attention output `[T, heads * head_dim]` in `dtype`, rows in the step's token order."""
    out = (p.acc / p.l[..., None]).transpose(1, 2)  # [B, Q, heads, hd]
    rows = out[batch.query_valid]  # entry-major, query order: the step's token rows
    return rows.reshape(batch.num_tokens, -1).to(dtype)
