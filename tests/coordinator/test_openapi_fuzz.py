"""The served OpenAPI schema, and a bounded schemathesis run over every operation in it.

The front runs on a loopback uvicorn over the FakeEngine. Schemathesis generates requests from
`/openapi.json` (valid ones and broken ones: its default modes are positive and negative), at most
`MAX_EXAMPLES` per operation, derandomized so a run is repeatable, no deadline. Every answer must be:
  - never a 5xx;
  - a 4xx with a JSON error body carrying a non-empty message, in the route family's shape;
and when the run is over no request is still running in the engine, and every one it started was closed.
The one 5xx a request may get is a deliberate 501 `not_supported` (slot save/restore without
`engine.slot_save_path`), with the same JSON error body as a 4xx.
"""
from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from coordinator.tokenizer import Tokenizer
from tests.coordinator.fake_engine import running_front

MAX_EXAMPLES = 50
BODY_ROUTES = {
    "/v1/chat/completions": "ChatRequest",
    "/v1/completions": "CompletionRequest",
    "/v1/messages": "MessagesRequest",
    "/v1/messages/count_tokens": "CountTokensRequest",
}


@pytest.fixture(scope="module")
def stack(tiny_model_factory):
    tokenizer = Tokenizer.from_dir(tiny_model_factory())
    with running_front(tokenizer, max_context=256, max_body_bytes=1 << 20) as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(stack):
    return schemathesis.openapi.from_url(stack.url + "/openapi.json")


def test_openapi_describes_every_body_with_its_model(stack):
    doc = httpx.get(stack.url + "/openapi.json", timeout=10).json()
    components = doc["components"]["schemas"]
    for path, model in BODY_ROUTES.items():
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert components[model]["type"] == "object"
    chat = components["ChatRequest"]
    assert chat["required"] == ["messages"]
    assert "temperature" in chat["properties"] and "seed" in chat["properties"]
    assert components["MessagesRequest"]["required"] == ["model", "messages", "max_tokens"]
    text = json.dumps(doc)
    assert "#/$defs/" not in text  # every reference resolves inside the document
    assert "422" not in json.dumps([op["responses"] for p in doc["paths"].values() for op in p.values()])


OPERATIONS = [
    "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages", "POST /v1/messages/count_tokens",
    "GET /v1/models", "GET /health", "GET /slots", "POST /slots", "POST /slots/{slot_id}", "GET /metrics",
]
OTHERS = "any other operation"


def check_response(case, resp) -> None:
    """No 5xx; a 4xx is JSON with a message, in the Anthropic shape on /v1/messages*."""
    what = (case.method, case.path, case.path_parameters, case.query, repr(case.body)[:300])
    deliberate = resp.status_code == 501 and '"not_supported"' in resp.text
    assert resp.status_code < 500 or deliberate, (*what, resp.status_code, resp.text[:300])
    if resp.status_code >= 400:
        ctype = resp.headers.get("content-type") or [""]  # schemathesis keeps every header's values in a list
        assert ctype[0].startswith("application/json"), (*what, resp.headers)
        body = json.loads(resp.text)
        if case.path.startswith("/v1/messages"):
            assert body["type"] == "error", (*what, body)
        message = body["error"]["message"]
        assert isinstance(message, str) and message.strip(), (*what, body)


def fuzz(operation, url: str) -> int:
    """MAX_EXAMPLES valid and MAX_EXAMPLES broken requests for one operation; returns how many were sent."""
    sent = 0
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case) -> None:
            nonlocal sent
            check_response(case, case.call(base_url=url, timeout=30))
            sent += 1

        try:
            run()
        except Unsatisfiable:  # nothing to break in an operation without parameters or body
            assert mode is GenerationMode.NEGATIVE
    return sent


@pytest.mark.parametrize("label", OPERATIONS + [OTHERS])
def test_fuzzed_requests_never_get_a_5xx_and_every_4xx_says_why(stack, api_schema, label):
    ops = {res.ok().label: res.ok() for res in api_schema.get_all_operations()}
    if label == OTHERS:
        for other in sorted(set(ops) - set(OPERATIONS)):
            fuzz(ops[other], stack.url)
        return
    assert label in ops, sorted(ops)
    assert fuzz(ops[label], stack.url) >= 1


def test_after_the_fuzz_nothing_is_left_running(stack):
    engine = stack.engine
    started = [r.request_id for r in engine.requests]
    assert started, "the fuzz never reached the engine: its valid cases are not valid"
    for rid in started:
        assert engine.wait_closed(rid, 5), rid
    assert engine.running == 0
