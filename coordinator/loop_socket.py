"""A ZeroMQ socket read and written on the asyncio loop by callbacks (coordinator/link.py's DEALERs and monitors).

zmq.asyncio gives every message a future and a loop callback, and reads the socket's events through a dozen enum
operations per message: on a 2-core box the coordinator spent about a quarter of its CPU time per streamed token
there, time the stages' threads lose (docs/BENCHMARKS.md, "The coordinator's CPU per token"). Here a
plain socket's file descriptor is watched by the loop itself and every message that has arrived is handed to
one callback, in order.

Rules:
1. `send(frames)` sends the message now without blocking when nothing is waiting before it; a message the socket
   cannot take now (zmq.Again), and every one after it, waits in a queue and goes out in order once the socket
   can take it. A send that fails otherwise (the socket closed) drops the message, as a closed peer would.
2. Every message that arrives is passed to `on_message(frames)` on the loop, in arrival order, one at a time; an
   exception it raises is logged and the next message still comes.
3. ZeroMQ signals its file descriptor on edges, and any operation on the socket (a send, reading its events)
   may take an edge the loop has not seen yet: after each one the socket's events are read again, and if a
   message waits (or a queued send can go) the handler runs on the next loop turn, so no message waits for a
   signal that was already taken.
4. `close(linger)` stops watching the descriptor first, then closes the socket; nothing is called after it.
   Sending on a closed LoopSocket does nothing.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

import zmq

log = logging.getLogger("strata.link")

_IN, _OUT = int(zmq.POLLIN), int(zmq.POLLOUT)


class LoopSocket:
    """`sock` (a plain zmq.Socket) on the running loop; see the module docstring for the rules."""

    def __init__(self, sock: zmq.Socket, on_message: Callable[[list], None]) -> None:
        self.sock = sock
        self._on_message = on_message
        self._loop = asyncio.get_running_loop()
        self._fd = sock.getsockopt(zmq.FD)
        self._queue: deque[list] = deque()
        self._scheduled = False
        self.closed = False
        self._loop.add_reader(self._fd, self._handle)
        self._again()  # messages that arrived before the descriptor was watched (rule 3)

    def send(self, frames: list) -> None:
        """Rule 1."""
        if self.closed:
            return
        if not self._queue:
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                self._queue.append(frames)
            except zmq.ZMQError as err:
                log.debug("a send on a closed socket is dropped: %s", err)
                return
        else:
            self._queue.append(frames)
        self._again()

    def close(self, linger: int = 0) -> None:
        """Rule 4."""
        if self.closed:
            return
        self.closed = True
        self._queue.clear()
        try:
            self._loop.remove_reader(self._fd)
        except RuntimeError:  # the loop has ended: nothing watches the descriptor any more
            pass
        self.sock.close(linger=linger)

    def _events(self) -> int:
        return int(self.sock.getsockopt(zmq.EVENTS))

    def _again(self) -> None:
        """Rule 3: the handler on the next loop turn when the events just read call for it."""
        if self._scheduled or self.closed:
            return
        events = self._events()
        if events & _IN or (self._queue and events & _OUT):
            self._scheduled = True
            self._loop.call_soon(self._handle)

    def _handle(self) -> None:
        self._scheduled = False
        while self._queue and not self.closed:
            try:
                self.sock.send_multipart(self._queue[0], zmq.NOBLOCK)
            except zmq.Again:
                break
            self._queue.popleft()
        while not self.closed:  # until zmq.Again, after which the next message signals the descriptor anew
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                self._on_message(frames)
            except Exception:  # rule 2: one bad message does not stop the next
                log.exception("a message handler failed")
        if self._queue:  # the receive may have taken the signal that the socket can take them now (rule 3)
            self._again()
