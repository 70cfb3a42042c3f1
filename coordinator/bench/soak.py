"""`strata bench soak`: many clients against one Strata server for a bounded time, then its pool is checked.

    strata bench soak --url http://127.0.0.1:8080 --clients 64 --seconds 60

Each client loops until `--seconds` have passed (the request in flight then finishes, bounded by
`--timeout`): it picks an API (OpenAI chat, OpenAI completions, Anthropic messages), a prompt of random
words (mostly short, some near half the context), a `max_tokens`, streamed or not; some streams are dropped by
the client after a few events (a disconnect mid-stream). A 503 is waited out for min(Retry-After,
`BACKOFF_CAP_S`) seconds before the next request, as a polite client would.

Every request ends in one outcome:
  ok                  a complete answer (a stream that reached [DONE] / message_stop)
  disconnected        the client dropped the stream on purpose
  <status> <code>     an HTTP error; the code is OpenAI's error.code, or the prefix of the Anthropic message
  stream <code>       an error event inside a stream that had begun
  transport <error>   the connection failed (httpx exception name)
  bad response        a 200 whose body was not a complete answer
`DOCUMENTED` are the refusals a loaded server may give (503 kv_pool_full, 503 queue_full); anything else
besides ok and disconnected is an error of the server.

At the end, once the server reports nothing running or waiting, the soak sends `POST /slots?action=erase`
and reads `/metrics?format=json`: with every conversation erased, free cells must equal the pool's cells and
no slot may be busy (`summary.clean`). Prompt sizes come from one calibration against
`/v1/messages/count_tokens` (tokens per word, with a margin), so no request asks for more than the context.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx

from .report import percentile
from .serve import make_client, random_words, sse_lines

DOCUMENTED = frozenset({"503 kv_pool_full", "503 queue_full"})
EXPECTED = frozenset({"ok", "disconnected"}) | DOCUMENTED
BACKOFF_CAP_S = 1.0
APIS = (("chat", 0.4), ("completions", 0.2), ("messages", 0.4))


@dataclass
class SoakConfig:
    url: str
    clients: int = 64
    seconds: float = 60.0
    api_key: str | None = None
    model: str | None = None
    seed: int = 0
    timeout_s: float = 120.0
    stream_share: float = 0.5  # of requests, streamed
    disconnect_share: float = 0.25  # of streams, dropped by the client after a few events
    max_tokens: int = 64  # upper bound of a request's max_tokens (also capped by the context)


@dataclass
class Outcome:
    kind: str
    api: str
    stream: bool
    latency_s: float
    ttft_s: float | None = None  # streams: to the first event that carries text


@dataclass
class Shape:
    """What the calibration learned: the context, tokens per word (with margin) and the chat overhead."""

    max_context: int
    tokens_per_word: float
    overhead: int

    def max_words(self, max_tokens: int) -> int:
        return max(1, int((self.max_context - max_tokens - self.overhead) / self.tokens_per_word))


def error_code(resp_body: bytes) -> str:
    """OpenAI error.code, or the `code: message` prefix of an Anthropic error message."""
    try:
        body = json.loads(resp_body)
        err = body["error"]
    except (ValueError, KeyError, TypeError):
        return "unparsed"
    if isinstance(err, dict) and err.get("code"):
        return str(err["code"])
    message = str(err.get("message", "")) if isinstance(err, dict) else ""
    return message.split(":", 1)[0] if ":" in message else str(err.get("type", "unknown"))


def build(api: str, model: str, prompt: str, max_tokens: int, stream: bool) -> tuple[str, dict]:
    if api == "chat":
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": prompt}],
                                        "max_tokens": max_tokens, "stream": stream}
    if api == "completions":
        return "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    return "/v1/messages", {"model": model, "max_tokens": max_tokens, "stream": stream,
                            "messages": [{"role": "user", "content": prompt}]}


def _stream_event(api: str, data: str) -> tuple[str | None, bool, bool]:
    """(error code or None, finished, carries text) for the data of one SSE event of either API."""
    if data == "[DONE]":
        return None, True, False
    try:
        event = json.loads(data)
    except ValueError:
        return "unparsed", True, False
    if not isinstance(event, dict):
        return "unparsed", True, False
    if "error" in event:
        return error_code(data.encode()), True, False
    if api == "messages":
        return None, event.get("type") == "message_stop", event.get("type") == "content_block_delta"
    choice = (event.get("choices") or [{}])[0]
    return None, False, bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


async def one_request(client: httpx.AsyncClient, cfg: SoakConfig, rng: random.Random, shape: Shape,
                      model: str) -> tuple[Outcome, float | None]:
    """Send one request; (outcome, seconds to wait before the next one)."""
    api = rng.choices([a for a, _ in APIS], [w for _, w in APIS])[0]
    max_tokens = rng.randint(1, max(1, min(cfg.max_tokens, shape.max_context // 4)))
    top = shape.max_words(max_tokens)
    words = rng.randint(max(1, top // 2), top) if rng.random() < 0.1 else rng.randint(1, max(1, top // 8))
    stream = rng.random() < cfg.stream_share
    drop_after = rng.randint(1, 4) if stream and rng.random() < cfg.disconnect_share else None
    path, body = build(api, model, random_words(rng, words), max_tokens, stream)
    t0 = time.perf_counter()
    ttft = None

    def outcome(kind: str) -> Outcome:
        return Outcome(kind, api, stream, time.perf_counter() - t0, ttft)

    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                wait = None
                if resp.status_code == 503:
                    wait = min(float(resp.headers.get("retry-after", BACKOFF_CAP_S)), BACKOFF_CAP_S)
                return outcome(f"{resp.status_code} {error_code(raw)}"), wait
            if not stream:
                try:
                    answer = json.loads(await resp.aread())
                except ValueError:
                    return outcome("bad response"), None
                complete = isinstance(answer, dict) and bool(answer.get("choices") or answer.get("content"))
                return outcome("ok" if complete else "bad response"), None
            events = 0
            async for line in sse_lines(resp):
                if not line.startswith("data:"):
                    continue
                events += 1
                if drop_after is not None and events >= drop_after:
                    return outcome("disconnected"), None
                code, finished, text = _stream_event(api, line[5:].strip())
                if text and ttft is None:
                    ttft = time.perf_counter() - t0
                if code is not None:
                    return outcome(f"stream {code}"), None
                if finished:
                    return outcome("ok"), None
            return outcome("bad response"), None
    except httpx.TimeoutException:
        return outcome("transport timeout"), None
    except httpx.HTTPError as err:
        return outcome(f"transport {type(err).__name__}"), None


async def calibrate(client: httpx.AsyncClient, rng: random.Random) -> tuple[Shape, str]:
    """The served model, its context, and tokens per word of random_words (x1.5 for safety)."""
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    entry = resp.json()["data"][0]
    counts = []
    for n in (1, 200):
        messages = [{"role": "user", "content": random_words(rng, n)}]
        r = await client.post("/v1/messages/count_tokens", json={"model": entry["id"], "messages": messages})
        r.raise_for_status()
        counts.append(r.json()["input_tokens"])
    per_word = max(1.0, (counts[1] - counts[0]) / 199) * 1.5
    return Shape(int(entry["max_model_len"]), per_word, counts[0] + 8), entry["id"]


async def settle(client: httpx.AsyncClient, timeout_s: float = 30.0) -> dict:
    """Wait until the server runs and queues nothing; return /metrics?format=json's live part."""
    deadline = time.monotonic() + timeout_s
    while True:
        live = (await client.get("/metrics", params={"format": "json"})).json()["live"]
        if (live.get("running", 0) == 0 and live.get("waiting", 0) == 0) or time.monotonic() > deadline:
            return live
        await asyncio.sleep(0.1)


