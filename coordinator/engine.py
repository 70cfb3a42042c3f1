"""The seam between the HTTP front (`coordinator/api*.py`) and whatever generates tokens (the scheduler).

The front turns a client request into a `GenRequest` of token ids and reads back a stream of events:

    engine.generate(req)  ->  TokenEvent, TokenEvent, ..., Finished
                              ^ may raise EngineError before the first event (a refusal: the front answers
                                with an HTTP error) or after it (an error mid-stream: the front sends an
                                error event inside the stream).

Rules both sides keep:
- `generate` is an async generator function: calling it returns the iterator at once; the work starts on the
  first `__anext__`. Closing the iterator early (`aclose()`, or cancelling the task awaiting it) cancels the
  request and frees its slot; the front does this when a client disconnects or a stop string matches.
- A token in `stop_token_ids` ends the request with `Finished(reason="stop")`; it is not yielded and not
  counted in `completion_tokens` (the client never sees the end-of-turn token).
- `Finished.completion_tokens` counts the yielded TokenEvents; `cached_tokens` counts the prompt tokens whose
  K/V were reused from a held conversation (OpenAI `prompt_tokens_details.cached_tokens`).
- `truncated` is set when a decoding slot could not grow in a full pool: reason "length", `"truncated": true`.

No torch here, and nothing from `stages/`: this module is imported by both the front and the scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Literal, Protocol, runtime_checkable

from .thinking_budget import SectionBudget

SAMPLING_DEFAULTS: dict[str, float | int | list | None] = {
    "temperature": 1.0,  # 0 = greedy
    "top_p": 1.0,
    "top_k": 0,  # 0 = off
    "min_p": 0.0,
    "seed": None,  # None = a fresh random seed
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": None,  # [[token id, bias], ...], bias in [-100, 100], -100 bans; None = no bias
}
"""The keys of `GenRequest.sampling`, with the values that change nothing."""


@dataclass(frozen=True)
class GenRequest:
    """One generation: the prompt as token ids and how to sample the continuation.

    `sampling` has exactly the keys of `SAMPLING_DEFAULTS`. `logprobs` is how many top alternatives each
    TokenEvent carries in `top` (0: none); the sampled token's own logprob comes whenever the engine has it.
    `grammar` (coordinator/grammar.py) restricts every sampled token to what it allows; None: no constraint.
    `thinking` cuts the reasoning section at its budget (coordinator/thinking_budget.py), through the grammar's
    matcher.
    """

    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: dict = field(default_factory=lambda: dict(SAMPLING_DEFAULTS))
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: int = 0
    grammar: str | None = None
    thinking: SectionBudget | None = None  # a token budget on the reasoning section (needs a grammar)


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token; `logprob` of the token and `top` [(id, logprob), ...] best first, when asked.

    `cached_tokens`, on a request's first TokenEvent, is what its Finished will report (the prefill is done
    by then), so a stream can state the prompt's cache split at its start; None where the engine does not say.
    """

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True)
class Finished:
    """The last event of a request that ended normally."""

    reason: Literal["stop", "length"]
    truncated: bool
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class EngineError(Exception):
    """A request the engine refuses or cannot finish.

    `status` is the HTTP status the front answers with, `code` the machine-readable reason
    (OpenAI `error.code`), `type` the OpenAI `error.type`, `retry_after` seconds for a `Retry-After` header
    (503s the client should retry), `param` the request field at fault, if any. The front maps these to the
    Anthropic shape itself (e.g. a 503 `kv_pool_full` becomes `overloaded_error`).
    """

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        type: str = "server_error",
        retry_after: int | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.type = type
        self.retry_after = retry_after
        self.param = param

    def __repr__(self) -> str:
        return f"EngineError({self.status}, {self.code!r}, {self.message!r})"

    @classmethod
    def kv_pool_full(cls, want_cells: int, free_cells: int, retry_after: int = 10) -> "EngineError":
        """The pool cannot hold the prompt even after evicting every idle conversation."""
        return cls(
            503,
            "kv_pool_full",
            f"the KV pool is full: the prompt needs {want_cells} cells, {free_cells} are free after evictions; "
            f"retry in {retry_after} s",
            retry_after=retry_after,
        )

    @classmethod
    def queue_full(cls, retry_after: int = 10) -> "EngineError":
        """Too many requests are already waiting for a slot."""
        return cls(503, "queue_full", f"too many requests are waiting; retry in {retry_after} s", retry_after=retry_after)

    @classmethod
    def context_length(cls, prompt_tokens: int, max_tokens: int, max_context: int) -> "EngineError":
        """The prompt plus the completion it asks for would pass `max_context` (message names both numbers)."""
        return cls(
            400,
            "context_length_exceeded",
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the completion). "
            f"Please reduce the length of the prompt or the completion.",
            type="invalid_request_error",
            param="messages",
        )

    @classmethod
    def stage_down(cls, message: str = "a stage is down", retry_after: int | None = None) -> "EngineError":
        """A stage process is gone; requests fail until it is back (see /health)."""
        return cls(503, "stage_down", message, retry_after=retry_after)

    @classmethod
    def invalid(cls, message: str, param: str | None = None) -> "EngineError":
        """A request the engine cannot run as given (the front should have caught it)."""
        return cls(400, "invalid_request", message, type="invalid_request_error", param=param)

    @classmethod
    def internal(cls, message: str = "internal error") -> "EngineError":
        return cls(500, "internal_error", message)


@runtime_checkable
class Engine(Protocol):
    """What the HTTP front needs from the scheduler.

    `live_metrics()` shape (read at every /metrics scrape, so it must be cheap):
        {"running": n, "waiting": n,
         "kv_pool": {"cells": n, "free": n,
                     "slots": [{"slot": i, "cells": held, ...}, ...],
                     "parked": [{"table": t, "cells": held, ...}, ...]},
         "counters": {"evictions": n, "refusals": {code: n}, "truncations": n}}
    `health()`: {"status": "ok" | "degraded", "stages": [{"index": i, "up": bool, ...}, ...]}.
    `slots()`: one dict per slot, llama.cpp `/slots` style ({"id", "is_processing", "n_ctx", ...}).
    """

    max_context: int
    model_name: str

    def generate(self, req: GenRequest) -> AsyncIterator[TokenEvent | Finished]: ...

    def live_metrics(self) -> dict: ...

    def health(self) -> dict: ...

    def slots(self) -> list[dict]: ...

    def erase_slot(self, slot: int) -> int:
        """Drop the conversation an idle slot holds; returns its token count (EngineError if busy or unknown)."""
        ...

    def flush_cache(self) -> int:
        """Every idle held conversation (slots and parked) gives its cells back; returns the cells freed."""
        ...

    async def save_slot(self, slot: int, filename: str) -> dict:
        """An idle slot's conversation into session files (llama.cpp's answer: id_slot, filename, n_saved,
        n_written, timings); EngineError 400 for a bad name or empty slot, 409 busy, 501 disabled."""
        ...

    async def restore_slot(self, slot: int, filename: str) -> dict:
        """A saved conversation into an idle slot (id_slot, filename, n_restored, n_read, timings); EngineError
        400 for a refused file (the message says why), 409 busy, 503 kv_pool_full; a refusal changes nothing."""
        ...
