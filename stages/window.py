"""The device window: frames on the compute device over the stage's canonical host pool.

    host pool (the pool file; pinned on CUDA)          device window (`frames`, a KVCache of F + 1 chunks)
    | chunk 0 | chunk 1 | ... | chunk N-1 | trash |   | frame 0 | ... | frame F-1 | trash frame |
      every local layer's K, V (+ int8 scales)           the same arrays; frame f holds one pool chunk's
                                                         cells in every local layer, or nothing
    frame_of   int32 [N + 1]                  pool chunk -> frame (-1: not resident), fixed device address
    frames.tables int32 [n_slots, table_chunks]   slot s, logical chunk j -> frame (trash frame elsewhere),
                                              fixed device address, rows set in place for the step's slots

The coordinator never sees any of this: its tables name pool chunks, and residency is the stage's own cache.

Rules:
1. The host pool is canonical. Every cell a step writes reaches it in the same step (rule 4), so a frame is
   only ever a copy: eviction writes nothing back, and a SIGKILLed stage re-attaches its pool file and loses
   nothing a finished step wrote.
2. A frame is valid for chunk c only while c's generation (the pool file's header, set from the coordinator's
   OPS before any step that follows them) is the one it was filled under; a frame found stale is dropped and
   the chunk filled again. Every host-side rewrite of a chunk's bytes that bypasses the window (a session LOAD
   into a freshly reserved table, a pool-off exchange) comes with a new generation, so the stage never
   invalidates by hand. A new coordinator session restarts generations: `clear()` then drops every frame.
3. `begin(batch)` makes the chunks the step reads and writes resident. U = for each entry, the pool chunks of
   logical chunks [lo // C, ceil((start + n) / C)), lo the oldest cell any local layer can see (0 unless every
   local layer has a sliding window). Then either
   - a resident step (|U| <= F): misses are filled whole (every layer) into free frames, then into the least
     recently used frames outside U; attention runs through `frames` with stages/attention.py unchanged; or
   - a streamed step (|U| > F): valid frames of U stay (at most F - 1, most recently used first); every other
     frame becomes a stream buffer. For each layer the rest of U passes through the buffers a piece at a time
     (one layer's cells per chunk; a piece's scores at most PIECE_SCORE_BYTES) and stages/split_attention.py
     merges the pieces exactly. Buffers hold one layer only, so they hold no chunk after the step.
   The host trash chunk maps to the trash frame and is never filled.
4. Writes: a step's new K/V are encoded once on the device (int8: quantised once, so host and frame hold the
   same bytes), stored in the frames through the step's tables (a chunk with no frame this step names the
   trash frame), and copied through to the host pool: at the end of a resident step (one sync), before the
   pieces of each layer of a streamed step (they read the host).
5. Eviction is least recently used first, and never takes a frame of U.
6. Copies host -> frame go on a copy stream on CUDA, ordered after the work already queued on the compute
   stream (a frame may be overwritten only once nothing queued reads it) and before the step's kernels.
7. `stats` counts: steps, streamed_steps, hits (chunks of U found valid), fills (whole chunks copied in),
   stale (frames dropped by rule 2), evictions, streamed (chunk layers copied into buffers), h2d_bytes,
   d2h_bytes (write-through).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Iterator

import torch

from pool.window_plan import PIECE_SCORE_BYTES
from stages.attention import encode_kv, paged_attention, store_kv, token_cells
from stages.batch import StepBatch
from stages.kv_cache import KVCache
from stages.split_attention import Piece, finish, merge, partial_attention

COUNTERS = ("steps", "streamed_steps", "hits", "fills", "stale", "evictions", "streamed", "h2d_bytes", "d2h_bytes")


def frames_for(device_cells: int, chunk_cells: int, n_chunks: int) -> int:
    """Frames of a window of `device_cells` cells: whole chunks, rounded up, at most the pool's chunks."""
    return min(n_chunks, math.ceil(device_cells / chunk_cells))


