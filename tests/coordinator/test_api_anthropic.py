"""The Anthropic routes over a real uvicorn server and the official `anthropic` client (FakeEngine behind)."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from coordinator.engine import EngineError
from tests.coordinator.fake_engine import SCRIPT_TEXT, parse_sse, running_front

SYSTEM = "Be brief."
MSGS = [{"role": "user", "content": "Say hello."}]
TEMPLATE_MSGS = [{"role": "system", "content": SYSTEM}, *MSGS]


@pytest.fixture(scope="module")
def stack(tokenizer):
    with running_front(tokenizer, max_context=256) as s:
        yield s


@pytest.fixture
def client(ant) -> anthropic.Anthropic:
    return ant


def script_text(env, n: int | None = None) -> str:
    return env.tokenizer.decode(env.engine.script[:n])


def post(env, body, path: str = "/v1/messages") -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body)
    return httpx.post(env.url + path, content=data, headers={"content-type": "application/json"}, timeout=10)


def test_message_not_streamed(env, client):
    env.engine.cached_tokens = 4
    # This client version no longer has sampling keywords; the server still reads them from the body.
    msg = client.messages.create(model="claude-anything", max_tokens=100, system=SYSTEM, messages=MSGS,
                                 extra_body={"temperature": 0.3, "top_p": 0.8, "top_k": 20})
    prompt = env.tokenizer.chat_ids(TEMPLATE_MSGS)
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == SCRIPT_TEXT
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.role == "assistant" and msg.model == "tiny-test" and msg.id.startswith("msg_")
    assert msg.usage.input_tokens == len(prompt) - 4
    assert msg.usage.cache_read_input_tokens == 4
    assert msg.usage.output_tokens == len(env.engine.script)
    (req,) = env.engine.requests
    assert req.prompt == prompt and req.max_tokens == 100
    assert (req.sampling["temperature"], req.sampling["top_p"], req.sampling["top_k"]) == (0.3, 0.8, 20)
    assert env.engine.wait_closed(msg.id, 2)


def test_content_blocks_and_system_blocks(env, client):
    client.messages.create(
        model="m", max_tokens=10,
        system=[{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hello."}]}],
    )
    joined = [{"role": "system", "content": "Be\nbrief."}, {"role": "user", "content": "Say\nhello."}]
    assert env.engine.requests[-1].prompt == env.tokenizer.chat_ids(joined)


def test_message_streamed_events_in_order(env, client):
    with client.messages.stream(model="m", max_tokens=100, system=SYSTEM, messages=MSGS) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == SCRIPT_TEXT
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(env.engine.script)
    raw = post(env, {"model": "m", "max_tokens": 100, "messages": MSGS, "stream": True})
    events = parse_sse(raw.text)
    kinds = [e for e, _ in events]
    n_deltas = kinds.count("content_block_delta")
    assert n_deltas >= 2
    assert kinds == ["message_start", "content_block_start", "ping", *["content_block_delta"] * n_deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    datas = [json.loads(d) for _, d in events]
    assert all(d["type"] == k for d, k in zip(datas, kinds))
    assert datas[0]["message"]["usage"]["input_tokens"] == len(env.tokenizer.chat_ids(MSGS))
    assert "".join(d["delta"]["text"] for d in datas if d["type"] == "content_block_delta") == SCRIPT_TEXT
    assert datas[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert datas[-2]["usage"]["output_tokens"] == len(env.engine.script)


def test_max_tokens_and_truncation_stop_reason(env, client):
    msg = client.messages.create(model="m", max_tokens=5, messages=MSGS)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 5
    assert msg.content[0].text == script_text(env, 5)
    env.engine.truncate_after = 2
    msg = client.messages.create(model="m", max_tokens=50, messages=MSGS)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 2


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(env, client, stream):
    stops = ["zzz", " chunks", "chunks."]
    expected = SCRIPT_TEXT[: SCRIPT_TEXT.index(" chunks")]
    if stream:
        with client.messages.stream(model="m", max_tokens=100, messages=MSGS, stop_sequences=stops) as s:
            text = "".join(s.text_stream)
            msg = s.get_final_message()
    else:
        msg = client.messages.create(model="m", max_tokens=100, messages=MSGS, stop_sequences=stops)
        text = msg.content[0].text
    assert text == expected
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == " chunks"
    assert env.engine.wait_closed(env.engine.requests[-1].request_id, 2)


def test_count_tokens(env, client):
    got = client.messages.count_tokens(model="m", system=SYSTEM, messages=MSGS)
    assert got.input_tokens == len(env.tokenizer.chat_ids(TEMPLATE_MSGS))
    assert env.engine.requests == []


@pytest.mark.parametrize("stream", [False, True])
def test_kv_pool_full_is_503_overloaded(env, client, stream):
    env.engine.refuse = EngineError.kv_pool_full(300, 12, retry_after=9)
    with pytest.raises(anthropic.ServiceUnavailableError) as exc:
        if stream:
            with client.messages.stream(model="m", max_tokens=10, messages=MSGS) as s:
                list(s.text_stream)
        else:
            client.messages.create(model="m", max_tokens=10, messages=MSGS)
    err = exc.value
    assert err.status_code == 503
    assert err.response.headers["retry-after"] == "9"
    assert err.body["type"] == "error"
    assert err.body["error"]["type"] == "overloaded_error"
    assert "kv_pool_full" in err.body["error"]["message"]


def test_error_mid_stream_is_an_error_event(env, client):
    env.engine.fail_after = 3
    got = []
    with pytest.raises(anthropic.APIStatusError) as exc:
        with client.messages.stream(model="m", max_tokens=100, messages=MSGS) as s:
            for piece in s.text_stream:
                got.append(piece)
    assert exc.value.body["error"]["type"] == "overloaded_error"
    assert "kv_pool_full" in exc.value.body["error"]["message"]
    assert "".join(got) == script_text(env, 3)
    events = parse_sse(post(env, {"model": "m", "max_tokens": 100, "messages": MSGS, "stream": True}).text)
    assert events[-1][0] == "error"
    assert json.loads(events[-1][1])["error"]["type"] == "overloaded_error"
    assert "message_stop" not in [e for e, _ in events]


@pytest.mark.parametrize("body, words", [
    ({"model": "m", "messages": MSGS}, "max_tokens: Field required"),
    ({"model": "m", "max_tokens": 10, "messages": []}, "messages"),
    ({"model": "m", "max_tokens": 10, "messages": MSGS, "temperature": 1.5}, "temperature"),
    ({"model": "m", "max_tokens": 10, "messages": MSGS, "stop_sequences": ["s"] * 17}, "at most 16"),
    ({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "'image'"),
    ({"model": "m", "max_tokens": 1000, "messages": MSGS}, "256"),
    (b'{"model": "m",', "not valid JSON"),
])
def test_bad_requests_are_400_in_anthropic_shape(env, body, words):
    r = post(env, body)
    assert r.status_code == 400
    got = r.json()
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
    assert words in got["error"]["message"]
    assert env.engine.requests == []


def test_client_raises_bad_request(env, client):
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model="m", max_tokens=1000, messages=MSGS)
    assert "context_length_exceeded" in exc.value.body["error"]["message"]


def test_disconnect_closes_the_engine_iterator(env):
    env.engine.hang_after = 2
    with httpx.stream("POST", env.url + "/v1/messages", timeout=10,
                      json={"model": "m", "max_tokens": 100, "messages": MSGS, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("event: content_block_delta"):
                break
    rid = env.engine.requests[-1].request_id
    assert env.engine.wait_closed(rid, 2)


def test_api_key_enforced(tokenizer):
    with running_front(tokenizer, api_key="sekret") as s:
        with pytest.raises(anthropic.AuthenticationError) as exc:
            anthropic.Anthropic(base_url=s.url, api_key="wrong", max_retries=0).messages.create(
                model="m", max_tokens=5, messages=MSGS)
        assert exc.value.body["error"]["type"] == "authentication_error"
        good = anthropic.Anthropic(base_url=s.url, api_key="sekret", max_retries=0)
        assert good.messages.create(model="m", max_tokens=5, messages=MSGS).usage.output_tokens == 5
        assert good.messages.count_tokens(model="m", messages=MSGS).input_tokens > 0


# ---- what is not supported yet, and the no-op values clients send --------------------------------------
TOOL = {"name": "get_weather", "description": "Weather", "input_schema": {"type": "object", "properties": {}}}
TOOL_TURNS = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "20 C"}]},
]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("patch, words", [
    ({"tool_choice": {"type": "any"}}, "tool_choice: type 'any' needs `tools`"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens: Input should be greater than"),
    ({"thinking": {"type": "adaptive"}}, "thinking.type:"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config:"),
    ({"speed": "fast"}, "speed:"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content: content[0] has type 'image': images are not supported"),
    ({"messages": [TOOL_TURNS[0], {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]},
     "messages.1.content: content[0] has type 'redacted_thinking'"),
    ({"messages": [{"role": "user", "content": [TOOL_TURNS[1]["content"][0]]}]},
     "type 'tool_use', which a user message cannot hold"),
])
def test_what_is_not_supported_yet_is_a_400_in_anthropic_shape(env, path, patch, words):
    r = post(env, {"model": "m", "max_tokens": 10, "messages": MSGS, **patch}, path=path)
    assert r.status_code == 400
    got = r.json()
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
    assert words in got["error"]["message"], got
    assert env.engine.requests == []


@pytest.mark.parametrize("patch", [{"service_tier": "priority"}, {"container": "c-1"}, {"inference_geo": "eu"},
                                   {"mcp_servers": [{"type": "url", "url": "x", "name": "m"}]}])
def test_what_only_messages_take_is_refused_there(env, patch):
    r = post(env, {"model": "m", "max_tokens": 10, "messages": MSGS, **patch})
    assert r.status_code == 400 and next(iter(patch)) + ":" in r.json()["error"]["message"]


def test_values_that_ask_for_nothing_are_served(env, client):
    msg = client.messages.create(model="m", max_tokens=100, system=SYSTEM, messages=MSGS, tools=[],
                                 tool_choice={"type": "none"}, thinking={"type": "disabled"},
                                 metadata={"user_id": "u-1"}, service_tier="auto",
                                 extra_body={"cache_control": {"type": "ephemeral"}})
    assert msg.content[0].text == SCRIPT_TEXT
    assert env.engine.requests[-1].prompt == env.tokenizer.chat_ids(TEMPLATE_MSGS, enable_thinking=False)
    marked = [{"type": "text", "text": "Say hello.", "cache_control": {"type": "ephemeral"}}]
    client.messages.create(model="m", max_tokens=10, system=SYSTEM, messages=[{"role": "user", "content": marked}])
    assert env.engine.requests[-1].prompt == env.tokenizer.chat_ids(TEMPLATE_MSGS)


# ---- usage: the stream's start agrees with its end and with the whole answer ---------------------------
def test_stream_usage_at_the_start_agrees_with_the_end(env, client):
    env.engine.cached_tokens = 4
    prompt = len(env.tokenizer.chat_ids(TEMPLATE_MSGS))
    whole = client.messages.create(model="m", max_tokens=100, system=SYSTEM, messages=MSGS).usage
    raw = post(env, {"model": "m", "max_tokens": 100, "system": SYSTEM, "messages": MSGS, "stream": True})
    datas = [json.loads(d) for _, d in parse_sse(raw.text)]
    start, end = datas[0]["message"]["usage"], datas[-2]["usage"]
    split = {"input_tokens": prompt - 4, "cache_read_input_tokens": 4, "cache_creation_input_tokens": 0}
    assert {k: start[k] for k in split} == {k: end[k] for k in split} == split
    assert (whole.input_tokens, whole.cache_read_input_tokens) == (prompt - 4, 4)
    assert start["output_tokens"] == 0 and end["output_tokens"] == whole.output_tokens == len(env.engine.script)
    with client.messages.stream(model="m", max_tokens=100, system=SYSTEM, messages=MSGS) as s:
        final = s.get_final_message()
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (prompt - 4, 4)


def test_stream_start_without_the_engines_cache_split_reports_the_whole_prompt(env):
    env.engine.cached_tokens, env.engine.cached_at_start = 4, False
    raw = post(env, {"model": "m", "max_tokens": 100, "messages": MSGS, "stream": True})
    datas = [json.loads(d) for _, d in parse_sse(raw.text)]
    prompt = len(env.tokenizer.chat_ids(MSGS))
    assert datas[0]["message"]["usage"]["input_tokens"] == prompt
    assert datas[0]["message"]["usage"]["cache_read_input_tokens"] == 0
    assert datas[-2]["usage"]["input_tokens"] + datas[-2]["usage"]["cache_read_input_tokens"] == prompt


@pytest.mark.parametrize("stream", [False, True])
def test_output_tokens_after_a_stop_sequence_cover_the_text_returned(env, client, stream):
    stop = " chunks"
    text = SCRIPT_TEXT[: SCRIPT_TEXT.index(stop)]
    returned = [t for i, t in enumerate(env.engine.script)
                if len(env.tokenizer.decode(env.engine.script[:i])) < len(text)]
    if stream:
        with client.messages.stream(model="m", max_tokens=100, messages=MSGS, stop_sequences=[stop]) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(model="m", max_tokens=100, messages=MSGS, stop_sequences=[stop])
    assert msg.content[0].text == text
    assert msg.usage.output_tokens == len(returned)


# ---- a final assistant message is a prefill ------------------------------------------------------------
def test_a_final_assistant_message_is_continued(env, client):
    prefill = "The best answer is ("
    msgs = MSGS + [{"role": "assistant", "content": prefill}]
    client.messages.create(model="m", max_tokens=10, messages=msgs)
    rendered = env.tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
    want = env.tokenizer.encode(rendered[: rendered.rindex(prefill) + len(prefill)])
    assert env.engine.requests[-1].prompt == want
    assert env.tokenizer.decode(want).endswith("<|im_start|>assistant\n" + prefill)
    assert client.messages.count_tokens(model="m", messages=msgs).input_tokens == len(want)
    # An empty one asks for nothing: the assistant turn simply starts.
    client.messages.create(model="m", max_tokens=10, messages=MSGS + [{"role": "assistant", "content": ""}])
    assert env.engine.requests[-1].prompt == env.tokenizer.chat_ids(MSGS)
    r = post(env, {"model": "m", "max_tokens": 10, "messages": MSGS + [{"role": "assistant", "content": "So "}]})
    assert r.status_code == 400 and "whitespace" in r.json()["error"]["message"]


def test_a_stream_event_never_holds_a_character_a_line_splitter_breaks_at():
    from coordinator.api_anthropic import sse_event

    text = "a\u2028b\u2029c\x85d"
    lines = [x for x in sse_event("content_block_delta", {"delta": {"text": text}}).splitlines() if x]
    assert lines[0] == "event: content_block_delta" and len(lines) == 2
    assert json.loads(lines[1].removeprefix("data: "))["delta"]["text"] == text
