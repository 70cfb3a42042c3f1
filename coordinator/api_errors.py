"""Errors of the HTTP front, in the OpenAI and the Anthropic shape.

Every error the front answers with is an `EngineError` (the engine's own, or an `ApiError` the front raises
for bad input); the route family picks the shape:
  OpenAI    {"error": {"message", "type", "code", "param"}}
  Anthropic {"type": "error", "error": {"type", "message"}}   (the code is kept in the message: "code: ...")
A 503 carries `Retry-After` when the error says when to retry. The Anthropic type follows the status, except
that the retryable 503s (`kv_pool_full`, `queue_full`) are `overloaded_error`.
"""
from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from .engine import EngineError

ANTHROPIC_PREFIX = "/v1/messages"
OVERLOADED_CODES = frozenset({"kv_pool_full", "queue_full"})
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


class ApiError(EngineError):
    """An error the front decides itself (bad input, auth, unknown model, body too large)."""

    @classmethod
    def bad_request(cls, message: str, param: str | None = None, code: str | None = None) -> "ApiError":
        return cls(400, code or "invalid_request", message, type="invalid_request_error", param=param)

    @classmethod
    def unauthorized(cls) -> "ApiError":
        return cls(401, "invalid_api_key", "Incorrect API key provided", type="invalid_request_error")

    @classmethod
    def model_not_found(cls, name: str, served: list[str]) -> "ApiError":
        return cls(
            404,
            "model_not_found",
            f"The model {name!r} does not exist; this server serves {', '.join(repr(s) for s in served)}",
            type="invalid_request_error",
            param="model",
        )

    @classmethod
    def too_large(cls, limit: int) -> "ApiError":
        return cls(413, "request_too_large", f"the request body is larger than {limit} bytes",
                   type="invalid_request_error")


def is_anthropic(path: str) -> bool:
    return path.startswith(ANTHROPIC_PREFIX)


def openai_body(err: EngineError) -> dict:
    return {"error": {"message": err.message, "type": err.type, "code": err.code, "param": err.param}}


def anthropic_type(err: EngineError) -> str:
    if err.status == 503 and err.code in OVERLOADED_CODES:
        return "overloaded_error"
    return _ANTHROPIC_TYPES.get(err.status, "api_error")


def anthropic_body(err: EngineError) -> dict:
    return {"type": "error", "error": {"type": anthropic_type(err), "message": f"{err.code}: {err.message}"}}


def error_response(path: str, err: EngineError) -> JSONResponse:
    """The JSON error answer for a request to `path`, shaped for its API family."""
    body = anthropic_body(err) if is_anthropic(path) else openai_body(err)
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
    return JSONResponse(body, status_code=err.status, headers=headers)


def openai_sse_error(err: EngineError) -> str:
    """An error inside an OpenAI stream: a data line the official client raises as APIError, then [DONE]."""
    return f"data: {json.dumps(openai_body(err))}\n\ndata: [DONE]\n\n"


def anthropic_sse_error(err: EngineError) -> str:
    """An error inside an Anthropic stream: the `error` event the official client raises."""
    return f"event: error\ndata: {json.dumps(anthropic_body(err))}\n\n"
