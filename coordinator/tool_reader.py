"""Reading tool-call objects and content out of an answer's text as it grows: the half of StreamParser
(tool_stream.py) that knows no family. The families' machines are generators over these methods; each waits
(yields) for the next delta where the text runs out.

Rules:
1. A call is a JSON object with a string "name" and its arguments under "arguments" or "parameters" (keys in
   any order; other keys are read and ignored; of a repeated key the first counts). `arguments` is what the
   model wrote for the value: an object's source text as is (a value has no whitespace around it); a JSON
   string holding JSON (some models write that) becomes the text it holds, whitespace-trimmed; absent: "{}".
2. A call is decided at its name. Until the name string is complete the block is held back; then, when it is
   one of `tool_names` (any name when None), the call starts (CallStart), arguments read before the name go
   out at once, and the rest stream as the raw pieces of the value, in order. A block that breaks before
   that (JSON that cannot continue, a name that is not a string or not a tool, an object that closes without
   a name, the end of the text) is Content with its original text, markers included, and no CallStart is
   sent for it; the text from where it broke is read again as content, so a marker in it still opens a block.
   (A JSON object without a "name", such as a JSON answer in llama3_json, thus goes out when it closes.)
3. A started call cannot be taken back. If its JSON breaks later (the model was cut off or wrote malformed
   JSON), the call ends with what has streamed and `valid` False; the text from the break on is read by the
   family's content rules. `valid` is True when the arguments are a whole JSON object (or a string holding
   one), or are absent and the call's object closed; then `json.loads(arguments)` is a dict. A call that is
   not valid is the model's text for it, not something to run; nothing is made up to complete it.
4. Text that may still become a marker ("<tool" at the end of a delta) is held back until the next delta
   tells.
5. Content goes out in order, without the whitespace that touches a call, except the whitespace that, after
   a call, parts content written before it from content written after it ("A <call> B" -> "A B"). Which
   text is content, and which markers and separators are dropped, is the family's (tool_stream.py rule 2).
"""
from __future__ import annotations

import json
import re
from collections.abc import Generator

from .json_scan import BAD, DONE_BEFORE, MORE, WS, JsonValue, json_object
from .tool_events import ARG_KEYS, CallArgs, CallEnd, CallStart, Content, Event

# A trailing \\uD800-\\uDBFF escape (an unescaped backslash): the first half of a pair, held until the second.
_HIGH_SURROGATE_TAIL = re.compile(r"(?:^|[^\\])(?:\\\\)*\\u[dD][89abAB][0-9a-fA-F]{2}$")


class Break(Exception):
    """The JSON being read cannot continue here (or the text ended); the reader decides what the block was."""


Machine = Generator[None, None, None]


