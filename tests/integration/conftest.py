"""Real stage processes for integration tests, and a minimal driver that plays the scheduler's part.

- `box(n_stages, pool=True, transport="ipc", **engine)` writes a YAML config into a short temp dir (ipc
  socket paths are limited to 107 bytes) and returns a `Box`: `.start(i, *overrides)` starts stage i as
  `python -m stages.server`, `.kill(i)` SIGKILLs it, `.link()` makes a StageLink on the box's config. Every
  process is stopped by the fixture's finalizer (SIGTERM, then SIGKILL), so a failing test leaves no orphans.
- `Driver` keeps the authoritative ChunkMap/StaticMap and sends its ops before each step, the way the
  scheduler does: reserve cells, `send_ops(map.drain_ops())`, then the step with `version = map.version`.
- `strata_up(**engine)` (module scope) runs the whole box as `strata up` (supervisor, coordinator, two CPU
  stages) on a free port with ipc endpoints in a short temp dir, and returns a `Server` with the official
  clients and the probes the serving tests need (`live()`, `slots()`, `erase_all()`, `check_clean()`).
  Everything it started is stopped when the module ends; a supervisor that does not stop is killed and so
  is every process still running from its config.
- Oracles from transformers, which the serving path is checked against: `oracle_chat_ids` (a chat prompt
  rendered and tokenized), `oracle_encode` / `oracle_decode`, `oracle_greedy` (the greedy continuation).
"""
from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
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


# ---- the whole box behind HTTP -------------------------------------------------------------------------
SERVING_MODEL = {"arch": "qwen3", "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "seed": 3}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `strata up` box on 127.0.0.1: a supervisor, the coordinator and `n_stages` CPU stages (two)."""

    def __init__(self, root: Path, model: Path, engine: dict, coordinator: dict | None = None,
                 headers: dict | None = None, timeout: float = 60, n_stages: int = 2) -> None:
        """`engine` overrides the serving defaults; `coordinator` holds the coordinator keys besides the port and
        the heartbeat (default: host 127.0.0.1); `headers` and `timeout` are those of `.http`."""
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        eng = {"max_context": 512, "parallel": 4, "chunk_cells": 16, "threads": 1, "prefill_chunk": 64,
               "kv_pool_tokens": 2048, **engine}
        stages = [{"device": "cpu", "layers": layers, "endpoint": f"ipc://{root}/s{i}"}
                  for i, layers in enumerate(split(4, n_stages))]
        coord = {"port": self.port, "heartbeat_ms": 100, "stage_timeout_ms": 3000,
                 **(coordinator if coordinator is not None else {"host": "127.0.0.1"})}
        self.data = {"model": str(model), "engine": eng, "stages": stages, "coordinator": coord}
        self.path = root / "box.yaml"
        self.path.write_text(yaml.safe_dump(self.data))
        self.cfg = load_config(self.path)
        self.proc: subprocess.Popen | None = None
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        self.model = ""

    # ---- processes ---------------------------------------------------------------------------------
    def start(self, timeout: float = 180) -> None:
        """Run `strata up` and wait until /health answers 200 (stages handshaken, HTTP front listening)."""
        log = open(self.root / "up.log", "ab")
        argv = [sys.executable, "-m", "coordinator.cli", "up", "--config", str(self.path)]
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"strata up exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if self.http.get("/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"strata up not healthy after {timeout:g} s:\n{self.log()[-3000:]}")
            time.sleep(0.1)
        self.model = self.http.get("/v1/models").json()["data"][0]["id"]

    def log(self) -> str:
        return (self.root / "up.log").read_text(errors="replace")

    def stage_pid(self, index: int) -> int:
        """Stage `index`'s pid as the coordinator last saw it in a handshake (a restarted stage included)."""
        for line in reversed(self.log().splitlines()):
            back = re.search(r"event=stage\.back stage=%d pid=(\d+)" % index, line)
            if back:
                return int(back.group(1))
            if "event=stages.up" in line:
                return int(re.findall(r'pid\\?":(\d+)', line)[index])
        raise LookupError(f"stage {index}'s pid is not in the log")

    def stop(self) -> None:
        """SIGTERM the supervisor (it stops the coordinator, then the stages); then SIGKILL every process still
        running from this box's config file (what a supervisor that had to be killed left behind)."""
        self.http.close()
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and str(self.path).encode() in (entry / "cmdline").read_bytes():
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                continue

    # ---- clients and probes --------------------------------------------------------------------------
    def openai(self, timeout: float = 120):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)

    def anthropic(self, timeout: float = 120):
        import anthropic

        return anthropic.Anthropic(base_url=self.url, api_key="unused", max_retries=0, timeout=timeout)

    def metrics_json(self) -> dict:
        return self.http.get("/metrics", params={"format": "json"}).json()

    def live(self) -> dict:
        return self.metrics_json()["live"]

    def slots(self) -> list[dict]:
        return self.http.get("/slots").json()

    def erase_all(self) -> int:
        resp = self.http.post("/slots", params={"action": "erase"})
        assert resp.status_code == 200, resp.text
        return resp.json()["erased_cells"]

    def wait_idle(self, timeout: float = 30) -> None:
        """Until no request is running or waiting."""
        deadline = time.monotonic() + timeout
        while (live := self.live())["running"] or live["waiting"]:
            assert time.monotonic() < deadline, f"requests still running after {timeout:g} s: {live}"
            time.sleep(0.05)

    def wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.http.get("/health").status_code != 200:
            assert time.monotonic() < deadline, f"not healthy after {timeout:g} s: {self.http.get('/health').text}"
            time.sleep(0.1)

    def check_clean(self) -> None:
        """After a test: erase every held conversation; then every cell is free and no slot is busy."""
        self.wait_idle()
        self.erase_all()
        pool = self.live()["kv_pool"]
        assert pool["free"] == pool["cells"], pool
        assert all(s["cells"] == 0 and s["state"] == "free" for s in pool["slots"]), pool["slots"]
        assert pool["parked"] == [], pool["parked"]
        assert not any(s["is_processing"] for s in self.slots())


