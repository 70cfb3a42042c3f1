"""ChunkMap, StaticMap and TableMirror: every rule of pool/chunk_map.py pinned with exact chunk ids.

The pool: 11 usable chunks of 16 cells (trash = chunk 11), tables of 4 chunks (64 cells), 2 slots.
"""
from __future__ import annotations

import msgpack
import pytest

from pool.chunk_map import ChunkMap, OpError, OpGap, StaleOp, StaticMap, TableMirror, region

T = 11  # the trash chunk


@pytest.fixture
def cm() -> ChunkMap:
    return ChunkMap(n_chunks=11, chunk_cells=16, table_chunks=4, n_slots=2)


def state(m: ChunkMap | StaticMap) -> tuple:
    """Everything a failed call must leave as it was."""
    return (
        {t: m.entries(t) for t in m.tables},
        {t: m.held_cells(t) for t in m.tables},
        m.free_chunks, m.free_cells, m.version,
        [m.generation(c) for c in range(m.n_chunks + 1)],
    )


def test_fresh_pool_hands_out_lowest_chunks_first(cm):
    assert (cm.trash, cm.free_chunks, cm.free_cells, cm.total_cells, cm.version) == (T, 11, 176, 176, 0)
    assert cm.entries(0) == cm.entries(1) == [T, T, T, T]
    assert cm.reserve(0, 20)
    assert cm.entries(0) == [0, 1, T, T]
    assert cm.reserve(1, 64)
    assert cm.entries(1) == [2, 3, 4, 5]
    assert cm.reserve(0, 33)
    assert cm.entries(0) == [0, 1, 6, T]
    assert (cm.held_chunks(0), cm.held_cells(0), cm.held_chunks(1), cm.held_cells(1)) == (3, 48, 4, 64)
    assert (cm.free_chunks, cm.free_cells, cm.version) == (4, 64, 3)


def test_reserve_already_covered_is_not_a_change(cm):
    assert cm.reserve(0, 17)
    cm.drain_ops()
    before = state(cm)
    assert cm.reserve(0, 32) and cm.reserve(0, 1) and cm.reserve(0, 0)
    assert state(cm) == before and cm.drain_ops() == []


def test_failed_reserve_changes_nothing(cm):
    assert cm.reserve(0, 64) and cm.reserve(1, 64)
    t = cm.new_table()
    assert cm.reserve(t, 33)  # 3 chunks: 8, 9, 10; the pool is now full
    cm.drain_ops()
    cm.shrink(t, 16)  # frees 10 and 9
    ops = cm.drain_ops()
    assert cm.free_chunks == 2
    before = state(cm)
    assert not cm.can_reserve(t, 64)
    assert not cm.reserve(t, 64)  # needs 3 more, 2 are free: takes none of them
    assert state(cm) == before and cm.drain_ops() == []
    assert not cm.can_reserve(2, 65) and not cm.reserve(2, 65)  # more than a table holds
    assert not ChunkMap(11, 16, 4, 2).reserve(0, 65)  # even on an empty pool
    assert state(cm) == before and cm.drain_ops() == []
    assert cm.can_reserve(t, 48) and cm.reserve(t, 48)
    assert cm.entries(t) == [8, 9, 10, T]  # the two freed chunks, lowest index first
    assert ops == [["set", 4, t, [[1, T], [2, T]]]]


def test_shrink_gives_back_the_tail(cm):
    assert cm.reserve(0, 64)
    cm.shrink(0, 17)  # keeps ceil(17/16) = 2 chunks
    assert cm.entries(0) == [0, 1, T, T]
    assert (cm.held_chunks(0), cm.free_chunks) == (2, 9)
    before = state(cm)
    cm.shrink(0, 32)  # frees nothing: not a change
    cm.shrink(0, 64)
    assert state(cm) == before
    cm.release(0)
    assert cm.entries(0) == [T] * 4 and cm.free_chunks == 11
    assert cm.drain_ops() == [
        ["set", 1, 0, [[0, 0], [1, 1], [2, 2], [3, 3]]],
        ["set", 2, 0, [[2, T], [3, T]]],
        ["set", 3, 0, [[0, T], [1, T]]],
    ]


