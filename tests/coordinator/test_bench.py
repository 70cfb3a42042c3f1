"""`strata bench`: the statistics, the report files, the CLI, and the load generator against a small OpenAI-style
streaming server started here on the loopback. No timing is asserted: only counts, shapes and exact math."""
from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

import coordinator.bench as bench
from coordinator.bench.report import (format_table, format_value, percentile, ratio, render, write_report)
from coordinator.bench.serve import (WORDS, RequestResult, ServeConfig, build_body, chunk_text, level_stats,
                                     parse_sse, random_words, run_serve)

TOKENS_PER_WORD = 2  # the fake server's "tokenizer": every word is two tokens


# -- statistics

@pytest.mark.parametrize("n", [1, 2, 5, 10, 101])
def test_percentile_matches_numpy(n: int) -> None:
    rng = random.Random(n)
    values = [rng.uniform(0, 100) for _ in range(n)]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_exact_values() -> None:
    assert percentile([4, 1, 3, 2], 50) == 2.5  # mean of the two middle values
    assert percentile([1, 2, 3, 4, 5], 90) == pytest.approx(4.6)
    assert percentile([7], 90) == 7
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1, 2], 101)


def test_ratio() -> None:
    assert ratio(10, 4) == 2.5
    assert ratio(None, 4) is None
    assert ratio(3, None) is None
    assert ratio(3, 0) is None  # a ratio against nothing is absent, not infinite


# -- report files

def _result() -> dict:
    return {
        "bench": "demo",
        "columns": ["name", "x", "fast_us", "slow_us", "ratio"],
        "rows": [{"name": "a", "x": 1, "fast_us": 2.0, "slow_us": 20.0, "ratio": 10.0},
                 {"name": "a", "x": 2, "fast_us": 2.1, "slow_us": 41.0, "ratio": None}],
        "tables": [{"title": "memory", "columns": ["config", "gib"], "rows": [{"config": "c", "gib": 1.5}]}],
        "plot": {"x": "x", "series": ["name"], "logx": True,
                 "panels": [{"y": ["fast_us", "slow_us"], "ylabel": "us", "logy": True}, {"y": ["ratio"]}]},
        "notes": ["measured here"],
    }


def test_format_table_aligns_numbers_right() -> None:
    text = format_table(["name", "value"], [{"name": "a", "value": 1.5}, {"name": "bbb", "value": 12345.0}])
    lines = text.splitlines()
    assert lines[0].split() == ["name", "value"]
    assert lines[2] == "a        1.5"
    assert lines[3] == "bbb   12,345"
    assert format_value(None) == "-" and format_value(0.000123456) == "0.000123" and format_value(True) == "yes"


def test_write_report_writes_json_and_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")  # the `bench` extra
    paths = write_report(_result(), tmp_path / "out")
    assert json.loads(paths["json"].read_text()) == _result()
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = render(_result())
    assert "note: measured here" in text and "memory" in text and "41" in text


def test_write_report_without_plot(tmp_path: Path) -> None:
    result = _result()
    del result["plot"]
    assert set(write_report(result, tmp_path)) == {"json"}


# -- stream parsing and per-level statistics

def test_parse_sse_and_chunk_text() -> None:
    assert parse_sse("data: [DONE]") == "[DONE]"
    assert parse_sse(": ping") is None and parse_sse("") is None and parse_sse("event: x") is None
    chunk = parse_sse('data: {"choices": [{"delta": {"content": "hi"}}]}')
    assert chunk_text(chunk) == "hi"
    assert chunk_text({"choices": [{"text": "yo"}]}) == "yo"
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


