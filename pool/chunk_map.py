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
 6. `shrink(t, cells)` gives back the chunks past ceil(cells / C); `release(t)` is `shrink(t, 0)`. A chunk that
    another table also holds is never kept in part: when `cells` falls inside it, it goes too (t keeps
    floor(cells / C) chunks), because t's next write, at cell `cells`, would land in it (rule 16).
 7. `swap(a, b)` exchanges two tables in place: O(T), no chunk changes owner, no byte of K/V moves. This is
    how a conversation moves between a slot and its parked table.
 8. `version` bumps by one per op logged. A call that changes no entry is not a change and logs nothing: a
    reserve already covered, a shrink that frees nothing, a swap of a table with itself or of two empty
    tables, `new_table()`, a publish. A failed call never changes anything.
 9. `generation(chunk)` bumps when the chunk leaves the free list (reserved) and when it returns to it
    (freed by its last holder), not on a swap (the chunk keeps its conversation) and not when a table takes
    or drops a reference while another holds it (the bytes stay those of the same tokens). A reader that
    noted (chunk, generation) can tell that the bytes are no longer its own; a re-attached stage compares
    them with the coordinator's to know which conversations survived.
10. Counters are O(1): free_chunks, free_cells = free_chunks*C, total_cells = N*C, held_chunks(t),
    held_cells(t) = held_chunks(t)*C (cells backed, not cells written; shared ones included), shared_cells
    (cells in chunks that more than one table holds), saved_cells (sum over chunks of (refs - 1) * C: what
    the tables would hold on top without sharing). free_cells + distinct held cells = total, and
    free_cells + sum(held_cells) = total + saved_cells.
11. Ops (msgpack-able lists, tagged with the version after them): ["set", v, table, [[index, chunk], ...]]
    (entries that changed, trash included; a "set" never names a chunk another table holds),
    ["share", v, table, [[index, chunk], ...]] (chunks other tables hold, mapped into an empty table),
    ["swap", v, a, b], ["drop", v, table]; StaticMap also logs ["exchange", v, a, b, cells]. `drain_ops()`
    returns the ops since the last drain, in order. `snapshot_ops()` rebuilds the current state on a fresh
    mirror (`TableMirror.load`): one "set" per slot and per other table that holds chunks (the chunks no
    lower table names), followed by a "share" for the chunks a lower table names, all tagged with the current
    version. Drain (and send) first, then snapshot: ops still in the log are older than the snapshot and a
    mirror refuses them as stale.

Sharing (pool on only; StaticMap never shares):
12. A chunk may be named by several tables. `refs(chunk)` is the number of tables naming it, 0 for a free
    chunk, and the trash chunk is never counted. Shrink and release drop one reference per chunk; a chunk
    returns to the free list when its last holder lets it go, and only then.
