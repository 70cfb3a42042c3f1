"""What ChunkMap and StaticMap share (bookkeeping only, no torch): table rows, held chunks, generations, the
version and the op log; and `region`, the fixed chunks of a StaticMap table.

The rules are pool/chunk_map.py's: version and ops (rules 8 and 11), generations (9), counters (10); the
sharing counters (10, 17) have the values of a map that never shares, which ChunkMap overrides.
`Tables` is not used alone: ChunkMap and StaticMap supply `free_chunks`, `shrink` and how chunks are handed out.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

Op = list[Any]


def region(table: int, table_chunks: int) -> list[int]:
    """Chunks of a StaticMap table's fixed region: [table*T, (table+1)*T)."""
    return list(range(table * table_chunks, (table + 1) * table_chunks))


def positive_int(name: str, value: int) -> int:
    """`value` if it is an int >= 1; ValueError naming `name` otherwise."""
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class Tables:
    """What both maps share: table rows, held chunks, generations, version and the op log."""

    def __init__(self, n_chunks: int, chunk_cells: int, table_chunks: int, n_slots: int) -> None:
        self.n_chunks = positive_int("n_chunks", n_chunks)
        self.chunk_cells = positive_int("chunk_cells", chunk_cells)
        self.table_chunks = positive_int("table_chunks", table_chunks)
        self.n_slots = positive_int("n_slots", n_slots)
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

    @property
    def shared_cells(self) -> int:
        """Cells in chunks more than one table holds (ChunkMap rule 10); none without sharing."""
        return 0

    @property
    def saved_cells(self) -> int:
        """Sum over chunks of (tables holding it - 1) * chunk_cells (ChunkMap rule 10); none without sharing."""
        return 0

    def exclusive_cells(self, t: int) -> int:
        """Cells only `t` holds, what evicting it alone gives back (ChunkMap rule 17); all it holds here."""
        return self.held_cells(t)

    def cells_freed_by(self, tables: Iterable[int]) -> int:
        """Cells that evicting every table of `tables` gives back (ChunkMap rule 17)."""
        return sum(self.held_cells(t) for t in set(tables))

    def generation(self, chunk: int) -> int:
        if not 0 <= chunk <= self.n_chunks:
            raise IndexError(f"chunk {chunk} is outside 0..{self.n_chunks} (trash = {self.n_chunks})")
        return self._generations[chunk]

    def generations_of(self, ops: Sequence[Op]) -> list[list[int]]:
        """[[chunk, generation now], ...] for every chunk `ops` give to a table or write bytes into ("set" and
        "share" entries that are not trash, the region cells an "exchange" rewrites), each once, ascending.

        A stage records these beside its K/V when it applies the ops, so after a crash it can report which
        owners its bytes belong to (rule 9 of pool/chunk_map.py). Freed chunks are not listed: no table holds them.
        """
        chunks: set[int] = set()
        for op in ops:
            if op[0] in ("set", "share"):
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
