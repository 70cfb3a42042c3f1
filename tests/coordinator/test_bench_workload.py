"""The mixed-length workload (coordinator/bench/workload.py): the seeded generator, the arrival schedule, the
statistics (exact, on hand-made results), and the runner against the fake engine behind the real HTTP front.
No timing is asserted beyond "never sent before its offset"."""
from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import numpy as np
import pytest

import coordinator.bench as bench
from coordinator.bench.serve import RequestResult, ServeConfig, make_client
from coordinator.bench.workload import (PREFIX_IDS, WorkloadRun, WorkloadSpec, WorkRequest, make_workload,
                                        run_workload, send_offsets, workload_stats)
from coordinator.engine import EngineError
from tests.coordinator.fake_engine import running_front


# -- the generator

def test_workload_is_seeded_and_its_lengths_lie_in_range() -> None:
    spec = WorkloadSpec(requests=200, prompt_min=3, prompt_max=9, output_min=1, output_max=4, seed=5, token_ids=50)
    work = make_workload(spec)
    assert work == make_workload(spec)  # same spec, same workload
    assert make_workload(WorkloadSpec(**{**spec.__dict__, "seed": 6})) != work
    assert len(work) == 200
    assert {len(w.prompt_ids) for w in work} == set(range(3, 10))  # every length of the range, none outside
    assert {w.max_tokens for w in work} == {1, 2, 3, 4}
    assert all(0 <= t < 50 for w in work for t in w.prompt_ids)
    assert len({tuple(w.prompt_ids[:PREFIX_IDS]) for w in work}) == 200  # no two share their first ids
    assert all(w.send_at == 0.0 for w in work)  # arrivals "all"


def test_the_default_workload_is_the_one_the_issue_measures() -> None:
    spec = WorkloadSpec()
    work = make_workload(spec)
    assert len(work) == 32 and spec.max_context == 1024 + 128
    assert all(64 <= len(w.prompt_ids) <= 1024 and 16 <= w.max_tokens <= 128 for w in work)
    assert work[0].prompt_ids[:4] == make_workload(WorkloadSpec(seed=0))[0].prompt_ids[:4]


def test_poisson_offsets_follow_the_seeded_schedule() -> None:
    spec = WorkloadSpec(requests=2000, arrivals="poisson", rate=8.0, seed=3)
    offsets = send_offsets(spec)
    rng = random.Random("arrivals-3")
    expected = [0.0]
    for _ in range(1999):
        expected.append(expected[-1] + rng.expovariate(8.0))
    assert offsets == expected
    gaps = np.diff(offsets)
    assert (gaps > 0).all()
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)  # a Poisson process of 8 requests per second
    assert [w.send_at for w in make_workload(spec)] == offsets
    assert send_offsets(WorkloadSpec(requests=5, arrivals="poisson", rate=8.0, seed=4)) != offsets[:5]


@pytest.mark.parametrize("bad", [{"requests": 0}, {"prompt_min": 0}, {"prompt_min": 9, "prompt_max": 8},
                                 {"output_min": 5, "output_max": 4}, {"arrivals": "burst"},
                                 {"arrivals": "poisson", "rate": 0.0}, {"token_ids": 1}])
def test_a_spec_that_breaks_a_rule_is_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        make_workload(WorkloadSpec(**bad))


# -- the statistics

