"""Tool-call parsing (coordinator/tool_parsers.py): scripted answers of each family with exact content and calls,
the same result for every cut of each answer into deltas, the held-back rules delta by delta, the JSON rules,
format_calls round trips and the family guess from a chat template."""
from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator import tool_parsers as tp
from coordinator.tool_parsers import CallArgs, CallEnd, CallStart, Content, StreamParser, ToolCall
from stages.tiny_tokenizer import CHAT_TEMPLATE

NAMES = {"get_weather", "get_time", "search"}
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
TIME = '{"name": "get_time", "arguments": {}}'
NESTED_ARGS = r'{"q": "a {b} [c] \"quoted\" \\ back", "opts": {"deep": [{"x": "}"}, []], "u": "héllo 😀 \u00e9"}}'
STRING_INNER = '{"tz": "Europe/Paris", "note": "é😀 \\"q\\""}'  # sent as a JSON string holding it
W = ToolCall("get_weather", '{"city": "Paris", "days": 2}')
T = ToolCall("get_time", "{}")


def block(obj: str) -> str:
    return f"<tool_call>\n{obj}\n</tool_call>"


# (family, text, tool names, expected content, expected calls)
CASES = [
    # hermes
    ("hermes", block(WEATHER), NAMES, "", [W]),
    ("hermes", "Let me check.\n\n" + block(WEATHER) + "\n" + block(TIME) + "\nDone.", NAMES,
     "Let me check.\nDone.", [W, T]),
    ("hermes", "A " + block(TIME) + " B", NAMES, "A B", [T]),
    ("hermes", block('{"name": "search", "arguments": ' + NESTED_ARGS + "}"), NAMES, "",
     [ToolCall("search", NESTED_ARGS)]),
    ("hermes", block('{"name": "get_time", "arguments": ' + json.dumps(" " + STRING_INNER + "\n") + "}"), NAMES, "",
     [ToolCall("get_time", STRING_INNER)]),
    ("hermes", block('{"name": "rm_rf", "arguments": {}}'), NAMES, block('{"name": "rm_rf", "arguments": {}}'), []),
    ("hermes", block('{"name" "get_time"}') + " ok", NAMES, block('{"name" "get_time"}') + " ok", []),
    ("hermes", block('{"name": "get_time", "arguments": {"tz": UTC}}'), NAMES, "UTC}}",
     [ToolCall("get_time", '{"tz": ', valid=False)]),
    ("hermes", 'Sure. <tool_call>\n{"name": "get_wea', NAMES, 'Sure. <tool_call>\n{"name": "get_wea', []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', NAMES, "",
     [ToolCall("get_weather", '{"city": "Par', valid=False)]),
    ("hermes", '<tool_call>\n{"name": "get_weather"', NAMES, "", [ToolCall("get_weather", "{}", valid=False)]),
    ("hermes", block('{"arguments": {"q": "x"}, "id": 7, "name": "search"}'), NAMES, "",
     [ToolCall("search", '{"q": "x"}')]),
    ("hermes", block('{"name": "get_time"}'), NAMES, "", [T]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}\n<tool_call>{"name": "search", "arguments": '
     '{"q": "a"}}</tool_call>', NAMES, "", [T, ToolCall("search", '{"q": "a"}')]),
    ("hermes", '<tool_call>{"name": "search", "arguments": {"q": 1}\n</tool_call>', NAMES, "",
     [ToolCall("search", '{"q": 1}')]),  # the outer brace is missing; the arguments are whole
    ("hermes", "a <tool or </tool_call> <tool_call", NAMES, "a <tool or </tool_call> <tool_call", []),
    ("hermes", block("<function=search>"), NAMES, block("<function=search>"), []),
    ("hermes", block('{"name": "anything", "arguments": {"k": [1]}}'), None, "",
     [ToolCall("anything", '{"k": [1]}')]),
    ("hermes", block('{"name": "search", "arguments": "not json"}'), NAMES, "",
     [ToolCall("search", "not json", valid=False)]),
    ("hermes", "\n\n" + block(TIME) + "\n\n", NAMES, "", [T]),
    ("hermes", "  plain answer\n", NAMES, "  plain answer\n", []),
    ("hermes", "", NAMES, "", []),
    ("hermes", block(TIME) + "\n<tool_call>\n{oops}", NAMES, "<tool_call>\n{oops}", [T]),
    # llama3_json
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', NAMES, "", [W]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; ' + TIME,
     NAMES, "", [W, T]),
    ("llama3_json", '\n  {"name": "get_time", "parameters": {}}\n{"name": "search", "parameters": {"q": "Oslo"}}\n',
     NAMES, "", [T, ToolCall("search", '{"q": "Oslo"}')]),
    ("llama3_json", 'The weather is {"nice"}.', NAMES, 'The weather is {"nice"}.', []),
    ("llama3_json", '{"answer": 42}', NAMES, '{"answer": 42}', []),
    ("llama3_json", ' {"name": "rm", "parameters": {}}', NAMES, ' {"name": "rm", "parameters": {}}', []),
    ("llama3_json", '{"name": "get_time", "parameters": {}} I called it.', NAMES, "I called it.", [T]),
    ("llama3_json", '{"name": "get_time", "parameters": {}}; {"nam', NAMES, '{"nam', [T]),
    ("llama3_json", "<|python_tag|>print(1)", NAMES, "<|python_tag|>print(1)", []),
    ("llama3_json", "<|python_ta", NAMES, "<|python_ta", []),
    ("llama3_json", '{"name": "search", "parameters": ' + NESTED_ARGS + "}", NAMES, "",
     [ToolCall("search", NESTED_ARGS)]),
    # mistral
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]', NAMES, "", [W]),
    ("mistral", "Checking both. [TOOL_CALLS][" + WEATHER + ", " + TIME + "]", NAMES, "Checking both.", [W, T]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[ARGS]{}', NAMES,
     "", [W, T]),
    ("mistral", "[TOOL_CALLS]rm[ARGS]{}", NAMES, "[TOOL_CALLS]rm[ARGS]{}", []),
    ("mistral", "[TOOL_CALLS]get weather[ARGS]{}", NAMES, "[TOOL_CALLS]get weather[ARGS]{}", []),
    ("mistral", '[TOOL_CALLS][{"name": get_time}]', NAMES, '[TOOL_CALLS][{"name": get_time}]', []),
    ("mistral", "[TOOL_CALLS][" + TIME + ', {"name": "rm", "arguments": {}}]', NAMES,
     '{"name": "rm", "arguments": {}}]', [T]),
    ("mistral", "[TOOL_CALLS][" + TIME + "]\nDone.", NAMES, "Done.", [T]),
    ("mistral", "Hmm [TOOL_CALLS]", NAMES, "Hmm [TOOL_CALLS]", []),
    ("mistral", "[TOOL_CALLS][]", NAMES, "[TOOL_CALLS][]", []),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', NAMES, "",
     [ToolCall("get_weather", '{"city": "Pa', valid=False)]),
    ("mistral", "[TOOL_CALLS]" + TIME, NAMES, "", [T]),
    ("mistral", "[TOOL_CALLS]search[ARGS]" + json.dumps(STRING_INNER), NAMES, "", [ToolCall("search", STRING_INNER)]),
]
IDS = [f"{i}-{c[0]}" for i, c in enumerate(CASES)]


