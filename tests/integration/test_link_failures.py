"""What the link refuses and how it survives: mismatched stages, steps ahead of their ops, failing steps,
a killed stage, a frozen stage, and `strata up` restarting a stage that died."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from coordinator.link import LinkError, StageDown, StepFailed, check_hellos
from pool.config import load_config
from pool.memory import default_path

PROMPT = [5, 17, 99, 3, 250, 41, 8, 77]
GREEDY = {"temperature": 0.0}


def hello(i: int, layers: list[int], **kw: object) -> dict:
    h = {"stage": i, "layers": layers, "model_layers": 4, "model_fp": "m0", "config_fp": "c0",
         "pool": {"n_chunks": 32, "chunk_cells": 16, "table_chunks": 4}}
    return {**h, **kw}


@pytest.mark.parametrize("hellos, message", [
    ([hello(0, [0, 2]), hello(1, [2, 5])], "stage 1 serves layers [2, 5) but stage 0 ends at 2 and the model has 4 layers"),
    ([hello(0, [0, 2]), hello(1, [3, 4])], "stage 1 serves layers [3, 4) but stage 0 ends at 2 and the model has 4 layers"),
    ([hello(0, [0, 2]), hello(1, [1, 4])], "stage 1 serves layers [1, 4) but stage 0 ends at 2 and the model has 4 layers"),
    ([hello(0, [0, 2]), hello(1, [2, 3])], "stage 1 serves layers [2, 3) but stage 0 ends at 2 and the model has 4 layers"),
    ([hello(0, [1, 4])], "stage 0 serves layers [1, 4) but the first stage must start at 0 and the model has 4 layers"),
    ([hello(0, [0, 2]), hello(1, [2, 4], model_fp="m1")], "stage 1 has checkpoint fp m1, stage 0 has m0"),
    ([hello(0, [0, 2]), hello(1, [2, 4], pool={"n_chunks": 64, "chunk_cells": 16, "table_chunks": 4})],
     "stage 1 has 64 chunks, stage 0 has 32"),
    ([hello(0, [0, 2]), hello(1, [2, 4], pool={"n_chunks": 32, "chunk_cells": 8, "table_chunks": 4})],
     "stage 1 has chunk_cells 8, stage 0 has 16"),
    ([hello(0, [0, 2]), hello(1, [2, 4], config_fp="c1")], "stage 1 has config fp c1, stage 0 has c0"),
    ([hello(0, [0, 4], config_fp="c1")], "stage 0 has config fp c1, the coordinator has c0"),
    ([hello(0, [0, 2]), hello(0, [2, 4])], "stage 1's endpoint is answered by a stage started as --device 0"),
])
def test_check_hellos_names_the_mismatch(hellos, message):
    with pytest.raises(LinkError) as err:
        check_hellos(hellos, "c0")
    assert str(err.value) == message


def test_check_hellos_accepts_a_good_split():
    check_hellos([hello(0, [0, 1]), hello(1, [1, 3]), hello(2, [3, 4])], "c0")


async def expect_refusal(b, cfg=None) -> str:
    link = b.link(cfg)
    with pytest.raises(LinkError) as err:
        await link.start(timeout=60)
    return str(err.value)


def test_mismatched_stages_are_refused_with_the_reason(box, tiny_model_factory):
    b = box(2)
    b.start(0)
    fp = re.compile(r"[0-9a-f]{16}")
    gap = b.write_variant("gap", stages=[{**b.data["stages"][0], "layers": [0, 2]},
                                         {**b.data["stages"][1], "layers": [2, 3]}])
    beyond = b.write_variant("beyond", stages=[{**b.data["stages"][0], "layers": [0, 2]},
                                               {**b.data["stages"][1], "layers": [2, 5]}])
    other = tiny_model_factory("qwen3", layers=4, hidden=64, heads=4, kv_heads=2, seed=4)
    cases = [
        ({"config": gap}, lambda m: m == "stage 1 serves layers [2, 3) but stage 0 ends at 2 and the model has 4 layers"),
        ({"config": beyond}, lambda m: m == "stage 1 could not start: stages.1.layers=[2, 5) but the model has 4 layers"),
        ({"overrides": [f"model={other}"]},
         lambda m: re.fullmatch(r"stage 1 has checkpoint fp [0-9a-f]{16}, stage 0 has [0-9a-f]{16}", m)),
        ({"overrides": ["engine.kv_pool_tokens=256"]}, lambda m: m == "stage 1 has 16 chunks, stage 0 has 12"),
        ({"overrides": ["engine.max_waiting=7"]}, lambda m: len(fp.findall(m)) == 2 and
         m.startswith("stage 1 has config fp ") and ", stage 0 has " in m),
    ]
    for case, ok in cases:
        _restart(b, 1, *case.get("overrides", []), config=case.get("config"))
        message = asyncio.run(expect_refusal(b))
        assert ok(message), (case, message, b.log(1)[-2000:])
    # Both stages agree, but the coordinator runs another config.
    _restart(b, 1)
    message = asyncio.run(expect_refusal(b, load_config(b.path, ["engine.max_waiting=7"])))
    assert re.fullmatch(r"stage 0 has config fp [0-9a-f]{16}, the coordinator has [0-9a-f]{16}", message), message
    # And the same processes serve a matching coordinator afterwards (a new session each time).
    assert asyncio.run(_generate_once(b)) == asyncio.run(_generate_once(b))


def _restart(b, i: int, *overrides: str, config: Path | None = None) -> None:
    if i in b.procs:
        proc = b.procs.pop(i)
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    b.start(i, *overrides, config=config)


async def _generate_once(b, slot: int = 0, n: int = 3) -> list[int]:
    link = b.link()
    await link.start(timeout=60)
    try:
        return await b.driver(link).generate(slot, PROMPT, n)
    finally:
        link.close()


async def _stats(link, stage: int) -> dict:
    """The stage's counters from a PONG sent after everything before this call."""
    await asyncio.sleep(0.6)
    return link.stage_info()[stage]