def test_workload_stats_exact() -> None:
    work = [WorkRequest([1] * 10, 4, 0.0), WorkRequest([2] * 20, 3, 0.5), WorkRequest([3] * 30, 2, 1.0),
            WorkRequest([4] * 5, 6, 1.5)]
    t0 = 100.0
    results = [
        RequestResult(start=100.0, end=101.0, chunk_times=[100.2, 100.5], usage_output=4, usage_prompt=10),
        RequestResult(start=100.5, end=103.0, chunk_times=[101.0], usage_output=3, usage_prompt=20),
        RequestResult(start=101.0, end=101.1, error="HTTP 503: full"),
        RequestResult(start=101.5, end=102.5, usage_output=5, usage_prompt=5),  # no text at all, and short
    ]
    row = workload_stats(WorkloadRun(results, t0), work)
    assert row["requests"] == 4 and row["failed"] == 1 and row["short"] == 1 and row["no_usage"] == 0
    assert row["first_error"] == "HTTP 503: full"
    assert row["prompt_tokens"] == 35 and row["output_tokens"] == 12  # from usage, failed left out
    assert row["makespan_s"] == pytest.approx(3.0)  # first send 100.0, last stream end 103.0
    assert row["out_tok_s"] == pytest.approx(12 / 3.0)
    ttfts = [200.0, 500.0, 1000.0]  # 0.2 s, 0.5 s, and the stream's end for the one without text
    for q in (50, 90, 99):
        assert row[f"ttft_p{q}_ms"] == pytest.approx(float(np.percentile(ttfts, q)))
    e2e = [1.0, 2.5, 1.0]
    assert row["e2e_mean_s"] == pytest.approx(1.5)
    for q in (50, 90, 99):
        assert row[f"e2e_p{q}_s"] == pytest.approx(float(np.percentile(e2e, q)))
    assert WorkloadRun(results, t0).sent_at == [0.0, 0.5, 1.0, 1.5]


def test_workload_stats_when_everything_failed() -> None:
    work = [WorkRequest([1], 1, 0.0)]
    row = workload_stats(WorkloadRun([RequestResult(start=1.0, end=1.5, error="refused")], 1.0), work)
    assert row["failed"] == 1 and row["makespan_s"] is None and row["out_tok_s"] is None
    assert row["ttft_p50_ms"] is None and row["e2e_mean_s"] is None


# -- the runner against the fake engine behind the real front

@pytest.fixture(scope="module")
def front(tokenizer):
    with running_front(tokenizer, max_context=4096) as stack:
        yield stack


@pytest.fixture
def engine(front):
    front.engine.reset()
    front.engine.script = front.tokenizer.encode(" ".join(["pool chunk slot stage"] * 20))
    yield front.engine
    front.engine.reset()


def _run(url: str, work: list[WorkRequest]) -> WorkloadRun:
    async def go() -> WorkloadRun:
        cfg = ServeConfig(url=url, model="tiny-test", api="completions")
        async with make_client(url, None, 30.0, len(work) + 2) as client:
            return await run_workload(client, cfg, work)

    return asyncio.run(go())


def test_runner_counts_tokens_from_usage_and_failures(front, engine) -> None:
    original = engine.generate

    async def odd_prompts_fail(req):  # a refusal for every request whose prompt has an odd length
        if len(req.prompt) % 2:
            raise EngineError.kv_pool_full(100, 0, retry_after=1)
        async for event in original(req):
            yield event

    engine.generate = odd_prompts_fail
    try:
        work = make_workload(WorkloadSpec(requests=12, prompt_min=4, prompt_max=40, output_min=2, output_max=12,
                                          seed=1))
        run = _run(front.url, work)
    finally:
        del engine.generate
    row = workload_stats(run, work)
    served = [w for w in work if len(w.prompt_ids) % 2 == 0]
    assert 0 < len(served) < 12
    assert row["requests"] == 12 and row["failed"] == 12 - len(served) and "503" in row["first_error"]
    assert row["short"] == 0 and row["no_usage"] == 0
    assert row["prompt_tokens"] == sum(len(w.prompt_ids) for w in served)
    assert row["output_tokens"] == sum(w.max_tokens for w in served)
    assert sorted(len(r.prompt) for r in engine.requests) == sorted(len(w.prompt_ids) for w in served)
    assert all(not r.stop_token_ids for r in engine.requests)  # ignore_eos: no id ends a request
    ok = [r for r in run.results if r.ok]
    e2e = [r.end - r.start for r in ok]
    assert row["makespan_s"] == pytest.approx(max(r.end for r in ok) - min(r.start for r in run.results))
    assert row["makespan_s"] >= max(e2e)
    assert row["e2e_p90_s"] == pytest.approx(float(np.percentile(e2e, 90)))
    assert row["ttft_p50_ms"] == pytest.approx(float(np.percentile([r.ttft * 1e3 for r in ok], 50)))
    assert row["out_tok_s"] == pytest.approx(row["output_tokens"] / row["makespan_s"])


