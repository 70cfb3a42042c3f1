"""Chunk tables: which pool chunk backs each part of each conversation (bookkeeping only, no torch).

The coordinator owns the only authoritative tables, a `ChunkMap` (pool on) or a `StaticMap` (pool off), and
sends every change to every stage as one ordered stream of ops; each stage keeps a `TableMirror` and copies the
slot rows it changes into its device table.

    pool:   | chunk 0 | chunk 1 | ... | chunk N-1 | trash chunk N |     each chunk = C cells (chunk_cells)
    table:  [ e0 | e1 | ... | e(T-1) ]     entry i backs cells [i*C, (i+1)*C); T = table_chunks

Rules of ChunkMap:
 1. Chunks 0..N-1 are usable; chunk N is the trash chunk. It is never handed out, and every entry that is not
    reserved names it, so a stray write lands there, never in another conversation's cells.
 2. Tables 0..n_slots-1 are the slots and always exist. `new_table()` hands out a further id for a parked
    conversation; ids are never reused, so a stale id cannot name someone else's conversation.
    `drop_table(t)` forgets a table that holds nothing; a slot cannot be dropped.
 3. A table holds a prefix: entries [0, held_chunks) are its chunks, the rest are trash.
 4. `reserve(t, cells)` backs cells [0, cells), i.e. ceil(cells / C) chunks. All or nothing: when cells > T*C
    or the free chunks do not cover the missing ones it returns False and nothing changes (entries, counters,
    generations, version, op log). `can_reserve(t, cells)` is the same check without acting.
 5. Order: a fresh pool hands out the lowest chunk first (0, 1, 2, ...). Freed chunks go on a LIFO free list,
    the one from the lowest table index on top, so the next reserve gets the chunks just freed and
    `release(t)` then `reserve(t, same cells)` gives back the same entries. A stack is O(1) both ways, and
    its order is fully determined, so tests can pin exact chunk ids.
 6. `shrink(t, cells)` gives back the chunks past ceil(cells / C); `release(t)` is `shrink(t, 0)`.
 7. `swap(a, b)` exchanges two tables in place: O(T), no chunk changes owner, no byte of K/V moves. This is
    how a conversation moves between a slot and its parked table.
 8. `version` bumps by one per op logged. A call that changes no entry is not a change and logs nothing: a
    reserve already covered, a shrink that frees nothing, a swap of a table with itself or of two empty
    tables, `new_table()`. A failed call never changes anything.
 9. `generation(chunk)` bumps when the chunk changes owner (reserved or freed), not on a swap (the chunk keeps
    its conversation). A reader that noted (chunk, generation) can tell that the bytes are no longer its own;
    a re-attached stage compares them with the coordinator's to know which conversations survived.
10. Counters are O(1): free_chunks, free_cells = free_chunks*C, total_cells = N*C, held_chunks(t),
    held_cells(t) = held_chunks(t)*C (cells backed, not cells written). free_cells + sum(held_cells) = total.
11. Ops (msgpack-able lists, tagged with the version after them): ["set", v, table, [[index, chunk], ...]]
    (entries that changed, trash included), ["swap", v, a, b], ["drop", v, table]; StaticMap also logs
    ["exchange", v, a, b, cells]. `drain_ops()` returns the ops since the last drain, in order.
    `snapshot_ops()` rebuilds the current state on a fresh mirror (`TableMirror.load`): one "set" per slot
    and per other table that holds chunks, all tagged with the current version. Drain (and send) first,
    then snapshot: ops still in the log are older than the snapshot and a mirror refuses them as stale.

Where the rest lives, all of it importable from here as the rest of the code does:
    pool/tables.py       what both maps share (`Tables`, `region`, the `Op` type)
    pool/static_map.py   StaticMap, the pool-off baseline, and its rules
    pool/mirror.py       TableMirror, a stage's copy, and the op checks (OpError, StaleOp, OpGap)
"""
from __future__ import annotations

from pool.mirror import OpError, OpGap, StaleOp, TableMirror
from pool.static_map import StaticMap
from pool.tables import Op, Tables, region

__all__ = ["ChunkMap", "Op", "OpError", "OpGap", "StaleOp", "StaticMap", "TableMirror", "Tables", "region"]


class ChunkMap(Tables):
    """The shared pool's tables (pool on). Rules 1-11 of the module docstring."""

    def __init__(self, n_chunks: int, chunk_cells: int, table_chunks: int, n_slots: int) -> None:
        super().__init__(n_chunks, chunk_cells, table_chunks, n_slots)
        # Free chunks as a stack, top at the end: a fresh pool pops 0 first; a freed chunk is pushed and
        # popped next (rule 5).
        self._free = list(range(n_chunks - 1, -1, -1))
        self._next_table = n_slots

    @property
    def free_chunks(self) -> int:
        return len(self._free)

    def new_table(self) -> int:
        """A new empty table for a parked conversation; ids grow and are never reused."""
        t = self._next_table
        self._next_table += 1
        self._add_table(t)
        return t

    def drop_table(self, t: int) -> None:
        """Forget table `t`; it must hold nothing and must not be a slot."""
        self._drop(t)

    def can_reserve(self, t: int, cells: int) -> bool:
        """Whether `reserve(t, cells)` would succeed now."""
        self._check(t)
        want = self._chunks_for(cells)
        return want <= self.table_chunks and want - self._held[t] <= len(self._free)

    def reserve(self, t: int, cells: int) -> bool:
        """Back cells [0, cells) of `t`; all or nothing (False and no change when it cannot)."""
        if not self.can_reserve(t, cells):
            return False
        old, new = self._held[t], self._chunks_for(cells)
        if new <= old:
            return True
        row = self._rows[t]
        changed = []
        for i in range(old, new):
            c = self._free.pop()
            row[i] = c
            self._generations[c] += 1
            changed.append([i, c])
        self._held[t] = new
        self._log("set", t, changed)
        return True

    def shrink(self, t: int, cells: int) -> None:
        """Give back the chunks of `t` past ceil(cells / chunk_cells)."""
        self._check(t)
        keep, old = self._chunks_for(cells), self._held[t]
        if keep >= old:
            return
        row = self._rows[t]
        for i in range(old - 1, keep - 1, -1):  # the lowest index is pushed last, so it comes out first
            c = row[i]
            row[i] = self.trash
            self._generations[c] += 1
            self._free.append(c)
        self._held[t] = keep
        self._log("set", t, [[i, self.trash] for i in range(keep, old)])

    def swap(self, a: int, b: int) -> None:
        """Exchange tables `a` and `b` in place; no chunk changes owner, no K/V byte moves."""
        self._check(a)
        self._check(b)
        if a == b or self._held[a] == self._held[b] == 0:
            return
        self._rows[a], self._rows[b] = self._rows[b], self._rows[a]
        self._held[a], self._held[b] = self._held[b], self._held[a]
        self._log("swap", a, b)
