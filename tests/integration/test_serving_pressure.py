"""The serving path under pressure, end to end (`strata up`, two CPU stages, the official clients).

Two boxes, each started once for the module:
- `pressure`, like the seeds' pressure run scaled down: 4 slots, max_context 512, a pool of 768 cells in
  chunks of 16 (48 chunks), prompts of ~300 tokens (19 chunks each): two such conversations fill the pool
  when they grow, so a third prompt is refused and a decode runs out of room;
- `narrow`: 2 slots and at most 2 waiting requests, for the queue and for conversations that move
  between slots; once with the shared pool and once without it (the baseline, where a move copies bytes).

A refusal happens before the first token, so even a streamed request gets it as an HTTP 503 (the front waits
for the engine's first event before it answers); an error after the stream began is an event inside the
stream, checked here by killing a stage while two streams run.
"""
from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import os
import signal
import threading
import time
from typing import Any, Callable

import anthropic
import openai
import pytest

from tests.integration.conftest import oracle_chat_ids, oracle_decode, oracle_encode, oracle_greedy

GREEDY_A = {"temperature": 0}  # this anthropic client takes sampling keys only as extra body
RETRY_AFTER = "10"
WORDS = ("river stone mill wheel key bottle cart summer village evening children water green door bread "
         "lamp field road winter bridge").split()


@pytest.fixture(scope="module")
def pressure(strata_up):
    return strata_up(parallel=4, max_context=512, kv_pool_tokens=768, chunk_cells=16, prefill_chunk=64)


@pytest.fixture(scope="module", params=["pool", "baseline"])
def narrow(request, strata_up):
    """Two slots, two places in the queue; with the shared pool, and without it (moves copy bytes)."""
    server = strata_up(parallel=2, max_context=1024, kv_pool_tokens=4096 if request.param == "pool" else 0,
                       chunk_cells=16, prefill_chunk=64, max_waiting=2)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def clean(request):
    yield
    for name in ("pressure", "narrow"):
        if name in request.fixturenames:
            request.getfixturevalue(name).check_clean()


def text_of(server, n_tokens: int, seed: int) -> str:
    """A user text of about `n_tokens` tokens; different seeds share no first word."""
    words = [WORDS[(seed + i * (seed + 3) + i * i) % len(WORDS)] for i in range(2 * n_tokens)]
    words[0] = f"{seed}"
    ids = oracle_encode(server.data["model"], " ".join(words))[:n_tokens]
    return oracle_decode(server.data["model"], ids)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def counters(server) -> dict:
    c = server.live()["counters"]
    return {"refused": c["refusals"].get("kv_pool_full", 0), "queue_full": c["refusals"].get("queue_full", 0),
            "truncations": c["truncations"], "evictions": c["evictions"], "moves": c["moves"]}


def assert_openai_refusal(err: openai.APIStatusError, code: str) -> None:
    assert err.status_code == 503 and err.response.headers["retry-after"] == RETRY_AFTER
    body = err.response.json()["error"]
    assert (body["code"], body["type"], body["param"]) == (code, "server_error", None) and body["message"]


def assert_anthropic_refusal(err: anthropic.APIStatusError, code: str) -> None:
    assert err.status_code == 503 and err.response.headers["retry-after"] == RETRY_AFTER
    body = err.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
    assert body["error"]["message"].startswith(f"{code}: ")


