"""The device window's counters in /metrics: `strata up` with two CPU stages, each with a window of two frames.

A first short chat fits the window (its chunks are filled whole); a second turn of the same conversation is
longer than the window, so its steps stream. Every stage's counters then show fills, bytes both ways and
streamed steps, in the Prometheus text (parsed by prometheus_client) and in the JSON view alike. The values
come from each stage's last heartbeat answer, so the test reads them once they have settled.
"""
from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

CHUNK_CELLS = 16
FRAMES = 2
MAX_TOKENS = 6
SHORT = [{"role": "user", "content": "Hi."}]
LONG = ("Tell me, in your own words and at some length, where the river ran after the rain, who walked along "
        "its banks that morning, what the children of the village saw there, and why nobody went home early.")
GAUGES = {"frames": "frames", "cells": "cells", "resident_frames": "resident", "device_bytes": "device_bytes"}
COUNTERS = ("steps", "streamed_steps", "hits", "fills", "stale", "evictions", "streamed", "h2d_bytes", "d2h_bytes")


@pytest.fixture(scope="module")
def server(strata_up):
    return strata_up(chunk_cells=CHUNK_CELLS, device_cells=FRAMES * CHUNK_CELLS)


@pytest.fixture(autouse=True)
def clean(server):
    yield
    server.check_clean()


def window_samples(text: str) -> dict[tuple[str, str], float]:
    """{(sample name, stage label): value} of the strata:kv_window_* samples, parsed by prometheus_client."""
    return {(s.name, s.labels["stage"]): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.startswith("strata:kv_window_")}


def settled(server, timeout: float = 10) -> list[dict]:
    """live.kv_window once both stages report the same steps and two reads a few heartbeats apart agree."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        stages = server.live()["kv_window"]
        if stages == last and len(stages) == 2 and len({s["steps"] for s in stages}) == 1:
            return stages
        assert time.monotonic() < deadline, f"window counters did not settle: {stages}"
        last = stages
        time.sleep(0.3)


def test_window_counters_in_both_views(server):
    client = server.openai()
    first = client.chat.completions.create(model=server.model, messages=SHORT, max_tokens=MAX_TOKENS, temperature=0)
    assert first.usage.total_tokens <= FRAMES * CHUNK_CELLS  # fits the window: resident steps, chunks filled
    turn2 = [*SHORT, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": LONG}]
    second = client.chat.completions.create(model=server.model, messages=turn2, max_tokens=MAX_TOKENS, temperature=0)
    assert second.usage.prompt_tokens > FRAMES * CHUNK_CELLS  # longer than the window: streamed steps
    server.wait_idle()

    stages = settled(server)
    text = server.http.get("/metrics").text
    assert server.live()["kv_window"] == stages  # nothing moved while the text was read
    s = window_samples(text)
    assert [e["stage"] for e in stages] == [0, 1]
    for e in stages:
        i = str(e["stage"])
        assert (e["frames"], e["cells"]) == (FRAMES, FRAMES * CHUNK_CELLS)
        assert e["steps"] > e["streamed_steps"] > 0 and e["fills"] > 0 and e["streamed"] > 0
        assert e["h2d_bytes"] > 0 and e["d2h_bytes"] > 0 and e["device_bytes"] > 0
        assert 0 <= e["resident"] <= FRAMES
        for name, key in GAUGES.items():
            assert s[(f"strata:kv_window_{name}", i)] == e[key], (name, i)
        for key in COUNTERS:
            assert s[(f"strata:kv_window_{key}_total", i)] == e[key], (key, i)
    assert s[("strata:kv_window_frames", "0")] == s[("strata:kv_window_frames", "1")] == FRAMES
    assert all(s[(f"strata:kv_window_{k}_total", i)] > 0 for k in ("fills", "h2d_bytes", "d2h_bytes") for i in "01")
    # Each stage's own time: it computed every step it ran; stage 1 also waited for stage 0's hidden states.
    busy = {(x.name, x.labels["stage"]): x.value for fam in text_string_to_metric_families(text)
            for x in fam.samples if x.name.startswith("strata:stage_")}
    for i in "01":
        assert busy[("strata:stage_steps_total", i)] == stages[int(i)]["steps"]
        assert 0 < busy[("strata:stage_busy_seconds_total", i)] < 60
        # none refused or failed, as the stage's own PONG counts them
        assert busy[("strata:stage_steps_refused_total", i)] == busy[("strata:stage_steps_failed_total", i)] == 0
    assert busy[("strata:stage_hidden_wait_seconds_total", "0")] == 0
    # the sockets went to the compute thread once built, and around the first step (stages/baton.py rule 3)
    assert all(busy[("strata:stage_baton_passes_total", i)] >= 3 for i in "01")
    # weights as loaded, from each stage's HELLO: the first holds the embedding, the last the lm_head
    assert all(busy[("strata:stage_weight_bytes", i)] > 0 for i in "01")
    assert busy[("strata:stage_hidden_wait_seconds_total", "1")] > 0
