"""`strata bench window` (stages/bench_window.py) at a tiny size: the rows' shape, the window's bytes per token
against the rule of stages/window.py computed here, and the dual-3080 table against an independent computation.
No timing is asserted."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from pool.config import load_config
from stages import bench_window
from stages.tiny import DEFAULT_SPEC

REPO = Path(__file__).resolve().parents[2]
SEEDS = REPO.parent / "shared" / "seeds"
C = 16  # chunk_cells


@pytest.fixture(scope="module")
def result() -> dict:
    args = bench_window.parse_args(["--contexts", "64,128", "--chunk-cells", str(C), "--frames", "1,2",
                                    "--steps", "3", "--threads", "1"])
    return bench_window.run(args)


def test_rows_per_context_and_window(result):
    rows = result["rows"]
    assert [(r["context"], r["window"], r["frames"]) for r in rows] == [
        (ctx, label, frames) for ctx, chunks in ((64, 4), (128, 8))
        for label, frames in (("off", None), ("whole", chunks), ("F=1", 1), ("F=2", 2))]
    for r in rows:
        assert set(result["columns"]) <= set(r)
        assert r["step_ms"] > 0 and r["best_ms"] <= r["step_ms"] and r["max_abs_diff"] <= bench_window.TOLERANCE
    assert all(r["over_off"] == 1 and r["h2d_bytes_tok"] is None for r in rows if r["window"] == "off")


def test_bytes_per_token_follow_the_window_rule(result):
    # tiny default, int8: K, V of kv_heads x head_dim bytes + a float32 scale per head for each, per layer.
    head_dim = DEFAULT_SPEC["hidden"] // DEFAULT_SPEC["heads"]
    cell = 2 * DEFAULT_SPEC["kv_heads"] * head_dim + 2 * DEFAULT_SPEC["kv_heads"] * 4
    frame = C * DEFAULT_SPEC["layers"] * cell
    for r in result["rows"]:
        if r["window"] == "off":
            continue
        assert r["frame_bytes"] == frame and r["d2h_bytes_tok"] == DEFAULT_SPEC["layers"] * cell
        if r["window"] == "whole":  # after the warm-up every chunk is resident: no fills, nothing streamed
            assert r["mode"] == "resident" and r["fills_tok"] == 0 and r["h2d_bytes_tok"] == 0
            assert r["hits_tok"] == r["chunks"] and r["streamed_tok"] == 0
        else:  # f - 1 frames kept (the warm steps), the other chunks streamed layer by layer
            kept = r["frames"] - 1
            assert r["mode"] == "streamed" and r["fills_tok"] == 0 and r["hits_tok"] == kept
            assert r["streamed_tok"] == (r["chunks"] - kept) * DEFAULT_SPEC["layers"]
            assert r["h2d_bytes_tok"] == (r["chunks"] - kept) * frame > 0


def test_dual_3080_rows_equal_an_independent_computation(result):
    cfg = load_config(REPO / "configs" / "dual-3080.yaml")
    e = cfg.engine
    frames = math.ceil(e.device_cells / e.chunk_cells) if isinstance(e.device_cells, int) and e.device_cells else 16
    layers = 40 // len(cfg.stages)
    frame = e.chunk_cells * layers * (2 * 8 * 128 + 2 * 8 * 4)  # 2,112 B per cell per layer
    table = result["tables"][0]
    want = []
    for ctx in (32768, 131072, 262144):
        for bw in (15.75e9, 12e9):
            chunks = ctx // e.chunk_cells
            if chunks <= frames:
                h2d = layers * 2112  # a new chunk's fill, amortized over its chunk_cells tokens
            else:
                h2d = (ctx - (frames - 1) * e.chunk_cells) * layers * 2112
            want.append((ctx, h2d / 1e9, h2d / bw * 1e3, bw / (2 * h2d), bw / h2d))
    got = [(r["context"], r["h2d_gb_tok_stage"], r["link_ms_stage"], r["lane_tok_s"], r["two_lanes_tok_s"])
           for r in table["rows"]]
    assert [v for row in got for v in row] == pytest.approx([v for row in want for v in row], rel=1e-12)
    assert f"window {frames} frames" in table["title"] and f"a frame is {frame:,} B" in " ".join(result["notes"])


def test_seed_quotes_are_in_the_seed_files(result):
    rows = result["tables"][1]["rows"]
    derived = next(r for r in rows if "per cell" in r["figure"])
    assert f"{6.24 * 2**30 / 524288:,.0f} B per cell" in derived["figure"]  # 12,780 B
    if not SEEDS.is_dir():
        pytest.skip("no seeds beside this checkout")
    quoted = [r for r in rows if r["seed"].endswith(".txt")]
    assert len(quoted) == 3
    for r in quoted:
        text = (SEEDS / r["seed"]).read_text()
        for quote in re.findall(r'"([^"]+)"', r["figure"]):
            assert quote in text, (r["seed"], quote)
