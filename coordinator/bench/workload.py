"""The mixed-length workload: many requests of different prompt and output lengths against one OpenAI-compatible
server, the load continuous batching is for. `strata bench serve --workload mixed --url URL` runs it against any
server; `strata bench peers --workload mixed` against Strata and llama-server in one run.

Rules of the workload (make_workload):
- N requests. Request i has a prompt of P_i token ids and asks for M_i tokens; P_i is drawn uniformly from
  [prompt_min, prompt_max] and M_i from [output_min, output_max] (both inclusive), then its ids uniformly from
  [0, token_ids), all from random.Random(f"mixed-{seed}") in that order (P_0, M_0, ids_0, P_1, ...). The same
  arguments give the same workload, on every engine and every run.
- Prompts go as token ids to /v1/completions (exact lengths on any tokenizer), greedy, streamed with usage,
  with `ignore_eos` (every request should generate exactly M_i tokens; one that generates fewer counts as short).
  Their first ids differ (a prompt that would share its first 8 ids with an earlier one is drawn again), so no
  server can serve one request's prefix from another's.
- Arrivals: "all" sends every request at offset 0; "poisson" sends request 0 at 0 and request i at
  offset_{i-1} + Exp(rate), the gaps from random.Random(f"arrivals-{seed}") (a Poisson process of `rate`
  requests per second). The runner sleeps until each offset (asyncio: never before it) and records when each
  request was actually sent.

What is reported (workload_stats), from the client's side of HTTP; every request is answered or counted failed:
    makespan    first send to the end of the last stream (a server sends usage right after the last token)
    tokens      prompt and output tokens summed from the server's usage (prompt_tokens / completion_tokens),
                never from chunk counts
    TTFT        send to the first content chunk, p50/p90/p99 (a token whose bytes are incomplete UTF-8 is held
                back by the server until its text is whole; with none, the stream's end)
    latency     send to the end of the stream (end to end), mean/p50/p90/p99
    out_tok_s   output tokens / makespan
    stage_busy  a Strata server's stages: each one's share of the makespan spent computing steps, and bubble =
                1 - their sum / the steps computed at once (their mean when pipelined, their sum in turns:
                serve.py's busy_fractions; None from a server without Strata's /metrics)
    coord_ms_tok  a Strata server's coordinator process: its CPU time over the run per output token (ms; every
                thread of it: the HTTP front, the scheduler, the link, ZeroMQ's I/O thread)
Percentiles are report.percentile's (linear between closest ranks); a failed request (an HTTP error, an error
in the stream, no token) is counted and left out of the times and tokens.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, replace
from typing import Any

from .report import percentile, ratio
from .serve import (RequestResult, ServeConfig, busy_fractions, coordinator_cpu, make_client, resolve_model, stage_time,
                    stream_request)

PREFIX_IDS = 8  # prompts differ within their first PREFIX_IDS ids


@dataclass(frozen=True)
class WorkloadSpec:
    requests: int = 32
    prompt_min: int = 64
    prompt_max: int = 1024
    output_min: int = 16
    output_max: int = 128
    arrivals: str = "all"  # "all" or "poisson"
    rate: float = 4.0  # requests per second, for poisson arrivals
    seed: int = 0
    token_ids: int = 500  # prompt ids are drawn from [0, token_ids)

    def check(self) -> None:
        """ValueError with the first rule the spec breaks."""
        if self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if not 1 <= self.prompt_min <= self.prompt_max:
            raise ValueError(f"prompt lengths need 1 <= min <= max, got {self.prompt_min}-{self.prompt_max}")
        if not 1 <= self.output_min <= self.output_max:
            raise ValueError(f"output lengths need 1 <= min <= max, got {self.output_min}-{self.output_max}")
        if self.arrivals not in ("all", "poisson"):
            raise ValueError(f"arrivals must be 'all' or 'poisson', got {self.arrivals!r}")
        if self.arrivals == "poisson" and not self.rate > 0:
            raise ValueError(f"poisson arrivals need a rate > 0, got {self.rate}")
        if self.token_ids < 2:
            raise ValueError(f"token_ids must be >= 2, got {self.token_ids}")

    @property
    def max_context(self) -> int:
        """The longest request's cells: prompt_max + output_max."""
        return self.prompt_max + self.output_max

    def describe(self) -> str:
        sends = "all at once" if self.arrivals == "all" else f"Poisson arrivals at {self.rate:g} requests/s"
        return (f"{self.requests} requests, prompts of {self.prompt_min}-{self.prompt_max} token ids, outputs of "
                f"{self.output_min}-{self.output_max} tokens (uniform, seed {self.seed}), {sends}")