def test_a_step_ahead_of_its_ops_is_refused_and_never_runs(box):
    b = box(2)
    b.start_all()

    async def scenario() -> None:
        link = b.link()
        await link.start(timeout=60)
        d = b.driver(link)
        assert d.map.reserve(0, len(PROMPT))
        ops = d.map.drain_ops()
        header = {"version": d.map.version, "slots": [[0, 0, len(PROMPT), 1]], "sampling": {0: GREEDY}}
        with pytest.raises(StepFailed, match="needs table version 1 but this stage has applied ops up to version 0"):
            await link.step(header, PROMPT)  # the test hook: STEP sent before its OPS
        link.send_ops(ops)
        for i in (0, 1):
            s = await _stats(link, i)
            assert (s["steps_run"], s["steps_refused"], s["version"]) == (0, 1, 1), s
        first = (await link.step(header, PROMPT))["tokens"][0][1]  # the same step, now after its ops

        # Only stage 1 misses an op: stage 0 runs the step, stage 1 refuses it.
        assert d.map.reserve(1, len(PROMPT))
        ops = d.map.drain_ops()
        link.send_ops(ops, stage=0)
        header1 = {"version": d.map.version, "slots": [[1, 0, len(PROMPT), 1]], "sampling": {1: GREEDY}}
        with pytest.raises(StepFailed) as err:
            await link.step(header1, PROMPT)
        assert err.value.stage == 1
        link.send_ops(ops, stage=1)
        assert (await link.step(header1, PROMPT))["tokens"][0][1] == first
        s0, s1 = await _stats(link, 0), await _stats(link, 1)
        assert (s0["steps_run"], s0["steps_refused"]) == (3, 1)
        assert (s1["steps_run"], s1["steps_refused"]) == (2, 2)
        # A fresh conversation on slot 2 confirms nothing stale was written anywhere.
        assert (await d.generate(2, PROMPT, 0)) == [first]
        link.close()

    asyncio.run(scenario())


def test_a_failing_step_fails_alone_and_the_stage_keeps_serving(box):
    b = box(2)
    b.start_all()

    async def scenario() -> None:
        link = b.link()
        await link.start(timeout=60)
        d = b.driver(link)
        assert d.map.reserve(0, 3)
        link.send_ops(d.map.drain_ops())
        header = {"version": d.map.version, "slots": [[0, 0, 3, 1]], "sampling": {0: GREEDY}}
        with pytest.raises(StepFailed, match="step has 3 tokens but the input has 2 rows") as err:
            await link.step(header, [1, 2])  # three tokens promised, two sent: the model raises
        assert err.value.stage == 0 and all(link.stages_up)
        assert len(await d.generate(1, PROMPT, 2)) == 3
        link.close()

    asyncio.run(scenario())


async def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def test_a_killed_stage_fails_the_step_in_flight_and_rejoins_when_restarted(box):
    """SIGKILL the middle of three stages while a step waits on it; restart it; the next prefill succeeds."""
    b = box(3)
    b.start_all()

    async def scenario() -> None:
        link = b.link()
        downs: list[tuple[int, str]] = []
        await link.start(timeout=60)
        d = b.driver(link)
        link.on_stage_down = lambda i, why: downs.append((i, why))
        before = await d.generate(0, PROMPT, 4)
        os.kill(b.procs[1].pid, signal.SIGSTOP)  # hold the step at stage 1 so it is surely in flight
        pos = len(PROMPT) + 4
        step = asyncio.create_task(d.step([[0, pos, 1, 1]], [before[-1]]))
        await asyncio.sleep(0.3)
        assert not step.done()
        t0 = time.monotonic()
        b.kill(1)
        with pytest.raises(StageDown) as err:
            await step
        elapsed = time.monotonic() - t0
        assert elapsed < 2.0, elapsed
        assert err.value.index == 1 and downs and downs[0][0] == 1
        assert link.stages_up == [True, False, True]
        with pytest.raises(StageDown):  # no new step while a stage is down
            await d.step([[1, 0, 1, 1]], [PROMPT[0]])
        print(f"in-flight step failed {elapsed:.3f} s after SIGKILL ({err.value.reason})")

        b.start(1)
        await _until(lambda: all(link.stages_up), 60, "stage 1 to rejoin")
        info = link.stage_info()[1]
        assert info["pid"] == b.procs[1].pid
        d.map.release(0)  # its K/V on stage 1 is not trusted any more
        after = await d.generate(2, PROMPT, 4)  # the next prefill, through the restarted stage
        assert after == before
        link.close()

    asyncio.run(scenario())


