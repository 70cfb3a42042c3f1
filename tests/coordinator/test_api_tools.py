"""Tools, reasoning and response formats on the HTTP routes, with the official `openai` and `anthropic` clients
over a real uvicorn server; the FakeEngine answers with scripted texts (what a model would write), so the
parsing, the shapes and the prompts are checked exactly. The constrained path through real stages is in
tests/integration/test_structured.py."""
from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.coordinator.fake_engine import running_front

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def stack(tokenizer):
    with running_front(tokenizer, max_context=2048) as s:
        yield s


def prompt_text(env) -> str:
    return env.tokenizer.decode(env.engine.requests[-1].prompt)


# ---- OpenAI ------------------------------------------------------------------------------------------
def test_tools_are_rendered_and_a_call_is_parsed(env, oai):
    env.engine.say(CALL)
    resp = oai.chat.completions.create(model="tiny-test", messages=MSGS, tools=TOOLS)
    want_prompt = env.tokenizer.apply_chat_template(MSGS, tools=TOOLS)
    assert prompt_text(env) == want_prompt and "<tools>" in want_prompt and '"get_time"' in want_prompt
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert env.engine.requests[-1].grammar is None  # "auto": the model decides


def test_content_and_parallel_calls(env, oai):
    env.engine.say("Let me check.\n" + CALL + "\n" + CALL2)
    msg = oai.chat.completions.create(model="tiny-test", messages=MSGS, tools=TOOLS).choices[0].message
    assert msg.content == "Let me check."
    assert [c.function.name for c in msg.tool_calls] == ["get_weather", "get_time"]
    assert len({c.id for c in msg.tool_calls}) == 2


def test_streamed_calls_match_the_whole_answer(env, oai):
    env.engine.say("Let me check.\n" + CALL + "\n" + CALL2)
    stream = oai.chat.completions.create(model="tiny-test", messages=MSGS, tools=TOOLS, stream=True)
    content, calls, finish = "", {}, None
    for chunk in stream:
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.id is not None:  # a call opens with its id, type and name, before any argument
                assert tc.index not in calls and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                calls[tc.index]["arguments"] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me check."
    assert finish == "tool_calls"
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 2} and json.loads(calls[1]["arguments"]) == {}


def test_tool_choice_none_renders_tools_but_parses_nothing(env, oai):
    env.engine.say(CALL)
    msg = oai.chat.completions.create(model="tiny-test", messages=MSGS, tools=TOOLS, tool_choice="none").choices[0]
    assert msg.message.content == CALL and not msg.message.tool_calls and msg.finish_reason == "stop"
    assert "<tools>" in prompt_text(env)


def test_an_unknown_tool_name_stays_text(env, oai):
    text = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    env.engine.say(text)
    msg = oai.chat.completions.create(model="tiny-test", messages=MSGS, tools=TOOLS).choices[0]
    assert msg.message.content == text and not msg.message.tool_calls and msg.finish_reason == "stop"


def test_history_with_calls_and_results_renders_through_the_template(env, oai):
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "20C, sunny"},
    ]
    oai.chat.completions.create(model="tiny-test", messages=history, tools=TOOLS)
    want = env.tokenizer.apply_chat_template(
        MSGS + [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "20C, sunny"}], tools=TOOLS)
    assert prompt_text(env) == want
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in want
    assert "<tool_response>\n20C, sunny\n</tool_response>" in want


def test_forced_choices_and_response_formats_carry_a_grammar(env, oai):
    for kw in ({"tools": TOOLS, "tool_choice": "required"},
               {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
               {"response_format": {"type": "json_object"}},
               {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER,
                                                                           "strict": True}}}):
        oai.chat.completions.create(model="tiny-test", messages=MSGS, **kw)
        assert env.engine.requests[-1].grammar, kw
    oai.chat.completions.create(model="tiny-test", messages=MSGS, response_format={"type": "text"})
    assert env.engine.requests[-1].grammar is None


@pytest.mark.parametrize("kw,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object",
                                                                 "properties": {"a": {"type": "no-such-type"}}}}}},
     "response_format"),
    ({"extra_body": {"chat_template_kwargs": {"tools": []}}}, "chat_template_kwargs"),
])
def test_bad_tool_fields_are_400s_naming_them(env, oai, kw, param):
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="tiny-test", messages=MSGS, **kw)
    assert exc.value.param == param, exc.value.message
    assert env.engine.requests == []


