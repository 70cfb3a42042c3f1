"""Grammars and matchers against the tiny tokenizer: construction and its refusals, the mask layout, and walks
that sample random logits through the masks until eos, whose text must parse and follow the schema or the
tool-call format exactly."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from coordinator import grammar as g
from coordinator.thinking_budget import SectionBudget
from coordinator.tokenizer import Tokenizer

N_VOCAB = 520  # the model's ids: 8 past the tiny tokenizer's 512, never allowed


@pytest.fixture(scope="module")
def tok(tiny_model_factory) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_factory("qwen3", layers=2, hidden=32, heads=2, kv_heads=1, seed=0))


@pytest.fixture(scope="module")
def gt(tok) -> g.GrammarTokenizer:
    return g.GrammarTokenizer.for_tokenizer(tok, N_VOCAB)


def allowed_ids(mask: bytes) -> list[int]:
    return np.nonzero(np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little"))[0].tolist()


def walk(gt: g.GrammarTokenizer, tok: Tokenizer, grammar: str, seed: int, limit: int = 400,
         banned: tuple[int, ...] = (), budget: SectionBudget | None = None) -> tuple[str, list[int], bool]:
    """Sample random logits through the masks until eos: (text, tokens, ended by eos)."""
    rng = np.random.default_rng(seed)
    m = g.Matcher(gt, grammar, banned, gt.budget(budget, tok) if budget is not None else None)
    out: list[int] = []
    for _ in range(limit):
        mask = m.mask()
        assert len(mask) == 4 * ((N_VOCAB + 31) // 32)
        ids = allowed_ids(mask)
        assert ids and max(ids) < tok.vocab_size, ids  # ids past the tokenizer are never allowed
        assert not set(ids) & set(banned)
        if m.finished:
            assert set(ids) == set(gt.eos_ids)
        logits = rng.normal(size=N_VOCAB) * 3
        keep = np.full(N_VOCAB, -np.inf)
        keep[ids] = 0.0
        p = np.exp(logits + keep - (logits + keep).max())
        token = int(rng.choice(N_VOCAB, p=p / p.sum()))
        if token in gt.eos_ids:
            return tok.decode(out), out, True
        m.advance(token)
        out.append(token)
    return tok.decode(out), out, False


def validate(value, schema: dict) -> None:
    """The JSON-schema subset the tests use, checked by hand."""
    if "enum" in schema:
        assert value in schema["enum"], (value, schema)
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict)
        props = schema.get("properties", {})
        assert set(schema.get("required", [])) <= set(value), (value, schema)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), (value, schema)
        for k, v in value.items():
            if k in props:
                validate(v, props[k])
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), (value, schema)
    elif kind == "boolean":
        assert isinstance(value, bool)
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
        if "pattern" in schema:
            assert re.search(schema["pattern"], value), (value, schema)
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
        for v in value:
            validate(v, schema["items"])


def compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def assert_compact(text: str) -> None:
    """No whitespace outside strings but one space after each separator."""
    outside = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    assert not re.search(r"\s", re.sub(r"[,:] ", "", outside)), text
    assert not re.search(r"[,:](?! )", outside), text


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok", "kind", "tags"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog", 3]},
                         "tags": {"type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": -5,
                                                                            "maximum": 5}}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"},
                          "days": {"type": "integer", "minimum": 1, "maximum": 9}}}
TOOLS = [{"name": "get_weather", "description": "Weather by city", "parameters": WEATHER},
         {"name": "ping"}]  # no parameters: the arguments are {}
PARAMS = {"get_weather": WEATHER, "ping": {"type": "object", "additionalProperties": False}}


# ---- construction ------------------------------------------------------------------------------------
def test_constructors_give_validated_serialized_grammars():
    for grammar in (g.json_object(), g.json_schema(PERSON, strict=True), g.json_schema(PERSON, strict=False),
                    g.tool_calls("hermes", TOOLS, "required", True),
                    g.after_reasoning(g.json_object(), True, "<think>", "</think>")):
        assert json.loads(grammar)["grammars"]


@pytest.mark.parametrize("build, message", [
    (lambda: g.json_schema({"type": "bogus"}, True), "schema: Invalid type: bogus"),
    (lambda: g.json_schema({"type": "string", "format": "no-such-format"}, True), "schema: Unknown format"),
    (lambda: g.json_schema({"type": "object", "x-guidance": {"lenient": True}}, False),
     "schema: 'x-guidance' is an engine option"),
    (lambda: g.json_schema(["not", "a", "schema"], True), "schema must be a JSON schema object, got list"),
    (lambda: g.json_schema({"const": float("nan")}, True), "schema is not JSON"),
    (lambda: g.tool_calls("chatml", TOOLS, "required", True), "tool-call family 'chatml' is not one of"),
    (lambda: g.tool_calls("hermes", [], "required", True), "tools must be a non-empty list"),
    (lambda: g.tool_calls("hermes", [{"description": "x"}], "required", True), "tools\\[0\\] needs a non-empty"),
    (lambda: g.tool_calls("hermes", [TOOLS[1], TOOLS[1]], "required", True), "tools\\[1\\]: the name 'ping'"),
    (lambda: g.tool_calls("hermes", TOOLS, "get_time", True), "tool_choice names 'get_time'"),
    (lambda: g.tool_calls("mistral", [{"name": "f", "parameters": {"type": "bogus"}}], "f", False),
     "tools: .*Invalid type: bogus"),
    (lambda: g.after_reasoning("not a grammar", True, "<think>", "</think>"), "answer's grammar"),
])
def test_what_cannot_become_a_grammar_is_a_grammar_error(build, message):
    with pytest.raises(g.GrammarError, match=message):
        build()


def test_lenient_schemas_skip_what_strict_ones_refuse():
    g.json_schema({"type": "string", "format": "no-such-format"}, strict=False)


def test_grammar_tokenizer_is_built_once_and_refuses_what_cannot_work(tok, gt):
    assert g.GrammarTokenizer.for_tokenizer(tok, N_VOCAB) is gt
    exact = g.GrammarTokenizer.for_tokenizer(tok, 512)
    assert exact is not gt and exact.words == 16
    assert len(g.Matcher(exact, g.json_object()).mask()) == 64  # whole words, none more
    assert gt.eos_ids == tuple(sorted(tok.eos_ids)) and gt.words == 17
    text = tok.backend.to_str()
    with pytest.raises(g.GrammarError, match="vocabulary \\(500 ids\\) is smaller than its tokenizer's \\(512"):
        g.GrammarTokenizer(text, 512, 500, tok.eos_ids)
    with pytest.raises(g.GrammarError, match="names no eos token"):
        g.GrammarTokenizer(text, 512, 512, [])
    with pytest.raises(g.GrammarError, match="the model's vocabulary size is unknown"):
        g.Matcher.for_request(tok, None, g.json_object(), None)
    with pytest.raises(g.GrammarError, match="no tokenizer"):
        g.Matcher.for_request(None, 512, g.json_object(), None)


# ---- masks -------------------------------------------------------------------------------------------
def test_the_mask_layout_is_bit_i_of_word_w(tok, gt):
    m = g.Matcher(gt, g.json_schema({"enum": ["yes"]}, True))
    ids = allowed_ids(m.mask())
    assert ids and all('"yes"'.startswith(tok.decode([t])) for t in ids)
    words = np.frombuffer(m.mask(), dtype="<i4")
    assert [32 * w + i for w in range(len(words)) for i in range(32) if (int(words[w]) >> i) & 1] == ids


def test_a_finished_grammar_allows_only_eos_and_refuses_other_tokens(tok, gt):
    m = g.Matcher(gt, g.json_schema({"enum": [True]}, True))
    for t in tok.encode("true"):
        assert not m.finished
        m.advance(t)
    assert m.finished
    assert allowed_ids(m.mask()) == sorted(tok.eos_ids)
    m2 = g.Matcher(gt, g.json_schema({"enum": [True]}, True))
    with pytest.raises(g.GrammarError, match=f"token {tok.encode('x')[0]} is not allowed by the grammar here"):
        m2.advance(tok.encode("x")[0])


def test_banned_tokens_leave_every_mask_and_an_emptied_mask_is_an_error(tok, gt):
    first = allowed_ids(g.Matcher(gt, g.json_object()).mask())
    assert len(first) > 1
    text, _, _ = walk(gt, tok, g.json_object(), seed=1, banned=tuple(first[:-1]))
    assert text.startswith(tok.decode([first[-1]]))
    m = g.Matcher.for_request(tok, N_VOCAB, g.json_object(), [[t, -100] for t in first] + [[5, -99.5]])
    with pytest.raises(g.GrammarError, match="logit_bias bans every token the grammar allows next"):
        m.mask()


# ---- walks -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strict", [True, False])
def test_random_walks_give_compact_json_that_follows_the_schema(tok, gt, strict):
    grammar = g.json_schema(PERSON, strict)
    for seed in range(12):
        text, _, ended = walk(gt, tok, grammar, seed)
        assert ended, text
        value = json.loads(text)
        validate(value, PERSON)
        assert_compact(text)


def test_json_object_walks_give_objects(tok, gt):
    for seed in range(6):
        text, _, ended = walk(gt, tok, g.json_object(), seed, limit=2000)
        if ended:
            assert isinstance(json.loads(text), dict)
        else:
            assert text.startswith("{")


def parse_calls(family: str, text: str) -> list[tuple[str, dict]]:
    """The calls of one answer, read by each family's exact format (grammar.py rule 4)."""
    if family == "hermes":
        blocks = text.split("\n")
        assert len(blocks) % 3 == 0, text
        bodies = []
        for i in range(0, len(blocks), 3):
            assert blocks[i] == "<tool_call>" and blocks[i + 2] == "</tool_call>", text
            bodies.append(json.loads(blocks[i + 1]))
        key = "arguments"
    elif family == "llama3_json":
        bodies, key = [json.loads(part) for part in text.split("; ")], "parameters"
    else:
        assert text.startswith("[TOOL_CALLS]"), text
        bodies, key = json.loads(text[len("[TOOL_CALLS]"):]), "arguments"
    calls = []
    for body in bodies:
        assert list(body) == ["name", key], text
        calls.append((body["name"], body[key]))
    return calls


