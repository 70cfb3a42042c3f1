"""Bad input never hurts: every malformed or out-of-range request is a 4xx with a message, never a 5xx,
and nothing reaches the engine (the FakeEngine records every request it is asked to start).

`HAND_CASES` is also sent to a real server (real stages) by tests/integration/test_soak.py; keep every
case independent of the engine behind the front. `EDGE_CASES` are extreme but valid: they must be served.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from coordinator.api_generation import LARGE_TEXT_CHARS, Front
from tests.coordinator.fake_engine import running_front

LIMIT = 12 * 1024 * 1024  # coordinator.max_body_bytes of every server these cases are sent to
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES, COUNT = "/v1/messages", "/v1/messages/count_tokens"
USER = [{"role": "user", "content": "Say hello."}]


@dataclass(frozen=True)
class Case:
    """One request and the status it must get; `body` is sent as JSON unless it is bytes."""

    name: str
    path: str
    body: Any = None
    status: int = 400
    method: str = "POST"
    code: str | None = None  # OpenAI error.code (the Anthropic message starts with it)
    headers: dict = field(default_factory=dict)

    def content(self) -> bytes | None:
        if self.body is None or isinstance(self.body, bytes):
            return self.body
        return json.dumps(self.body).encode()


def chat(**kw: Any) -> dict:
    return {"model": None, "messages": USER, "max_tokens": 4, **kw}


def anth(**kw: Any) -> dict:
    return {"model": "claude-any", "max_tokens": 4, "messages": USER, **kw}


def comp(**kw: Any) -> dict:
    return {"prompt": "Once upon", "max_tokens": 4, **kw}


_DEEP = b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
_TEN_MB = "pool " * (2 * 1024 * 1024)  # 10 MiB of text, under LIMIT: tokenized, then refused for its length

HAND_CASES: list[Case] = [
    # the body itself
    Case("malformed JSON", CHAT, b'{"messages": [', code="invalid_request"),
    Case("empty body", CHAT, b""),
    Case("body is a list", CHAT, b"[1, 2]"),
    Case("body is a string", MESSAGES, b'"hello"'),
    Case("invalid UTF-8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    Case("NaN", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}'),
    Case("Infinity", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "repetition_penalty": Infinity}'),
    Case("lone surrogate (chat)", CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    Case("lone surrogate (completions)", COMPLETIONS, b'{"prompt": "\\udfff"}'),
    Case("lone surrogate (messages)", MESSAGES,
         b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "\\ud83d"}]}'),
    Case("lone surrogate in a key", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "\\udc00": 1}'),
    Case("nesting too deep", CHAT, _DEEP),
    Case("over max_body_bytes", CHAT, b'{"messages": "' + b"x" * LIMIT + b'"}', status=413, code="request_too_large"),
    Case("over max_body_bytes (messages)", MESSAGES, b" " * (LIMIT + 1), status=413),
    # wrong types
    Case("messages is a string", CHAT, chat(messages="hello")),
    Case("max_tokens is a string", CHAT, chat(max_tokens="5")),
    Case("stream is a string", CHAT, chat(stream="yes")),
    Case("temperature is a string", CHAT, chat(temperature="hot")),
    Case("stop is a number", CHAT, chat(stop=5)),
    Case("stream_options is a list", CHAT, chat(stream=True, stream_options=[1])),
    Case("seed is a string", CHAT, chat(seed="abc")),
    Case("seed is a float", CHAT, chat(seed=1.5)),
    Case("seed past int64", CHAT, chat(seed=2**64)),
    Case("top_k past int64", CHAT, chat(top_k=2**70)),
    Case("anthropic max_tokens is a float", MESSAGES, anth(max_tokens=4.0)),
    # limits
    Case("max_tokens negative", CHAT, chat(max_tokens=-1)),
    Case("max_tokens zero", CHAT, chat(max_tokens=0)),
    Case("max_tokens huge", CHAT, chat(max_tokens=10**12), code="context_length_exceeded"),
    Case("max_tokens huge (streamed)", CHAT, chat(max_tokens=10**12, stream=True), code="context_length_exceeded"),
    Case("max_tokens past int64", COMPLETIONS, comp(max_tokens=2**80), code="context_length_exceeded"),
    Case("max_completion_tokens zero", CHAT, chat(max_completion_tokens=0)),
    Case("anthropic max_tokens zero", MESSAGES, anth(max_tokens=0)),
    Case("anthropic max_tokens missing", MESSAGES, {"model": "m", "messages": USER}),
    Case("temperature below 0", CHAT, chat(temperature=-0.1)),
    Case("temperature above 2", CHAT, chat(temperature=2.1)),
    Case("anthropic temperature above 1", MESSAGES, anth(temperature=1.5)),
    Case("top_p zero", CHAT, chat(top_p=0)),
    Case("top_p above 1", CHAT, chat(top_p=1.5)),
    Case("anthropic top_p negative", MESSAGES, anth(top_p=-0.5)),
    Case("top_k negative", CHAT, chat(top_k=-2)),
    Case("anthropic top_k negative", MESSAGES, anth(top_k=-1)),
    Case("repetition_penalty huge", CHAT, chat(repetition_penalty=1e308)),
    Case("repetition_penalty zero", CHAT, chat(repetition_penalty=0)),
    Case("presence_penalty out of range", CHAT, chat(presence_penalty=3)),
    Case("top_logprobs above 20", CHAT, chat(logprobs=True, top_logprobs=21)),
    Case("top_logprobs negative", CHAT, chat(logprobs=True, top_logprobs=-1)),
    Case("completions logprobs above 5", COMPLETIONS, comp(logprobs=6)),
    Case("completions logprobs negative", COMPLETIONS, comp(logprobs=-1)),
    Case("n=2", CHAT, chat(n=2)),
    Case("best_of=2", COMPLETIONS, comp(best_of=2)),
    Case("stop list too long", CHAT, chat(stop=["a", "b", "c", "d", "e"])),
    Case("empty stop string", CHAT, chat(stop=[""])),
    Case("stop_sequences too long", MESSAGES, anth(stop_sequences=[str(i) for i in range(17)])),
    # messages
    Case("unknown model", CHAT, chat(model="gpt-9"), status=404, code="model_not_found"),
    Case("unknown model (completions)", COMPLETIONS, comp(model="gpt-9"), status=404, code="model_not_found"),
    Case("empty messages", CHAT, chat(messages=[])),
    Case("empty messages (anthropic)", MESSAGES, anth(messages=[])),
    Case("messages missing", CHAT, {"max_tokens": 4}),
    Case("a message without content", CHAT, chat(messages=[{"role": "user"}])),
    Case("a message without content (anthropic)", MESSAGES, anth(messages=[{"role": "user"}])),
    Case("a message without a role", CHAT, chat(messages=[{"content": "hi"}])),
    Case("unknown role", CHAT, chat(messages=[{"role": "robot", "content": "beep"}])),
    Case("system role inside anthropic messages", MESSAGES, anth(messages=[{"role": "system", "content": "x"}])),
    Case("a message that is a string", CHAT, chat(messages=["hi"])),
    Case("10 MB single string under the limit", CHAT, chat(messages=[{"role": "user", "content": _TEN_MB}]),
         code="context_length_exceeded"),
    # nested garbage in content parts
    Case("text part whose text is an object", CHAT,
         chat(messages=[{"role": "user", "content": [{"type": "text", "text": {"a": [1, {"b": None}]}}]}])),
    Case("image part", CHAT,
         chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])),
    Case("parts nested in lists", CHAT, chat(messages=[{"role": "user", "content": [[["x"]]]}])),
    Case("parts that are numbers", MESSAGES, anth(messages=[{"role": "user", "content": [1, 2]}])),
    Case("part without a type", MESSAGES, anth(messages=[{"role": "user", "content": [{"text": "x"}]}])),
    Case("system blocks of garbage", MESSAGES, anth(system=[[[]]])),
    Case("count_tokens with garbage content", COUNT, {"model": "m", "messages": [{"role": "user", "content": {}}]}),
    # completions prompts
    Case("empty prompt", COMPLETIONS, comp(prompt="")),
    Case("empty token list", COMPLETIONS, comp(prompt=[])),
    Case("negative token id", COMPLETIONS, comp(prompt=[-1, 5])),
    Case("token id past the vocabulary", COMPLETIONS, comp(prompt=[10**9])),
    Case("two prompts", COMPLETIONS, comp(prompt=["a", "b"])),
    Case("mixed prompt list", COMPLETIONS, comp(prompt=["a", 1])),
    Case("prompt missing", COMPLETIONS, {"max_tokens": 4}),
    # what the server does not do yet, and logit_bias out of range
    Case("tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}])),
    Case("tool_choice required", CHAT, chat(tool_choice="required")),
    Case("response_format of an unknown type", CHAT, chat(response_format={"type": "yaml"})),
    Case("response_format json_schema without json_schema (completions)", COMPLETIONS,
         comp(response_format={"type": "json_schema"})),
    Case("response_format with a schema the grammar refuses", CHAT,
         chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}})),
    Case("functions", CHAT, chat(functions=[{"name": "f"}])),
    Case("a tool message without its call id", CHAT, chat(messages=[{"role": "tool", "content": "x"}])),
    Case("tool_calls on a user message", CHAT, chat(messages=[{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}])),
    Case("tool arguments that are not a JSON object", CHAT, chat(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}]}])),
    Case("tool_choice naming a missing tool", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                        tool_choice={"type": "function", "function": {"name": "g"}})),
    Case("top_logprobs without logprobs", CHAT, chat(top_logprobs=2)),
    Case("logit_bias past 100", CHAT, chat(logit_bias={"5": 100.5})),
    Case("logit_bias key not an id", COMPLETIONS, comp(logit_bias={"x": 1})),
    Case("logit_bias id past the vocabulary", CHAT, chat(logit_bias={str(10**9): 1})),
    Case("logit_bias is a list", CHAT, chat(logit_bias=[[5, 1]])),
    Case("anthropic tools", MESSAGES, anth(tools=[{"name": "f", "input_schema": {"type": "object"}}])),
    Case("anthropic thinking enabled", MESSAGES, anth(thinking={"type": "enabled", "budget_tokens": 1024})),
    Case("anthropic tool_result block on an assistant turn", MESSAGES,
         anth(messages=USER + [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                                   "content": "x"}]}])),
    Case("anthropic tool_result with an image", MESSAGES,
         anth(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                      "content": [{"type": "image", "source": {}}]}]}])),
    Case("count_tokens with a server tool", COUNT,
         {"model": "m", "messages": USER, "tools": [{"name": "f", "type": "bash_20250124",
                                                     "input_schema": {"type": "object"}}]}),
    Case("anthropic thinking without a budget", MESSAGES, anth(thinking={"type": "enabled"})),
    Case("a prefill ending in whitespace", MESSAGES, anth(messages=USER + [{"role": "assistant", "content": "A "}])),
    # routes and methods
    Case("GET on a POST route", CHAT, method="GET", status=405, code="method_not_allowed"),
    Case("GET on /v1/messages", MESSAGES, method="GET", status=405),
    Case("PUT on /v1/completions", COMPLETIONS, comp(), method="PUT", status=405),
    Case("unknown route", "/v1/nothing", {}, status=404, code="not_found"),
    Case("unknown model id", "/v1/models/gpt-9", method="GET", status=404, code="model_not_found"),
    Case("slot id not an int", "/slots/abc?action=erase"),
    Case("unknown slot action", "/slots/0?action=explode"),
    Case("unknown action on all slots", "/slots?action=explode"),
    Case("metrics in an unknown format", "/metrics?format=xml", method="GET"),
]

EDGE_CASES: list[Case] = [
    Case("seed at int64 max", CHAT, chat(seed=2**63 - 1), status=200),
    Case("negative seed", CHAT, chat(seed=-(2**63)), status=200),
    Case("top_k at int64 max", CHAT, chat(top_k=2**63 - 1), status=200),
    Case("top_k -1 (off)", CHAT, chat(top_k=-1), status=200),
    Case("repetition_penalty at its bound", CHAT, chat(repetition_penalty=10.0), status=200),
    Case("temperature 2", CHAT, chat(temperature=2, top_p=1e-9, min_p=1.0), status=200),
    Case("temperature 1e-300", CHAT, chat(temperature=1e-300, seed=3), status=200),
    Case("anthropic temperature 5e-324", MESSAGES, anth(temperature=5e-324), status=200),
    Case("logprobs at their bounds", CHAT, chat(logprobs=True, top_logprobs=20), status=200),
    Case("completions logprobs 5", COMPLETIONS, comp(logprobs=5, prompt=[1, 2, 3]), status=200),
    Case("NUL and a surrogate pair", CHAT, chat(messages=[{"role": "user", "content": "a\x00b \U0001F600"}]),
         status=200),
    Case("an assistant turn without content", CHAT,
         chat(messages=USER + [{"role": "assistant"}, {"role": "user", "content": "again"}]), status=200),
    Case("logit_bias at its bounds", CHAT, chat(logit_bias={"0": -100, "5": 100, "7": 0.5}), status=200),
    Case("no-op tool and format fields", CHAT,
         chat(tools=[], tool_choice="none", parallel_tool_calls=True, response_format={"type": "text"}), status=200),
    Case("anthropic no-op tool and thinking fields", MESSAGES,
         anth(tools=[], tool_choice={"type": "auto"}, thinking={"type": "disabled"}), status=200),
    Case("anthropic prefill", MESSAGES, anth(messages=USER + [{"role": "assistant", "content": "Sure:"}]),
         status=200),
    Case("anthropic text blocks", MESSAGES,
         anth(system=[{"type": "text", "text": "Be brief."}],
              messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], top_k=2**63 - 1),
         status=200),
]


def send(client: httpx.Client, url: str, case: Case) -> httpx.Response:
    headers = {"content-type": "application/json", **case.headers}
    return client.request(case.method, url + case.path, content=case.content(), headers=headers)


def error_message(case: Case, resp: httpx.Response) -> str:
    """The message of a JSON error in the route family's shape (asserts the shape)."""
    body = resp.json()
    if case.path.startswith("/v1/messages"):
        assert body["type"] == "error" and isinstance(body["error"]["type"], str), body
        message = body["error"]["message"]
        if case.code:
            assert message.startswith(case.code + ":"), message
    else:
        message = body["error"]["message"]
        if case.code:
            assert body["error"]["code"] == case.code, body
    assert isinstance(message, str) and message.strip(), body
    return message


