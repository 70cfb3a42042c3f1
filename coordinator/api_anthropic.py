"""Anthropic routes: POST /v1/messages (streamed or not) and POST /v1/messages/count_tokens.

Usage follows Anthropic's meaning: `input_tokens` are the prompt tokens NOT read from the cache,
`cache_read_input_tokens` those that were (their sum is the prompt), `output_tokens` the completion.
stop_reason: `end_turn` (the model ended its turn), `max_tokens` (the limit, or a truncation in a full
pool), `stop_sequence` (with `stop_sequence` naming it).
Stream events, in order: message_start, content_block_start, ping, content_block_delta (text_delta)...,
content_block_stop, message_delta (stop_reason, usage), message_stop; an error after the start is one
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

from .api_errors import anthropic_sse_error
from .api_generation import ClientGone, Front, Generation, new_id, sse_response
from .engine import EngineError
from .schemas import CountTokensRequest, MessagesRequest, json_body

log = logging.getLogger("strata.api")


def sse_event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'), ensure_ascii=False)}\n\n"


def stop_reason(run: Generation) -> str:
    if run.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if run.finish_reason == "length" else "end_turn"


def usage_body(run: Generation, output_tokens: int | None = None) -> dict:
    return {
        "input_tokens": run.prompt_tokens - run.cached_tokens,
        "output_tokens": run.completion_tokens if output_tokens is None else output_tokens,
        "cache_read_input_tokens": run.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


async def _events(run: Generation, message: dict) -> AsyncIterator[str]:
    try:
        yield sse_event("message_start", {"message": message})
        yield sse_event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        yield sse_event("ping", {})
        async for d in run.deltas():
            if d.text:
                yield sse_event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": d.text}})
        yield sse_event("content_block_stop", {"index": 0})
        yield sse_event("message_delta", {"delta": {"stop_reason": stop_reason(run), "stop_sequence": run.stop_sequence},
                                          "usage": usage_body(run)})
        yield sse_event("message_stop", {})
    except EngineError as err:
        yield anthropic_sse_error(err)
    except ClientGone:
        return
    except Exception:  # a bug must still end the stream in a shape the client understands
        log.exception("stream %s failed", run.gen.request_id)
        yield anthropic_sse_error(EngineError.internal("the stream failed; see the server log"))


def make_router(front: Front, auth: Callable) -> APIRouter:
    router = APIRouter(dependencies=[Depends(auth)])

    @router.post("/v1/messages", openapi_extra=json_body(MessagesRequest))
    async def messages(request: Request):
        arrival = time.monotonic()
        req: MessagesRequest = await front.parse(request, MessagesRequest)
        ids = await front.chat_ids(req.template_messages(), continue_final=True)
        rid, model = new_id("msg_"), front.engine.model_name
        gen = front.gen_request(rid, ids, req.max_tokens, req.sampling())
        run = Generation(front, request, gen, req.stop_sequences, arrival)
        await run.start()

        if req.stream:
            start = {"id": rid, "type": "message", "role": "assistant", "model": model, "content": [],
                     "stop_reason": None, "stop_sequence": None,
                     "usage": usage_body(run, output_tokens=0)}
            return sse_response(_events(run, start), run)

        text, _ = await run.text()
        return JSONResponse({
            "id": rid, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text}],
            "stop_reason": stop_reason(run), "stop_sequence": run.stop_sequence,
            "usage": usage_body(run),
        })

    @router.post("/v1/messages/count_tokens", openapi_extra=json_body(CountTokensRequest))
    async def count_tokens(request: Request):
        req: CountTokensRequest = await front.parse(request, CountTokensRequest)
        return {"input_tokens": len(await front.chat_ids(req.template_messages(), continue_final=True, count=True))}

    return router