def test_build_body_chat_and_completions() -> None:
    cfg = ServeConfig(url="http://127.0.0.1:1", model="m", ignore_eos=True)
    msgs = [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c"}]
    path, body = build_body(cfg, msgs, 5)
    assert path == "/v1/chat/completions" and body["messages"] == msgs and body["max_tokens"] == 5
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
    cfg.api = "completions"
    path, body = build_body(cfg, msgs, 5)
    assert path == "/v1/completions" and body["prompt"] == "a b\n\nc" and "messages" not in body


def test_level_stats_exact() -> None:
    a = RequestResult(start=0.0, chunk_times=[0.1, 0.2, 0.4], usage_output=3, usage_prompt=10)
    b = RequestResult(start=0.0, chunk_times=[0.3, 0.6], usage_output=None, usage_prompt=10)
    c = RequestResult(start=0.0, error="HTTP 503: full")
    row = level_stats(2, [a, b, c], wall_s=1.0)
    assert row["requests"] == 3 and row["errors"] == 1 and row["first_error"] == "HTTP 503: full"
    assert row["output_tokens"] == 5  # 3 from usage, 2 counted chunks
    assert row["ttft_p50_ms"] == pytest.approx(200.0)  # TTFTs 0.1, 0.3
    assert row["itl_p50_ms"] == pytest.approx(200.0)  # gaps 0.1, 0.2, 0.3
    assert row["itl_p90_ms"] == pytest.approx(280.0)
    assert row["out_tok_s"] == pytest.approx(5.0) and row["req_s"] == pytest.approx(2.0)
    assert row["decode_tok_s"] == pytest.approx((2 + 1) / (0.6 - 0.1))


def test_ttft_falls_back_to_the_stream_end_when_no_text_came() -> None:
    held_back = RequestResult(start=1.0, end=1.5, usage_output=1)  # one token, incomplete UTF-8: no text
    assert held_back.ok and held_back.ttft == pytest.approx(0.5) and held_back.output_tokens == 1
    assert not RequestResult(start=1.0, end=1.5).ok and RequestResult(start=1.0, end=1.5).ttft is None


def test_random_words_seeded() -> None:
    one, two = random_words(random.Random(3), 50), random_words(random.Random(3), 50)
    assert one == two and len(one.split()) == 50 and set(one.split()) <= set(WORDS)
    assert random_words(random.Random(4), 50) != one


# -- the load generator against a local server

class FakeServer:
    """An OpenAI-style streaming server on 127.0.0.1: one content chunk per output token, usage at the end."""

    def __init__(self, fail_every: int = 0, max_context: int = 0) -> None:
        self.requests: list[dict] = []
        self.max_context = max_context
        self.in_flight = 0
        self.max_in_flight = 0
        self.fail_every = fail_every
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):  # noqa: ANN202
            body = await request.json()
            return await self._answer(body, " ".join(m["content"] for m in body["messages"]), chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request):  # noqa: ANN202
            body = await request.json()
            return await self._answer(body, body["prompt"], chat=False)

        self.app = app

    async def _answer(self, body: dict, prompt: str, chat: bool):  # noqa: ANN202
        self.requests.append(body)
        if self.fail_every and len(self.requests) % self.fail_every == 0:
            return JSONResponse({"error": {"message": "full", "code": "kv_pool_full"}}, status_code=503)
        prompt_tokens = TOKENS_PER_WORD * len(prompt.split())
        n = body["max_tokens"]
        if self.max_context and prompt_tokens + n > self.max_context:
            return JSONResponse({"error": {"message": "context", "code": "context_length_exceeded"}}, status_code=400)

        async def stream():  # noqa: ANN202
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                for i in range(n):
                    await asyncio.sleep(0.002)
                    choice = {"index": 0, "delta": {"content": f"w{i} "}} if chat else {"index": 0, "text": f"w{i} "}
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                self.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")


