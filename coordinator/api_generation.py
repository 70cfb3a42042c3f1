"""One request's run through the engine, shared by the OpenAI and Anthropic routes.

`Front` holds what every route needs (config, engine, tokenizer, metrics) and turns prompt ids plus limits
into a `GenRequest`, refusing what cannot fit `max_context` before the engine sees it.
`Generation` reads the engine's events and turns them into text deltas:

    TokenEvent -> IncrementalDetokenizer.push -> StopStrings.feed -> Delta(text, logprobs)
    Finished   -> flush both, record usage and finish reason

Rules:
- `start()` waits for the first event, so a refusal (EngineError before any event) is still an HTTP error
  with its status; after that, errors arrive inside the stream.
- The engine iterator is closed in every way out: the end, a matched stop string, an error, a client that
  disconnects (watched on the ASGI `receive` channel, so a request still queued or prefilling is cancelled
  too), or the task being cancelled. Closing it is what frees the slot.
- Text that could still become a stop string is held back; a matched stop is cut and never sent. A token's
  logprob goes out with the first character of its text; after a stop, the tokens whose text starts at or
  past the stop string are neither reported (logprobs) nor counted (`completion_tokens`): usage and logprobs
  cover the tokens of the text returned.
- `cached_tokens` is known from the first event when the engine says it there (TokenEvent.cached_tokens),
  so a stream can report the prompt's cache split at its start; Finished has the last word.
- Timing for the metrics: arrival -> first token (TTFT), token -> token (ITL), arrival -> end (E2E).
- A prompt text of `LARGE_TEXT_CHARS` or more is tokenized in a worker thread with the GIL released
  (`encode_batch`; plain `encode` holds it), so a multi-megabyte prompt does not stall every other stream;
  at most TOKENIZE_WORKERS such texts at once. Before any of it, a text longer than max_context x the
  longest token (in characters) is refused (400 `context_length_exceeded`): it cannot fit, and tokenizing
  it would cost ~150 bytes of memory per token. A token count (`count_tokens`) may go COUNT_CONTEXTS
  contexts long, so a client can tell how far past the context a conversation is.
"""
from __future__ import annotations

import asyncio
import functools
import bisect
import inspect
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import anyio
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse

from pool.config import Config

from . import constraints
from .answers import AnswerPlan, PlanError, plan_for
from .api_errors import ApiError
from .engine import Engine, EngineError, Finished, GenRequest, TokenEvent
from .metrics import Metrics
from .schemas import validation_message
from .schemas_tools import ResponseFormat, ToolChoice, ToolSpec
from .tokenizer import ChatTemplateError, IncrementalDetokenizer, StopStrings, Tokenizer
from .thinking_budget import SectionBudget


log = logging.getLogger("strata.api")


class ClientGone(Exception):
    """The client closed the connection; the request is abandoned."""


@dataclass
class TokenLogprob:
    token: int
    logprob: float | None
    top: list[tuple[int, float]]


@dataclass
class Delta:
    """New text for the client, with the logprobs of the tokens that produced it."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


LARGE_TEXT_CHARS = 1 << 16
TOKENIZE_WORKERS = 2  # large texts tokenized at once; the others wait their turn (bounded memory)
COUNT_CONTEXTS = 4  # count_tokens counts prompts up to this many contexts long (how far past it a client is)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# Code points that end a line for str.splitlines() and that JSON leaves raw: a client that splits a stream with it
# (httpx's aiter_lines does) would cut an event in two. Escaped, the JSON means the same to every parser.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse_json(obj: Any) -> str:
    """`obj` as the JSON of one SSE data line: compact, UTF-8 as is, and no character any line splitter breaks at
    (the SSE rule is CR and LF only; U+2028, U+2029 and U+0085 are escaped as well)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).translate(_LINE_BREAKS)


