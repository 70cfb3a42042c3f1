"""A thinking budget: at most N tokens in a reasoning section, then its close marker is forced.

Anthropic's `thinking.budget_tokens` limits the section a thinking template opens (coordinator/reasoning.py).
The grammar (grammar.after_reasoning) lets the section close whenever the model closes it and constrains what
follows; this module cuts it at the budget. It lives in the request's Matcher (grammar.py), which asks it
before every mask.

Rules:
1. The count is of completion tokens inside the section: from the first token when the prompt opens the
   section (`opened`), else from the token that completes the open marker the completion itself begins with
   (a completion that does not begin with it has no section, and nothing is ever forced).
2. The section is closed once the decoded bytes since it opened hold the close marker (a marker split over
   several tokens counts, and so does one the model writes itself before the budget).
3. When `budget` tokens sit in the open section, the next tokens are forced, one per sampled step, to the
   close marker's ids as the tokenizer encodes it: the mask allows that one id. When the section's bytes end
   inside a UTF-8 character, the grammar allows none of the marker yet: the tokens that finish the character
   come first (at most three, byte tokens), then the marker. Once forcing began, a sampled token that is not
   the forced one is an error (the last stage sampled past its mask). After the last forced id nothing more
   is imposed here; the grammar goes on as usual.
4. A budget of 0 forces the marker at once (the section is empty).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SectionBudget:
    """What a request asks: `tokens` at most in the section; `opened`: the prompt opens it (rule 1)."""

    tokens: int
    opened: bool


class BudgetCounter:
    """One request's position against its SectionBudget (rules 1-4)."""

    def __init__(self, budget: SectionBudget, open_marker: str, close_marker: str,
                 encode: Callable[[str], list[int]], decode: Callable[[list[int]], bytes]) -> None:
        if budget.tokens < 0:
            raise ValueError(f"a thinking budget must be >= 0, got {budget.tokens}")
        self.budget = budget.tokens
        self._open, self._close = open_marker.encode(), close_marker.encode()
        self._close_ids = list(encode(close_marker))
        if not self._close_ids:
            raise ValueError(f"the close marker {close_marker!r} encodes to no tokens")
        self._decode = decode
        self._state = "inside" if budget.opened else "before"  # before | inside | closed | none
        self._head: list[int] = []  # completion tokens before the section opened (rule 1)
        self._section: list[int] = []  # tokens since it opened
        self._forcing = 0  # close-marker ids forced so far

    @property
    def inside(self) -> int:
        """Tokens counted in the section so far (forced ones excluded)."""
        return len(self._section) - self._forcing

    @property
    def forcing(self) -> bool:
        """The first marker id is taken: the rest must follow."""
        return self._forcing > 0

    def forced(self) -> int | None:
        """The id the next token must be (rule 3), or None."""
        if self._state != "inside":
            return None
        if self._forcing or len(self._section) >= self.budget:
            return self._close_ids[self._forcing]
        return None

    def advance(self, token: int) -> None:
        """Take the sampled `token` (ValueError when it is not the forced id)."""
        want = self.forced()
        if want is not None and token != want:
            if self._forcing:
                raise ValueError(f"token {token} sampled where the thinking budget forces {want}")
            want = None  # a token finishing a character before the marker (rule 3)
        if self._state == "before":
            self._head.append(token)
            text = self._decode(self._head)
            if text.startswith(self._open):
                self._state = "inside"
                tail = text[len(self._open):]
                self._section = [token] if tail else []  # a token that completes the marker and goes on
                self._check_closed()
            elif not self._open.startswith(text):
                self._state = "none"
            return
        if self._state != "inside":
            return
        self._section.append(token)
        if want is not None:
            self._forcing += 1
            if self._forcing == len(self._close_ids):
                self._state = "closed"
            return
        self._check_closed()

    def _check_closed(self) -> None:
        recent = self._section[-(len(self._close) + 8):]  # every token is at least one byte, most are more
        if self._close in self._decode(recent):
            self._state = "closed"