def spec_from_args(args: Any, token_ids: int) -> WorkloadSpec:
    """The spec of the CLI's mixed-workload options (--requests, --prompt-range, --output-range, --arrivals,
    --rate, --seed); RuntimeError with the rule it breaks."""
    spec = WorkloadSpec(requests=args.requests or 32, prompt_min=args.prompt_range[0], prompt_max=args.prompt_range[1],
                        output_min=args.output_range[0], output_max=args.output_range[1], arrivals=args.arrivals,
                        rate=args.rate, seed=args.seed, token_ids=token_ids)
    try:
        spec.check()
    except ValueError as err:
        raise RuntimeError(f"mixed workload: {err}") from None
    return spec


@dataclass(frozen=True)
class WorkRequest:
    prompt_ids: list[int]
    max_tokens: int
    send_at: float  # seconds after the first send


def make_workload(spec: WorkloadSpec) -> list[WorkRequest]:
    """The requests of `spec`, in send order (module docstring)."""
    spec.check()
    rng = random.Random(f"mixed-{spec.seed}")
    heads: set[tuple[int, ...]] = set()
    drawn = []
    for _ in range(spec.requests):
        n_prompt = rng.randint(spec.prompt_min, spec.prompt_max)
        n_out = rng.randint(spec.output_min, spec.output_max)
        while True:
            ids = [rng.randrange(spec.token_ids) for _ in range(n_prompt)]
            head = tuple(ids[:PREFIX_IDS])
            if head not in heads:
                heads.add(head)
                break
        drawn.append((ids, n_out))
    return [WorkRequest(ids, n_out, at) for (ids, n_out), at in zip(drawn, send_offsets(spec))]


def send_offsets(spec: WorkloadSpec) -> list[float]:
    """Each request's send time after the first (module docstring, arrivals)."""
    if spec.arrivals == "all":
        return [0.0] * spec.requests
    rng = random.Random(f"arrivals-{spec.seed}")
    offsets = [0.0]
    for _ in range(spec.requests - 1):
        offsets.append(offsets[-1] + rng.expovariate(spec.rate))
    return offsets


@dataclass
class WorkloadRun:
    """What the runner saw: one RequestResult per request (in workload order) and the clock's zero."""

    results: list[RequestResult]
    t0: float

    @property
    def sent_at(self) -> list[float]:
        """When each request was actually sent, in seconds after t0."""
        return [r.start - self.t0 for r in self.results]


async def run_workload(client: Any, cfg: ServeConfig, work: list[WorkRequest]) -> WorkloadRun:
    """Send every request at its offset (never before it) and stream it to its end; errors are recorded in the
    results, never raised. `client` has room for len(work) connections."""
    cfg = replace(cfg, ignore_eos=True)
    t0 = time.perf_counter()

    async def one(req: WorkRequest) -> RequestResult:
        delay = t0 + req.send_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        while time.perf_counter() < t0 + req.send_at:  # asyncio may wake within its clock resolution early
            await asyncio.sleep(0)
        return await stream_request(client, cfg, [], req.max_tokens, prompt_ids=req.prompt_ids)

    results = await asyncio.gather(*(one(r) for r in work))
    return WorkloadRun(list(results), t0)


