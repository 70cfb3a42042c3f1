"""stages/snapshot.py and the runner's part in saves and crashes: K/V cells (and a linear-attention state entry)
to a part and back through any table and any chunk size, damaged parts refused before a byte is written,
generations kept per session."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pool.config import config_from_dict
from pool.layer_kinds import LinearGeometry
from pool.snapshot import SnapshotError
from stages.kv_cache import KVCache
from stages.runner import StageRunner, StaleStep
from stages.snapshot import check_part, load_part, save_part
from stages.state_pool import UNKNOWN, StatePool

HEADER = {"save_id": "s1", "model_fp": "m", "config_fp": "c", "kv_dtype": "float32", "n_stages": 1}


def cache(kv_dtype: str = "float32", chunk_cells: int = 16, n_chunks: int = 8, device: str = "cpu") -> KVCache:
    return KVCache(2, n_chunks, chunk_cells, 2, 8, kv_dtype, device, 4, 64 // chunk_cells)


def fill(kv: KVCache, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for arr in kv.arrays():
        if arr.dtype == torch.int8:
            arr.copy_(torch.randint(-127, 128, arr.shape, generator=g, dtype=torch.int8))
        else:
            arr.copy_(torch.randn(arr.shape, generator=g))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def cells(kv: KVCache, entries: list[int], n: int) -> list[torch.Tensor]:
    """Every array's cells [0, n) of a table, in cell order (the reference reader)."""
    pos = torch.arange(n)
    idx = torch.tensor(entries)[pos // kv.chunk_cells] * kv.chunk_cells + pos % kv.chunk_cells
    return [arr.reshape(-1, *arr.shape[2:])[idx.to(arr.device)].cpu() for arr in kv.arrays()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_cells_come_back_through_another_table_and_chunk_size(tmp_path: Path, kv_dtype: str, device: str) -> None:
    src, n = cache(kv_dtype, device=device), 37  # 3 chunks of 16, the last one partly
    fill(src, 1)
    table = [5, 2, 7, 8]  # out of order, trash past the third
    part = tmp_path / "c.stage0"
    nbytes = save_part(src, table, n, part, {**HEADER, "kv_dtype": kv_dtype})
    assert nbytes == part.stat().st_size and nbytes > n * src.bytes_per_cell
    assert check_part(src, part, n, {**HEADER, "kv_dtype": kv_dtype}) == nbytes
    dst = cache(kv_dtype, chunk_cells=32, n_chunks=4, device=device)  # another pool: 32-cell chunks, other ids
    fill(dst, 2)
    before = [a.clone() for a in dst.arrays()]
    load_part(dst, [3, 0, 4], n, part, {**HEADER, "kv_dtype": kv_dtype})
    for want, got in zip(cells(src, table, n), cells(dst, [3, 0], n)):
        assert torch.equal(want, got)
    for old, arr in zip(before, dst.arrays()):  # nothing outside cells [0, 37) of chunks 3, 0 changed
        changed = (old != arr).reshape(old.shape[0], old.shape[1], -1).any(-1)
        rows = changed.nonzero().tolist()
        assert all((c == 3 and p < 32) or (c == 0 and p < 5) for c, p in rows), rows[:5]


def test_a_damaged_part_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    src, n = cache(), 20
    fill(src, 3)
    part = tmp_path / "c.stage0"
    save_part(src, [0, 1, 8, 8], n, part, HEADER)
    data = bytearray(part.read_bytes())
    data[-5] ^= 0x10
    part.write_bytes(bytes(data))
    dst = cache()
    with pytest.raises(SnapshotError, match="payload hash does not match"):
        check_part(dst, part, n, HEADER)
    assert all(not a.any() for a in dst.arrays())  # the check wrote nothing
    with pytest.raises(SnapshotError, match="n_tokens is 20 in the file, expected 21"):
        check_part(dst, part, 21, HEADER)
    with pytest.raises(SnapshotError, match="another model"):
        check_part(dst, part, n, {**HEADER, "model_fp": "other"})
    with pytest.raises(SnapshotError, match="head_dim is None in the file, expected 16"):
        _geometry(part, n)
    with pytest.raises(ValueError, match="reach the trash chunk"):
        save_part(src, [0, 8, 8, 8], n, tmp_path / "d", HEADER)
    assert not (tmp_path / "d").exists()


def _geometry(part: Path, n: int) -> None:
    """A stage whose layers have another head_dim expects its own (the runner puts the geometry in every part)."""
    other = KVCache(2, 8, 16, 2, 16, "float32", "cpu", 4, 4)
    check_part(other, part, n, {**HEADER, "head_dim": 16})


# ---- the runner ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("qwen3", layers=4, hidden=64, heads=4, kv_heads=2, seed=3)


def runner_cfg(model_dir: Path, save_dir: Path | None):
    stages = [{"device": "cpu", "layers": [0, 4], "endpoint": "ipc:///tmp/strata-test-snapshot-0"}]
    eng = {"max_context": 64, "parallel": 2, "chunk_cells": 16, "kv_pool_tokens": 128, "threads": 1,
           "prefill_chunk": 64, "slot_save_path": str(save_dir) if save_dir else None}
    return config_from_dict({"model": str(model_dir), "engine": eng, "stages": stages})


def test_generations_survive_a_restart_within_their_session_only(model_dir: Path, tmp_path: Path) -> None:
    cfg = runner_cfg(model_dir, None)
    r = StageRunner(cfg, 0, pool_path=tmp_path / "pool")
    r.reset("sessionA")
    r.record_generations([[0, 3], [5, 1]])
    assert r.hello()["generations"][:6] == [3, 0, 0, 0, 0, 1]
    with pytest.raises(ValueError, match="outside"):
        r.record_generations([[9, 1]])
    r.close(unlink=False)  # a crash
    r = StageRunner(cfg, 0, pool_path=tmp_path / "pool")
    try:
        r.reset("sessionA")  # the same coordinator: its generations are kept for it to compare
        assert r.hello()["pool"]["reattached"] and r.hello()["generations"][:6] == [3, 0, 0, 0, 0, 1]
        r.reset("sessionB")  # a new coordinator counts from zero
        assert not any(r.hello()["generations"]) and r.memory.session == "sessionB"
    finally:
        r.close()


def test_save_and_restore_go_through_the_mirror_and_refuse_stale_versions(model_dir: Path, tmp_path: Path) -> None:
    r = StageRunner(runner_cfg(model_dir, tmp_path / "saves"), 0, pool_path=tmp_path / "pool")
    try:
        r.apply(["set", 1, 0, [[0, 2], [1, 6]]])
        fill(r.kv, 4)
        x, y = "a" * 32, "b" * 32
        req = {"name": "c", "save_id": x, "version": 1, "table": 0, "cells": 20}
        nbytes = r.save_session(req)
        saves = tmp_path / "saves"
        assert (saves / f"c.{x}.stage0").stat().st_size == nbytes
        with pytest.raises(StaleStep, match="needs table version 0"):
            r.save_session({**req, "version": 0})
        assert r.restore_session({**req, "check": True}) == nbytes
        with pytest.raises(SnapshotError, match="no such snapshot file"):
            r.restore_session({**req, "save_id": y, "check": True})
        with pytest.raises(SnapshotError, match="not 32 hex digits"):
            r.restore_session({**req, "save_id": "../../etc", "check": True})
        shutil.copy(saves / f"c.{x}.stage0", saves / f"c.{y}.stage0")
        with pytest.raises(SnapshotError, match="another save"):
            r.restore_session({**req, "save_id": y, "check": True})
        assert r.save_session({"name": "c", "save_id": x, "tidy": "others"}) == 0  # the other save's part goes
        assert sorted(p.name for p in saves.iterdir()) == [f"c.{x}.stage0"]
        r.apply(["set", 2, 5, [[0, 4], [1, 1]]])  # a parked table
        r.restore_session({**req, "version": 2, "table": 5})
        for want, got in zip(cells(r.kv, [2, 6], 20), cells(r.kv, [4, 1], 20)):
            assert torch.equal(want, got)
        with pytest.raises(SnapshotError, match="1..max_context=64"):
            r.restore_session({**req, "cells": 65, "check": True})
        r.save_session({"name": "c", "save_id": x, "tidy": "this"})  # a save that failed on another stage
        assert list(saves.iterdir()) == []
    finally:
        r.close()
    off = StageRunner(runner_cfg(model_dir, None), 0, pool_path=tmp_path / "pool2")
    try:
        with pytest.raises(SnapshotError, match="slot_save_path is not set"):
            off.save_session({"name": "c", "save_id": "a" * 32, "version": 0, "table": 0, "cells": 4})
    finally:
        off.close()


def states(n_entries: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> StatePool:
    pool = StatePool(n_entries, 3, LinearGeometry(key_heads=2, value_heads=4, key_dim=8, value_dim=8, kernel=4), dtype)
    g = torch.Generator().manual_seed(seed)
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=g))
    pool.recurrent.copy_(torch.randn(pool.recurrent.shape, generator=g))
    return pool


@pytest.mark.parametrize("empty_kv", [False, True])
def test_a_state_entry_comes_back_with_its_cells_into_another_entry(tmp_path: Path, empty_kv: bool) -> None:
    """A stage with linear-attention layers (with or without full-attention layers) saves one entry's conv and
    recurrent state after the cells; reading it sets only the target entry, holding exactly the cells' tokens."""
    src = KVCache(0, 8, 16, 2, 8, "float32", "cpu", 4, 4) if empty_kv else cache()
    fill(src, 1)
    pool, n, part = states(3, 1), 37, tmp_path / "c.stage0"
    with pytest.raises(SnapshotError, match="state entry 2 holds the state after 0 tokens, not that of the 37"):
        save_part(src, [5, 2, 7, 8], n, part, HEADER, (pool, 2))
    pool.tokens[2] = n
    nbytes = save_part(src, [5, 2, 7, 8], n, part, HEADER, (pool, 2))
    assert nbytes == part.stat().st_size > n * src.bytes_per_cell + pool.entry_nbytes
    other = states(3, 2)
    with pytest.raises(SnapshotError, match="the header is corrupt"):  # a part without the entry's bytes
        check_part(src, part, n, HEADER)
    assert check_part(src, part, n, HEADER, (other, 0)) == nbytes
    conv, recurrent, tokens = other.conv.clone(), other.recurrent.clone(), list(other.tokens)
    load_part(src, [3, 0, 4], n, part, HEADER, (other, 1))
    assert torch.equal(other.conv[1], pool.conv[2]) and torch.equal(other.recurrent[1], pool.recurrent[2])
    for e in (0, 2):  # the other entries are untouched
        assert torch.equal(other.conv[e], conv[e]) and torch.equal(other.recurrent[e], recurrent[e])
    assert other.tokens == [tokens[0], n, tokens[2]]
    flip = bytearray(part.read_bytes())
    flip[-1] ^= 0x40
    part.write_bytes(bytes(flip))
    with pytest.raises(SnapshotError, match="hash"):
        load_part(src, [3, 0, 4], n, part, HEADER, (other, 1))
    assert other.tokens[1] == UNKNOWN  # garbage in the entry: no step may continue it
