"""ChunkMap sharing (rules 6, 9-17 of pool/chunk_map.py), the prefix index and the mirror's checks, with exact
chunk ids.

The pool: 11 usable chunks of 4 cells (trash = chunk 11), tables of 4 chunks (16 cells), 2 slots.
"""
from __future__ import annotations

import msgpack
import pytest

from pool.chunk_map import ChunkMap, OpError, SharedWrite, TableMirror
from pool.prefix_index import ROOT, PrefixIndex

T = 11
IDS = [100 + k for k in range(16)]  # four whole chunks of token ids


@pytest.fixture
def cm() -> ChunkMap:
    return ChunkMap(n_chunks=11, chunk_cells=4, table_chunks=4, n_slots=2)


def refs(m: ChunkMap) -> list[int]:
    return [m.refs(c) for c in range(m.n_chunks)]


def test_only_full_chunks_are_published_and_found_by_their_ids(cm):
    assert cm.reserve(0, 10)  # [0, 1, 2]: cells 8..9 of chunk 2 written, chunk 2 is partial
    cm.publish(0, IDS[:10])
    assert cm.lookup(IDS) == [0, 1]
    assert cm.lookup(IDS, limit=1) == [0]
    assert cm.lookup(IDS[:7]) == [0]  # a lookup matches whole chunks only
    assert cm.lookup([100, 101, 102, 999] + IDS[4:]) == []  # the first chunk differs: nothing after it counts
    assert cm.lookup([7, 7, 7, 7] + IDS[4:8]) == []  # chunk 1's ids after another first chunk: another prefix
    cm.publish(0, IDS[:12])  # chunk 2 now full
    assert cm.lookup(IDS) == [0, 1, 2]
    assert cm.version == 1 and cm.drain_ops() == [["set", 1, 0, [[0, 0], [1, 1], [2, 2]]]]  # publish logs nothing
    cm.publish(1, IDS)  # slot 1 holds nothing: nothing to register
    assert cm.lookup(IDS) == [0, 1, 2]
    with pytest.raises(ValueError, match="publish: 17 cells of table 0 but 16 tokens"):
        cm.publish(0, IDS, 17)


def test_share_maps_a_run_and_counts_every_holder(cm):
    assert cm.reserve(0, 10)
    cm.publish(0, IDS[:10])
    cm.drain_ops()
    gens = [cm.generation(c) for c in range(12)]
    t = cm.new_table()
    cm.share(t, cm.lookup(IDS))
    assert cm.entries(t) == [0, 1, T, T] and cm.held_chunks(t) == 2 and cm.held_cells(t) == 8
    assert refs(cm)[:4] == [2, 2, 1, 0]
    assert (cm.free_chunks, cm.shared_cells, cm.saved_cells) == (8, 8, 8)
    assert [cm.generation(c) for c in range(12)] == gens  # a second holder changes no generation
    assert cm.reserve(t, 14)
    assert cm.entries(t) == [0, 1, 3, 4]  # its own chunks come fresh, lowest first
    assert cm.drain_ops() == [["share", 2, t, [[0, 0], [1, 1]]], ["set", 3, t, [[2, 3], [3, 4]]]]
    assert (cm.exclusive_cells(0), cm.exclusive_cells(t)) == (4, 8)
    assert cm.cells_freed_by([0]) == 4 and cm.cells_freed_by([0, t]) == 20 and cm.cells_freed_by([t, t]) == 8
    # free + distinct held = total; free + sum(held) = total + saved
    assert cm.free_cells + 5 * 4 == cm.total_cells
    assert cm.free_cells + cm.held_cells(0) + cm.held_cells(t) == cm.total_cells + cm.saved_cells
    assert cm.generations_of([["share", 2, t, [[0, 0], [1, 1]]]]) == [[0, 1], [1, 1]]


def test_the_last_holder_frees_a_shared_chunk(cm):
    assert cm.reserve(0, 10)
    cm.publish(0, IDS[:10])
    t = cm.new_table()
    cm.share(t, [0, 1])
    gens = [cm.generation(c) for c in range(12)]
    cm.drain_ops()
    cm.release(0)  # chunk 2 was slot 0's alone; 0 and 1 stay with t
    assert refs(cm)[:3] == [1, 1, 0] and cm.free_chunks == 9
    assert [cm.generation(c) for c in range(3)] == [gens[0], gens[1], gens[2] + 1]
    assert cm.lookup(IDS) == [0, 1]  # still registered: t holds them
    assert (cm.shared_cells, cm.saved_cells) == (0, 0)
    assert cm.reserve(1, 4) and cm.entries(1)[0] == 2  # the chunk just freed is next out
    cm.release(t)
    assert refs(cm)[:3] == [0, 0, 1] and cm.free_chunks == 10
    assert cm.lookup(IDS) == []  # a freed chunk's key is forgotten
    assert cm.reserve(0, 8) and cm.entries(0)[:2] == [0, 1]  # t's chunks were pushed lowest entry on top
    assert cm.drain_ops() == [["set", 3, 0, [[0, T], [1, T], [2, T]]], ["set", 4, 1, [[0, 2]]],
                              ["set", 5, t, [[0, T], [1, T]]], ["set", 6, 0, [[0, 0], [1, 1]]]]