13. `publish(t, tokens, cells=None)`: cells [0, cells) of t (default len(tokens)) hold the written K/V of
    tokens[0:cells]. Every full chunk of t inside them is registered in the prefix index (pool/prefix_index.py:
    keyed by its parent chunk and its own token ids, so by every token up to its end); a partial chunk is
    not. It goes entry by entry from where t's registered run ends and stops at a chunk whose tokens another
    chunk already holds (that one stays private until the other is freed). It logs nothing. Entries past the
    run hold chunks with no key (a table's registered chunks form a prefix of its row).
14. `lookup(tokens, limit)` returns the chunks of the longest run of registered chunks holding tokens[0:C],
    tokens[C:2C], ..., at most `limit` of them; the ids are compared, not only hashed.
15. `share(t, chunks)` maps such a run into entries [0, k) of t, which must hold nothing: each chunk gains a
    reference and keeps its generation; logs one "share". All or nothing: a run that is not a chain of
    registered chunks from entry 0 (what `lookup` returns) is a ValueError and nothing changes.
16. Writes never land in a chunk two tables hold. A table's shared run is full (rule 13), so its writes start
    past it; a shrink into a shared chunk drops it (rule 6); a shrink into a registered chunk t holds alone
    forgets its key, since t's next write will change its bytes. A freed chunk's key is forgotten too.
17. `exclusive_cells(t)`: cells of the chunks only t holds, what evicting t alone frees. `cells_freed_by(ts)`:
    cells of the chunks held by the tables `ts` and by no other table, what evicting all of them frees.

Where the rest lives, all of it importable from here as the rest of the code does:
    pool/tables.py       what both maps share (`Tables`, `region`, the `Op` type)
    pool/static_map.py   StaticMap, the pool-off baseline, and its rules
    pool/mirror.py       TableMirror, a stage's copy, and the op checks (OpError, StaleOp, OpGap, SharedWrite)
    pool/prefix_index.py the index of shareable chunks (rules 13-14)
"""
from __future__ import annotations

from typing import Iterable, Sequence

from pool.mirror import OpError, OpGap, SharedWrite, StaleOp, TableMirror
from pool.prefix_index import ROOT, PrefixIndex
from pool.static_map import StaticMap
from pool.tables import Op, Tables, region

__all__ = ["ChunkMap", "Op", "OpError", "OpGap", "SharedWrite", "StaleOp", "StaticMap", "TableMirror", "Tables",
           "region"]


class ChunkMap(Tables):
    """The shared pool's tables (pool on). Rules 1-17 of the module docstring."""

    def __init__(self, n_chunks: int, chunk_cells: int, table_chunks: int, n_slots: int) -> None:
        super().__init__(n_chunks, chunk_cells, table_chunks, n_slots)
        # Free chunks as a stack, top at the end: a fresh pool pops 0 first; a freed chunk is pushed and
        # popped next (rule 5).
        self._free = list(range(n_chunks - 1, -1, -1))
        self._next_table = n_slots
        self._refs = [0] * n_chunks  # tables naming each chunk (rule 12); the trash chunk has no entry
        self._multi = 0  # chunks with refs > 1
        self._extra = 0  # sum of refs - 1 over those chunks
        self._index = PrefixIndex(chunk_cells)
        self._published = dict.fromkeys(range(n_slots), 0)  # per table: its leading entries that are registered

    @property
    def free_chunks(self) -> int:
        return len(self._free)

    @property
    def shared_cells(self) -> int:
        return self._multi * self.chunk_cells

    @property
    def saved_cells(self) -> int:
        return self._extra * self.chunk_cells

    def refs(self, chunk: int) -> int:
        """Tables naming `chunk` (rule 12); 0 for a free chunk and for the trash chunk."""
        self.generation(chunk)  # validates the id
        return self._refs[chunk] if chunk < self.n_chunks else 0

    def new_table(self) -> int:
        """A new empty table for a parked conversation; ids grow and are never reused."""
        t = self._next_table
        self._next_table += 1
        self._add_table(t)
        self._published[t] = 0
        return t

    def drop_table(self, t: int) -> None:
        """Forget table `t`; it must hold nothing and must not be a slot."""
        self._drop(t)
        del self._published[t]

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
            self._refs[c] = 1
            self._generations[c] += 1
            changed.append([i, c])
        self._held[t] = new
        self._log("set", t, changed)
        return True

    def shrink(self, t: int, cells: int) -> None:
        """Give back the chunks of `t` past ceil(cells / chunk_cells); a shared chunk `cells` falls inside goes
        too, and a registered one `t` keeps alone loses its key (rules 6 and 16)."""
        self._check(t)
        keep, old = self._chunks_for(cells), self._held[t]
        row = self._rows[t]
        if cells % self.chunk_cells and keep <= old:  # t's next write lands inside entry keep - 1
            c = row[keep - 1]
            if self._refs[c] > 1:
                keep -= 1
            elif self._index.registered(c):
                self._index.remove(c)
                self._published[t] = min(self._published[t], keep - 1)
        if keep >= old:
            return
        for i in range(old - 1, keep - 1, -1):  # the lowest index is pushed last, so it comes out first
            c = row[i]
            row[i] = self.trash
            self._unref(c)
        self._held[t] = keep
        self._published[t] = min(self._published[t], keep)
        self._log("set", t, [[i, self.trash] for i in range(keep, old)])

    def swap(self, a: int, b: int) -> None:
        """Exchange tables `a` and `b` in place; no chunk changes owner, no K/V byte moves."""
        self._check(a)
        self._check(b)
        if a == b or self._held[a] == self._held[b] == 0:
            return
        self._rows[a], self._rows[b] = self._rows[b], self._rows[a]
        self._held[a], self._held[b] = self._held[b], self._held[a]
        self._published[a], self._published[b] = self._published[b], self._published[a]
        self._log("swap", a, b)

    # ---- sharing (rules 12-17)
    def publish(self, t: int, tokens: Sequence[int], cells: int | None = None) -> None:
        """Register the full chunks of `t` inside cells [0, cells), which hold the K/V of tokens[0:cells]
        (rule 13)."""
        self._check(t)
        n = len(tokens) if cells is None else cells
        if not 0 <= n <= len(tokens):
            raise ValueError(f"publish: {n} cells of table {t} but {len(tokens)} tokens")
        c, row = self.chunk_cells, self._rows[t]
        for i in range(self._published[t], min(n // c, self._held[t])):
            if not self._index.add(row[i], row[i - 1] if i else ROOT, tokens[i * c:(i + 1) * c]):
                return  # another chunk holds these tokens: this one stays private until that one is freed
            self._published[t] = i + 1

    def lookup(self, tokens: Sequence[int], limit: int | None = None) -> list[int]:
        """The longest run of registered chunks holding tokens[0:C], tokens[C:2C], ... (rule 14)."""
        limit = self.table_chunks if limit is None else min(limit, self.table_chunks)
        return self._index.match(tokens, limit)

    def share(self, t: int, chunks: Sequence[int]) -> None:
        """Map a registered run (what `lookup` returns) into entries [0, k) of empty table `t` (rule 15)."""
        self._check(t)
        if self._held[t]:
            raise ValueError(f"share: table {t} holds {self._held[t]} chunks; a shared run goes into an empty table")
        if len(chunks) > self.table_chunks:
            raise ValueError(f"share: {len(chunks)} chunks, a table has {self.table_chunks} entries")
        parent = ROOT
        for i, c in enumerate(chunks):
            key = self._index.key_of(c) if isinstance(c, int) and 0 <= c < self.n_chunks else None
            if key is None or key[0] != parent:
                raise ValueError(f"share: entry {i} names chunk {c}, which is not the registered chunk after "
                                 f"{'the root' if parent == ROOT else f'chunk {parent}'}; share what lookup returns")
            parent = c
        if not chunks:
            return
        row = self._rows[t]
        for i, c in enumerate(chunks):
            row[i] = c
            self._refs[c] += 1
            self._multi += self._refs[c] == 2
            self._extra += 1
        self._held[t] = self._published[t] = len(chunks)
        self._log("share", t, [[i, c] for i, c in enumerate(chunks)])

    def exclusive_cells(self, t: int) -> int:
        """Cells of the chunks only `t` holds: what evicting `t` alone gives back (rule 17)."""
        held = self._rows[self._check(t)][: self._held[t]]
        return sum(1 for c in held if self._refs[c] == 1) * self.chunk_cells

    def cells_freed_by(self, tables: Iterable[int]) -> int:
        """Cells of the chunks that `tables` hold and no other table does (rule 17)."""
        counts: dict[int, int] = {}
        for t in set(tables):
            for c in self._rows[self._check(t)][: self._held[t]]:
                counts[c] = counts.get(c, 0) + 1
        return sum(1 for c, n in counts.items() if n == self._refs[c]) * self.chunk_cells

    def snapshot_ops(self) -> list[Op]:
        """Rule 11: per table a "set" of the chunks no lower table names, then a "share" of the others."""
        v, seen, ops = self._version, set(), []
        for t, row in sorted(self._rows.items()):
            if t >= self.n_slots and self._held[t] == 0:
                continue
            held = list(enumerate(row[: self._held[t]]))
            ops.append(["set", v, t, [[i, c] for i, c in held if c not in seen]])
            shared = [[i, c] for i, c in held if c in seen]
            if shared:
                ops.append(["share", v, t, shared])
            seen.update(c for _, c in held)
        return ops

    # ---- helpers
    def _unref(self, c: int) -> None:
        """Drop one reference to `c`; the last one frees it (rules 9 and 12)."""
        self._refs[c] -= 1
        if self._refs[c] >= 1:
            self._extra -= 1
            self._multi -= self._refs[c] == 1
            return
        self._generations[c] += 1
        self._index.remove(c)
        self._free.append(c)