def sse_response(body: AsyncIterator[str], run: Generation) -> StreamingResponse:
    """An SSE response; closing `run` afterwards covers a client gone before the body was first read."""
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS,
                             background=BackgroundTask(run.close))


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _lone_surrogate(data: Any) -> bool:
    """True when a string (or key) of a parsed body holds half of a UTF-16 pair, which has no UTF-8 form."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def parse_json(body: bytes) -> Any:
    """A request body as JSON, or a 400 naming what is wrong.

    Refused besides malformed JSON and invalid UTF-8: NaN and Infinity (Python's json reads them, JSON has
    none), nesting past the parser's recursion limit, and an escaped lone surrogate ("\\ud800"), which no
    tokenizer can encode. The surrogate walk runs only when the raw body holds such an escape.
    """
    try:
        data = json.loads(body, parse_constant=_refuse_constant)
    except RecursionError:
        raise ApiError.bad_request("the body is not valid JSON: it nests too deeply") from None
    except ValueError as err:  # UnicodeDecodeError is a ValueError too
        raise ApiError.bad_request(f"the body is not valid JSON: {err}") from None
    if _SURROGATE_ESCAPE.search(body) and _lone_surrogate(data):
        raise ApiError.bad_request("the body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff); "
                                   "strings must be valid Unicode")
    return data


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass
class Front:
    """What every route needs; built once by `make_app`."""

    cfg: Config
    engine: Engine
    tokenizer: Tokenizer
    metrics: Metrics

    @property
    def served_models(self) -> list[str]:
        """Names /v1/models lists; a request may name any of them."""
        return [self.engine.model_name]

    def check_model(self, name: str | None) -> None:
        if name and name not in self.served_models:
            raise ApiError.model_not_found(name, self.served_models)

    async def parse(self, request: Request, model: type[BaseModel]) -> Any:
        """The body as `model`: 413 past `coordinator.max_body_bytes`, 400 for bad JSON or a bad field."""
        limit = self.cfg.coordinator.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise ApiError.too_large(limit)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError.too_large(limit)
        data = parse_json(bytes(body))
        if not isinstance(data, dict):
            raise ApiError.bad_request("the body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as err:
            message, param = validation_message(err)
            raise ApiError.bad_request(message, param=param) from None

    async def chat_ids(self, messages: list[dict], continue_final: bool = False, count: bool = False,
                       tools: list[dict] | None = None, template_vars: dict | None = None) -> list[int]:
        """The rendered chat prompt (`render_chat`) as token ids."""
        text = self.render_chat(messages, continue_final, tools, template_vars)
        return await self.encode(text, param="messages", count=count)

    def render_chat(self, messages: list[dict], continue_final: bool = False, tools: list[dict] | None = None,
                    template_vars: dict | None = None) -> str:
        """The chat prompt text (as `Tokenizer.apply_chat_template`, with the tools and extra template variables
        given); a template that refuses the messages is a 400.

        `continue_final` (Anthropic's prefill): when the last message is the assistant's, the prompt ends
        inside that turn, right after its content, and the completion continues it. As transformers'
        `continue_final_message`: render without a generation prompt, cut after the last occurrence of the
        content. An empty final assistant message asks for nothing (the assistant turn simply starts); one
        that ends in whitespace, or that the template rewrites, is a 400.
        """
        final = messages[-1] if messages and continue_final and messages[-1]["role"] == "assistant" else None
        if final is not None and not final["content"] and not final.get("tool_calls"):
            messages, final = messages[:-1], None
        elif final is not None and final.get("tool_calls"):
            raise ApiError.bad_request("the final assistant message (a prefill) cannot hold tool calls",
                                       param="messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=final is None, tools=tools,
                                                      **(template_vars or {}))
        except ChatTemplateError as err:  # raise_exception in the template: the client's messages did it
            raise ApiError.bad_request(str(err), param="messages") from None
        if final is not None:
            content = final["content"]
            if content != content.rstrip():
                raise ApiError.bad_request("the final assistant message (a prefill) must not end with whitespace",
                                           param="messages")
            cut = text.rfind(content.strip())
            if cut < 0:
                raise ApiError.bad_request("the final assistant message (a prefill) cannot be continued: this "
                                           "model's chat template rewrites it", param="messages")
            text = text[: cut + len(content.strip())]
        return text

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token of the vocabulary in characters of its raw form: no token covers more characters
        of a prompt (a byte-level token's raw form has one character per byte it stands for)."""
        return max((len(t) for t in self.tokenizer.backend.get_vocab(with_added_tokens=True)), default=1)

    @functools.cached_property
    def _tokenizing(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(TOKENIZE_WORKERS)

    async def encode(self, text: str, param: str = "prompt", count: bool = False) -> list[int]:
        """`tokenizer.encode(text)`, after refusing a text too long to fit `max_context` whatever its tokens are
        (`count`: a token count only, which may go COUNT_CONTEXTS times past it); a large text off the event loop,
        at most TOKENIZE_WORKERS at once (see the module docstring)."""
        limit = self.engine.max_context * self.max_token_chars * (COUNT_CONTEXTS if count else 1)
        if len(text) > limit:
            self.metrics.refused("context_length_exceeded")
            raise EngineError(
                400, "context_length_exceeded",
                f"This model's maximum context length is {self.engine.max_context} tokens, and no token is longer "
                f"than {self.max_token_chars} characters, so a prompt of {len(text)} characters cannot fit. Please "
                f"reduce the length of the prompt.", type="invalid_request_error", param=param)
        if len(text) < LARGE_TEXT_CHARS:
            return self.tokenizer.encode(text)
        backend = self.tokenizer.backend
        async with self._tokenizing:
            encodings = await anyio.to_thread.run_sync(
                lambda: backend.encode_batch([text], add_special_tokens=False))
        return list(encodings[0].ids)

    def answer_plan(self, prompt_text: str, tools: list[ToolSpec], choice: ToolChoice,
                    id_prefix: str = "call_") -> AnswerPlan:
        """How the answer is shaped (answers.py); tools this model's template cannot render are a 400."""
        try:
            return plan_for(self.tokenizer.chat_template, prompt_text, tools, choice, id_prefix)
        except PlanError as err:
            raise ApiError.bad_request(str(err), param=err.param) from None

    def grammar_for(self, plan: AnswerPlan, choice: ToolChoice, response_format: ResponseFormat | None = None,
                    thinking_budget: int | None = None) -> str | None:
        """The grammar the answer follows (constraints.py), or None."""
        return constraints.grammar_for(plan, choice, response_format, thinking_budget)

    def gen_request(self, request_id: str, prompt: list[int], max_tokens: int | None, sampling: dict,
                    logprobs: int = 0, ignore_eos: bool = False, prompt_param: str = "messages",
                    grammar: str | None = None, thinking: SectionBudget | None = None) -> GenRequest:
        """A GenRequest that fits `max_context`; `max_tokens` defaults to what the prompt leaves free.
        The tokenizer's eos ids end it, unless `ignore_eos` (then only max_tokens, or a stop string, does).

        Refused here: a prompt that fills the context, or a prompt plus `max_tokens` beyond it (400
        `context_length_exceeded`, message naming both numbers, param `prompt_param`: the field that holds
        the prompt); a prompt or `logit_bias` token id outside the vocabulary, a logit_bias that bans it all.
        """
        if not prompt:
            raise ApiError.bad_request("the prompt is empty", param="prompt")
        limit = self.engine.max_context
        if max_tokens is None:
            max_tokens = limit - len(prompt)
            if max_tokens < 1:
                self.metrics.refused("context_length_exceeded")
                raise EngineError(
                    400, "context_length_exceeded",
                    f"This model's maximum context length is {limit} tokens. However, your prompt has "
                    f"{len(prompt)} tokens, which leaves no room for a completion.",
                    type="invalid_request_error", param=prompt_param,
                )
        elif len(prompt) + max_tokens > limit:
            self.metrics.refused("context_length_exceeded")
            err = EngineError.context_length(len(prompt), max_tokens, limit)
            err.param = prompt_param
            raise err
        vocab = self.tokenizer.vocab_size
        for t in prompt:
            if not 0 <= t < vocab:
                raise ApiError.bad_request(f"token id {t} is outside the vocabulary [0, {vocab})", param="prompt")
        bias = sampling.get("logit_bias") or []
        for t, _ in bias:
            if t >= vocab:
                raise ApiError.bad_request(f"logit_bias: token id {t} is outside the vocabulary [0, {vocab})",
                                           param="logit_bias")
        if sum(1 for _, b in bias if b <= -100) >= vocab:
            raise ApiError.bad_request("logit_bias: it bans every token of the vocabulary", param="logit_bias")
        stop_ids = frozenset() if ignore_eos else frozenset(self.tokenizer.eos_ids)
        return GenRequest(request_id, list(prompt), max_tokens, sampling, stop_ids, logprobs, grammar=grammar,
                          thinking=thinking)

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body is already read, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Generation:
    """Engine events -> text deltas for one request; see the module docstring for the rules."""

    def __init__(self, front: Front, request: Request, gen: GenRequest, stops: list[str], arrival: float,
                 want_logprobs: bool = False) -> None:
        self.front, self.request, self.gen = front, request, gen
        self.stops = list(stops)
        self.arrival = arrival
        self.want_logprobs = want_logprobs
        self.finish_reason: str | None = None  # "stop" | "length" once ended normally
        self.stop_sequence: str | None = None  # the stop string that ended it, if one did
        self.truncated = False
        self.prompt_tokens = len(gen.prompt)
        self.cached_tokens = 0
        self.completion_tokens = 0
        self._detok = IncrementalDetokenizer(front.tokenizer)
        self._stop = StopStrings(self.stops)
        self._chars_in = 0  # text the detokenizer has given (fed to the stop strings)
        self._chars_out = 0  # text sent to the client
        self._starts: list[int] = []  # with stop strings, per token: where its text starts (detokenized)
        self._pending_lp: list[tuple[int, TokenLogprob]] = []  # (start, entry), waiting for its text to go out
        self._last_token_at: float | None = None
        self._it: Any = None
        self._waiting: asyncio.Task | None = None  # the task awaiting the engine's next event, in `_next`
        self._watch: asyncio.Task | None = None
        self._gone = False  # the watch saw the client leave
        self._gone_cancel = False  # ... and cancelled `_waiting`, which `_next` turns into ClientGone
        self._first: TokenEvent | Finished | None = None
        self._closed = False
        self._ended: str | None = None  # "refused" | "error" when it ended without a finish reason

    # ---- the engine side ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Waits for the first event; raises EngineError (a refusal) or ClientGone, after closing."""
        try:
            it = self.front.engine.generate(self.gen)
            self._it = (await it) if inspect.isawaitable(it) else it
            self._watch = asyncio.ensure_future(_wait_disconnect(self.request))
            self._watch.add_done_callback(self._client_left)
            self._first = await self._next()
            cached = getattr(self._first, "cached_tokens", None)
            if cached is not None:
                self.cached_tokens = cached
        except EngineError:
            self._ended = "refused"  # not started: neither finished nor aborted
            await self.close()
            raise
        except BaseException:
            await self.close()
            raise

    async def _next(self) -> TokenEvent | Finished | None:
        """The next engine event, None when the iterator ends; raises ClientGone if the client leaves first.

        Awaited in the calling task itself (no task per event): when the client leaves, the watch cancels that
        task (`_client_left`), and the cancel it asked for is counted back here and becomes ClientGone; the
        engine's iterator is cancelled at its await, as closing it would."""
        if self._gone:
            raise ClientGone()
        task = asyncio.current_task()
        self._waiting = task
        try:
            return await self._it.__anext__()
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            if self._gone_cancel:
                self._gone_cancel = False
                if task.uncancel() == 0:  # no one else asked for this task to be cancelled
                    raise ClientGone() from None
            raise
        finally:
            self._waiting = None

    def _client_left(self, watch: asyncio.Task) -> None:
        if watch.cancelled():
            return  # closed
        watch.exception()  # a failed receive channel counts as a client gone, as its end does
        self._gone = True
        if self._waiting is not None and not self._gone_cancel:
            self._gone_cancel = True
            self._waiting.cancel()

    async def close(self) -> None:
        """Closes the engine iterator (frees the slot) and the disconnect watch; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._watch is not None:
                self._watch.cancel()
            if self._it is not None and hasattr(self._it, "aclose"):
                try:
                    await self._it.aclose()
                except (Exception, asyncio.CancelledError):
                    pass
        if self.finish_reason is None and self._ended != "refused":
            self.front.metrics.aborted(self._ended or "abort", self.completion_tokens)

    # ---- the text side ---------------------------------------------------------------------------
    async def deltas(self) -> AsyncIterator[Delta]:
        """Text deltas to the end; raises EngineError (mid-stream) or ClientGone. Call after `start()`."""
        try:
            event = self._first
            while True:
                if event is None:
                    raise EngineError.internal("the engine ended a request without a Finished event")
                if isinstance(event, Finished):
                    tail = self._finish(event)
                    if tail.text or tail.logprobs:
                        yield tail
                    return
                delta = self._on_token(event)
                if delta is not None:
                    yield delta
                if self.finish_reason is not None:  # a stop string matched: the engine request is closed
                    self._record_end()
                    return
                event = await self._next()
        except EngineError:
            self._ended = "error"
            raise
        finally:
            await self.close()

    async def text(self) -> tuple[str, list[TokenLogprob]]:
        """The whole completion at once (non-streaming routes)."""
        parts, logprobs = [], []
        async for d in self.deltas():
            parts.append(d.text)
            logprobs.extend(d.logprobs)
        return "".join(parts), logprobs

    def _on_token(self, event: TokenEvent) -> Delta | None:
        now = time.monotonic()
        if self._last_token_at is None:
            self.front.metrics.first_token(now - self.arrival)
        else:
            self.front.metrics.token_gap(now - self._last_token_at)
        self._last_token_at = now
        self.completion_tokens += 1
        if event.token in self.gen.stop_token_ids:
            return None
        if self.stops:
            self._starts.append(self._chars_in)
        if self.want_logprobs:
            self._pending_lp.append((self._chars_in, TokenLogprob(event.token, event.logprob, list(event.top or []))))
        delta = self._delta(self._feed(self._detok.push(event.token)))
        return delta if delta.text or delta.logprobs else None

    def _feed(self, text: str) -> str:
        """Passes detokenized text through the stop strings; returns what may be sent. At a matched stop,
        `completion_tokens` becomes the count of tokens whose text starts before it."""
        self._chars_in += len(text)
        emit, stopped = self._stop.feed(text)
        self._chars_out += len(emit)
        if stopped and self.finish_reason is None:
            self.finish_reason = "stop"
            self.stop_sequence = self._stop.matched
            self.completion_tokens = bisect.bisect_left(self._starts, self._chars_out)
        return emit

    def _delta(self, text: str, final: bool = False) -> Delta:
        """`text` with the logprobs of the tokens whose text has begun to go out (all of them at the `final`
        delta of a request no stop string ended); after a stop, the rest are dropped."""
        stopped = self._stop.stopped
        if final and not stopped:
            n = len(self._pending_lp)
        else:
            n = bisect.bisect_left(self._pending_lp, self._chars_out, key=lambda e: e[0])
        lp = [e for _, e in self._pending_lp[:n]]
        self._pending_lp = [] if stopped else self._pending_lp[n:]
        return Delta(text, lp)

    def _finish(self, event: Finished) -> Delta:
        """The engine's last event: flush the held text, take its counts as the truth (unless a stop string
        matched in the flushed text: then the tokens before it)."""
        text = self._feed(self._detok.flush())
        if self.finish_reason is None:
            tail = self._stop.flush()
            self._chars_out += len(tail)
            text += tail
            self.finish_reason = event.reason
            self.completion_tokens = event.completion_tokens
        self.truncated = event.truncated
        self.prompt_tokens = event.prompt_tokens
        self.cached_tokens = event.cached_tokens
        self._record_end()
        return self._delta(text, final=True)

    def _record_end(self) -> None:
        self.front.metrics.finished(self.finish_reason or "stop", time.monotonic() - self.arrival,
                                    self.prompt_tokens, self.cached_tokens, self.completion_tokens)
