"""The coordinator's link to its stages: one ordered ZeroMQ stream per stage, a handshake, heartbeats.

    StageLink ── DEALER ──> stage 0 ROUTER   HELLO  OPS  STEP  PING  BYE   (one ordered stream per stage)
              <──────────                    HELLO  ERROR  PONG
              ── DEALER ──> stage S-1 ROUTER
              <──────────                    HELLO  RESULT  ERROR  PONG

Rules:
- Ops and steps go out on the same socket, so a stage sees every op a step depends on before the step.
  Ops for a stage that is not up are dropped, not queued: a stage that comes back gets a snapshot instead.
- `start()` sends HELLO to every stage and refuses to serve (LinkError naming the mismatch) unless the
  stages cover every layer of the model exactly once, in order, and agree on the checkpoint fingerprint,
  the pool geometry (n_chunks, chunk_cells, table_chunks) and the config fingerprint (also the
  coordinator's own). The HELLO request carries a session id: a stage that sees a new session starts with
  empty tables, so a restarted coordinator never inherits another one's tables. HELLO proves the box key
  (stages/ownership.py); a stage that serves another live coordinator refuses it, and start() fails with
  that reason (after waiting out one predecessor that has just died).
- Every step goes to every stage; only the last stage answers (RESULT). Any number of steps may be in
  flight; each has a future. Step ids increase within a session: the link assigns one when the header has
  none and refuses an id that does not increase (a stage uses the order to drop stale hidden states).
- A stage is down when it has said nothing (PONG or anything else) for `stage_timeout_ms`, when its
  connection drops (socket monitor), or when it reports a fatal error. Then every in-flight step fails at
  once with StageDown, `on_stage_down(index, reason)` is called, and the link opens a fresh socket to it
  (the old queue with its stale steps is dropped) and repeats HELLO until the stage answers and passes the
  same checks against the other stages. It is then *joining*: `on_stage_up(index)` is called (the scheduler
  sends a snapshot with `send_ops(..., stage=index, snapshot=True)`), and when that returns the stage is up
  again. `stages_up` is only true for stages that are up; steps are refused while any stage is not.
  With chained steps on several stages, the first stage (when up) gets a HELLO too: it drops the steps it has
  queued, one of which may wait for the down stage's samples (pool/step_chain.py rule 6); its answer, from a
  stage that is up, changes nothing here.
- An ERROR naming a step fails that step's future with StepFailed; the stage keeps serving.
- A step past its deadline (coordinator/deadlines.py: from its size and the measured rate, with a floor of
  `coordinator.step_timeout_ms`) marks the stage holding it down: every step in flight fails with StageDown
  and the stage is resynchronised as after any other failure.
- OPS carry `op_generations(ops)` when the scheduler sets it (`ChunkMap.generations_of`): the generation of
  every chunk the ops hand out, which a stage keeps in its pool file and reports in HELLO (`stage_hello`).
- `ask(kind, headers)` sends one request per stage (SAVE, LOAD) on the same ordered streams, at once, and its
  future gets every stage's DONE header, in stage order; it fails with StageDown if a stage goes down first.
"""
from __future__ import annotations

import array
import asyncio
import inspect
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from pool import step_chain
from pool.config import Config
from pool.logs import event
from pool.curve import connect_with, load_keys
from pool.runtime import box_key, token

from .deadlines import StepClock
from .handshake import LinkError, StageDown, StepFailed, check_hellos
from .loop_socket import LoopSocket

__all__ = ["LinkError", "StageDown", "StageLink", "StepFailed", "check_hellos"]
from pool.wire import (BYE, DONE, ERROR, HELLO, OPS, PING, PONG, PROTOCOL, RESULT, STEP, RawTensor, WireError, decode,
                       encode)

log = logging.getLogger("strata.link")

