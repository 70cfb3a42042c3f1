"""A 2-stage box on the GPU under `strata up`, against the same box on CPU stages: the official client's greedy
answer is the same text, through the whole device window and through one of two frames (streamed steps), and
the pool's cells all come back. Needs CUDA (both stages share cuda:0 when there is one device)."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

from pool.config import load_config
from tests.integration.conftest import SERVING_MODEL, Server

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MESSAGES = [{"role": "user", "content": "Tell me about the pinned host pool and its device window."}]


def box(model: Path, device: str | None, **engine: object) -> Server:
    root = Path(tempfile.mkdtemp(prefix="gpu", dir="/tmp"))
    server = Server(root, model, dict(engine))
    if device is not None:
        n = torch.cuda.device_count()
        for i, stage in enumerate(server.data["stages"]):
            stage["device"] = f"cuda:{i % n}"
        server.path.write_text(yaml.safe_dump(server.data))
        server.cfg = load_config(server.path)
    server.start()
    return server


def answer(server: Server) -> str:
    out = server.openai().chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=24,
                                                   temperature=0)
    return out.choices[0].message.content


@pytest.fixture
def servers():
    """The boxes a test starts (append them); each checked clean, then stopped and removed, at its end."""
    made: list[Server] = []
    yield made
    try:
        for s in made:
            s.check_clean()
    finally:
        for s in made:
            s.stop()
            shutil.rmtree(s.root, ignore_errors=True)


@pytest.mark.parametrize("device_cells", ["auto", 32], ids=["whole-pool", "two-frames"])
def test_a_cuda_box_answers_as_the_cpu_box(tiny_model_factory, servers, device_cells):
    model = tiny_model_factory(**SERVING_MODEL)
    servers.append(box(model, None))
    want = answer(servers[0])
    servers.append(box(model, "cuda", device_cells=device_cells))
    assert answer(servers[1]) == want
    windows = servers[1].live().get("kv_window", [])
    assert len(windows) == 2 and all(w["fills"] > 0 for w in windows), windows


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_moe_and_hybrid_models_answer_on_the_gpu_as_on_cpu(tiny_model_factory, servers, arch):
    """The MoE expert matmuls and the Gated DeltaNet layers (torch reference: chunked prefill, recurrent decode,
    the state pool in device memory) on CUDA give the CPU box's greedy answer, a second turn included."""
    model = tiny_model_factory(arch, layers=4, hidden=64, heads=4, kv_heads=2, seed=5)
    servers.append(box(model, None))
    servers.append(box(model, "cuda"))
    first = [answer(s) for s in servers]
    assert first[1] == first[0]
    turn = [*MESSAGES, {"role": "assistant", "content": first[0]}, {"role": "user", "content": "And then?"}]
    again = [s.openai().chat.completions.create(model=s.model, messages=turn, max_tokens=16, temperature=0)
             for s in servers]
    assert again[1].choices[0].message.content == again[0].choices[0].message.content
    assert again[1].usage.prompt_tokens_details.cached_tokens == again[0].usage.prompt_tokens_details.cached_tokens
