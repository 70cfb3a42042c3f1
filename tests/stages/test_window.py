"""The device window on CPU (frames in a separate array, stages/window.py): every step's greedy tokens and
logprobs equal those of the same script run straight on the pool, whatever the window's size, the moves, the
split, the pool mode or the KV dtype; a chunk handed to another owner is never served from a stale frame; the
host pool is canonical (a re-attached stage decodes on)."""
from __future__ import annotations

import random

import pytest
import torch

from stages.attention import paged_attention, write_kv
from stages.batch import StepBatch
from stages.kv_cache import KVCache
from stages.split_attention import Piece, finish, merge, partial_attention
from stages.window import DeviceWindow
from tests.stages.harness import GREEDY, PROMPT_A, PROMPT_B, Local, make_cfg

C = 16  # chunk_cells
LONG = {"max_context": 384, "kv_pool_tokens": 1024, "prefill_chunk": 64}  # 24-entry tables, 64 chunks


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 512) for _ in range(n)]


def run_prefill(m: Local, slot: int, ids: list[int], piece: int) -> tuple[int, float]:
    """Read `ids` into `slot` in pieces of `piece` tokens; the sampled (token, logprob) after the last piece."""
    out = None
    for at in range(0, len(ids), piece):
        part = ids[at:at + piece]
        last = at + len(part) == len(ids)
        res = m.step([[slot, at, len(part), int(last)]], part, {slot: dict(GREEDY)} if at == 0 else None)
        if last:
            out = (res[0][1], res[0][2])
    assert out is not None
    return out


def decode_together(m: Local, heads: dict[int, tuple[int, int]], n: int,
                    new: tuple[int, ...] = ()) -> dict[int, list[tuple[int, float]]]:
    """`n` decode steps of every slot in `heads` ({slot: (position, token)}) in one step each; the slots in
    `new` get greedy sampling first (a conversation that just moved there)."""
    out: dict[int, list[tuple[int, float]]] = {s: [] for s in heads}
    pos = dict(heads)
    for i in range(n):
        slots = sorted(pos)
        sampling = {s: dict(GREEDY) for s in new} if i == 0 else None
        res = m.step([[s, pos[s][0], 1, 1] for s in slots], [pos[s][1] for s in slots], sampling)
        for slot, token, logprob, _ in res:
            out[slot].append((token, logprob))
            pos[slot] = (pos[slot][0] + 1, token)
    return out