def test_freed_chunks_are_next_out(cm):
    assert cm.reserve(0, 32) and cm.reserve(1, 32)  # 0: [0, 1], 1: [2, 3]
    cm.release(0)
    assert cm.reserve(1, 48)
    assert cm.entries(1) == [2, 3, 0, T]  # chunk 0 was freed last-pushed, so it is first out
    assert cm.reserve(1, 64)
    assert cm.entries(1) == [2, 3, 0, 1]
    assert cm.reserve(0, 16)
    assert cm.entries(0) == [4, T, T, T]  # free list empty of freed chunks: back to the fresh order
    cm.shrink(1, 16)  # frees 3, 0, 1 (indices 1..3)
    assert cm.reserve(0, 64)
    assert cm.entries(0) == [4, 3, 0, 1]


def test_release_then_reserve_gives_back_the_same_entries(cm):
    assert cm.reserve(0, 16) and cm.reserve(1, 16) and cm.reserve(0, 64)
    assert cm.entries(0) == [0, 2, 3, 4]
    cm.release(0)
    assert cm.reserve(0, 64)
    assert cm.entries(0) == [0, 2, 3, 4]


def test_swap_exchanges_tables_in_place(cm):
    assert cm.reserve(0, 40) and cm.reserve(1, 16)
    p = cm.new_table()
    gens = [cm.generation(c) for c in range(12)]
    cm.drain_ops()
    cm.swap(0, p)
    assert (cm.entries(0), cm.entries(p)) == ([T] * 4, [0, 1, 2, T])
    assert (cm.held_chunks(0), cm.held_chunks(p), cm.held_cells(p), cm.free_chunks) == (0, 3, 48, 7)
    cm.swap(1, p)
    assert (cm.entries(1), cm.entries(p)) == ([0, 1, 2, T], [3, T, T, T])
    assert [cm.generation(c) for c in range(12)] == gens  # no chunk changed owner
    assert cm.drain_ops() == [["swap", 3, 0, p], ["swap", 4, 1, p]]
    q = cm.new_table()
    before = state(cm)
    cm.swap(1, 1)
    cm.swap(0, q)  # two empty tables: nothing changes
    assert state(cm) == before and cm.drain_ops() == []


def test_trash_is_never_handed_out_and_fills_unreserved_entries(cm):
    tables = [0, 1, cm.new_table()]
    assert cm.reserve(0, 64) and cm.reserve(1, 64) and cm.reserve(tables[2], 48)
    assert cm.free_chunks == 0 and not cm.reserve(tables[2], 64)
    held = [c for t in tables for c in cm.entries(t) if c != T]
    assert sorted(held) == list(range(11))
    assert cm.entries(tables[2])[3] == T and cm.generation(T) == 0


def test_generation_bumps_when_a_chunk_changes_owner(cm):
    assert cm.reserve(0, 32)
    assert [cm.generation(c) for c in (0, 1, 2)] == [1, 1, 0]
    cm.shrink(0, 16)
    assert [cm.generation(c) for c in (0, 1, 2)] == [1, 2, 0]
    assert cm.reserve(1, 16)  # chunk 1 again, to a new owner
    assert cm.entries(1)[0] == 1 and cm.generation(1) == 3
    cm.swap(0, 1)
    assert [cm.generation(c) for c in (0, 1, 2)] == [1, 3, 0]
    with pytest.raises(IndexError):
        cm.generation(12)


def test_tables_new_and_drop(cm):
    assert cm.tables == [0, 1]
    a, b = cm.new_table(), cm.new_table()
    assert (a, b, cm.tables, cm.entries(a)) == (2, 3, [0, 1, 2, 3], [T] * 4)
    assert cm.version == 0  # an empty table changes no entry
    assert cm.reserve(b, 16)
    with pytest.raises(ValueError, match="holds 1 chunks"):
        cm.drop_table(b)
    with pytest.raises(ValueError, match="slot"):
        cm.drop_table(0)
    cm.drop_table(a)
    assert cm.drain_ops()[-1] == ["drop", 2, a]
    assert cm.new_table() == 4  # ids are never reused
    for call in (lambda: cm.entries(a), lambda: cm.reserve(a, 1), lambda: cm.swap(0, a), lambda: cm.drop_table(a)):
        with pytest.raises(KeyError, match="table 2 does not exist"):
            call()
    with pytest.raises(ValueError):
        cm.reserve(0, -1)


