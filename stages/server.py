"""The strata-stage process: one layer range of the model behind ZeroMQ sockets.

    strata-stage --device N --config box.yaml [--set key=value ...]     (N indexes `stages:`)

Shape: bind, build, handshake, loop. Two threads, so a PING is answered while a step computes:

    I/O thread (main; ROUTER and PULL)                        compute thread (the StageRunner, PUSH)
    ROUTER  endpoint   <- coordinator: HELLO OPS STEP      ──queue (in order)──>  hello / apply / step /
                                       SAVE LOAD BYE                              save / load session files
                       -> HELLO RESULT ERROR DONE PONG     <──inproc PAIR──────   (destination, frames)
                       <- PING, answered here with PONG at once
    PULL    data       <- HIDDEN from stage i-1  ──> _Hidden (keyed by step) ──>  the step that needs it
                                                                PUSH next data -> HIDDEN to stage i+1
The compute thread owns the PUSH socket (no other thread touches it): a step's hidden states leave as soon
as they are computed, without a hop through the I/O thread.

Rules:
- Everything from the coordinator except PING goes through one queue, so ops and steps run in the order
  they were sent: a step's table version is checked against a mirror that has seen every earlier op. SAVE and
  LOAD (session files) take the same queue, so a SAVE reads exactly the cells the steps before it wrote; each
  is answered with DONE {req, stage, ok, message, nbytes, ms}, whether it worked or not.
- A step on stage i > 0 waits for the HIDDEN with its step id. Hidden states come in step order from
  stage i-1; one for a later step means this one will never come (stage i-1 refused it, or restarted),
  so the step is dropped. A refused or failed step sends HIDDEN {"step", "error"} on, so later stages
  drop it too rather than wait; only the stage where it failed reports ERROR {step, message}.
- An exception in a step is reported (ERROR) and the stage keeps serving. A failure to build (bad
  checkpoint, layer range outside the model) is fatal: ERROR {"fatal": true} to the coordinator (waiting a
  few seconds for it to connect if it has not), then exit status 1.
- A HELLO with a new session (a restarted coordinator) resets the tables (and the pool file's generations,
  unless they are that session's: then this is a restarted stage rejoining). Every HELLO also drops the
  steps, SAVEs and LOADs that came before it, queued or waiting for a hidden state: the coordinator sends
  HELLO only at start or after failing every step in flight on this stage, so none of them has anyone
  waiting.
- SIGTERM or SIGINT ends the loop cleanly: the compute thread stops, sockets close, bound ipc socket files
  and the pool file are removed. A crash leaves the pool file for the restarted stage to re-attach.
- Stale ipc socket files (a crashed stage's) are removed before binding.
"""
from __future__ import annotations

import argparse
import logging
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from pool.config import Config, ConfigError, load_config
from pool.logs import event, setup_logging
from pool.wire import (BYE, DONE, ERROR, HELLO, HIDDEN, LOAD, OPS, PING, PONG, RESULT, SAVE, STEP, WireError, decode,
                       encode)

log = logging.getLogger("strata.stage")

FATAL_GRACE_S = 5.0  # how long a stage that failed to build waits for a coordinator to tell


