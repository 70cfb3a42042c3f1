"""`strata up`: the coordinator and every stage of a config as child processes of this one.

    strata up --config box.yaml [--set key=value ...]

Rules:
- The model is made ready once before any stage starts (`strata-stage --prepare` builds the embedded
  "tiny" checkpoint into the cache), so the stages do not race to build it.
- Every child runs in a session (process group) of its own: Ctrl-C in the terminal reaches only this
  supervisor, which then stops the children in order (coordinator first, then the stages) with SIGTERM,
  and SIGKILLs whatever is still there after a grace period. The whole group is signalled, so nothing a
  child started is left behind.
- A stage that dies is restarted after a short backoff (0.5 s, doubling up to 10 s; back to 0.5 s after it
  has run for a minute). The coordinator re-handshakes it on its own.
- If the coordinator exits, everything is shut down and its exit status is returned. So does a stage that
  exits with status 2 (its config or its endpoint is refused: a restart would fail the same way).
- A box whose stages are already up (an ipc endpoint's lock is held, pool/runtime.py) is refused before
  anything starts, naming the live stage's pid: nothing of the running box is touched.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from pathlib import Path

from pool.config import Config, ConfigError, load_config
from pool.runtime import RuntimeDirError, is_held

BACKOFF_MIN_S, BACKOFF_MAX_S, STABLE_S = 0.5, 10.0, 60.0
GRACE_S = 10.0
POLL_S = 0.2
FATAL_STATUS = 2  # a child refused its config or its endpoint: never restarted


def live_stages(cfg: Config) -> list[str]:
    """The ipc endpoints of `cfg` a live stage serves now (its lock is held), with the holder's pid."""
    out = []
    for i, s in enumerate(cfg.stages):
        for endpoint in [s.endpoint, *([s.data] if i else [])]:
            if endpoint.startswith("ipc://"):
                path = Path(endpoint[len("ipc://"):])
                pid = is_held(path.with_name(path.name + ".lock"))
                if pid is not None:
                    out.append(f"stage {i}'s {endpoint} (pid {pid or '?'})")
    return out


def stage_command(config_path: str, index: int, overrides: list[str]) -> list[str]:
    """argv of stage `index` (the same interpreter as this process)."""
    sets = [a for o in overrides for a in ("--set", o)]
    return [sys.executable, "-m", "stages.server", "--device", str(index), "--config", str(config_path), *sets]


def coordinator_command(config_path: str, overrides: list[str]) -> list[str]:
    sets = [a for o in overrides for a in ("--set", o)]
    return [sys.executable, "-m", "coordinator.cli", "coord", "--config", str(config_path), *sets]


@dataclass
class Child:
    """One supervised process and its restart state."""

    name: str
    argv: list[str]
    restart: bool
    proc: subprocess.Popen | None = None
    started: float = 0.0
    backoff: float = BACKOFF_MIN_S
    due: float = 0.0  # when a dead child may start again
    restarts: int = 0

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, start_new_session=True)
        self.started = time.monotonic()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


class Supervisor:
    """Starts children, restarts the ones marked `restart` when they die, stops them all on request."""

    def __init__(self, log: Callable[[str], object] = print) -> None:
        self.children: list[Child] = []
        self.stopping = False
        self.log = log

    def add(self, name: str, argv: list[str], restart: bool) -> Child:
        child = Child(name, argv, restart)
        self.children.append(child)
        child.start()
        return child

    def poll(self) -> Child | None:
        """One supervision pass: restart what is due; return a non-restartable child that has exited."""
        now = time.monotonic()
        for c in self.children:
            if c.proc is None:
                if now >= c.due:
                    c.restarts += 1
                    self.log(f"strata: restarting {c.name} (restart {c.restarts})")
                    c.start()
                continue
            code = c.proc.poll()
            if code is None:
                continue
            if not c.restart or code == FATAL_STATUS:
                return c
            if now - c.started > STABLE_S:
                c.backoff = BACKOFF_MIN_S
            self.log(f"strata: {c.name} exited with status {code}; restarting in {c.backoff:g} s")
            c.proc, c.due = None, now + c.backoff
            c.backoff = min(c.backoff * 2, BACKOFF_MAX_S)
        return None

    def stop_all(self, grace: float = GRACE_S) -> None:
        """SIGTERM the first child (the coordinator) and wait for it, then the rest together; SIGKILL stragglers."""
        self.stopping = True
        groups = [self.children[:1], self.children[1:]]
        for group in groups:
            for c in group:
                c.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for c in group:
                if c.proc is None:
                    continue
                try:
                    c.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.log(f"strata: {c.name} did not stop in {grace:g} s; killing it")
                    c.signal(signal.SIGKILL)
                    c.proc.wait()


def up(config_path: str, overrides: list[str]) -> int:
    """Run a whole box from one config until Ctrl-C/SIGTERM (0) or until the coordinator exits (its status)."""
    try:
        cfg = load_config(config_path, overrides)
    except ConfigError as err:
        print(f"strata: {err}", file=sys.stderr)
        return 2
    try:
        busy = live_stages(cfg)
    except RuntimeDirError as err:
        print(f"strata: {err}", file=sys.stderr)
        return FATAL_STATUS
    if busy:
        print(f"strata: this box is already up: {', '.join(busy)} served by a live stage; stop it first",
              file=sys.stderr)
        return FATAL_STATUS
    prepare = stage_command(config_path, 0, overrides) + ["--prepare"]
    if subprocess.run(prepare, stdout=subprocess.DEVNULL).returncode != 0:
        print(f"strata: the model {cfg.model!r} could not be prepared", file=sys.stderr)
        return 1
    stop = {"sig": None}

    def on_signal(sig: int, _frame: object) -> None:
        stop["sig"] = sig

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    sup = Supervisor()
    status = 0
    try:
        coord = sup.add("coordinator", coordinator_command(config_path, overrides), restart=False)
        for i, s in enumerate(cfg.stages):
            sup.add(f"stage {i} (layers [{s.layers[0]}, {s.layers[1]}) on {s.device})",
                    stage_command(config_path, i, overrides), restart=True)
        c = cfg.coordinator
        print(f"strata: serving http://{c.host}:{c.port}/v1 (model {cfg.model}, {len(cfg.stages)} stages, "
              f"pids: coordinator {coord.proc.pid}, stages {' '.join(str(ch.proc.pid) for ch in sup.children[1:])})",
              flush=True)
        while stop["sig"] is None:
            ended = sup.poll()
            if ended is not None:
                status = ended.proc.returncode or 0
                print(f"strata: {ended.name} exited with status {status}; stopping the box", file=sys.stderr)
                break
            time.sleep(POLL_S)
    finally:
        sup.stop_all()
        for s, handler in old.items():
            signal.signal(s, handler)
    return status
