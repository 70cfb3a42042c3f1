"""The stage's compute thread and the hidden states it waits for (see stages/server.py for the rules).

`Compute` runs HELLO, OPS, STEP, SAVE and LOAD in the order the coordinator sent them, against the
StageRunner it builds, and owns the PUSH socket to the next stage (and, on the last stage of a box with chained
steps, the one to the first stage's data endpoint: pool/step_chain.py rule 6). `Hidden` holds hidden states from
the previous stage, or on the first stage the last stage's samples, keyed by step id, until the step that needs
them runs. While it waits it reads the stage's sockets itself, and sends its answers on them; before work
that may outlast a heartbeat it lets the I/O thread read them (stages/baton.py).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from pool.logs import event
from pool.curve import connect_with
from pool.wire import DONE, ERROR, HELLO, HIDDEN, LOAD, OPS, RESULT, SAMPLES, SAVE, STEP, encode

from .baton import Baton

log = logging.getLogger("strata.stage")
RING_KEEP = 64  # SAMPLES the first stage keeps: a chained step names one of the S + 1 latest steps


class Hidden:
    """Hidden states from the previous stage (on the first stage: the last stage's SAMPLES), by step id, from
    whichever thread read them (stages/baton.py) to the step that needs them."""

    def __init__(self, keep: int | None = None) -> None:
        self._lock = threading.Lock()  # put by whichever thread holds the baton; abandoned by the I/O thread
        self._items: dict[int, tuple[dict, list]] = {}
        self.keep = keep  # at most this many kept, the latest (SAMPLES: most steps are never named by a chained one)
        self._epoch = 0
        self.closed = False

    def put(self, step: int, header: dict, tensors: list) -> None:
        with self._lock:
            self._items[step] = (header, tensors)
            if self.keep is not None and len(self._items) > self.keep:
                del self._items[min(self._items)]

    @property
    def epoch(self) -> int:
        return self._epoch

    def abandon(self) -> None:
        """Make every step queued or waiting so far give up (a HELLO came, or shutdown), and forget the hidden
        states that came for them: their step ids belong to the steps given up."""
        with self._lock:
            self._epoch += 1
            self._items.clear()

    def poll(self, step: int, epoch: int) -> tuple[dict | None, list, str | None] | None:
        """(header, tensors, None) for `step` (queued in `epoch`), (None, [], why) when it will never come, or
        None while it may still come."""
        with self._lock:
            if step in self._items:
                header, tensors = self._items.pop(step)
                for old in [s for s in self._items if s < step]:
                    del self._items[old]
                return header, tensors, None
            if any(s > step for s in self._items):
                return None, [], "the previous stage moved on to a later step (it restarted or dropped this one)"
            if self.closed or self._epoch != epoch:
                return None, [], "abandoned: the coordinator reconnected"
            return None


class Compute(threading.Thread):
    """Builds the runner, then runs queued HELLO/OPS/STEP items in order; sends its answers on the ROUTER while it
    holds the baton, else over inproc for the I/O thread to forward (stages/baton.py)."""

    def __init__(self, build: Callable[[], Any], ctx: zmq.Context, index: int, n_stages: int, *, baton: Baton,
                 read: Callable[[int], None], send: Callable[[list], None], next_data: str | None = None,
                 hidden_token: str = "", curve: Any = None, ring_data: str | None = None,
                 takes_samples: bool = False) -> None:
        super().__init__(name="stage-compute", daemon=True)
        self.build = build
        self.ctx = ctx
        self.index = index
        self.has_prev = index > 0
        self.has_next = index < n_stages - 1
        self.next_data = next_data  # the next stage's data endpoint (PUSH from this thread)
        self.hidden_token = hidden_token  # proves to the next stage that a HIDDEN comes from this box
        self.curve = curve  # pool/curve.py CurveKeys, or None
        self.ring_data = ring_data  # the last stage of a ring: the first stage's data endpoint (SAMPLES)
        self.takes_samples = takes_samples  # the first stage of a ring: chained rows wait for SAMPLES
        self.ring_taken = 0  # the first stage: the last step whose SAMPLES went into the runner's Samples
        self.items: queue.Queue = queue.Queue()
        self.hidden = Hidden(RING_KEEP if takes_samples else None)
        self.runner: Any = None
        self.session: str | None = None
        self.baton = baton  # who reads the stage's sockets (stages/baton.py)
        self.read = read  # for the baton's holder: read the ROUTER and the PULL for up to N ms, as the I/O thread would
        self.send = send  # for the baton's holder: frames out on the ROUTER
        self.stopping = False  # set by the I/O thread at shutdown: stop waiting for the baton
        # Read by the I/O thread for every PONG; "kv_window" is replaced whole, never changed in place.
        self.stats = {"steps_run": 0, "steps_refused": 0, "steps_failed": 0, "busy": False, "kv_window": None,
                      "last_step": None, "busy_s": 0.0, "hidden_wait_s": 0.0}

    def run(self) -> None:
        out = self.ctx.socket(zmq.PAIR)
        out.connect("inproc://stage-results")
        self.out = out
        self.push = self._push(self.next_data) if self.has_next else None
        self.ring = self._push(self.ring_data) if self.ring_data else None
        try:
            self.runner = self.build()
        except Exception as err:  # noqa: BLE001 - any failure to build is reported to the peer, then fatal
            event(log, "stage.build_failed", logging.ERROR, stage=self.index, message=str(err))
            out.send_multipart([b"F", str(err).encode()])
            out.close(linger=-1)
            return
        self._window_stats()
        out.send_multipart([b"R"])
        try:
            while (item := self._until(self._next_item, (None,))[0]) is not None:
                kind, ident, header, tensors, epoch = item
                if kind == HELLO:
                    self._hello(ident, header)
                elif kind == OPS:
                    self._ops(ident, header)
                elif kind in (STEP, SAVE, LOAD) and epoch != self.hidden.epoch:
                    event(log, "step.dropped", stage=self.index, step=header.get("step", header.get("req")),
                          kind=kind, why="sent before a HELLO")
                    if kind == STEP:
                        self._to_ring(header.get("step"), error="sent before a HELLO")
                elif kind == STEP:
                    self._step(ident, header, tensors, epoch)
                elif kind in (SAVE, LOAD):
                    self._session_file(ident, kind, header)
        except Exception as err:  # noqa: BLE001 - steps catch their own errors; this is a bug: fatal, not silent
            event(log, "stage.compute_failed", logging.ERROR, stage=self.index, message=str(err),
                  exc=traceback.format_exc())
            self.baton.give(to_compute=False)  # rule 5: the I/O thread reads the F below and ends the stage
            out.send_multipart([b"F", f"compute thread failed: {err}".encode()])
        finally:
            self.baton.give(to_compute=False)
            out.close(linger=-1)

    def _next_item(self) -> tuple | None:
        """(the next queued item or None at shutdown,) or None while nothing is queued."""
        try:
            return (self.items.get_nowait(),)
        except queue.Empty:
            return None

    def _until(self, ready: Callable[[], Any], stopped: Any) -> Any:
        """`ready()` once it is not None, reading the sockets meanwhile (baton rule 2); `stopped` at shutdown."""
        while (got := ready()) is None:
            if not self._hold():
                return stopped
            self.read(100)
        return got

    def _take(self, step: int, epoch: int) -> tuple[dict | None, list, str | None]:
        """Hidden.poll's answer for `step`, once it has one."""
        return self._until(lambda: self.hidden.poll(step, epoch), (None, [], "the stage is stopping"))

    def _hold(self) -> bool:
        """Take the baton back from the I/O thread (rule 4) unless this thread holds it; False at shutdown."""
        if self.baton.compute_holds:
            return True
        self.out.send_multipart([b"B"])
        while not self.baton.wait(for_compute=True, timeout=0.1):
            if self.stopping:
                return False
        return True

    def _let_go(self) -> None:
        """Give the baton to the I/O thread before work that may outlast `hold_s` (rule 3)."""
        self.baton.give(to_compute=False)

    def _push(self, endpoint: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        connect_with(sock, self.curve)
        for opt in (zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM):
            sock.setsockopt(opt, 0)
        sock.connect(endpoint)
        return sock

    def _to_coord(self, ident: bytes, kind: str, header: dict, tensors: list = ()) -> None:
        if self.baton.compute_holds:
            self.send([ident, *encode(kind, header, tensors)])
        else:  # the I/O thread forwards it (rule 3)
            self.out.send_multipart([b"C", ident, *encode(kind, header, tensors)], copy=False)

    def _hello(self, ident: bytes, header: dict) -> None:
        session = header.get("session")
        if session != self.session:
            self.runner.reset(session)
            event(log, "stage.session", stage=self.index, session=session, previous=self.session,
                  generations=sum(1 for g in self.runner.hello()["generations"] or [] if g))
            self.session = session
            self.ring_taken = 0  # step ids start again
            self._window_stats()  # a new session drops every frame
        self._to_coord(ident, HELLO, {**self.runner.hello(), "session": session})

    def _ops(self, ident: bytes, header: dict) -> None:
        try:
            if header.get("snapshot"):
                self.runner.load_snapshot(header["ops"])
            else:
                for op in header["ops"]:
                    self.runner.apply(op)
            self.runner.record_generations(header.get("generations") or [])  # after the bytes moved
        except Exception as err:  # noqa: BLE001 - a refused op is reported; the next step will be refused too
            event(log, "ops.refused", logging.ERROR, stage=self.index, message=str(err))
            self._to_coord(ident, ERROR, {"message": f"ops refused: {err}", "version": self.runner.version})

    def _session_file(self, ident: bytes, kind: str, header: dict) -> None:
        """SAVE or LOAD one session file part; the answer (DONE) says whether it worked and why not."""
        from pool.snapshot import SnapshotError

        self._let_go()
        t0 = time.perf_counter()
        try:
            if kind == SAVE:
                nbytes = self.runner.save_session(header)
            else:
                nbytes = self.runner.restore_session(header)
            reply = {"ok": True, "nbytes": nbytes}
        except Exception as err:  # noqa: BLE001 - a refused or failed file is answered; the stage keeps serving
            level = logging.WARNING if isinstance(err, SnapshotError) else logging.ERROR
            event(log, "session_file.failed", level, stage=self.index, kind=kind, file=header.get("name"),
                  message=str(err))
            reply = {"ok": False, "message": str(err), "refused": isinstance(err, SnapshotError),
                     "errno": getattr(err, "errno", None)}
        ms = round((time.perf_counter() - t0) * 1000, 3)
        if reply["ok"]:
            event(log, "session_file.done", stage=self.index, kind=kind, file=header.get("name"),
                  check=bool(header.get("check")), nbytes=reply["nbytes"], ms=ms)
        self._to_coord(ident, DONE, {"req": header.get("req"), "stage": self.index, "ms": ms, **reply})

    def _step(self, ident: bytes, header: dict, tensors: list, epoch: int) -> None:
        """Run one step, whatever becomes of it; `last_step` (in PONG) then names it, so the coordinator can tell
        which stage holds a step that is overdue (coordinator/deadlines.py)."""
        try:
            self._run_step(ident, header, tensors, epoch)
        finally:
            self.stats["last_step"] = header.get("step")

    def _run_step(self, ident: bytes, header: dict, tensors: list, epoch: int) -> None:
        from .tensors import from_raw, to_raw

        sid = header.get("step")
        try:  # before waiting for the hidden state: a refused step must not wait for one
            self.runner.check_step(header)
        except Exception as err:  # noqa: BLE001
            self._failed(ident, sid, err)
            return
        hidden = None
        if self.has_prev:
            t0 = time.perf_counter()
            hidden_header, hidden_tensors, why = self._take(sid, epoch)
            self.stats["hidden_wait_s"] += time.perf_counter() - t0  # the pipeline's bubble, seen from here
            origin = self.index
            if why is None and hidden_header.get("error"):
                why = f"failed on an earlier stage: {hidden_header['error']}"
                origin = int(hidden_header.get("origin", self.index - 1))
            if why is not None:
                event(log, "step.dropped", logging.WARNING, stage=self.index, step=sid, why=why)
                self._pass_error(sid, why, origin)
                if not self.has_next:  # the coordinator waits for this step's answer: it gets the reason
                    self._to_coord(ident, ERROR, {"step": sid, "origin": origin,
                                                  "message": f"stage {self.index} dropped it: {why}"})
                    self._to_ring(sid, error=why)
                return
            hidden = from_raw(hidden_tensors[0])
        elif self.takes_samples and header.get("chain"):
            why = self._chain_samples(header, epoch)
            if why is not None:  # its requests ended with the step it names; nothing runs
                event(log, "step.dropped", logging.WARNING, stage=self.index, step=sid, why=why)
                self.stats["steps_refused"] += 1
                self._to_coord(ident, ERROR, {"step": sid, "refused": True,
                                              "message": f"stage {self.index} dropped it: {why}"})
                self._pass_error(sid, why)
                return
        tokens = from_raw(tensors[0]) if tensors else None
        rows = sum(int(entry[2]) for entry in header["slots"])
        if not self.baton.keeps(rows):
            self._let_go()
        self.stats["busy"] = True
        t0 = time.perf_counter()
        try:
            out = self.runner.step(header, tokens, hidden)
        except Exception as err:  # noqa: BLE001 - one bad step must not take the stage down
            self._failed(ident, sid, err)
            return
        finally:
            self.stats["busy"] = False
            self.stats["busy_s"] += time.perf_counter() - t0
            self._window_stats()
        self.baton.ran(rows, time.perf_counter() - t0)
        self.stats["steps_run"] += 1
        if self.has_next:
            self._to_next(encode(HIDDEN, {"step": sid, "box": self.hidden_token, "session": self.session}, [to_raw(out)]))
        else:
            self._to_ring(sid, rows=out)  # first: the first stage may be waiting for it
            self._to_coord(ident, RESULT, {"step": sid, "tokens": out})

    def _chain_samples(self, header: dict, epoch: int) -> str | None:
        """The first stage of a ring (pool/step_chain.py rule 6): wait for the last stage's SAMPLES of every step
        the chained rows name and record them for `Samples.fill`; None, or why one will never come."""
        t0 = time.perf_counter()
        try:
            for named in sorted({int(entry[1]) for entry in header["chain"]}):
                if named <= self.ring_taken:  # already recorded (Samples.fill checks each slot)
                    continue
                got, _, why = self._take(named, epoch)
                if why is None and got.get("error"):
                    why = f"it failed on the way: {got['error']}"
                if why is not None:
                    return f"the samples of step {named}, which it reads, will not come: {why}"
                self.runner.samples.record(named, got.get("rows") or [])
                self.ring_taken = named
            return None
        finally:
            self.stats["hidden_wait_s"] += time.perf_counter() - t0  # the ring's wait is the bubble too

    def _to_ring(self, sid: int, rows: list | None = None, error: str | None = None) -> None:
        """The last stage of a ring: what step `sid` sampled (or why it ended without samples), to the first."""
        if self.ring is None:
            return
        header = {"step": sid, "box": self.hidden_token, "session": self.session}
        if error is not None:
            header["error"] = error
        else:
            header["rows"] = [[int(row[0]), int(row[1])] for row in rows or []]
        try:
            self.ring.send_multipart(encode(SAMPLES, header), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            event(log, "samples.dropped", logging.WARNING, stage=self.index, why="first stage not connected")

    def _window_stats(self) -> None:
        """The window's sizes and counters as of now (None without a window), for the next PONG."""
        self.stats["kv_window"] = self.runner.window_stats()

    def _failed(self, ident: bytes, sid: int, err: Exception) -> None:
        """Report a refused or failed step to the coordinator and tell the next stage to drop it."""
        from .runner import StaleStep

        refused = isinstance(err, StaleStep)
        self.stats["steps_refused" if refused else "steps_failed"] += 1
        if refused:
            event(log, "step.refused", logging.WARNING, stage=self.index, step=sid, message=str(err))
        else:
            event(log, "step.failed", logging.ERROR, stage=self.index, step=sid, message=str(err),
                  exc=traceback.format_exc())
        self._to_coord(ident, ERROR, {"step": sid, "message": str(err), "refused": refused})
        self._pass_error(sid, str(err))
        if not self.has_next:
            self._to_ring(sid, error=str(err))

    def _pass_error(self, sid: int, message: str, origin: int | None = None) -> None:
        """Tell the next stage to drop step `sid`; `origin` is the stage where it failed (this one by default)."""
        if self.has_next:
            origin = self.index if origin is None else origin
            self._to_next(encode(HIDDEN, {"step": sid, "error": message, "origin": origin, "box": self.hidden_token,
                                            "session": self.session}))

    def _to_next(self, frames: list) -> None:
        try:
            self.push.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            event(log, "hidden.dropped", logging.WARNING, stage=self.index, why="next stage not connected")
