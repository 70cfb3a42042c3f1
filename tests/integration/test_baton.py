"""stages/baton.py on a live stage: short steps are read and answered by the compute thread itself, without the
baton changing hands; a step predicted to outlast a tenth of stage_timeout_ms gives the sockets to the I/O thread,
which keeps answering PINGs, so the link does not declare the stage down while it computes."""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from stages.runner import StageRunner
from stages.server import StageServer

STEP_S = 0.01  # every step sleeps this much: its rate per row is known whatever the machine
LONG_ROWS = 32  # a step of more rows sleeps LONG_S, more than the box's stage_timeout_ms (1500 ms)
LONG_S = 2.5


class SlowRunner:
    """A StageRunner whose steps take at least STEP_S, and LONG_S when they carry more than LONG_ROWS rows."""

    def __init__(self, runner: StageRunner) -> None:
        self._runner = runner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def step(self, header: dict, tokens: Any, hidden: Any) -> Any:
        rows = sum(entry[2] for entry in header["slots"])
        time.sleep(LONG_S if rows > LONG_ROWS else STEP_S)
        return self._runner.step(header, tokens, hidden)


def test_short_steps_keep_the_baton_and_a_long_one_hands_it_over(box):
    b = box(1)
    assert b.cfg.coordinator.stage_timeout_ms / 1000 < LONG_S
    server = StageServer(b.cfg, 0, lambda: SlowRunner(StageRunner(b.cfg, 0, pool_path=str(b.root / "pool0"))))
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()

    async def passes(link) -> int:
        await asyncio.sleep(0.5)  # a PONG sent after the last answer
        return link.stage_info()[0]["baton_passes"]

    async def scenario() -> None:
        link = b.link()
        await link.start(timeout=60)
        try:
            d = b.driver(link)
            await d.generate(0, [5, 17, 99, 3], 3)  # the first step is handed over: nothing to predict it by
            first = await passes(link)
            assert first >= 3, first  # to the compute thread once built, to the I/O thread and back
            await d.generate(1, [8, 77, 41, 250], 8)  # 4 rows x ~10 ms per row: kept (150 ms)
            held = await passes(link)
            assert held - first <= 2, (first, held)  # 9 steps; one machine hiccup may hand one over
            long_prompt = list(range(3, 3 + 40))
            out = await d.generate(2, long_prompt, 2)  # 40 rows x >= 10 ms: handed over; it sleeps 2.5 s
            assert len(out) == 3
            assert await passes(link) >= held + 2
            assert link.stage_info()[0]["steps_failed"] == 0
            for slot in (0, 1, 2):  # every cell back, on the map and the stage's mirror
                d.map.shrink(slot, 0)
            link.send_ops(d.map.drain_ops())
            assert d.map.free_chunks == b.cfg.engine.n_chunks
        finally:
            link.close()

    try:
        asyncio.run(scenario())
    finally:
        server.stop.set()
        serving.join(10)
        server.close()