def write_calls(family: str, calls: list[tuple[str, dict]]) -> str:
    if family == "hermes":
        return "\n".join(f"<tool_call>\n{compact({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
    if family == "llama3_json":
        return "; ".join(compact({"name": n, "parameters": a}) for n, a in calls)
    return "[TOOL_CALLS]" + compact([{"name": n, "arguments": a} for n, a in calls])


@pytest.mark.parametrize("family", g.FAMILIES)
@pytest.mark.parametrize("choice", ["required", "get_weather"])
@pytest.mark.parametrize("parallel", [False, True])
def test_tool_call_walks_have_the_exact_family_format(tok, gt, family, choice, parallel):
    grammar = g.tool_calls(family, TOOLS, choice, parallel)
    counts = set()
    for seed in range(16):
        text, _, ended = walk(gt, tok, grammar, seed)
        assert ended, text
        calls = parse_calls(family, text)
        counts.add(len(calls))
        assert write_calls(family, calls) == text
        for name, args in calls:
            assert name in (PARAMS if choice == "required" else [choice])
            validate(args, PARAMS[name])
    assert counts == {1} if not parallel else max(counts) > 1


def test_parallel_calls_can_be_several(tok, gt):
    grammar = g.tool_calls("hermes", TOOLS, "ping", True)
    m = g.Matcher(gt, grammar)
    one = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    for t in tok.encode(one + "\n" + one):
        m.advance(t)
    assert not m.finished and set(gt.eos_ids) <= set(allowed_ids(m.mask()))


def thinking_tokens(gt: g.GrammarTokenizer, tokens: list[int], close: str) -> int:
    """Tokens that carry bytes of the section before its close marker (one cut by the marker counts)."""
    raw = gt.ll.decode_bytes(tokens)
    thinking = raw[: raw.index(close.encode())]
    return next(n for n in range(len(tokens) + 1) if len(gt.ll.decode_bytes(tokens[:n])) >= len(thinking))


def assert_within_budget(gt: g.GrammarTokenizer, section: list[int], n: int, budget: int) -> None:
    """n section tokens: at most the budget, or up to three more that finish a UTF-8 character the budget's
    last token began (thinking_budget.py rule 3)."""
    if n > budget:
        assert n - budget <= 3, (n, budget)
        with pytest.raises(UnicodeDecodeError):
            gt.ll.decode_bytes(section[:budget]).decode("utf-8")


@pytest.mark.parametrize("budget", [0, 3, 12])
def test_a_thinking_budget_closes_the_section_then_the_answer_follows_its_grammar(tok, gt, budget):
    grammar = g.after_reasoning(g.json_schema(WEATHER, True), True, "<think>", "</think>")
    longest = 0
    for seed in range(6):
        text, tokens, ended = walk(gt, tok, grammar, seed, budget=SectionBudget(budget, opened=True))
        assert ended, text
        n = thinking_tokens(gt, tokens, "</think>")
        assert_within_budget(gt, tokens, n, budget)
        longest = max(longest, n)
        answer = text.split("</think>", 1)[1]
        gap = len(answer) - len(answer.lstrip("\n"))
        assert gap <= 2
        validate(json.loads(answer[gap:]), WEATHER)
    assert longest >= budget  # a random model thinks until the budget closes the section


def test_a_section_the_completion_may_open_and_free_text_after_it(tok, gt):
    grammar = g.after_reasoning(g.json_schema(WEATHER, True), False, "<think>", "</think>")
    forms = set()
    for seed in range(12):
        text, tokens, ended = walk(gt, tok, grammar, seed, budget=SectionBudget(4, opened=False))
        assert ended, text
        if text.startswith("<think>"):
            forms.add("section")
            opened = next(n for n in range(len(tokens)) if tok.decode(tokens[: n + 1]).startswith("<think>"))
            section = tokens[opened + 1:]
            assert_within_budget(gt, section, thinking_tokens(gt, section, "</think>"), 4)
            text = text.split("</think>", 1)[1]
        else:
            forms.add("direct")
        validate(json.loads(text), WEATHER)
    assert forms == {"section", "direct"}
    free = g.after_reasoning(None, True, "<think>", "</think>")
    m = g.Matcher(gt, free, budget=gt.budget(SectionBudget(2, opened=True), tok))
    for t in tok.encode("ab</think>\n\nanything at all"):
        m.advance(t)
    assert set(gt.eos_ids) <= set(allowed_ids(m.mask())) and not m.finished
