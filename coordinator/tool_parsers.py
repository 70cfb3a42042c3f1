"""Tool calls in a model's answer: (content, calls) in the format of the model's family, whole or streamed.

    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   any number of blocks, text around
    llama3_json  [<|python_tag|>]{"name": "f", "parameters": {...}}; {...}        the answer is the calls
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]             v3 / v7 tokenizers
                 [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}                v11+ tokenizers

Interface, as the API routes use it:
    parse(family, text, tool_names) -> (content, [ToolCall(name, arguments, valid)])    a whole answer
    StreamParser(family, tool_names): feed(delta) -> [Event], then finish() -> [Event]  a streamed answer
        Event = Content(text) | CallStart(index, name) | CallArgs(index, text) | CallEnd(index, valid)
        OpenAI: CallStart -> a `tool_calls` delta with the call's id, type and name; CallArgs -> an `arguments`
        delta. Anthropic: CallStart -> content_block_start (tool_use); CallArgs -> input_json_delta;
        CallEnd -> content_block_stop. Indexes count calls from 0 in order; ids are the API's to make.
    family_for_template(chat_template) -> family | None      format_calls(family, calls) -> text
    FAMILIES; check_family(family) -> family or ValueError (tool_events.py rule 3)
    A call that is not `valid` (tool_reader.py rule 3) may hold text that is not JSON: pass it on as text (OpenAI's
    `arguments` is a string), never `json.loads` it unchecked.

The modules behind it:
    tool_events.py  the families' markers, ToolCall and the events; check_family
    tool_stream.py  StreamParser: one machine per family, what is content (its rules 1-2)
    tool_reader.py  CallReader, StreamParser's base: call objects and content in a growing text (rules 1-5)
    json_scan.py    one JSON value, a character at a time

Rules:
1. `parse(family, text, tool_names)` is the StreamParser fed the whole text, then finished (tool_stream.py
   rule 1): content is the Content events' text joined; a call's `arguments` its CallArgs' text joined, and
   its `valid` its CallEnd's.
2. `format_calls(family, calls)` writes calls as grammar.py's tool-call grammar does (hermes blocks joined by
   "\\n", llama3_json objects joined by "; ", mistral one list joined by ", "); `parse` reads them back.
   The calls' `arguments` must be JSON object texts.
3. `family_for_template`: the first of these found in the template's source: "<tool_call>" -> hermes,
   "[TOOL_CALLS]" -> mistral, "<|python_tag|>", an "ipython" role or Llama's '"parameters": dictionary of
   argument name' wording -> llama3_json; else None (the template renders no tools in a format known here).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable

from .tool_events import (ARG_KEYS, FAMILIES, HERMES_CLOSE, HERMES_OPEN, MISTRAL_ARGS, MISTRAL_CALLS, PYTHON_TAG,
                          CallArgs, CallEnd, CallStart, Content, Event, ToolCall, check_family)
from .tool_stream import StreamParser

__all__ = [
    "ARG_KEYS", "FAMILIES", "HERMES_CLOSE", "HERMES_OPEN", "MISTRAL_ARGS", "MISTRAL_CALLS", "PYTHON_TAG",
    "CallArgs", "CallEnd", "CallStart", "Content", "Event", "StreamParser", "ToolCall",
    "check_family", "family_for_template", "format_calls", "parse",
]


def family_for_template(chat_template: str | None) -> str | None:
    """The tool-call family a chat template writes (rule 3)."""
    if not chat_template:
        return None
    if HERMES_OPEN in chat_template:
        return "hermes"
    if MISTRAL_CALLS in chat_template:
        return "mistral"
    if (PYTHON_TAG in chat_template or "ipython" in chat_template
            or re.search(r"parameters\W{1,6}dictionary of argument name", chat_template)):
        return "llama3_json"
    return None


def format_calls(family: str, calls: Iterable[ToolCall]) -> str:
    """`calls` in `family`'s text format (rule 2)."""
    key = "parameters" if check_family(family) == "llama3_json" else "arguments"
    objs = [f'{{"name": {json.dumps(c.name, ensure_ascii=False)}, "{key}": {c.arguments}}}' for c in calls]
    if family == "hermes":
        return "\n".join(f"{HERMES_OPEN}\n{o}\n{HERMES_CLOSE}" for o in objs)
    if family == "llama3_json":
        return "; ".join(objs)
    return f"{MISTRAL_CALLS}[{', '.join(objs)}]"


def parse(family: str, text: str, tool_names: set[str] | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole answer: the stream machine fed all at once (rule 1)."""
    sp = StreamParser(family, tool_names)
    events = sp.feed(text) + sp.finish()
    content: list[str] = []
    names: list[str] = []
    args: list[list[str]] = []
    valid: list[bool] = []
    for e in events:
        if isinstance(e, Content):
            content.append(e.text)
        elif isinstance(e, CallStart):
            names.append(e.name)
            args.append([])
            valid.append(False)
        elif isinstance(e, CallArgs):
            args[e.index].append(e.text)
        else:
            valid[e.index] = e.valid
    return "".join(content), [ToolCall(n, "".join(a), v) for n, a, v in zip(names, args, valid)]
