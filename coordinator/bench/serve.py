"""`strata bench serve`: a load generator for any OpenAI-compatible server (no torch).

It streams chat completions (or completions) with httpx and times each request from the client's side:

    t0 ── request sent          TTFT = t(first content chunk) - t0
    │     ... prefill ...       ITL  = gaps between consecutive content chunks of one request
    t1 ── first content chunk   output tokens = usage.completion_tokens when the server sends usage
    │     ... decode ...                        (stream_options.include_usage), else content chunks
    tn ── last content chunk

Per concurrency c, K requests run with at most c in flight (a new one starts as one ends). Reported: TTFT and
ITL p50/p90, output tok/s over the level's wall time, requests/s, and decode tok/s = sum(n_i - 1) /
(max tn - min t1), the tokens after each first one over the span in which decoding happened.

The appended-turn case: a long conversation is sent once (the server may hold it), then a short question is
appended to it and its TTFT taken ("held"); the same shape of conversation made of other random words, never
sent before, is asked the same question ("cold"). cold / held is what holding a conversation saves.

Prompts are random common words from a seeded generator, different from the first word on, so no two requests
share a prefix by chance. A prompt's word count is calibrated once against the server's usage figures so that it
is about --prompt-tokens tokens; without usage, one word counts as one token.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx

from .report import median, percentile, ratio

WORDS = tuple(dict.fromkeys((
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point home "
    "water room mother area money story fact month lot right study book eye job word business issue side kind "
    "head house service friend father power hour game line end member law car city community name president "
    "team minute idea kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force education foot boy "
    "age policy music market sense nation plan college interest death experience effect use class control care "
    "field development role effort rate heart drug show leader light voice wife police mind price report "
    "decision son view relationship town road arm difference value building action model season society tax "
    "director position player record paper space ground form event official matter center couple site project "
    "activity star table need court oil situation cost industry figure street image phone data picture practice "
    "piece land product doctor wall patient worker news test movie north love support technology step baby "
    "computer type attention film tree source organization hair window evidence population site river garden "
    "stone bridge signal summer winter valley island engine letter corner planet forest"
).split()))


def random_words(rng: random.Random, n: int) -> str:
    """n words drawn from WORDS, space separated."""
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))


@dataclass
class ServeConfig:
    url: str
    model: str | None = None
    api: str = "chat"  # "chat" (/v1/chat/completions) or "completions" (/v1/completions)
    prompt_tokens: int = 256
    output_tokens: int = 64
    seed: int = 0
    api_key: str | None = None
    ignore_eos: bool = False
    timeout_s: float = 600.0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestResult:
    """One request as the client saw it; times are time.perf_counter() seconds."""

    start: float
    end: float | None = None  # when the stream ended
    chunk_times: list[float] = field(default_factory=list)
    usage_output: int | None = None
    usage_prompt: int | None = None
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and (bool(self.chunk_times) or bool(self.usage_output))

    @property
    def ttft(self) -> float | None:
        """Time to the first content chunk; for a stream whose tokens carried no text yet (a detokenizer holds
        back an incomplete UTF-8 sequence), the end of the stream, when usage says a token was generated."""
        if self.chunk_times:
            return self.chunk_times[0] - self.start
        if self.usage_output and self.end is not None:
            return self.end - self.start
        return None

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def output_tokens(self) -> int:
        return self.usage_output if self.usage_output is not None else len(self.chunk_times)


SSE_LINE_END = re.compile(r"\r\n|\r|\n")  # the SSE rules' line ends


async def sse_lines(resp: httpx.Response) -> AsyncIterator[str]:
    """The lines of a streamed response cut as the SSE rules cut them, at CR, LF or CRLF only (httpx's aiter_lines
    also cuts at U+2028, U+0085 and other Unicode line breaks, which a server may send raw inside its JSON). A CRLF
    split over two reads gives one more empty line, which ends no event here."""
    rest = ""
    async for text in resp.aiter_text():
        *lines, rest = SSE_LINE_END.split(rest + text)
        for line in lines:
            yield line
    if rest:
        yield rest


def parse_sse(line: str) -> dict[str, Any] | str | None:
    """One line of an SSE stream: the decoded JSON of a `data:` line, the string "[DONE]", or None for any other
    line (comments, blank separators, event names)."""
    if not line.startswith("data:"):
        return None
    body = line[5:].strip()
    if body == "[DONE]":
        return "[DONE]"
    if not body:
        return None
    return json.loads(body)


def chunk_text(chunk: dict[str, Any]) -> str:
    """The generated text a streamed chunk carries (chat delta content or reasoning, or completion text)."""
    out = []
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            out.append(delta.get("content") or "")
            out.append(delta.get("reasoning_content") or "")
        out.append(choice.get("text") or "")
    return "".join(out)


def build_body(cfg: ServeConfig, messages: list[dict[str, str]], max_tokens: int,
               prompt_ids: list[int] | None = None) -> tuple[str, dict[str, Any]]:
    """The request path and JSON body; completions get the messages joined as plain text. With `prompt_ids`
    the request is a completion whose prompt is those token ids (exact prompt length on any tokenizer)."""
    body: dict[str, Any] = {
        "model": cfg.model or "default",
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra)
    if prompt_ids is not None:
        body["prompt"] = list(prompt_ids)
        return "/v1/completions", body
    if cfg.api == "chat":
        body["messages"] = messages
        return "/v1/chat/completions", body
    if cfg.api != "completions":
        raise ValueError(f"api must be 'chat' or 'completions', got {cfg.api!r}")
    body["prompt"] = "\n\n".join(m["content"] for m in messages)
    return "/v1/completions", body


async def stream_request(client: httpx.AsyncClient, cfg: ServeConfig, messages: list[dict[str, str]],
                         max_tokens: int, prompt_ids: list[int] | None = None) -> RequestResult:
    """Send one streamed request and time every content chunk; errors are recorded, not raised."""
    path, body = build_body(cfg, messages, max_tokens, prompt_ids)
    res = RequestResult(start=time.perf_counter())
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                res.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return res
            async for line in sse_lines(resp):
                event = parse_sse(line)
                if event is None:
                    continue
                if event == "[DONE]":
                    break
                if "error" in event:
                    res.error = f"stream error: {json.dumps(event['error'])[:200]}"
                    break
                text = chunk_text(event)
                if text:
                    res.chunk_times.append(time.perf_counter())
                    res.text += text
                usage = event.get("usage")
                if usage:
                    res.usage_output = usage.get("completion_tokens")
                    res.usage_prompt = usage.get("prompt_tokens")
    except httpx.HTTPError as err:
        res.error = f"{type(err).__name__}: {err}"
    res.end = time.perf_counter()
    if res.error is None and not res.chunk_times and not res.usage_output:
        res.error = "no content chunk and no usage in the stream"
    return res


def make_client(url: str, api_key: str | None, timeout_s: float, connections: int) -> httpx.AsyncClient:
    """A client of the server at `url` (Bearer `api_key` when given) with room for `connections` at once."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, limits=limits,
                             timeout=httpx.Timeout(timeout_s, connect=10.0))