@pytest.fixture(scope="module")
def strata_up(tiny_model_factory):
    """strata_up(n_stages=2, model=None, saves=False, **engine) -> a started Server on `model` (tiny_model_factory
    arguments; None: the serving model), with `engine.slot_save_path` in its own directory when `saves`; all
    stopped when the module ends."""
    made: list[Server] = []

    def make(n_stages: int = 2, model: dict | None = None, saves: bool = False, **engine: object) -> Server:
        root = Path(tempfile.mkdtemp(prefix="su", dir="/tmp"))
        if saves:
            engine["slot_save_path"] = str(root / "saves")
        server = Server(root, tiny_model_factory(**(model or SERVING_MODEL)), dict(engine), n_stages=n_stages)
        made.append(server)
        server.start()
        return server

    yield make
    for server in made:
        server.stop()
        shutil.rmtree(server.root, ignore_errors=True)


_ORACLES: dict[str, Any] = {}


def _oracle(model_dir: str | Path) -> Any:
    from transformers import AutoTokenizer

    key = str(model_dir)
    if key not in _ORACLES:
        _ORACLES[key] = AutoTokenizer.from_pretrained(key)
    return _ORACLES[key]


def oracle_chat_ids(model_dir: str | Path, messages: list[dict]) -> list[int]:
    """transformers' own rendering and tokenization of a chat prompt (with the generation prompt)."""
    out = _oracle(model_dir).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def oracle_encode(model_dir: str | Path, text: str) -> list[int]:
    """transformers' tokenization of plain text (no special tokens added)."""
    return list(_oracle(model_dir).encode(text, add_special_tokens=False))


def oracle_greedy(model_dir: str | Path, prompt: list[int], max_tokens: int) -> tuple[list[int], bool]:
    """transformers' greedy continuation of `prompt`: (tokens, ended) where `ended` says an end-of-turn id
    (generation_config's eos ids) was sampled; like the engine, that id is not in the tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    key = f"model:{model_dir}"
    if key not in _ORACLES:
        torch.set_num_threads(1)  # the cores are shared with the stages; one thread is fastest for this size
        _ORACLES[key] = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model = _ORACLES[key]
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if token in eos:
                return out, True
            out.append(token)
            ids.append(token)
    return out, False


def oracle_decode(model_dir: str | Path, ids: list[int]) -> str:
    return _oracle(model_dir).decode(ids)
