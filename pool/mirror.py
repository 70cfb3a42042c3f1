"""TableMirror: a stage's copy of the coordinator's tables, and the checks on every op it is fed (no torch).

TableMirror (a stage's copy): `apply(op)` accepts only the op with version `mirror.version + 1` and raises
`StaleOp` (already seen) or `OpGap` (one is missing) otherwise, before changing anything. `changed_slots` holds
the slots whose rows the last apply (or load) touched. An "exchange" op records only its version: the stage
runner moves the bytes of the two regions (`region(table, table_chunks)`).

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


class TableMirror:
    """A stage's copy of the tables, fed the coordinator's ops in order (see the module docstring)."""

    def __init__(self, n_chunks: int, table_chunks: int, n_slots: int) -> None:
        self.n_chunks = positive_int("n_chunks", n_chunks)
        self.table_chunks = positive_int("table_chunks", table_chunks)
        self.n_slots = positive_int("n_slots", n_slots)
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
        return list(row) if row is not None else self._empty()

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