def merged(events: list) -> list:
    """Events with adjacent Content joined and adjacent CallArgs of one call joined, after checking their order:
    a call's pieces come between its CallStart and its CallEnd, calls are numbered in order, no text is empty."""
    out: list = []
    open_call, next_index = None, 0
    for e in events:
        if isinstance(e, (Content, CallArgs)):
            assert e.text, e
        if isinstance(e, CallStart):
            assert open_call is None and e.index == next_index, (e, open_call)
            open_call, next_index = e.index, next_index + 1
        elif isinstance(e, (CallArgs, CallEnd)):
            assert e.index == open_call, (e, open_call)
            if isinstance(e, CallEnd):
                open_call = None
        else:
            assert open_call is None, e  # no content inside a call
        if out and type(e) is type(out[-1]) and isinstance(e, (Content, CallArgs)):
            out[-1] = type(e)(*([e.index] if isinstance(e, CallArgs) else []), out[-1].text + e.text)
        else:
            out.append(e)
    assert open_call is None
    return out


def stream(family: str, pieces: list[str], names: set[str] | None) -> list:
    sp = StreamParser(family, names)
    events = []
    for p in pieces:
        events += sp.feed(p)
    return events + sp.finish()


def events_of(content: str, calls: list[ToolCall]) -> list:
    """What a stream of an answer with this content (all before the calls) and these calls merges to."""
    out: list = [Content(content)] if content else []
    for i, c in enumerate(calls):
        out += [CallStart(i, c.name)] + ([CallArgs(i, c.arguments)] if c.arguments else []) + [CallEnd(i, c.valid)]
    return out


def cuts(text: str, seed: int) -> list[list[str]]:
    """Every 1-char and 2-char cut, every cut into two, and random cuts of 1-8 chars."""
    out = [list(text), [text[i:i + 2] for i in range(0, len(text), 2)], [text[:1]] + [text[i:i + 2] for i in
                                                                                     range(1, len(text), 2)]]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    rng = random.Random(seed)
    for _ in range(20):
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 8)
            pieces.append(text[i:i + n])
            i += n
        out.append(pieces)
    return out


