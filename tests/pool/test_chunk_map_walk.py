"""Random walks over ChunkMap and StaticMap, checking every invariant of pool/chunk_map.py after every step.

A small model runs beside the map: which table holds how many chunks, and which conversation each table
holds (a swap moves conversations between tables), so the walk can tell whether a chunk changed owner and
whether a call that had to fail changed anything. A TableMirror is fed drain_ops() after every step.
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

    def _owners(self) -> tuple[dict[int, int], list[int]]:
        """chunk -> conversation holding it, and every chunk's generation."""
        owners = {}
        for t in self.m.tables:
            for c in self.m.entries(t)[: self.m.held_chunks(t)]:
                owners[c] = self.conv[t]
        return owners, [self.m.generation(c) for c in range(self.m.n_chunks + 1)]

    def _snap(self) -> tuple:
        m = self.m
        return m.tables, [m.entries(t) for t in m.tables], m.free_chunks, m.version, self._owners()

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
        self.m.shrink(t, cells)
        self.held[t] = min(self.held[t], self._chunks(cells))

    @rule(i=pick)
    def release(self, i: int) -> None:
        t = self._table(i)
        self.m.release(t)
        self.held[t] = 0

    @rule(i=pick, j=pick)
    def swap(self, i: int, j: int) -> None:
        a, b = self._table(i), self._table(j)
        self.m.swap(a, b)
        self.held[a], self.held[b] = self.held[b], self.held[a]
        self.conv[a], self.conv[b] = self.conv[b], self.conv[a]

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
        del self.held[t], self.conv[t]
        if self.map_class is ChunkMap:
            self.dropped.add(t)

    # ---- invariants, after every step
    @invariant()
    def tables_match_the_model(self) -> None:
        assert self.m.tables == sorted(self.held)
        for t, n in self.held.items():
            assert self.m.held_chunks(t) == n

    @invariant()
    def every_chunk_is_free_or_held_exactly_once(self) -> None:
        held = [c for t in self.m.tables for c in self.m.entries(t) if c != self.m.trash]
        assert len(held) == len(set(held)) == sum(self.held.values())
        assert all(0 <= c < self.m.n_chunks for c in held)  # the trash chunk is never handed out
        assert self.m.free_chunks + len(held) == self.m.n_chunks
        assert self.m.free_cells + sum(self.m.held_chunks(t) * self.m.chunk_cells for t in self.m.tables) \
            == self.m.total_cells
        if isinstance(self.m, ChunkMap):  # the free chunks are exactly the rest: take them all in a copy
            probe, taken = copy.deepcopy(self.m), []
            while probe.free_chunks:
                t = probe.new_table()
                assert probe.reserve(t, min(probe.free_chunks, probe.table_chunks) * probe.chunk_cells)
                taken += probe.entries(t)[: probe.held_chunks(t)]
            assert sorted(taken + held) == list(range(self.m.n_chunks))

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
        if isinstance(self.m, ChunkMap):
            for c in range(self.m.n_chunks):
                assert gens1[c] - gens0[c] == (owners0.get(c) != owners1.get(c)), c
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


class ChunkMapWalk(_Walk):
    map_class = ChunkMap


class StaticMapWalk(_Walk):
    map_class = StaticMap
    geometry = dict(n_chunks=12, chunk_cells=4, table_chunks=4, n_slots=2)


TestChunkMapWalk = ChunkMapWalk.TestCase
TestChunkMapWalk.settings = WALK
TestStaticMapWalk = StaticMapWalk.TestCase
TestStaticMapWalk.settings = WALK
