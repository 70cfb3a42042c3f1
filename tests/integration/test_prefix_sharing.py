"""Prefix sharing through real stage processes (two CPU stages, the tiny model).

- The stage's own check: a step that would write into a chunk two tables hold is refused with a step error and
  writes nothing; a step reading the shared chunks gives the tokens of a table that wrote them itself.
- The whole box (`strata up`): a second chat conversation on the same long system prompt, while the first is
  held and while it is still running, reads only what follows the shared full chunks (`cached_tokens`), and
  answers token for token what it answers alone and what transformers computes. Metrics report the shared
  cells in both views. A session file of a conversation that shares chunks restores into chunks of its own.
  After each test every conversation is erased and every cell is free again.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from coordinator.link import StepFailed
from tests.integration.conftest import GREEDY, oracle_chat_ids, oracle_decode, oracle_greedy

PREFIX = [(7 + 13 * k) % 400 + 5 for k in range(32)]  # two full chunks of 16


@pytest.mark.parametrize("window", [{}, {"device_cells": 32}], ids=["pool", "window"])
def test_a_stage_refuses_a_write_into_a_shared_chunk_and_reads_it_like_its_writer(box, window):
    """`window`: the stages read the pool through a device window of 2 frames (stages/window.py)."""
    b = box(2, **window)
    b.start_all()

    async def scenario() -> None:
        link = b.link()
        await link.start(timeout=60)
        try:
            d = b.driver(link)
            first = await d.generate(0, PREFIX, 2)  # slot 0 writes cells [0, 34): chunks 0, 1 full, 2 partial
            d.map.publish(0, PREFIX + first[:2])
            run = d.map.lookup(PREFIX + [first[0]], limit=2)
            assert run == d.map.entries(0)[:2] == [0, 1]
            d.map.share(1, run)
            with pytest.raises(StepFailed, match=r"slot 1 would write cells \[30, 32\) into chunk 1, which 2 "
                                                 r"tables hold; a shared chunk is read-only"):
                await d.step([[1, 30, 3, 1]], [9, 9, 9], {1: dict(GREEDY)})
            # Slot 1 reads the shared chunks (untouched by the refused step) and writes from cell 32 on: slot 0's
            # next tokens, as slot 0 got them.
            assert await d.generate(1, first[:1], 1, start=32) == first[1:3]
        finally:
            link.close()

    asyncio.run(scenario())


# ---- the whole box ---------------------------------------------------------------------------------------
SYSTEM = ("You are the keeper of the old mill by the river. You answer questions about the mill, the wheel, "
          "the stones and the village in one short line, and you never mention the weather.")


def chat(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


@pytest.fixture(scope="module")
def server(strata_up):
    return strata_up(max_context=512, kv_pool_tokens=2048, chunk_cells=16, prefill_chunk=64)


@pytest.fixture(autouse=True)
def clean(request):
    yield
    for name in ("server", "saving"):
        if name in request.fixturenames:
            request.getfixturevalue(name).check_clean()


def shared_cells(model_dir: str, a: list[int], b: list[int], chunk: int = 16) -> int:
    """The full chunks prompt `b` can map from a table holding `a`: whole chunks of their common prefix, with
    at least the last prompt token left to read."""
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return min(common, len(b) - 1) // chunk * chunk


def ask(server, messages: list[dict], max_tokens: int = 16) -> tuple[str, list[str], int]:
    r = server.openai().chat.completions.create(model=server.model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, logprobs=True)
    c = r.choices[0]
    return c.message.content, [t.token for t in c.logprobs.content], r.usage.prompt_tokens_details.cached_tokens


def test_a_second_conversation_on_a_held_system_prompt_reads_only_the_rest(server):
    model_dir = server.data["model"]
    first, second = chat(SYSTEM, "Who built the wheel?"), chat(SYSTEM, "How old are the stones?")
    ids_a, ids_b = oracle_chat_ids(model_dir, first), oracle_chat_ids(model_dir, second)
    share = shared_cells(model_dir, ids_a, ids_b)
    assert share >= 32, "the system prompt no longer spans two full chunks"
    hits = server.metrics_json()["requests"]["prefix_cache_hits"]
    a = ask(server, first)
    assert a[2] == 0
    b = ask(server, second)
    assert b[2] == share
    tokens, _ = oracle_greedy(model_dir, ids_b, 16)
    assert b[0] == oracle_decode(model_dir, tokens)
    pool = server.live()["kv_pool"]
    assert pool["share_prefixes"] is True and pool["shared"] == pool["saved"] == share
    held = sorted(s["tokens"] for s in pool["slots"] if s["state"] == "held")
    assert len(held) == 2  # the first conversation was not cut: both are held, whole
    assert sum(s["cells"] for s in pool["slots"]) + pool["free"] == pool["cells"] + pool["saved"]
    text = server.http.get("/metrics").text
    assert f"strata:kv_pool_shared_cells {float(share)}" in text
    assert f"strata:kv_pool_saved_cells {float(share)}" in text
    assert server.metrics_json()["requests"]["prefix_cache_hits"] == hits + share
    server.erase_all()
    assert ask(server, second) == (b[0], b[1], 0)  # alone and cold: token for token the same


def test_a_second_conversation_shares_while_the_first_is_still_running(server):
    model_dir = server.data["model"]
    first, second = chat(SYSTEM, "Tell me the whole story of the mill."), chat(SYSTEM, "Where is the key?")
    share = shared_cells(model_dir, oracle_chat_ids(model_dir, first), oracle_chat_ids(model_dir, second))
    alone = ask(server, second)
    server.erase_all()
    stream = server.openai().chat.completions.create(model=server.model, messages=first, max_tokens=360,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(stream)
    assert next(stream).choices  # the first is decoding: its prompt's cells are written
    b = ask(server, second)
    busy = [s for s in server.slots() if s["is_processing"]]
    assert len(busy) == 1, "the first conversation ended before the second was admitted"
    stream.close()
    assert b[2] == share and b[:2] == alone[:2]
    deadline = time.monotonic() + 10
    while any(s["is_processing"] for s in server.slots()):
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.fixture(scope="module")
def saving(strata_up, tmp_path_factory):
    return strata_up(max_context=512, kv_pool_tokens=2048, chunk_cells=16, prefill_chunk=64,
                     slot_save_path=str(tmp_path_factory.mktemp("saves")))


def completion(server, prompt: list[int]) -> tuple[str, list[str], int]:
    r = server.openai().completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0,
                                           logprobs=1)
    c = r.choices[0]
    return c.text, c.logprobs.tokens, r.usage.prompt_tokens_details.cached_tokens


def test_a_saved_conversation_that_shares_chunks_restores_into_chunks_of_its_own(saving):
    """Slot 1's conversation maps slot 0's full chunks; its session file is read through its table, so it holds
    the shared cells too. Restored after an erase, its table holds chunks of its own, and a new request on its
    prompt shares them and answers as a cold run does."""
    base = [(11 + 7 * k) % 450 + 5 for k in range(40)]
    a, b = base + [300, 301, 302], base + [400, 401, 402, 403, 404]
    assert completion(saving, a)[2] == 0
    warm = completion(saving, b)
    assert warm[2] == 32
    assert saving.live()["kv_pool"]["saved"] == 32
    r = saving.http.post("/slots/1", params={"action": "save"}, json={"filename": "b"})
    assert r.status_code == 200 and r.json()["n_saved"] == len(b) + 7, r.text
    saving.erase_all()
    r = saving.http.post("/slots/1", params={"action": "restore"}, json={"filename": "b"})
    assert r.status_code == 200 and r.json()["n_restored"] == len(b) + 7, r.text
    pool = saving.live()["kv_pool"]
    assert pool["saved"] == 0 and pool["cells"] - pool["free"] == 4 * 16  # 52 cells in 4 chunks of its own
    again = completion(saving, b)  # a branch inside the restored conversation: its full chunks are shared
    assert again[2] == (len(b) - 1) // 16 * 16 == 32 and saving.live()["kv_pool"]["saved"] == 32
    assert again[:2] == warm[:2]
    saving.erase_all()
    assert completion(saving, b)[:2] == warm[:2]  # and cold
    saving.http.post("/slots", params={"action": "erase"})