def test_reasoning_is_returned_apart(env, oai):
    env.engine.say("The user wants weather.\n</think>\n\nSunny.")
    resp = oai.chat.completions.create(model="tiny-test", messages=MSGS,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert prompt_text(env).endswith("<|im_start|>assistant\n<think>\n")
    msg = resp.choices[0].message
    assert msg.content == "Sunny." and msg.model_extra["reasoning_content"] == "The user wants weather.\n"
    stream = oai.chat.completions.create(model="tiny-test", messages=MSGS, stream=True,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    thought, answer = "", ""
    for chunk in stream:
        d = chunk.choices[0].delta
        thought += (d.model_extra or {}).get("reasoning_content") or ""
        answer += d.content or ""
    assert (thought, answer) == ("The user wants weather.\n", "Sunny.")


def test_thinking_off_writes_an_empty_section(env, oai):
    env.engine.say("Sunny.")
    resp = oai.chat.completions.create(model="tiny-test", messages=MSGS,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert prompt_text(env).endswith("<think>\n\n</think>\n\n")
    assert resp.choices[0].message.content == "Sunny."
    assert resp.choices[0].message.model_extra.get("reasoning_content") is None


# ---- Anthropic ---------------------------------------------------------------------------------------
A_TOOLS = [{"name": "get_weather", "description": "Weather by city", "input_schema": WEATHER},
           {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}]


def test_anthropic_tool_use(env, ant):
    env.engine.say("Checking.\n" + CALL)
    msg = ant.messages.create(model="any", max_tokens=400, messages=MSGS[1:], system="Be brief.", tools=A_TOOLS)
    assert msg.stop_reason == "tool_use"
    text, use = msg.content
    assert text.type == "text" and text.text == "Checking."
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris", "days": 2}
    assert use.id.startswith("toolu_")
    rendered = [{"type": "function", "function": {"name": t["name"], **({"description": t["description"]}
                                                                        if "description" in t else {}),
                                                  "parameters": t["input_schema"]}} for t in A_TOOLS]
    assert prompt_text(env) == env.tokenizer.apply_chat_template(MSGS, tools=rendered)


def test_anthropic_streamed_tool_use_matches(env, ant):
    env.engine.say("Checking.\n" + CALL + "\n" + CALL2)
    with ant.messages.stream(model="any", max_tokens=400, messages=MSGS[1:], tools=A_TOOLS) as stream:
        kinds = [e.type for e in stream if e.type in ("content_block_start", "content_block_stop")]
        final = stream.get_final_message()
    assert kinds == ["content_block_start", "content_block_stop"] * 3
    assert [b.type for b in final.content] == ["text", "tool_use", "tool_use"]
    assert final.content[0].text == "Checking."
    assert final.content[1].input == {"city": "Paris", "days": 2} and final.content[2].input == {}
    assert final.stop_reason == "tool_use"


def test_anthropic_tool_results_render_as_tool_messages(env, ant):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                                  {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": [{"type": "text", "text": "20C"}]},
                                             {"type": "text", "text": "And tomorrow?"}]}]
    ant.messages.create(model="any", max_tokens=50, messages=messages, tools=A_TOOLS)
    text = prompt_text(env)
    assert ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
            in text)
    assert "<|im_start|>user\n<tool_response>\n20C\n</tool_response><|im_end|>\n<|im_start|>user\nAnd tomorrow?" in text


def test_anthropic_forced_tool_carries_a_grammar(env, ant):
    ant.messages.create(model="any", max_tokens=50, messages=MSGS[1:], tools=A_TOOLS,
                        tool_choice={"type": "tool", "name": "get_time"})
    assert env.engine.requests[-1].grammar
    ant.messages.create(model="any", max_tokens=50, messages=MSGS[1:], tools=A_TOOLS, tool_choice={"type": "auto"})
    assert env.engine.requests[-1].grammar is None


def test_anthropic_thinking(env, ant):
    env.engine.say("Weather, then.\n</think>\n\nSunny.")
    msg = ant.messages.create(model="any", max_tokens=2000, messages=MSGS[1:],
                              thinking={"type": "enabled", "budget_tokens": 1024})
    assert prompt_text(env).endswith("<|im_start|>assistant\n<think>\n")
    thinking, text = msg.content
    assert thinking.type == "thinking" and thinking.thinking == "Weather, then.\n"
    assert text.type == "text" and text.text == "Sunny."
    assert env.engine.requests[-1].grammar  # the budget is a grammar
    with ant.messages.stream(model="any", max_tokens=2000, messages=MSGS[1:],
                             thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Weather, then.\n" and final.content[1].text == "Sunny."


def test_anthropic_without_thinking_does_not_think(env, ant):
    env.engine.say("Sunny.")
    msg = ant.messages.create(model="any", max_tokens=50, messages=MSGS[1:], thinking={"type": "disabled"})
    assert prompt_text(env).endswith("<think>\n\n</think>\n\n")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "Sunny."
    assert env.engine.requests[-1].grammar is None


@pytest.mark.parametrize("kw,param", [
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 4096}}, "thinking.budget_tokens"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": A_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tools": [{"name": "web_search", "type": "web_search_20250305"}]}, "tools.0.type"),
])
def test_anthropic_bad_fields_are_400s(env, ant, kw, param):
    with pytest.raises(anthropic.BadRequestError) as exc:
        ant.messages.create(model="any", max_tokens=2000, messages=MSGS[1:], **kw)
    assert param in exc.value.message
    assert env.engine.requests == []


def test_a_call_broken_off_keeps_its_name_and_no_made_up_input(env, oai, ant):
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    env.engine.say(broken)
    (call,) = oai.chat.completions.create(model="tiny-test", messages=MSGS, tools=TOOLS).choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Par'
    msg = ant.messages.create(model="any", max_tokens=400, messages=MSGS[1:], tools=A_TOOLS)
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {}
