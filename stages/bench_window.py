"""`strata bench window`: what the device window (stages/window.py) costs a decode step, and how many bytes it
moves per token, against the window's size and the context. Run by `coordinator.bench` as a child process
(`python -m stages.bench_window --json PATH ...`).

Measured, on CPU (the window's frames are a separate CPU array, so host -> frame is a memcpy: this measures the
mechanism's own overhead, not a PCIe link). For each context of C cells, one slot of a one-stage runner of the
tiny model decodes through a held conversation: the pool is filled with seeded K/V for cells [0, C), then
`warmup + steps` decode steps end at context C. Variants, each on a fresh runner over the same pool bytes:

    off      no window: the plain paged path over the pool
    whole    frames >= the context's chunks: every step resident once the first step filled them
    F=f      f frames, f < the context's chunks: every step streamed (rule 3 of stages/window.py)

A streamed step keeps at most f - 1 valid frames of the chunks it reads; which ones hold a chunk depends on how
the conversation was read. Reading a prompt in pieces of at most one chunk fills chunks 0 .. f - 1 while they
fit, and every streamed step after that keeps f - 1 of them. Every variant runs the same warm steps first: one
step of one token at cell (f - 1) * chunk_cells - 1 for each f of the frames list (2 <= f < chunks, ascending),
which leaves exactly that state. Each variant's greedy tokens and logprobs must equal those of `off` (within
TOLERANCE) before its timing is reported. Per decoded token, from the window's counters: h2d bytes (fills and
streamed chunk layers), d2h bytes (write-through), fills, streamed chunk layers, hits.

Computed (no run), `dual_3080`: the same rule for the dual-3080 box (configs/dual-3080.yaml: two stages, one
RTX 3080 each on PCIe 3.0) with Qwen3-14B's attention (40 layers, 20 per stage, kv_heads 8, head_dim 128, int8
K/V: 2 x 8 x 128 + 2 x 8 x 4 = 2,112 B per cell per layer) and a window of the config's `device_cells` (16
frames when it leaves `auto`). A step whose chunks fit the window is resident: it copies in only a new chunk, once
per chunk_cells tokens. One that does not fit keeps f - 1 frames and streams the rest, per stage and per token

    h2d = (chunks - (f - 1)) x chunk_cells x 20 layers x 2,112 B      (= (C - resident cells) x 20 x 2,112 B)

through the link: at PCIe 3.0 x16 (15.75 GB/s theoretical: 8 GT/s x 16 lanes x 128/130 b) and at ~12 GB/s (a
realistic pinned copy). One lane's token crosses the two stages in turn (tok/s <= 1 / (2 t)); two lanes in flight
keep both links busy (<= 1 / t in all). `seed_figures`: what the seeds (../shared/seeds/) state for their box,
quoted with the file each comes from, and the per-cell bytes their figures imply.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pool.chunk_map import ChunkMap
from pool.config import config_from_dict, load_config
from pool.memory import PoolLayout
from pool.window_plan import frame_bytes, window_bytes
from stages.bench_pool import CONFIGS, write_result
from stages.runner import StageRunner
from stages.tiny import ensure_tiny

TOLERANCE = 1e-4
GREEDY = {"temperature": 0.0}
FIRST_TOKEN = 1
WINDOW_COUNTERS = ("h2d_bytes", "d2h_bytes", "fills", "streamed", "hits", "streamed_steps")


def make_runner(model_dir: Path, ctx: int, chunk_cells: int, kv_dtype: str, device_cells: int, threads: int,
                pool_dir: Path, tag: str) -> StageRunner:
    """A one-stage CPU runner over the whole model: one slot, a pool of exactly the context's chunks."""
    engine = {"max_context": ctx, "parallel": 1, "chunk_cells": chunk_cells, "kv_pool_tokens": ctx,
              "prefill_chunk": min(ctx, 512), "kv_dtype": kv_dtype, "threads": threads,
              "device_cells": device_cells}
    stages = [{"device": "cpu", "layers": [0, model_layers(model_dir)], "endpoint": "ipc:///tmp/strata-bench-window"}]
    cfg = config_from_dict({"model": str(model_dir), "engine": engine, "stages": stages})
    return StageRunner(cfg, 0, pool_path=pool_dir / f"pool-{tag}")


def model_layers(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]