def check_refused(client: httpx.Client, url: str, case: Case) -> None:
    resp = send(client, url, case)
    assert resp.status_code == case.status, (case.name, resp.status_code, resp.text[:300])
    assert resp.headers["content-type"].startswith("application/json"), (case.name, resp.headers)
    error_message(case, resp)


@pytest.fixture(scope="module")
def stack(tokenizer):
    with running_front(tokenizer, max_context=256, max_body_bytes=LIMIT) as s:
        yield s


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=60) as c:
        yield c


@pytest.mark.parametrize("case", HAND_CASES, ids=[c.name for c in HAND_CASES])
def test_bad_input_is_a_4xx_with_a_message_and_starts_nothing(env, client, case):
    check_refused(client, env.url, case)
    assert env.engine.requests == [] and env.engine.running == 0


@pytest.mark.parametrize("case", EDGE_CASES, ids=[c.name for c in EDGE_CASES])
def test_extreme_but_valid_input_is_served(env, client, case):
    resp = send(client, env.url, case)
    assert resp.status_code == 200, (case.name, resp.text[:300])
    (req,) = env.engine.requests
    assert env.engine.wait_closed(req.request_id, 5)


@pytest.mark.parametrize("path,body", [(CHAT, chat(temperature=1e-300)), (MESSAGES, anth(temperature=9e-6))])
def test_a_temperature_too_small_for_float32_is_sent_as_greedy(env, client, path, body):
    assert client.post(env.url + path, json=body).status_code == 200
    (req,) = env.engine.requests
    assert req.sampling["temperature"] == 0.0