def refusals(server, messages: list[dict], max_tokens: int, code: str) -> list[Callable[[], None]]:
    """One call per route and mode that must be refused with `code`; each checks the exact shape."""
    oa, an, model = server.openai(), server.anthropic(), server.model
    prompt_ids = oracle_chat_ids(server.data["model"], messages)

    def via_openai(call: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            with pytest.raises(openai.InternalServerError) as err:
                call()
            assert_openai_refusal(err.value, code)
        return run

    def via_anthropic(call: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            with pytest.raises(anthropic.InternalServerError) as err:
                call()
            assert_anthropic_refusal(err.value, code)
        return run

    chat = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    comp = dict(model=model, prompt=prompt_ids, max_tokens=max_tokens, temperature=0)
    msgs = dict(model="m", messages=messages, max_tokens=max_tokens, extra_body=GREEDY_A)
    return [
        via_openai(lambda: oa.chat.completions.create(**chat)),
        via_openai(lambda: oa.chat.completions.create(**chat, stream=True)),
        via_openai(lambda: oa.completions.create(**comp)),
        via_openai(lambda: oa.completions.create(**comp, stream=True)),
        via_anthropic(lambda: an.messages.create(**msgs)),
        via_anthropic(lambda: an.messages.create(**msgs, stream=True)),
    ]


# ---- runners: one streamed request read to its end, telling when its first chunk came ---------------------
def openai_chat_stream(server, messages: list[dict], max_tokens: int, first: threading.Event) -> dict:
    out: dict = {"tokens": []}
    for c in server.openai().chat.completions.create(model=server.model, messages=messages, max_tokens=max_tokens,
                                                     temperature=0, stream=True, logprobs=True,
                                                     stream_options={"include_usage": True}):
        first.set()
        if not c.choices:
            out["completion"] = c.usage.completion_tokens
            continue
        ch = c.choices[0]
        if ch.logprobs:
            out["tokens"] += [t.token for t in ch.logprobs.content]
        if ch.finish_reason:
            out["finish"], out["truncated"] = ch.finish_reason, (ch.model_extra or {})["truncated"]
    return out


def anthropic_stream(server, messages: list[dict], max_tokens: int, first: threading.Event) -> dict:
    with server.anthropic().messages.stream(model="m", messages=messages, max_tokens=max_tokens,
                                            extra_body=GREEDY_A) as s:
        for _ in s:
            first.set()
        final = s.get_final_message()
    text = "".join(b.text for b in final.content)
    return {"text": text, "finish": final.stop_reason, "completion": final.usage.output_tokens,
            "truncated": final.stop_reason == "max_tokens" and final.usage.output_tokens < max_tokens}


def solo(server, family: str, messages: list[dict], max_tokens: int) -> dict:
    """The same request alone on an empty pool."""
    server.erase_all()
    runner = openai_chat_stream if family == "openai" else anthropic_stream
    return runner(server, messages, max_tokens, threading.Event())


def same_start(part: dict, whole: dict) -> bool:
    if "tokens" in part:
        return part["tokens"] == whole["tokens"][: len(part["tokens"])]
    return whole["text"].startswith(part["text"].rstrip("\ufffd"))  # a cut may end inside a character


# ---- the pool full ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["openai", "anthropic"])
def test_full_pool_refuses_every_route_and_truncates_a_decode(pressure, family):
    runner = openai_chat_stream if family == "openai" else anthropic_stream
    long = [user(text_of(pressure, n, seed)) for n, seed in ((290, 1), (280, 2))]
    sizes = [len(oracle_chat_ids(pressure.data["model"], m)) for m in long]
    assert all(280 <= n <= 304 for n in sizes), sizes  # 18-19 chunks each, 10 or more chunks left free
    limits = [512 - n for n in sizes]  # each may reach max_context: together they need more than the pool
    big = user(text_of(pressure, 470, 3))  # ~30 chunks: more than the pool minus any running prompt
    assert 30 * 16 - 16 < len(oracle_chat_ids(pressure.data["model"], big)) <= 512 - 8
    before = counters(pressure)
    firsts = [threading.Event(), threading.Event()]
    with cf.ThreadPoolExecutor(8) as pool:
        running = [pool.submit(runner, pressure, m, n, f) for m, n, f in zip(long, limits, firsts)]
        assert all(f.wait(60) for f in firsts)
        # Both decode now: whatever is free or idle is smaller than `big` as long as one of them runs.
        calls = refusals(pressure, big, 8, "kv_pool_full")
        for fut in [pool.submit(call) for call in calls]:
            fut.result()
        assert not all(r.done() for r in running), "the runners ended before the refusals were checked"
        results = [r.result() for r in running]
    after = counters(pressure)
    assert after["refused"] - before["refused"] == len(calls)
    cut = [r for r in results if r["truncated"]]
    assert len(cut) == 1 == after["truncations"] - before["truncations"]
    assert after["evictions"] > before["evictions"]  # the other one grew into the cut conversation's cells
    for r, limit in zip(results, limits):
        assert "tokens" not in r or len(r["tokens"]) == r["completion"]  # usage counts the tokens streamed
        if r["truncated"]:
            assert r["finish"] == ("length" if family == "openai" else "max_tokens") and r["completion"] < limit
        else:
            assert r["finish"] in (("length", "stop") if family == "openai" else ("max_tokens", "end_turn"))
            assert r["completion"] == limit or r["finish"] in ("stop", "end_turn")
    for r, m, limit in zip(results, long, limits):  # nothing the pressure did changed what they read
        alone = solo(pressure, family, m, limit)
        assert same_start(r, alone) if r["truncated"] else r == alone


def test_a_burst_like_the_seeds_is_answered_or_refused_with_the_exact_shape(pressure):
    prompts = [user(text_of(pressure, 290 - 4 * i, 10 + i)) for i in range(4)]
    oa, an = pressure.openai(), pressure.anthropic()
    before = counters(pressure)

    def chat(m, stream):
        if not stream:
            r = oa.chat.completions.create(model=pressure.model, messages=m, max_tokens=150, temperature=0)
            return "openai", r.choices[0].finish_reason, r.choices[0].model_extra["truncated"], r.usage.completion_tokens
        out = openai_chat_stream(pressure, m, 150, threading.Event())
        return "openai", out["finish"], out["truncated"], out["completion"]

    def messages(m, stream):
        if not stream:
            r = an.messages.create(model="m", messages=m, max_tokens=150, extra_body=GREEDY_A)
            return "anthropic", r.stop_reason, r.stop_reason == "max_tokens" and r.usage.output_tokens < 150, \
                r.usage.output_tokens
        out = anthropic_stream(pressure, m, 150, threading.Event())
        return "anthropic", out["finish"], out["truncated"], out["completion"]

    def one(i: int):
        call = (chat, messages)[i % 2]
        try:
            return call(prompts[i], i >= 2)
        except openai.InternalServerError as err:
            assert_openai_refusal(err, "kv_pool_full")
            return "openai", "refused", False, 0
        except anthropic.InternalServerError as err:
            assert_anthropic_refusal(err, "kv_pool_full")
            return "anthropic", "refused", False, 0

    with cf.ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(one, range(4)))
    refused = [o for o in outcomes if o[1] == "refused"]
    answered = [o for o in outcomes if o[1] != "refused"]
    assert refused and answered, outcomes  # three prompts never fit at once; the first always does
    for family, finish, cut, n in answered:
        if cut:
            assert finish == ("length" if family == "openai" else "max_tokens") and n < 150
        else:
            assert n == 150 or finish in ("stop", "end_turn")
    after = counters(pressure)
    assert after["refused"] - before["refused"] == len(refused)
    assert after["truncations"] - before["truncations"] == sum(o[2] for o in answered)


def test_an_error_after_the_stream_began_is_an_event_carrying_its_code(pressure):
    oa, an = pressure.openai(), pressure.anthropic()
    probe = dict(model=pressure.model, prompt=[70 + k for k in range(30)], max_tokens=12, temperature=0)
    before = oa.completions.create(**probe).choices[0].text
    chat = oa.chat.completions.create(model=pressure.model, messages=user("Tell me about the mill."),
                                      max_tokens=480, temperature=0, stream=True)
    events = an.messages.create(model="m", messages=user("Tell me about the bridge."), max_tokens=480,
                                extra_body=GREEDY_A, stream=True)
    assert next(chat).choices[0].delta.role == "assistant"
    assert next(iter(events)).type == "message_start"
    os.kill(pressure.stage_pid(1), signal.SIGKILL)
    with pytest.raises(openai.APIError) as err:
        for _ in chat:
            pass
    assert err.value.body["code"] == "stage_down" and err.value.body["type"] == "server_error"
    with pytest.raises(anthropic.APIStatusError) as err2:
        for _ in events:
            pass
    assert err2.value.body["type"] == "error" and err2.value.body["error"]["type"] == "api_error"
    assert err2.value.body["error"]["message"].startswith("stage_down: ")
    pressure.wait_healthy(90)  # `strata up` restarts the stage; the coordinator takes it back
    again = oa.completions.create(**probe)  # the probe's idle conversation survived in the re-attached pool:
    # asked again, the prompt shares its full chunks (the held answer stays whole) and reads the rest
    assert again.usage.prompt_tokens_details.cached_tokens == (len(probe["prompt"]) - 1) // 16 * 16 > 0
    assert again.choices[0].text == before


# ---- the queue --------------------------------------------------------------------------------------------
def test_a_full_queue_is_refused_and_clients_that_leave_free_their_places(narrow):
    oa = narrow.openai()
    streams = [oa.chat.completions.create(model=narrow.model, messages=user(f"Story number {i}."), max_tokens=1000,
                                          temperature=0, stream=True) for i in range(2)]
    for s in streams:
        next(s)
    body = {"model": narrow.model, "prompt": [150 + k for k in range(12)], "max_tokens": 6, "temperature": 0}
    leaver = http.client.HTTPConnection("127.0.0.1", narrow.port, timeout=30)  # a raw client, to leave at will
    with cf.ThreadPoolExecutor(1) as pool:
        queued = pool.submit(oa.completions.create, **{**body, "prompt": [100 + k for k in range(12)]})
        leaver.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        wait_for(lambda: narrow.live()["waiting"] == 2, "two requests waiting")
        before = counters(narrow)
        calls = refusals(narrow, user("One more, please."), 8, "queue_full")
        for call in calls:
            call()
        assert counters(narrow)["queue_full"] - before["queue_full"] == len(calls)
        leaver.close()  # a waiting client that leaves gives its place back at once
        wait_for(lambda: narrow.live()["waiting"] == 1, "the leaver's place freed", timeout=2)
        assert all(s["is_processing"] for s in narrow.slots()) and not queued.done()
        t0 = time.monotonic()
        streams[0].close()  # a running client that leaves hands its slot to the waiting request
        answer = queued.result(timeout=30)
        assert time.monotonic() - t0 < 5 and answer.usage.completion_tokens == 6
        streams[1].close()


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.01)


