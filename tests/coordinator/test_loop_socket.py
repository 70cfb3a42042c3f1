"""coordinator/loop_socket.py against a real ZeroMQ peer over ipc: messages arrive in order through the loop, a
send that takes the descriptor's edge loses no message, a full socket queues in order, a failing handler does not
stop the next message, and nothing is called after close."""
from __future__ import annotations

import asyncio
import time

import zmq

from coordinator.loop_socket import LoopSocket


def _pair(tmp_path, hwm: int = 0) -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    ctx = zmq.Context()
    peer = ctx.socket(zmq.ROUTER)
    peer.setsockopt(zmq.RCVHWM, hwm)
    peer.bind(f"ipc://{tmp_path}/s")
    ours = ctx.socket(zmq.DEALER)
    ours.setsockopt(zmq.SNDHWM, hwm)
    ours.setsockopt(zmq.LINGER, 0)
    ours.connect(f"ipc://{tmp_path}/s")
    return ctx, peer, ours


def _identity(peer: zmq.Socket, ours: LoopSocket) -> bytes:
    ours.send([b"hi"])
    assert peer.poll(2000)
    ident, hi = peer.recv_multipart()
    assert hi == b"hi"
    return ident


async def _until(cond, timeout: float = 2.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.005)


def test_messages_arrive_in_order_and_one_that_a_send_took_the_signal_of_still_arrives(tmp_path):
    ctx, peer, raw = _pair(tmp_path)

    async def main() -> list[bytes]:
        got: list[bytes] = []
        ours = LoopSocket(raw, lambda frames: got.append(bytes(frames[0])))
        ident = _identity(peer, ours)
        for i in range(50):
            peer.send_multipart([ident, b"%d" % i])
        await _until(lambda: len(got) == 50)
        # the peer answers while the loop is busy; our next send processes ZeroMQ's commands (and takes the
        # descriptor's signal) before the loop looks at the descriptor again
        peer.send_multipart([ident, b"late"])
        time.sleep(0.2)
        ours.send([b"x"])
        await _until(lambda: got[-1:] == [b"late"])
        ours.close()
        return got

    try:
        got = asyncio.run(main())
    finally:
        ctx.destroy(linger=0)
    assert got == [b"%d" % i for i in range(50)] + [b"late"]


def test_a_full_socket_queues_its_sends_and_sends_them_in_order(tmp_path):
    ctx, peer, raw = _pair(tmp_path, hwm=2)

    async def main() -> tuple[list[int], int]:
        deadline = time.monotonic() + 10
        ours = LoopSocket(raw, lambda frames: None)
        _identity(peer, ours)
        for i in range(300):  # the peer reads nothing yet: the socket's queues fill, the rest wait in order
            ours.send([b"%d" % i])
        queued = len(ours._queue)
        got: list[int] = []
        while len(got) < 300:
            if peer.poll(0):
                got.append(int(peer.recv_multipart()[1]))
            else:
                await asyncio.sleep(0.001)  # the loop sends what waits as the socket takes it
            assert len(got) == 300 or time.monotonic() < deadline
        ours.close()
        return got, queued

    try:
        got, queued = asyncio.run(main())
    finally:
        ctx.destroy(linger=0)
    assert queued > 0  # the test reached the queue
    assert got == list(range(300))


def test_a_failing_handler_does_not_stop_the_next_message_and_close_ends_everything(tmp_path):
    ctx, peer, raw = _pair(tmp_path)

    async def main() -> list[bytes]:
        got: list[bytes] = []

        def handle(frames: list) -> None:
            got.append(bytes(frames[0]))
            if got[-1] == b"bad":
                raise ValueError("a bad message")

        ours = LoopSocket(raw, handle)
        ident = _identity(peer, ours)
        peer.send_multipart([ident, b"bad"])
        peer.send_multipart([ident, b"good"])
        await _until(lambda: got == [b"bad", b"good"])
        ours.close()
        ours.send([b"after close"])  # nothing
        peer.send_multipart([ident, b"unseen"])
        await asyncio.sleep(0.1)
        assert not peer.poll(50)
        return got

    try:
        got = asyncio.run(main())
    finally:
        ctx.destroy(linger=0)
    assert got == [b"bad", b"good"]
