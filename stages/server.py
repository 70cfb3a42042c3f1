"""The strata-stage process: one layer range of the model behind ZeroMQ sockets.

    strata-stage --device N --config box.yaml [--set key=value ...]     (N indexes `stages:`)

Shape: bind, build, handshake, loop. Two threads, so a PING is answered while a step computes; the ROUTER and the
PULL are read by one of them at a time, the holder of the baton (stages/baton.py): the compute thread while it waits
for work or runs a step expected to end within a tenth of `stage_timeout_ms`, the I/O thread otherwise. As the
I/O thread reads them:

    I/O thread (main; ROUTER and PULL)                        compute thread (the StageRunner, PUSH)
    ROUTER  endpoint   <- coordinator: HELLO OPS STEP      ──queue (in order)──>  hello / apply / step /
                                       SAVE LOAD BYE                              save / load session files
                       -> HELLO RESULT ERROR DONE PONG     <──inproc PAIR──────   (destination, frames)
                       <- PING, answered here with PONG at once
    PULL    data       <- HIDDEN from stage i-1  ──> Hidden (keyed by step) ──>  the step that needs it
                                                                PUSH next data -> HIDDEN to stage i+1
                       <- SAMPLES from the last stage (stage 0, chained steps: pool/step_chain.py rule 6)
                                                                PUSH stage 0's data -> SAMPLES (the last stage)
The compute thread owns the PUSH sockets (no other thread touches them): a step's hidden states leave as soon
as they are computed, without a hop through the I/O thread.

Rules:
- Everything from the coordinator except PING goes through one queue, so ops and steps run in the order
  they were sent: a step's table version is checked against a mirror that has seen every earlier op. SAVE and
  LOAD (session files) take the same queue, so a SAVE reads exactly the cells the steps before it wrote; each
  is answered with DONE {req, stage, ok, message, nbytes, ms}, whether it worked or not.
- A step on stage i > 0 waits for the HIDDEN with its step id and its coordinator's session (a HIDDEN of an
  earlier session, computed while a new coordinator said HELLO, is dropped: its step id means nothing now). Hidden states come in step order from
  stage i-1; one for a later step means this one will never come (stage i-1 refused it, or restarted),
  so the step is dropped. A refused or failed step sends HIDDEN {"step", "error"} on, so later stages
  drop it too rather than wait; only the stage where it failed reports ERROR {step, message}.
- Stage 0 of a box with chained steps (pool/step_chain.py rule 6) waits the same way, before a chained step, for
  the last stage's SAMPLES of the step it names; the last stage sends SAMPLES for every step it ends.
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
- A stage holds `<socket>.lock` beside each ipc socket it binds (pool/runtime.py), in a private directory: a
  second stage for a live stage's endpoint exits at once (status 2) without touching its socket or its pool
  file; a stale socket file (a crashed stage's, whose lock the kernel dropped) is removed before binding.
  The pool file has its own lock (stages/runner.py), for a second stage started with `--pool-path`.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import zmq

from pool.config import Config, ConfigError, load_config
from pool.curve import authenticator, load_keys, serve_on
from pool.runtime import Hold, InUse, RuntimeDirError, box_key, hold, private_dir, same_token
from pool.logs import event, setup_logging

from .baton import Baton
from .compute import Compute
from .ownership import Ownership
from pool import pipeline, step_chain
from pool.wire import (BYE, ERROR, HELLO, HIDDEN, LOAD, OPS, PING, PONG, SAMPLES, SAVE, STEP, WireError, decode,
                       encode)

log = logging.getLogger("strata.stage")

FATAL_GRACE_S = 5.0  # how long a stage that failed to build waits for a coordinator to tell


class EndpointBusy(RuntimeError):
    """An endpoint this stage should bind is another live process's (or not private); nothing was touched."""


def _bind(sock: zmq.Socket, endpoint: str, bound: list[Path], locks: list[Hold], what: str) -> None:
    """Bind `endpoint`. ipc: its directory must be private, and `<path>.lock` is held for the stage's life, so a
    second stage for the same endpoint fails here (EndpointBusy) before touching the live one's socket file; only
    a socket file nobody holds (a crashed stage's) is removed. tcp: an address in use is EndpointBusy too."""
    if endpoint.startswith("ipc://"):
        path = Path(endpoint[len("ipc://"):])
        try:
            private_dir(path.parent)
            locks.append(hold(path.with_name(path.name + ".lock"), f"{what} {endpoint}"))
        except (InUse, RuntimeDirError) as err:
            raise EndpointBusy(str(err)) from None
        path.unlink(missing_ok=True)  # a crashed stage's socket file; connecting to it would hang
        bound.append(path)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as err:
        raise EndpointBusy(f"{what} {endpoint} cannot be bound: {err}") from None