class _Hidden:
    """Hidden states from the previous stage, by step id, handed from the I/O thread to the compute thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: dict[int, tuple[dict, list]] = {}
        self._epoch = 0
        self.closed = False

    def put(self, step: int, header: dict, tensors: list) -> None:
        with self._cond:
            self._items[step] = (header, tensors)
            self._cond.notify_all()

    @property
    def epoch(self) -> int:
        return self._epoch

    def abandon(self) -> None:
        """Make every step queued or waiting so far give up (a HELLO came, or shutdown)."""
        with self._cond:
            self._epoch += 1
            self._cond.notify_all()

    def take(self, step: int, epoch: int) -> tuple[dict | None, list, str | None]:
        """(header, tensors, None) for `step` (queued in `epoch`), or (None, [], why) when it will never come."""
        with self._cond:
            while True:
                if step in self._items:
                    header, tensors = self._items.pop(step)
                    for old in [s for s in self._items if s < step]:
                        del self._items[old]
                    return header, tensors, None
                if any(s > step for s in self._items):
                    return None, [], "the previous stage moved on to a later step (it restarted or dropped this one)"
                if self.closed or self._epoch != epoch:
                    return None, [], "abandoned: the coordinator reconnected"
                self._cond.wait(0.5)


class _Compute(threading.Thread):
    """Builds the runner, then runs queued HELLO/OPS/STEP items in order; sends results over inproc."""

    def __init__(self, build: Callable[[], Any], ctx: zmq.Context, index: int, n_stages: int,
                 next_data: str | None = None) -> None:
        super().__init__(name="stage-compute", daemon=True)
        self.build = build
        self.ctx = ctx
        self.index = index
        self.has_prev = index > 0
        self.has_next = index < n_stages - 1
        self.next_data = next_data  # the next stage's data endpoint (PUSH from this thread)
        self.items: queue.Queue = queue.Queue()
        self.hidden = _Hidden()
        self.runner: Any = None
        self.session: str | None = None
        self.stats = {"steps_run": 0, "steps_refused": 0, "steps_failed": 0, "busy": False}

    def run(self) -> None:
        out = self.ctx.socket(zmq.PAIR)
        out.connect("inproc://stage-results")
        self.out = out
        self.push = None
        if self.has_next:
            self.push = self.ctx.socket(zmq.PUSH)
            for opt in (zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM):
                self.push.setsockopt(opt, 0)
            self.push.connect(self.next_data)
        try:
            self.runner = self.build()
        except Exception as err:  # noqa: BLE001 - any failure to build is reported to the peer, then fatal
            event(log, "stage.build_failed", logging.ERROR, stage=self.index, message=str(err))
            out.send_multipart([b"F", str(err).encode()])
            out.close(linger=-1)
            return
        out.send_multipart([b"R"])
        try:
            while (item := self.items.get()) is not None:
                kind, ident, header, tensors, epoch = item
                if kind == HELLO:
                    self._hello(ident, header)
                elif kind == OPS:
                    self._ops(ident, header)
                elif kind in (STEP, SAVE, LOAD) and epoch != self.hidden.epoch:
                    event(log, "step.dropped", stage=self.index, step=header.get("step", header.get("req")),
                          kind=kind, why="sent before a HELLO")
                elif kind == STEP:
                    self._step(ident, header, tensors, epoch)
                elif kind in (SAVE, LOAD):
                    self._session_file(ident, kind, header)
        except Exception as err:  # noqa: BLE001 - steps catch their own errors; this is a bug: fatal, not silent
            event(log, "stage.compute_failed", logging.ERROR, stage=self.index, message=str(err),
                  exc=traceback.format_exc())
            out.send_multipart([b"F", f"compute thread failed: {err}".encode()])
        finally:
            out.close(linger=-1)

    def _to_coord(self, ident: bytes, kind: str, header: dict, tensors: list = ()) -> None:
        self.out.send_multipart([b"C", ident, *encode(kind, header, tensors)], copy=False)

    def _hello(self, ident: bytes, header: dict) -> None:
        session = header.get("session")
        if session != self.session:
            self.runner.reset(session)
            event(log, "stage.session", stage=self.index, session=session, previous=self.session,
                  generations=sum(1 for g in self.runner.hello()["generations"] or [] if g))
            self.session = session
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
            reply = {"ok": False, "message": str(err), "refused": isinstance(err, SnapshotError)}
        ms = round((time.perf_counter() - t0) * 1000, 3)
        if reply["ok"]:
            event(log, "session_file.done", stage=self.index, kind=kind, file=header.get("name"),
                  check=bool(header.get("check")), nbytes=reply["nbytes"], ms=ms)
        self._to_coord(ident, DONE, {"req": header.get("req"), "stage": self.index, "ms": ms, **reply})

    def _step(self, ident: bytes, header: dict, tensors: list, epoch: int) -> None:
        from .tensors import from_raw, to_raw

        sid = header.get("step")
        try:  # before waiting for the hidden state: a refused step must not wait for one
            self.runner.check_step(header)
        except Exception as err:  # noqa: BLE001
            self._failed(ident, sid, err)
            return
        hidden = None
        if self.has_prev:
            hidden_header, hidden_tensors, why = self.hidden.take(sid, epoch)
            if why is None and hidden_header.get("error"):
                why = f"failed on an earlier stage: {hidden_header['error']}"
            if why is not None:
                event(log, "step.dropped", logging.WARNING, stage=self.index, step=sid, why=why)
                self._pass_error(sid, why)
                return
            hidden = from_raw(hidden_tensors[0])
        tokens = from_raw(tensors[0]) if tensors else None
        self.stats["busy"] = True
        try:
            out = self.runner.step(header, tokens, hidden)
        except Exception as err:  # noqa: BLE001 - one bad step must not take the stage down
            self._failed(ident, sid, err)
            return
        finally:
            self.stats["busy"] = False
        self.stats["steps_run"] += 1
        if self.has_next:
            self._to_next(encode(HIDDEN, {"step": sid}, [to_raw(out)]))
        else:
            self._to_coord(ident, RESULT, {"step": sid, "tokens": out})

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

    def _pass_error(self, sid: int, message: str) -> None:
        if self.has_next:
            self._to_next(encode(HIDDEN, {"step": sid, "error": message}))

    def _to_next(self, frames: list) -> None:
        try:
            self.push.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            event(log, "hidden.dropped", logging.WARNING, stage=self.index, why="next stage not connected")


def _bind(sock: zmq.Socket, endpoint: str, bound: list[Path]) -> None:
    if endpoint.startswith("ipc://"):
        path = Path(endpoint[len("ipc://"):])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # a crashed stage's socket file; connecting to it would hang
        bound.append(path)
    sock.bind(endpoint)


class StageServer:
    """The I/O side of one stage: sockets, the poll loop, and the compute thread it feeds."""

    def __init__(self, cfg: Config, index: int, build: Callable[[], Any]) -> None:
        self.cfg = cfg
        self.index = index
        self.stop = threading.Event()
        self.ctx = zmq.Context()
        self.bound: list[Path] = []
        stage = cfg.stages[index]
        # No high-water marks: a send never blocks the I/O thread nor drops a frame; a peer that stops
        # reading is the link's to detect (heartbeat), not this loop's.
        self.router = self._socket(zmq.ROUTER)
        self.results = self.ctx.socket(zmq.PAIR)
        self.results.bind("inproc://stage-results")
        self.pull = self._socket(zmq.PULL) if index > 0 else None
        _bind(self.router, stage.endpoint, self.bound)
        if self.pull is not None:
            _bind(self.pull, stage.data, self.bound)
        next_data = cfg.stages[index + 1].data if index < len(cfg.stages) - 1 else None
        self.compute = _Compute(build, self.ctx, index, len(cfg.stages), next_data)
        self.peer: bytes | None = None  # the coordinator's identity, once it has said anything
        self.fatal: str | None = None
        self.ready = False

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        for opt in (zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM):
            sock.setsockopt(opt, 0)
        return sock

    def serve(self) -> int:
        """Run until SIGTERM (0) or a fatal build error (1)."""
        self.compute.start()
        poller = zmq.Poller()
        for s in (self.router, self.results, self.pull):
            if s is not None:
                poller.register(s, zmq.POLLIN)
        fatal_since = 0.0
        while not self.stop.is_set():
            events = dict(poller.poll(100))
            if self.results in events:
                self._from_compute()
            if self.router in events:
                self._from_coord()
            if self.pull is not None and self.pull in events:
                self._from_prev()
            if self.fatal is not None:
                fatal_since = fatal_since or time.monotonic()
                if self.peer is not None or time.monotonic() - fatal_since > FATAL_GRACE_S:
                    if self.peer is not None:
                        self.router.send_multipart([self.peer, *encode(ERROR, {"fatal": True, "message": self.fatal})])
                        time.sleep(0.2)  # let the ERROR leave before the sockets close
                    return 1
        return 0

    def _from_compute(self) -> None:
        while True:
            try:
                frames = self.results.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            dest = frames[0].bytes
            if dest == b"C":
                self.router.send_multipart(frames[1:], copy=False)
            elif dest == b"R":
                self.ready = True
                event(log, "stage.ready", stage=self.index, detail=self.compute.runner.describe())
            elif dest == b"F":
                self.fatal = frames[1].bytes.decode()

    def _from_coord(self) -> None:
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = frames[0].bytes
            self.peer = ident
            try:
                kind, header, tensors = decode(frames[1:])
            except WireError as err:
                self.router.send_multipart([ident, *encode(ERROR, {"message": f"malformed message: {err}"})])
                continue
            if kind == PING:
                runner = self.compute.runner
                pong = {"version": runner.version if runner is not None else None, "ready": self.ready,
                        **self.compute.stats}
                self.router.send_multipart([ident, *encode(PONG, pong)])
            elif kind == BYE:
                event(log, "stage.bye", stage=self.index, session=header.get("session"))
            elif kind in (HELLO, OPS, STEP, SAVE, LOAD):
                if kind == HELLO:  # the coordinator has given up on every step it sent before
                    self.compute.hidden.abandon()
                if self.fatal is None:
                    self.compute.items.put((kind, ident, header, tensors, self.compute.hidden.epoch))
            else:
                self.router.send_multipart([ident, *encode(ERROR, {"message": f"a stage does not take {kind}"})])

    def _from_prev(self) -> None:
        while True:
            try:
                frames = self.pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                kind, header, tensors = decode(frames)
                if kind != HIDDEN or not isinstance(header.get("step"), int):
                    raise WireError(f"expected HIDDEN with a step id, got {kind}")
            except WireError as err:
                event(log, "hidden.malformed", logging.WARNING, stage=self.index, message=str(err))
                continue
            self.compute.hidden.put(header["step"], header, tensors)

    def close(self) -> None:
        """Stop the compute thread, close the sockets, remove bound ipc files."""
        self.compute.items.put(None)
        self.compute.hidden.closed = True
        self.compute.hidden.abandon()
        if self.compute.is_alive():
            self.compute.join(timeout=10)
        if self.compute.runner is not None and not self.compute.is_alive():
            self.compute.runner.close()
        self.ctx.destroy(linger=0)
        for path in self.bound:
            path.unlink(missing_ok=True)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="strata-stage", description="Strata stage: one layer range of the model")
    p.add_argument("--device", type=int, required=True, metavar="N", help="which entry of `stages:` to serve")
    p.add_argument("--config", default=None, help="box YAML (default: the embedded cpu-tiny config)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set engine.kv_pool_tokens=8192")
    p.add_argument("--pool-path", default=None, help="pool file (default: /dev/shm/strata-<config>-stage<N>)")
    p.add_argument("--prepare", action="store_true",
                   help="only make sure the model exists (builds the embedded 'tiny' model), then exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `strata-stage`; the exit status is 0 after SIGTERM, 1 after a fatal error, 2 on bad args."""
    args = _parse_args(argv)
    setup_logging(f"stage{args.device}")
    try:
        from pool.config import default_config_path

        cfg = load_config(args.config or default_config_path(), args.overrides)
        if not 0 <= args.device < len(cfg.stages):
            raise ConfigError(f"--device {args.device}: the config has {len(cfg.stages)} stages (0..{len(cfg.stages) - 1})")
    except ConfigError as err:
        print(f"strata-stage: {err}", file=sys.stderr)
        return 2
    from .runner import StageRunner, resolve_model_dir

    if args.prepare:
        print(resolve_model_dir(cfg.model))
        return 0
    server = StageServer(cfg, args.device, lambda: StageRunner(cfg, args.device, pool_path=args.pool_path))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop.set())
    try:
        return server.serve()
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(main())
