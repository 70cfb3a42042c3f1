"""Prometheus metrics of the HTTP front, vLLM-compatible names where vLLM has one.

Two sources, one registry (per `Metrics` object, never the global one, so tests and several apps in one
process do not collide):
- latencies and token counts are measured by the front from each request's event stream
  (`first_token`, `token_gap`, `finished`, `aborted`);
- gauges and the engine's own counters (running, waiting, the KV pool, evictions, refusals, truncations)
  are read from `engine.live_metrics()` at scrape time by a custom collector, so they are never stale.

Exposed names (prometheus_client adds `_total` to counters itself; we give it the bare name):
  vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc (0..1),
  vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds, vllm:e2e_request_latency_seconds,
  vllm:prompt_tokens_total, vllm:generation_tokens_total, vllm:prefix_cache_queries_total,
  vllm:prefix_cache_hits_total (both in tokens), vllm:request_success_total{finished_reason},
  strata:kv_pool_cells, strata:kv_pool_free_cells, strata:kv_pool_held_cells{slot},
  strata:kv_pool_shared_cells (cells in chunks more than one table holds), strata:kv_pool_saved_cells (sum over
  shared chunks of (tables holding it - 1) x chunk_cells: what the pool would hold on top without sharing),
  strata:kv_pool_evictions_total, strata:requests_refused_total{code} (the engine's refusals plus those the
  front decides itself, e.g. context_length_exceeded), strata:requests_truncated_total,
  and per stage with a device window (stages/window.py), labelled `stage="0"`...: strata:kv_window_frames,
  strata:kv_window_cells, strata:kv_window_resident_frames, strata:kv_window_device_bytes,
  strata:kv_window_steps_total, strata:kv_window_streamed_steps_total, strata:kv_window_hits_total,
  strata:kv_window_fills_total, strata:kv_window_stale_total, strata:kv_window_evictions_total,
  strata:kv_window_streamed_total, strata:kv_window_h2d_bytes_total, strata:kv_window_d2h_bytes_total
  (none when no stage has a window; a stage's values are those of its last heartbeat answer),
  and per stage strata:stage_steps_total, strata:stage_steps_refused_total, strata:stage_steps_failed_total,
  strata:stage_busy_seconds_total, strata:stage_hidden_wait_seconds_total
  (the time a stage computed steps, and waited for the stage before it: busy fractions and the bubble),
  strata:stage_baton_passes_total (its sockets changing threads: stages/baton.py), and the
  gauge strata:stage_weight_bytes (its weights as loaded, from its HELLO); and the coordinator process's own
  process_cpu_seconds_total, process_resident_memory_bytes and the rest of prometheus_client's process
  collector (Linux).
`strata:kv_pool_held_cells` has one series per slot (`slot="0"`...) and one per parked table
(`slot="parked:<table>"`).
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .engine import Engine

log = logging.getLogger("strata.metrics")

# vLLM's buckets, so dashboards built for it read these the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# strata:kv_window_<name> per stage: (key of a `live_metrics()["kv_window"]` entry, help text).
WINDOW_GAUGES = {
    "frames": ("frames", "Frames of the stage's device window (one pool chunk each)."),
    "cells": ("cells", "Cells the stage's device window holds."),
    "resident_frames": ("resident", "Frames of the device window holding a chunk now."),
    "device_bytes": ("device_bytes", "Bytes of the device window's frames."),
}
WINDOW_COUNTERS = {
    "steps": ("steps", "Steps run through the device window."),
    "streamed_steps": ("streamed_steps", "Steps whose chunks did not fit the window and were streamed."),
    "hits": ("hits", "Chunks a step needed that were found valid in a frame."),
    "fills": ("fills", "Whole chunks copied host->frame."),
    "stale": ("stale", "Frames dropped because the chunk's generation changed."),
    "evictions": ("evictions", "Resident chunks dropped from their frame to make room (a fill or a stream buffer)."),
    "streamed": ("streamed", "One layer's cells of a chunk copied into a stream buffer."),
    "h2d_bytes": ("h2d_bytes", "Bytes copied host->device."),
    "d2h_bytes": ("d2h_bytes", "Bytes copied device->host (write-through)."),
}


class Metrics:
    """The front's measurements plus a scrape-time view of the engine."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first token.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between two tokens of one request.",
                             labels, buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             labels, buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        # Plain counts, read by the collector and by `snapshot()`: one source for both formats.
        self.totals: Counter[str] = Counter()
        self.finished_reasons: Counter[str] = Counter()
        self.front_refusals: Counter[str] = Counter()
        self.latency = {"ttft": [0, 0.0], "itl": [0, 0.0], "e2e": [0, 0.0]}  # [count, sum seconds]
        self.registry.register(_LiveCollector(self))
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total and memory, as vLLM's /metrics has

    # ---- recorded by the front, per request ----------------------------------------------------------
    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self._add("ttft", seconds)

    def token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self._add("itl", seconds)

    def finished(self, reason: str, seconds: float, prompt_tokens: int, cached_tokens: int,
                 completion_tokens: int) -> None:
        """A request that ran to its end (`reason` "stop" or "length")."""
        self.e2e.observe(seconds)
        self._add("e2e", seconds)
        self.finished_reasons[reason] += 1
        self.totals["prompt_tokens"] += prompt_tokens
        self.totals["generation_tokens"] += completion_tokens
        self.totals["prefix_cache_queries"] += prompt_tokens
        self.totals["prefix_cache_hits"] += cached_tokens

    def aborted(self, reason: str, completion_tokens: int) -> None:
        """A request cut short: "abort" (the client left) or "error" (an engine error mid-stream)."""
        self.finished_reasons[reason] += 1
        self.totals["generation_tokens"] += completion_tokens

    def refused(self, code: str) -> None:
        """A request the front itself turned away (e.g. context_length_exceeded), never seen by the engine."""
        self.front_refusals[code] += 1

    def _add(self, key: str, seconds: float) -> None:
        acc = self.latency[key]
        acc[0] += 1
        acc[1] += seconds

    # ---- read ------------------------------------------------------------------------------------
    def render(self) -> bytes:
        """Prometheus text exposition."""
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, Any]:
        """The `/metrics?format=json` body: the engine's live view plus the front's counts."""
        return {
            "live": self.engine.live_metrics(),
            "model": self.model_name,
            "requests": {
                "finished": dict(self.finished_reasons),
                "refused_by_front": dict(self.front_refusals),
                **{k: self.totals[k] for k in ("prompt_tokens", "generation_tokens", "prefix_cache_queries",
                                                "prefix_cache_hits")},
            },
            "latency_seconds": {
                k: {"count": n, "mean": (s / n if n else None)} for k, (n, s) in self.latency.items()
            },
        }