def hold_conversation(runner: StageRunner, ctx: int, seed: int) -> ChunkMap:
    """Reserve [0, ctx) for slot 0 (ops and generations applied as OPS would) and fill the pool with seeded K/V."""
    e = runner.cfg.engine
    cmap = ChunkMap(e.n_chunks, e.chunk_cells, e.table_chunks, n_slots=1)
    assert cmap.reserve(0, ctx), "the bench pool holds exactly one context"
    ops = cmap.drain_ops()
    for op in ops:
        runner.apply(op)
    runner.record_generations(cmap.generations_of(ops))
    gen = torch.Generator().manual_seed(seed)
    for arr in runner.kv.arrays():
        if arr.dtype == torch.int8:
            arr.copy_(torch.randint(-127, 128, arr.shape, generator=gen, dtype=torch.int8))
        elif runner.kv.quantized and arr.dim() == 3:  # an int8 array's float32 scales: [chunks, cells, heads]
            arr.copy_(torch.rand(arr.shape, generator=gen) * 0.02 + 0.005)
        else:
            arr.copy_(torch.randn(arr.shape, generator=gen, dtype=arr.dtype))
    return cmap


def warm_positions(frames: list[int], chunks: int, chunk_cells: int) -> list[int]:
    """Cells of the warm steps (module docstring): one per f of `frames` with 2 <= f < chunks, ascending."""
    return [(f - 1) * chunk_cells - 1 for f in sorted(set(frames)) if 2 <= f < chunks]


class Decode:
    """One variant: warm steps, then decode steps ending at context `ctx`, each step timed."""

    def __init__(self, runner: StageRunner, cmap: ChunkMap) -> None:
        self.runner, self.cmap, self.step_id = runner, cmap, 0

    def step(self, start: int, token: int, sample: bool, sampling: dict | None = None) -> list:
        self.step_id += 1
        header = {"step": self.step_id, "version": self.cmap.version, "slots": [[0, start, 1, int(sample)]],
                  "sampling": sampling or {}}
        return self.runner.step(header, torch.tensor([token], dtype=torch.int32), None)

    def run(self, ctx: int, warm: list[int], warmup: int, steps: int) -> dict[str, Any]:
        for pos in warm:
            self.step(pos, FIRST_TOKEN, sample=False)
        start = ctx - warmup - steps
        token, out, times = FIRST_TOKEN, [], []
        before: dict[str, int] = {}
        for i in range(warmup + steps):
            if i == warmup and self.runner.window is not None:
                before = dict(self.runner.window.stats)
            t0 = time.perf_counter()
            res = self.step(start + i, token, sample=True, sampling={0: dict(GREEDY)} if i == 0 else None)
            dt = time.perf_counter() - t0
            token = res[0][1]
            out.append((token, res[0][2]))
            if i >= warmup:
                times.append(dt)
        w = self.runner.window
        delta = None if w is None else {k: (w.stats[k] - before[k]) / steps for k in WINDOW_COUNTERS}
        return {"times": times, "tokens": out, "delta": delta}


def check_same(name: str, got: list[tuple[int, float]], want: list[tuple[int, float]]) -> float:
    """The variant's greedy tokens equal off's, logprobs within TOLERANCE; returns the largest logprob difference."""
    if [t for t, _ in got] != [t for t, _ in want]:
        raise AssertionError(f"{name}: greedy tokens {[t for t, _ in got]} differ from off's {[t for t, _ in want]}")
    diff = max(abs(a - b) for (_, a), (_, b) in zip(got, want))
    if not diff <= TOLERANCE:
        raise AssertionError(f"{name}: logprobs differ from off's by {diff} (> {TOLERANCE})")
    return diff


def variants(chunks: int, frames: list[int]) -> list[tuple[str, int | None]]:
    """(label, frames) of one context: off, whole, then each f < chunks (a larger one would be `whole` again)."""
    return [("off", None), ("whole", chunks), *((f"F={f}", f) for f in sorted(set(frames)) if f < chunks)]