async def resolve_model(client: httpx.AsyncClient) -> str:
    """The first model /v1/models lists, or "default" when the server has no such route."""
    try:
        resp = await client.get("/v1/models")
        data = resp.json().get("data") or []
        if resp.status_code == 200 and data:
            return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, AttributeError):
        pass
    return "default"


CALIBRATION_WORDS = 512


async def calibrate_words(client: httpx.AsyncClient, cfg: ServeConfig, rng: random.Random) -> tuple[float, str]:
    """Words per prompt token for this server's tokenizer (and chat template), from one untimed request's usage;
    1.0 when the server reports no usage. The request also warms the server up. It has `--prompt-tokens` words,
    at most CALIBRATION_WORDS: a word is often more than one token, so a prompt of as many words as a long
    prompt's tokens could exceed the server's context."""
    n = max(8, min(cfg.prompt_tokens, CALIBRATION_WORDS))
    res = await stream_request(client, cfg, [{"role": "user", "content": random_words(rng, n)}], 1)
    if res.error:
        raise RuntimeError(f"calibration request to {cfg.url} failed: {res.error}")
    if not res.usage_prompt:
        return 1.0, "the server sent no usage: one prompt word counts as one token"
    return n / res.usage_prompt, f"{n} words were {res.usage_prompt} prompt tokens (template included)"


