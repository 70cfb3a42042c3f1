"""The stage protocol over tcp with CURVE (`strata keygen`, box.curve_dir): the same tokens as over ipc, and a
peer without the box's keys gets nothing from a stage, not even a HELLO refusal.

Both peers below hold the right box key and send a HELLO with a valid token: only CURVE stops them (one speaks
in clear, one has the server's public key but not the box's client keypair, which the stages' ZAP handler
refuses).
"""
from __future__ import annotations

import asyncio
import subprocess
import sys

import zmq

from pool.curve import load_keys
from pool.runtime import read_key, token
from pool.wire import HELLO, PROTOCOL, encode
from tests.integration.conftest import ROOT
from tests.integration.test_split import run


def keyed_box(box):
    b = box(2, transport="tcp")
    keys = b.root / "keys"
    out = subprocess.run([sys.executable, "-m", "coordinator.cli", "keygen", str(keys)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    b.rewrite(box={"curve_dir": str(keys)})
    return b, keys


def test_curve_over_tcp_gives_the_tokens_of_ipc(box):
    plain, _, _ = asyncio.run(run(box(2)))
    b, _ = keyed_box(box)
    curved, info, _ = asyncio.run(run(b))
    assert curved == plain and [s["layers"] for s in info] == [[0, 2], [2, 4]]


def test_a_peer_without_the_box_keys_gets_nothing(box):
    b, keys = keyed_box(box)
    b.start_all()
    hello = encode(HELLO, {"protocol": PROTOCOL, "session": "rogue", "stage": 0, "config_fp": b.cfg.fingerprint(),
                           "box": token(read_key(keys / "box.key"), "hello:rogue")})
    server_public = load_keys(keys).server_public
    ctx = zmq.Context()
    try:
        honest = ctx.socket(zmq.DEALER)  # the box's own client keys: answered (the stage is up)
        k = load_keys(keys)
        honest.curve_secretkey, honest.curve_publickey, honest.curve_serverkey = (k.client_secret, k.client_public,
                                                                                  server_public)
        honest.connect(b.cfg.stages[0].endpoint)
        honest.send_multipart(hello)
        assert honest.poll(60000), "the stage answers a HELLO from a peer with the box's keys"
        honest.close(linger=0)

        clear = ctx.socket(zmq.DEALER)
        clear.connect(b.cfg.stages[0].endpoint)
        other = ctx.socket(zmq.DEALER)
        public, secret = zmq.curve_keypair()
        other.curve_secretkey, other.curve_publickey, other.curve_serverkey = secret, public, server_public
        other.connect(b.cfg.stages[0].endpoint)
        for sock in (clear, other):
            sock.send_multipart(hello, zmq.NOBLOCK)
        assert not clear.poll(2000) and not other.poll(500)
    finally:
        ctx.destroy(linger=0)
        b.stop()
