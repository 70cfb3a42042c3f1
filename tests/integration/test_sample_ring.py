"""Chained steps on a layer split (pool/step_chain.py rule 6, the ring), on real stage processes behind a real link:
the last stage sends what it sampled to the first stage's data endpoint, and a chained step reads it there.

- Chained decode steps, each sent before the step it reads has come back, give the tokens of plain steps, on
  two stages over ipc and three over tcp.
- A chained step whose samples will never come (the step it reads failed) fails, having run nothing, and the
  box goes on.
- A chained step waiting at the first stage for the samples of a step frozen at the last stage, which then
  dies: both fail at once, the first stage is told to stop waiting (a HELLO from the link), and after the
  restart the box answers as before. Without that HELLO the first stage would hold every later step until
  the step deadline marks it down too.
(A rogue SAMPLES is in test_box_isolation.py.)
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from coordinator.link import StageDown, StepFailed
from pool.step_chain import CHAINED
from tests.integration.conftest import GREEDY

PROMPT = [5, 17, 99, 3, 250, 41, 8, 77]


def send(d, slots: list[list[int]], tokens: list[int], reserve: bool = True, **extra: object) -> tuple[int, asyncio.Future]:
    """conftest's Driver.step without waiting: (step id, future), so a chained step can name a step in flight."""
    if reserve:
        for slot, start, n, _ in slots:
            assert d.map.reserve(slot, start + n)
    d.link.send_ops(d.map.drain_ops())
    header = {"version": d.map.version, "slots": slots, "sampling": {}, **extra}
    fut = d.link.submit(header, tokens)
    return d.link._last_step, fut


async def started(b, n_decode: int) -> tuple:
    """(link, driver, slot 0's greedy tokens: the answer every later request must give again)."""
    b.start_all()
    link = b.link()
    await link.start(timeout=60)
    d = b.driver(link)
    return link, d, await d.generate(0, PROMPT, n_decode)


async def prefill(d, slot: int) -> int:
    res = await d.step([[slot, 0, len(PROMPT), 1]], PROMPT, {slot: dict(GREEDY)})
    return res["tokens"][0][1]


@pytest.mark.parametrize("n_stages,transport", [(2, "ipc"), (3, "tcp")])
def test_chained_steps_on_a_split_read_the_last_stages_samples(box, n_stages, transport):
    b = box(n_stages, transport=transport, chain_steps=True)

    async def scenario() -> None:
        link, d, want = await started(b, 6)
        out, pos = [await prefill(d, 1)], len(PROMPT)
        prev = send(d, [[1, pos, 1, 1]], [out[-1]])
        for i in range(6):
            nxt = send(d, [[1, pos + 1, 1, 1]], [CHAINED], chain=[[0, prev[0]]]) if i < 5 else None
            res = await prev[1]
            out.append(res["tokens"][0][1])
            pos, prev = pos + 1, nxt
        assert out == want
        d.map.release(0)
        d.map.release(1)
        link.close()

    asyncio.run(scenario())


def test_a_step_chained_on_a_failed_one_fails_and_the_box_goes_on(box):
    b = box(2, chain_steps=True)

    async def scenario() -> None:
        link, d, want = await started(b, 3)
        tok, pos = await prefill(d, 1), len(PROMPT)
        assert d.map.reserve(1, pos + 1)
        bad = send(d, [[9, pos, 1, 1]], [tok], reserve=False)  # slot 9 of 4: refused on every stage
        chained = send(d, [[1, pos, 1, 1]], [CHAINED], chain=[[0, bad[0]]])
        with pytest.raises(StepFailed, match="slot 9 does not exist"):
            await bad[1]
        with pytest.raises(StepFailed, match="will not come"):
            await chained[1]
        for slot in (0, 1):
            d.map.release(slot)
        assert await d.generate(2, PROMPT, 3) == want
        link.close()

    asyncio.run(scenario())
    assert "event=step.dropped" in b.log(0)


def test_a_chained_step_waiting_on_a_dead_last_stage_fails_and_the_first_stage_serves_again(box):
    b = box(2, chain_steps=True)

    async def scenario() -> None:
        link, d, want = await started(b, 3)
        tok, pos = await prefill(d, 1), len(PROMPT)
        os.kill(b.procs[1].pid, signal.SIGSTOP)  # the plain step waits at stage 1, its samples with it
        plain = send(d, [[1, pos, 1, 1]], [tok])
        chained = send(d, [[1, pos + 1, 1, 1]], [CHAINED], chain=[[0, plain[0]]])
        await asyncio.sleep(0.3)
        assert not plain[1].done() and not chained[1].done()
        t0 = time.monotonic()
        b.kill(1)
        for fut in (plain[1], chained[1]):
            with pytest.raises(StageDown):
                await fut
        assert time.monotonic() - t0 < 2.0
        b.start(1)
        deadline = time.monotonic() + 60
        while not all(link.stages_up):
            assert time.monotonic() < deadline, "stage 1 did not rejoin"
            await asyncio.sleep(0.05)
        for slot in (0, 1):
            d.map.release(slot)
        # stage 0 gave up the chained step: the next request goes through it
        assert await asyncio.wait_for(d.generate(2, PROMPT, 3), 30) == want
        link.close()

    asyncio.run(scenario())
