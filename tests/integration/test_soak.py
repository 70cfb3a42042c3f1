"""A real server (`strata up`: supervisor, coordinator, two CPU stages) under bad input, the API key, and a
bounded soak.

The box has a small pool (6 chunks of 16 cells for 4 slots) and a short queue, so a loaded server refuses
with the documented 503s (kv_pool_full, queue_full). Every test ends the same way: once nothing runs,
`POST /slots?action=erase` gives every held cell back, free cells == total and no slot is busy.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from coordinator.bench.soak import DOCUMENTED, SoakConfig, run_soak
from pool.config import CoordinatorConfig, default_config_path, load_config
from tests.coordinator.test_bad_input import EDGE_CASES, HAND_CASES, LIMIT, error_message, send

ROOT = Path(__file__).resolve().parents[2]
KEY = "soak-key-1"
MODEL = {"arch": "qwen3", "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "seed": 3}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Box:
    """`strata up` on one config; `stop()` ends the supervisor and whatever it left running."""

    def __init__(self, model: Path) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="sk", dir="/tmp"))  # ipc paths must stay short
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.path = self.root / "box.yaml"
        self.path.write_text(yaml.safe_dump({
            "model": str(model),
            "engine": {"max_context": 64, "parallel": 4, "chunk_cells": 16, "kv_pool_tokens": 96, "max_waiting": 4,
                       "threads": 1, "prefill_chunk": 64},
            "stages": [{"device": "cpu", "layers": [0, 2], "endpoint": f"ipc://{self.root}/s0"},
                       {"device": "cpu", "layers": [2, 4], "endpoint": f"ipc://{self.root}/s1"}],
            # no host: the default (loopback) is what test_the_default_bind_is_loopback checks
            "coordinator": {"port": self.port, "api_key": KEY, "max_body_bytes": LIMIT, "retry_after_s": 1,
                            "heartbeat_ms": 100, "stage_timeout_ms": 3000},
        }))
        self.proc: subprocess.Popen | None = None
        self.http = httpx.Client(base_url=self.url, headers={"x-api-key": KEY}, timeout=120)

    def start(self, timeout: float = 180) -> None:
        with open(self.root / "up.log", "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "up", "--config", str(self.path)],
                                         cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"strata up exited:\n{self.log()[-3000:]}"
            try:
                if self.http.get("/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"not healthy after {timeout} s:\n{self.log()[-3000:]}"
            time.sleep(0.1)

    def log(self) -> str:
        return (self.root / "up.log").read_text(errors="replace")

    def stop(self) -> None:
        self.http.close()
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for entry in Path("/proc").iterdir():  # children the supervisor could not stop, found by our config path
            try:
                if entry.name.isdigit() and str(self.path).encode() in (entry / "cmdline").read_bytes():
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                continue
        shutil.rmtree(self.root, ignore_errors=True)

    def live(self) -> dict:
        return self.http.get("/metrics", params={"format": "json"}).json()["live"]

    def check_clean(self) -> None:
        """Nothing running; after erase every cell is free and no slot is busy or holds cells."""
        deadline = time.monotonic() + 30
        while (live := self.live())["running"] or live["waiting"]:
            assert time.monotonic() < deadline, live
            time.sleep(0.05)
        assert self.http.post("/slots", params={"action": "erase"}).status_code == 200
        pool = self.live()["kv_pool"]
        assert pool["free"] == pool["cells"], pool
        assert all(s["state"] == "free" and s["cells"] == 0 for s in pool["slots"]), pool["slots"]
        assert pool["parked"] == []
        assert not any(s["is_processing"] for s in self.http.get("/slots").json())
        assert self.http.get("/health").status_code == 200


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    box = Box(tiny_model_factory(**MODEL))
    try:
        box.start()
        yield box
    finally:
        box.stop()


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
