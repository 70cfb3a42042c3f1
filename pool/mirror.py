"""TableMirror: a stage's copy of the coordinator's tables, and the checks on every op it is fed (no torch).

TableMirror (a stage's copy): `apply(op)` accepts only the op with version `mirror.version + 1` and raises
`StaleOp` (already seen) or `OpGap` (one is missing) otherwise, before changing anything. `changed_slots` holds
the slots whose rows the last apply (or load) touched. An "exchange" op records only its version: the stage
runner moves the bytes of the two regions (`region(table, table_chunks)`).

Sharing (pool/chunk_map.py rules 12-16): the mirror holds every table's row, so it counts the tables naming each
chunk itself (`refs`) and needs no count on the wire. The op says what the coordinator means, and the mirror
checks it against its count, refusing the op (OpError) when they disagree:
- "set" never names a chunk another table (or another entry) already names: a chunk is handed out once; a
  second holder comes only by
- "share", whose chunks some table already names, written into trash entries.
`check_write(slot, start, n, chunk_cells)` raises `SharedWrite` when a step would write cells [start, start+n)
of `slot` into a chunk that more than one table names: the stage runs no such step, so a bookkeeping error on
the coordinator can never change the bytes another conversation reads.

The ops themselves, and the versions they carry, are rule 11 of pool/chunk_map.py.
"""
from __future__ import annotations

from typing import Any, Sequence

from pool.tables import positive_int


class OpError(ValueError):
    """An op a mirror cannot apply; nothing was changed."""


class StaleOp(OpError):
    """An op whose version the mirror has already reached (sent twice, or older than a snapshot)."""


class OpGap(OpError):
    """An op that skips versions: one or more ops before it were lost or reordered."""


class SharedWrite(ValueError):
    """A step that would write into a chunk more than one table holds; it was not run."""