def test_a_frozen_stage_is_down_within_2s_and_rejoins_when_it_wakes(box):
    """SIGSTOP: the socket stays connected, only the heartbeat can tell. SIGCONT: the same process rejoins."""
    b = box(2)
    b.rewrite(coordinator={})  # the defaults: heartbeat 250 ms, timeout 1500 ms
    assert (b.cfg.coordinator.heartbeat_ms, b.cfg.coordinator.stage_timeout_ms) == (250, 1500)
    b.start_all()

    async def scenario() -> None:
        link = b.link()
        await link.start(timeout=60)
        d = b.driver(link)
        before = await d.generate(0, PROMPT, 2)
        await asyncio.sleep(0.5)
        os.kill(b.procs[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        step = asyncio.create_task(d.generate(1, PROMPT, 2))
        with pytest.raises(StageDown) as err:
            await step
        elapsed = time.monotonic() - t0
        assert elapsed < 2.0, elapsed
        assert err.value.index == 1 and "no answer" in err.value.reason
        print(f"frozen stage found down after {elapsed:.3f} s ({err.value.reason})")
        os.kill(b.procs[1].pid, signal.SIGCONT)
        await _until(lambda: all(link.stages_up), 30, "stage 1 to rejoin")
        assert await d.generate(3, PROMPT, 2) == before
        link.close()

    asyncio.run(scenario())


def test_a_new_coordinator_is_not_held_up_by_steps_a_dead_stage_left_behind(box):
    """Stage 1 holds two steps whose hidden states will never come (stage 0 froze, then died); the next
    coordinator's HELLO must drop them rather than queue behind them."""
    b = box(2)
    b.start_all()

    async def first_coordinator() -> None:
        link = b.link()
        await link.start(timeout=60)
        d = b.driver(link)
        os.kill(b.procs[0].pid, signal.SIGSTOP)
        steps = [asyncio.create_task(d.generate(s, PROMPT, 0)) for s in (0, 1)]
        await asyncio.sleep(0.3)
        link.close()
        for t in steps:
            with pytest.raises(StageDown):
                await t

    asyncio.run(first_coordinator())
    b.kill(0)
    b.start(0)

    async def second_coordinator() -> list[int]:
        link = b.link()
        await link.start(timeout=20)
        try:
            return await b.driver(link).generate(2, PROMPT, 2)
        finally:
            link.close()

    assert len(asyncio.run(second_coordinator())) == 3
    assert "event=step.dropped" in b.log(1)


def _http(port: int, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")
    except OSError:
        return 0, {}


def _procs_under(root: Path) -> list[int]:
    """Pids of live processes whose command line names `root` (the box's config path)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
                state = (entry / "stat").read_text().split(")")[-1].split()[0]
            except OSError:
                continue
            if str(root).encode() in cmd and state != "Z":
                pids.append(int(entry.name))
    return pids


def test_strata_up_restarts_a_dead_stage_and_stops_everything(box):
    b = box(2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = b.write_variant("up", coordinator={"port": port})
    log = b.root / "up.log"
    fp = load_config(path).fingerprint()
    pool_files = [default_path(f"{fp}-stage{i}") for i in range(2)]
    with open(log, "wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "up", "--config", str(path)],
                              cwd=Path(__file__).resolve().parents[2], stdout=out, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        def wait_health(timeout: float) -> dict:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                status, body = _http(port, "/health")
                if status == 200 and body.get("status") == "ok":
                    return body
                assert up.poll() is None, log.read_text()
                time.sleep(0.2)
            raise AssertionError(f"no healthy /health in {timeout} s:\n{log.read_text()}")

        wait_health(90)
        m = re.search(r"pids: coordinator (\d+), stages (\d+) (\d+)", log.read_text())
        assert m, log.read_text()
        coord, s0, s1 = (int(g) for g in m.groups())
        request = {"prompt": [5, 17, 99, 3], "max_tokens": 4, "temperature": 0}
        status, first = _http(port, "/v1/completions", request)
        assert status == 200, first
        os.kill(s1, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while "restarting stage 1" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        wait_health(60)
        status, again = _http(port, "/v1/completions", request)
        assert status == 200 and again["choices"][0]["text"] == first["choices"][0]["text"], again
        procs = set(_procs_under(b.root))
        assert s1 not in procs and {up.pid, coord, s0} < procs and len(procs) == 4  # a new stage 1
        assert pool_files[1].exists()  # the crash left it; the new stage 1 re-attached it
        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0
        assert _procs_under(b.root) == [], log.read_text()  # no orphans
        assert not any(f.exists() for f in pool_files)  # a clean stop removes the pool files
    finally:
        for f in pool_files:
            f.unlink(missing_ok=True)
        for pid in [up.pid, *_procs_under(b.root)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        up.wait()