HELLO_RETRY_S = 1.0  # how often a down stage is asked again
@dataclass
class _Peer:
    index: int
    endpoint: str
    state: str = "down"  # down -> joining -> up
    reason: str = "not started"
    sock: LoopSocket | None = None
    mon: LoopSocket | None = None
    hello: dict | None = None  # the accepted HELLO
    waiter: asyncio.Future | None = None  # start(): the first HELLO answer
    last_seen: float = 0.0
    last_hello: float = 0.0
    pong: dict = field(default_factory=dict)
    refused_since: float = 0.0  # start(): when the stage first refused our HELLO because it has a live owner


class StageLink:
    """One DEALER per stage on the loop (coordinator/loop_socket.py); see the module docstring for the rules."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.session = uuid.uuid4().hex[:12]
        self._hello_token = token(box_key(cfg.box.resolved_key_file), f"hello:{self.session}")
        self._curve = load_keys(cfg.box.curve_dir) if cfg.box.curve_dir else None
        self.on_stage_up: Callable[[int], Any] | None = None
        self.on_stage_down: Callable[[int, str], Any] | None = None
        self.op_generations: Callable[[list], list] | None = None
        self._ctx = zmq.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)  # a context dropped without close() must never block in term()
        self._peers = [_Peer(i, s.endpoint) for i, s in enumerate(cfg.stages)]
        self._inflight: dict[int, asyncio.Future] = {}
        self.clock = StepClock(cfg.coordinator.step_timeout_ms / 1000)
        self._asks: dict[int, tuple[asyncio.Future, dict[int, dict]]] = {}  # req -> (future, DONE by stage)
        self._last_ask = 0
        self._last_step = -1
        self._heartbeat: asyncio.Task | None = None
        self._started = False
        self._closed = False

    # ---- state ---------------------------------------------------------------------------------------
    @property
    def stages_up(self) -> list[bool]:
        return [p.state == "up" for p in self._peers]

    def stage_info(self) -> list[dict]:
        """Per stage: index, endpoint, state, up, reason when not up, layers, device, and the last PONG."""
        out = []
        for p in self._peers:
            h = p.hello or {}
            info = {"index": p.index, "endpoint": p.endpoint, "state": p.state, "up": p.state == "up",
                    "layers": h.get("layers"), "device": h.get("device"), "pid": h.get("pid"),
                    "weight_bytes": h.get("weight_bytes"), **p.pong}
            if p.state != "up":
                info["reason"] = p.reason
            out.append(info)
        return out

    def stage_hello(self, index: int) -> dict | None:
        """The HELLO stage `index` was accepted with (the latest one after a rejoin)."""
        return self._peers[index].hello

    # ---- handshake -----------------------------------------------------------------------------------
    async def start(self, timeout: float = 600.0) -> None:
        """HELLO every stage and check that they fit together; LinkError (naming why) otherwise."""
        loop = asyncio.get_running_loop()
        for p in self._peers:
            p.waiter = loop.create_future()
            self._open(p)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.waiter for p in self._peers)), timeout)
            check_hellos([p.waiter.result() for p in self._peers], self.cfg.fingerprint())
        except asyncio.TimeoutError:
            silent = [f"stage {p.index} ({p.endpoint})" for p in self._peers if not p.waiter.done()]
            self.close()
            raise LinkError(f"{', '.join(silent)} did not answer HELLO within {timeout:g} s") from None
        except BaseException:
            for p in self._peers:  # a fatal ERROR from one stage must not leave the others' futures unread
                if p.waiter.done() and not p.waiter.cancelled():
                    p.waiter.exception()
            self.close()
            raise
        now = time.monotonic()
        for p in self._peers:
            p.hello, p.waiter = p.waiter.result(), None
            p.state, p.reason, p.last_seen = "up", "", now
        self._started = True
        self._heartbeat = asyncio.create_task(self._beat(), name="stage-heartbeat")
        event(log, "stages.up", stages=[{"layers": p.hello["layers"], "device": p.hello["device"], "pid": p.hello["pid"]}
                                        for p in self._peers], session=self.session)

    def _open(self, p: _Peer) -> None:
        """A fresh DEALER (and monitor) to stage p, with HELLO queued first on it."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a slow stage; down-detection bounds it
        sock.setsockopt(zmq.RCVHWM, 0)
        connect_with(sock, self._curve)
        mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(p.endpoint)
        # a socket closed when it is replaced calls nothing more (loop_socket rule 4): no stale message or event
        p.sock = LoopSocket(sock, lambda frames: self._read(p, frames))
        p.mon = LoopSocket(mon, lambda frames: self._watch(p, frames))
        self._send_hello(p)

    def _close_socket(self, p: _Peer, linger: int = 0) -> None:
        if p.sock is not None:
            try:
                p.sock.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            p.mon.close()
            p.sock.close(linger=linger)
            p.sock = p.mon = None

    def _send_hello(self, p: _Peer) -> None:
        p.last_hello = time.monotonic()
        self._send(p, encode(HELLO, {"protocol": PROTOCOL, "session": self.session, "stage": p.index,
                                     "config_fp": self.cfg.fingerprint(), "box": self._hello_token}))

    def _send(self, p: _Peer, frames: list) -> None:
        p.sock.send(frames)  # a failure surfaces as the stage going down

    # ---- receiving -----------------------------------------------------------------------------------
    def _read(self, p: _Peer, frames: list) -> None:
        try:
            kind, header, _ = decode(frames)
        except WireError as err:
            event(log, "stage.malformed", logging.WARNING, stage=p.index, message=str(err))
            return
        p.last_seen = time.monotonic()
        if kind == PONG:
            p.pong = {k: v for k, v in header.items() if k != "t"}
        elif kind == RESULT:
            fut = self._inflight.get(header.get("step"))
            if fut is not None and not fut.done():
                fut.set_result(header)
        elif kind == ERROR:
            self._on_error(p, header)
        elif kind == HELLO:
            self._on_hello(p, header)
        elif kind == DONE:
            self._on_done(p, header)
        else:
            event(log, "stage.unexpected", logging.WARNING, stage=p.index, kind=kind)

    def _on_error(self, p: _Peer, header: dict) -> None:
        message = str(header.get("message", "unknown error"))
        if header.get("hello_refused"):
            self._on_refused(p, message, bool(header.get("owned")))
            return
        if header.get("fatal"):
            if p.waiter is not None and not p.waiter.done():
                p.waiter.set_exception(LinkError(f"stage {p.index} could not start: {message}"))
            elif p.state == "down":
                p.reason = f"fatal error: {message}"  # a restarted stage that cannot build: stays down
            else:
                self._mark_down(p, f"fatal error: {message}")
            return
        step = header.get("step")
        fut = self._inflight.get(step)
        if fut is not None and not fut.done():  # a later stage that dropped it names the stage where it failed
            fut.set_exception(StepFailed(step, int(header.get("origin", p.index)), message))
        elif step is None:
            event(log, "stage.error", logging.WARNING, stage=p.index, message=message)

    def _on_refused(self, p: _Peer, message: str, owned: bool) -> None:
        """A stage refused our HELLO. At start: a key mismatch fails start() at once; a live owner is waited out
        for two stage timeouts (a predecessor that just died stops being heard), asking again every
        HELLO_RETRY_S, then fails it. Later (a rejoin): the stage stays down with the reason, asked again."""
        if p.reason != message:
            event(log, "stage.refused", logging.ERROR, stage=p.index, reason=message)
        p.reason = message
        if p.waiter is None or p.waiter.done():
            return
        now = time.monotonic()
        p.refused_since = p.refused_since or now
        if owned and now - p.refused_since < 2 * self.cfg.coordinator.stage_timeout_ms / 1000:
            asyncio.get_running_loop().call_later(HELLO_RETRY_S, lambda: p.sock is not None and self._send_hello(p))
            return
        p.waiter.set_exception(LinkError(message))

    def _on_done(self, p: _Peer, header: dict) -> None:
        pending = self._asks.get(header.get("req"))
        if pending is None or pending[0].done():
            return
        fut, answers = pending
        answers[p.index] = header
        if len(answers) == len(self._peers):
            fut.set_result([answers[i] for i in range(len(self._peers))])

    def _on_hello(self, p: _Peer, header: dict) -> None:
        if p.waiter is not None:
            if not p.waiter.done():
                p.waiter.set_result(header)
            return
        if not self._started or p.state != "down":
            return  # a repeated answer to a HELLO sent while the stage was slow
        hellos = [header if q is p else q.hello for q in self._peers]
        try:
            check_hellos(hellos, self.cfg.fingerprint())
        except LinkError as err:
            if p.reason != str(err):
                event(log, "stage.refused", logging.ERROR, stage=p.index, reason=str(err))
            p.reason = str(err)
            return
        p.hello, p.state, p.reason, p.last_seen = header, "joining", "", time.monotonic()
        event(log, "stage.back", stage=p.index, pid=header.get("pid"))
        if self.on_stage_up is None:
            p.state = "up"
            return
        result = self.on_stage_up(p.index)
        if inspect.isawaitable(result):
            asyncio.ensure_future(self._finish_join(p, result))
        else:
            p.state = "up"

    async def _finish_join(self, p: _Peer, pending: Any) -> None:
        await pending
        if p.state == "joining":
            p.state = "up"

    def _watch(self, p: _Peer, frames: list) -> None:
        """A monitor event of the stage's socket: a lost connection marks the stage down."""
        if parse_monitor_message([bytes(f) for f in frames])["event"] == zmq.EVENT_DISCONNECTED and p.state != "down":
            self._mark_down(p, "connection lost")  # closes this socket and opens the next

    # ---- heartbeat and failure -----------------------------------------------------------------------
    async def _beat(self) -> None:
        period = self.cfg.coordinator.heartbeat_ms / 1000
        limit = self.cfg.coordinator.stage_timeout_ms / 1000
        ping = encode(PING, {})
        while not self._closed:
            now = time.monotonic()
            self._check_deadline(now)
            for p in self._peers:
                if p.state != "down":
                    if now - p.last_seen > limit:
                        self._mark_down(p, f"no answer for {limit:g} s")
                    else:
                        self._send(p, ping)
                elif now - p.last_hello > HELLO_RETRY_S:
                    self._send_hello(p)
            await asyncio.sleep(period)

    def _check_deadline(self, now: float) -> None:
        """The oldest step past its deadline (coordinator/deadlines.py): the stage holding it is marked down."""
        late = self.clock.overdue(now)
        if late is None:
            return
        step, limit, tokens = late
        holder = next((p for p in self._peers if p.state == "up" and (p.pong.get("last_step") is None
                                                                      or p.pong["last_step"] < step)), None)
        holder = holder or self._peers[-1]
        event(log, "step.overdue", logging.ERROR, stage=holder.index, step=step, limit_s=round(limit, 3), tokens=tokens)
        self._mark_down(holder, f"step {step} ({tokens} tokens) passed its deadline of {limit:.1f} s")
        self.clock.clear()

    def _fail_pending(self, err: Exception) -> None:
        """Every step and ask still waiting fails with `err`."""
        for fut in [*self._inflight.values(), *(f for f, _ in self._asks.values())]:
            if not fut.done():
                fut.set_exception(err)

    def _mark_down(self, p: _Peer, reason: str) -> None:
        """Fail everything in flight, tell the scheduler, and start asking the stage to come back."""
        if p.state == "down" or self._closed:
            return
        event(log, "stage.down", logging.ERROR, stage=p.index, reason=reason)
        p.state, p.reason, p.pong = "down", reason, {}
        self._fail_pending(StageDown(p.index, reason))
        if self.on_stage_down is not None:
            self.on_stage_down(p.index, reason)
        self._close_socket(p)
        self._open(p)
        first = self._peers[0]
        if p is not first and step_chain.ring(self.cfg) and first.state == "up" and first.sock is not None:
            self._send_hello(first)  # its chained steps wait for samples this stage will not send (step_chain rule 6)

    # ---- sending -------------------------------------------------------------------------------------
    def _require_up(self) -> None:
        """StageDown for the first stage that is not up: steps and asks go to every stage or to none."""
        for p in self._peers:
            if p.state != "up":
                raise StageDown(p.index, p.reason or p.state)

    def send_ops(self, ops: list, stage: int | None = None, snapshot: bool = False) -> None:
        """Send table ops (in order) to every stage, or to one; `snapshot` replaces the stage's tables."""
        if not ops and not snapshot:
            return
        gens = self.op_generations(ops) if self.op_generations is not None else []
        frames = encode(OPS, {"ops": ops, "snapshot": snapshot, "generations": gens})
        for p in self._peers if stage is None else [self._peers[stage]]:
            if p.state != "down" and p.sock is not None:
                self._send(p, frames)

    def submit(self, header: dict, tokens: list[int]) -> asyncio.Future:
        """Send one step to every stage now (in order with the ops sent before it); the future gets the last
        stage's RESULT header (tokens as [[slot, token, logprob, top]]) or fails with StageDown/StepFailed.

        Sending is synchronous on purpose: the scheduler sends the ops of the next step right after, and a step
        must be on the wire before any op that follows it."""
        self._require_up()
        header = dict(header)
        sid = header.setdefault("step", self._last_step + 1)
        if not isinstance(sid, int) or sid <= self._last_step:
            raise ValueError(f"step id {sid!r} does not increase (last was {self._last_step})")
        self._last_step = sid
        fut = asyncio.get_running_loop().create_future()
        self._inflight[sid] = fut
        self.clock.submitted(sid, len(tokens), time.monotonic())

        def done(f: asyncio.Future) -> None:
            self._inflight.pop(sid, None)
            self.clock.answered(sid, time.monotonic(), measure=not f.cancelled() and f.exception() is None)

        fut.add_done_callback(done)
        ids = array.array("i", tokens)
        frames = encode(STEP, header, [RawTensor("int32", (len(ids),), memoryview(ids))])
        for p in self._peers:
            self._send(p, frames)
        return fut

    def ask(self, kind: str, headers: list[dict]) -> asyncio.Future:
        """Send `headers[i]` (with a fresh "req" id) to stage i now, in order with everything sent before; the
        future gets the stages' DONE headers in stage order, or fails with StageDown."""
        self._require_up()
        self._last_ask += 1
        req = self._last_ask
        fut = asyncio.get_running_loop().create_future()
        self._asks[req] = (fut, {})
        fut.add_done_callback(lambda _f: self._asks.pop(req, None))
        for p, header in zip(self._peers, headers):
            self._send(p, encode(kind, {**header, "req": req}))
        return fut

    async def step(self, header: dict, tokens: list[int]) -> dict:
        """`submit` and wait for the result."""
        return await self.submit(header, tokens)

    def close(self) -> None:
        """Say BYE to every stage and drop the sockets; steps still in flight fail with StageDown."""
        if self._closed:
            return
        self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        bye = encode(BYE, {"session": self.session})
        try:
            asyncio.get_running_loop()
            can_send = True
        except RuntimeError:
            can_send = False  # closed after its loop ended: no BYE (the stages time the session out)
        try:
            if can_send:
                self._fail_pending(StageDown(0, "the link is closed"))
            for p in self._peers:
                said_bye = can_send and p.sock is not None and p.state != "down"
                if said_bye:
                    self._send(p, bye)
                p.state, p.reason = "down", "the link is closed"
                self._close_socket(p, linger=200 if said_bye else 0)
        finally:
            self._ctx.term()
