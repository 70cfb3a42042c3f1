"""What a stage needs to survive its own crash: the generations ops carry (`generations_of`), the check the
coordinator makes on a rejoin (`intact`), and the pool file's session tag that scopes the generations."""
from __future__ import annotations

from pathlib import Path

import pytest

from pool.chunk_map import ChunkMap, StaticMap, TableMirror
from pool.memory import PoolLayout, PoolMemory

C, T = 16, 4  # chunk_cells, table_chunks


def stage_copy(m, gens: list[int], ops: list) -> None:
    """What a stage does with an OPS message: apply, then note the generations it carries."""
    for chunk, g in m.generations_of(ops):
        gens[chunk] = g


def test_generations_of_names_the_chunks_handed_out_with_their_generation_now():
    m = ChunkMap(8, C, T, 2)
    assert m.reserve(0, 40)  # chunks 0, 1, 2
    assert m.reserve(1, 20)  # chunks 3, 4
    ops = m.drain_ops()
    assert m.generations_of(ops) == [[0, 1], [1, 1], [2, 1], [3, 1], [4, 1]]
    m.shrink(0, 16)  # frees 2 and 1: not listed, nobody holds them
    assert m.generations_of(m.drain_ops()) == []
    t = m.new_table()
    m.swap(0, t)  # a move: no chunk changes owner
    assert m.generations_of(m.drain_ops()) == []
    assert m.reserve(t, 48)  # gets 1 and 2 back, each at generation 3 (reserved, freed, reserved)
    assert m.generations_of(m.drain_ops()) == [[1, 3], [2, 3]]
    # Within one batch a chunk freed and handed out again is listed once, at its latest generation.
    m.release(1)
    assert m.reserve(0, 32)
    assert m.generations_of(m.drain_ops()) == [[3, 3], [4, 3]]


def test_generations_of_an_exchange_cover_the_region_cells_it_rewrites():
    m = StaticMap((2 + 1) * T, C, T, 2)
    assert m.reserve(0, 20)  # region 0: chunks 0..3, 2 held
    m.drain_ops()
    park = m.new_table()
    m.swap(0, park)  # exchange 20 cells: two chunks of each region are rewritten
    ops = m.drain_ops()
    assert ops[0][0] == "exchange"
    assert m.generations_of(ops) == [[0, 2], [1, 2], [8, 1], [9, 1]]  # region 0 was reserved before


def test_intact_compares_a_tables_chunks_only():
    m = ChunkMap(8, C, T, 2)
    gens = [0] * 9
    assert m.reserve(0, 40) and m.reserve(1, 20)
    stage_copy(m, gens, m.drain_ops())
    assert m.intact(0, gens) and m.intact(1, gens)
    m.release(1)
    assert m.reserve(1, 16)  # chunk 4 again, at generation 3: the stage never saw this op
    m.drain_ops()
    assert m.intact(0, gens) and not m.intact(1, gens)
    gens[5] = 99  # a chunk nobody holds does not matter
    assert m.intact(0, gens)
    gens[2] = 0  # a fresh pool file: the bytes are not table 0's
    assert not m.intact(0, gens)
    assert not m.intact(0, None) and not m.intact(0, gens[:2])
    m.release(1)
    assert m.intact(1, None)  # a table holding nothing has nothing to lose


def test_the_mirror_still_takes_the_ops_unchanged():
    m = ChunkMap(8, C, T, 2)
    mirror = TableMirror(8, T, 2)
    assert m.reserve(0, 40)
    for op in m.drain_ops():
        mirror.apply(op)
    assert mirror.entries(0) == m.entries(0)


def test_the_pool_file_keeps_the_session_its_generations_belong_to(tmp_path: Path):
    layout = PoolLayout(n_layers=1, n_chunks=4, chunk_cells=16, kv_heads=1, head_dim=16, kv_dtype="float32")
    path = tmp_path / "pool"
    with PoolMemory.create(path, layout) as mem:
        assert mem.session == ""
        mem.session = "3f9a1c22b0de"
        mem.generations[2] = 7
    with PoolMemory.attach(path, layout) as mem:  # a restarted stage
        assert mem.session == "3f9a1c22b0de" and mem.generations[2] == 7
        mem.session = "x"
        assert mem.session == "x"
        with pytest.raises(ValueError, match="longer than 16 bytes"):
            mem.session = "s" * 17