class TableMirror:
    """A stage's copy of the tables, fed the coordinator's ops in order (see the module docstring)."""

    def __init__(self, n_chunks: int, table_chunks: int, n_slots: int) -> None:
        self.n_chunks = positive_int("n_chunks", n_chunks)
        self.table_chunks = positive_int("table_chunks", table_chunks)
        self.n_slots = positive_int("n_slots", n_slots)
        self.trash = n_chunks
        self._rows: dict[int, list[int]] = {}
        self._refs = [0] * n_chunks  # tables naming each chunk, from the rows; trash not counted
        self._version = 0
        self.changed_slots: set[int] = set()

    @property
    def version(self) -> int:
        return self._version

    def entries(self, t: int) -> list[int]:
        """Table `t`'s entries; a table no op has named (or a dropped one) is all trash."""
        row = self._rows.get(t)
        return list(row) if row is not None else self._empty()

    def refs(self, chunk: int) -> int:
        """Tables naming `chunk` here; 0 for a free chunk and for the trash chunk."""
        return self._refs[chunk] if 0 <= chunk < self.n_chunks else 0

    def check_write(self, slot: int, start: int, n: int, chunk_cells: int, step: int | None = None) -> None:
        """SharedWrite when cells [start, start + n) of `slot` fall in a chunk more than one table names
        (`step`: the step id the message names)."""
        row = self._rows.get(slot)
        if row is None or n <= 0:
            return
        for j in range(start // chunk_cells, min(-(-(start + n) // chunk_cells), self.table_chunks)):
            c = row[j]
            if c != self.trash and self._refs[c] > 1:
                lo, hi = max(start, j * chunk_cells), min(start + n, (j + 1) * chunk_cells)
                raise SharedWrite(f"{'' if step is None else f'step {step}: '}slot {slot} would write cells "
                                  f"[{lo}, {hi}) into chunk {c}, which "
                                  f"{self._refs[c]} tables hold; a shared chunk is read-only")

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
        if kind in ("set", "share"):
            self._write(self._rows, self._refs, op)
        elif kind == "swap":
            a, b = tables
            self._rows[a], self._rows[b] = self.entries(b), self.entries(a)
        elif kind == "drop":
            self._rows.pop(tables[0], None)
        self._version = version
        self.changed_slots = {t for t in tables if t < self.n_slots} if kind != "exchange" else set()

    def load(self, ops: Sequence[Sequence[Any]]) -> None:
        """Reset to a snapshot (`snapshot_ops()`): "set" (and "share") ops that all carry the same version."""
        checked = [self._check(op) for op in ops]
        if not ops or checked[0][0] != "set" or any(kind not in ("set", "share") for kind, _, _ in checked):
            raise OpError(f"a snapshot is one or more 'set' ops (one per slot at least), each table's shared "
                          f"chunks in a 'share' after it, got {list(ops)!r}")
        versions = {version for _, version, _ in checked}
        if len(versions) != 1:
            raise OpError(f"a snapshot's ops carry one version, got {sorted(versions)}")
        rows: dict[int, list[int]] = {}
        refs = [0] * self.n_chunks
        for op in ops:
            self._write(rows, refs, op)
        self._rows, self._refs, self._version = rows, refs, versions.pop()
        self.changed_slots = set(range(self.n_slots))

    def _empty(self) -> list[int]:
        return [self.trash] * self.table_chunks

    def _write(self, rows: dict[int, list[int]], refs: list[int], op: Sequence[Any]) -> None:
        """Write a "set" or "share" into `rows`, keeping `refs`; every check runs before the first change."""
        kind, t, pairs = op[0], op[2], op[3]
        row = rows.get(t) or self._empty()
        delta: dict[int, int] = {}
        for i, c in pairs:
            if row[i] == c:
                continue
            if kind == "share" and row[i] != self.trash:
                raise OpError(f"op 'share' for table {t} writes chunk {c} over entry {i}, which names chunk {row[i]}")
            if kind == "share" and c in row:
                raise OpError(f"op 'share' maps chunk {c} into table {t}, which names it already")
            for chunk, d in ((row[i], -1), (c, 1)):
                if chunk != self.trash:
                    delta[chunk] = delta.get(chunk, 0) + d
        for chunk, d in delta.items():
            before = refs[chunk]
            if d > 1 or (kind == "set" and d > 0 and before > 0):
                raise OpError(f"op 'set' gives chunk {chunk} to table {t}, but {before + d - 1} other entries "
                              f"name it: a chunk gains a second holder only by a 'share'")
            if kind == "share" and d > 0 and before == 0:
                raise OpError(f"op 'share' maps chunk {chunk} into table {t}, but no table holds it")
            if before + d < 0:
                raise OpError(f"op {kind!r} drops chunk {chunk} from table {t}, which does not name it")
        new = list(row)
        for i, c in pairs:
            new[i] = c
        for chunk, d in delta.items():
            refs[chunk] += d
        rows[t] = new

    def _check(self, op: Sequence[Any]) -> tuple[str, int, list[int]]:
        """(kind, version, tables) of a well-formed op; OpError naming the fault otherwise. Runs before any
        change, so a refused op leaves the mirror as it was."""
        sizes = {"set": 4, "share": 4, "swap": 4, "exchange": 5, "drop": 3}
        if not isinstance(op, (list, tuple)) or not op or op[0] not in sizes or len(op) != sizes[op[0]]:
            raise OpError(f"not an op: {op!r} (kinds and lengths: {sizes})")
        kind, version = op[0], op[1]
        tables = list(op[2:4]) if kind in ("swap", "exchange") else [op[2]]
        if not isinstance(version, int) or version < 0:
            raise OpError(f"op {kind!r} has no valid version: {version!r}")
        if not all(isinstance(t, int) and t >= 0 for t in tables):
            raise OpError(f"op {kind!r} names an invalid table: {op!r}")
        if kind in ("set", "share"):
            pairs = op[3] if isinstance(op[3], (list, tuple)) else [None]
            top = self.n_chunks if kind == "set" else self.n_chunks - 1  # the trash chunk is never shared
            for pair in pairs:
                if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, int) for x in pair)
                        and 0 <= pair[0] < self.table_chunks and 0 <= pair[1] <= top):
                    raise OpError(f"op {kind!r} for table {op[2]} has {pair!r} where an [index < "
                                  f"{self.table_chunks}, chunk <= {top}] pair belongs")
            if len({i for i, _ in pairs}) != len(pairs):
                raise OpError(f"op {kind!r} for table {op[2]} names an entry twice: {op[3]!r}")
        return kind, version, tables