@pytest.fixture
def fake_server():  # noqa: ANN201
    servers = []

    def start(**kw) -> tuple[str, FakeServer]:  # noqa: ANN003
        fake = FakeServer(**kw)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(fake.app, log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.time() + 10
        while not server.started and time.time() < deadline:
            time.sleep(0.01)
        assert server.started, "the fake server did not start"
        servers.append((server, thread, sock))
        return f"http://127.0.0.1:{sock.getsockname()[1]}", fake

    yield start
    for server, thread, sock in servers:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def test_load_generator_counts_and_concurrency(fake_server) -> None:  # noqa: ANN001
    url, fake = fake_server()
    cfg = ServeConfig(url=url, prompt_tokens=40, output_tokens=5, seed=1)
    result = asyncio.run(run_serve(cfg, [1, 3], requests=6, long_tokens=0))
    assert cfg.model == "fake-model"  # taken from /v1/models
    assert result["config"]["words_per_token"] == pytest.approx(1 / TOKENS_PER_WORD)
    rows = result["rows"]
    assert [r["concurrency"] for r in rows] == [1, 3]
    for row in rows:
        assert row["requests"] == 6 and row["errors"] == 0
        assert row["output_tokens"] == 6 * 5
        assert row["prompt_tokens"] == 40  # calibrated: 20 words of 2 tokens
        assert row["ttft_p50_ms"] > 0 and row["itl_p90_ms"] >= row["itl_p50_ms"] > 0 and row["out_tok_s"] > 0
    timed = fake.requests[1:]  # the first request calibrates
    assert len(timed) == 12 and all(r["model"] == "fake-model" and r["stream"] for r in timed)
    prompts = [r["messages"][0]["content"] for r in timed]
    assert len({tuple(p.split()[:8]) for p in prompts}) == 12  # no two share a prefix
    assert fake.max_in_flight == 3
    assert result["appended_turn"] is None


def test_appended_turn_sends_held_and_cold_conversations(fake_server) -> None:  # noqa: ANN001
    url, fake = fake_server()
    cfg = ServeConfig(url=url, model="x", prompt_tokens=8, output_tokens=3, seed=2)
    result = asyncio.run(run_serve(cfg, [1], requests=1, long_tokens=60, question_tokens=6, trials=2))
    turn = result["appended_turn"]
    assert turn["errors"] == 0 and turn["trials"] == 2
    assert turn["held_ttft_ms"] > 0 and turn["cold_ttft_ms"] > 0
    assert turn["cold_over_held"] == pytest.approx(turn["cold_ttft_ms"] / turn["held_ttft_ms"])
    first, held, cold = fake.requests[-3:]  # the last trial: first turn, appended question, cold copy
    assert held["messages"][0] == first["messages"][0] and len(first["messages"]) == 1
    assert held["messages"][1] == {"role": "assistant", "content": "w0 w1 w2 "}
    assert cold["messages"][1:] == held["messages"][1:] and cold["messages"][0] != held["messages"][0]
    assert len(held["messages"][0]["content"].split()) == len(cold["messages"][0]["content"].split()) == 30
    assert held["max_tokens"] == 1


def test_a_prompt_near_the_context_calibrates_on_a_shorter_one(fake_server) -> None:  # noqa: ANN001
    """2 tokens a word: a calibration prompt of 1,800 words would be 3,600 tokens, past the 2,000 of context."""
    url, fake = fake_server(max_context=2000)
    cfg = ServeConfig(url=url, model="x", prompt_tokens=1800, output_tokens=2)
    result = asyncio.run(run_serve(cfg, [1], requests=1))
    row = result["rows"][0]
    assert row["errors"] == 0 and row["prompt_tokens"] == 1800
    assert len(fake.requests[0]["messages"][0]["content"].split()) == 512


def test_errors_are_counted_not_raised(fake_server) -> None:  # noqa: ANN001
    url, fake = fake_server(fail_every=3)
    cfg = ServeConfig(url=url, model="x", api="completions", prompt_tokens=10, output_tokens=2)
    result = asyncio.run(run_serve(cfg, [2], requests=6))
    row = result["rows"][0]
    assert row["errors"] == 2 and "503" in row["first_error"] and row["output_tokens"] == 4 * 2
    assert all("prompt" in r for r in fake.requests)


# -- the CLI

def test_cli_parsing() -> None:
    args = bench.build_parser().parse_args(
        ["serve", "--url", "http://127.0.0.1:9", "--concurrency", "1,2,4", "--prompt-tokens", "100",
         "--output-tokens", "20", "--requests", "8", "--model", "m"])
    assert args.concurrency == [1, 2, 4] and args.prompt_tokens == 100 and args.requests == 8
    assert args.out == "bench-out" and args.long_tokens is None
    pool = bench.build_parser().parse_args(["pool", "--cells", "16384,32768", "--kv-dtypes", "int8"])
    assert pool.cells == [16384, 32768] and pool.kv_dtypes == ["int8"]
    assert bench._child_args(pool, ["cells", "kv-dtypes", "swap-repeats"]) == [
        "--cells", "16384,32768", "--kv-dtypes", "int8", "--swap-repeats", "200"]
    for bad in (["serve"], ["serve", "--url", "u", "--concurrency", "1,x"], ["pool", "--cells", "0"], ["nope"]):
        with pytest.raises(SystemExit):
            bench.build_parser().parse_args(bad)


def test_cli_serve_writes_files(fake_server, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    url, _ = fake_server()
    rc = bench.main(["serve", "--url", url, "--concurrency", "1,2", "--prompt-tokens", "10", "--output-tokens", "3",
                     "--requests", "2", "--long-tokens", "20", "--trials", "1", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "serve.json").read_text())
    assert [r["concurrency"] for r in data["rows"]] == [1, 2] and data["machine"]["cpus"] >= 1
    try:
        import matplotlib  # noqa: F401
        assert (tmp_path / "serve.png").exists()
    except ImportError:
        assert not (tmp_path / "serve.png").exists()
    out = capsys.readouterr().out
    assert "ttft_p50_ms" in out and "appended turn" in out and "cold_over_held" in out


def test_cli_serve_unreachable_server_fails_cleanly(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    rc = bench.main(["serve", "--url", f"http://127.0.0.1:{port}", "--requests", "1", "--out", str(tmp_path)])
    assert rc == 1 and "calibration request" in capsys.readouterr().err


# -- the torch benchmarks, run as child processes at a tiny size (they check their own results)

def test_pool_bench_smoke(tmp_path: Path) -> None:
    rc = bench.main(["pool", "--cells", "256,512", "--geometries", "cpu-tiny", "--kv-dtypes", "int8",
                     "--swap-repeats", "3", "--copy-repeats", "1", "--threads", "1", "--out", str(tmp_path),
                     "--no-plot"])
    assert rc == 0
    data = json.loads((tmp_path / "pool.json").read_text())
    assert [(r["cells"], r["chunks"]) for r in data["rows"]] == [(256, 1), (512, 2)]
    assert all(r["swap_us"] > 0 and r["copy_us"] > 0 for r in data["rows"])
    mem = data["tables"][0]["rows"][0]
    # cpu-tiny: 64 chunks + trash vs 5 regions of 16 chunks + trash, 256 cells each; same bytes per cell.
    assert mem["pool_over_baseline"] == pytest.approx(65 / 81)


def test_paged_bench_smoke(tmp_path: Path) -> None:
    rc = bench.main(["paged", "--contexts", "300", "--repeats", "1", "--threads", "1", "--out", str(tmp_path),
                     "--no-plot"])
    assert rc == 0
    rows = json.loads((tmp_path / "paged.json").read_text())["rows"]
    assert [(r["level"], r["chunks"]) for r in rows] == [("attention", 2), ("layer", 2)]
    assert all(r["max_abs_diff"] <= 1e-4 for r in rows)


def test_window_cli_parsing() -> None:
    args = bench.build_parser().parse_args(["window", "--contexts", "64,128", "--frames", "1,2", "--steps", "3",
                                            "--long", "--json"])
    assert args.contexts == [64, 128] and args.frames == [1, 2] and args.long and args.json
    assert bench._child_args(args, ["contexts", "frames", "steps", "threads"]) == [
        "--contexts", "64,128", "--frames", "1,2", "--steps", "3", "--threads", "1"]
    for bad in (["window", "--frames", "0"], ["window", "--kv-dtype", "fp8"]):
        with pytest.raises(SystemExit):
            bench.build_parser().parse_args(bad)


def test_window_bench_smoke(tmp_path: Path, capfd) -> None:  # noqa: ANN001
    rc = bench.main(["window", "--contexts", "64", "--chunk-cells", "16", "--frames", "1", "--steps", "2",
                     "--out", str(tmp_path), "--no-plot", "--json"])
    assert rc == 0
    data = json.loads((tmp_path / "window.json").read_text())
    assert [(r["window"], r["mode"]) for r in data["rows"]] == [("off", "-"), ("whole", "resident"),
                                                                  ("F=1", "streamed")]
    assert data["rows"][2]["h2d_bytes_tok"] > 0 and data["rows"][1]["fills_tok"] == 0
    assert [t["title"].split(",")[0] for t in data["tables"]] == ["dual-3080", "the seeds' box"]
    out = capfd.readouterr().out
    assert "h2d_bytes_tok" in out and '"bench": "window"' in out  # the table, then the JSON (--json)


# -- peers: the pure parts (the runs themselves need a server and minutes)

def test_peers_config_splits_layers_and_threads() -> None:
    from coordinator.bench.peers import strata_config

    cfg = strata_config("/m", n_stages=2, n_layers=12, threads=2, port=1234, max_context=300, parallel=4,
                        root=Path("/run/x"))
    assert [s["layers"] for s in cfg["stages"]] == [[0, 6], [6, 12]]
    assert cfg["engine"]["threads"] == 2 and cfg["engine"]["max_context"] == 512  # in turns: the whole budget
    piped = strata_config("/m", n_stages=2, n_layers=12, threads=2, port=1234, max_context=300, parallel=4,
                          root=Path("/run/x"), pipeline=True)
    assert piped["engine"]["threads"] == 1 and piped["engine"]["pipeline"] is True  # pipelined: split
    assert cfg["engine"]["kv_pool_tokens"] == 4 * 512 and cfg["engine"]["prefill_chunk"] == 512
    assert cfg["coordinator"] == {"host": "127.0.0.1", "port": 1234}
    three = strata_config("/m", n_stages=3, n_layers=4, threads=4, port=1, max_context=16, parallel=1,
                          root=Path("/run/x"))
    assert [s["endpoint"] for s in three["stages"]] == ["ipc:///run/x/s0", "ipc:///run/x/s1", "ipc:///run/x/s2"]
    assert [s["layers"] for s in three["stages"]] == [[0, 1], [1, 3], [3, 4]]
    assert three["engine"]["threads"] == 4 and three["engine"]["prefill_chunk"] == 256
    from pool.config import config_from_dict

    from pool import pipeline

    assert pipeline.turns(config_from_dict(cfg)) and not pipeline.turns(config_from_dict(piped))  # strata up takes both


def test_peers_split_the_layers_of_the_checkpoint_given_with_model_dir(tmp_path: Path) -> None:
    """`--model-dir` of a 28-layer checkpoint splits 28 layers, whatever `--layers` (the built model's) says."""
    from coordinator.bench.peers import checkpoint_layers

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 28}))
    assert checkpoint_layers(tmp_path) == 28
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 36}}))
    assert checkpoint_layers(str(tmp_path)) == 36