def same(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < 1e-4


def window_of(m: Local) -> list[DeviceWindow]:
    return [r.window for r in m.runners]


def long_conversation(m: Local) -> list[tuple[int, float]]:
    """A 20-chunk conversation: 200 prompt tokens in pieces of 48, then 119 decodes (cells [0, 320))."""
    ids = prompt(200, seed=1)
    first = run_prefill(m, 0, ids, 48)
    return [first, *decode_together(m, {0: (200, first[0])}, 119)[0]]


@pytest.mark.parametrize("frames", [1, 2, 3])
def test_a_long_conversation_through_a_window_of_a_few_chunks(local, frames):
    want = long_conversation(local([[0, 4]], **LONG))
    m = local([[0, 4]], device_cells=frames * C, **LONG)
    assert m.runners[0].window.n_frames == frames
    same(long_conversation(m), want)
    stats = m.runners[0].window.stats
    assert stats["streamed_steps"] > 0 and stats["streamed"] > 0  # the context did not fit: it was streamed
    assert stats["d2h_bytes"] > 0


def four_slots(m: Local) -> dict[int, list[tuple[int, float]]]:
    heads = {}
    for slot in range(4):
        ids = prompt(36 + 5 * slot, seed=10 + slot)  # 3-4 chunks each
        token, logprob = run_prefill(m, slot, ids, 24)
        heads[slot] = (len(ids), token)
    return decode_together(m, heads, 12)


@pytest.mark.parametrize("frames", [5, 16])
def test_four_slots_whose_union_exceeds_the_window_match_solo_runs(local, frames):
    """5 frames: each prompt piece fits, the prompts evict each other's frames, and every 4-slot decode step
    streams; 16: room for the 4 conversations, every step resident."""
    solo = {}
    for slot in range(4):
        ref = local([[0, 4]], **LONG)
        ids = prompt(36 + 5 * slot, seed=10 + slot)
        token, _ = run_prefill(ref, slot, ids, 24)
        solo[slot] = decode_together(ref, {slot: (len(ids), token)}, 12)[slot]
        ref.close()
    m = local([[0, 4]], device_cells=frames * C, **LONG)
    got = four_slots(m)
    for slot in range(4):
        same(got[slot], solo[slot])
    stats = m.runners[0].window.stats
    assert stats["streamed_steps"] == (12 if frames == 5 else 0)
    assert (stats["evictions"] > 0) == (frames == 5)


def moves(m: Local) -> list[tuple[int, float]]:
    """A parked, a second conversation through the same slot (evicting A's frames), A back into another slot."""
    out = []
    a = prompt(40, seed=21)
    token, lp = run_prefill(m, 0, a, 16)
    out.append((token, lp))
    out += decode_together(m, {0: (40, token)}, 4)[0]
    park = m.map.new_table()
    m.map.swap(0, park)
    b = prompt(45, seed=22)
    tb, lpb = run_prefill(m, 0, b, 20)
    out.append((tb, lpb))
    out += decode_together(m, {0: (45, tb)}, 3)[0]
    m.map.swap(park, 2)
    both = decode_together(m, {2: (44, out[4][0]), 0: (48, out[-1][0])}, 4, new=(2,))
    return out + both[2] + both[0]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("pool", [True, False], ids=["pool", "no-pool"])
@pytest.mark.parametrize("ranges", [[[0, 4]], [[0, 2], [2, 4]]], ids=["1-stage", "2-stages"])
def test_moves_and_evictions_through_the_window(local, ranges, pool, kv_dtype):
    engine = {"max_context": 96, "kv_pool_tokens": 256 if pool else 0, "kv_dtype": kv_dtype}
    want = moves(local(ranges, pool=pool, **engine))
    m = local(ranges, pool=pool, device_cells=4 * C, **engine)
    same(moves(m), want)
    for w in window_of(m):
        assert w.stats["hits"] > 0
        # pool: B's fills evict A's frames; no pool: the exchange rewrote A's and B's regions in the host pool
        # with new generations, so their frames are found stale (rule 2) before any eviction is needed.
        assert w.stats["evictions" if pool else "stale"] > 0
        assert w.frames.k[0].data_ptr() != m.runners[0].kv.k[0].data_ptr()  # frames apart from the pool


def session_request(m: Local, table: int, cells: int, **extra: object) -> dict:
    return {"name": "a", "save_id": "5" * 32, "version": m.map.version, "table": table, "cells": cells, **extra}


def restore_over_a_reused_chunk(m: Local) -> list[int]:
    """A saved and released; B takes A's chunks (and the frames fill with B); A restored into the same chunks
    (a new generation, bytes written to the host pool only); then A decodes on."""
    r = m.runners[0]
    a = m.generate(0, PROMPT_A, 3)  # cells [0, 20): chunks 0 and 1
    r.save_session(session_request(m, 0, 20))
    m.map.release(0)
    m.sync()
    m.generate(0, [*PROMPT_B, *PROMPT_B, *PROMPT_B, *PROMPT_B], 2)  # 22 cells: chunks 0 and 1 again
    assert m.map.entries(0)[:2] == [0, 1]
    m.map.release(0)
    table = m.map.new_table()
    assert m.map.reserve(table, 20) and m.map.entries(table)[:2] == [0, 1]
    m.sync()
    r.restore_session(session_request(m, table, 20, check=True))
    r.restore_session(session_request(m, table, 20))
    m.map.swap(table, 1)
    return a + m.decode(1, 20, a[-1], 5, sampling={1: dict(GREEDY)})


def test_a_chunk_given_to_another_owner_is_refilled_never_served_stale(local, tmp_path, monkeypatch):
    engine = {"slot_save_path": str(tmp_path / "slots")}
    (tmp_path / "slots").mkdir()
    want = local([[0, 4]]).generate(0, PROMPT_A, 8)
    m = local([[0, 4]], device_cells=4 * C, **engine)
    assert restore_over_a_reused_chunk(m) == want
    assert m.runners[0].window.stats["stale"] >= 2  # chunks 0 and 1 were found stale and filled again

    # Without the generation check, the frames still holding B's cells would be read as A's.
    monkeypatch.setattr(DeviceWindow, "resident", lambda self, chunk: self._frame_of.get(chunk))
    unchecked = local([[0, 4]], device_cells=4 * C, **engine)
    assert restore_over_a_reused_chunk(unchecked) != want


def test_the_host_pool_is_canonical_a_reattached_stage_decodes_on(model_dir, tmp_path):
    """Every written cell is in the pool file when a step ends: a runner that crashed (no clean close) is
    replaced by one that re-attaches the file and, with the coordinator's tables, continues exactly."""
    cfg = make_cfg(model_dir, [[0, 4]], device_cells=2 * C)
    ref = Local(make_cfg(model_dir, [[0, 4]]), tmp_path, tag="ref")
    want = ref.generate(0, PROMPT_A, 10)
    ref.close()
    a = Local(cfg, tmp_path)
    got = a.generate(0, PROMPT_A, 4)
    a.close(unlink=False)  # the crash: the file stays, the frames are gone
    b = Local(cfg, tmp_path)
    try:
        r = b.runners[0]
        assert r.hello()["pool"]["reattached"] is True and r.window.stats["fills"] == 0
        b.map = a.map
        r.load_snapshot(b.map.snapshot_ops())
        got += b.decode(0, len(PROMPT_A) + 4, got[-1], 6, sampling={0: dict(GREEDY)})
        assert got == want
    finally:
        b.close()


def test_a_new_coordinator_session_drops_every_frame(local):
    m = local([[0, 4]], device_cells=4 * C)
    r = m.runners[0]
    r.reset("session-1")
    m.generate(0, PROMPT_A, 2)
    assert r.window.describe()["resident"] == 2
    r.reset("session-1")  # the same session: frames stay valid
    assert r.window.describe()["resident"] == 2
    r.reset("session-2")
    assert r.window.describe()["resident"] == 0 and r.window.frame_of.tolist() == [-1] * r.kv.n_chunks + [4]


def test_frame_table_and_slot_tables_keep_their_addresses(local):
    m = local([[0, 4]], device_cells=3 * C)
    w = m.runners[0].window
    addrs = (w.frame_of.data_ptr(), w.frames.tables.data_ptr())
    m.generate(0, PROMPT_A, 2)
    m.generate(1, PROMPT_B, 2)
    assert (w.frame_of.data_ptr(), w.frames.tables.data_ptr()) == addrs
    frames = w.frame_of.tolist()
    for slot in (0, 1):
        for j, chunk in enumerate(m.map.entries(slot)):
            f = w.frames.host_tables[slot][j]
            assert f == (frames[chunk] if chunk != w.host.trash else w.frames.trash)
    assert torch.equal(w.frames.tables[0], torch.tensor(w.frames.host_tables[0], dtype=torch.int32))


def test_frames_hold_exactly_the_host_cells(local):
    """After each step every valid frame equals its chunk in the host pool, byte for byte (int8 too)."""
    m = local([[0, 2], [2, 4]], device_cells=3 * C, kv_dtype="int8")
    for slot, ids in ((0, PROMPT_A), (1, PROMPT_B), (2, prompt(30, seed=5))):
        m.generate(slot, ids, 3)
        for r in m.runners:
            w = r.window
            for chunk, f in w._frame_of.items():
                for frame_arr, host_arr in zip(w.frames.arrays(), w.host.arrays()):
                    assert torch.equal(frame_arr[f], host_arr[chunk])


def test_window_sizes_from_device_cells(local):
    assert local([[0, 4]]).runners[0].window is None  # CPU: off by default
    assert local([[0, 4]], device_cells=0).runners[0].window is None
    assert local([[0, 4]], device_cells=C + 1).runners[0].window.n_frames == 2  # whole chunks, rounded up
    assert local([[0, 4]], device_cells=10**6).runners[0].window.n_frames == 12  # at most the pool


def split_matches_paged(device: str, kv_dtype: torch.dtype = torch.float32) -> None:
    """A decode and a prefill piece read in two pieces, merged, equal one read of the whole context."""
    gen = torch.Generator().manual_seed(0)
    kv = KVCache(1, 8, 16, 2, 32, kv_dtype, device, n_slots=2, table_chunks=4)
    kv.set_table(0, [3, 1, 6, 8])
    kv.set_table(1, [0, 5, 8, 8])
    batch = StepBatch.from_slots([[0, 40, 1, 1], [1, 20, 8, 1]], device)
    for ctx_slot, ctx in ((0, 40), (1, 20)):  # the cells before the step's
        old = StepBatch.from_slots([[ctx_slot, 0, ctx, 0]], device)
        write_kv(kv, 0, old, *(torch.randn(ctx, 2, 32, generator=gen).to(device) for _ in range(2)))
    k, v, q = (torch.randn(batch.num_tokens, h, 32, generator=gen).to(device) for h in (2, 2, 4))
    write_kv(kv, 0, batch, k, v)
    for window in (None, 12):
        want = paged_attention(q, kv, 0, batch, 32 ** -0.5, window)
        first = Piece([list(range(3 * 16, 4 * 16)), list(range(0, 16))], [list(range(16)), list(range(16))])
        second = Piece([[*range(16, 32), *range(6 * 16, 6 * 16 + 9)], list(range(5 * 16, 5 * 16 + 12))],
                       [list(range(16, 41)), list(range(16, 28))])
        p = merge(None, partial_attention(q, kv, 0, batch, first, 32 ** -0.5, window))
        p = merge(p, partial_attention(q, kv, 0, batch, second, 32 ** -0.5, window))
        torch.testing.assert_close(finish(p, batch, q.dtype), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=["float32", "int8"])
def test_split_attention_merges_pieces_exactly(kv_dtype):
    split_matches_paged("cpu", kv_dtype)