def test_a_chunked_body_over_the_limit_is_413(env):
    def chunks():
        for _ in range(LIMIT // 65536 + 2):
            yield b" " * 65536

    resp = httpx.post(env.url + CHAT, content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    assert env.engine.requests == []


def test_the_server_still_serves_after_every_bad_case(env, client):
    for case in HAND_CASES[:10]:
        send(client, env.url, case)
    resp = client.post(env.url + CHAT, json=chat())
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"]


def test_a_large_prompt_is_tokenized_off_the_event_loop(env):
    """Front.encode gives the tokenizer's ids, and the loop keeps turning while a large text is encoded."""
    front: Front = env.app.state.front
    text = "the pool holds chunks of cells " * (4 * LARGE_TEXT_CHARS // 31)

    async def run() -> tuple[list[int], int]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        start = ticks
        ids = await front.encode(text)
        stop.set()
        await task
        return ids, ticks - start

    t0 = time.perf_counter()
    context, env.engine.max_context = env.engine.max_context, 1 << 20  # a context the text can fit
    try:
        ids, ticks = asyncio.run(run())
    finally:
        env.engine.max_context = context
    assert ids == env.tokenizer.encode(text)
    assert ticks > 10, f"the event loop turned {ticks} times in {time.perf_counter() - t0:.3f} s"
    assert front.tokenizer.encode("short") == asyncio.run(front.encode("short"))