def test_drained_ops_replayed_into_a_mirror_give_the_same_tables(cm):
    mirror = TableMirror(n_chunks=11, table_chunks=4, n_slots=2)
    p = cm.new_table()
    assert cm.reserve(0, 50) and cm.reserve(p, 20)
    cm.swap(0, p)
    cm.shrink(p, 10)
    assert cm.reserve(1, 64)
    assert cm.entries(1) == [1, 2, 3, 6]
    cm.release(0)
    cm.release(p)
    cm.drop_table(p)
    seen = []
    for op in msgpack.unpackb(msgpack.packb(cm.drain_ops())):  # as it travels on the wire
        mirror.apply(op)
        seen.append(sorted(mirror.changed_slots))
        assert mirror.version == op[1]
    assert mirror.version == cm.version
    for t in (0, 1, p):
        assert mirror.entries(t) == (cm.entries(t) if t in cm.tables else [T] * 4)
    assert seen[:3] == [[0], [], [0]]  # reserve slot 0, reserve parked table, swap touches slot 0


def test_mirror_refuses_stale_ops_and_gaps(cm):
    mirror = TableMirror(11, 4, 2)
    assert cm.reserve(0, 16) and cm.reserve(0, 32) and cm.reserve(1, 16)
    op1, op2, op3 = cm.drain_ops()
    with pytest.raises(OpGap, match="version 2 .* at version 0: ops 1..1 are missing"):
        mirror.apply(op2)
    assert mirror.version == 0 and mirror.entries(0) == [T] * 4
    mirror.apply(op1)
    with pytest.raises(StaleOp, match="already at version 1"):
        mirror.apply(op1)
    with pytest.raises(OpGap):
        mirror.apply(op3)
    mirror.apply(op2)
    mirror.apply(op3)
    assert (mirror.entries(0), mirror.entries(1), mirror.version) == ([0, 1, T, T], [2, T, T, T], 3)
    for bad in (["set", 4, 0, [[4, 0]]], ["set", 4, 0, [[0, 12]]], ["set", 4, 0, [0]], ["grow", 4, 0],
                ["swap", 4, 0], ["drop", 4, 1], ["drop", 4, -2], ["set", "4", 0, []]):
        with pytest.raises(OpError):
            mirror.apply(bad)
    assert mirror.version == 3 and mirror.entries(0) == [0, 1, T, T]


def test_snapshot_rebuilds_the_whole_state_on_a_fresh_mirror(cm):
    live = TableMirror(11, 4, 2)
    p, q = cm.new_table(), cm.new_table()
    assert cm.reserve(0, 30) and cm.reserve(p, 64) and cm.reserve(1, 5)
    cm.swap(1, p)
    for op in cm.drain_ops():
        live.apply(op)
    snap = cm.snapshot_ops()
    assert snap == [
        ["set", 4, 0, [[0, 0], [1, 1]]],
        ["set", 4, 1, [[0, 2], [1, 3], [2, 4], [3, 5]]],
        ["set", 4, p, [[0, 6]]],
    ]  # every slot, and the tables that hold chunks (q holds none)
    rejoined = TableMirror(11, 4, 2)
    rejoined.apply(["set", 1, 0, [[3, 9]]])  # junk from before the crash
    rejoined.load(msgpack.unpackb(msgpack.packb(snap)))
    assert rejoined.changed_slots == {0, 1} and rejoined.version == cm.version
    cm.release(p)
    cm.drop_table(q)
    for op in cm.drain_ops():
        live.apply(op)
        rejoined.apply(op)
    for t in (0, 1, p, q):
        assert rejoined.entries(t) == live.entries(t) == (cm.entries(t) if t in cm.tables else [T] * 4)
    with pytest.raises(StaleOp):
        rejoined.apply(["set", 2, 0, []])
    with pytest.raises(OpError):
        rejoined.load([])
    with pytest.raises(OpError, match="one version"):
        rejoined.load([["set", 1, 0, []], ["set", 2, 1, []]])
    fresh = ChunkMap(11, 16, 4, 2).snapshot_ops()
    assert fresh == [["set", 0, 0, []], ["set", 0, 1, []]]  # slots always: a snapshot is never empty
    rejoined.load(fresh)
    assert (rejoined.version, rejoined.entries(0), rejoined.entries(p)) == (0, [T] * 4, [T] * 4)


