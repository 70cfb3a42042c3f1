"""The conversation cache: which token prefix each table holds, and which held prefix a new prompt reuses.

A conversation is a table (a slot's, or a parked one) plus the tokens whose K/V sit in its cells
`[0, len(tokens))`. A new prompt may reuse the K/V of the held conversation sharing the longest exact token
prefix with it. The match is bound to that one conversation: only cells of the table that really holds those
tokens are reused, and only for the prefix both share (never bytes another conversation left behind).
At least one prompt token is always read again, because its logits are what the first sampled token needs.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

_clock = itertools.count(1)


def tick() -> int:
    """A logical clock for least-recently-used order (strictly increasing, no ties)."""
    return next(_clock)


@dataclass
class Conversation:
    table: int
    tokens: list[int] = field(default_factory=list)
    last_used: int = field(default_factory=tick)
    answer_at: int | None = None  # where its last sampled answer begins (None: no answer, a prompt only)

    @property
    def answer_start(self) -> int:
        return len(self.tokens) if self.answer_at is None else min(self.answer_at, len(self.tokens))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class Match:
    conversation: Conversation
    reuse: int  # cells of the conversation's table reused as they are


def best_match(prompt: list[int], conversations: list[Conversation]) -> Match | None:
    """The held conversation sharing the longest prefix with `prompt` (ties: most recently used).

    `reuse` is capped at `len(prompt) - 1` so the last prompt token is read again. A match of 0 cells is
    no match.
    """
    best: Match | None = None
    for conv in conversations:
        n = min(common_prefix(prompt, conv.tokens), len(prompt) - 1)
        if n <= 0:
            continue
        if best is None or n > best.reuse or (n == best.reuse and conv.last_used > best.conversation.last_used):
            best = Match(conv, n)
    return best


def worth_taking(match: Match, prompt_len: int) -> bool:
    """Whether a new prompt takes over the held conversation it matches (reusing that table in place).

    Yes when the prompt continues the whole conversation (nothing is lost), or when the shared part is at least
    half of the prompt (an answer asked again, a late branch). A smaller match would cut another conversation
    short to save a few tokens (every chat prompt shares the template's first tokens, often a system prompt), so
    it is ignored: the request starts cold in an idle slot, and the conversation stays whole (parked if its slot
    is needed).
    """
    return match.reuse >= len(match.conversation.tokens) or 2 * match.reuse >= prompt_len
