"""The coordinator's tokenizer, with transformers' AutoTokenizer as the oracle for templates and ids."""
from __future__ import annotations

import json
import random
import shutil

import pytest

from coordinator.tokenizer import ChatTemplateError, IncrementalDetokenizer, StopStrings, Tokenizer

CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello, how can I help?"}, {"role": "user", "content": "Tell me a joke.\n"},
     {"role": "assistant", "content": "No."}, {"role": "user", "content": "東京 café 🙂"}],
    [{"role": "user", "content": "  leading and trailing spaces  "}, {"role": "assistant", "content": ""}],
]

# A template in the style of Qwen2.5's: tools as JSON, namespace, loop controls, a generation block,
# strftime_now and bos_token; whitespace control relies on trim_blocks / lstrip_blocks.
RICH_TEMPLATE = """{{ bos_token }}
{%- if tools %}
<|im_start|>system
Year {{ strftime_now('%Y') }}. Tools:
    {% for tool in tools %}
{{ tool | tojson }}
{{ tool | tojson(indent=2) }}
    {% endfor %}
<|im_end|>
{% endif %}
{% set ns = namespace(users=0) %}
{% for message in messages %}
    {% if message.role == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}
    {% if message.role == 'tool' and loop.index0 > 8 %}{% break %}{% endif %}
<|im_start|>{{ message.role }}
    {% if message.role == 'assistant' %}
{% generation %}{{ message.content }}{% endgeneration %}
        {% if message.tool_calls is defined %}
            {% for call in message.tool_calls %}
<tool_call>{{ call.function | tojson }}</tool_call>
            {% endfor %}
        {% endif %}
    {% else %}
{{ message.content }}
    {% endif %}
<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant ({{ ns.users }} user turns)
{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <in> a \"city\"",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}]


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory):
    return tiny_model_factory("qwen3", layers=1)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_chat_template_renders_exactly_like_transformers(tok, hf, chat, gen):
    msgs = CHATS[chat]
    want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == want
    want_ids = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=False)
    assert tok.chat_ids(msgs, add_generation_prompt=gen) == list(want_ids)


def test_a_rich_template_renders_like_transformers(tiny_dir, tmp_path):
    from transformers import AutoTokenizer

    d = tmp_path / "rich"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = RICH_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, hf = Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(str(d))
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris é"}}}]},
            {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "user", "content": "thanks"},
            {"role": "assistant", "content": None, "tool_calls": None}]
    for tools in (None, TOOLS):
        for gen in (True, False):
            want = hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen)
            got = ours.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen)
            assert got == want
    assert "Paris é" in got and "<|endoftext|>" in got  # tojson keeps non-ASCII; bos_token is a variable


def test_text_parts_are_joined_and_other_parts_refused(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "one\ntwo"}])
    with pytest.raises(ChatTemplateError, match="only text parts"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ChatTemplateError, match="Unknown role"):  # the template's raise_exception
        tok.apply_chat_template([{"role": "wizard", "content": "hi"}])
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([])


def test_ids_and_metadata_match_transformers(tok, hf):
    assert tok.vocab_size == len(hf) == 512
    assert tok.eos_ids == {hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")}
    assert tok.name.startswith("tiny-qwen3-")
    for text in ["Hello world", "东京 and 東京, crème brûlée 🙂🚀", "<|im_start|>user\nx<|im_end|>", " \n\t "]:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False)
        assert tok.decode(hf.encode(text)) == hf.decode(hf.encode(text))


@pytest.mark.parametrize("text", ["The river ran low that summer.", "def f(x):\n    return x  # ok\n",
                                  "Straße, mañana, 日本語の文章, Ελληνικά, 🙂 🚀 ✨ €", "ǅ̀ zalgo ̴̡̢ 𝔘𝔫𝔦"])
def test_decode_of_encode_is_identity(tok, text):
    assert tok.decode(tok.encode(text)) == text


def _stream(tok, ids, prompt_ids=None, skip_special=True):
    d = IncrementalDetokenizer(tok, prompt_ids=prompt_ids, skip_special=skip_special)
    pieces = [d.push(i) for i in ids]
    return pieces, d.flush()


def test_incremental_detokenizer_equals_decode_for_random_ids(tok):
    rng = random.Random(1234)
    multibyte = set()
    for trial in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        skip = trial % 2 == 0
        pieces, tail = _stream(tok, ids, prompt_ids=tok.encode("Hi there.\n") if trial % 3 == 0 else None,
                               skip_special=skip)
        assert "".join(pieces) + tail == tok.decode(ids, skip_special=skip)
        multibyte |= {p for p in pieces if any(ord(c) > 127 for c in p)}
    assert multibyte  # random ids did form multi-byte characters across tokens


def test_incremental_detokenizer_never_emits_half_a_character(tok):
    text = "東京 café 🙂 — Ελληνικά: αβγ; 日本語の文章も少し。 🚀✨"
    ids = tok.encode(text)
    assert len(ids) > len(text) // 2  # many characters span several tokens
    pieces, tail = _stream(tok, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text and tail == ""
    # Specials are skipped by default and kept on request.
    ids = tok.encode("ok<|im_end|>")
    assert "".join(_stream(tok, ids)[0]) == "ok"
    assert "".join(_stream(tok, ids, skip_special=False)[0]) == "ok<|im_end|>"


def test_flush_returns_an_incomplete_character_as_replacement(tok):
    ids = tok.encode("🙂")
    pieces, tail = _stream(tok, ids[:-1])
    assert "".join(pieces) == "" and tail == tok.decode(ids[:-1]) and tail.endswith("\ufffd")


def _reference_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Character by character: stop at the first position where some stop string ends."""
    for n in range(1, len(text) + 1):
        ending = [s for s in stops if text[:n].endswith(s)]
        if ending:
            return text[:n - max(map(len, ending))], True
    return text, False


def _feed_all(stops, chunks):
    ss = StopStrings(stops)
    emitted, stopped = [], False
    for c in chunks:
        out, stopped = ss.feed(c)
        emitted.append(out)
    if not stopped:
        emitted.append(ss.flush())
    return emitted, stopped


def test_stop_string_split_across_pushes_is_caught_and_never_emitted():
    emitted, stopped = _feed_all(["STOP"], ["Hello wo", "rld! S", "T", "O", "P and more", "after"])
    assert stopped and "".join(emitted) == "Hello world! "
    assert emitted == ["Hello wo", "rld! ", "", "", "", ""]
    emitted, stopped = _feed_all(["STOP"], ["a ST", "OOP", "S"])
    assert not stopped and "".join(emitted) == "a STOOPS"
    emitted, stopped = _feed_all(["\n\n", "User:"], ["ok\n", "\nUser:"])
    assert stopped and "".join(emitted) == "ok"


def test_stop_strings_agree_with_a_character_by_character_reference():
    rng = random.Random(7)
    alphabet = "ab\né"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 16)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randrange(1, 5))))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        emitted, stopped = _feed_all(stops, chunks)
        assert ("".join(emitted), stopped) == _reference_stop(text, stops), (text, stops, chunks)


def test_empty_stop_strings_are_refused():
    with pytest.raises(ValueError):
        StopStrings(["ok", ""])
    assert StopStrings([]).feed("anything") == ("anything", False)
