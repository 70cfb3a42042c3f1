"""Random walks over ChunkMap and StaticMap, checking every invariant of pool/chunk_map.py after every step.

A small model runs beside the map: which table holds how many chunks, and which conversation each table
holds (a swap moves conversations between tables), so the walk can tell whether a chunk changed owner and
whether a call that had to fail changed anything. A TableMirror is fed drain_ops() after every step.

ChunkMap walks also share: the model keeps the token ids each table has written (drawn from two values, so
equal prefixes are common), `publish` writes more of them, `share` maps another table's run into an empty one.
Then every chunk is free or held with refs = the number of tables naming it, free + distinct held = total, the
trash chunk is never shared nor counted, no write ever lands in a chunk two tables hold, and every chunk a
lookup returns holds, in every table naming it, exactly the ids it was looked up by.
"""
from __future__ import annotations

import copy

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pool.chunk_map import ChunkMap, StaticMap, TableMirror, region

WALK = settings(max_examples=300, stateful_step_count=50, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
pick = st.integers(min_value=0, max_value=1_000)


class _Walk(RuleBasedStateMachine):
    map_class: type = ChunkMap
    geometry = dict(n_chunks=11, chunk_cells=4, table_chunks=4, n_slots=3)

    def __init__(self) -> None:
        super().__init__()
        self.m = self.map_class(**self.geometry)
        g = self.geometry
        self.mirror = TableMirror(g["n_chunks"], g["table_chunks"], g["n_slots"])
        self.held = {s: 0 for s in range(g["n_slots"])}  # model: chunks per table
        self.conv = {s: s for s in range(g["n_slots"])}  # model: the conversation a table holds
        self.ids: dict[int, list[int]] = {s: [] for s in range(g["n_slots"])}  # model: ids written, cells [0, n)
        self.next_conv = g["n_slots"]
        self.dropped: set[int] = set()
        self.before = self._owners()

    # ---- helpers
    def _table(self, i: int) -> int:
        tables = sorted(self.held)
        return tables[i % len(tables)]

    def _cells(self, n: int) -> int:
        return n % (self.m.max_cells + 2 * self.m.chunk_cells)

    def _chunks(self, cells: int) -> int:
        return -(-cells // self.m.chunk_cells)

    def _owners(self) -> tuple[dict[int, frozenset[int]], list[int]]:
        """chunk -> the conversations holding it, and every chunk's generation."""
        owners: dict[int, set[int]] = {}
        for t in self.m.tables:
            for c in self.m.entries(t)[: self.m.held_chunks(t)]:
                owners.setdefault(c, set()).add(self.conv[t])
        return {c: frozenset(o) for c, o in owners.items()}, [self.m.generation(c) for c in range(self.m.n_chunks + 1)]

    def _snap(self) -> tuple:
        m = self.m
        refs = [m.refs(c) for c in range(m.n_chunks + 1)] if isinstance(m, ChunkMap) else None
        return m.tables, [m.entries(t) for t in m.tables], m.free_chunks, m.version, self._owners(), refs

    def _cut(self, t: int) -> None:
        """The model's ids of `t` end where its backed cells end."""
        del self.ids[t][self.m.held_cells(t):]

    # ---- rules
    @rule()
    def new_table(self) -> None:
        t = self.m.new_table()
        if t is None:  # StaticMap: the park table is taken
            assert self.map_class is StaticMap and self.geometry["n_slots"] in self.held
            return
        assert t not in self.held and t not in self.dropped
        self.held[t] = 0
        self.conv[t] = self.next_conv
        self.ids[t] = []
        self.next_conv += 1

    @rule(i=pick, n=pick)
    def reserve(self, i: int, n: int) -> None:
        t, cells = self._table(i), self._cells(n)
        want = self._chunks(cells)
        fits = want <= self.m.table_chunks and want - self.held[t] <= self.m.free_chunks
        if isinstance(self.m, StaticMap):
            fits = want <= self.m.table_chunks
        assert self.m.can_reserve(t, cells) == fits
        if not fits:
            before = self._snap()
            assert self.m.reserve(t, cells) is False
            assert self._snap() == before  # all or nothing: a failed reserve changes nothing
            return
        assert self.m.reserve(t, cells)
        self.held[t] = max(self.held[t], want)

    @rule(i=pick, n=pick)
    def shrink(self, i: int, n: int) -> None:
        t, cells = self._table(i), self._cells(n)
        keep = self._chunks(cells)
        if isinstance(self.m, ChunkMap) and cells % self.m.chunk_cells and keep <= self.held[t] \
                and self.m.refs(self.m.entries(t)[keep - 1]) > 1:
            keep -= 1  # rule 6: a chunk another table holds is never kept in part
        self.m.shrink(t, cells)
        self.held[t] = min(self.held[t], keep)
        del self.ids[t][cells:]
        self._cut(t)

    @rule(i=pick)
    def release(self, i: int) -> None:
        t = self._table(i)
        self.m.release(t)
        self.held[t] = 0
        self.ids[t] = []

    @rule(i=pick, j=pick)
    def swap(self, i: int, j: int) -> None:
        a, b = self._table(i), self._table(j)
        self.m.swap(a, b)
        self.held[a], self.held[b] = self.held[b], self.held[a]
        self.conv[a], self.conv[b] = self.conv[b], self.conv[a]
        if isinstance(self.m, StaticMap):  # a fixed region: the bytes are exchanged, the ids with them
            self.ids[a], self.ids[b] = self.ids[b], self.ids[a]
            self._cut(a)
            self._cut(b)
        else:
            self.ids[a], self.ids[b] = self.ids[b], self.ids[a]

    @rule(i=pick)
    def drop(self, i: int) -> None:
        t = self._table(i)
        if t < self.m.n_slots or self.held[t]:
            before = self._snap()
            with pytest.raises(ValueError):
                self.m.drop_table(t)
            assert self._snap() == before
            return
        self.m.drop_table(t)
        del self.held[t], self.conv[t], self.ids[t]
        if self.map_class is ChunkMap:
            self.dropped.add(t)

    @rule(i=pick, bits=st.lists(st.integers(min_value=0, max_value=1), max_size=24))
    def publish(self, i: int, bits: list[int]) -> None:
        """Steps write ids into t's backed cells past what it has written, then t publishes them."""
        if not isinstance(self.m, ChunkMap):
            return
        t, c = self._table(i), self.m.chunk_cells
        ids = self.ids[t]
        new = bits[: self.m.held_cells(t) - len(ids)]
        for j in range(len(ids) // c, -(-(len(ids) + len(new)) // c)):  # the chunks these writes land in
            assert self.m.refs(self.m.entries(t)[j]) == 1, "a write would land in a shared chunk"
        ids += new
        before = self._snap()
        self.m.publish(t, ids)
        assert self._snap() == before  # publishing changes no entry, count, version or generation

    @rule(i=pick, j=pick)
    def share(self, i: int, j: int) -> None:
        if not isinstance(self.m, ChunkMap):
            return
        t, src = self._table(i), self._table(j)
        run = self.m.lookup(self.ids[src])
        if self.held[t]:
            before = self._snap()
            with pytest.raises(ValueError, match="holds"):
                self.m.share(t, run)
            assert self._snap() == before
            return
        self.m.share(t, run)
        self.held[t] = len(run)
        self.ids[t] = self.ids[src][: len(run) * self.m.chunk_cells]

    # ---- invariants, after every step
    @invariant()
    def tables_match_the_model(self) -> None:
        assert self.m.tables == sorted(self.held)
        for t, n in self.held.items():
            assert self.m.held_chunks(t) == n

    @invariant()
    def every_chunk_is_free_or_held_with_refs_equal_to_its_tables(self) -> None:
        m = self.m
        named = [c for t in m.tables for c in m.entries(t) if c != m.trash]
        assert len(named) == sum(self.held.values())
        assert all(0 <= c < m.n_chunks for c in named)  # the trash chunk is never handed out
        for t in m.tables:  # a table names a chunk at most once
            row = m.entries(t)[: m.held_chunks(t)]
            assert len(row) == len(set(row))
        distinct = set(named)
        assert m.free_chunks + len(distinct) == m.n_chunks
        extra = len(named) - len(distinct)
        assert m.free_cells + sum(m.held_chunks(t) * m.chunk_cells for t in m.tables) \
            == m.total_cells + extra * m.chunk_cells
        if isinstance(m, StaticMap):
            assert extra == 0  # the baseline never shares
            return
        counts = {c: named.count(c) for c in distinct}
        assert [m.refs(c) for c in range(m.n_chunks)] == [counts.get(c, 0) for c in range(m.n_chunks)]
        assert m.refs(m.trash) == 0
        assert m.shared_cells == sum(1 for n in counts.values() if n > 1) * m.chunk_cells
        assert m.saved_cells == extra * m.chunk_cells
        for t in m.tables:
            assert m.exclusive_cells(t) == sum(counts[c] == 1 for c in m.entries(t)[: m.held_chunks(t)]) * m.chunk_cells
        assert m.cells_freed_by(m.tables) == len(distinct) * m.chunk_cells
        # the free chunks are exactly the rest: take them all in a copy
        probe, taken = copy.deepcopy(m), []
        while probe.free_chunks:
            t = probe.new_table()
            assert probe.reserve(t, min(probe.free_chunks, probe.table_chunks) * probe.chunk_cells)
            taken += probe.entries(t)[: probe.held_chunks(t)]
        assert sorted(taken + list(distinct)) == list(range(m.n_chunks))

    @invariant()
    def a_lookup_hands_over_only_cells_holding_its_ids(self) -> None:
        if not isinstance(self.m, ChunkMap):
            return
        m, c = self.m, self.m.chunk_cells
        for t in m.tables:
            want = self.ids[t]
            for i, chunk in enumerate(m.lookup(want)):
                assert chunk != m.trash
                for u in m.tables:
                    row = m.entries(u)
                    if chunk in row:
                        assert row.index(chunk) == i  # a registered chunk sits at one depth in every table
                        assert self.ids[u][i * c:(i + 1) * c] == want[i * c:(i + 1) * c]

    @invariant()
    def unreserved_entries_are_trash(self) -> None:
        for t in self.m.tables:
            row, n = self.m.entries(t), self.m.held_chunks(t)
            assert len(row) == self.m.table_chunks
            assert self.m.trash not in row[:n] and row[n:] == [self.m.trash] * (len(row) - n)
            if isinstance(self.m, StaticMap):
                assert row[:n] == region(t, self.m.table_chunks)[:n]

    @invariant()
    def generation_bumps_exactly_when_the_owner_changes(self) -> None:
        (owners0, gens0), (owners1, gens1) = self.before, self._owners()
        if isinstance(self.m, ChunkMap):  # rule 9: leaving or joining the free list, nothing else
            for c in range(self.m.n_chunks):
                assert gens1[c] - gens0[c] == ((c in owners0) != (c in owners1)), c
        else:  # an exchange overwrites region chunks; those bump once even when no owner changes
            for c in range(self.m.n_chunks):
                assert gens1[c] - gens0[c] in (0, 1)
                if owners0.get(c) != owners1.get(c):
                    assert gens1[c] == gens0[c] + 1, c
        assert gens1[self.m.n_chunks] == 0
        self.before = (owners1, gens1)

    @invariant()
    def a_mirror_fed_the_ops_matches(self) -> None:
        ops = self.m.drain_ops()
        for op in ops:
            self.mirror.apply(op)
        assert self.mirror.version == self.m.version == (ops[-1][1] if ops else self.mirror.version)
        empty = [self.m.trash] * self.m.table_chunks
        for t in set(self.held) | self.dropped:  # a dropped table reads as empty on the mirror
            assert self.mirror.entries(t) == (self.m.entries(t) if t in self.held else empty)
        rejoined = TableMirror(self.m.n_chunks, self.m.table_chunks, self.m.n_slots)
        rejoined.load(self.m.snapshot_ops())
        assert rejoined.version == self.m.version
        assert all(rejoined.entries(t) == self.m.entries(t) for t in self.m.tables)
        n = self.m.n_chunks + 1
        assert [rejoined.refs(c) for c in range(n)] == [self.mirror.refs(c) for c in range(n)]
        if isinstance(self.m, ChunkMap):
            assert [self.mirror.refs(c) for c in range(n)] == [self.m.refs(c) for c in range(n)]


class ChunkMapWalk(_Walk):
    map_class = ChunkMap


class StaticMapWalk(_Walk):
    map_class = StaticMap
    geometry = dict(n_chunks=12, chunk_cells=4, table_chunks=4, n_slots=2)


TestChunkMapWalk = ChunkMapWalk.TestCase
TestChunkMapWalk.settings = WALK
TestStaticMapWalk = StaticMapWalk.TestCase
TestStaticMapWalk.settings = WALK
