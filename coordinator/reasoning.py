"""The reasoning section of a completion: `<think> ... </think>` apart from the answer.

Rules:
1. A model reasons when its chat template writes a thinking section (`template_thinks`: the template's source
   holds THINK_OPEN). Only then is a completion split; any other model's text is all answer.
2. Where the completion starts: inside the section when the rendered prompt ends in an open one (its last
   THINK_OPEN comes after its last THINK_CLOSE: Qwen3 with `enable_thinking`, or a template that always opens
   it); none when the prompt ends with a closed section (thinking turned off: all of it is answer); else the
   section starts only if the completion itself begins with THINK_OPEN (after whitespace).
3. The section ends at THINK_CLOSE; the whitespace right after it (templates write "\\n\\n") is not answer.
   A completion that never closes it is all reasoning (it ran out of tokens while thinking), as vLLM returns it.
4. Streaming (`ThinkSplitter.feed`) gives the same split as the whole text (`split`) for any cut of the text
   into deltas: text that may be the start of a marker is held back until the next delta tells.
5. A thinking budget (Anthropic's `thinking.budget_tokens`) is a token limit on the section, enforced by a
   grammar (coordinator/constraints.py): at most that many tokens inside, then THINK_CLOSE is forced and the
   answer follows (freely, or under the request's other constraint).
"""
from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def template_thinks(chat_template: str | None) -> bool:
    return bool(chat_template) and THINK_OPEN in chat_template


def prompt_closes_thinking(prompt_text: str) -> bool:
    """The rendered prompt ends with a closed section (Qwen3 with `enable_thinking` false writes an empty one):
    the completion is all answer (rule 2)."""
    closed = prompt_text.rfind(THINK_CLOSE)
    return closed >= 0 and closed > prompt_text.rfind(THINK_OPEN) and not prompt_text[closed + len(THINK_CLOSE):].strip()


def prompt_opens_thinking(prompt_text: str) -> bool:
    """The rendered prompt leaves a thinking section open (rule 2)."""
    opened = prompt_text.rfind(THINK_OPEN)
    return opened >= 0 and opened > prompt_text.rfind(THINK_CLOSE)


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker` (it may still become one)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ThinkSplitter:
    """Text deltas -> (reasoning, answer) deltas, by rules 2-4."""

    def __init__(self, inside: bool) -> None:
        self._state = "inside" if inside else "start"  # start -> inside -> after, or start -> answer
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) text that may go out now."""
        reasoning, answer = [], []
        text = self._held + text
        self._held = ""
        while text:
            if self._state == "start":
                stripped = text.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._state, text = "inside", stripped[len(THINK_OPEN):]
                elif THINK_OPEN.startswith(stripped):  # only whitespace, or a prefix of the marker so far
                    self._held = text
                    return "".join(reasoning), "".join(answer)
                else:
                    self._state = "answer"
            elif self._state == "inside":
                end = text.find(THINK_CLOSE)
                if end < 0:
                    keep = _held_prefix(text, THINK_CLOSE)
                    reasoning.append(text[: len(text) - keep])
                    self._held = text[len(text) - keep:]
                    return "".join(reasoning), "".join(answer)
                reasoning.append(text[:end])
                self._state, text = "after", text[end + len(THINK_CLOSE):]
            elif self._state == "after":
                stripped = text.lstrip()
                if not stripped:
                    return "".join(reasoning), "".join(answer)
                self._state, text = "answer", stripped
            else:
                answer.append(text)
                text = ""
        return "".join(reasoning), "".join(answer)

    def flush(self) -> tuple[str, str]:
        """What is held at the end: a partial marker inside the section is reasoning, before it answer."""
        held, self._held = self._held, ""
        if self._state == "inside":
            return held, ""
        if self._state == "start":
            return "", held
        return "", ""

    @property
    def reasoning_done(self) -> bool:
        return self._state in ("after", "answer")


def split(text: str, inside: bool) -> tuple[str, str]:
    """(reasoning, answer) of a whole completion."""
    s = ThinkSplitter(inside)
    r1, a1 = s.feed(text)
    r2, a2 = s.flush()
    return r1 + r2, a1 + a2