def test_poisson_arrivals_are_never_sent_before_their_offset(front, engine) -> None:
    work = make_workload(WorkloadSpec(requests=8, prompt_min=4, prompt_max=8, output_min=2, output_max=3,
                                      arrivals="poisson", rate=200.0, seed=2))
    run = _run(front.url, work)
    scheduled = [w.send_at for w in work]
    assert scheduled[0] == 0.0 and scheduled[-1] > 0.0
    assert all(sent >= at for sent, at in zip(run.sent_at, scheduled))
    row = workload_stats(run, work)
    assert row["failed"] == 0 and row["makespan_s"] >= scheduled[-1]


# -- the CLI

def test_cli_parses_the_mixed_workload_options() -> None:
    args = bench.build_parser().parse_args(["serve", "--url", "http://127.0.0.1:9", "--workload", "mixed",
                                            "--prompt-range", "8-64", "--output-range", "4", "--arrivals", "poisson",
                                            "--rate", "2.5"])
    assert args.workload == "mixed" and args.prompt_range == (8, 64) and args.output_range == (4, 4)
    assert args.arrivals == "poisson" and args.rate == 2.5 and args.requests is None and args.token_ids == 500
    peers = bench.build_parser().parse_args(["peers", "--workload", "mixed", "--peers",
                                             "strata-1,llama-server,llama-server-f32", "--slots", "8",
                                             "--llama-kv", "f32", "--llama-flash-attn", "off", "--llama-repack",
                                             "off"])
    assert peers.peers == ["strata-1", "llama-server", "llama-server-f32"] and peers.slots == 8
    assert peers.llama_repack == "off"
    assert peers.prompt_range == (64, 1024) and peers.output_range == (16, 128) and peers.arrivals == "all"
    for bad in (["serve", "--url", "u", "--prompt-range", "9-8"], ["serve", "--url", "u", "--prompt-range", "0-8"],
                ["serve", "--url", "u", "--output-range", "a-b"], ["serve", "--url", "u", "--arrivals", "x"],
                ["peers", "--peers", "llama-server-f16"], ["peers", "--llama-kv", "q4"],
                ["peers", "--llama-repack", "no"]):
        with pytest.raises(SystemExit):
            bench.build_parser().parse_args(bad)


def test_cli_serve_mixed_writes_the_row(front, engine, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    rc = bench.main(["serve", "--url", front.url, "--workload", "mixed", "--requests", "6", "--prompt-range", "4-20",
                     "--output-range", "2-6", "--seed", "3", "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    data = json.loads((tmp_path / "serve.json").read_text())
    work = make_workload(WorkloadSpec(requests=6, prompt_min=4, prompt_max=20, output_min=2, output_max=6, seed=3))
    (row,) = data["rows"]
    assert row["requests"] == 6 and row["failed"] == 0 and row["model"] == "tiny-test"
    assert row["output_tokens"] == sum(w.max_tokens for w in work)
    assert row["prompt_tokens"] == sum(len(w.prompt_ids) for w in work)
    assert data["config"]["workload"] == "mixed" and data["config"]["requests"] == 6
    assert "makespan_s" in capsys.readouterr().out


def test_cli_serve_mixed_refuses_a_bad_rate(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    rc = bench.main(["serve", "--url", "http://127.0.0.1:9", "--workload", "mixed", "--arrivals", "poisson",
                     "--rate", "0", "--out", str(tmp_path)])
    assert rc == 1 and "rate" in capsys.readouterr().err