# ---- StaticMap: the pool-off baseline -----------------------------------------------------------------


@pytest.fixture
def sm() -> StaticMap:
    return StaticMap(n_chunks=12, chunk_cells=16, table_chunks=4, n_slots=2)  # regions 0, 1 and park 2


def test_static_map_needs_one_region_per_slot_plus_park():
    with pytest.raises(ValueError, match="n_chunks = \\(n_slots \\+ 1\\) \\* table_chunks = 12"):
        StaticMap(11, 16, 4, 2)


def test_static_map_identity_layout(sm):
    assert (sm.trash, sm.free_chunks, sm.total_cells) == (12, 12, 192)
    assert region(1, 4) == [4, 5, 6, 7]
    assert sm.reserve(1, 20) and sm.reserve(0, 64)
    assert sm.entries(1) == [4, 5, 12, 12]  # identity up to the held cells, trash past them
    assert sm.entries(0) == [0, 1, 2, 3]
    assert (sm.held_cells(1), sm.held_chunks(1), sm.free_chunks) == (20, 2, 6)
    assert sm.reserve(1, 30)
    assert sm.drain_ops() == [["set", 1, 1, [[0, 4], [1, 5]]], ["set", 2, 0, [[0, 0], [1, 1], [2, 2], [3, 3]]]]
    assert sm.held_cells(1) == 30 and sm.version == 2  # same chunks: recorded, not a change
    before = state(sm)
    assert not sm.can_reserve(1, 65) and not sm.reserve(1, 65)
    assert state(sm) == before
    sm.shrink(1, 10)
    assert sm.entries(1) == [4, 12, 12, 12] and sm.held_cells(1) == 10
    assert [sm.generation(c) for c in (4, 5, 6)] == [1, 2, 0]
    assert sm.drain_ops() == [["set", 3, 1, [[1, 12]]]]


def test_static_map_park_table(sm):
    assert sm.new_table() == 2
    assert sm.new_table() is None  # the one park region is taken
    assert sm.reserve(2, 40) and sm.entries(2) == [8, 9, 10, 12]
    with pytest.raises(ValueError):
        sm.drop_table(2)
    sm.release(2)
    sm.drop_table(2)
    assert sm.new_table() == 2


def test_static_map_swap_exchanges_bytes(sm):
    p = sm.new_table()
    assert sm.reserve(0, 40) and sm.reserve(p, 20)
    sm.drain_ops()
    gens = [sm.generation(c) for c in range(13)]
    sm.swap(0, p)
    assert (sm.held_cells(0), sm.held_cells(p)) == (20, 40)
    assert (sm.entries(0), sm.entries(p)) == ([0, 1, 12, 12], [8, 9, 10, 12])
    assert sm.drain_ops() == [["exchange", 3, 0, p, 40], ["set", 4, 0, [[2, 12]]], ["set", 5, p, [[2, 10]]]]
    bumped = [c for c in range(13) if sm.generation(c) != gens[c]]
    assert bumped == [0, 1, 2, 8, 9, 10]  # the region chunks the exchange overwrote
    assert sm.free_chunks == 7
    sm.release(0)
    sm.swap(0, 1)  # both empty: no bytes to move
    sm.swap(1, 1)
    assert [op[0] for op in sm.drain_ops()] == ["set"]


def test_static_map_ops_replayed_into_a_mirror(sm):
    mirror = TableMirror(12, 4, 2)
    p = sm.new_table()
    assert sm.reserve(0, 64) and sm.reserve(1, 5)
    sm.swap(0, p)
    sm.swap(1, p)
    sm.shrink(0, 17)
    for op in sm.drain_ops():
        mirror.apply(op)
        if op[0] == "exchange":
            assert mirror.changed_slots == set()  # the runner moves the bytes; the rows follow in "set" ops
    for t in (0, 1, p):
        assert mirror.entries(t) == sm.entries(t)
    fresh = TableMirror(12, 4, 2)
    fresh.load(sm.snapshot_ops())
    assert [fresh.entries(t) for t in (0, 1, p)] == [sm.entries(t) for t in (0, 1, p)]
    assert fresh.version == mirror.version == sm.version
