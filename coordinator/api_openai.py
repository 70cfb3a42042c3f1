"""OpenAI routes: POST /v1/chat/completions and POST /v1/completions, streamed (SSE) or not.

Streams are `data: {json}\\n\\n` lines ending with `data: [DONE]`. With `stream_options.include_usage` every
chunk carries `"usage": null` and one last chunk carries the usage with empty `choices`. The finished choice
(the response's, or the stream's closing chunk) says `"truncated"`: true when the pool could not hold the
conversation's growth (finish_reason "length").
A chat answer is shaped by answers.py: `reasoning_content` apart from `content` for a model that reasons, tool
calls as `tool_calls` (streamed as deltas: the call's id, type and name first, then `arguments` in pieces) with
finish_reason "tool_calls"; `response_format` (both routes) and a forced tool_choice constrain the tokens
(constraints.py, grammar.py).
An error after the stream has begun is one `data: {"error": {...}}` line, then `[DONE]`.
"""
from __future__ import annotations

import logging
import time
from typing import AsyncIterator, Callable

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from starlette.requests import Request

from .api_errors import openai_sse_error
from .answers import AnswerPlan, AnswerShaper, CallArgs, CallStart, Event, Reasoning, Text, shape
from .api_generation import ClientGone, Front, Generation, TokenLogprob, new_id, sse_json, sse_response
from .engine import EngineError
from .schemas import ChatRequest, CompletionRequest, json_body
from .schemas_tools import ToolChoice

log = logging.getLogger("strata.api")


def sse_data(obj: dict) -> str:
    return f"data: {sse_json(obj)}\n\n"


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


Chunk = Callable[[dict | None, str | None, dict | None], dict]
"""chunk(delta, finish_reason, logprobs) -> one stream chunk; delta None for the closing chunk."""


def text_delta(shaper: AnswerShaper | None) -> Callable[[str], list[dict]]:
    """A text delta -> the chunk deltas it makes: plain {"text"} for completions (no shaper); for chat, the
    shaper's events as `content`, `reasoning_content` and `tool_calls` deltas (answers.py)."""
    if shaper is None:
        return lambda text: [{"text": text}] if text else []
    return lambda text: [d for e in shaper.feed(text) if (d := chat_event(e)) is not None]


