"""One box, one owner: what a second coordinator, a second stage, a second `strata up` and a rogue peer on the
stage sockets can do to a running box (nothing), each against a live `strata up` box of two CPU stages.

Every test first records the box's greedy answer, attacks, then asks again: the same text, every cell free.
Without the checks of stages/ownership.py and the endpoint locks, each attack breaks the box (a HELLO resets
the stages' tables, a rogue HIDDEN for a later step makes stage 1 drop the real one, a rogue SAMPLES for a later
step makes stage 0 drop every chained step, a second stage removes the live one's socket file).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from pool.runtime import write_key
from pool.wire import ERROR, HELLO, HIDDEN, LOAD, OPS, PROTOCOL, SAMPLES, SAVE, STEP, decode, encode
from tests.integration.conftest import ROOT

MSGS = [{"role": "user", "content": "Name three rivers."}]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def server(strata_up):
    return strata_up(chain_steps=True)  # stage 0 binds its data endpoint too (pool/step_chain.py rule 6)


@pytest.fixture(scope="module")
def answer(server) -> str:
    return ask(server)


def ask(server) -> str:
    out = server.openai().chat.completions.create(model=server.model, messages=MSGS, max_tokens=8, temperature=0)
    return out.choices[0].message.content


@pytest.fixture(autouse=True)
def unharmed(server, answer):
    yield
    assert server.http.get("/health").status_code == 200, server.http.get("/health").text
    assert ask(server) == answer
    server.check_clean()


def run(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def test_second_coordinator_is_refused_and_changes_nothing(server):
    began = time.monotonic()
    out = run(["-m", "coordinator.cli", "coord", "--config", str(server.path), "--set", "coordinator.port=0"])
    assert out.returncode == 1, out.stderr
    assert "serves another live coordinator" in out.stderr, out.stderr
    assert time.monotonic() - began < 40


def test_coordinator_of_another_box_is_refused_at_once(server, tmp_path):
    os.chmod(tmp_path, 0o700)
    write_key(tmp_path / "other.key")
    out = run(["-m", "coordinator.cli", "coord", "--config", str(server.path), "--set", "coordinator.port=0",
               "--set", f"box.key_file={tmp_path / 'other.key'}"])
    assert out.returncode == 1 and "box key does not match" in out.stderr, out.stderr


def test_second_stage_for_a_live_endpoint_exits_and_touches_nothing(server):
    sock = Path(server.cfg.stages[0].endpoint[len("ipc://"):])
    before = sock.stat().st_ino
    out = run(["-m", "stages.server", "--device", "0", "--config", str(server.path)])
    assert out.returncode == 2, out.stderr
    assert "in use by a live process (pid" in out.stderr and "nothing was changed" in out.stderr, out.stderr
    assert sock.stat().st_ino == before  # the live stage's socket file is still the one it bound


def test_second_strata_up_is_refused_before_starting_anything(server):
    out = run(["-m", "coordinator.cli", "up", "--config", str(server.path)])
    assert out.returncode == 2 and "already up" in out.stderr, out.stderr


def test_rogue_peer_gets_nothing_and_changes_nothing(server):
    """HELLO without the box key, OPS / STEP / SAVE / LOAD without a HELLO, a HIDDEN for a far later step, and a
    SAMPLES for one on stage 0's data endpoint (where the last stage's samples come: pool/step_chain.py rule 6)."""
    ctx = zmq.Context()
    try:
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(server.cfg.stages[0].endpoint)
        rogue.send_multipart(encode(HELLO, {"protocol": PROTOCOL, "session": "rogue", "stage": 0, "config_fp": "x"}))
        assert rogue.poll(5000), "a HELLO refusal is answered"
        kind, header, _ = decode(rogue.recv_multipart())
        assert kind == ERROR and header["hello_refused"] and not header["owned"], header
        for frames in (encode(OPS, {"ops": [], "snapshot": True, "generations": []}),
                       encode(STEP, {"step": 10**9, "version": 0, "slots": [[0, 0, 1, 1]], "sampling": {}}),
                       encode(SAVE, {"req": 1, "name": "x"}), encode(LOAD, {"req": 2, "name": "x"})):
            rogue.send_multipart(frames)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(server.cfg.stages[1].data)
        push.send_multipart(encode(HIDDEN, {"step": 10**9, "error": "rogue"}))
        ring = ctx.socket(zmq.PUSH)
        ring.setsockopt(zmq.LINGER, 1000)
        ring.connect(server.cfg.stages[0].data)
        ring.send_multipart(encode(SAMPLES, {"step": 10**9, "rows": [[0, 1]], "session": "rogue"}))
        time.sleep(1.0)
        assert not rogue.poll(500), "nothing but the HELLO refusal comes back"
    finally:
        ctx.destroy(linger=0)
