"""Anthropic routes: POST /v1/messages (streamed or not) and POST /v1/messages/count_tokens.

Usage follows Anthropic's meaning: `input_tokens` are the prompt tokens NOT read from the cache,
`cache_read_input_tokens` those that were (their sum is the prompt), `output_tokens` the completion.
stop_reason: `end_turn` (the model ended its turn), `max_tokens` (the limit, or a truncation in a full
pool), `stop_sequence` (with `stop_sequence` naming it).
stop_reason `tool_use` when the answer holds tool calls.
Content: a `thinking` block (a model that reasons; it thinks only when `thinking` is enabled, within
`budget_tokens`; `thinking` disabled turns it off; left out, the template's default), the `text` block, then one `tool_use` block per call (answers.py shapes the text).
Stream events, in order: message_start, then per block content_block_start (a ping after the first), content_block_delta
(thinking_delta and a closing signature_delta / text_delta / input_json_delta)..., content_block_stop (an empty
answer is one empty text block); then message_delta (stop_reason, usage), message_stop; an error after the start is one
`error` event (a full pool: `overloaded_error`, the code kept in the message). message_start reports the
prompt as the non-streaming answer does (`input_tokens` + `cache_read_input_tokens`, the split the engine
gives with the first token; all of the prompt as `input_tokens` where it gives none); message_delta carries
the final usage.
A final assistant message is a prefill: the answer continues it (`Front.chat_ids`, continue_final).
Any model name is accepted (Anthropic clients send their own); responses name the served model.
"""
from __future__ import annotations

import json
import logging
import time
from typing import AsyncIterator, Callable

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from starlette.requests import Request

from .answers import AnswerShaper, CallArgs, CallStart, Event, Reasoning, Shaped, Text, shape
from .api_errors import ApiError, anthropic_sse_error
from .api_generation import ClientGone, Front, Generation, new_id, sse_json, sse_response
from .engine import EngineError
from .reasoning import template_thinks
from .schemas import CountTokensRequest, MessagesRequest, json_body
from .thinking_budget import SectionBudget

log = logging.getLogger("strata.api")


def sse_event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {sse_json({'type': kind, **data})}\n\n"


def stop_reason(run: Generation, calls: int = 0) -> str:
    if run.stop_sequence is not None:
        return "stop_sequence"
    if run.finish_reason == "length":
        return "max_tokens"
    return "tool_use" if calls else "end_turn"