def workload_stats(run: WorkloadRun, work: list[WorkRequest]) -> dict[str, Any]:
    """One table row for a run of `work` (module docstring); times in ms for TTFT, seconds for the rest."""
    results = run.results
    ok = [(r, w) for r, w in zip(results, work) if r.ok]
    ends = [r.end for r, _ in ok if r.end is not None]
    makespan = (max(ends) - min(r.start for r in results)) if ends else None
    e2e = [r.end - r.start for r, _ in ok if r.end is not None]
    ttfts = [r.ttft * 1e3 for r, _ in ok if r.ttft is not None]
    usage_out = [r.usage_output for r, _ in ok]
    usage_prompt = [r.usage_prompt for r, _ in ok]
    out_tokens = sum(n for n in usage_out if n is not None)
    no_usage = sum(1 for a, b in zip(usage_out, usage_prompt) if a is None or b is None)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "short": sum(1 for r, w in ok if r.usage_output is not None and r.usage_output < w.max_tokens),
        "no_usage": no_usage,
        "prompt_tokens": sum(n for n in usage_prompt if n is not None),
        "output_tokens": out_tokens,
        "makespan_s": makespan,
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p90_ms": percentile(ttfts, 90),
        "ttft_p99_ms": percentile(ttfts, 99),
        "e2e_mean_s": sum(e2e) / len(e2e) if e2e else None,
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p90_s": percentile(e2e, 90),
        "e2e_p99_s": percentile(e2e, 99),
        "out_tok_s": ratio(out_tokens, makespan),
        "first_error": next((r.error for r in results if r.error), None),
    }


COLUMNS = ["requests", "failed", "short", "prompt_tokens", "output_tokens", "makespan_s", "ttft_p50_ms",
           "ttft_p90_ms", "ttft_p99_ms", "e2e_mean_s", "e2e_p50_s", "e2e_p90_s", "e2e_p99_s", "out_tok_s",
           "stage_busy", "bubble", "coord_ms_tok"]


async def measure_workload(url: str, spec: WorkloadSpec, api_key: str | None = None, model: str | None = None,
                           timeout_s: float = 1800.0) -> dict[str, Any]:
    """Run the workload of `spec` against the server at `url` once; its stats row, with the model's name."""
    work = make_workload(spec)
    cfg = ServeConfig(url=url, model=model, api="completions", seed=spec.seed, api_key=api_key, ignore_eos=True,
                      timeout_s=timeout_s)
    async with make_client(url, api_key, timeout_s, len(work) + 2) as client:
        if cfg.model is None:
            cfg.model = await resolve_model(client)
        before = await stage_time(client)
        run = await run_workload(client, cfg, work)
        row = workload_stats(run, work)
        after = await stage_time(client)
        row.update(busy_fractions(before, after, row["makespan_s"] or 0.0))
        row["coord_ms_tok"] = coordinator_cpu(before, after, row["output_tokens"])
    return {**row, "model": cfg.model}


def run_mixed_serve(url: str, spec: WorkloadSpec, api_key: str | None = None, model: str | None = None,
                    timeout_s: float = 1800.0) -> dict[str, Any]:
    """`strata bench serve --workload mixed`: the report result for one server."""
    row = asyncio.run(measure_workload(url, spec, api_key, model, timeout_s))
    return {
        "bench": "serve",
        "config": {"url": url, "model": row["model"], "workload": "mixed", **spec.__dict__},
        "columns": COLUMNS,
        "rows": [row],
        "plot": None,
        "notes": [f"server {url}, model {row['model']}; {spec.describe()}; greedy, ignore_eos, token-id prompts "
                  "to /v1/completions",
                  "tokens from the server's usage; makespan = first send to the end of the last stream; "
                  "out_tok_s = output tokens / makespan; TTFT in ms, latencies (e2e) in s"]
                 + ([f"first error: {row['first_error']}"] if row["first_error"] else []),
    }