class DeviceWindow:
    """Frames over `host` on `device` (see the module docstring for the rules)."""

    def __init__(self, host: KVCache, n_frames: int, device: torch.device | str, generations: Sequence[int],
                 sliding_windows: Sequence[int | None], heads: int) -> None:
        if n_frames < 1:
            raise ValueError(f"a device window needs at least one frame, got {n_frames}")
        if host.device.type != "cpu":
            raise ValueError(f"the host pool must be in host memory, not on {host.device}")
        self.host, self.n_frames, self.heads = host, n_frames, heads
        self.device = torch.device(device)
        self.frames = KVCache(host.n_layers, n_frames, host.chunk_cells, host.kv_heads, host.head_dim, host.kv_dtype,
                              self.device, host.n_slots, host.table_chunks)
        self.generations = generations
        windows = list(sliding_windows)
        self._reach = None if not windows or None in windows else max(windows)  # oldest cell any layer sees
        self._chunk: list[int | None] = [None] * n_frames  # pool chunk each frame holds
        self._gen = [0] * n_frames  # the generation it was filled under
        self._frame_of: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # frames that hold a chunk, least recently used first
        self.frame_of = torch.full((host.n_chunks + 1,), -1, dtype=torch.int32, device=self.device)
        self.frame_nbytes = sum(a[0].numel() * a.element_size() for a in self.frames.arrays())
        self.stats = dict.fromkeys(COUNTERS, 0)
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def cells(self) -> int:
        return self.n_frames * self.host.chunk_cells

    @property
    def device_nbytes(self) -> int:
        """Bytes of the frames (the trash frame included) and the two tables."""
        return (self.n_frames + 1) * self.frame_nbytes + self.frame_of.nbytes + self.frames.tables.nbytes

    def describe(self) -> dict:
        return {"frames": self.n_frames, "cells": self.cells, "device_bytes": self.device_nbytes,
                "resident": len(self._frame_of), **self.stats}

    # ---- residency -----------------------------------------------------------------------------------
    def resident(self, chunk: int) -> int | None:
        """The frame validly holding `chunk`, or None; a frame found stale (rule 2) is dropped."""
        f = self._frame_of.get(chunk)
        if f is not None and self._gen[f] != self.generations[chunk]:
            self._drop(f)
            self.stats["stale"] += 1
            return None
        return f

    def clear(self) -> None:
        """Drop every frame (a new coordinator session: generations are counted anew)."""
        for f in list(self._lru):
            self._drop(f)
        self._sync_frame_of()

    def _drop(self, f: int) -> None:
        chunk = self._chunk[f]
        if chunk is not None:
            del self._frame_of[chunk]
            self._chunk[f] = None
            self._lru.pop(f, None)

    def _hold(self, f: int, chunk: int) -> None:
        self._drop(f)
        self._chunk[f], self._gen[f] = chunk, self.generations[chunk]
        self._frame_of[chunk] = f
        self._lru[f] = None

    def _sync_frame_of(self) -> None:
        row = [-1] * (self.host.n_chunks + 1)
        for chunk, f in self._frame_of.items():
            row[chunk] = f
        row[self.host.trash] = self.frames.trash
        self.frame_of.copy_(torch.tensor(row, dtype=torch.int32))

    @contextmanager
    def _copies(self) -> Iterator[None]:
        """Host -> frame copies inside this block run on the copy stream on CUDA (rule 6)."""
        if self._copy_stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(compute)
        with torch.cuda.stream(self._copy_stream):
            yield
        compute.wait_stream(self._copy_stream)

    def _fill(self, f: int, chunk: int) -> None:
        for frame_arr, host_arr in zip(self.frames.arrays(), self.host.arrays()):
            frame_arr[f].copy_(host_arr[chunk], non_blocking=True)
        self._hold(f, chunk)
        self.stats["fills"] += 1
        self.stats["h2d_bytes"] += self.frame_nbytes

    # ---- a step ----------------------------------------------------------------------------------------
    def needed(self, batch: StepBatch) -> list[tuple[int, int, list[int]]]:
        """Per entry of the step: (slot, first logical chunk j0, the pool chunks of j0 .. its last chunk)."""
        c, out = self.host.chunk_cells, []
        for slot, start, n, _ in batch.slots:
            lo = 0 if self._reach is None else max(0, start - self._reach + 1)
            j0 = lo // c
            out.append((slot, j0, self.host.host_tables[slot][j0:-(-(start + n) // c)]))
        return out

    @contextmanager
    def step(self, batch: StepBatch) -> Iterator["StepView"]:
        """Make the step's chunks resident, yield the view the model runs against, then write through."""
        view = self.begin(batch)
        try:
            yield view
        finally:
            self.end(view)

    def begin(self, batch: StepBatch) -> "StepView":
        needs = self.needed(batch)
        trash = self.host.trash
        union = list(dict.fromkeys(ch for _, _, chunks in needs for ch in chunks if ch != trash))
        held = {ch: f for ch in union if (f := self.resident(ch)) is not None}
        self.stats["steps"] += 1
        self.stats["hits"] += len(held)
        if len(union) <= self.n_frames:
            place = self._fill_all(union, held)
            pieces: list[tuple[Piece, list[tuple[int, int]]]] = []
        else:
            place, pieces = self._stream_plan(batch, needs, union, held)
            self.stats["streamed_steps"] += 1
        for f in place.values():
            self._lru.move_to_end(f)
        self._sync_frame_of()
        for slot, _, _ in needs:
            row = [place.get(ch, self.frames.trash) for ch in self.host.host_tables[slot]]
            if row != self.frames.host_tables[slot]:
                self.frames.set_table(slot, row)
        return StepView(self, batch, pieces)

    def _fill_all(self, union: list[int], held: dict[int, int]) -> dict[int, int]:
        """A resident step: every chunk of `union` gets a frame (rule 3); returns chunk -> frame."""
        place = dict(held)
        free = [f for f in range(self.n_frames) if self._chunk[f] is None]
        victims = (f for f in list(self._lru) if self._chunk[f] not in place)
        with self._copies():
            for ch in union:
                if ch in place:
                    continue
                f = free.pop(0) if free else next(victims)
                if self._chunk[f] is not None:
                    self.stats["evictions"] += 1
                self._fill(f, ch)
                place[ch] = f
        return place

    def _stream_plan(self, batch: StepBatch, needs: list, union: list[int], held: dict[int, int]):
        """A streamed step: which frames stay, and the pieces each layer reads (rule 3)."""
        recency = {f: i for i, f in enumerate(self._lru)}
        keep = sorted(held, key=lambda ch: recency[held[ch]], reverse=True)[: self.n_frames - 1]
        place = {ch: held[ch] for ch in keep}
        buffers = [f for f in range(self.n_frames) if f not in place.values()]
        for f in buffers:
            if self._chunk[f] is not None:
                self.stats["evictions"] += 1
            self._drop(f)
        rest = [ch for ch in union if ch not in place]
        c = self.host.chunk_cells
        # A piece's scores are [entries, heads, queries, cells]: at most PIECE_SCORE_BYTES of float32.
        per_chunk = batch.num_seqs * self.heads * batch.max_new * c * 4
        size = max(1, min(len(buffers), PIECE_SCORE_BYTES // per_chunk))
        groups = [rest[i:i + size] for i in range(0, len(rest), size)]
        pieces = []
        for i, group in enumerate(groups):
            where = {**(place if i == 0 else {}), **{ch: buffers[k] for k, ch in enumerate(group)},
                     self.host.trash: self.frames.trash}
            cells, positions = [], []
            for (slot, j0, chunks), (_, start, n, _) in zip(needs, batch.slots):
                ctx = start + n
                ce, pe = [], []
                for j, ch in enumerate(chunks, start=j0):
                    f = where.get(ch)
                    if f is None or (ch == self.host.trash and i > 0):
                        continue
                    m = min(c, ctx - j * c)
                    ce.extend(range(f * c, f * c + m))
                    pe.extend(range(j * c, j * c + m))
                cells.append(ce)
                positions.append(pe)
            pieces.append((Piece(cells, positions), [(buffers[k], ch) for k, ch in enumerate(group)]))
        return place, pieces

    def end(self, view: "StepView") -> None:
        """Write the step's cells through (rule 4); stream buffers hold nothing after a streamed step."""
        view.flush()

    def stream_in(self, layer: int, copies: list[tuple[int, int]]) -> None:
        """Copy one layer's cells of pool chunks into stream buffers: [(frame, chunk), ...]."""
        with self._copies():
            for f, chunk in copies:
                for which in self.host_arrays:
                    getattr(self.frames, which)[layer][f].copy_(getattr(self.host, which)[layer][chunk],
                                                                non_blocking=True)
        self.stats["streamed"] += len(copies)
        self.stats["h2d_bytes"] += len(copies) * self.frame_nbytes // self.host.n_layers

    @property
    def host_arrays(self) -> tuple[str, ...]:
        return ("k", "v", "k_scale", "v_scale") if self.host.quantized else ("k", "v")


class StepView:
    """What the model runs one step against: `attend` writes the new K/V and attends (rules 3 and 4)."""

    def __init__(self, window: DeviceWindow, batch: StepBatch, pieces: list) -> None:
        self.window, self.batch, self.pieces = window, batch, pieces
        frames = window.frames
        self.n_layers, self.kv_heads, self.head_dim = frames.n_layers, frames.kv_heads, frames.head_dim
        self._pending: list[tuple[int, list[tuple[str, torch.Tensor]]]] = []

    def attend(self, layer: int, batch: StepBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float, sliding_window: int | None) -> torch.Tensor:
        w = self.window
        encoded = encode_kv(w.frames, k, v)
        store_kv(w.frames, layer, token_cells(w.frames, batch), encoded)
        self._pending.append((layer, [(which, _to_host(rows)) for which, rows in encoded]))
        if not self.pieces:
            return paged_attention(q, w.frames, layer, batch, scale, sliding_window)
        self.flush()  # the pieces read the host pool: this step's cells must be there first
        partial = None
        for piece, copies in self.pieces:
            w.stream_in(layer, copies)
            partial = merge(partial, partial_attention(q, w.frames, layer, batch, piece, scale, sliding_window))
        return finish(partial, batch, q.dtype)

    def flush(self) -> None:
        """Store the pending write-through rows in the host pool (after the device finished producing them)."""
        if not self._pending:
            return
        w = self.window
        if w.device.type == "cuda":
            torch.cuda.current_stream(w.device).synchronize()
        cells = token_cells(w.host, self.batch)
        for layer, encoded in self._pending:
            store_kv(w.host, layer, cells, encoded)
            w.stats["d2h_bytes"] += sum(rows.nbytes for _, rows in encoded)
        self._pending.clear()


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory: itself on CPU; on CUDA an asynchronous copy into pinned memory (valid after a sync)."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out