def bench_context(model_dir: Path, ctx: int, args: argparse.Namespace, pool_dir: Path) -> list[dict[str, Any]]:
    c = args.chunk_cells
    chunks = -(-ctx // c)
    if args.warmup + args.steps > c:
        raise ValueError(f"warmup + steps = {args.warmup + args.steps} must be at most chunk_cells = {c}, so every "
                         "timed step reads the same chunks")
    if ctx <= args.warmup + args.steps:
        raise ValueError(f"context {ctx} must be longer than warmup + steps = {args.warmup + args.steps}")
    warm = warm_positions(args.frames, chunks, c)
    rows, off = [], None
    for label, frames in variants(chunks, args.frames):
        runner = make_runner(model_dir, ctx, c, args.kv_dtype, 0 if frames is None else frames * c, args.threads,
                             pool_dir, f"{ctx}-{label}")
        try:
            res = Decode(runner, hold_conversation(runner, ctx, seed=ctx)).run(ctx, warm, args.warmup, args.steps)
            frame_nbytes = None if runner.window is None else runner.window.frame_nbytes
        finally:
            runner.close()
        diff = 0.0 if off is None else check_same(f"{label} at {ctx}", res["tokens"], off["tokens"])
        mean_ms = 1e3 * sum(res["times"]) / len(res["times"])
        if off is None:
            off = {**res, "mean_ms": mean_ms}
        d = res["delta"]
        row = {"context": ctx, "chunks": chunks, "window": label, "frames": frames,
               "mode": "-" if d is None else ("streamed" if d["streamed_steps"] == 1 else "resident"),
               "step_ms": mean_ms, "best_ms": 1e3 * min(res["times"]), "over_off": mean_ms / off["mean_ms"],
               "h2d_bytes_tok": None, "d2h_bytes_tok": None, "fills_tok": None, "streamed_tok": None,
               "hits_tok": None, "frame_bytes": frame_nbytes, "max_abs_diff": diff}
        if d is not None:
            row.update(h2d_bytes_tok=d["h2d_bytes"], d2h_bytes_tok=d["d2h_bytes"], fills_tok=d["fills"],
                       streamed_tok=d["streamed"], hits_tok=d["hits"])
        rows.append(row)
        print(f"  ctx {ctx} {label}: {mean_ms:.2f} ms/step", file=sys.stderr, flush=True)
    return rows


# ---- computed: the dual-3080 box ---------------------------------------------------------------------------
QWEN3_14B = {"num_hidden_layers": 40, "num_key_value_heads": 8, "head_dim": 128}  # its config.json
ASSUMED_FRAMES = 16  # the window when configs/dual-3080.yaml leaves device_cells at auto
LINKS = (("PCIe 3.0 x16, theoretical", 15.75e9), ("pinned copy, realistic", 12e9))  # bytes per second
BOX_CONTEXTS = (32768, 131072, 262144)


def box_frames(device_cells: int | str, chunk_cells: int) -> tuple[int, str]:
    """The dual-3080 window in frames, and where that number comes from."""
    if isinstance(device_cells, int) and device_cells > 0:
        return math.ceil(device_cells / chunk_cells), f"engine.device_cells {device_cells} of configs/dual-3080.yaml"
    return ASSUMED_FRAMES, f"assumed: configs/dual-3080.yaml leaves engine.device_cells at {device_cells}"


def box_row(ctx: int, chunk_cells: int, frames: int, frame: int, stages: int, link: str, bw: float) -> dict[str, Any]:
    """One context through one link: bytes per token per stage host -> device (`frame`: one frame's bytes), link
    time, tok/s bounds for `stages` stages."""
    chunks = -(-ctx // chunk_cells)
    if chunks <= frames:
        mode, resident, h2d = "resident", ctx, frame / chunk_cells  # a new chunk's fill, once per chunk_cells tokens
    else:
        mode, resident, h2d = "streamed", (frames - 1) * chunk_cells, (chunks - (frames - 1)) * frame
    t = h2d / bw
    return {"context": ctx, "link": link, "link_gb_s": bw / 1e9, "chunks": chunks, "mode": mode,
            "resident_cells": resident, "h2d_gb_tok_stage": h2d / 1e9, "link_ms_stage": t * 1e3,
            "lane_tok_s": 1 / (stages * t), "two_lanes_tok_s": 1 / t}


def dual_3080(config: Path = CONFIGS["dual-3080"]) -> dict[str, Any]:
    """The computed table of the module docstring, and its notes."""
    cfg = load_config(config)
    e = cfg.engine
    frames, source = box_frames(e.device_cells, e.chunk_cells)
    stage_layers = max(s.layers[1] - s.layers[0] for s in cfg.stages)
    if sum(s.layers[1] - s.layers[0] for s in cfg.stages) != QWEN3_14B["num_hidden_layers"]:
        raise ValueError(f"{config}: its stages do not cover Qwen3-14B's {QWEN3_14B['num_hidden_layers']} layers")
    layout = PoolLayout(stage_layers, 1, e.chunk_cells, QWEN3_14B["num_key_value_heads"], QWEN3_14B["head_dim"],
                        "int8")
    cell = layout.bytes_per_cell
    frame = frame_bytes(e.chunk_cells, cell, stage_layers)
    rows = [box_row(ctx, e.chunk_cells, frames, frame, len(cfg.stages), link, bw)
            for ctx in BOX_CONTEXTS for link, bw in LINKS]
    past = [ctx for ctx in BOX_CONTEXTS if ctx > e.max_context]
    return {
        "frames": frames, "chunk_cells": e.chunk_cells, "cell_bytes": cell, "stage_layers": stage_layers,
        "table": {"title": f"dual-3080, computed (no run): Qwen3-14B, {stage_layers} layers per stage, int8 "
                           f"{cell:,} B per cell per layer, chunk {e.chunk_cells}, window {frames} frames; per "
                           "decode token",
                  "columns": ["context", "link", "link_gb_s", "chunks", "mode", "resident_cells", "h2d_gb_tok_stage",
                              "link_ms_stage", "lane_tok_s", "two_lanes_tok_s"],
                  "rows": rows},
        "notes": [
            f"dual-3080 rows are computed, not measured: Qwen3-14B attention (40 layers, {stage_layers} per stage, "
            f"kv_heads 8, head_dim 128, int8: {cell:,} B per cell per layer); window {frames} frames ({source}); "
            f"a frame is {frame:,} B per stage, the window {window_bytes(frames, frame) / 2**30:.2f} GiB of device "
            "memory per stage (trash frame included)",
            "dual-3080: a streamed step keeps f - 1 frames and streams (chunks - (f - 1)) x chunk_cells x layers x "
            "B per cell per stage per token; a resident row's link moves one new chunk per chunk_cells tokens. "
            "lane_tok_s = 1 / (2 stages x link time), one conversation crossing both links in turn; "
            "two_lanes_tok_s = 1 / link time, two conversations in flight keeping both links busy; compute ignored",
            *([f"dual-3080: {', '.join(f'{c:,}' for c in past)} cells exceed the config's max_context "
               f"({e.max_context:,}); computed for comparison with the seeds' 256k lanes"] if past else []),
        ],
    }


# ---- quoted: the seeds' box ---------------------------------------------------------------------------------
SEED_POOL = ("000_2d3312a5adea4384.txt", 6.24, 524288)  # "Pinned for the pool: 6.24 GiB for 524,288 cells"
SEED_SESSION = ("001_6a5b087b21ae3983.txt", 3.09, 262144)  # "3.09 GiB per session" at --max-context 262144
SEED_RESIDENT = 32768  # "--kv-resident 32768" in both measured configurations
SEED_TWO_LANES = ("002_552fead1f184eb26.txt", 59, 62)  # "both lanes decoding an appended turn 59-62 ... tok/s"


def seed_figures() -> dict[str, Any]:
    """The seeds' figures for their box, quoted, and what their bytes per cell come to (computed here)."""
    per_cell = SEED_POOL[1] * 2**30 / SEED_POOL[2]
    per_session_cell = SEED_SESSION[1] * 2**30 / SEED_SESSION[2]
    qwen_cell = QWEN3_14B["num_hidden_layers"] * 2 * QWEN3_14B["num_key_value_heads"] * (QWEN3_14B["head_dim"] + 4)
    moved = (262144 - SEED_RESIDENT) * per_cell
    bw = LINKS[1][1]
    budget = 2 * bw / SEED_TWO_LANES[1]  # both links' bytes per token at the faster reported rate
    rows = [
        {"seed": SEED_POOL[0], "box": "2x RTX 3080 20 GB, PCIe 3.0, no NVLink, layer split",
         "figure": '"two lanes of 256k context from one 512k-token pool", "6.24 GiB pinned"; '
                   '"--kv int8 --kv-resident 32768 --kv-pool-tokens 524288"; '
                   '"6.24 GiB for 524,288 cells (both stages together)"'},
        {"seed": SEED_TWO_LANES[0], "box": "2 x RTX 3080 20 GB, two lanes of about 256k tokens",
         "figure": '"both lanes decoding an appended turn 59-62 against 25-38 tok/s" (with the pool against without)'},
        {"seed": SEED_SESSION[0], "box": "RTX 4090, 64 GB RAM",
         "figure": '"3.09 GiB per session" at 262,144 cells, --kv int8; "4 lanes x 256K: 83.0 tok/s total on code, '
                   '81.5 on prose"'},
        {"seed": "computed here", "box": "from the seeds' figures",
         "figure": f"{SEED_POOL[1]} GiB / {SEED_POOL[2]:,} cells = {per_cell:,.0f} B per cell (all layers, both "
                   f"stages); {SEED_SESSION[1]} GiB / {SEED_SESSION[2]:,} = {per_session_cell:,.0f} B; Qwen3-14B "
                   f"int8: 40 x 2,112 = {qwen_cell:,} B ({qwen_cell / per_cell:.1f}x): their model is a hybrid with "
                   "few full-attention layers"},
        {"seed": "computed here", "box": "the seeds' bytes under this window's rule",
         "figure": f"streaming every non-resident cell of a 256k lane, (262,144 - {SEED_RESIDENT:,}) x "
                   f"{per_cell:,.0f} B = {moved / 1e9:.2f} GB per token: at {bw / 1e9:g} GB/s <= "
                   f"{bw / moved:.1f} tok/s for one lane, <= {2 * bw / moved:.1f} for two (even split); "
                   f"{SEED_TWO_LANES[1]} tok/s for two lanes leaves <= {budget / 1e9:.2f} GB per token "
                   f"(~{budget / per_cell / 1000:.0f}k of their cells): their streaming moves less per token than "
                   "the whole non-resident context; the seeds do not say what it moves"},
    ]
    return {"title": "the seeds' box, quoted (../shared/seeds/)", "columns": ["seed", "box", "figure"], "rows": rows}


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = ensure_tiny("tiny")
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="strata-bench-window-", dir=base) as tmp:
        # The process's first steps pay torch's lazy start-up: one untimed run of the first context, window off.
        first = argparse.Namespace(**{**vars(args), "frames": []})
        bench_context(model_dir, args.contexts[0], first, Path(tmp))
        for ctx in args.contexts:
            rows += bench_context(model_dir, ctx, args, Path(tmp))
    cfg = json.loads((model_dir / "config.json").read_text())
    box = dual_3080()
    return {
        "bench": "window",
        "columns": ["context", "chunks", "window", "frames", "mode", "step_ms", "best_ms", "over_off",
                    "h2d_bytes_tok", "d2h_bytes_tok", "fills_tok", "streamed_tok", "hits_tok"],
        "rows": rows,
        "tables": [box["table"], seed_figures()],
        "plot": {"x": "context", "xlabel": "context (cells)", "logx": True, "series": ["window"],
                 "panels": [{"y": ["step_ms"], "ylabel": "decode step, mean (ms)", "logy": True},
                            {"y": ["h2d_bytes_tok"], "ylabel": "host -> frames per token (B)", "logy": True}]},
        "notes": [
            f"measured on CPU: tiny model ({cfg['model_type']}, {cfg['num_hidden_layers']} layers, hidden "
            f"{cfg['hidden_size']}, kv_heads {cfg['num_key_value_heads']}, head_dim {cfg['head_dim']}), float32, "
            f"kv {args.kv_dtype}, chunk_cells {args.chunk_cells}, one stage, one slot, torch threads "
            f"{torch.get_num_threads()}; the frames are a separate CPU array, so h2d is a memcpy: these rows "
            "measure the window's own overhead, not a PCIe link",
            f"per context: {args.warmup} warm-up + {args.steps} timed decode steps ending at the context; step_ms "
            "the mean, best_ms the least; over_off = step_ms / off's step_ms; per-token columns are window counter "
            "deltas over the timed steps (streamed_tok: chunk layers copied into stream buffers)",
            "warm steps before decoding (one 1-token step at cell (f - 1) x chunk_cells - 1 per window size f) leave "
            "chunks 0 .. f - 2 resident, as reading the prompt in pieces of at most one chunk does; every variant "
            f"runs them, and each variant's greedy tokens and logprobs equal off's (<= {TOLERANCE}) before timing",
            *box["notes"],
        ],
        "threads": torch.get_num_threads(),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    p = argparse.ArgumentParser(prog="python -m stages.bench_window")
    p.add_argument("--json", default=None, help="write the result here (default: stdout)")
    p.add_argument("--contexts", type=ints, default=[1024, 4096, 16384, 32768])
    p.add_argument("--long", action="store_true", help="add 65536 and 131072 cells to the contexts")
    p.add_argument("--frames", type=ints, default=[1, 2, 4], help="small windows, in frames")
    p.add_argument("--chunk-cells", type=int, default=256)
    p.add_argument("--kv-dtype", choices=["int8", "auto"], default="int8")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps before them")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: the stage's default, every core)")
    args = p.parse_args(argv)
    if args.long:
        args.contexts = [*args.contexts, *(c for c in (65536, 131072) if c not in args.contexts)]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    write_result(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
