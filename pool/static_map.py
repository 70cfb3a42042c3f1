"""StaticMap: chunk tables without a pool (bookkeeping only, no torch).

StaticMap (pool off, the baseline the benchmarks compare against): n_chunks = (n_slots + 1) * T, cut into fixed
regions; region r is chunks [r*T, (r+1)*T). Slot s owns region s; `new_table()` returns the one park table
(id n_slots, region n_slots) or None while it is taken. `reserve` only checks cells <= T*C and records the held
cells (exact); entries are the identity inside the region up to ceil(held / C) and trash past it, so a stray
write still lands in the trash chunk. `swap(a, b)` cannot exchange tables, because a slot's region is fixed
memory: it logs ["exchange", v, a, b, cells] with cells = max held cells of both, on which every stage swaps
the bytes of the first `cells` cells of the two regions (a copy, O(cells)), then "set" ops for the entries of
a and b where their held extents differ. That copy is exactly what the pool's O(T) swap avoids. Generations
bump for the region chunks the exchange overwrites.

Everything else (version, generations, counters, ops) follows the rules of pool/chunk_map.py.
"""
from __future__ import annotations

from pool.tables import Tables, region


class StaticMap(Tables):
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