@pytest.mark.parametrize("family,text,names,content,calls", CASES, ids=IDS)
def test_parse_whole(family, text, names, content, calls):
    assert tp.parse(family, text, names) == (content, calls)
    for c in calls:
        if c.valid:
            assert isinstance(json.loads(c.arguments), dict)


@pytest.mark.parametrize("family,text,names,content,calls", CASES, ids=IDS)
def test_every_cut_streams_the_same_result(family, text, names, content, calls):
    whole = merged(stream(family, [text], names))
    for i, pieces in enumerate(cuts(text, seed=len(text))):
        assert merged(stream(family, pieces, names)) == whole, (i, pieces)
    assert "".join(e.text for e in whole if isinstance(e, Content)) == content
    if not content or whole[0] == Content(content):  # the content, when any, comes before the calls
        assert whole == events_of(content, calls)


def test_a_marker_split_across_deltas_is_held_back_until_known():
    sp = StreamParser("hermes", NAMES)
    assert sp.feed("Sure <tool") == [Content("Sure")]
    assert sp.feed('_call>\n{"name": "get_') == []  # the block is held until its name is complete
    assert sp.feed('time", "arguments": {"tz"') == [CallStart(0, "get_time"), CallArgs(0, '{"tz"')]
    assert sp.feed(': "UTC"}}\n</tool') == [CallArgs(0, ': "UTC"}'), CallEnd(0, True)]
    assert sp.feed("_call>") == []
    assert sp.finish() == []


def test_a_false_marker_comes_out_as_text():
    sp = StreamParser("hermes", NAMES)
    assert sp.feed("I <tool") == [Content("I")]
    assert sp.feed("s are> here ") == [Content(" <tools are> here")]
    assert sp.finish() == [Content(" ")]


def test_an_unknown_name_never_starts_a_call():
    sp = StreamParser("hermes", NAMES)
    assert sp.feed('<tool_call>\n{"name": "rm') == []
    assert sp.feed('_rf", "arguments": {}}') == [Content('<tool_call>\n{"name": "rm_rf"'),
                                                  Content(', "arguments": {}}')]
    assert sp.finish() == []


def test_mistral_v11_name_then_streamed_arguments():
    sp = StreamParser("mistral", NAMES)
    assert [sp.feed(d) for d in ["Ok[TOOL_", "CALLS]get_", "weather[AR", 'GS]{"city": ', '"Paris"}']] == [
        [Content("Ok")], [], [], [CallStart(0, "get_weather"), CallArgs(0, '{"city": ')],
        [CallArgs(0, '"Paris"}'), CallEnd(0, True)]]
    assert sp.finish() == []


def test_string_arguments_stream_decoded_and_wait_for_whole_escapes():
    sp = StreamParser("hermes", NAMES)
    assert sp.feed('<tool_call>{"name": "search", "arguments": " {\\"q\\": \\"\\ud83d') == [
        CallStart(0, "search"), CallArgs(0, '{"q": "')]
    assert sp.feed("\\ude") == []
    assert sp.feed('00\\"} "}') == [CallArgs(0, '😀"}'), CallEnd(0, True)]
    assert sp.finish() == []


def test_arguments_before_the_name_go_out_when_it_is_known():
    sp = StreamParser("llama3_json", NAMES)
    assert sp.feed('{"parameters": {"q": [1, 2]}, "na') == []
    assert sp.feed('me": "search"}') == [CallStart(0, "search"), CallArgs(0, '{"q": [1, 2]}'), CallEnd(0, True)]
    assert sp.finish() == []


VALIDITY = [  # (arguments as written, what the call's arguments are: all of it when valid, else what streamed)
    ("{}", None), ('{"a": -0.5e+10}', None), ('{"a": [true, false, null, 0, 1.0, -1E-2, 10]}', None),
    (r'{"a": "\u00e9\n\/\\\"", "b": "\ud83d\ude00"}', None), ('{"a":{"b":{"c":[[],{}]}}}', None),
    ('{ "a" : 1 }', None), ('{"a": 01}', '{"a": 0'), ('{"a": .5}', '{"a": '), ('{"a": NaN}', '{"a": '),
    ('{"a": "x\ny"}', '{"a": "x'), ('{"a": tru}', '{"a": tru'), ('{"a": 1,}', '{"a": 1,'), ('{"a" 1}', '{"a" '),
    (r'{"a": "\x"}', '{"a": "\\'), ('{"a": 1e}', '{"a": 1e'), ('{"a": -}', '{"a": -'),
    ('{"a": [1 2]}', '{"a": [1 '), (r'{"a": "\u12g4"}', r'{"a": "\u12'),
    ("[1, 2]", "[1, 2]"), ("null", "null"), ("7", "7"),  # whole JSON, but not an object
]


