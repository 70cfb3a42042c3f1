"""Prefix sharing in the scheduler (coordinator/prefix_sharing.py) on the real chunk map, against CellLink: it
keeps token ids in cells through the tables, derives every "sampled" token from the ids it reads back, and
refuses a step that would write into a chunk two tables hold (the stage's check). A shared chunk holding the
wrong ids, or a write into one, changes the tokens, so every answer is compared with a solo run.

Geometry (make_cfg): chunks of 16 cells, 4 slots; a 40-token system prompt is two full chunks and a half.
"""
from __future__ import annotations

import asyncio

import pytest

from coordinator.engine import EngineError, TokenEvent
from tests.accounting import assert_pool_accounted
from tests.coordinator.test_scheduler import make_cfg, req, run, solo, started

SYSTEM = list(range(500, 540))  # 40 tokens: chunks [0, 16) and [16, 32) full, [32, 40) in a third
A = SYSTEM + list(range(600, 610))  # 50 tokens
B = SYSTEM + list(range(700, 712))  # 52 tokens


async def test_a_second_conversation_on_a_held_system_prompt_shares_its_full_chunks():
    cfg = make_cfg(True)
    sched, _ = await started(cfg)
    out_a, fin_a = await run(sched, req(A))
    assert fin_a.cached_tokens == 0 and sched.map.entries(0)[:4] == [0, 1, 2, 3]
    out_b, fin_b = await run(sched, req(B))
    assert fin_b.cached_tokens == 32  # the two full chunks; the partial third is read again
    assert out_b == (await solo(cfg, B))[0]
    assert sched.map.entries(1)[:5] == [0, 1, 4, 5, sched.map.trash]  # its own chunks start at entry 2
    assert [sched.map.refs(c) for c in range(6)] == [2, 2, 1, 1, 1, 1]
    assert (sched.map.shared_cells, sched.map.saved_cells) == (32, 32)
    assert sched.cache.counters["shares"] == 1
    assert sched.map.free_cells == 1024 - 6 * 16  # six distinct chunks held, the shared two once
    assert sorted(len(c.tokens) for c in sched.held.values()) == [len(A) + 11, len(B) + 11]  # both whole
    turn = A + out_a + [5]
    out2, fin2 = await run(sched, req(turn))  # A's next turn: a continuation, served from its own table
    assert fin2.cached_tokens == len(A) + 11 and out2 == (await solo(cfg, turn))[0]
    assert sched.cache.counters["shares"] == 1
    assert_pool_accounted(sched)
    await sched.stop()


async def test_a_running_conversation_shares_the_cells_its_steps_have_written():
    cfg = make_cfg(True)
    sched, _ = await started(cfg, delay=0.005)
    first = sched.generate(req(A, 30, rid="a"))
    got_a = []
    async for ev in first:
        got_a.append(ev.token)
        if len(got_a) == 3:
            break
    assert sched.jobs[0] is not None and sched.jobs[0].fed >= len(A)  # still running, its prompt written

    async def rest() -> None:
        async for ev in first:
            if isinstance(ev, TokenEvent):
                got_a.append(ev.token)

    out_b, fin_b = (await asyncio.gather(rest(), run(sched, req(B, rid="b"))))[1]
    assert fin_b.cached_tokens == 32
    assert out_b == (await solo(cfg, B))[0]
    assert got_a == (await solo(cfg, A, 30))[0]
    assert_pool_accounted(sched)
    await sched.stop()


async def test_with_sharing_off_the_second_conversation_takes_the_first_over():
    cfg = make_cfg(True, share_prefixes=False)
    sched, _ = await started(cfg)
    await run(sched, req(A))
    out_b, fin_b = await run(sched, req(B))
    assert fin_b.cached_tokens == 40  # worth_taking: the whole system prompt, by a move
    assert out_b == (await solo(cfg, B))[0]
    assert [len(c.tokens) for c in sched.held.values()] == [len(B) + 11]  # A was cut to its system prompt
    assert (sched.map.shared_cells, sched.cache.counters["shares"]) == (0, 0)
    assert_pool_accounted(sched)
    await sched.stop()