async def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    async with make_client(cfg.url, cfg.api_key, cfg.timeout_s, cfg.clients + 4) as client:
        shape, served = await calibrate(client, random.Random(cfg.seed))
        model = cfg.model or served
        outcomes: list[Outcome] = []
        start = time.perf_counter()
        deadline = start + cfg.seconds

        async def worker(i: int) -> None:
            rng = random.Random(cfg.seed * 1_000_003 + i)
            while time.perf_counter() < deadline:
                outcome, wait = await one_request(client, cfg, rng, shape, model)
                outcomes.append(outcome)
                if wait:
                    await asyncio.sleep(rng.uniform(0.5, 1.0) * wait)

        await asyncio.gather(*(worker(i) for i in range(cfg.clients)))
        wall = time.perf_counter() - start
        before = await settle(client)
        erased = (await client.post("/slots", params={"action": "erase"})).json().get("erased_cells")
        after = await settle(client, timeout_s=5)
        slots = (await client.get("/slots")).json()
    return summarize(cfg, shape, outcomes, wall, before, erased, after, slots)


def _latency_row(name: str, outs: list[Outcome]) -> dict[str, Any]:
    lat = [o.latency_s for o in outs]
    ttft = [o.ttft_s for o in outs if o.ttft_s is not None]
    return {"requests": name, "ok": len(outs), "p50_s": percentile(lat, 50), "p99_s": percentile(lat, 99),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99)}


