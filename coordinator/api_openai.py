"""OpenAI routes: POST /v1/chat/completions and POST /v1/completions, streamed (SSE) or not.

Streams are `data: {json}\\n\\n` lines ending with `data: [DONE]`. With `stream_options.include_usage` every
chunk carries `"usage": null` and one last chunk carries the usage with empty `choices`. The finished choice
(the response's, or the stream's closing chunk) says `"truncated"`: true when the pool could not hold the
conversation's growth (finish_reason "length").
An error after the stream has begun is one `data: {"error": {...}}` line, then `[DONE]`.
"""
from __future__ import annotations

import json
import logging
import time
from typing import AsyncIterator, Callable

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from starlette.requests import Request

from .api_errors import openai_sse_error
from .api_generation import ClientGone, Front, Generation, TokenLogprob, new_id, sse_response
from .engine import EngineError
from .schemas import ChatRequest, CompletionRequest, json_body

log = logging.getLogger("strata.api")


def sse_data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def usage_body(run: Generation) -> dict:
    return {
        "prompt_tokens": run.prompt_tokens,
        "completion_tokens": run.completion_tokens,
        "total_tokens": run.prompt_tokens + run.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": run.cached_tokens},
    }


def chat_logprobs(front: Front, entries: list[TokenLogprob]) -> dict:
    """OpenAI chat shape: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}."""

    def one(token: int, logprob: float | None) -> dict:
        text = front.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(front: Front, entries: list[TokenLogprob], offset: int) -> dict:
    """Legacy completions shape: parallel lists, `text_offset` counted from `offset`."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        text = front.token_text(e.token)
        tokens.append(text)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{front.token_text(t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


Chunk = Callable[[str | None, str | None, dict | None], dict]
"""chunk(text, finish_reason, logprobs) -> one stream chunk; text None for the closing chunk."""


async def _sse(run: Generation, chunk: Chunk, head: list[dict], include_usage: bool,
               logprobs: Callable[[list[TokenLogprob]], dict] | None) -> AsyncIterator[str]:
    """One OpenAI stream: head chunks, one chunk per delta, the closing chunk, usage, [DONE]."""
    try:
        for h in head:
            yield sse_data(h)
        async for d in run.deltas():
            yield sse_data(chunk(d.text, None, logprobs(d.logprobs) if logprobs and d.logprobs else None))
        closing = chunk(None, run.finish_reason, None)
        closing["choices"][0]["truncated"] = run.truncated
        yield sse_data(closing)
        if include_usage:
            final = chunk(None, None, None)
            final["choices"], final["usage"] = [], usage_body(run)
            yield sse_data(final)
        yield "data: [DONE]\n\n"
    except EngineError as err:
        yield openai_sse_error(err)
    except ClientGone:
        return
    except Exception:  # a bug must still end the stream in a shape the client understands
        log.exception("stream %s failed", run.gen.request_id)
        yield openai_sse_error(EngineError.internal("the stream failed; see the server log"))


def make_router(front: Front, auth: Callable) -> APIRouter:
    router = APIRouter(dependencies=[Depends(auth)])

    @router.post("/v1/chat/completions", openapi_extra=json_body(ChatRequest))
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        req: ChatRequest = await front.parse(request, ChatRequest)
        front.check_model(req.model)
        ids = await front.chat_ids([m.as_template_message() for m in req.messages])
        rid, created, model = new_id("chatcmpl-"), int(time.time()), front.engine.model_name
        gen = front.gen_request(rid, ids, req.completion_limit, req.sampling(), logprobs=req.num_top_logprobs,
                                ignore_eos=req.ignore_eos)
        run = Generation(front, request, gen, req.stop, arrival, want_logprobs=req.logprobs)
        await run.start()

        if req.stream:
            def chunk(text: str | None, finish: str | None, lp: dict | None, delta: dict | None = None) -> dict:
                if delta is None:
                    delta = {} if text is None else {"content": text}
                out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}
                if req.include_usage:
                    out["usage"] = None
                return out

            head = [chunk(None, None, None, delta={"role": "assistant", "content": ""})]
            lp = (lambda e: chat_logprobs(front, e)) if req.logprobs else None
            return sse_response(_sse(run, chunk, head, req.include_usage, lp), run)

        text, entries = await run.text()
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": chat_logprobs(front, entries) if req.logprobs else None,
            "finish_reason": run.finish_reason,
            "truncated": run.truncated,
        }
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                             "choices": [choice], "usage": usage_body(run)})

    @router.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
    async def completions(request: Request):
        arrival = time.monotonic()
        req: CompletionRequest = await front.parse(request, CompletionRequest)
        front.check_model(req.model)
        ids = await front.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        rid, created, model = new_id("cmpl-"), int(time.time()), front.engine.model_name
        want_lp = req.logprobs is not None
        gen = front.gen_request(rid, ids, req.max_tokens, req.sampling(), logprobs=req.logprobs or 0,
                                ignore_eos=req.ignore_eos, prompt_param="prompt")
        run = Generation(front, request, gen, req.stop, arrival, want_logprobs=want_lp)
        await run.start()

        if req.stream:
            offset = [0]

            def chunk(text: str | None, finish: str | None, lp: dict | None) -> dict:
                out = {"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": [{"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}]}
                if req.include_usage:
                    out["usage"] = None
                return out

            def lp(entries: list[TokenLogprob]) -> dict:
                out = completion_logprobs(front, entries, offset[0])
                offset[0] += sum(len(t) for t in out["tokens"])
                return out

            return sse_response(_sse(run, chunk, [], req.include_usage, lp if want_lp else None), run)

        text, entries = await run.text()
        choice = {
            "index": 0,
            "text": text,
            "logprobs": completion_logprobs(front, entries, 0) if want_lp else None,
            "finish_reason": run.finish_reason,
            "truncated": run.truncated,
        }
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": [choice], "usage": usage_body(run)})

    return router