class StageServer:
    """The I/O side of one stage: sockets, the poll loop, and the compute thread it feeds."""

    def __init__(self, cfg: Config, index: int, build: Callable[[], Any]) -> None:
        self.cfg = cfg
        self.index = index
        self.stop = threading.Event()
        self.owners = Ownership(box_key(cfg.box.resolved_key_file), index, cfg.coordinator.stage_timeout_ms / 1000)
        self.curve = load_keys(cfg.box.curve_dir) if cfg.box.curve_dir else None
        self.ctx = zmq.Context()
        self.bound: list[Path] = []
        self.locks: list[Hold] = []
        stage = cfg.stages[index]
        # No high-water marks: a send never blocks the I/O thread nor drops a frame; a peer that stops
        # reading is the link's to detect (heartbeat), not this loop's.
        self.auth = authenticator(self.ctx, self.curve)  # ZAP: only the box's client key gets in (pool/curve.py)
        self.router = self._socket(zmq.ROUTER)
        self.results = self.ctx.socket(zmq.PAIR)
        self.results.bind("inproc://stage-results")
        self.ring = step_chain.ring(cfg)  # stage 0 takes the last stage's samples (pool/step_chain.py rule 6)
        self.pull = self._socket(zmq.PULL) if index > 0 or self.ring else None
        for sock in (self.router, self.pull):
            if sock is not None:
                serve_on(sock, self.curve)
        try:
            _bind(self.router, stage.endpoint, self.bound, self.locks, f"stage {index}'s endpoint")
            if self.pull is not None:
                _bind(self.pull, stage.data, self.bound, self.locks, f"stage {index}'s data endpoint")
        except EndpointBusy:
            self._release()
            raise
        last = index == len(cfg.stages) - 1
        next_data = cfg.stages[index + 1].data if not last else None
        ring_data = cfg.stages[0].data if self.ring and last else None
        self.baton = Baton(cfg.coordinator.stage_timeout_ms / 1000 / 10)
        self.compute = Compute(build, self.ctx, index, len(cfg.stages), baton=self.baton, read=self._read,
                               send=lambda frames: self.router.send_multipart(frames, copy=False),
                               next_data=next_data, hidden_token=self.owners.hidden_token, curve=self.curve,
                               ring_data=ring_data, takes_samples=self.ring and index == 0)
        self._compute_poller = zmq.Poller()  # the compute thread's, while it holds the baton
        for sock in (self.router, self.pull):
            if sock is not None:
                self._compute_poller.register(sock, zmq.POLLIN)
        self.peer: bytes | None = None  # the coordinator's identity, once its HELLO was accepted
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
            if self.baton.compute_holds:  # it reads the sockets now; it gives them back before long work
                self.baton.wait(for_compute=False, timeout=0.1)
                continue
            events = dict(poller.poll(100))
            if self.results in events and not self._from_compute():
                continue  # the baton went to the compute thread: the sockets are its own now
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

    def _from_compute(self) -> bool:
        """Forward the compute thread's answers; False once it asked for the baton back (then given)."""
        for frames in _waiting(self.results):
            dest = frames[0].bytes
            if dest == b"C":
                self.router.send_multipart(frames[1:], copy=False)
            elif dest == b"R":
                self.ready = True
                event(log, "stage.ready", stage=self.index, detail=self.compute.runner.describe())
            elif dest == b"F":
                self.fatal = frames[1].bytes.decode()
            elif dest == b"B":  # after every answer before it (baton rule 4); nothing follows it on the pair
                self.baton.give(to_compute=True)
                return False
        return True

    def _read(self, timeout_ms: int) -> None:
        """The compute thread, holding the baton: wait up to `timeout_ms` for the ROUTER or the PULL, and take in
        what came as the I/O thread would (a PING answered, the rest queued or kept for the step that needs it)."""
        events = dict(self._compute_poller.poll(timeout_ms))
        if self.router in events:
            self._from_coord()
        if self.pull in events:
            self._from_prev()

    def _from_coord(self) -> None:
        for frames in _waiting(self.router):
            ident = frames[0].bytes
            try:
                kind, header, tensors = decode(frames[1:])
            except WireError as err:
                event(log, "coord.malformed", logging.WARNING, stage=self.index, message=str(err))
                if ident == self.owner:
                    self.router.send_multipart([ident, *encode(ERROR, {"message": f"malformed message: {err}"})])
                continue
            if kind == HELLO:
                refusal = self.owners.hello(ident, header, time.monotonic())
                if refusal is not None:
                    self.router.send_multipart([ident, *encode(ERROR, refusal)])
                    continue
                self.peer = ident
            elif not self.owners.heard(ident, time.monotonic()):
                event(log, "coord.refused", logging.WARNING, stage=self.index, kind=kind,
                      reason="not from the coordinator this stage serves (no accepted HELLO)")
                continue  # a peer that has not proved it is this box's coordinator gets nothing
            if kind == PING:
                runner = self.compute.runner
                pong = {"version": runner.version if runner is not None else None, "ready": self.ready,
                        **self.compute.stats, "baton_passes": self.baton.passes}
                self.router.send_multipart([ident, *encode(PONG, pong)])
            elif kind == BYE:
                event(log, "stage.bye", stage=self.index, session=header.get("session"))
                self.owners.bye(ident)
            elif kind in (HELLO, OPS, STEP, SAVE, LOAD):
                if kind == HELLO:  # the coordinator has given up on every step it sent before
                    self.compute.hidden.abandon()
                if self.fatal is None:
                    self.compute.items.put((kind, ident, header, tensors, self.compute.hidden.epoch))
            else:
                self.router.send_multipart([ident, *encode(ERROR, {"message": f"a stage does not take {kind}"})])

    @property
    def owner(self) -> bytes | None:
        return self.owners.ident

    def _from_prev(self) -> None:
        """HIDDEN from the stage before; on stage 0, SAMPLES from the last stage. Both wait, keyed by step id, for
        the step that needs them (Compute.hidden), and only when they carry the box token and this session."""
        want = HIDDEN if self.index > 0 else SAMPLES
        for frames in _waiting(self.pull):
            try:
                kind, header, tensors = decode(frames)
                if kind != want or not isinstance(header.get("step"), int):
                    raise WireError(f"expected {want} with a step id, got {kind}")
            except WireError as err:
                event(log, "hidden.malformed", logging.WARNING, stage=self.index, message=str(err))
                continue
            if not same_token(header.get("box"), self.owners.hidden_token):
                event(log, "hidden.refused", logging.WARNING, stage=self.index, step=header["step"], kind=kind,
                      reason="not from a stage of this box (box token)")
                continue
            if header.get("session") != self.owners.session:  # a step of a coordinator this stage left behind
                event(log, "hidden.stale", stage=self.index, step=header["step"], session=header.get("session"))
                continue
            self.compute.hidden.put(header["step"], header, tensors)

    def close(self) -> None:
        """Stop the compute thread, close the sockets, remove bound ipc files."""
        self.compute.items.put(None)
        self.compute.stopping = True
        self.compute.hidden.closed = True
        self.compute.hidden.abandon()
        if self.compute.is_alive():
            self.compute.join(timeout=10)
        if self.compute.runner is not None and not self.compute.is_alive():
            self.compute.runner.close()
        self._release()

    def _release(self) -> None:
        """Close the sockets, remove the ipc files this stage bound, then drop their locks."""
        if self.auth is not None:
            self.auth.stop()
        self.ctx.destroy(linger=0)
        for path in self.bound:  # only what this stage bound, while it still holds the locks
            path.unlink(missing_ok=True)
        for lock in self.locks:
            lock.release()
        self.bound, self.locks = [], []