def test_shrink_never_keeps_a_shared_chunk_in_part(cm):
    assert cm.reserve(0, 12)
    cm.publish(0, IDS[:12])
    cm.share(1, [0, 1, 2])
    cm.drain_ops()
    cm.shrink(1, 8)  # on a boundary: keeps chunks 0 and 1
    assert cm.entries(1) == [0, 1, T, T]
    cm.shrink(1, 6)  # cell 6 is inside chunk 1, which slot 0 also holds: slot 1's next write would land there
    assert cm.entries(1) == [0, T, T, T] and cm.held_cells(1) == 4
    assert refs(cm)[:3] == [2, 1, 1] and cm.free_chunks == 8  # it dropped a reference, freed nothing
    assert cm.drain_ops() == [["set", 3, 1, [[2, T]]], ["set", 4, 1, [[1, T]]]]
    cm.shrink(0, 10)  # inside chunk 2, which slot 0 holds alone: kept, its key forgotten (its bytes will change)
    assert cm.entries(0) == [0, 1, 2, T] and cm.drain_ops() == []
    assert cm.lookup(IDS) == [0, 1]
    cm.publish(0, IDS[:8] + [5, 5, 5, 5])  # slot 0 wrote other tokens into chunk 2
    assert cm.lookup(IDS[:8] + [5, 5, 5, 5]) == [0, 1, 2] and cm.lookup(IDS) == [0, 1]
    cm.shrink(0, 2)  # inside chunk 0, which slot 1 also holds: slot 0 keeps nothing
    assert cm.entries(0) == [T] * 4 and refs(cm)[:3] == [1, 0, 0] and cm.free_chunks == 10


def test_a_second_copy_of_the_same_tokens_stays_private_until_the_first_goes(cm):
    assert cm.reserve(0, 8) and cm.reserve(1, 8)  # both prefilled the same tokens before either published
    cm.publish(0, IDS[:8])
    cm.publish(1, IDS[:8])
    assert cm.lookup(IDS) == [0, 1]
    cm.release(0)
    assert cm.lookup(IDS) == []
    cm.publish(1, IDS[:8])
    assert cm.lookup(IDS) == [2, 3]


def test_share_refuses_anything_but_a_registered_chain_and_changes_nothing(cm):
    assert cm.reserve(0, 12)
    cm.publish(0, IDS[:8])  # chunks 0 and 1 registered, 2 not
    cm.drain_ops()
    t = cm.new_table()
    before = (cm.entries(t), refs(cm), cm.version, cm.free_chunks)
    for bad, why in (([1], "entry 0 names chunk 1"), ([0, 2], "entry 1 names chunk 2"),
                     ([0, 1, 1], "entry 2 names chunk 1"), ([T], "entry 0 names chunk 11"),
                     ([0, 0], "entry 1 names chunk 0")):
        with pytest.raises(ValueError, match=why):
            cm.share(t, bad)
        assert (cm.entries(t), refs(cm), cm.version, cm.free_chunks) == before
    with pytest.raises(ValueError, match="holds 3 chunks"):
        cm.share(0, [0])
    cm.share(t, [])  # an empty run is no change
    assert cm.drain_ops() == []


def test_a_hash_collision_never_matches_other_ids():
    index = PrefixIndex(chunk_cells=2)
    a, b = (5, -1), (5, -2)
    assert hash(a) == hash(b) and a != b  # CPython: hash(-1) == hash(-2)
    assert index.add(7, ROOT, a)
    assert index.match(list(a), 1) == [7]
    assert index.match(list(b), 1) == []
    assert index.add(8, ROOT, b) and index.match(list(b), 1) == [8]
    with pytest.raises(ValueError, match="2 token ids, got 3"):
        index.add(9, ROOT, (1, 2, 3))


def test_swap_keeps_references_and_what_is_published(cm):
    assert cm.reserve(0, 8)
    cm.publish(0, IDS[:8])
    cm.share(1, [0, 1])
    p = cm.new_table()
    cm.swap(1, p)
    assert refs(cm)[:2] == [2, 2] and cm.entries(p)[:2] == [0, 1] and cm.entries(1) == [T] * 4
    assert cm.reserve(p, 12) and cm.entries(p)[:3] == [0, 1, 2]
    cm.publish(p, IDS[:12])
    assert cm.lookup(IDS) == [0, 1, 2]  # p's own chunk 2 chains on after the shared run


