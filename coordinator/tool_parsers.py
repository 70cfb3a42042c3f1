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
    FAMILIES; check_family(family) -> family or ValueError (rule 8)
    A call that is not `valid` (rule 3) may hold text that is not JSON: pass it on as text (OpenAI's
    `arguments` is a string), never `json.loads` it unchecked.

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
4. Streaming and whole parsing are one machine: `parse` feeds the whole text to a StreamParser, so the two
   agree on the content and calls of a text for any cut of it into deltas. Text that may still become a
   marker ("<tool" at the end of a delta) is held back until the next delta tells.
5. Content is the text outside calls, in order. Dropped: markers, separators between calls (";", ","), and
   whitespace that touches a call, except the whitespace that, after a call, parts content written before
   it from content written after it ("A <call> B" -> "A B"). A text with no call is returned as it is.
   hermes       text before, between and after blocks is content; after a call, text before its
                "</tool_call>" (or the next "<tool_call>") is content.
   llama3_json  an answer that does not start (after whitespace and <|python_tag|>) with "{" is content;
                after the calls, the rest is content from the first thing that is not a further call.
   mistral      text before [TOOL_CALLS] is content; after a list, a lone object or a v11 call, text is
                content until the next [TOOL_CALLS]. A v11 name is [A-Za-z0-9_.-]+ right before [ARGS].
6. `format_calls(family, calls)` writes calls as grammar.py's tool-call grammar does (hermes blocks joined by
   "\\n", llama3_json objects joined by "; ", mistral one list joined by ", "); `parse` reads them back.
   The calls' `arguments` must be JSON object texts.
7. `family_for_template`: the first of these found in the template's source: "<tool_call>" -> hermes,
   "[TOOL_CALLS]" -> mistral, "<|python_tag|>", an "ipython" role or Llama's '"parameters": dictionary of
   argument name' wording -> llama3_json; else None (the template renders no tools in a format known here).
8. An unknown family name is a ValueError naming it and the known ones.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass

FAMILIES = ("hermes", "llama3_json", "mistral")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
ARG_KEYS = ("arguments", "parameters")

_WS = " \t\n\r"  # JSON's whitespace
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_HEX = frozenset("0123456789abcdefABCDEF")
# A trailing \\uD800-\\uDBFF escape (an unescaped backslash): the first half of a pair, held until the second.
_HIGH_SURROGATE_TAIL = re.compile(r"(?:^|[^\\])(?:\\\\)*\\u[dD][89abAB][0-9a-fA-F]{2}$")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON object text (rule 1); the streamed text when not `valid` (rule 3)
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


def family_for_template(chat_template: str | None) -> str | None:
    """The tool-call family a chat template writes (rule 7)."""
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
    """`calls` in `family`'s text format (rule 6)."""
    key = "parameters" if check_family(family) == "llama3_json" else "arguments"
    objs = [f'{{"name": {json.dumps(c.name, ensure_ascii=False)}, "{key}": {c.arguments}}}' for c in calls]
    if family == "hermes":
        return "\n".join(f"{HERMES_OPEN}\n{o}\n{HERMES_CLOSE}" for o in objs)
    if family == "llama3_json":
        return "; ".join(objs)
    return f"{MISTRAL_CALLS}[{', '.join(objs)}]"