def summarize(cfg: SoakConfig, shape: Shape, outcomes: list[Outcome], wall: float, before: dict,
              erased: int | None, after: dict, slots: list[dict]) -> dict[str, Any]:
    kinds = Counter(o.kind for o in outcomes)
    ok = [o for o in outcomes if o.kind == "ok"]
    pool, held = after.get("kv_pool", {}), before.get("kv_pool", {})
    busy = sum(1 for s in slots if s.get("is_processing"))
    unexpected = {k: n for k, n in kinds.items() if k not in EXPECTED}
    summary = {
        "requests": len(outcomes), "ok": kinds.get("ok", 0), "disconnected": kinds.get("disconnected", 0),
        "refused": {k: n for k, n in kinds.items() if k in DOCUMENTED}, "unexpected": unexpected,
        "requests_per_s": len(outcomes) / wall if wall > 0 else None,
        "p50_s": percentile([o.latency_s for o in ok], 50), "p99_s": percentile([o.latency_s for o in ok], 99),
        "pool_cells": pool.get("cells"), "pool_free_after_erase": pool.get("free"), "erased_cells": erased,
        "held_cells_before_erase": held.get("cells", 0) - held.get("free", 0),
        "busy_slots": busy, "running_after": after.get("running"), "waiting_after": after.get("waiting"),
    }
    summary["clean"] = (pool.get("cells") is not None and pool.get("free") == pool.get("cells") and busy == 0
                        and after.get("running", 0) == 0 and after.get("waiting", 0) == 0)
    rows = [{"outcome": k, "requests": n, "share": n / len(outcomes)} for k, n in kinds.most_common()]
    by_api = [_latency_row(f"{api} {'stream' if s else 'whole'}", [o for o in ok if o.api == api and o.stream == s])
              for api, _ in APIS for s in (False, True)]
    return {
        "bench": "soak",
        "config": {"url": cfg.url, "clients": cfg.clients, "seconds": cfg.seconds, "seed": cfg.seed,
                   "stream_share": cfg.stream_share, "disconnect_share": cfg.disconnect_share,
                   "max_tokens": cfg.max_tokens, "max_context": shape.max_context,
                   "tokens_per_word": round(shape.tokens_per_word, 3)},
        "summary": summary,
        "columns": ["outcome", "requests", "share"],
        "rows": rows,
        "tables": [
            {"title": "latency of ok requests (s; ttft: first content event of a stream)",
             "columns": ["requests", "ok", "p50_s", "p99_s", "ttft_p50_s", "ttft_p99_s"],
             "rows": [_latency_row("all", ok)] + [r for r in by_api if r["ok"]]},
            {"title": "pool after the run, after POST /slots?action=erase",
             "columns": ["pool_cells", "held_cells_before_erase", "erased_cells", "pool_free_after_erase",
                         "busy_slots", "clean"],
             "rows": [summary]},
        ],
        "plot": {"x": "outcome", "panels": [{"y": ["requests"], "kind": "bar", "ylabel": "requests"}]},
        "notes": [
            f"{cfg.clients} clients for {cfg.seconds:g} s ({wall:.1f} s with the last requests finishing); "
            f"{summary['requests_per_s']:.2f} requests/s",
            "documented refusals: " + ", ".join(sorted(DOCUMENTED)) + "; anything else but ok/disconnected is an error",
            f"unexpected outcomes: {unexpected or 'none'}; end state clean: {summary['clean']}",
        ],
    }


def run_soak_sync(cfg: SoakConfig) -> dict[str, Any]:
    """run_soak; a server that cannot be reached or calibrated is a RuntimeError naming the URL."""
    try:
        return asyncio.run(run_soak(cfg))
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as err:
        raise RuntimeError(f"{cfg.url}: {type(err).__name__}: {err}") from err
