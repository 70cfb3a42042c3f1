"""The layer split as real processes: 1, 2 and 3 CPU stages behind a StageLink give the same tokens.

Every test starts `python -m stages.server` processes on a tiny checkpoint, drives them through
`coordinator.link.StageLink` (no HTTP) the way the scheduler does (ops from ChunkMap/StaticMap.drain_ops()
before each step, several steps in flight), and compares greedy tokens with each other and with
transformers' own greedy generation (the oracle).
"""
from __future__ import annotations

import asyncio

import pytest
import torch

PROMPTS = {
    0: [5, 17, 99, 3, 250, 41, 8, 77, 120, 6, 33, 2],  # 12 + 33 cells: 3 chunks of 16
    1: [301, 7, 45, 12, 88, 9, 150, 23, 64, 18, 200, 11, 40, 41, 42, 43, 44, 45, 46, 47],  # 20 + 33: 4 chunks
    2: [400, 3, 15, 60, 61],  # 5 + 33: 3 chunks (10 of the pool's 12)
}
N_DECODE = 32


async def run(b) -> tuple[dict[int, list[int]], list[dict], object]:
    """Start the box's stages, run every prompt's chain at once; (tokens, stage info after, driver)."""
    b.start_all()
    link = b.link()
    await link.start(timeout=120)
    driver = b.driver(link)
    tokens = await driver.generate_all(PROMPTS, N_DECODE)
    await asyncio.sleep(3 * b.cfg.coordinator.heartbeat_ms / 1000)  # PONGs sent after the last step
    info = link.stage_info()
    link.close()
    b.stop()
    return tokens, info, driver


def hf_greedy(model_dir: str, prompts: dict[int, list[int]], n: int) -> dict[int, list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for slot, prompt in prompts.items():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
            out[slot] = ids[0, len(prompt):].tolist()
    return out


@pytest.mark.parametrize("pool", [True, False], ids=["pool", "no-pool"])
def test_two_and_three_stages_give_the_tokens_of_one(box, pool):
    results = {}
    for n_stages in (1, 2, 3):
        b = box(n_stages, pool=pool)
        tokens, info, driver = asyncio.run(run(b))
        results[n_stages] = tokens
        steps = len(PROMPTS) * (N_DECODE + 1)
        for stage in info:  # every op applied, every step run, none refused
            assert stage["version"] == driver.map.version, (n_stages, stage)
            assert (stage["steps_run"], stage["steps_refused"], stage["steps_failed"]) == (steps, 0, 0), stage
        assert driver.max_in_flight == len(PROMPTS)  # the chains were pipelined through the link
        if pool:  # interleaved chains got interleaved chunks: tables really translate
            tables = [driver.map.entries(s) for s in PROMPTS]
            assert any(t[1] != t[0] + 1 for t in tables), tables
    assert all(len(t) == N_DECODE + 1 for t in results[1].values())
    assert results[2] == results[1]
    assert results[3] == results[1]
    assert results[1] == hf_greedy(b.data["model"], PROMPTS, N_DECODE + 1)


def test_tcp_endpoints_work_too(box):
    ipc, _, _ = asyncio.run(run(box(1)))
    b = box(2, transport="tcp")
    assert all(s.endpoint.startswith("tcp://127.0.0.1:") for s in b.cfg.stages)
    tcp, info, _ = asyncio.run(run(b))
    assert tcp == ipc
    assert [s["layers"] for s in info] == [[0, 2], [2, 4]]