def chat_event(e: Event) -> dict | None:
    if isinstance(e, Text):
        return {"content": e.text}
    if isinstance(e, Reasoning):
        return {"reasoning_content": e.text}
    if isinstance(e, CallStart):
        return {"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                "function": {"name": e.name, "arguments": ""}}]}
    if isinstance(e, CallArgs):
        return {"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]}
    return None


async def _sse(run: Generation, chunk: Chunk, head: list[dict], include_usage: bool,
               logprobs: Callable[[list[TokenLogprob]], dict] | None, deltas: Callable[[str], list[dict]],
               tail: Callable[[], list[dict]] = lambda: [],
               finish: Callable[[], str | None] | None = None) -> AsyncIterator[str]:
    """One OpenAI stream: head chunks, the chunks of each text delta, the closing chunk, usage, [DONE].
    A delta's logprobs go with the first chunk it makes (or the next one, when it makes none yet)."""
    try:
        for h in head:
            yield sse_data(h)
        pending: list[TokenLogprob] = []
        async for d in run.deltas():
            pending += d.logprobs
            for delta in deltas(d.text):
                yield sse_data(chunk(delta, None, logprobs(pending) if logprobs and pending else None))
                pending = []
        for delta in tail():
            yield sse_data(chunk(delta, None, logprobs(pending) if logprobs and pending else None))
            pending = []
        if pending and logprobs:
            yield sse_data(chunk({}, None, logprobs(pending)))
        closing = chunk(None, finish() if finish else run.finish_reason, None)
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


def chat_finish(run: Generation, calls: int) -> str | None:
    """finish_reason: "tool_calls" when the model ended its turn with tool calls (answers.py rule 4)."""
    return "tool_calls" if calls and run.finish_reason == "stop" else run.finish_reason


def make_router(front: Front, auth: Callable) -> APIRouter:
    router = APIRouter(dependencies=[Depends(auth)])

    @router.post("/v1/chat/completions", openapi_extra=json_body(ChatRequest))
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        req: ChatRequest = await front.parse(request, ChatRequest)
        front.check_model(req.model)
        tools, choice = req.tool_specs, req.chosen_tools
        prompt = front.render_chat(req.template_messages(), tools=[t.template_form() for t in tools] or None,
                                   template_vars=req.chat_template_kwargs)
        ids = await front.encode(prompt, param="messages")
        plan = front.answer_plan(prompt, tools, choice)
        grammar = front.grammar_for(plan, choice, req.response_format)
        rid, created, model = new_id("chatcmpl-"), int(time.time()), front.engine.model_name
        gen = front.gen_request(rid, ids, req.completion_limit, req.sampling(), logprobs=req.num_top_logprobs,
                                ignore_eos=req.ignore_eos, grammar=grammar)
        run = Generation(front, request, gen, req.stop, arrival, want_logprobs=req.logprobs)
        await run.start()

        if req.stream:
            def chunk(delta: dict | None, finish: str | None, lp: dict | None) -> dict:
                out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [{"index": 0, "delta": delta or {}, "logprobs": lp, "finish_reason": finish}]}
                if req.include_usage:
                    out["usage"] = None
                return out

            shaper = AnswerShaper(plan)
            head = [chunk({"role": "assistant", "content": ""}, None, None)]
            lp = (lambda e: chat_logprobs(front, e)) if req.logprobs else None
            tail = lambda: [d for e in shaper.finish() if (d := chat_event(e)) is not None]  # noqa: E731
            return sse_response(_sse(run, chunk, head, req.include_usage, lp, text_delta(shaper), tail,
                                     lambda: chat_finish(run, shaper.calls)), run)

        text, entries = await run.text()
        shaped = shape(plan, text)
        message: dict = {"role": "assistant", "content": shaped.text if shaped.text or not shaped.calls else None}
        if shaped.reasoning is not None:  # a model that reasons: its section, null when it wrote none (as vLLM)
            message["reasoning_content"] = shaped.reasoning or None
        if shaped.calls:
            message["tool_calls"] = [{"id": cid, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for cid, c in shaped.calls]
        choice_body = {
            "index": 0,
            "message": message,
            "logprobs": chat_logprobs(front, entries) if req.logprobs else None,
            "finish_reason": chat_finish(run, len(shaped.calls)),
            "truncated": run.truncated,
        }
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                             "choices": [choice_body], "usage": usage_body(run)})

    @router.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
    async def completions(request: Request):
        arrival = time.monotonic()
        req: CompletionRequest = await front.parse(request, CompletionRequest)
        front.check_model(req.model)
        ids = await front.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        rid, created, model = new_id("cmpl-"), int(time.time()), front.engine.model_name
        want_lp = req.logprobs is not None
        grammar = front.grammar_for(AnswerPlan(), ToolChoice("none"), req.response_format)
        gen = front.gen_request(rid, ids, req.max_tokens, req.sampling(), logprobs=req.logprobs or 0,
                                ignore_eos=req.ignore_eos, prompt_param="prompt", grammar=grammar)
        run = Generation(front, request, gen, req.stop, arrival, want_logprobs=want_lp)
        await run.start()

        if req.stream:
            offset = [0]

            def chunk(delta: dict | None, finish: str | None, lp: dict | None) -> dict:
                out = {"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": [{"index": 0, "text": (delta or {}).get("text", ""), "logprobs": lp,
                                    "finish_reason": finish}]}
                if req.include_usage:
                    out["usage"] = None
                return out

            def lp(entries: list[TokenLogprob]) -> dict:
                out = completion_logprobs(front, entries, offset[0])
                offset[0] += sum(len(t) for t in out["tokens"])
                return out

            return sse_response(_sse(run, chunk, [], req.include_usage, lp if want_lp else None, text_delta(None)),
                                run)

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
