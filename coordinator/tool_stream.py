"""StreamParser: the text deltas of one answer -> Content and call events, in the format of the model's family
(the formats: tool_parsers.py).

Call objects and content are read by CallReader (tool_reader.py, rules 1-5 there); what is here is the public
feed / finish, and one machine per family, which says where calls may be and what is content.

Rules:
1. Streaming and whole parsing are one machine: `parse` (tool_parsers.py) feeds the whole text to a
   StreamParser, so the two agree on the content and calls of a text for any cut of it into deltas.
   `feed` after `finish` is a RuntimeError.
2. Content is the text outside calls, in order. Dropped: markers, separators between calls (";", ","), and
   whitespace that touches a call (tool_reader.py rule 5). A text with no call is returned as it is.
   hermes       text before, between and after blocks is content; after a call, text before its
                "</tool_call>" (or the next "<tool_call>") is content.
   llama3_json  an answer that does not start (after whitespace and <|python_tag|>) with "{" is content;
                after the calls, the rest is content from the first thing that is not a further call.
   mistral      text before [TOOL_CALLS] is content; after a list, a lone object or a v11 call, text is
                content until the next [TOOL_CALLS]. A v11 name is [A-Za-z0-9_.-]+ right before [ARGS].
"""
from __future__ import annotations

from collections.abc import Callable

from .tool_events import (HERMES_CLOSE, HERMES_OPEN, MISTRAL_ARGS, MISTRAL_CALLS, PYTHON_TAG, CallEnd, Event,
                          check_family)
from .tool_reader import Break, CallReader, Machine

_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")


class StreamParser(CallReader):
    """Text deltas of one answer -> events, by tool_reader.py rules 1-5 and rule 2 here; `finish()` once the
    answer has ended."""

    def __init__(self, family: str, tool_names: set[str] | None = None) -> None:
        machines: dict[str, Callable[[], Machine]] = {
            "hermes": self._hermes, "llama3_json": self._llama3_json, "mistral": self._mistral}
        super().__init__(tool_names)
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
            self._say_end()
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

    # ---- the families (rule 2) ----------------------------------------------------------------------
    def _hermes(self) -> Machine:
        marker = yield from self._content((HERMES_OPEN,))
        while marker is not None:
            start = self._pos - len(marker)
            try:
                c = yield from self._peek()
            except Break:
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
        except Break:
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
            except Break:
                self._release(start)
            marker = yield from self._content((MISTRAL_CALLS,))

    def _list(self, start: int) -> Machine:
        self._pos += 1
        first = True
        while True:
            try:
                c = yield from self._peek()
            except Break:
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
            except Break:
                return
            if c != ",":
                if c == "]":
                    self._pos += 1
                return
            self._pos += 1

    def _v11(self, start: int) -> Machine:
        """name[ARGS]{json} after its [TOOL_CALLS]; Break (the caller releases) until the name is known."""
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
            raise Break
        index = self._start_call(name)
        valid = False
        try:
            valid = yield from self._args(index, (yield from self._peek()))
        except Break:
            pass
        self._out.append(CallEnd(index, valid))
