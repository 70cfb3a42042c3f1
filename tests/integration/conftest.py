"""Real stage processes for integration tests, and a minimal driver that plays the scheduler's part.

- `box(n_stages, pool=True, transport="ipc", **engine)` writes a YAML config into a short temp dir (ipc
  socket paths are limited to 107 bytes) and returns a `Box`: `.start(i, *overrides)` starts stage i as
  `python -m stages.server`, `.kill(i)` SIGKILLs it, `.link()` makes a StageLink on the box's config. Every
  process is stopped by the fixture's finalizer (SIGTERM, then SIGKILL), so a failing test leaves no orphans.
- `Driver` keeps the authoritative ChunkMap/StaticMap and sends its ops before each step, the way the
  scheduler does: reserve cells, `send_ops(map.drain_ops())`, then the step with `version = map.version`.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from coordinator.link import StageLink
from pool.chunk_map import ChunkMap, StaticMap
from pool.config import Config, load_config

ROOT = Path(__file__).resolve().parents[2]
GREEDY = {"temperature": 0.0}


def free_port_pair() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 (a stage binds its endpoint and endpoint + 1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


def split(n_layers: int, n_stages: int) -> list[list[int]]:
    """Layer ranges for n stages; uneven on purpose (3 stages of 4 layers: [0,1) [1,3) [3,4))."""
    if n_stages == 1:
        return [[0, n_layers]]
    if n_stages == 2:
        return [[0, n_layers // 2], [n_layers // 2, n_layers]]
    assert n_stages == 3 and n_layers == 4
    return [[0, 1], [1, 3], [3, 4]]


class Box:
    """One config file and the stage processes started from it."""

    def __init__(self, root: Path, model: Path, n_stages: int, pool: bool, transport: str, engine: dict) -> None:
        self.root = root
        self.n_layers = 4
        stages = []
        for i, layers in enumerate(split(self.n_layers, n_stages)):
            if transport == "ipc":
                endpoint = f"ipc://{root}/s{i}"
            else:
                endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
            stages.append({"device": "cpu", "layers": layers, "endpoint": endpoint})
        eng = {"max_context": 64, "parallel": 4, "chunk_cells": 16, "threads": 1, "prefill_chunk": 64,
               "kv_pool_tokens": 192 if pool else 0, **engine}
        self.data = {"model": str(model), "engine": eng, "stages": stages,
                     "coordinator": {"heartbeat_ms": 100, "stage_timeout_ms": 1500}}
        self.path = root / "box.yaml"
        self.rewrite()
        self.procs: dict[int, subprocess.Popen] = {}
        self.links: list[StageLink] = []

    def rewrite(self, **changes: object) -> None:
        """Replace top-level keys of this box's own config (before its stages start)."""
        self.data.update(changes)
        self.path.write_text(yaml.safe_dump(self.data))
        self.cfg = load_config(self.path)

    def write_variant(self, name: str, **changes: object) -> Path:
        """Another config file: this one with top-level keys replaced (e.g. stages=[...])."""
        path = self.root / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**self.data, **changes}))
        return path

    def start(self, i: int, *overrides: str, config: Path | None = None) -> subprocess.Popen:
        sets = [a for o in overrides for a in ("--set", o)]
        log = open(self.root / f"stage{i}.log", "ab")
        argv = [sys.executable, "-m", "stages.server", "--device", str(i), "--config", str(config or self.path),
                "--pool-path", str(self.root / f"pool{i}"), *sets]
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        log.close()
        self.procs[i] = proc
        return proc

    def start_all(self) -> None:
        for i in range(len(self.cfg.stages)):
            self.start(i)

    def kill(self, i: int) -> None:
        """SIGKILL stage i (a crash: no goodbye, the pool file stays)."""
        proc = self.procs.pop(i)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def link(self, cfg: Config | None = None) -> StageLink:
        link = StageLink(cfg or self.cfg)
        self.links.append(link)
        return link

    def driver(self, link: StageLink) -> "Driver":
        return Driver(link, self.cfg)

    def log(self, i: int) -> str:
        path = self.root / f"stage{i}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


@pytest.fixture
def box(tiny_model_factory):
    """box(n_stages, pool=True, transport="ipc", **engine) -> Box; all processes stopped afterwards."""
    made: list[Box] = []
    model = tiny_model_factory("qwen3", layers=4, hidden=64, heads=4, kv_heads=2, seed=3)

    def make(n_stages: int, pool: bool = True, transport: str = "ipc", **engine: object) -> Box:
        root = Path(tempfile.mkdtemp(prefix="st", dir="/tmp"))
        b = Box(root, model, n_stages, pool, transport, dict(engine))
        made.append(b)
        return b

    yield make
    for b in made:
        for link in b.links:
            link.close()
        b.stop()
        shutil.rmtree(b.root, ignore_errors=True)


class Driver:
    """The scheduler's part, reduced: one map, ops before steps, greedy chains per slot."""

    def __init__(self, link: StageLink, cfg: Config) -> None:
        e = cfg.engine
        cls = ChunkMap if e.pool_on else StaticMap
        self.map = cls(e.n_chunks, e.chunk_cells, e.table_chunks, e.parallel)
        self.link = link
        link.on_stage_up = lambda i: link.send_ops(self.map.snapshot_ops(), stage=i, snapshot=True)
        self.in_flight = self.max_in_flight = 0

    async def step(self, slots: list[list[int]], tokens: list[int], sampling: dict | None = None) -> dict:
        for slot, start, n, _ in slots:
            assert self.map.reserve(slot, start + n), f"pool full reserving slot {slot}"
        self.link.send_ops(self.map.drain_ops())
        header = {"version": self.map.version, "slots": slots, "sampling": sampling or {}}
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self.link.step(header, tokens)
        finally:
            self.in_flight -= 1

    async def generate(self, slot: int, prompt: list[int], n_decode: int, start: int = 0) -> list[int]:
        """Prefill `prompt` at cells [start, ...) in one step, then n_decode greedy steps; the sampled tokens."""
        res = await self.step([[slot, start, len(prompt), 1]], prompt, {slot: dict(GREEDY)})
        out = [res["tokens"][0][1]]
        pos = start + len(prompt)
        for _ in range(n_decode):
            res = await self.step([[slot, pos, 1, 1]], [out[-1]])
            out.append(res["tokens"][0][1])
            pos += 1
        return out

    async def generate_all(self, prompts: dict[int, list[int]], n_decode: int) -> dict[int, list[int]]:
        """Every slot's chain at once: up to len(prompts) steps in flight (the pipeline)."""
        chains = [self.generate(s, p, n_decode) for s, p in prompts.items()]
        return dict(zip(prompts, await asyncio.gather(*chains)))