async def test_the_baseline_never_shares():
    cfg = make_cfg(False)
    sched, _ = await started(cfg)
    await run(sched, req(A))
    out_b, fin_b = await run(sched, req(B))
    assert fin_b.cached_tokens == 40 and out_b == (await solo(cfg, B))[0]
    assert not sched.sharing and sched.map.saved_cells == 0
    assert sched.cache.counters["shares"] == 0
    assert_pool_accounted(sched)
    await sched.stop()


async def test_chunks_only_held_conversations_share_are_evicted_together():
    # 10 chunks of 16: A holds 4, B shares A's first 2 and holds 2 of its own; 4 are free.
    cfg = make_cfg(True, max_context=160, kv_pool_tokens=160)
    sched, _ = await started(cfg)
    await run(sched, req(A))
    await run(sched, req(B))
    assert sched.map.free_chunks == 4 and sched.map.saved_cells == 32
    c = list(range(800, 940))  # 140 tokens: 9 chunks; A's and B's own cells (2 + 2) do not cover the 5 missing
    out_c, fin_c = await run(sched, req(c))
    assert fin_c.cached_tokens == 0 and not fin_c.truncated
    assert out_c == (await solo(cfg, c))[0]
    assert sched.cache.counters["evictions"] == 2 and list(sched.held) == [2]
    assert_pool_accounted(sched)
    await sched.stop()


async def test_a_refused_request_lets_go_of_its_shared_run():
    cfg = make_cfg(True, max_context=160, kv_pool_tokens=160)
    sched, _ = await started(cfg, delay=0.01)
    await run(sched, req(A))  # slot 0 holds A: 4 chunks
    other = sched.generate(req(list(range(900, 960)), 20, rid="e"))  # 60 tokens, running in slot 1
    await other.__anext__()
    d = SYSTEM + list(range(300, 408))  # 148 tokens: the 2 shared chunks + 8 more, which cannot be had
    with pytest.raises(EngineError) as err:
        await run(sched, req(d, 12, rid="d"))
    assert err.value.code == "kv_pool_full"
    assert [sched.map.refs(c) for c in range(2)] == [1, 1] and sched.map.saved_cells == 0
    assert len(sched.held[0].tokens) == len(A) + 11  # A is whole (evicting it would not have covered it)
    async for _ in other:
        pass
    assert_pool_accounted(sched)
    await sched.stop()


async def test_a_branch_inside_a_shared_chunk_starts_cold_and_cuts_nobody():
    """A prompt sharing 10 tokens with held conversations whose first chunk two tables hold: a move would have
    to drop that chunk (it is never kept in part), so it would keep nothing and only cut a conversation."""
    cfg = make_cfg(True)
    sched, _ = await started(cfg)
    await run(sched, req(A))
    await run(sched, req(B))
    p = SYSTEM[:10] + [1]
    out, fin = await run(sched, req(p))
    assert fin.cached_tokens == 0 and out == (await solo(cfg, p))[0]
    assert sorted(len(c.tokens) for c in sched.held.values()) == [len(p) + 11, len(A) + 11, len(B) + 11]
    assert_pool_accounted(sched)
    await sched.stop()


async def test_a_turn_that_rewrites_the_last_token_moves_and_a_branch_shares():
    """A held conversation of 61 tokens (three full chunks and 13 cells). A next turn that renders its last
    token otherwise cuts 1 token to keep 12 cells more than the shared run: it moves (cached 60). A branch 8
    tokens into the answer would cut 8 to keep 5 more: it shares the three full chunks and leaves A whole."""
    cfg = make_cfg(True)
    sched, _ = await started(cfg)
    out_a, _ = await run(sched, req(A))
    held = A + out_a[:-1]  # the last sampled token was never fed
    assert sched.held[0].tokens == held and len(held) == 61
    branch = held[:53] + [7]
    out_b, fin_b = await run(sched, req(branch))
    assert fin_b.cached_tokens == 48 and out_b == (await solo(cfg, branch))[0]
    assert sorted(len(c.tokens) for c in sched.held.values()) == [61, len(branch) + 11]  # A is whole
    turn = held[:60] + [5, 6]
    out_t, fin_t = await run(sched, req(turn))
    assert fin_t.cached_tokens == 60 and out_t == (await solo(cfg, turn))[0]
    assert sched.cache.counters["shares"] == 1  # the branch's; the turn moved
    assert_pool_accounted(sched)
    await sched.stop()
