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
                  parallel: int, root: Path, pipeline: bool | str = "auto", dtype: str = "auto",
                  int8_activations: bool = True) -> dict[str, Any]:
    """A box config for N CPU stages over the checkpoint's layers, split as evenly as it goes; the stage
    sockets in `root`, a private (0700) directory, as a stage requires of its runtime directory. `threads` is
    the box's budget: stages in turns (pool/pipeline.py, the default for CPU stages on one machine) each get all
    of it, since one computes at a time; pipelined ones split it. `dtype` is engine.dtype, `int8_activations`
    engine.int8_activations."""
    bounds = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    piped = pipeline is True  # "auto" on CPU stages of one machine: in turns
    chunk = CHUNK_CELLS
    max_context = -(-max_context // chunk) * chunk
    return {
        "model": model_dir,
        "coordinator": {"host": "127.0.0.1", "port": port},
        "engine": {"max_context": max_context, "parallel": parallel, "kv_pool_tokens": parallel * max_context,
                   "chunk_cells": chunk, "threads": max(1, threads // n_stages) if piped else threads,
                   "prefill_chunk": min(512, max_context), "pipeline": pipeline, "dtype": dtype,
                   "int8_activations": int8_activations},
        "stages": [{"device": "cpu", "layers": [bounds[i], bounds[i + 1]],
                    "endpoint": f"ipc://{root}/s{i}"} for i in range(n_stages)],
    }


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)


class ServerProcess:
    """A server on a command line, as a context manager: started in its own session (and, on Linux, sent SIGTERM
    when this process dies), entered once /health answers 200, stopped with SIGTERM and then SIGKILL after
    `stop_s`, whatever happened in between; a server that exits or stays unhealthy for STARTUP_S is an error
    ending with its log's tail."""

    name = "server"
    stop_s = 30.0
    poll_s = 0.25

    def __init__(self, cmd: list[str], port: int, log_path: Path) -> None:
        self.cmd, self.port, self.log_path = cmd, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self):
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        try:
            self._wait_healthy()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(self.poll_s)
        raise RuntimeError(f"{self.name} did not answer /health in {STARTUP_S:g} s: {self.tail()}")

    def tail(self, n: int = 1500) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def __exit__(self, *exc: object) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


class StrataServer(ServerProcess):
    """`strata up` on a config file (it stops its children on SIGTERM, then exits)."""

    name = "strata up"

    def __init__(self, config_path: Path, port: int, log_path: Path) -> None:
        super().__init__([sys.executable, "-m", "coordinator.cli", "up", "--config", str(config_path)], port,
                         log_path)
        self.config_path = config_path


def stage_weight_bytes(url: str) -> list[float]:
    """Each stage's strata:stage_weight_bytes from /metrics (parsed by prometheus_client), in stage order."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {s.labels["stage"]: s.value for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text)
             for s in fam.samples if s.name == "strata:stage_weight_bytes"}
    return [found[k] for k in sorted(found, key=int)]