def level_stats(concurrency: int, results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    """One table row for a concurrency level (times in ms, rates per second)."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [g for r in ok for g in r.itls]
    out_tokens = sum(r.output_tokens for r in ok)
    timed = [r for r in ok if r.chunk_times]
    firsts = [r.chunk_times[0] for r in timed]
    lasts = [r.chunk_times[-1] for r in timed]
    decode_span = (max(lasts) - min(firsts)) if timed else 0.0
    decode_tokens = sum(max(r.output_tokens - 1, 0) for r in timed)

    def ms(v: float | None) -> float | None:
        return None if v is None else v * 1000.0

    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "prompt_tokens": median([r.usage_prompt for r in ok if r.usage_prompt]),
        "output_tokens": out_tokens,
        "ttft_p50_ms": ms(percentile(ttfts, 50)),
        "ttft_p90_ms": ms(percentile(ttfts, 90)),
        "itl_p50_ms": ms(percentile(itls, 50)),
        "itl_p90_ms": ms(percentile(itls, 90)),
        "out_tok_s": ratio(out_tokens, wall_s),
        "decode_tok_s": ratio(decode_tokens, decode_span),
        "req_s": ratio(len(ok), wall_s),
        "wall_s": wall_s,
        "first_error": next((r.error for r in results if r.error), None),
    }


async def run_level(client: httpx.AsyncClient, cfg: ServeConfig, concurrency: int, prompts: list[str]
                    ) -> dict[str, Any]:
    """Run every prompt with at most `concurrency` in flight; return level_stats."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[RequestResult] = []

    async def worker() -> None:
        while True:
            try:
                prompt = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await stream_request(client, cfg, [{"role": "user", "content": prompt}],
                                                cfg.output_tokens))

    before = await stage_time(client)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    row = level_stats(concurrency, results, wall)
    after = await stage_time(client)
    row.update(busy_fractions(before, after, wall))
    row["coord_ms_tok"] = coordinator_cpu(before, after, row["output_tokens"])
    return row


async def _stage_time_once(client: httpx.AsyncClient) -> dict | None:
    try:
        r = await client.get("/metrics", params={"format": "json"})
        if r.status_code != 200:
            return None
        live = r.json()["live"]
        return {"stages": live["stages"], "groups": live.get("pipeline_groups"), "cpu_s": live.get("coordinator_cpu_s")}
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


SETTLE_S = 0.6  # stage counters unchanged this long: every step that ran is in them (heartbeats: 250 ms)


async def stage_time(client: httpx.AsyncClient, settle_s: float = SETTLE_S, limit_s: float = 5.0) -> dict | None:
    """A Strata server's per-stage time counters (/metrics JSON `live.stages`) and its pipeline groups
    (`live.pipeline_groups`, pool/pipeline.py), {"stages": [...], "groups": G}, read once the busy seconds stop
    changing for `settle_s` (the stages report them with each heartbeat, so a read right after a level would miss
    its last steps), at most `limit_s`; None from any other server."""
    last = await _stage_time_once(client)
    if last is None:
        return None
    t0 = same_since = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        await asyncio.sleep(0.1)
        now = await _stage_time_once(client)
        if now is None:
            return last
        if [s.get("busy_s") for s in now["stages"]] != [s.get("busy_s") for s in last["stages"]]:
            last, same_since = now, time.perf_counter()
        elif time.perf_counter() - same_since >= settle_s:
            break
    return last


def busy_fractions(before: dict | None, after: dict | None, wall_s: float) -> dict[str, Any]:
    """`stage_busy`: each stage's share of the level's wall time spent computing steps ("0.93 0.88"), and
    `bubble`: 1 - their sum / the groups of steps the server computes at once (pool/pipeline.py rule 6: S for
    pipelined stages, their mean; 1 for stages in turns, their sum), the share of the time the compute idled;
    None when the server does not report stage time. The counters are read settled (`stage_time`), before and
    after the level."""
    if not before or not after or len(before["stages"]) != len(after["stages"]) or wall_s <= 0:
        return {"stage_busy": None, "bubble": None}
    fractions = [max(0.0, (a["busy_s"] - b["busy_s"]) / wall_s) for b, a in zip(before["stages"], after["stages"])]
    groups = after.get("groups") or len(fractions)
    return {"stage_busy": " ".join(f"{f:.2f}" for f in fractions),
            "bubble": round(1 - sum(fractions) / groups, 3)}


def coordinator_cpu(before: dict | None, after: dict | None, tokens: int) -> float | None:
    """`coord_ms_tok`: the coordinator process's CPU time over the level (every thread: the HTTP front, the
    scheduler, the link and ZeroMQ's I/O thread) per output token, in ms; None when the server does not report
    it. It includes the few /metrics reads that settle the counters (`stage_time`)."""
    if not before or not after or before.get("cpu_s") is None or after.get("cpu_s") is None or tokens <= 0:
        return None
    return round((after["cpu_s"] - before["cpu_s"]) * 1000 / tokens, 3)


