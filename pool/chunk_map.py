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

StaticMap (pool off, the baseline the benchmarks compare against): n_chunks = (n_slots + 1) * T, cut into fixed
regions; region r is chunks [r*T, (r+1)*T). Slot s owns region s; `new_table()` returns the one park table
(id n_slots, region n_slots) or None while it is taken. `reserve` only checks cells <= T*C and records the held
cells (exact); entries are the identity inside the region up to ceil(held / C) and trash past it, so a stray
write still lands in the trash chunk. `swap(a, b)` cannot exchange tables, because a slot's region is fixed
memory: it logs ["exchange", v, a, b, cells] with cells = max held cells of both, on which every stage swaps
the bytes of the first `cells` cells of the two regions (a copy, O(cells)), then "set" ops for the entries of
a and b where their held extents differ. That copy is exactly what the pool's O(T) swap avoids. Generations
bump for the region chunks the exchange overwrites.

TableMirror (a stage's copy): `apply(op)` accepts only the op with version `mirror.version + 1` and raises
`StaleOp` (already seen) or `OpGap` (one is missing) otherwise, before changing anything. `changed_slots` holds
the slots whose rows the last apply (or load) touched. An "exchange" op records only its version: the stage
runner moves the bytes of the two regions (`region(table, table_chunks)`).
"""
from __future__ import annotations

from typing import Any, Sequence

Op = list[Any]


class OpError(ValueError):
    """An op a mirror cannot apply; nothing was changed."""


class StaleOp(OpError):
    """An op whose version the mirror has already reached (sent twice, or older than a snapshot)."""


class OpGap(OpError):
    """An op that skips versions: one or more ops before it were lost or reordered."""


def region(table: int, table_chunks: int) -> list[int]:
    """Chunks of a StaticMap table's fixed region: [table*T, (table+1)*T)."""
    return list(range(table * table_chunks, (table + 1) * table_chunks))


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class _Tables:
    """What both maps share: table rows, held chunks, generations, version and the op log."""

    def __init__(self, n_chunks: int, chunk_cells: int, table_chunks: int, n_slots: int) -> None:
        self.n_chunks = _positive("n_chunks", n_chunks)
        self.chunk_cells = _positive("chunk_cells", chunk_cells)
        self.table_chunks = _positive("table_chunks", table_chunks)
        self.n_slots = _positive("n_slots", n_slots)
        self.trash = n_chunks
        self._rows: dict[int, list[int]] = {}
        self._held: dict[int, int] = {}
        for s in range(n_slots):
            self._add_table(s)
        self._generations = [0] * (n_chunks + 1)
        self._version = 0
        self._ops: list[Op] = []

    # -- reading
    @property
    def version(self) -> int:
        return self._version

    @property
    def free_chunks(self) -> int:
        raise NotImplementedError

    @property
    def free_cells(self) -> int:
        return self.free_chunks * self.chunk_cells

    @property
    def total_cells(self) -> int:
        return self.n_chunks * self.chunk_cells

    @property
    def max_cells(self) -> int:
        """Cells one table can back: table_chunks * chunk_cells."""
        return self.table_chunks * self.chunk_cells

    @property
    def tables(self) -> list[int]:
        """Ids of the tables that exist, slots first."""
        return sorted(self._rows)

    def entries(self, t: int) -> list[int]:
        return list(self._rows[self._check(t)])

    def held_chunks(self, t: int) -> int:
        return self._held[self._check(t)]

    def held_cells(self, t: int) -> int:
        return self._held[self._check(t)] * self.chunk_cells

    def generation(self, chunk: int) -> int:
        if not 0 <= chunk <= self.n_chunks:
            raise IndexError(f"chunk {chunk} is outside 0..{self.n_chunks} (trash = {self.n_chunks})")
        return self._generations[chunk]

    def generations_of(self, ops: Sequence[Op]) -> list[list[int]]:
        """[[chunk, generation now], ...] for every chunk `ops` give to a table or write bytes into ("set"
        entries that are not trash, the region cells an "exchange" rewrites), each once, ascending.

        A stage records these beside its K/V when it applies the ops, so after a crash it can report which
        owners its bytes belong to (rule 9). Freed chunks are not listed: no table holds them.
        """
        chunks: set[int] = set()
        for op in ops:
            if op[0] == "set":
                chunks.update(c for _, c in op[3] if c != self.trash)
            elif op[0] == "exchange":
                n = self._chunks_for(op[4])
                chunks.update(region(op[2], self.table_chunks)[:n] + region(op[3], self.table_chunks)[:n])
        return [[c, self._generations[c]] for c in sorted(chunks)]

    def intact(self, t: int, generations: Sequence[int] | None) -> bool:
        """Whether every chunk table `t` holds has, in `generations` (a stage's, indexed by chunk), the
        generation it has here: then that stage applied the op that gave it to `t` and its bytes are `t`'s.
        None (a stage that kept no generations) is never intact unless `t` holds nothing."""
        held = self._rows[self._check(t)][: self._held[t]]
        if not held:
            return True
        if generations is None:
            return False
        return all(c < len(generations) and generations[c] == self._generations[c] for c in held)

    def release(self, t: int) -> None:
        """Give back every chunk of `t` (shrink to 0 cells)."""
        self.shrink(t, 0)

    def shrink(self, t: int, cells: int) -> None:
        raise NotImplementedError

    # -- ops
    def drain_ops(self) -> list[Op]:
        """Ops logged since the last drain, oldest first; the log is emptied."""
        ops, self._ops = self._ops, []
        return ops

    def snapshot_ops(self) -> list[Op]:
        """Ops that rebuild the current state on a fresh mirror: every slot, and every other table that holds
        chunks, as one "set" of its non-trash entries, all tagged with the current version."""
        v = self._version
        return [
            ["set", v, t, [[i, c] for i, c in enumerate(row) if c != self.trash]]
            for t, row in sorted(self._rows.items())
            if t < self.n_slots or self._held[t] > 0
        ]

    # -- helpers
    def _add_table(self, t: int) -> None:
        self._rows[t] = [self.trash] * self.table_chunks
        self._held[t] = 0

    def _check(self, t: int) -> int:
        if t not in self._rows:
            raise KeyError(f"table {t} does not exist (tables: {self.tables})")
        return t

    def _chunks_for(self, cells: int) -> int:
        if not isinstance(cells, int) or cells < 0:
            raise ValueError(f"cells must be an int >= 0, got {cells!r}")
        return -(-cells // self.chunk_cells)

    def _log(self, kind: str, *args: Any) -> None:
        self._version += 1
        self._ops.append([kind, self._version, *args])

    def _drop(self, t: int) -> None:
        self._check(t)
        if t < self.n_slots:
            raise ValueError(f"table {t} is a slot; slots always exist and cannot be dropped")
        if self._held[t]:
            raise ValueError(f"table {t} still holds {self._held[t]} chunks; release it before dropping")
        del self._rows[t], self._held[t]
        self._log("drop", t)


class ChunkMap(_Tables):
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


class StaticMap(_Tables):
    """The baseline without a pool: one fixed full-context region per slot plus one park region; a move copies
    bytes ("exchange"). Same interface as ChunkMap; the module docstring states the rules and why."""

    def __init__(self, n_chunks: int, chunk_cells: int, table_chunks: int, n_slots: int) -> None:
        super().__init__(n_chunks, chunk_cells, table_chunks, n_slots)
        if n_chunks != (n_slots + 1) * table_chunks:
            raise ValueError(
                f"StaticMap needs n_chunks = (n_slots + 1) * table_chunks = {(n_slots + 1) * table_chunks} "
                f"(one region per slot plus one park region), got n_chunks={n_chunks}"
            )
        self.park = n_slots
        self._cells: dict[int, int] = dict.fromkeys(range(n_slots), 0)
        self._n_free = n_chunks

    @property
    def free_chunks(self) -> int:
        return self._n_free

    def held_cells(self, t: int) -> int:
        """Cells reserved (exact, not rounded to chunks): what an exchange must copy."""
        return self._cells[self._check(t)]

    def new_table(self) -> int | None:
        """The park table (id n_slots), or None while it is taken."""
        if self.park in self._rows:
            return None
        self._add_table(self.park)
        self._cells[self.park] = 0
        return self.park

    def drop_table(self, t: int) -> None:
        """Give the park table back; it must hold nothing."""
        self._drop(t)
        del self._cells[t]

    def can_reserve(self, t: int, cells: int) -> bool:
        self._check(t)
        return self._chunks_for(cells) <= self.table_chunks

    def reserve(self, t: int, cells: int) -> bool:
        """Record that `t` holds cells [0, cells) of its region; False only when cells > the region."""
        if not self.can_reserve(t, cells):
            return False
        if cells > self._cells[t]:
            self._hold(t, cells, bump=True)
        return True

    def shrink(self, t: int, cells: int) -> None:
        self._check(t)
        self._chunks_for(cells)  # validates cells
        if cells < self._cells[t]:
            self._hold(t, cells, bump=True)

    def swap(self, a: int, b: int) -> None:
        """Log an "exchange" (the stages swap the bytes of the first `cells` cells of both regions), then the
        "set" ops that move the held extents with them."""
        self._check(a)
        self._check(b)
        cells = max(self._cells[a], self._cells[b])
        if a == b or cells == 0:
            return
        n = self._chunks_for(cells)
        for c in region(a, self.table_chunks)[:n] + region(b, self.table_chunks)[:n]:
            self._generations[c] += 1
        self._log("exchange", a, b, cells)
        cells_a, cells_b = self._cells[a], self._cells[b]
        self._hold(a, cells_b, bump=False)
        self._hold(b, cells_a, bump=False)

    def _hold(self, t: int, cells: int, bump: bool) -> None:
        """Set the held cells of `t` and log a "set" for the entries whose extent changed."""
        self._cells[t] = cells
        old, new = self._held[t], self._chunks_for(cells)
        if old == new:
            return
        row, own = self._rows[t], region(t, self.table_chunks)
        lo, hi = min(old, new), max(old, new)
        changed = []
        for i in range(lo, hi):
            row[i] = own[i] if new > old else self.trash
            if bump:
                self._generations[own[i]] += 1
            changed.append([i, row[i]])
        self._held[t] = new
        self._n_free -= new - old
        self._log("set", t, changed)


class TableMirror:
    """A stage's copy of the tables, fed the coordinator's ops in order (see the module docstring)."""

    def __init__(self, n_chunks: int, table_chunks: int, n_slots: int) -> None:
        self.n_chunks = _positive("n_chunks", n_chunks)
        self.table_chunks = _positive("table_chunks", table_chunks)
        self.n_slots = _positive("n_slots", n_slots)
        self.trash = n_chunks
        self._rows: dict[int, list[int]] = {}
        self._version = 0
        self.changed_slots: set[int] = set()

    @property
    def version(self) -> int:
        return self._version

    def entries(self, t: int) -> list[int]:
        """Table `t`'s entries; a table no op has named (or a dropped one) is all trash."""
        row = self._rows.get(t)
        return list(row) if row is not None else [self.trash] * self.table_chunks

    def apply(self, op: Sequence[Any]) -> None:
        """Apply the op with version `self.version + 1`; raise StaleOp / OpGap / OpError otherwise."""
        kind, version, tables = self._check(op)
        if version <= self._version:
            raise StaleOp(f"op {kind!r} has version {version} but this mirror is already at version "
                          f"{self._version} (sent twice, or older than the snapshot it loaded)")
        if version != self._version + 1:
            raise OpGap(f"op {kind!r} has version {version} but this mirror is at version {self._version}: "
                        f"ops {self._version + 1}..{version - 1} are missing")
        if kind == "drop" and (tables[0] < self.n_slots or self.entries(tables[0]) != self._empty()):
            raise OpError(f"op 'drop' names table {tables[0]}, a slot or a table that holds chunks here")
        if kind == "set":
            self._write(self._rows, op)
        elif kind == "swap":
            a, b = tables
            self._rows[a], self._rows[b] = self.entries(b), self.entries(a)
        elif kind == "drop":
            self._rows.pop(tables[0], None)
        self._version = version
        self.changed_slots = {t for t in tables if t < self.n_slots} if kind != "exchange" else set()

    def load(self, ops: Sequence[Sequence[Any]]) -> None:
        """Reset to a snapshot (`snapshot_ops()`): "set" ops that all carry the same version."""
        checked = [self._check(op) for op in ops]
        if not ops or any(kind != "set" for kind, _, _ in checked):
            raise OpError(f"a snapshot is one or more 'set' ops (one per slot at least), got {list(ops)!r}")
        versions = {version for _, version, _ in checked}
        if len(versions) != 1:
            raise OpError(f"a snapshot's ops carry one version, got {sorted(versions)}")
        rows: dict[int, list[int]] = {}
        for op in ops:
            self._write(rows, op)
        self._rows, self._version = rows, versions.pop()
        self.changed_slots = set(range(self.n_slots))

    def _empty(self) -> list[int]:
        return [self.trash] * self.table_chunks

    def _write(self, rows: dict[int, list[int]], op: Sequence[Any]) -> None:
        row = rows.setdefault(op[2], self._empty())
        for i, c in op[3]:
            row[i] = c

    def _check(self, op: Sequence[Any]) -> tuple[str, int, list[int]]:
        """(kind, version, tables) of a well-formed op; OpError naming the fault otherwise. Runs before any
        change, so a refused op leaves the mirror as it was."""
        sizes = {"set": 4, "swap": 4, "exchange": 5, "drop": 3}
        if not isinstance(op, (list, tuple)) or not op or op[0] not in sizes or len(op) != sizes[op[0]]:
            raise OpError(f"not an op: {op!r} (kinds and lengths: {sizes})")
        kind, version = op[0], op[1]
        tables = list(op[2:4]) if kind in ("swap", "exchange") else [op[2]]
        if not isinstance(version, int) or version < 0:
            raise OpError(f"op {kind!r} has no valid version: {version!r}")
        if not all(isinstance(t, int) and t >= 0 for t in tables):
            raise OpError(f"op {kind!r} names an invalid table: {op!r}")
        if kind == "set":
            pairs = op[3] if isinstance(op[3], (list, tuple)) else [None]
            for pair in pairs:
                if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, int) for x in pair)
                        and 0 <= pair[0] < self.table_chunks and 0 <= pair[1] <= self.n_chunks):
                    raise OpError(f"op 'set' for table {op[2]} has {pair!r} where an [index < {self.table_chunks},"
                                  f" chunk <= {self.n_chunks}] pair belongs")
        return kind, version, tables
