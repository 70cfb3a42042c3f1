"""How long a step may be in flight before the link gives up on it (coordinator/link.py runs the clock).

A stage that drops a step while its I/O thread still answers PINGs would otherwise hold the step's requests
forever: the heartbeat sees a live stage. Rules:
- Stages run steps in order, so only the oldest step in flight is timed, from when it became the oldest (its
  submission, or the previous step's answer if that came later): steps queued behind it are not its cost.
- Its limit is `floor_s + SLACK * tokens * per_token_s`. `per_token_s` is an exponentially weighted mean
  (weight ALPHA) of seconds per token of the answered steps, timed the same way; before the first answer it is
  INITIAL_TOKEN_S, generous, since a stage's first steps include its warm-up. A limit only grows with the
  slowest rate seen lately, never below the floor.
- Past its limit, the link fails every step in flight, marks down the stage that holds the step (the first one
  whose PONG `last_step` is older than it) and resynchronises it as any stage that comes back (a HELLO, then
  the tables' snapshot). No torch, no sockets: `now` comes from the caller.
"""
from __future__ import annotations

from dataclasses import dataclass

SLACK = 10.0
ALPHA = 0.2
INITIAL_TOKEN_S = 0.5


@dataclass
class _Step:
    tokens: int
    submitted: float


class StepClock:
    """Steps in flight in submission order, and the rate their answers came at."""

    def __init__(self, floor_s: float) -> None:
        self.floor_s = floor_s
        self.per_token_s: float | None = None
        self._steps: dict[int, _Step] = {}
        self._last_answer = 0.0

    def submitted(self, step: int, tokens: int, now: float) -> None:
        self._steps[step] = _Step(max(tokens, 1), now)

    def answered(self, step: int, now: float, measure: bool = True) -> None:
        """`step` is done (answered, failed or given up); `measure` feeds its time into the rate."""
        s = self._steps.pop(step, None)
        if s is None:
            return
        if measure:
            rate = (now - max(s.submitted, self._last_answer)) / s.tokens
            self.per_token_s = rate if self.per_token_s is None else (1 - ALPHA) * self.per_token_s + ALPHA * rate
        self._last_answer = max(self._last_answer, now)

    def limit(self, tokens: int) -> float:
        """Seconds a step of `tokens` tokens may take once it is the oldest."""
        rate = INITIAL_TOKEN_S if self.per_token_s is None else self.per_token_s
        return self.floor_s + SLACK * max(tokens, 1) * rate

    def overdue(self, now: float) -> tuple[int, float, int] | None:
        """(step, limit, tokens) of the oldest step when it is past its limit; None otherwise."""
        if not self._steps:
            return None
        step = min(self._steps)
        s = self._steps[step]
        limit = self.limit(s.tokens)
        return (step, limit, s.tokens) if now - max(s.submitted, self._last_answer) > limit else None

    def clear(self) -> None:
        self._steps.clear()