def test_peers_prompts_are_seeded_and_distinct() -> None:
    from coordinator.bench.peers import ORDINARY_TOKENS, prompt_ids

    a, b = prompt_ids(0, 4, 64), prompt_ids(0, 4, 64)
    assert a == b and len(a) == 4 and all(len(p) == 64 for p in a)
    assert all(0 <= t < ORDINARY_TOKENS for p in a for t in p)
    assert len({tuple(p[:8]) for p in a}) == 4 and prompt_ids(1, 4, 64) != a


def test_peers_argument_checks() -> None:
    args = bench.build_parser().parse_args(["peers", "--peers", "strata-1,strata-2,transformers"])
    assert args.peers == ["strata-1", "strata-2", "transformers"] and args.concurrency == [1, 4]
    for bad in ("strata-0", "vllm", "strata-x"):
        with pytest.raises(SystemExit):
            bench.build_parser().parse_args(["peers", "--peers", bad])


def test_busy_fractions_from_the_stages_counters():
    from coordinator.bench.serve import busy_fractions

    before = {"stages": [{"stage": 0, "busy_s": 1.0}, {"stage": 1, "busy_s": 2.0}], "groups": 2}
    after = {"stages": [{"stage": 0, "busy_s": 4.0}, {"stage": 1, "busy_s": 3.5}], "groups": 2}
    assert busy_fractions(before, after, 4.0) == {"stage_busy": "0.75 0.38", "bubble": 0.438}
    assert busy_fractions(None, after, 4.0) == {"stage_busy": None, "bubble": None}  # not a Strata server
    # stages in turns (pool/pipeline.py rule 6): one computes at a time, so the bubble is 1 - the sum
    turns = {"stages": [{"stage": 0, "busy_s": 2.9}, {"stage": 1, "busy_s": 3.0}], "groups": 1}
    assert busy_fractions(before, turns, 4.0)["bubble"] == 0.275


