"""/metrics: Prometheus names (vLLM's where they exist), values from the event stream and the engine's live view."""
from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.engine import EngineError
from coordinator.metrics import Metrics
from tests.coordinator.fake_engine import KV_WINDOW, STAGES, running_front

MSGS = [{"role": "user", "content": "Say hello."}]

# strata:kv_window_* sample name -> the key of a live_metrics()["kv_window"] entry it is read from
WINDOW_SAMPLES = {
    "strata:kv_window_frames": "frames", "strata:kv_window_cells": "cells",
    "strata:kv_window_resident_frames": "resident", "strata:kv_window_device_bytes": "device_bytes",
    **{f"strata:kv_window_{k}_total": k for k in ("steps", "streamed_steps", "hits", "fills", "stale", "evictions",
                                                   "streamed", "h2d_bytes", "d2h_bytes")},
}
WINDOW_NAMES = list(WINDOW_SAMPLES)

EXPOSED = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:request_success_total",
    "strata:kv_pool_cells", "strata:kv_pool_free_cells", "strata:kv_pool_held_cells",
    "strata:kv_pool_evictions_total", "strata:requests_refused_total", "strata:requests_truncated_total",
    "strata:decode_rows_chained_total", *WINDOW_NAMES, "strata:stage_steps_total", "strata:stage_steps_refused_total",
    "strata:stage_steps_failed_total", "strata:stage_busy_seconds_total",
    "strata:stage_hidden_wait_seconds_total", "strata:stage_baton_passes_total", "strata:stage_weight_bytes",
]


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from Prometheus text, parsed by prometheus_client."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture(scope="module")
def served(tokenizer):
    """One front; the requests below run once, so the counters are exact."""
    with running_front(tokenizer, max_context=256) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=10)
        s.engine.cached_tokens = 2
        c.chat.completions.create(model="tiny-test", messages=MSGS)  # runs to its end: stop
        c.chat.completions.create(model="tiny-test", messages=MSGS, max_tokens=4)  # length
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model="tiny-test", messages=MSGS, max_tokens=1000)
        s.engine.refuse = EngineError.kv_pool_full(10, 0)
        with pytest.raises(openai.InternalServerError):
            c.chat.completions.create(model="tiny-test", messages=MSGS)
        s.engine.refuse = None
        yield s


def test_names_present_and_single_total_suffix(served):
    text = httpx.get(served.url + "/metrics").text
    names = {name for name, _ in samples(text)}
    for name in EXPOSED:
        assert name in names, name
    assert not any(n.endswith("_total_total") for n in names)


def test_values_from_requests_and_live_view(served):
    s = samples(httpx.get(served.url + "/metrics").text)
    prompt = len(served.tokenizer.chat_ids(MSGS))
    model = (("model_name", "tiny-test"),)
    script = len(served.engine.script)
    assert s[("vllm:request_success_total", (("finished_reason", "stop"), *model))] == 1
    assert s[("vllm:request_success_total", (("finished_reason", "length"), *model))] == 1
    assert s[("vllm:prompt_tokens_total", model)] == 2 * prompt
    assert s[("vllm:generation_tokens_total", model)] == script + 4
    assert s[("vllm:prefix_cache_queries_total", model)] == 2 * prompt
    assert s[("vllm:prefix_cache_hits_total", model)] == 4
    assert s[("vllm:time_to_first_token_seconds_count", model)] == 2
    assert s[("vllm:inter_token_latency_seconds_count", model)] == (script - 1) + 3
    assert s[("vllm:e2e_request_latency_seconds_count", model)] == 2
    # the live view (FakeEngine.live_metrics)
    assert s[("vllm:num_requests_waiting", model)] == 1
    assert s[("vllm:kv_cache_usage_perc", model)] == pytest.approx(0.25)
    assert s[("strata:kv_pool_cells", ())] == 1024
    assert s[("strata:kv_pool_free_cells", ())] == 768
    assert s[("strata:kv_pool_held_cells", (("slot", "0"),))] == 160
    assert s[("strata:kv_pool_held_cells", (("slot", "1"),))] == 0
    assert s[("strata:kv_pool_held_cells", (("slot", "parked:2"),))] == 96
    assert s[("strata:kv_pool_evictions_total", ())] == 3
    assert s[("strata:requests_truncated_total", ())] == 1
    assert s[("strata:decode_rows_chained_total", ())] == 5
    assert s[("strata:pipeline_groups", ())] == 2
    # the engine's refusals plus the one the front decided (context_length_exceeded)
    assert s[("strata:requests_refused_total", (("code", "kv_pool_full"),))] == 2
    assert s[("strata:requests_refused_total", (("code", "context_length_exceeded"),))] == 1


