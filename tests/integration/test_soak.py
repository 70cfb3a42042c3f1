"""A real server (`strata up`: supervisor, coordinator, two CPU stages) under bad input, the API key, and a
bounded soak.

The box has a small pool (6 chunks of 16 cells for 4 slots) and a short queue, so a loaded server refuses
with the documented 503s (kv_pool_full, queue_full). Every test ends the same way: once nothing runs,
`POST /slots?action=erase` gives every held cell back, free cells == total and no slot is busy.
"""
from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import httpx
import pytest

from coordinator.bench.soak import DOCUMENTED, SoakConfig, run_soak
from pool.config import CoordinatorConfig, default_config_path, load_config
from tests.coordinator.test_bad_input import EDGE_CASES, HAND_CASES, LIMIT, error_message, send
from tests.integration.conftest import Server

KEY = "soak-key-1"
MODEL = {"arch": "qwen3", "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "seed": 3}


class Box(Server):
    """`strata up` with the API key, a small pool and a short queue; `check_clean` also wants /health at 200."""

    def __init__(self, model: Path) -> None:
        root = Path(tempfile.mkdtemp(prefix="sk", dir="/tmp"))  # ipc paths must stay short
        super().__init__(root, model, {"max_context": 64, "kv_pool_tokens": 96, "max_waiting": 4},
                         # no host: the default (loopback) is what test_the_default_bind_is_loopback checks
                         coordinator={"api_key": KEY, "max_body_bytes": LIMIT, "retry_after_s": 1},
                         headers={"x-api-key": KEY}, timeout=120)

    def check_clean(self) -> None:
        super().check_clean()
        assert self.http.get("/health").status_code == 200


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    box = Box(tiny_model_factory(**MODEL))
    try:
        box.start()
        yield box
    finally:
        box.stop()
        shutil.rmtree(box.root, ignore_errors=True)


def chat_body() -> dict:
    return {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


# ---- bind and key ---------------------------------------------------------------------------------------
def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the TCP sockets listening on `port`, from /proc/net/tcp{,6} (no traffic sent)."""
    found = set()
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(addr)
    return found


def test_the_default_bind_is_loopback(server):
    assert CoordinatorConfig().host == "127.0.0.1"
    assert load_config(default_config_path()).coordinator.host == "127.0.0.1"
    assert load_config(server.path).coordinator.host == "127.0.0.1"  # the box sets no host
    assert _listening_addresses(server.port) == {"0100007F"}  # 127.0.0.1, and nothing else


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/v1/chat/completions", chat_body()),
    ("POST", "/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ("GET", "/v1/models", None),
    ("GET", "/slots", None),
    ("POST", "/slots?action=erase", None),
])
def test_the_api_key_is_enforced_in_both_header_styles(server, method, path, body):
    def call(headers: dict) -> httpx.Response:
        return httpx.request(method, server.url + path, json=body, headers=headers, timeout=60)

    for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"x-api-key": KEY + "x"},
                    {"authorization": KEY}):
        resp = call(headers)
        assert resp.status_code == 401, (headers, resp.text)
        body_json = resp.json()
        if path.startswith("/v1/messages"):
            assert body_json["error"]["type"] == "authentication_error", body_json
        else:
            assert body_json["error"]["code"] == "invalid_api_key", body_json
    for headers in ({"authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        assert call(headers).status_code == 200, headers
    server.check_clean()


def test_health_metrics_and_the_schema_stay_open(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200
    assert "/v1/chat/completions" in httpx.get(server.url + "/openapi.json", timeout=10).json()["paths"]


# ---- bad input ------------------------------------------------------------------------------------------
def test_hand_cases_against_the_real_server(server):
    for case in HAND_CASES:
        resp = send(server.http, server.url, case)
        assert resp.status_code == case.status, (case.name, resp.status_code, resp.text[:300])
        error_message(case, resp)
    ok = server.http.post("/v1/chat/completions", json=chat_body())
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    server.check_clean()


def test_extreme_but_valid_input_reaches_the_stages_and_is_served(server):
    for case in EDGE_CASES:
        resp = send(server.http, server.url, case)
        assert resp.status_code == 200, (case.name, resp.text[:300])
    server.check_clean()


def test_a_temperature_below_float32_samples_as_greedy(server):
    """1e-300 is 0 in the stages' float32; the front sends it as greedy instead of a division by zero."""
    texts = []
    for temperature in (0, 1e-300):
        body = {**chat_body(), "max_tokens": 8, "temperature": temperature}
        resp = server.http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        texts.append(resp.json()["choices"][0]["message"]["content"])
    assert texts[0] == texts[1] and texts[0]
    server.check_clean()


# ---- the soak -------------------------------------------------------------------------------------------
def test_a_short_soak_gives_only_documented_refusals_and_leaves_the_pool_whole(server):
    result = asyncio.run(run_soak(SoakConfig(url=server.url, clients=16, seconds=10, api_key=KEY, seed=1)))
    s = result["summary"]
    assert s["unexpected"] == {}, (s, server.log()[-3000:])
    assert set(s["refused"]) <= DOCUMENTED
    assert s["ok"] > 0 and s["disconnected"] > 0, s
    assert sum(s["refused"].values()) > 0, f"the small pool never refused: {s}"  # the 503 paths ran
    assert s["clean"] and s["pool_free_after_erase"] == s["pool_cells"] == 96 and s["busy_slots"] == 0, s
    server.check_clean()
