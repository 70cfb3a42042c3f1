"""Step deadlines: the clock's arithmetic, and a link whose stage answers PINGs but drops a step (a real
ZeroMQ peer speaking the stage protocol): the step fails with the deadline named, the stage is marked down
and is asked to HELLO again."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from coordinator.deadlines import INITIAL_TOKEN_S, SLACK, StepClock
from coordinator.link import StageDown, StageLink
from pool.config import config_from_dict
from pool.wire import HELLO, PING, PONG, PROTOCOL, STEP, decode, encode


def test_only_the_oldest_step_is_timed_from_when_it_became_the_oldest():
    c = StepClock(floor_s=1.0)
    assert c.limit(4) == 1.0 + SLACK * 4 * INITIAL_TOKEN_S  # before any answer: the generous initial rate
    c.submitted(0, 10, now=0.0)
    c.submitted(1, 10, now=0.0)
    c.answered(0, now=2.0)  # 0.2 s per token
    assert c.per_token_s == pytest.approx(0.2)
    assert c.limit(10) == pytest.approx(1.0 + SLACK * 10 * 0.2)
    assert c.overdue(now=2.0 + 20.9) is None  # step 1 is timed from step 0's answer, not from its submission
    assert c.overdue(now=2.0 + 21.1) == (1, pytest.approx(21.0), 10)
    c.answered(1, now=3.0)  # 1 s for 10 tokens: 0.1 s per token, weighed in
    assert c.per_token_s == pytest.approx(0.8 * 0.2 + 0.2 * 0.1)
    assert c.overdue(now=1e9) is None


def test_a_failed_step_is_not_measured():
    c = StepClock(floor_s=0.5)
    c.submitted(3, 1, now=0.0)
    c.answered(3, now=100.0, measure=False)
    assert c.per_token_s is None and c.overdue(now=1e9) is None


class DroppingStage(threading.Thread):
    """A one-stage peer that passes the handshake, answers every PING, and never answers a STEP."""

    def __init__(self, endpoint: str, hello: dict) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(endpoint)
        self.hello, self.hellos, self.steps, self.stop = hello, 0, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, *frames = self.sock.recv_multipart()
            kind, header, _ = decode(frames)
            if kind == HELLO:
                self.hellos += 1
                self.sock.send_multipart([ident, *encode(HELLO, {**self.hello, "session": header["session"]})])
            elif kind == PING:
                self.sock.send_multipart([ident, *encode(PONG, {"version": 0, "ready": True, "last_step": None})])
            elif kind == STEP:
                self.steps += 1
        self.ctx.destroy(linger=0)


def test_a_dropped_step_fails_at_its_deadline_and_the_stage_is_resynchronised(tmp_path):
    endpoint = f"ipc://{tmp_path}/s0"
    cfg = config_from_dict({"model": "tiny", "stages": [{"device": "cpu", "layers": [0, 4], "endpoint": endpoint}],
                            "engine": {"max_context": 64, "chunk_cells": 16, "kv_pool_tokens": 128, "prefill_chunk": 64},
                            "coordinator": {"heartbeat_ms": 50, "stage_timeout_ms": 1000, "step_timeout_ms": 200}})
    e = cfg.engine
    stage = DroppingStage(endpoint, {"protocol": PROTOCOL, "stage": 0, "layers": [0, 4], "model_layers": 4,
                                     "model_fp": "m", "config_fp": cfg.fingerprint(), "device": "cpu", "pid": 1,
                                     "pool": {"n_chunks": e.n_chunks, "chunk_cells": e.chunk_cells,
                                              "table_chunks": e.table_chunks}})
    stage.start()

    async def main() -> tuple[str, float, list[dict]]:
        link = StageLink(cfg)
        await link.start(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(StageDown) as err:
            await asyncio.wait_for(link.step({"version": 0, "slots": [[0, 0, 1, 1]], "sampling": {}}, [7]), 30)
        took = time.monotonic() - t0
        await asyncio.sleep(0.3)  # the link asks the stage to HELLO again
        info = link.stage_info()
        link.close()
        return str(err.value), took, info

    try:
        message, took, info = asyncio.run(main())
    finally:
        stage.stop.set()
        stage.join(5)
    limit = 0.2 + SLACK * 1 * INITIAL_TOKEN_S
    assert "step 0 (1 tokens) passed its deadline of 5.2 s" in message, message
    assert limit - 0.1 < took < limit + 2.0
    assert stage.steps == 1 and stage.hellos >= 2  # resynchronised: a fresh HELLO after the deadline
    assert info[0]["state"] in ("joining", "up")