def test_sse_lines_cut_at_cr_and_lf_only_across_reads() -> None:
    """A data line with U+2028 and U+0085 raw in its JSON (another server's stream) stays one line; CRLF, CR and LF
    end lines wherever the reads split them."""
    import httpx

    from coordinator.bench.serve import sse_lines

    first = 'data: {"text":"a\u2028b\x85c"}'
    chunks = [first[:12].encode(), first[12:].encode() + b"\r", b"\n\r\ndata: [DONE]\r", b"data: tail"]

    async def body():
        for c in chunks:
            yield c

    async def read() -> list[str]:
        return [line async for line in sse_lines(httpx.Response(200, content=body()))]

    lines = [x for x in asyncio.run(read()) if x]
    assert lines == [first, "data: [DONE]", "data: tail"]
    assert json.loads(lines[0][5:])["text"] == "a\u2028b\x85c"


def test_coordinator_cpu_per_token_from_the_live_view():
    from coordinator.bench.serve import coordinator_cpu

    before, after = {"stages": [], "cpu_s": 10.0}, {"stages": [], "cpu_s": 10.5}
    assert coordinator_cpu(before, after, 250) == 2.0  # 500 ms of CPU over 250 tokens
    assert coordinator_cpu(before, {"stages": []}, 250) is None  # a server that does not report it
    assert coordinator_cpu(None, after, 250) is None and coordinator_cpu(before, after, 0) is None