async def appended_turn(client: httpx.AsyncClient, cfg: ServeConfig, rng: random.Random, words_per_token: float,
                        long_tokens: int, question_tokens: int, trials: int) -> dict[str, Any]:
    """TTFT of a short question appended to a held long conversation vs the same shape sent cold (medians)."""
    held, cold, errors = [], [], []
    n_long = max(8, round(long_tokens * words_per_token))
    n_question = max(2, round(question_tokens * words_per_token))
    for _ in range(trials):
        question = {"role": "user", "content": random_words(rng, n_question)}
        first = [{"role": "user", "content": random_words(rng, n_long)}]
        turn1 = await stream_request(client, cfg, first, cfg.output_tokens)
        if turn1.error:
            errors.append(turn1.error)
            continue
        reply = {"role": "assistant", "content": turn1.text}
        warm = await stream_request(client, cfg, first + [reply, question], 1)
        other = [{"role": "user", "content": random_words(rng, n_long)}]
        fresh = await stream_request(client, cfg, other + [reply, question], 1)
        for res, sink in ((warm, held), (fresh, cold)):
            if res.ok and res.ttft is not None:
                sink.append(res.ttft * 1000.0)
            else:
                errors.append(res.error or "no token")
    held_ms, cold_ms = median(held), median(cold)
    return {"long_tokens": long_tokens, "question_tokens": question_tokens, "trials": trials,
            "held_ttft_ms": held_ms, "cold_ttft_ms": cold_ms, "cold_over_held": ratio(cold_ms, held_ms),
            "errors": len(errors), "first_error": errors[0] if errors else None}


async def run_serve(cfg: ServeConfig, concurrency: list[int], requests: int | None,
                    long_tokens: int = 0, question_tokens: int = 16, trials: int = 3) -> dict[str, Any]:
    """The whole serve benchmark: calibration, one level per concurrency, then the appended-turn case
    (skipped when long_tokens is 0). Returns a report result (see report.py)."""
    rng = random.Random(cfg.seed)
    async with make_client(cfg.url, cfg.api_key, cfg.timeout_s, max(concurrency) + 2) as client:
        if cfg.model is None:
            cfg.model = await resolve_model(client)
        words_per_token, calib_note = await calibrate_words(client, cfg, rng)
        n_words = max(1, round(cfg.prompt_tokens * words_per_token))
        rows = []
        for c in concurrency:
            k = requests if requests is not None else max(4, 2 * c)
            prompts = [random_words(rng, n_words) for _ in range(k)]
            rows.append(await run_level(client, cfg, c, prompts))
        appended = None
        if long_tokens > 0:
            appended = await appended_turn(client, cfg, rng, words_per_token, long_tokens, question_tokens, trials)
    notes = [
        f"server {cfg.url}, model {cfg.model}, api {cfg.api}; prompts of ~{cfg.prompt_tokens} tokens "
        f"({n_words} random words; {calib_note}), max_tokens {cfg.output_tokens}, temperature 0",
        "times from the client: TTFT = first content chunk, ITL = gap between content chunks; "
        "decode_tok_s = sum(n-1) / (last chunk - first first chunk)",
    ]
    tables = []
    if appended is not None:
        tables.append({"title": "appended turn: a short question after a held long conversation vs the same shape "
                                f"cold (median of {appended['trials']})",
                       "columns": ["long_tokens", "question_tokens", "held_ttft_ms", "cold_ttft_ms", "cold_over_held",
                                   "errors"],
                       "rows": [appended]})
    return {
        "bench": "serve",
        "config": {"url": cfg.url, "model": cfg.model, "api": cfg.api, "prompt_tokens": cfg.prompt_tokens,
                   "output_tokens": cfg.output_tokens, "seed": cfg.seed, "words_per_token": words_per_token},
        "columns": ["concurrency", "requests", "errors", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms",
                    "out_tok_s", "decode_tok_s", "req_s", "stage_busy", "bubble", "coord_ms_tok"],
        "rows": rows,
        "tables": tables,
        "appended_turn": appended,
        "plot": {"x": "concurrency", "xlabel": "concurrent requests", "panels": [
            {"y": ["ttft_p50_ms", "ttft_p90_ms"], "ylabel": "TTFT (ms)"},
            {"y": ["itl_p50_ms", "itl_p90_ms"], "ylabel": "inter-token latency (ms)"},
            {"y": ["out_tok_s"], "ylabel": "output tokens / s"},
        ]},
        "notes": notes,
    }


def run_serve_sync(cfg: ServeConfig, concurrency: list[int], requests: int | None, **kw: Any) -> dict[str, Any]:
    return asyncio.run(run_serve(cfg, concurrency, requests, **kw))

