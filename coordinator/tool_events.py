"""What the tool-call modules share: the families and their markers, a parsed call, and the stream's events.

    Event = Content(text) | CallStart(index, name) | CallArgs(index, text) | CallEnd(index, valid)

Rules:
1. Indexes count one answer's calls from 0, in the order they start; a call's CallArgs and its CallEnd come
   after its CallStart and carry its index.
2. `ToolCall.arguments` is JSON object text when `valid`, else the text that streamed for it (tool_reader.py
   rule 3): never `json.loads` it unchecked.
3. An unknown family name is a ValueError naming it and the known ones (`check_family`).
"""
from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("hermes", "llama3_json", "mistral")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
ARG_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON object text (tool_reader.py rule 1); the streamed text when not `valid` (rule 2)
    valid: bool = True


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    text: str


@dataclass(frozen=True)
class CallEnd:
    index: int
    valid: bool = True


Event = Content | CallStart | CallArgs | CallEnd


def check_family(family: str) -> str:
    if family not in FAMILIES:
        raise ValueError(f"unknown tool-call family {family!r}; known: {', '.join(FAMILIES)}")
    return family
