"""Constrained answers end to end: `strata up` (two CPU stages, the random tiny model) behind the official
clients. The random model writes noise on its own; a forced tool choice or a response format must still give a
call or a JSON document that parses and follows the schema, through the grammar mask on the last stage, in
whole and streamed answers, greedy and sampled. An unconstrained request running beside them is unchanged."""
from __future__ import annotations

import concurrent.futures as cf
import json

import pytest

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
MSGS = [{"role": "user", "content": "Where did the river run?"}]
SAMPLING = {"greedy": {"temperature": 0}, "sampled": {"temperature": 1.0, "seed": 11}}


@pytest.fixture(scope="module")
def server(strata_up):
    return strata_up(max_context=1024, kv_pool_tokens=4096, chunk_cells=32, prefill_chunk=64)


@pytest.fixture(autouse=True)
def clean(server):
    yield
    server.check_clean()


def valid_weather(args: dict) -> bool:
    return (set(args) == {"city", "days"} and isinstance(args["city"], str) and len(args["city"]) <= 12
            and isinstance(args["days"], int) and 1 <= args["days"] <= 9)


@pytest.mark.parametrize("sampling", SAMPLING.values(), ids=SAMPLING.keys())
def test_required_tool_choice_gives_valid_calls(server, sampling):
    resp = server.openai().chat.completions.create(model=server.model, messages=MSGS, tools=TOOLS,
                                                   tool_choice="required", max_tokens=120, **sampling)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        args = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "get_time")
        assert valid_weather(args) if call.function.name == "get_weather" else args["zone"] in ("UTC", "CET")


def test_a_named_tool_streamed(server):
    stream = server.openai().chat.completions.create(
        model=server.model, messages=MSGS, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=3, stream=True)
    names, args, finish = [], "", None
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            assert tc.index == 0
            if tc.function.name:
                names.append(tc.function.name)
            args += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    assert valid_weather(json.loads(args))


@pytest.mark.parametrize("sampling", SAMPLING.values(), ids=SAMPLING.keys())
def test_json_schema_response_format(server, sampling):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    resp = server.openai().chat.completions.create(model=server.model, messages=MSGS, response_format=fmt,
                                                   max_tokens=120, **sampling)
    assert resp.choices[0].finish_reason == "stop"
    assert valid_weather(json.loads(resp.choices[0].message.content))


def test_json_object_response_format(server):
    resp = server.openai().chat.completions.create(model=server.model, messages=MSGS, max_tokens=200,
                                                   response_format={"type": "json_object"}, temperature=0.7, seed=5)
    text = resp.choices[0].message.content
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # ran out of tokens inside the object: what was written is still a JSON object's beginning
        assert text.lstrip().startswith("{")


def test_anthropic_forced_tool(server):
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    msg = server.anthropic().messages.create(model="any", max_tokens=200, messages=MSGS, tools=tools,
                                             tool_choice={"type": "tool", "name": "get_time",
                                                          "disable_parallel_tool_use": True},
                                             extra_body={"temperature": 0})
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_time" and uses[0].input["zone"] in ("UTC", "CET")


def test_constrained_beside_free_request_leaves_it_unchanged(server):
    client = server.openai()
    free = dict(model=server.model, messages=[{"role": "user", "content": "Tell me about the mill."}],
                max_tokens=32, temperature=0)
    solo = client.chat.completions.create(**free).choices[0].message.content
    server.erase_all()
    with cf.ThreadPoolExecutor(3) as pool:
        forced = [pool.submit(client.chat.completions.create, model=server.model, messages=MSGS, tools=TOOLS,
                              tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                                  temperature=1.0, seed=s) for s in (1, 2)]
        together = pool.submit(client.chat.completions.create, **free)
        assert together.result().choices[0].message.content == solo
        for f in forced:
            assert f.result().choices[0].finish_reason == "tool_calls"


@pytest.fixture(scope="module")
def long_server(strata_up):
    return strata_up(max_context=2048, kv_pool_tokens=4096, chunk_cells=32, prefill_chunk=64)


def test_an_anthropic_thinking_budget_closes_the_section_and_the_answer_follows(long_server):
    """The random model does not close its section on its own: on the OpenAI route with thinking on and no
    budget it thinks until max_tokens (the control). With a budget of 1024 the section is cut there and a
    text block follows the thinking block."""
    msgs = [{"role": "user", "content": "Think it over."}]
    free = long_server.openai().chat.completions.create(
        model=long_server.model, messages=msgs, max_tokens=1200, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert free.choices[0].finish_reason == "length" and not free.choices[0].message.content
    assert free.choices[0].message.model_extra["reasoning_content"]
    resp = long_server.anthropic().messages.create(model="m", max_tokens=1200, messages=msgs,
                                                   thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in resp.content] == ["thinking", "text"], resp.content
    assert "</think>" not in resp.content[0].thinking and resp.content[1].text
    long_server.check_clean()
