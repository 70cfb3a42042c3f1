"""The coordinator killed while a request streams: the stages stay up, a new coordinator re-handshakes them
(a new session: each stage resets its tables and zeroes its generations), starts from an empty pool, and serves
the same tokens a cold run gave before; its own conversation cache works from there."""
from __future__ import annotations

import re
import threading

import httpx
import openai

A = [{"role": "user", "content": "Tell me about the shared pool of chunks."}]
HOLD = [{"role": "user", "content": "Write a long answer, this one is in flight."}]


def sessions(log: str) -> list[tuple[str, str, str]]:
    """(session, previous, nonzero generations) of every new session a stage saw."""
    return re.findall(r"event=stage\.session stage=\d session=(\S+) previous=(\S+) generations=(\d+)", log)


def test_a_new_coordinator_serves_the_stages_a_killed_one_left(box, coordinator):
    b = box(2, max_context=128, kv_pool_tokens=1024)
    b.start_all()
    first = coordinator(b)
    a1 = first.chat(A)
    assert a1["cached"] == 0

    ended = {}

    def stream() -> None:
        try:
            for chunk in first.openai().chat.completions.create(model=first.model, messages=HOLD, max_tokens=80,
                                                                temperature=0, stream=True):
                if chunk.choices and chunk.choices[0].delta.content and first.proc.poll() is None:
                    first.kill()  # SIGKILL mid-decode: no BYE, steps left on the stages
            ended["how"] = "normally"
        except (openai.APIError, httpx.HTTPError) as err:
            ended["how"] = type(err).__name__

    t = threading.Thread(target=stream)
    t.start()
    t.join(60)
    assert ended.get("how") not in (None, "normally"), ended
    assert all(p.poll() is None for p in b.procs.values())  # the stages stay up

    second = coordinator(b)
    pool = second.live()["kv_pool"]
    assert pool["free"] == pool["cells"] and all(s["state"] == "free" for s in pool["slots"]), pool
    assert second.chat(A) == a1  # cold again: the old session's tables are gone, its bytes unused
    a2 = second.chat([*A, {"role": "assistant", "content": a1["text"]}, {"role": "user", "content": "Go on."}])
    assert a2["cached"] > 0

    for i in (0, 1):
        seen = sessions(b.log(i))
        assert len(seen) == 2, b.log(i)[-2000:]
        (one, none, _), (two, prev, gens) = seen
        assert none == "null" and prev == one != two and gens == "0", seen