@pytest.mark.parametrize("args,want", VALIDITY)
def test_arguments_are_valid_exactly_when_they_are_a_json_object(args, want):
    try:
        valid = isinstance(json.loads(args, parse_constant=lambda c: 1 / 0), dict)
    except (ValueError, ZeroDivisionError):
        valid = False
    assert valid == (want is None)  # the table agrees with Python's strict reading
    for family, text in [("hermes", block(f'{{"name": "search", "arguments": {args}}}')),
                         ("mistral", f"[TOOL_CALLS]search[ARGS]{args}")]:
        (call,) = tp.parse(family, text, NAMES)[1]
        assert call == ToolCall("search", args if want is None else want, valid)


def test_a_broken_call_keeps_what_streamed_and_the_rest_is_content():
    text = block('{"name": "get_time", "arguments": {"tz": \'UTC\'}}') + "\nAfter."
    assert tp.parse("hermes", text, NAMES) == ("'UTC'}}\nAfter.", [ToolCall("get_time", '{"tz": ', valid=False)])


FORMATTED = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                   '{"name": "get_time", "parameters": {}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
               '{"name": "get_time", "arguments": {}}]',
}


@pytest.mark.parametrize("family", tp.FAMILIES)
def test_format_calls_writes_the_family_format_and_parses_back(family):
    assert tp.format_calls(family, [W, T]) == FORMATTED[family]
    assert tp.parse(family, FORMATTED[family], NAMES) == ("", [W, T])
    assert tp.format_calls(family, []) == ("[TOOL_CALLS][]" if family == "mistral" else "")


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=6), lambda kids: st.lists(kids, max_size=3)
                    | st.dictionaries(st.text(max_size=4), kids, max_size=3), max_leaves=8)


@settings(max_examples=60, deadline=None)
@given(family=st.sampled_from(tp.FAMILIES), args=st.lists(st.dictionaries(st.text(max_size=5), JSON, max_size=3),
                                                           min_size=1, max_size=3),
       ascii_only=st.booleans(), seed=st.integers(0, 1000))
def test_any_arguments_round_trip_whole_and_streamed(family, args, ascii_only, seed):
    calls = [ToolCall(sorted(NAMES)[i % 3], json.dumps(a, ensure_ascii=ascii_only)) for i, a in enumerate(args)]
    text = tp.format_calls(family, calls)
    assert tp.parse(family, text, NAMES) == ("", calls)
    rng, pieces, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 5)
        pieces.append(text[i:i + n])
        i += n
    assert merged(stream(family, pieces, NAMES)) == events_of("", calls)


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool", "[TOOL_CALLS]", "[ARGS]", "[TOOL", "<|python_tag|>", "{", "}",
             "[", "]", '"', "\\", ":", ",", ";", " ", "\n", '"name"', '"arguments"', '"parameters"', '"get_time"',
             "get_time", '"rm"', "{}", '"a"', "1", "é", "\\u00e9", "\\ud83d", "x y",
             '{"name": "get_time", ', '"arguments": {"a": ', '"arguments": "{', "get_time[ARGS]", "}}",
             ', {"name": "search"']


@settings(max_examples=300, deadline=None)
@given(family=st.sampled_from(tp.FAMILIES), parts=st.lists(st.sampled_from(FRAGMENTS), max_size=24),
       seed=st.integers(0, 1000))
def test_any_text_streams_as_it_parses_and_a_text_without_calls_is_all_content(family, parts, seed):
    text = "".join(parts)
    content, calls = tp.parse(family, text, NAMES)
    if not calls:
        assert content == text
    rng, pieces, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 4)
        pieces.append(text[i:i + n])
        i += n
    assert merged(stream(family, pieces, NAMES)) == merged(stream(family, [text], NAMES))


def test_family_for_template():
    assert tp.family_for_template(CHAT_TEMPLATE) == "hermes"
    assert tp.family_for_template("{{ '[AVAILABLE_TOOLS]' }}...{{ '[TOOL_CALLS]' + calls }}") == "mistral"
    assert tp.family_for_template("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    assert tp.family_for_template("{%- if message.role == 'ipython' %}") == "llama3_json"
    assert tp.family_for_template('Respond in the format {"name": function name, "parameters": dictionary of '
                                  'argument name and its value}.') == "llama3_json"
    assert tp.family_for_template("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert tp.family_for_template("") is None and tp.family_for_template(None) is None


def test_an_unknown_family_is_refused_by_name():
    for call in (lambda: tp.parse("pythonic", "x"), lambda: StreamParser("pythonic", None),
                 lambda: tp.format_calls("pythonic", [T])):
        with pytest.raises(ValueError, match="'pythonic'.*hermes, llama3_json, mistral"):
            call()


def test_feed_after_finish_is_an_error():
    sp = StreamParser("hermes", NAMES)
    assert sp.feed("hi") == [Content("hi")]
    assert sp.finish() == [] and sp.finish() == []
    with pytest.raises(RuntimeError):
        sp.feed("more")
