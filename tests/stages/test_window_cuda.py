"""The device window on a CUDA stage, against its CPU run (the torch reference): the pool file pinned, frames in
device memory filled on the copy stream, write-through to the host pool, streamed steps merged exactly.
Every test here needs CUDA; tests/gpu/run.sh runs them with the other CUDA checks."""
from __future__ import annotations

import pytest
import torch

from tests.stages.harness import PROMPT_A, Local, make_cfg
from tests.stages.test_window import C, LONG, long_conversation, moves, split_matches_paged

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cuda_cfg(model_dir, ranges, **engine):
    cfg = make_cfg(model_dir, ranges, **engine)
    for s in cfg.stages:
        s.device = "cuda:0"
    return cfg


def close_to(got, want, atol=1e-3):
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < atol


@pytest.mark.parametrize("frames", ["auto", 1, 3])
def test_a_long_conversation_on_cuda_matches_the_cpu_run(model_dir, tmp_path, frames):
    cpu = Local(make_cfg(model_dir, [[0, 4]], **LONG), tmp_path, tag="cpu")
    want = long_conversation(cpu)
    cpu.close()
    cells = frames if frames == "auto" else frames * C
    m = Local(cuda_cfg(model_dir, [[0, 4]], device_cells=cells, **LONG), tmp_path, tag="cuda")
    try:
        r = m.runners[0]
        assert r.pinned and r.memory.pinned and r.kv.device.type == "cpu"
        assert r.window.frames.k[0].device.type == "cuda"
        assert r.window.n_frames == (r.kv.n_chunks if frames == "auto" else frames)
        close_to(long_conversation(m), want)
        for chunk, f in r.window._frame_of.items():  # the copy stream and the write-through kept them equal
            for frame_arr, host_arr in zip(r.window.frames.arrays(), r.kv.arrays()):
                assert torch.equal(frame_arr[f].cpu(), host_arr[chunk])
    finally:
        m.close()


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_moves_on_a_two_stage_cuda_box_match_the_cpu_run(model_dir, tmp_path, kv_dtype):
    engine = {"max_context": 96, "kv_pool_tokens": 256, "kv_dtype": kv_dtype}
    cpu = Local(make_cfg(model_dir, [[0, 2], [2, 4]], **engine), tmp_path, tag="cpu")
    want = moves(cpu)
    cpu.close()
    m = Local(cuda_cfg(model_dir, [[0, 2], [2, 4]], device_cells=4 * C, **engine), tmp_path, tag="cuda")
    try:
        close_to(moves(m), want, atol=1e-2 if kv_dtype == "int8" else 1e-3)
    finally:
        m.close()


def test_a_reattached_cuda_stage_decodes_on(model_dir, tmp_path):
    cfg = cuda_cfg(model_dir, [[0, 4]], device_cells=2 * C)
    a = Local(cfg, tmp_path)
    want = a.generate(0, PROMPT_A, 10)
    a.close()
    b = Local(cfg, tmp_path)
    got = b.generate(0, PROMPT_A, 4)
    b.close(unlink=False)
    c = Local(cfg, tmp_path)
    try:
        c.map = b.map
        c.runners[0].load_snapshot(c.map.snapshot_ops())
        got += c.decode(0, len(PROMPT_A) + 4, got[-1], 6, sampling={0: {"temperature": 0.0}})
        assert got == want
    finally:
        c.close()


def test_split_attention_on_cuda_matches_paged_attention():
    split_matches_paged("cuda")