# ---- conversations that move -------------------------------------------------------------------------------
def test_a_moved_conversation_is_reused_only_by_its_own_next_turn(narrow):
    """Conversations A and B share a first part. With two slots, an unrelated request parks one of them; its
    next turn moves it into the other's slot (which parks that one), and the other's next turn moves it into the
    first one's old slot. Every turn must read what its own table holds: each answer equals a cold run's, and
    each reports the cached prefix of its own conversation. A match not bound to its conversation (a stale
    table, bytes left behind by a move) would change these answers."""
    model_dir, oa = narrow.data["model"], narrow.openai()
    shared = [200 + (k * 5) % 150 for k in range(40)]
    firsts = {"A": shared + [11 + k for k in range(10)], "B": shared + [60 + k for k in range(14)]}

    def ask(prompt: list[int], max_tokens: int = 16) -> tuple:
        r = oa.completions.create(model=narrow.model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  logprobs=1)
        c = r.choices[0]
        return c.text, c.logprobs.tokens, c.logprobs.token_logprobs, r.usage.prompt_tokens_details.cached_tokens

    def slot_holding(n_tokens: set[int]) -> int:
        (slot,) = [s["slot"] for s in narrow.live()["kv_pool"]["slots"] if s["tokens"] in n_tokens]
        return slot

    before = counters(narrow)
    with cf.ThreadPoolExecutor(2) as pool:  # together, so neither reuses the other's shared part
        warm = dict(zip(firsts, pool.map(lambda p: ask(p, 120), firsts.values())))
    assert [w[3] for w in warm.values()] == [0, 0]
    conversations = {}
    for name, prompt in firsts.items():
        tokens, ended = oracle_greedy(model_dir, prompt, 120)
        assert warm[name][0] == oracle_decode(model_dir, tokens)
        conversations[name] = prompt + tokens + ([511] if ended else [])
    home = {name: slot_holding({len(c) - 1}) for name, c in conversations.items()}
    ask([3, 1, 4, 1, 5, 9, 2, 6], 4)  # unrelated: takes the least recently used slot, parking its conversation
    (parked,) = narrow.live()["kv_pool"]["parked"]
    first = next(n for n, c in conversations.items() if parked["tokens"] == len(c) - 1)
    other = "B" if first == "A" else "A"
    turns = {first: conversations[first] + [7, 7, 7], other: conversations[other] + [8, 8, 8, 8]}
    for name, moved_to in ((first, home[other]), (other, home[first])):
        warm[name] = ask(turns[name])
        assert warm[name][3] == len(conversations[name]) - 1, name
        n = len(turns[name]) + len(warm[name][1])
        assert slot_holding({n - 1, n}) == moved_to, name  # it came back into the other slot
    assert counters(narrow)["moves"] - before["moves"] == 3  # a park and two admissions by move
    branch = shared + [99, 98, 97]  # a new conversation: only the shared part can be reused, from one table
    warm["branch"] = ask(branch)
    # with the pool, its full chunks are shared and A and B stay whole; without it, a move takes one over
    assert warm["branch"][3] == (len(shared) // 16 * 16 if narrow.cfg.engine.pool_on else len(shared))
    for name, prompt in list(turns.items()) + [("branch", branch)]:
        narrow.erase_all()
        cold = ask(prompt)
        assert cold[3] == 0
        assert cold[:2] == warm[name][:2], name
        assert cold[2] == pytest.approx(warm[name][2], abs=1e-4)


def test_chat_conversations_taking_turns_keep_their_own_cache(narrow):
    """Three chat users on two slots, turn by turn. Every chat prompt starts with the same template tokens, so a
    new conversation shares a few tokens with every held one; that must not make it take over (and cut short)
    another user's conversation: it takes an idle slot, parking the least recently used conversation, and each
    user's next turn reuses everything its own conversation holds."""
    model_dir, oa = narrow.data["model"], narrow.openai()
    users = {name: [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{name}, tell me a tale."}]
             for name in ("Ann", "Bob", "Cy")}
    held, firsts = {}, {}
    for name, messages in users.items():
        r = oa.chat.completions.create(model=narrow.model, messages=messages, max_tokens=12, temperature=0)
        prompt = oracle_chat_ids(model_dir, messages)
        # with the pool, the template's first full chunks are shared from an earlier user; nobody is taken over
        common = max((next(i for i, (a, b) in enumerate(zip(prompt, h)) if a != b) for h in held.values()), default=0)
        shared = common // 16 * 16 if narrow.cfg.engine.pool_on else 0
        assert r.usage.prompt_tokens_details.cached_tokens == shared, name
        tokens, ended = oracle_greedy(model_dir, prompt, 12)
        held[name] = prompt + (tokens if ended else tokens[:-1])
        firsts[name] = len(prompt)
        users[name] = messages + [{"role": "assistant", "content": r.choices[0].message.content},
                                  {"role": "user", "content": "Go on."}]
    for name, messages in users.items():
        r = oa.chat.completions.create(model=narrow.model, messages=messages, max_tokens=4, temperature=0)
        turn = oracle_chat_ids(model_dir, messages)
        shared = next(i for i, (a, b) in enumerate(zip(turn + [-1], held[name] + [-2])) if a != b)
        assert r.usage.prompt_tokens_details.cached_tokens == shared >= firsts[name], name  # its own first turn
