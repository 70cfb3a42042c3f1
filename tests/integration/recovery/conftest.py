"""Processes behind HTTP for the recovery tests: a coordinator on a `box`'s stages, or a whole `strata up`.

- `coordinator(b) -> Front`: `python -m coordinator.cli coord` on box `b`'s config (its stages started by the
  test with `b.start(i)`), on a free port; `.kill()` SIGKILLs it, and calling `coordinator(b)` again starts
  another one against the same stages.
- `strata_up_box(b) -> Front`: `strata up` on box `b`'s config (the supervisor starts and restarts the stages,
  with their default pool files in /dev/shm); `.pids()` are the supervisor's first report, `.stage_pid(i)` the
  stage's latest handshake as the coordinator logged it.
- `Front`: `.url`, `.http` (httpx), `.openai()` (the official client), `.live()` (the engine's live metrics),
  `.chat(messages)` (one greedy 8-token turn), `.wait_healthy()`.
Every process is SIGKILLed (its whole process group) when the test ends, and /dev/shm pool files of
`strata up` boxes are removed.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pool.memory import default_path
from tests.integration.conftest import free_port

ROOT = Path(__file__).resolve().parents[3]


class Front:
    """One process serving HTTP on 127.0.0.1 (a coordinator, or a `strata up` supervisor)."""

    def __init__(self, argv: list[str], log: Path, port: int) -> None:
        self.port, self.log_path = port, log
        self.url = f"http://127.0.0.1:{port}"
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})
        self.http = httpx.Client(base_url=self.url, timeout=60)
        self.model = ""
        self.pool_files: list[Path] = []

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"exited with {self.proc.returncode}:\n{self.log()[-3000:]}"
            try:
                if self.http.get("/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"not healthy after {timeout:g} s:\n{self.log()[-3000:]}"
            time.sleep(0.1)
        self.model = self.model or self.http.get("/v1/models").json()["data"][0]["id"]

    def openai(self, timeout: float = 60):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)

    def live(self) -> dict:
        return self.http.get("/metrics", params={"format": "json"}).json()["live"]

    def chat(self, messages: list[dict], logprobs: bool = False) -> dict:
        """One greedy 8-token chat through the official client: its text, cached prompt tokens and sampled
        tokens, and with `logprobs` their logprobs too (left out otherwise, so two turns compare with `==`)."""
        r = self.openai().chat.completions.create(model=self.model, messages=messages, max_tokens=8, temperature=0,
                                                  logprobs=True)
        choice = r.choices[0]
        out = {"text": choice.message.content, "cached": r.usage.prompt_tokens_details.cached_tokens,
               "tokens": [t.token for t in choice.logprobs.content]}
        if logprobs:
            out["logprobs"] = [t.logprob for t in choice.logprobs.content]
        return out

    def kill(self) -> None:
        """SIGKILL the process group (no goodbye to the stages)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def pids(self) -> tuple[int, list[int]]:
        """(coordinator pid, [stage pids]) from the supervisor's first line (strata up only)."""
        m = re.search(r"pids: coordinator (\d+), stages ([\d ]+)", self.log())
        assert m, self.log()[-3000:]
        return int(m.group(1)), [int(p) for p in m.group(2).split()]

    def stage_pid(self, index: int) -> int:
        """Stage `index`'s pid in its latest handshake (a restarted stage's once it rejoined)."""
        for line in reversed(self.log().splitlines()):
            back = re.search(r"event=stage\.back stage=%d pid=(\d+)" % index, line)
            if back:
                return int(back.group(1))
        return self.pids()[1][index]


@pytest.fixture
def coordinator(box):
    """coordinator(b) -> a healthy Front running `strata-coord` on box b's config; killed after the test."""
    made: list[Front] = []

    def start(b) -> Front:
        port = free_port()
        argv = [sys.executable, "-m", "coordinator.cli", "coord", "--config", str(b.path),
                "--set", f"coordinator.port={port}"]
        front = Front(argv, b.root / f"coord{len(made)}.log", port)
        made.append(front)
        front.wait_healthy()
        return front

    yield start
    for front in made:
        front.http.close()
        front.kill()


@pytest.fixture
def strata_up_box(box):
    """strata_up_box(b) -> a healthy Front running `strata up` on box b's config (b.start is not used)."""
    made: list[tuple[Front, list[Path]]] = []

    def start(b) -> Front:
        port = free_port()
        path = b.write_variant("up", coordinator={**b.data["coordinator"], "port": port})
        fp = b.cfg.fingerprint()  # the port is not part of it
        pool_files = [default_path(f"{fp}-stage{i}") for i in range(len(b.cfg.stages))]
        front = Front([sys.executable, "-m", "coordinator.cli", "up", "--config", str(path)], b.root / "up.log", port)
        front.pool_files = pool_files
        made.append((front, pool_files))
        front.wait_healthy()
        return front

    yield start
    for front, pool_files in made:
        front.http.close()
        if front.proc.poll() is None:
            os.killpg(front.proc.pid, signal.SIGTERM)  # the supervisor stops its children
            try:
                front.proc.wait(30)
            except subprocess.TimeoutExpired:
                front.kill()
        for pid in _running_from(front.log_path.parent):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for f in pool_files:
            f.unlink(missing_ok=True)
            f.with_name(f.name + ".state").unlink(missing_ok=True)  # a hybrid model's state file


def _running_from(root: Path) -> list[int]:
    """Live processes whose command line names a file under `root` (children a dead supervisor left)."""
    pids, needle = [], str(root).encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids
