"""The coordinator's HTTP front: `make_app(cfg, engine, tokenizer) -> FastAPI`.

Routes
  POST /v1/chat/completions, POST /v1/completions      OpenAI (api_openai.py)
  POST /v1/messages, POST /v1/messages/count_tokens    Anthropic (api_anthropic.py)
  GET  /v1/models                                      the served model
  GET  /v1/models/{id}                                 one of them; 404 model_not_found for another id
  GET  /health                                         engine.health(); 503 while a stage is down
  GET  /slots                                          engine.slots(), llama.cpp style
  POST /slots/{id}?action=erase, POST /slots?action=erase   drop one idle slot's conversation, or all idle ones
  POST /slots/{id}?action=save|restore  {"filename": f}      an idle slot's conversation to / from session files
                                                       in engine.slot_save_path (501 without it; slot_files.py)
  GET  /metrics                                        Prometheus text; `?format=json` for {"live": ...}
  GET  /openapi.json                                   the OpenAPI schema; request bodies are schemas.py's models

Rules
- With `coordinator.api_key` set, /v1/* and /slots need it, as `Authorization: Bearer <key>` or
  `x-api-key: <key>` (both clients' ways); /health and /metrics stay open for probes and scrapers, and
  /openapi.json for clients and fuzzers (it describes the routes, nothing served).
- Every error is an EngineError rendered in the shape of the route's API family (api_errors.py): bad input
  is 400 (never FastAPI's 422), an oversized body 413, a refusal 503 with Retry-After.
- A client that goes away before its response starts gets nothing (499 in the access log).
"""
from __future__ import annotations

import hmac
import json
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pool.config import Config

from . import api_anthropic, api_openai
from .api_errors import ApiError, error_response
from .api_generation import ClientGone, Front
from .engine import Engine, EngineError
from .metrics import CONTENT_TYPE, Metrics
from .schemas import openapi_schemas
from .tokenizer import Tokenizer


def _api_key_check(key: str | None):
    """A FastAPI dependency: nothing to check without a key; else Bearer or x-api-key must match."""

    async def check(request: Request) -> None:
        if key is None:
            return
        given = request.headers.get("x-api-key")
        auth = request.headers.get("authorization", "")
        if given is None and auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        if given is None or not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError.unauthorized()

    return check


def make_app(cfg: Config, engine: Engine, tokenizer: Tokenizer) -> FastAPI:
    """The HTTP front over `engine`; the app's `state.front` holds the shared pieces (tests read metrics)."""
    metrics = Metrics(engine, engine.model_name)
    front = Front(cfg, engine, tokenizer, metrics)
    started = int(time.time())
    auth = _api_key_check(cfg.coordinator.api_key)

    app = FastAPI(title="Strata", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.front = front

    def openapi() -> dict:
        """FastAPI's schema plus the body models the routes name in `openapi_extra` (schemas.json_body)."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(openapi_schemas(engine.max_context, tokenizer.vocab_size, front.served_models))
            for name in ("HTTPValidationError", "ValidationError"):  # bad input is a 400 here, never a 422
                components.pop(name, None)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    if operation.get("responses", {}).pop("422", None) is not None:
                        operation["responses"]["400"] = {"description": "bad input; the JSON error names it"}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, err: EngineError) -> JSONResponse:
        return error_response(request.url.path, err)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, err: RequestValidationError) -> JSONResponse:
        problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()]
        return error_response(request.url.path, ApiError.bad_request("; ".join(problems)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
        return error_response(request.url.path, ApiError(err.status_code, code, str(err.detail),
                                                         type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        # Starlette still re-raises it after this answer, so the traceback reaches the server log.
        return error_response(request.url.path, EngineError.internal("internal error; see the server log"))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, err: ClientGone) -> Response:
        return Response(status_code=499)

    app.include_router(api_openai.make_router(front, auth))
    app.include_router(api_anthropic.make_router(front, auth))

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": started, "owned_by": "strata",
                "max_model_len": engine.max_context}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        await auth(request)
        return {"object": "list", "data": [model_card(name) for name in front.served_models]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict:
        """One served model (the client's `models.retrieve`); an id may hold slashes ("org/name")."""
        await auth(request)
        if model_id not in front.served_models:
            raise ApiError.model_not_found(model_id, front.served_models)
        return model_card(model_id)

    @app.get("/health")
    async def health() -> JSONResponse:
        body = engine.health()
        down = [s for s in body.get("stages", []) if not s.get("up", False)]
        ok = not down and body.get("status", "ok") == "ok"
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/slots")
    async def slots(request: Request) -> list[dict]:
        await auth(request)
        return engine.slots()

    @app.post("/slots")
    async def slots_all_action(request: Request, action: str | None = None) -> dict:
        """`?action=erase`: every idle conversation (in slots and parked) gives its cells back."""
        await auth(request)
        if action != "erase":
            raise ApiError.bad_request(f"action={action!r}: without a slot id only erase is supported", param="action")
        return {"erased_cells": engine.flush_cache()}

    @app.post("/slots/{slot_id}")
    async def slot_action(request: Request, slot_id: int, action: str | None = None) -> dict:
        """llama.cpp's `POST /slots/{id}?action=erase|save|restore`: drop the conversation an idle slot holds,
        or save it to / restore it from the session files the body's `filename` names."""
        await auth(request)
        if action == "erase":
            return {"id_slot": slot_id, "n_erased": engine.erase_slot(slot_id)}
        if action not in ("save", "restore"):
            raise ApiError.bad_request(f"action={action!r}: supported actions are erase, save and restore",
                                       param="action")
        if not cfg.engine.slot_save_path:
            raise ApiError(501, "not_supported", f"action={action}: slot save/restore is disabled; start the server "
                           "with engine.slot_save_path set to a directory", type="invalid_request_error")
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise ApiError.bad_request('the body must be a JSON object: {"filename": "..."}')
        if action == "save":
            return await engine.save_slot(slot_id, body.get("filename"))
        return await engine.restore_slot(slot_id, body.get("filename"))

    @app.get("/metrics")
    async def metrics_route(format: str | None = None) -> Response:
        if format == "json":
            return JSONResponse(metrics.snapshot())
        if format not in (None, "prometheus", "text"):
            raise ApiError.bad_request(f"format={format!r}: use json or leave it out", param="format")
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app