def _waiting(sock: zmq.Socket) -> Iterator[list]:
    """The multipart messages already waiting on `sock`, received without blocking (copy=False frames)."""
    while True:
        try:
            yield sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="strata-stage", description="Strata stage: one layer range of the model")
    p.add_argument("--device", type=int, required=True, metavar="N", help="which entry of `stages:` to serve")
    p.add_argument("--config", default=None, help="box YAML (default: the embedded cpu-tiny config)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set engine.kv_pool_tokens=8192")
    p.add_argument("--pool-path", default=None, help="pool file (default: /dev/shm/strata-<uid>/strata-<config>-stage<N>)")
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
    os.environ.update(pipeline.spin_env(cfg, args.device, os.environ))  # before torch loads OpenMP
    from .runner import StageRunner, resolve_model_dir

    if args.prepare:
        print(resolve_model_dir(cfg.model))
        return 0
    try:
        server = StageServer(cfg, args.device, lambda: StageRunner(cfg, args.device, pool_path=args.pool_path))
    except EndpointBusy as err:
        print(f"strata-stage: {err}; nothing was changed there", file=sys.stderr)
        return 2
    except (RuntimeDirError, ValueError, OSError) as err:  # the box key or the CURVE keys
        print(f"strata-stage: {err}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop.set())
    try:
        return server.serve()
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(main())