def parse(family: str, text: str, tool_names: set[str] | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole answer: the stream machine fed all at once (rule 4)."""
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


# ---- one JSON value, a character at a time ----------------------------------------------------------
_MORE, _DONE, _DONE_BEFORE, _BAD = 0, 1, 2, 3  # step(): consumed | consumed, value ends | ends before c | refused
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_NUM_ENDS = frozenset({"0", "int", "frac", "exp"})  # number states where a number may end


class _JsonValue:
    """Reads one JSON value (strict: no NaN, no raw control characters in strings) with an explicit stack,
    so nesting costs no recursion; `step` says when the value ends and refuses the first character that
    cannot continue it."""

    __slots__ = ("stack", "state", "key", "rest", "num", "esc")

    def __init__(self) -> None:
        self.stack: list[str] = []  # open "{" / "["
        self.state = "value"  # value | key | key_or_end | value_or_end | colon | after | str | lit | num | done
        self.key = False  # the string being read is an object key
        self.rest = ""  # the rest of a literal
        self.num = ""  # - | 0 | int | . | frac | e | esign | exp
        self.esc = 0  # characters of an unfinished escape read so far ("\\" = 1, "\\u" = 2, ... "\\uXXX" = 5)

    def ends_here(self) -> bool:
        """The text may end here with the value complete (a top-level number)."""
        return self.state == "done" or (self.state == "num" and not self.stack and self.num in _NUM_ENDS)

    def _ended(self) -> int:
        if not self.stack:
            self.state = "done"
            return _DONE
        self.state = "after"
        return _MORE

    def step(self, c: str) -> int:
        s = self.state
        if s == "str":
            if self.esc:
                if self.esc == 1:
                    if c == "u":
                        self.esc = 2
                    elif c in '"\\/bfnrt':
                        self.esc = 0
                    else:
                        return _BAD
                elif c in _HEX:
                    self.esc = 0 if self.esc == 5 else self.esc + 1
                else:
                    return _BAD
                return _MORE
            if c == '"':
                if self.key:
                    self.state, self.key = "colon", False
                    return _MORE
                return self._ended()
            if c == "\\":
                self.esc = 1
            elif c < " ":
                return _BAD
            return _MORE
        if s == "num":
            return self._number(c)
        if s == "lit":
            if c != self.rest[0]:
                return _BAD
            self.rest = self.rest[1:]
            return _MORE if self.rest else self._ended()
        if c in _WS:
            return _MORE
        if s == "after":
            top = self.stack[-1]
            if c == ",":
                self.state = "key" if top == "{" else "value"
                return _MORE
            if c == ("}" if top == "{" else "]"):
                self.stack.pop()
                return self._ended()
            return _BAD
        if s == "colon":
            if c != ":":
                return _BAD
            self.state = "value"
            return _MORE
        if (s == "key_or_end" and c == "}") or (s == "value_or_end" and c == "]"):
            self.stack.pop()
            return self._ended()
        if s in ("key", "key_or_end"):
            if c != '"':
                return _BAD
            self.state, self.key = "str", True
            return _MORE
        if s not in ("value", "value_or_end"):
            return _BAD
        if c == "{" or c == "[":
            self.stack.append(c)
            self.state = "key_or_end" if c == "{" else "value_or_end"
        elif c == '"':
            self.state = "str"
        elif c in _LITERALS:
            self.state, self.rest = "lit", _LITERALS[c]
        elif c == "-" or "0" <= c <= "9":
            self.state, self.num = "num", ("-" if c == "-" else "0" if c == "0" else "int")
        else:
            return _BAD
        return _MORE

    def _number(self, c: str) -> int:
        n, digit = self.num, "0" <= c <= "9"
        if n == "-" and digit:
            self.num = "0" if c == "0" else "int"
        elif n in ("int", "frac", "exp") and digit:
            pass
        elif n in ("0", "int") and c == ".":
            self.num = "."
        elif n in ("0", "int", "frac") and c in "eE":
            self.num = "e"
        elif (n == "." and digit) or (n == "e" and c in "+-"):
            self.num = "frac" if n == "." else "esign"
        elif n in ("e", "esign") and digit:
            self.num = "exp"
        elif n in _NUM_ENDS:  # the number ended before c
            if not self.stack:
                self.state = "done"
                return _DONE_BEFORE
            self.state = "after"
            return self.step(c)
        else:
            return _BAD
        return _MORE


def _json_object(text: str) -> dict | None:
    def refuse(name: str) -> None:
        raise ValueError(name)
    try:
        value = json.loads(text, parse_constant=refuse)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class _Break(Exception):
    """The JSON being read cannot continue here (or the text ended); the reader decides what the block was."""


Machine = Generator[None, None, None]


class StreamParser:
    """Text deltas of one answer -> events, by rules 1-5; `finish()` once the answer has ended."""

    def __init__(self, family: str, tool_names: set[str] | None = None) -> None:
        machines: dict[str, Callable[[], Machine]] = {
            "hermes": self._hermes, "llama3_json": self._llama3_json, "mistral": self._mistral}
        self._names = None if tool_names is None else frozenset(tool_names)
        self._text, self._pos, self._eof = "", 0, False
        self._out: list[Event] = []
        self._calls = 0
        # content (rule 5): whitespace held at its end, whether a call came after the last content, and
        # whether any content went out
        self._ws, self._after_call, self._said = "", False, False
        # the arguments being streamed: their reader, call, form, the first raw character not yet sent,
        # whitespace held at their end and whether anything went out (a string's text is trimmed, rule 1)
        self._live: _JsonValue | None = None
        self._live_index, self._live_string, self._sent, self._args_ws, self._args_lead = 0, False, 0, "", False
        self._run: Machine | None = machines[check_family(family)]()
        next(self._run)  # runs until it waits for text

    def feed(self, delta: str) -> list[Event]:
        if self._eof:
            raise RuntimeError("feed() after finish()")
        if delta:
            self._text += delta
            self._resume()
        return self._take()

    def finish(self) -> list[Event]:
        if not self._eof:
            self._eof = True
            self._resume()
            assert self._run is None, "the machine must end with the text"
            if not self._after_call and self._ws:
                self._out.append(Content(self._ws))
            self._ws = ""
        return self._take()

    def _take(self) -> list[Event]:
        out, self._out = self._out, []
        return out

    def _resume(self) -> None:
        if self._run is not None:
            try:
                self._run.send(None)
            except StopIteration:
                self._run = None

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
            raise _Break

    def _peek(self) -> Generator[None, None, str]:
        """The next character that is not JSON whitespace (the whitespace is consumed); _Break at the end."""
        while True:
            text = self._text
            while self._pos < len(text):
                if text[self._pos] not in _WS:
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

    def _value(self, v: _JsonValue | None = None) -> Generator[None, None, tuple[int, int]]:
        """Read one JSON value at the cursor; its (start, end). _Break where it cannot continue."""
        v = v or _JsonValue()
        start = self._pos
        while True:
            text = self._text
            while self._pos < len(text):
                r = v.step(text[self._pos])
                if r == _BAD:
                    raise _Break
                if r != _DONE_BEFORE:
                    self._pos += 1
                if r != _MORE:
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
        self._live, self._live_index, self._live_string = _JsonValue(), index, first == '"'
        self._sent, self._args_ws, self._args_lead = self._pos + self._live_string, "", False
        try:
            start, end = yield from self._value(self._live)
        finally:
            self._flush_args()
            self._live = None
        if self._live_string:
            return _json_object(json.loads(self._text[start:end]).strip()) is not None
        return first == "{"

    def _early_args(self, index: int, start: int, end: int) -> bool:
        """Arguments read before the name, sent whole once the call starts."""
        raw = self._text[start:end]
        if raw[0] == '"':
            text = json.loads(raw).strip()
            self._args_out(index, text)
            return _json_object(text) is not None
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
                    raise _Break
                ks, ke = yield from self._value()
                key = json.loads(self._text[ks:ke])
                if (yield from self._peek()) != ":":
                    raise _Break
                self._pos += 1
                c = yield from self._peek()
                if key == "name" and index is None:
                    if c != '"':
                        raise _Break
                    ns, ne = yield from self._value()
                    name = json.loads(self._text[ns:ne])
                    if not self._known(name):
                        raise _Break
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
                    raise _Break
            self._pos += 1
            closed = True
            if index is None:
                raise _Break
        except _Break:
            if index is None:
                self._release(start)
                return False
        if not seen:
            self._args_out(index, "{}")
            valid = closed
        self._out.append(CallEnd(index, valid))
        return True

    # ---- the families (rule 5) ----------------------------------------------------------------------
    def _hermes(self) -> Machine:
        marker = yield from self._content((HERMES_OPEN,))
        while marker is not None:
            start = self._pos - len(marker)
            try:
                c = yield from self._peek()
            except _Break:
                self._release(start)
                return
            if c == "{" and (yield from self._call(start)):
                marker = yield from self._content((HERMES_CLOSE, HERMES_OPEN))
                if marker == HERMES_CLOSE:  # the call's end: whitespace before it touches the call
                    self._ws, self._after_call = "", True
                    marker = yield from self._content((HERMES_OPEN,))
                continue
            if c != "{":
                self._release(start)
            marker = yield from self._content((HERMES_OPEN,))

    def _llama3_json(self) -> Machine:
        start: int | None = 0  # where text not yet known to be calls begins; None: right after a call
        try:
            yield from self._peek()
            if (yield from self._at(PYTHON_TAG)):
                yield from self._peek()
            while self._text[self._pos] == "{":
                called = yield from self._call(start)
                start = None
                if not called:
                    break
                while (yield from self._peek()) == ";":
                    self._pos += 1
                start = self._pos
        except _Break:
            pass  # the text ended
        if start is not None:
            self._release(start)
        yield from self._content(())

    def _mistral(self) -> Machine:
        marker = yield from self._content((MISTRAL_CALLS,))
        while marker is not None:
            start = self._pos - len(marker)
            try:
                c = yield from self._peek()
                if c == "[":
                    yield from self._list(start)
                elif c == "{":
                    yield from self._call(start)
                else:
                    yield from self._v11(start)
            except _Break:
                self._release(start)
            marker = yield from self._content((MISTRAL_CALLS,))

    def _list(self, start: int) -> Machine:
        self._pos += 1
        first = True
        while True:
            try:
                c = yield from self._peek()
            except _Break:
                c = ""
            if c != "{":
                if first:
                    self._release(start)
                return
            if not (yield from self._call(start if first else self._pos)):
                return
            first = False
            try:
                c = yield from self._peek()
            except _Break:
                return
            if c != ",":
                if c == "]":
                    self._pos += 1
                return
            self._pos += 1

    def _v11(self, start: int) -> Machine:
        """name[ARGS]{json} after its [TOOL_CALLS]; _Break (the caller releases) until the name is known."""
        begin = self._pos
        while True:
            text = self._text
            while self._pos < len(text) and text[self._pos] in _NAME_CHARS:
                self._pos += 1
            if self._pos < len(text):
                break
            yield from self._need()
        name = self._text[begin:self._pos]
        if not (yield from self._at(MISTRAL_ARGS)) or not self._known(name):
            raise _Break
        index = self._start_call(name)
        valid = False
        try:
            valid = yield from self._args(index, (yield from self._peek()))
        except _Break:
            pass
        self._out.append(CallEnd(index, valid))


def _partial(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker` (it may still become one)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