def usage_body(run: Generation, output_tokens: int | None = None) -> dict:
    return {
        "input_tokens": run.prompt_tokens - run.cached_tokens,
        "output_tokens": run.completion_tokens if output_tokens is None else output_tokens,
        "cache_read_input_tokens": run.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


class _Blocks:
    """Answer events -> content block events: a block opens when its kind of text first comes, and closes when
    another kind (or the end) comes; a thinking block closes with its signature, a tool_use block streams its
    input as `input_json_delta`."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None
        self.pinged = False

    def _start(self, kind: str, block: dict) -> list[str]:
        out = self.close()
        self.index += 1
        self.open = kind
        out.append(sse_event("content_block_start", {"index": self.index, "content_block": block}))
        if not self.pinged:  # as Anthropic's streams: a ping after the first block starts
            self.pinged = True
            out.append(sse_event("ping", {}))
        return out

    def _delta(self, delta: dict) -> str:
        return sse_event("content_block_delta", {"index": self.index, "delta": delta})

    def close(self) -> list[str]:
        if self.open is None:
            return []
        out = [self._delta({"type": "signature_delta", "signature": ""})] if self.open == "thinking" else []
        self.open = None
        return out + [sse_event("content_block_stop", {"index": self.index})]

    def events(self, e: Event) -> list[str]:
        if isinstance(e, Reasoning):
            out = [] if self.open == "thinking" else self._start("thinking", {"type": "thinking", "thinking": "",
                                                                              "signature": ""})
            return out + [self._delta({"type": "thinking_delta", "thinking": e.text})]
        if isinstance(e, Text):
            out = [] if self.open == "text" else self._start("text", {"type": "text", "text": ""})
            return out + [self._delta({"type": "text_delta", "text": e.text})]
        if isinstance(e, CallStart):
            return self._start("tool_use", {"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
        if isinstance(e, CallArgs):
            return [self._delta({"type": "input_json_delta", "partial_json": e.text})]
        return self.close()  # CallEnd

    def end(self) -> list[str]:
        if self.index < 0:  # an empty answer is still one (empty) text block
            return self._start("text", {"type": "text", "text": ""}) + self.close()
        return self.close()


async def _events(run: Generation, message: dict, shaper: AnswerShaper) -> AsyncIterator[str]:
    try:
        yield sse_event("message_start", {"message": message})
        blocks = _Blocks()
        async for d in run.deltas():
            for e in shaper.feed(d.text):
                for out in blocks.events(e):
                    yield out
        for e in shaper.finish():
            for out in blocks.events(e):
                yield out
        for out in blocks.end():
            yield out
        if not blocks.pinged:
            yield sse_event("ping", {})
        yield sse_event("message_delta", {"delta": {"stop_reason": stop_reason(run, shaper.calls),
                                                    "stop_sequence": run.stop_sequence},
                                          "usage": usage_body(run)})
        yield sse_event("message_stop", {})
    except EngineError as err:
        yield anthropic_sse_error(err)
    except ClientGone:
        return
    except Exception:  # a bug must still end the stream in a shape the client understands
        log.exception("stream %s failed", run.gen.request_id)
        yield anthropic_sse_error(EngineError.internal("the stream failed; see the server log"))


def content_blocks(shaped: Shaped) -> list[dict]:
    blocks: list[dict] = []
    if shaped.reasoning:
        blocks.append({"type": "thinking", "thinking": shaped.reasoning, "signature": ""})
    if shaped.text or not shaped.calls:
        blocks.append({"type": "text", "text": shaped.text})
    # A call the model broke off (cut at max_tokens, malformed JSON) has no input to give: {} (tool_reader.py rule 3).
    blocks += [{"type": "tool_use", "id": cid, "name": c.name, "input": json.loads(c.arguments) if c.valid else {}}
               for cid, c in shaped.calls]
    return blocks


def template_vars(req: MessagesRequest | CountTokensRequest, front: Front) -> dict | None:
    """`thinking` given: a model that reasons thinks when it is enabled, not when it is disabled; left out, the
    template's own default holds (as the OpenAI routes render it)."""
    if req.thinking is None or not template_thinks(front.tokenizer.chat_template):
        return None
    return {"enable_thinking": req.thinking_budget is not None}


def make_router(front: Front, auth: Callable) -> APIRouter:
    router = APIRouter(dependencies=[Depends(auth)])

    @router.post("/v1/messages", openapi_extra=json_body(MessagesRequest))
    async def messages(request: Request):
        arrival = time.monotonic()
        req: MessagesRequest = await front.parse(request, MessagesRequest)
        budget = req.thinking_budget
        if budget is not None and budget >= req.max_tokens:
            raise ApiError.bad_request(f"thinking.budget_tokens: must be less than max_tokens ({req.max_tokens}), "
                                       f"got {budget}", param="thinking.budget_tokens")
        tools, choice = req.tool_specs, req.chosen_tools
        prompt = front.render_chat(req.template_messages(), continue_final=True,
                                   tools=[t.template_form() for t in tools] or None,
                                   template_vars=template_vars(req, front))
        ids = await front.encode(prompt, param="messages")
        plan = front.answer_plan(prompt, tools, choice, id_prefix="toolu_")
        budget = budget if plan.reasoning else None
        grammar = front.grammar_for(plan, choice, thinking_budget=budget)
        rid, model = new_id("msg_"), front.engine.model_name
        thinking = SectionBudget(budget, opened=plan.inside) if budget is not None else None
        gen = front.gen_request(rid, ids, req.max_tokens, req.sampling(), grammar=grammar, thinking=thinking)
        run = Generation(front, request, gen, req.stop_sequences, arrival)
        await run.start()

        if req.stream:
            start = {"id": rid, "type": "message", "role": "assistant", "model": model, "content": [],
                     "stop_reason": None, "stop_sequence": None,
                     "usage": usage_body(run, output_tokens=0)}
            return sse_response(_events(run, start, AnswerShaper(plan)), run)

        text, _ = await run.text()
        shaped = shape(plan, text)
        return JSONResponse({
            "id": rid, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(shaped),
            "stop_reason": stop_reason(run, len(shaped.calls)), "stop_sequence": run.stop_sequence,
            "usage": usage_body(run),
        })

    @router.post("/v1/messages/count_tokens", openapi_extra=json_body(CountTokensRequest))
    async def count_tokens(request: Request):
        req: CountTokensRequest = await front.parse(request, CountTokensRequest)
        tools = [t.template_form() for t in req.tool_specs] or None
        ids = await front.chat_ids(req.template_messages(), continue_final=True, count=True, tools=tools,
                                   template_vars=template_vars(req, front))
        return {"input_tokens": len(ids)}

    return router
