"""The OpenAI routes over a real uvicorn server and the official `openai` client (FakeEngine behind)."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from coordinator.engine import EngineError
from tests.coordinator.fake_engine import SCRIPT_TEXT, parse_sse, running_front

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def stack(tokenizer):
    with running_front(tokenizer, max_context=256, max_body_bytes=16384) as s:
        yield s


@pytest.fixture
def client(oai) -> openai.OpenAI:
    return oai


def script_text(env, n: int | None = None) -> str:
    return env.tokenizer.decode(env.engine.script[:n])


def post(env, path: str, body, **kw) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(env.url + path, content=data, headers={"content-type": "application/json"}, timeout=10, **kw)


# ---- chat --------------------------------------------------------------------------------------------
def test_chat_not_streamed_text_usage_and_request(env, client):
    env.engine.cached_tokens = 5
    resp = client.chat.completions.create(model="tiny-test", messages=MSGS, temperature=0.5, top_p=0.9, seed=7,
                                          extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1})
    prompt = env.tokenizer.chat_ids(MSGS)
    assert script_text(env) == SCRIPT_TEXT
    choice = resp.choices[0]
    assert choice.message.content == SCRIPT_TEXT
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert resp.usage.prompt_tokens == len(prompt)
    assert resp.usage.completion_tokens == len(env.engine.script)
    assert resp.usage.total_tokens == len(prompt) + len(env.engine.script)
    assert resp.usage.prompt_tokens_details.cached_tokens == 5
    assert resp.model == "tiny-test" and resp.id.startswith("chatcmpl-")
    (req,) = env.engine.requests
    assert req.request_id == resp.id
    assert req.prompt == prompt
    assert req.max_tokens == 256 - len(prompt)  # default: what the prompt leaves of max_context
    assert req.stop_token_ids == frozenset(env.tokenizer.eos_ids)
    assert req.sampling == {"temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7,
                            "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.1,
                            "logit_bias": None}
    assert env.engine.wait_closed(resp.id, 2)


def test_chat_streamed(env, client):
    chunks = list(client.chat.completions.create(model="tiny-test", messages=MSGS, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == SCRIPT_TEXT
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)
    assert len({c.id for c in chunks}) == 1


def test_chat_stream_include_usage(env, client):
    env.engine.cached_tokens = 3
    chunks = list(client.chat.completions.create(model="tiny-test", messages=MSGS, stream=True, max_tokens=6,
                                                 stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.prompt_tokens == len(env.tokenizer.chat_ids(MSGS))
    assert last.usage.completion_tokens == 6
    assert last.usage.total_tokens == last.usage.prompt_tokens + 6
    assert last.usage.prompt_tokens_details.cached_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == script_text(env, 6)


def test_max_tokens_and_max_completion_tokens(env, client):
    resp = client.chat.completions.create(model="tiny-test", messages=MSGS, max_tokens=5)
    assert resp.choices[0].finish_reason == "length"
    assert resp.choices[0].message.content == script_text(env, 5)
    assert resp.usage.completion_tokens == 5
    resp = client.chat.completions.create(model="tiny-test", messages=MSGS, max_tokens=9, max_completion_tokens=4)
    assert resp.usage.completion_tokens == 4
    assert env.engine.requests[-1].max_tokens == 4


def test_truncated_reported_in_choice(env):
    env.engine.truncate_after = 3
    body = post(env, "/v1/chat/completions", {"model": "tiny-test", "messages": MSGS}).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["truncated"] is True
    assert body["usage"]["completion_tokens"] == 3
    raw = post(env, "/v1/chat/completions", {"model": "tiny-test", "messages": MSGS, "stream": True}).text
    closing = [json.loads(d) for _, d in parse_sse(raw) if d != "[DONE]"][-1]
    assert closing["choices"][0]["finish_reason"] == "length" and closing["choices"][0]["truncated"] is True
    ok = post(env, "/v1/chat/completions", {"model": "tiny-test", "messages": MSGS, "max_tokens": 2}).json()
    assert ok["choices"][0]["truncated"] is False


# ---- stop strings ------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_split_across_tokens_is_cut_and_frees_the_request(env, client, stream):
    # " pool h" spans the tokens ' p', 'o', 'o', 'l', ' h': it only appears across several pushes.
    stop = " pool h"
    expected = SCRIPT_TEXT[: SCRIPT_TEXT.index(stop)]
    if stream:
        chunks = list(client.chat.completions.create(model="tiny-test", messages=MSGS, stop=[stop, "zzz"],
                                                     stream=True, stream_options={"include_usage": True}))
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        text, finish = "".join(pieces), chunks[-2].choices[0].finish_reason
        usage, rid = chunks[-1].usage, chunks[0].id
        assert not any("pool" in p for p in pieces)
    else:
        resp = client.chat.completions.create(model="tiny-test", messages=MSGS, stop=stop)
        text, finish, usage, rid = resp.choices[0].message.content, resp.choices[0].finish_reason, resp.usage, resp.id
    assert text == expected
    assert finish == "stop"
    assert usage.completion_tokens < len(env.engine.script)  # the engine was not run to its end
    assert env.engine.wait_closed(rid, 2)


# ---- ignore_eos --------------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_ignore_eos_runs_past_the_eos_to_max_tokens(env, monkeypatch, route, stream):
    """The script says its text, an eos, then its text again: with ignore_eos the request carries no stop ids,
    the eos is generated and passed over (its text is a special token's: none), and max_tokens ends it."""
    script = list(env.engine.script)
    monkeypatch.setattr(env.engine, "script", script + [env.engine.eos] + script)
    limit = 2 * len(script) + 1
    path, body = (("/v1/chat/completions", {"messages": MSGS}) if route == "chat"
                  else ("/v1/completions", {"prompt": "Hi"}))
    body = {"model": "tiny-test", "max_tokens": limit, "stream": stream, **body}

    def run(**extra) -> tuple[str, str, int]:
        r = post(env, path, {**body, **extra, "stream_options": {"include_usage": True}} if stream else
                 {**body, **extra})
        assert r.status_code == 200
        if not stream:
            choice = r.json()["choices"][0]
            text = choice["message"]["content"] if route == "chat" else choice["text"]
            return text, choice["finish_reason"], r.json()["usage"]["completion_tokens"]
        events = [json.loads(d) for _, d in parse_sse(r.text) if d != "[DONE]"]
        text = "".join((c["delta"].get("content") or "") if route == "chat" else c["text"]
                       for e in events for c in e["choices"])
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        return text, finish[-1], events[-1]["usage"]["completion_tokens"]

    assert run() == (SCRIPT_TEXT, "stop", len(script))
    assert env.engine.requests[-1].stop_token_ids == frozenset(env.tokenizer.eos_ids) != frozenset()
    assert run(ignore_eos=False)[1] == "stop"
    assert run(ignore_eos=True) == (SCRIPT_TEXT + SCRIPT_TEXT, "length", limit)
    assert env.engine.requests[-1].stop_token_ids == frozenset()
    assert env.engine.requests[-1].max_tokens == limit


def test_ignore_eos_keeps_stop_strings(env, client):
    resp = client.chat.completions.create(model="tiny-test", messages=MSGS, stop=" pool h",
                                          extra_body={"ignore_eos": True})
    assert resp.choices[0].message.content == SCRIPT_TEXT[: SCRIPT_TEXT.index(" pool h")]
    assert resp.choices[0].finish_reason == "stop"
    assert env.engine.requests[-1].stop_token_ids == frozenset()


@pytest.mark.parametrize("value", ["true", 1, None, [True]])
@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": MSGS}),
                                        ("/v1/completions", {"prompt": "Hi"})])
