"""`strata up` as a peer of the benchmarks (peers, prefix): a box config for N CPU stages over a checkpoint, and
the server as a context manager that waits for /health and always stops it."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

STARTUP_S = 300.0
CHUNK_CELLS = 256


def slot_cells(tokens: int) -> int:
    """Cells per slot for requests of up to `tokens` tokens: whole chunks of CHUNK_CELLS, with 16 to spare."""
    return -(-(tokens + 16) // CHUNK_CELLS) * CHUNK_CELLS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def strata_config(model_dir: str, n_stages: int, n_layers: int, threads: int, port: int, max_context: int,
                  parallel: int, root: Path) -> dict[str, Any]:
    """A box config for N CPU stages over the checkpoint's layers, split as evenly as it goes; the stage
    sockets in `root`, a private (0700) directory, as a stage requires of its runtime directory."""
    bounds = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    chunk = CHUNK_CELLS
    max_context = -(-max_context // chunk) * chunk
    return {
        "model": model_dir,
        "coordinator": {"host": "127.0.0.1", "port": port},
        "engine": {"max_context": max_context, "parallel": parallel, "kv_pool_tokens": parallel * max_context,
                   "chunk_cells": chunk, "threads": max(1, threads // n_stages),
                   "prefill_chunk": min(512, max_context)},
        "stages": [{"device": "cpu", "layers": [bounds[i], bounds[i + 1]],
                    "endpoint": f"ipc://{root}/s{i}"} for i in range(n_stages)],
    }


class StrataServer:
    """`strata up` on a config file, as a context manager: waits for /health, stops it with SIGTERM."""

    def __init__(self, config_path: Path, port: int, log_path: Path) -> None:
        self.config_path, self.port, self.log_path = config_path, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "StrataServer":
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "up", "--config", str(self.config_path)],
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"strata up exited with {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"strata up did not answer /health in {STARTUP_S:g} s: {self.tail()}")

    def tail(self, n: int = 1500) -> str:
        self._log.flush()
        return self.log_path.read_text()[-n:]

    def __exit__(self, *exc: object) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # `strata up` stops its children, then exits
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()



def stage_weight_bytes(url: str) -> list[float]:
    """Each stage's strata:stage_weight_bytes from /metrics (parsed by prometheus_client), in stage order."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {s.labels["stage"]: s.value for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text)
             for s in fam.samples if s.name == "strata:stage_weight_bytes"}
    return [found[k] for k in sorted(found, key=int)]
