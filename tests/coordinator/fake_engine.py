"""A deterministic Engine for the HTTP front's tests, and a real uvicorn server to put the front on.

`FakeEngine(tokenizer)` answers every request with the same script: the tokens of `SCRIPT_TEXT`, then an
end-of-turn token (which, like the real engine, ends the request with reason "stop" and is not yielded). A
request without stop ids (`ignore_eos`) gets the end-of-turn token too, and then ends with reason "length".
Knobs, set by a test and put back by `reset()`:
  script        the token ids every request gets (`say(text)` sets it from a text)
  refuse        an EngineError raised before the first event (a refusal)
  fail_after    raise `fail_with` after this many tokens (an error mid-stream)
  hang_after    after this many tokens, wait forever (until the request is cancelled)
  truncate      end with reason "length" and truncated=True after `truncate_after` tokens
  cached_tokens reported in Finished, and on the first TokenEvent unless `cached_at_start` is False
  stages_up     what health() reports
  kv_window     the per-stage device window entries of live_metrics() (`KV_WINDOW`)
`closed` lists the request ids whose iterator ended, for any reason (normally, closed, cancelled): the
server runs in another thread, so tests wait on it with `wait_closed`.
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator

import uvicorn

from coordinator.api import make_app
from coordinator.http_limits import server_config
from coordinator.engine import EngineError, Finished, GenRequest, TokenEvent
from pool.config import config_from_dict

SCRIPT_TEXT = "Hello there! The pool holds chunks. Done."
# live_metrics()["kv_window"]: stage 0 has a window that streamed, stage 1 one that never had to.
KV_WINDOW = [
    {"stage": 0, "frames": 2, "cells": 32, "device_bytes": 24576, "resident": 1, "steps": 9, "streamed_steps": 4,
     "hits": 5, "fills": 6, "stale": 1, "evictions": 3, "streamed": 40, "h2d_bytes": 110592, "d2h_bytes": 2304},
    {"stage": 1, "frames": 4, "cells": 64, "device_bytes": 40960, "resident": 3, "steps": 9, "streamed_steps": 0,
     "hits": 14, "fills": 3, "stale": 0, "evictions": 0, "streamed": 0, "h2d_bytes": 24576, "d2h_bytes": 2304},
]

# live_metrics()["stages"]: stage 1 waited for stage 0's hidden states a while.
STAGES = [{"stage": 0, "steps_run": 12, "steps_refused": 2, "steps_failed": 0, "busy_s": 1.5, "hidden_wait_s": 0.0,
           "baton_passes": 3, "weight_bytes": 1_234_567},
          {"stage": 1, "steps_run": 12, "steps_refused": 0, "steps_failed": 1, "busy_s": 1.25, "hidden_wait_s": 0.5,
           "baton_passes": 5}]


class FakeEngine:
    def __init__(self, tokenizer, max_context: int = 256, model_name: str = "tiny-test") -> None:
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.model_name = model_name
        self.erased: list = []
        self.eos = min(tokenizer.eos_ids)
        self.requests: list[GenRequest] = []
        self.closed: list[str] = []
        self._cond = threading.Condition()
        self.reset()

    def reset(self) -> None:
        self.script = self.tokenizer.encode(SCRIPT_TEXT)
        self.refuse: EngineError | None = None
        self.fail_after: int | None = None
        self.fail_with: EngineError = EngineError.kv_pool_full(100, 0, retry_after=5)
        self.hang_after: int | None = None
        self.truncate_after: int | None = None
        self.cached_tokens = 0
        self.cached_at_start = True
        self.stages_up = [True, True]
        self.running = 0
        self.counters = {"evictions": 3, "refusals": {"kv_pool_full": 2}, "truncations": 1, "chained": 5}
        self.kv_window = [dict(w) for w in KV_WINDOW]
        self.requests.clear()
        with self._cond:
            self.closed.clear()

    def say(self, text: str) -> None:
        """Answer with `text` (its tokens), then the end-of-turn token."""
        self.script = self.tokenizer.encode(text)

    def wait_closed(self, request_id: str, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: request_id in self.closed, timeout)

    def _top(self, token: int, n: int) -> list[tuple[int, float]] | None:
        if not n:
            return None
        return [(token, -0.25)] + [((token + k) % self.tokenizer.vocab_size, -1.0 - k) for k in range(1, n)]

    async def generate(self, req: GenRequest) -> AsyncIterator[TokenEvent | Finished]:
        self.requests.append(req)
        if self.refuse is not None:
            raise self.refuse
        self.running += 1
        try:
            sent = 0
            for token in self.script + [self.eos]:
                if sent == req.max_tokens:
                    yield Finished("length", False, len(req.prompt), self.cached_tokens, sent)
                    return
                if token in req.stop_token_ids:
                    yield Finished("stop", False, len(req.prompt), self.cached_tokens, sent)
                    return
                if sent == self.truncate_after:
                    yield Finished("length", True, len(req.prompt), self.cached_tokens, sent)
                    return
                if sent == self.fail_after:
                    raise self.fail_with
                if sent == self.hang_after:
                    await asyncio.Event().wait()
                cached = self.cached_tokens if sent == 0 and self.cached_at_start else None
                yield TokenEvent(token, -0.25, self._top(token, req.logprobs), cached_tokens=cached)
                sent += 1
                await asyncio.sleep(0.001)
            yield Finished("length", False, len(req.prompt), self.cached_tokens, sent)  # ignore_eos: script spent
        finally:
            self.running -= 1
            with self._cond:
                self.closed.append(req.request_id)
                self._cond.notify_all()

    def live_metrics(self) -> dict:
        return {
            "running": self.running,
            "waiting": 1,
            "kv_pool": {
                "cells": 1024,
                "free": 768,
                "slots": [{"slot": 0, "state": "busy", "cells": 160, "tokens": 150},
                          {"slot": 1, "state": "free", "cells": 0, "tokens": 0}],
                "parked": [{"table": 2, "cells": 96, "tokens": 90}],
            },
            "counters": {**self.counters, "refusals": dict(self.counters["refusals"])},
            "kv_window": [dict(w) for w in self.kv_window],
            "stages": [dict(st) for st in STAGES],
            "pipeline_groups": 2,
        }

    def health(self) -> dict:
        up = list(self.stages_up)
        return {"status": "ok" if all(up) else "degraded",
                "stages": [{"index": i, "up": u} for i, u in enumerate(up)]}

    def slots(self) -> list[dict]:
        return [{"id": 0, "is_processing": self.running > 0, "n_ctx": self.max_context}]

    def erase_slot(self, slot: int) -> int:
        if slot != 0:
            raise EngineError.invalid(f"slot {slot} does not exist (0..0)", param="id")
        self.erased.append(slot)
        return 7

    def flush_cache(self) -> int:
        self.erased.append("all")
        return 96


@contextmanager
def serve(app, cfg=None) -> Iterator[str]:
    """Runs `app` on uvicorn on a free loopback port in a background thread, with the front's HTTP limits
    (coordinator/http_limits.py) from `cfg` (default: the defaults); yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(server_config(app, cfg or config_from_dict({}), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def parse_sse(text: str) -> list[tuple[str | None, str]]:
    """(event, data) per server-sent event of a raw stream body."""
    out = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        event, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                event = line[len("event:"):].strip()
            elif line.startswith("data:"):
                data.append(line[len("data:"):].strip())
        out.append((event, "\n".join(data)))
    return out


@dataclass
class Stack:
    """A front on a live server: base `url`, the fake `engine` behind it, the `app` and the tokenizer."""

    url: str
    engine: FakeEngine
    app: Any
    tokenizer: Any


@contextmanager
def running_front(tokenizer, max_context: int = 256, model_name: str = "tiny-test",
                  **coordinator: Any) -> Iterator[Stack]:
    """make_app over a FakeEngine, served; `coordinator` keys override the config's coordinator section."""
    engine = FakeEngine(tokenizer, max_context=max_context, model_name=model_name)
    cfg = config_from_dict({"coordinator": coordinator})
    app = make_app(cfg, engine, tokenizer)
    with serve(app, cfg) as url:
        yield Stack(url, engine, app, tokenizer)