def test_ignore_eos_must_be_a_bool(env, path, body, value):
    r = post(env, path, {"model": "tiny-test", "ignore_eos": value, **body})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "ignore_eos" and "valid boolean" in err["message"]
    assert env.engine.requests == []


# ---- completions -------------------------------------------------------------------------------------
def test_completions_string_and_token_prompt(env, client):
    resp = client.completions.create(model="tiny-test", prompt="The pool", max_tokens=7)
    assert resp.choices[0].text == script_text(env, 7)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(env.tokenizer.encode("The pool"))
    assert env.engine.requests[-1].prompt == env.tokenizer.encode("The pool")
    resp = client.completions.create(model="tiny-test", prompt=[5, 6, 7], max_tokens=3)
    assert env.engine.requests[-1].prompt == [5, 6, 7]
    assert resp.usage.prompt_tokens == 3 and resp.usage.completion_tokens == 3


def test_completions_streamed_with_usage(env, client):
    chunks = list(client.completions.create(model="tiny-test", prompt="Hi", stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == SCRIPT_TEXT
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(env.engine.script)


def test_chat_logprobs(env, client):
    resp = client.chat.completions.create(model="tiny-test", messages=MSGS, max_tokens=4, logprobs=True,
                                          top_logprobs=2)
    assert env.engine.requests[-1].logprobs == 2
    content = resp.choices[0].logprobs.content
    assert [c.token for c in content] == [env.tokenizer.decode([t]) for t in env.engine.script[:4]]
    assert all(c.logprob == -0.25 and len(c.top_logprobs) == 2 for c in content)
    assert content[0].top_logprobs[1].logprob == -2.0
    plain = client.chat.completions.create(model="tiny-test", messages=MSGS, max_tokens=2)
    assert plain.choices[0].logprobs is None and env.engine.requests[-1].logprobs == 0


def test_completion_logprobs_legacy_shape(env, client):
    toks = [env.tokenizer.decode([t]) for t in env.engine.script[:3]]
    offsets = [0, len(toks[0]), len(toks[0]) + len(toks[1])]
    lp = client.completions.create(model="tiny-test", prompt="Hi", max_tokens=3, logprobs=2).choices[0].logprobs
    assert lp.tokens == toks and lp.token_logprobs == [-0.25] * 3 and lp.text_offset == offsets
    assert all(len(top) == 2 for top in lp.top_logprobs)
    chunks = client.completions.create(model="tiny-test", prompt="Hi", max_tokens=3, logprobs=1, stream=True)
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert sum((x.tokens for x in streamed), []) == toks
    assert sum((x.text_offset for x in streamed), []) == offsets


# ---- errors ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("patch, param, words", [
    ({"temperature": "hot"}, "temperature", "valid number"),
    ({"max_tokens": 1.5}, "max_tokens", "integer"),
    ({"n": 2}, "n", "n=1"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "'user'"),
    ({"top_logprobs": 99}, "top_logprobs", "20"),
])
def test_bad_fields_are_400_naming_the_field(env, patch, param, words):
    r = post(env, "/v1/chat/completions", {"model": "tiny-test", "messages": MSGS, **patch})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert err["message"].startswith(param) and words in err["message"]
    assert env.engine.requests == []