class CallReader:
    """A cursor over one answer's text, which grows by deltas, and the events read from it so far."""

    def __init__(self, tool_names: set[str] | None) -> None:
        self._names = None if tool_names is None else frozenset(tool_names)
        self._text, self._pos, self._eof = "", 0, False
        self._out: list[Event] = []
        self._calls = 0
        # content (rule 5): whitespace held at its end, whether a call came after the last content, and
        # whether any content went out
        self._ws, self._after_call, self._said = "", False, False
        # the arguments being streamed: their reader, call, form, the first raw character not yet sent,
        # whitespace held at their end and whether anything went out (a string's text is trimmed, rule 1)
        self._live: JsonValue | None = None
        self._live_index, self._live_string, self._sent, self._args_ws, self._args_lead = 0, False, 0, "", False

    # ---- reading ------------------------------------------------------------------------------------
    def _more(self) -> Generator[None, None, bool]:
        """Wait for the next delta; False once the answer has ended."""
        if self._eof:
            return False
        self._flush_args()
        yield
        return True

    def _need(self) -> Generator[None, None, None]:
        if not (yield from self._more()):
            raise Break

    def _peek(self) -> Generator[None, None, str]:
        """The next character that is not JSON whitespace (the whitespace is consumed); Break at the end."""
        while True:
            text = self._text
            while self._pos < len(text):
                if text[self._pos] not in WS:
                    return text[self._pos]
                self._pos += 1
            yield from self._need()

    def _at(self, marker: str) -> Generator[None, None, bool]:
        """Consume `marker` if the text goes on with it; False (nothing consumed) when it does not."""
        while True:
            seen = self._text[self._pos:self._pos + len(marker)]
            if seen == marker:
                self._pos += len(marker)
                return True
            if not marker.startswith(seen) or not (yield from self._more()):
                return False

    def _value(self, v: JsonValue | None = None) -> Generator[None, None, tuple[int, int]]:
        """Read one JSON value at the cursor; its (start, end). Break where it cannot continue."""
        v = v or JsonValue()
        start = self._pos
        while True:
            text = self._text
            while self._pos < len(text):
                r = v.step(text[self._pos])
                if r == BAD:
                    raise Break
                if r != DONE_BEFORE:
                    self._pos += 1
                if r != MORE:
                    return start, self._pos
            if self._eof and v.ends_here():
                return start, self._pos
            yield from self._need()

    def _content(self, markers: tuple[str, ...]) -> Generator[None, None, str | None]:
        """Content up to the first of `markers` (consumed and returned), or to the end (None)."""
        while True:
            self._text, self._pos = self._text[self._pos:], 0  # nothing before the cursor is read again
            hits = [(i, m) for m in markers if (i := self._text.find(m)) >= 0]
            if hits:
                i, m = min(hits)
                self._say(self._text[:i])
                self._pos = i + len(m)
                return m
            # a tail that may still become a marker waits for the next delta (rule 4)
            self._pos = len(self._text) - max((_partial(self._text, m) for m in markers), default=0)
            self._say(self._text[:self._pos])
            if not (yield from self._more()):
                self._say(self._text[self._pos:])
                self._pos = len(self._text)
                return None

    # ---- output -------------------------------------------------------------------------------------
    def _say(self, text: str) -> None:
        """Content, with the whitespace rules of rule 5."""
        body = text.strip()
        if not body:
            self._ws += text
            return
        begin, end = len(text) - len(text.lstrip()), len(text.rstrip())
        lead = "" if self._after_call and not self._said else self._ws + text[:begin]
        self._out.append(Content(lead + text[begin:end]))
        self._ws, self._after_call, self._said = text[end:], False, True

    def _say_end(self) -> None:
        """The answer has ended: whitespace held at the end of content goes out unless a call came after it."""
        if not self._after_call and self._ws:
            self._out.append(Content(self._ws))
        self._ws = ""

    def _release(self, start: int) -> None:
        """The block read since `start` was no call: its text is content (rule 2)."""
        self._say(self._text[start:self._pos])

    def _start_call(self, name: str) -> int:
        index, self._calls = self._calls, self._calls + 1
        self._ws, self._after_call = "", True
        self._out.append(CallStart(index, name))
        return index

    def _args_out(self, index: int, text: str) -> None:
        if text:
            self._out.append(CallArgs(index, text))

    def _flush_args(self) -> None:
        """Send what has been read of the streamed arguments (a string's: decoded, trimmed at both ends)."""
        v = self._live
        if v is None:
            return
        if not self._live_string:
            self._args_out(self._live_index, self._text[self._sent:self._pos])
            self._sent = self._pos
            return
        if v.state == "done":
            cut = self._pos - 1  # the closing quote
        else:  # an unfinished escape, and the first half of a surrogate pair, wait for the rest
            cut = self._pos - v.esc
            if _HIGH_SURROGATE_TAIL.search(self._text[self._sent:cut]):
                cut -= 6
        out = self._args_ws + json.loads('"' + self._text[self._sent:cut] + '"')
        self._sent = cut
        if not self._args_lead:
            out = out.lstrip()
        body = out.rstrip()
        self._args_ws = out[len(body):]
        self._args_lead = self._args_lead or bool(body)
        self._args_out(self._live_index, body)

    # ---- one call object (rules 1-3) ----------------------------------------------------------------
    def _known(self, name: object) -> bool:
        return isinstance(name, str) and bool(name) and (self._names is None or name in self._names)

    def _args(self, index: int, first: str) -> Generator[None, None, bool]:
        """Stream the arguments value at the cursor; whether it is a whole JSON object (rule 3)."""
        self._live, self._live_index, self._live_string = JsonValue(), index, first == '"'
        self._sent, self._args_ws, self._args_lead = self._pos + self._live_string, "", False
        try:
            start, end = yield from self._value(self._live)
        finally:
            self._flush_args()
            self._live = None
        if self._live_string:
            return json_object(json.loads(self._text[start:end]).strip()) is not None
        return first == "{"

    def _early_args(self, index: int, start: int, end: int) -> bool:
        """Arguments read before the name, sent whole once the call starts."""
        raw = self._text[start:end]
        if raw[0] == '"':
            text = json.loads(raw).strip()
            self._args_out(index, text)
            return json_object(text) is not None
        self._args_out(index, raw)
        return raw[0] == "{"

    def _call(self, start: int) -> Generator[None, None, bool]:
        """The call object at the cursor ("{"), its block opened at `start`; False: it was no call (released)."""
        index: int | None = None
        early: tuple[int, int] | None = None
        seen, valid, closed = False, False, False
        try:
            self._pos += 1
            c = yield from self._peek()
            while c != "}":
                if c != '"':
                    raise Break
                ks, ke = yield from self._value()
                key = json.loads(self._text[ks:ke])
                if (yield from self._peek()) != ":":
                    raise Break
                self._pos += 1
                c = yield from self._peek()
                if key == "name" and index is None:
                    if c != '"':
                        raise Break
                    ns, ne = yield from self._value()
                    name = json.loads(self._text[ns:ne])
                    if not self._known(name):
                        raise Break
                    index = self._start_call(name)
                    if early is not None:
                        valid = self._early_args(index, *early)
                elif key in ARG_KEYS and not seen:
                    seen = True
                    if index is None:
                        early = yield from self._value()
                    else:
                        valid = yield from self._args(index, c)
                else:
                    yield from self._value()
                c = yield from self._peek()
                if c == ",":
                    self._pos += 1
                    c = yield from self._peek()
                elif c != "}":
                    raise Break
            self._pos += 1
            closed = True
            if index is None:
                raise Break
        except Break:
            if index is None:
                self._release(start)
                return False
        if not seen:
            self._args_out(index, "{}")
            valid = closed
        self._out.append(CallEnd(index, valid))
        return True


def _partial(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker` (it may still become one)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
