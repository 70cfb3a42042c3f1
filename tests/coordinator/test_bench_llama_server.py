"""The llama-server peer of `strata bench peers` (coordinator/bench/llama_server.py) without llama-server: its
command line, its greedy-check note, the process wrapper on a stand-in server (waits for /health, always stops
it), and the peer skipped with its note when the binary is not built."""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import httpx
import pytest

import coordinator.bench as bench
from coordinator.bench import llama_server
from coordinator.bench.strata_server import free_port

STAND_IN = '''
import http.server, signal, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "--crash" in sys.argv:
    print("error: model file not found"); sys.exit(3)
start = time.monotonic()

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # 503 while "loading the model", then 200, as llama-server answers /health
        self.send_response(200 if time.monotonic() - start > 0.3 else 503)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
'''


def test_server_args_give_every_slot_its_cells_and_the_thread_budget() -> None:
    cmd = llama_server.server_args("/bin/ls", "/m.gguf", 8123, slots=8, cells_per_slot=1280, threads=2, kv="f16",
                                   flash_attn="auto", alias="llama-server")
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    assert cmd[0] == "/bin/ls" and cmd[-1] == "--no-webui"
    assert flags["-m"] == "/m.gguf" and flags["--host"] == "127.0.0.1" and flags["--port"] == "8123"
    assert flags["-np"] == "8" and flags["-c"] == str(8 * 1280)
    assert flags["-t"] == flags["-tb"] == "2" and flags["-ctk"] == flags["-ctv"] == "f16" and flags["-fa"] == "auto"
    assert llama_server.kv_and_fa("llama-server", "f16", "auto") == ("f16", "auto")
    assert llama_server.kv_and_fa("llama-server", "f32", "on") == ("f32", "on")  # --llama-kv, --llama-flash-attn
    assert llama_server.kv_and_fa("llama-server-f32", "f16", "auto") == ("f32", "off")
    assert "--no-repack" not in cmd
    plain = llama_server.server_args("/bin/ls", "/m.gguf", 8123, slots=8, cells_per_slot=1280, threads=2, kv="f16",
                                     flash_attn="auto", alias="llama-server", repack=False)
    assert plain == cmd[:-1] + ["--no-repack", "--no-webui"]  # --llama-repack off


def test_greedy_note() -> None:
    ref = [5, 6, 7, 8]
    assert "first 4 greedy token ids equal transformers'" in llama_server.greedy_note(
        "llama-server", [5, 6, 7, 8], "limit", ref, "transformers", 4)
    assert "DIFFER" in llama_server.greedy_note("llama-server", [5, 6, 9, 8], "limit", ref, "transformers", 4)
    stopped = llama_server.greedy_note("llama-server", [5, 6], "eos", ref, "transformers", 4)
    assert "equal transformers' for the 2 it generated" in stopped and "end-of-generation" in stopped
    assert "DIFFER" in llama_server.greedy_note("llama-server", [], "eos", ref, "transformers", 4)


@pytest.fixture
def stand_in(tmp_path: Path):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)

    def cmd(*flags: str) -> tuple[list[str], int]:
        port = free_port()
        return [sys.executable, str(script), "--port", str(port), *flags], port

    return cmd


def test_the_server_is_waited_for_and_stopped_also_on_errors(stand_in, tmp_path: Path) -> None:
    cmd, port = stand_in()
    with pytest.raises(ZeroDivisionError):
        with llama_server.LlamaServer(cmd, port, tmp_path / "ls.log") as server:
            assert httpx.get(server.url + "/health").status_code == 200  # not entered before /health said 200
            proc = server.proc
            1 / 0
    assert proc.poll() == -signal.SIGTERM


def test_a_server_that_ignores_sigterm_is_killed(stand_in, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(llama_server.LlamaServer, "stop_s", 0.3)
    cmd, port = stand_in("--ignore-term")
    with llama_server.LlamaServer(cmd, port, tmp_path / "ls.log") as server:
        proc = server.proc
    assert proc.poll() == -signal.SIGKILL


def test_a_server_that_exits_at_startup_is_reported_with_its_log(stand_in, tmp_path: Path) -> None:
    cmd, port = stand_in("--crash")
    with pytest.raises(RuntimeError, match="exited with 3: error: model file not found"):
        with llama_server.LlamaServer(cmd, port, tmp_path / "ls.log"):
            pass


def test_the_peer_is_skipped_with_the_build_command_when_the_binary_is_missing(
        tiny_model_factory, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))  # the child that looks for the binary sees it
    model = tiny_model_factory("qwen3", layers=2, hidden=64, heads=4, kv_heads=2)
    assert bench.main(["peers", "--peers", "llama-server,llama-server-f32", "--model-dir", str(model),
                       "--out", str(tmp_path), "--no-plot"]) == 0
    result = json.loads((tmp_path / "peers.json").read_text())
    assert result["rows"] == []
    skipped = [n for n in result["notes"] if "skipped" in n]
    expected = (f"llama-server is not built (no {tmp_path / 'cache' / 'llama-server-0.3.36' / 'llama-server'}); "
                "build it with `python -m stages.bench_peers build-llama-server`")
    assert skipped == [f"llama-server skipped: {expected}", f"llama-server-f32 skipped: {expected}"]
    assert bench.main(["peers", "--peers", "llama-server", "--model-dir", str(model), "--llama-server",
                       str(tmp_path / "nope"), "--out", str(tmp_path), "--no-plot"]) == 0
    notes = json.loads((tmp_path / "peers.json").read_text())["notes"]
    assert f"llama-server skipped: --llama-server {tmp_path / 'nope'} is not an executable file" in notes