def test_bad_body_400_invalid_json_and_413(env):
    r = post(env, "/v1/chat/completions", b'{"model": "tiny-test", "messages": [')
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = post(env, "/v1/completions", b'[1, 2]')
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = post(env, "/v1/chat/completions", {"model": "tiny-test", "messages": [{"role": "user", "content": "x" * 20000}]})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_client_raises_bad_request(env, client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny-test", messages=MSGS, n=2)
    assert exc.value.status_code == 400 and exc.value.param == "n"


def test_context_length_exceeded_names_both_numbers(env, client):
    prompt = len(env.tokenizer.chat_ids(MSGS))
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny-test", messages=MSGS, max_tokens=300)
    assert exc.value.code == "context_length_exceeded"
    assert "256" in exc.value.message and str(prompt + 300) in exc.value.message
    r = post(env, "/v1/completions", {"model": "tiny-test", "prompt": list(range(1, 257))})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "256" in r.json()["error"]["message"]
    assert env.engine.requests == []


def test_unknown_model_404_and_models_list(env, client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-99", messages=MSGS)
    assert exc.value.code == "model_not_found"
    assert [m.id for m in client.models.list()] == ["tiny-test"]


@pytest.mark.parametrize("stream", [False, True])
def test_kv_pool_full_is_503_with_retry_after(env, client, stream):
    env.engine.refuse = EngineError.kv_pool_full(300, 12, retry_after=7)
    with pytest.raises(openai.InternalServerError) as exc:
        out = client.chat.completions.create(model="tiny-test", messages=MSGS, stream=stream)
        list(out) if stream else None
    assert exc.value.status_code == 503
    assert exc.value.response.headers["retry-after"] == "7"
    assert exc.value.code == "kv_pool_full"
    assert exc.value.body["type"] == "server_error"


def test_error_mid_stream_is_an_error_event_then_done(env, client):
    env.engine.fail_after = 3
    got = []
    with pytest.raises(openai.APIError) as exc:
        for c in client.chat.completions.create(model="tiny-test", messages=MSGS, stream=True):
            got.append(c.choices[0].delta.content or "")
    assert exc.value.body["code"] == "kv_pool_full"
    assert "".join(got) == script_text(env, 3)
    raw = post(env, "/v1/chat/completions", {"model": "tiny-test", "messages": MSGS, "stream": True})
    events = parse_sse(raw.text)
    assert raw.status_code == 200 and events[-1] == (None, "[DONE]")
    assert json.loads(events[-2][1])["error"]["code"] == "kv_pool_full"


# ---- disconnects -------------------------------------------------------------------------------------
def test_disconnect_mid_stream_closes_the_engine_iterator(env):
    env.engine.hang_after = 2
    with httpx.stream("POST", env.url + "/v1/chat/completions", timeout=10,
                      json={"model": "tiny-test", "messages": MSGS, "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        rid = json.loads(first[5:])["id"]
        assert rid not in env.engine.closed
    t0 = time.monotonic()
    assert env.engine.wait_closed(rid, 2), "the engine iterator was not closed after the client left"
    assert time.monotonic() - t0 < 2


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_before_first_token_closes_the_engine_iterator(env, stream):
    env.engine.hang_after = 0  # queued or prefilling: nothing sent yet
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(env.url + "/v1/chat/completions", timeout=0.5,
                   json={"model": "tiny-test", "messages": MSGS, "stream": stream})
    rid = env.engine.requests[-1].request_id
    assert env.engine.wait_closed(rid, 2)


# ---- other routes ------------------------------------------------------------------------------------
def test_health_slots_and_unknown_route(env):
    assert httpx.get(env.url + "/health").status_code == 200
    env.engine.stages_up = [True, False]
    r = httpx.get(env.url + "/health")
    assert r.status_code == 503 and r.json()["stages"][1]["up"] is False
    assert httpx.get(env.url + "/slots").json()[0]["n_ctx"] == 256
    r = httpx.get(env.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_api_key_enforced(tokenizer):
    with running_front(tokenizer, api_key="sekret") as s:
        url = s.url + "/v1"
        with pytest.raises(openai.AuthenticationError) as exc:
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"
        assert httpx.get(url + "/models").status_code == 401
        assert httpx.post(url + "/chat/completions", json={"messages": MSGS}).status_code == 401
        assert httpx.get(s.url + "/slots").status_code == 401
        good = openai.OpenAI(base_url=url, api_key="sekret", max_retries=0)
        assert good.chat.completions.create(model="tiny-test", messages=MSGS).choices[0].message.content == SCRIPT_TEXT
        assert httpx.get(url + "/models", headers={"x-api-key": "sekret"}).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200  # probes need no key
        assert httpx.get(s.url + "/metrics").status_code == 200


def test_slot_erase_actions(env):
    r = httpx.post(env.url + "/slots/0", params={"action": "erase"})
    assert r.status_code == 200 and r.json() == {"id_slot": 0, "n_erased": 7}
    assert httpx.post(env.url + "/slots", params={"action": "erase"}).json() == {"erased_cells": 96}
    r = httpx.post(env.url + "/slots/5", params={"action": "erase"})
    assert r.status_code == 400 and "slot 5" in r.json()["error"]["message"]
    r = httpx.post(env.url + "/slots/0", params={"action": "explode"})
    assert r.status_code == 400 and "action" in r.json()["error"]["message"]
    assert env.engine.erased == [0, "all"]


# ---- what is not supported yet, and the no-op values clients send --------------------------------------
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("patch, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [TOOL["function"]]}, "functions"),
    ({"function_call": {"name": "get_weather"}}, "function_call"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"verbosity": "low"}, "verbosity"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"store": True}, "store"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ({"min_tokens": 4}, "min_tokens"),
    ({"stop_token_ids": [5]}, "stop_token_ids"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": [{"role": "tool", "content": "20 C"}]}, "messages.0"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
])
def test_what_is_not_supported_yet_is_a_400_naming_it(env, patch, param):
    r = post(env, "/v1/chat/completions", {"model": "tiny-test", "messages": MSGS, **patch})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"].startswith(param + ": ")
    assert env.engine.requests == []


def test_values_that_ask_for_nothing_are_served(env, client):
    resp = client.chat.completions.create(
        model="tiny-test", messages=MSGS, tools=[], tool_choice="none", parallel_tool_calls=False,
        response_format={"type": "text"}, modalities=["text"], store=False, service_tier="auto", user="u-1",
        metadata={"team": "a"}, safety_identifier="s-1", prompt_cache_key="k", stream_options=None,
        extra_body={"functions": [], "function_call": "none", "min_tokens": 0, "skip_special_tokens": True,
                    "length_penalty": 1})
    assert resp.choices[0].message.content == SCRIPT_TEXT
    assert env.engine.requests[-1].prompt == env.tokenizer.chat_ids(MSGS)  # no tools rendered into the prompt
    # An assistant turn echoed back with the null fields of a response message is an ordinary turn.
    turn = {"role": "assistant", "content": "Hi.", "tool_calls": None, "function_call": None, "refusal": None,
            "audio": None}
    client.chat.completions.create(model="tiny-test", messages=MSGS + [turn, {"role": "user", "content": "More."}])
    assert env.engine.requests[-1].prompt == env.tokenizer.chat_ids(
        MSGS + [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "More."}])


# ---- logit_bias --------------------------------------------------------------------------------------
def test_logit_bias_reaches_the_engine_as_pairs(env, client):
    client.chat.completions.create(model="tiny-test", messages=MSGS, logit_bias={"17": 3, "5": -100})
    assert env.engine.requests[-1].sampling["logit_bias"] == [[5, -100.0], [17, 3.0]]
    client.completions.create(model="tiny-test", prompt="Hi", max_tokens=2, logit_bias={"9": 100})
    assert env.engine.requests[-1].sampling["logit_bias"] == [[9, 100.0]]
    client.chat.completions.create(model="tiny-test", messages=MSGS, logit_bias={})
    assert env.engine.requests[-1].sampling["logit_bias"] is None


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("bias, words", [
    ({"5": 101}, "[-100, 100]"),
    ({"5": -100.5}, "[-100, 100]"),
    ({"five": 1}, "token ids"),
    ({"-5": 1}, "token ids"),
    ({"5": "1"}, "valid number"),
    ({"100000": 1}, "outside the vocabulary"),
    ({str(i): 1 for i in range(301)}, "at most 300"),
])
def test_logit_bias_out_of_range_is_a_400_naming_it(env, path, bias, words):
    body = {"messages": MSGS} if path.endswith("chat/completions") else {"prompt": "Hi"}
    r = post(env, path, {"model": "tiny-test", "logit_bias": bias, **body})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"].startswith("logit_bias") and words in err["message"], err
    assert env.engine.requests == []


# ---- models ------------------------------------------------------------------------------------------
def test_models_retrieve(env, client):
    got = client.models.retrieve("tiny-test")
    assert got.id == "tiny-test" and got.object == "model" and got.owned_by == "strata"
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("gpt-99")
    assert exc.value.code == "model_not_found" and exc.value.param == "model"
    assert exc.value.body["type"] == "invalid_request_error"


def test_models_retrieve_a_name_with_a_slash(tokenizer):
    with running_front(tokenizer, model_name="org/tiny-test") as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=10)
        assert client.models.retrieve("org/tiny-test").id == "org/tiny-test"
        assert httpx.get(s.url + "/v1/models/org/other").status_code == 404


# ---- context length names the field that holds the prompt --------------------------------------------
def test_context_length_error_names_prompt_on_completions(env, client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny-test", prompt="Hi", max_tokens=300)
    assert exc.value.code == "context_length_exceeded" and exc.value.param == "prompt"
    r = post(env, "/v1/completions", {"model": "tiny-test", "prompt": list(range(1, 257))})
    assert r.json()["error"]["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny-test", messages=MSGS, max_tokens=300)
    assert exc.value.param == "messages"


# ---- after a stop string, usage and logprobs cover the tokens returned ----------------------------------
def tokens_before(env, stop: str) -> list[str]:
    """The script's token texts that start before `stop` does (the tokens of the text returned)."""
    cut, at, out = SCRIPT_TEXT.index(stop), 0, []
    for t in env.engine.script:
        if at >= cut:
            break
        out.append(env.tokenizer.decode([t]))
        at += len(out[-1])
    return out


@pytest.mark.parametrize("stop", [" pool h", "hunks"], ids=["at a token", "inside a token"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_after_a_stop_string_usage_and_logprobs_cover_only_the_tokens_returned(env, client, stop, stream):
    want = tokens_before(env, stop)
    text = SCRIPT_TEXT[: SCRIPT_TEXT.index(stop)]
    if stream:
        chunks = list(client.chat.completions.create(model="tiny-test", messages=MSGS, stop=stop, logprobs=True,
                                                     stream=True, stream_options={"include_usage": True}))
        got_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        usage = chunks[-1].usage
    else:
        resp = client.chat.completions.create(model="tiny-test", messages=MSGS, stop=stop, logprobs=True)
        got_text, entries, usage = resp.choices[0].message.content, resp.choices[0].logprobs.content, resp.usage
    assert got_text == text
    assert [e.token for e in entries] == want
    assert usage.completion_tokens == len(want)
    legacy = client.completions.create(model="tiny-test", prompt="Hi", stop=stop, logprobs=1)
    assert legacy.choices[0].text == text
    assert legacy.choices[0].logprobs.tokens == want and legacy.usage.completion_tokens == len(want)


def test_a_stream_event_never_holds_a_character_a_line_splitter_breaks_at():
    """Text with U+2028, U+2029 and U+0085 (JSON leaves them raw) goes out escaped, so a client that cuts the
    stream with str.splitlines (httpx's aiter_lines) still reads one event per data line, with the same text."""
    from coordinator.api_openai import sse_data

    text = "a\u2028b\u2029c\x85d\x0be\x1cf\u00e9\U0001f600"
    event = sse_data({"choices": [{"text": text}]})
    (line,) = [x for x in event.splitlines() if x]
    assert json.loads(line.removeprefix("data: "))["choices"][0]["text"] == text
    assert "\u00e9\U0001f600" in line  # other text stays UTF-8 as is