def test_window_series_per_stage(served):
    text = httpx.get(served.url + "/metrics").text
    s = samples(text)
    for name, key in WINDOW_SAMPLES.items():
        for entry in KV_WINDOW:
            assert s[(name, (("stage", str(entry["stage"])),))] == entry[key], (name, entry["stage"])
    types = {fam.name: fam.type for fam in text_string_to_metric_families(text)}
    assert types["strata:kv_window_frames"] == "gauge" and types["strata:kv_window_fills"] == "counter"


def test_stage_time_per_stage(served):
    s = samples(httpx.get(served.url + "/metrics").text)
    for entry in STAGES:
        label = (("stage", str(entry["stage"])),)
        assert s[("strata:stage_steps_total", label)] == entry["steps_run"]
        assert s[("strata:stage_steps_refused_total", label)] == entry["steps_refused"]
        assert s[("strata:stage_steps_failed_total", label)] == entry["steps_failed"]
        assert s[("strata:stage_busy_seconds_total", label)] == entry["busy_s"]
        assert s[("strata:stage_hidden_wait_seconds_total", label)] == entry["hidden_wait_s"]
        assert s[("strata:stage_baton_passes_total", label)] == entry["baton_passes"]
        if entry.get("weight_bytes") is not None:
            assert s[("strata:stage_weight_bytes", label)] == entry["weight_bytes"]
        else:
            assert ("strata:stage_weight_bytes", label) not in s


def test_no_window_series_without_a_window(served):
    served.engine.kv_window = []
    try:
        s = samples(httpx.get(served.url + "/metrics").text)
        assert not any(name.startswith("strata:kv_window") for name, _ in s)
        assert s[("strata:kv_pool_cells", ())] == 1024
    finally:
        served.engine.kv_window = [dict(w) for w in KV_WINDOW]


def test_gauges_are_read_at_scrape_time(served):
    served.engine.counters["evictions"] = 11
    try:
        s = samples(httpx.get(served.url + "/metrics").text)
        assert s[("strata:kv_pool_evictions_total", ())] == 11
    finally:
        served.engine.counters["evictions"] = 3


def test_json_format(served):
    body = httpx.get(served.url + "/metrics", params={"format": "json"}).json()
    pool = body["live"]["kv_pool"]
    assert (pool["cells"], pool["free"]) == (1024, 768)
    assert [e["cells"] for e in pool["slots"]] == [160, 0] and pool["parked"][0]["cells"] == 96
    assert body["live"]["counters"]["refusals"] == {"kv_pool_full": 2}
    assert body["requests"]["finished"] == {"stop": 1, "length": 1}
    assert body["requests"]["refused_by_front"] == {"context_length_exceeded": 1}
    assert body["latency_seconds"]["ttft"]["count"] == 2
    assert body["live"]["kv_window"] == KV_WINDOW
    assert httpx.get(served.url + "/metrics", params={"format": "xml"}).status_code == 400


class _Broken:
    model_name = "m"

    def live_metrics(self) -> dict:
        raise RuntimeError("engine restarting")


def test_the_coordinator_process_cpu_is_exposed(served):
    text = httpx.get(served.url + "/metrics").text
    cpu = samples(text)[("process_cpu_seconds_total", ())]
    assert cpu > 0  # prometheus_client's process collector over this process (Linux)


def test_a_failing_live_view_leaves_the_front_counters():
    m = Metrics(_Broken(), "m")
    m.finished("stop", 0.5, 10, 0, 3)
    s = samples(m.render().decode())
    assert s[("vllm:generation_tokens_total", (("model_name", "m"),))] == 3
    assert not any(name.startswith("strata:kv_pool") for name, _ in s)


def test_registries_are_per_object():
    a, b = Metrics(_Broken(), "m"), Metrics(_Broken(), "m")  # a global registry would refuse the second
    a.first_token(0.1)
    assert samples(b.render().decode())[("vllm:time_to_first_token_seconds_count", (("model_name", "m"),))] == 0
