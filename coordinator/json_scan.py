"""One JSON value, read a character at a time, for the tool-call reader (tool_reader.py).

Rules:
1. Strict JSON: no NaN or Infinity, no raw control characters in strings, no trailing commas.
2. `JsonValue.step(c)` reads one character: MORE (consumed, the value goes on), DONE (consumed, the value ends
   with it), DONE_BEFORE (not consumed: a top-level number ended before it) or BAD (refused: the value cannot
   go on with it; the reader stops there).
3. Nesting is an explicit stack, not recursion, so the depth of the value costs no Python frames.
4. `ends_here()`: the text may end here with the value complete (only a top-level number needs it).
5. `json_object(text)` is the dict `text` holds, or None when it is not one JSON object (NaN refused).
"""
from __future__ import annotations

import json

WS = " \t\n\r"  # JSON's whitespace
_HEX = frozenset("0123456789abcdefABCDEF")
MORE, DONE, DONE_BEFORE, BAD = 0, 1, 2, 3  # step(): consumed | consumed, value ends | ends before c | refused
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_NUM_ENDS = frozenset({"0", "int", "frac", "exp"})  # number states where a number may end


class JsonValue:
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
            return DONE
        self.state = "after"
        return MORE

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
                        return BAD
                elif c in _HEX:
                    self.esc = 0 if self.esc == 5 else self.esc + 1
                else:
                    return BAD
                return MORE
            if c == '"':
                if self.key:
                    self.state, self.key = "colon", False
                    return MORE
                return self._ended()
            if c == "\\":
                self.esc = 1
            elif c < " ":
                return BAD
            return MORE
        if s == "num":
            return self._number(c)
        if s == "lit":
            if c != self.rest[0]:
                return BAD
            self.rest = self.rest[1:]
            return MORE if self.rest else self._ended()
        if c in WS:
            return MORE
        if s == "after":
            top = self.stack[-1]
            if c == ",":
                self.state = "key" if top == "{" else "value"
                return MORE
            if c == ("}" if top == "{" else "]"):
                self.stack.pop()
                return self._ended()
            return BAD
        if s == "colon":
            if c != ":":
                return BAD
            self.state = "value"
            return MORE
        if (s == "key_or_end" and c == "}") or (s == "value_or_end" and c == "]"):
            self.stack.pop()
            return self._ended()
        if s in ("key", "key_or_end"):
            if c != '"':
                return BAD
            self.state, self.key = "str", True
            return MORE
        if s not in ("value", "value_or_end"):
            return BAD
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
            return BAD
        return MORE

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
                return DONE_BEFORE
            self.state = "after"
            return self.step(c)
        else:
            return BAD
        return MORE


def json_object(text: str) -> dict | None:
    def refuse(name: str) -> None:
        raise ValueError(name)
    try:
        value = json.loads(text, parse_constant=refuse)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