def test_snapshot_with_shares_rebuilds_the_refs_on_a_fresh_mirror(cm):
    live = TableMirror(11, 4, 2)
    assert cm.reserve(0, 12)
    cm.publish(0, IDS[:12])
    p = cm.new_table()
    cm.share(p, [0, 1])
    assert cm.reserve(p, 16)
    cm.share(1, [0])
    for op in cm.drain_ops():
        live.apply(op)
    snap = cm.snapshot_ops()
    assert snap == [
        ["set", 4, 0, [[0, 0], [1, 1], [2, 2]]],
        ["set", 4, 1, []],
        ["share", 4, 1, [[0, 0]]],
        ["set", 4, p, [[2, 3], [3, 4]]],
        ["share", 4, p, [[0, 0], [1, 1]]],
    ]
    fresh = TableMirror(11, 4, 2)
    fresh.load(msgpack.unpackb(msgpack.packb(snap)))
    assert [fresh.refs(c) for c in range(12)] == [live.refs(c) for c in range(12)] == refs(cm) + [0]
    assert refs(cm)[:5] == [3, 2, 1, 1, 1]
    assert all(fresh.entries(t) == cm.entries(t) for t in cm.tables)
    with pytest.raises(OpError, match="a snapshot is one or more 'set' ops"):
        fresh.load([["share", 4, 1, [[0, 0]]]])
    assert cm.generations_of(snap) == [[c, 1] for c in range(5)]


def test_the_mirror_refuses_a_write_into_a_shared_chunk(cm):
    mirror = TableMirror(11, 4, 2)
    assert cm.reserve(0, 6)  # [0, 1]: slot 0 has written cells 0..5
    cm.publish(0, IDS[:6])
    cm.share(1, [0])
    assert cm.reserve(1, 6)  # slot 1: [0, 2]
    for op in cm.drain_ops():
        mirror.apply(op)
    mirror.check_write(1, 4, 2, 4)  # cells 4..5 of slot 1: its own chunk 2
    mirror.check_write(0, 6, 2, 4)  # slot 0's chunk 1
    with pytest.raises(SharedWrite, match=r"step 9: slot 1 would write cells \[3, 4\) into chunk 0, which 2 tables"):
        mirror.check_write(1, 3, 2, 4, step=9)
    with pytest.raises(SharedWrite, match=r"slot 0 would write cells \[0, 4\) into chunk 0"):
        mirror.check_write(0, 0, 6, 4)
    cm.release(1)
    for op in cm.drain_ops():
        mirror.apply(op)
    mirror.check_write(0, 0, 6, 4)  # slot 0 alone holds chunk 0 again


def test_the_mirror_refuses_ops_that_disagree_with_its_count(cm):
    mirror = TableMirror(11, 4, 2)
    assert cm.reserve(0, 8)
    for op in cm.drain_ops():
        mirror.apply(op)
    before = (mirror.entries(0), mirror.entries(1), [mirror.refs(c) for c in range(12)], mirror.version)
    for bad, why in ((["set", 2, 1, [[0, 1]]], "gives chunk 1 to table 1, but 1 other entries name it"),
                     (["set", 2, 1, [[0, 5], [1, 5]]], "gives chunk 5 to table 1, but 1 other entries"),
                     (["share", 2, 1, [[0, 5]]], "maps chunk 5 into table 1, but no table holds it"),
                     (["share", 2, 0, [[2, 0]]], "maps chunk 0 into table 0, which names it already"),
                     (["share", 2, 0, [[1, 0]]], "writes chunk 0 over entry 1, which names chunk 1"),
                     (["share", 2, 1, [[0, T]]], "chunk <= 10"),
                     (["share", 2, 1, [[0, 0], [0, 1]]], "names an entry twice")):
        with pytest.raises(OpError, match=why.replace("[", r"\[")):
            mirror.apply(bad)
        assert (mirror.entries(0), mirror.entries(1), [mirror.refs(c) for c in range(12)], mirror.version) == before
    mirror.apply(["share", 2, 1, [[0, 0], [1, 1]]])
    assert [mirror.refs(c) for c in range(3)] == [2, 2, 0] and mirror.changed_slots == {1}


def test_intact_holds_for_every_holder_of_a_shared_chunk(cm):
    assert cm.reserve(0, 8)
    cm.publish(0, IDS[:8])
    p = cm.new_table()
    cm.share(p, [0, 1])
    gens = [cm.generation(c) for c in range(11)]
    assert cm.intact(0, gens) and cm.intact(p, gens)
    gens[1] += 1  # a stage whose bytes of chunk 1 belong to another owner
    assert not cm.intact(0, gens) and not cm.intact(p, gens)