def _held_cells(entry: Any) -> int:
    """A slot or parked entry of `live_metrics()["kv_pool"]`: a dict with "cells", or a bare count."""
    if isinstance(entry, dict):
        return int(entry.get("cells", entry.get("held_cells", 0)))
    return int(entry)


class _LiveCollector(Collector):
    """Reads `engine.live_metrics()` at each scrape and the front's plain counters."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def describe(self) -> list[Metric]:
        return []  # no fixed description: the series depend on the engine's state

    def collect(self) -> Iterator[Metric]:
        m, name = self.m, self.m.model_name
        yield from self._front_counters(m, name)
        try:
            live = m.engine.live_metrics()
        except Exception:  # a scrape must not fail because the engine is mid-restart
            log.exception("live_metrics failed during a scrape")
            return
        yield from self._engine_view(live, name, m.front_refusals)

    @staticmethod
    def _front_counters(m: Metrics, name: str) -> Iterator[Metric]:
        for key, doc in (
            ("prompt_tokens", "Prompt tokens of finished requests."),
            ("generation_tokens", "Generated tokens."),
            ("prefix_cache_queries", "Prompt tokens looked up in the conversation cache."),
            ("prefix_cache_hits", "Prompt tokens whose K/V were reused from the conversation cache."),
        ):
            c = CounterMetricFamily(f"vllm:{key}", doc, labels=["model_name"])
            c.add_metric([name], m.totals[key])
            yield c
        success = CounterMetricFamily("vllm:request_success", "Finished requests by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason in sorted(set(m.finished_reasons) | {"stop", "length"}):
            success.add_metric([name, reason], m.finished_reasons[reason])
        yield success

    @staticmethod
    def _engine_view(live: dict, name: str, front_refusals: Counter[str]) -> Iterator[Metric]:
        running = GaugeMetricFamily("vllm:num_requests_running", "Requests in a slot.", labels=["model_name"])
        running.add_metric([name], live.get("running", 0))
        yield running
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting for a slot.",
                                    labels=["model_name"])
        waiting.add_metric([name], live.get("waiting", 0))
        yield waiting

        pool = live.get("kv_pool", {})
        cells, free = int(pool.get("cells", 0)), int(pool.get("free", 0))
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "Fraction of KV pool cells held (0..1).",
                                  labels=["model_name"])
        usage.add_metric([name], (cells - free) / cells if cells else 0.0)
        yield usage
        yield GaugeMetricFamily("strata:kv_pool_cells", "Cells in the shared KV pool.", value=cells)
        yield GaugeMetricFamily("strata:kv_pool_free_cells", "Cells of the pool no table holds.", value=free)
        yield GaugeMetricFamily("strata:kv_pool_shared_cells", "Cells in chunks more than one table holds.",
                                value=int(pool.get("shared", 0)))
        yield GaugeMetricFamily("strata:kv_pool_saved_cells", "Cells sharing saves: sum over shared chunks of "
                                "(tables holding it - 1) x chunk_cells.", value=int(pool.get("saved", 0)))
        held = GaugeMetricFamily("strata:kv_pool_held_cells", "Cells held per slot and per parked table.",
                                 labels=["slot"])
        for i, entry in enumerate(pool.get("slots", [])):
            slot = entry.get("slot", i) if isinstance(entry, dict) else i
            held.add_metric([str(slot)], _held_cells(entry))
        for i, entry in enumerate(pool.get("parked", [])):
            table = entry.get("table", i) if isinstance(entry, dict) else i
            held.add_metric([f"parked:{table}"], _held_cells(entry))
        yield held

        counters = live.get("counters", {})
        yield CounterMetricFamily("strata:kv_pool_evictions", "Held conversations evicted to make room.",
                                  value=counters.get("evictions", 0))
        refused = CounterMetricFamily("strata:requests_refused", "Requests refused, by error code.",
                                      labels=["code"])
        codes = Counter(counters.get("refusals", {})) + front_refusals
        for code, n in sorted(codes.items()):
            refused.add_metric([code], n)
        yield refused
        yield CounterMetricFamily("strata:requests_truncated", "Requests ended early because the pool was full.",
                                  value=counters.get("truncations", 0))
        yield CounterMetricFamily("strata:decode_rows_chained",
                                  "Decode rows sent before the token they read came back (pool/step_chain.py).",
                                  value=counters.get("chained", 0))
        yield GaugeMetricFamily("strata:pipeline_groups", "Steps the stages compute at once: the number of stages "
                                "when pipelined, 1 when they take turns (pool/pipeline.py).",
                                value=live.get("pipeline_groups", 1))
        yield from _window_series(live.get("kv_window", []))
        yield from _stage_series(live.get("stages", []))


STAGE_COUNTERS = {
    "stage_steps": ("steps_run", "Steps a stage has run."),
    "stage_steps_refused": ("steps_refused", "Steps a stage refused without running them (a table version it has "
                                             "not seen, a chained row it cannot fill)."),
    "stage_steps_failed": ("steps_failed", "Steps that failed on a stage while it computed them (their requests "
                                           "ended with step_failed)."),
    "stage_busy_seconds": ("busy_s", "Seconds a stage spent computing steps (busy / wall time = its busy fraction)."),
    "stage_hidden_wait_seconds": ("hidden_wait_s", "Seconds a stage's steps waited for the previous stage's hidden "
                                                   "states, or on the first stage for the last one's samples before "
                                                   "a chained step (the pipeline's bubble, seen from that stage)."),
    "stage_baton_passes": ("baton_passes", "Times a stage's sockets changed threads (stages/baton.py): twice around "
                                           "each step or session file it expected to outlast a tenth of "
                                           "stage_timeout_ms, which its I/O thread serves meanwhile."),
}


def _stage_series(stages: list[dict]) -> Iterator[Metric]:
    """strata:stage_* labelled by stage, from `live_metrics()["stages"]`."""
    if not stages:
        return
    for name, (key, doc) in STAGE_COUNTERS.items():
        fam = CounterMetricFamily(f"strata:{name}", doc, labels=["stage"])
        for entry in stages:
            fam.add_metric([str(entry["stage"])], entry.get(key, 0))
        yield fam
    weights = GaugeMetricFamily("strata:stage_weight_bytes", "Bytes of the stage's weights as loaded (quantized "
                                "GGUF weights at their packed size).", labels=["stage"])
    for entry in stages:
        if entry.get("weight_bytes") is not None:
            weights.add_metric([str(entry["stage"])], entry["weight_bytes"])
    yield weights


def _window_series(stages: list[dict]) -> Iterator[Metric]:
    """strata:kv_window_* labelled by stage, from `live_metrics()["kv_window"]`; nothing when it is empty."""
    if not stages:
        return
    for kind, table in ((GaugeMetricFamily, WINDOW_GAUGES), (CounterMetricFamily, WINDOW_COUNTERS)):
        for name, (key, doc) in table.items():
            fam = kind(f"strata:kv_window_{name}", doc, labels=["stage"])
            for entry in stages:
                fam.add_metric([str(entry["stage"])], entry.get(key, 0))
            yield fam
