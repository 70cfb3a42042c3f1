"""`strata bench pool`: what moving a conversation costs with the shared pool (a table swap) and without it
(copying its K/V bytes), and what the pool saves in memory. Run by `coordinator.bench` as a child process
(`python -m stages.bench_pool --json PATH ...`), because it needs torch.

A move is what happens when a parked conversation is admitted into a slot (or a slot's conversation is parked):

    pool on:   coordinator  ChunkMap.swap(slot, parked) -> drain_ops -> msgpack   (the op on the wire)
               stage        msgpack -> TableMirror.apply(op) -> KVCache.set_table(slot row)   (O(table_chunks))
    pool off:  stage        KVCache.copy_cells(park region -> slot region, cells)              (O(cells x layers))
                            and what StaticMap's "exchange" op makes the stage do: KVCache.exchange (a byte swap)

Both are timed in the same run on the same geometry; the figures are per stage (each stage moves the K/V of its
own layers, all stages in parallel). Where a stage's K/V of a long conversation would not fit this machine, the
copy is timed on fewer layers and scaled linearly to the stage's layer count (copy time is linear in layers:
one index_select / index_copy per layer array); the row says how many layers were timed.

Memory: per stage, the pool's K/V bytes for `kv_pool_tokens` vs the baseline's `(parallel + 1) x max_context`
cells, from `pool.memory.PoolLayout` (the exact size of the stage's pool file, trash chunk included).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import msgpack
import torch

from pool.chunk_map import ChunkMap, TableMirror, region
from pool.config import load_config
from pool.memory import PoolLayout
from stages.kv_cache import KVCache

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {"cpu-tiny": REPO / "configs" / "cpu-tiny.yaml", "dual-3080": REPO / "configs" / "dual-3080.yaml"}
# Attention geometry of Qwen3-30B-A3B (its config.json): what configs/dual-3080.yaml states its figures for.
QWEN3_30B_A3B = {"num_hidden_layers": 48, "num_key_value_heads": 4, "head_dim": 128}


def timeit(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Best (least) wall time of `fn()` in seconds over `repeats` runs, after `warmup` untimed runs.

    The least, not the median: on a machine shared with other work every disturbance only adds time, so the
    minimum is the estimate of the operation's own cost that other processes disturb least (timeit's advice).
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def write_result(result: dict[str, Any], path: str | None) -> None:
    """The child's answer: the result dict as JSON to `path` (or stdout)."""
    text = json.dumps(result, indent=2)
    if path:
        Path(path).write_text(text)
    else:
        print(text)


def geometry(name: str) -> dict[str, Any]:
    """Layers per stage, kv heads, head_dim and chunk_cells of a config's model, and where they came from."""
    cfg = load_config(CONFIGS[name])
    stage_layers = max(s.layers[1] - s.layers[0] for s in cfg.stages)
    model_cfg = Path(cfg.model).expanduser() / "config.json"
    if cfg.model == "tiny":
        from stages.tiny import DEFAULT_SPEC

        spec = DEFAULT_SPEC
        kv_heads, head_dim = spec["kv_heads"], spec["hidden"] // spec["heads"]
        source = f"the tiny model (stages.tiny.DEFAULT_SPEC: {spec['layers']} layers, kv_heads {kv_heads}, " \
                 f"head_dim {head_dim})"
    elif model_cfg.exists():
        mc = json.loads(model_cfg.read_text())
        kv_heads = mc.get("num_key_value_heads", mc["num_attention_heads"])
        head_dim = mc.get("head_dim", mc["hidden_size"] // mc["num_attention_heads"])
        source = f"{model_cfg}"
    else:
        kv_heads, head_dim = QWEN3_30B_A3B["num_key_value_heads"], QWEN3_30B_A3B["head_dim"]
        source = (f"{cfg.model} is not on this machine: Qwen3-30B-A3B attention geometry (48 layers, kv_heads 4, "
                  "head_dim 128), as the config's comments state")
    return {"name": name, "cfg": cfg, "stage_layers": stage_layers, "kv_heads": kv_heads, "head_dim": head_dim,
            "chunk_cells": cfg.engine.chunk_cells, "source": source}


def time_swap(table_chunks: int, chunk_cells: int, cells: int, kv: KVCache, repeats: int) -> float:
    """Best seconds of one move by table swap (`timeit`), the whole path of the module docstring."""
    n_chunks = kv.n_chunks
    cmap = ChunkMap(n_chunks, chunk_cells, table_chunks, n_slots=1)
    mirror = TableMirror(n_chunks, table_chunks, n_slots=1)
    parked = cmap.new_table()
    assert cmap.reserve(parked, cells), "the bench pool holds one conversation"
    for op in cmap.drain_ops():
        mirror.apply(op)

    def move() -> None:
        cmap.swap(0, parked)
        wire = msgpack.packb(cmap.drain_ops())
        for op in msgpack.unpackb(wire):
            mirror.apply(op)
        for slot in mirror.changed_slots:
            kv.set_table(slot, mirror.entries(slot))

    best = timeit(move, repeats)
    for t in (0, parked):  # the mirror and the device row must agree with the map, or nothing was moved
        assert mirror.entries(t) == cmap.entries(t), f"mirror of table {t} differs from the map"
    assert kv.tables[0].tolist() == cmap.entries(0), "device table row differs from the map"
    return best


def bench_moves(geo: dict[str, Any], kv_dtype: str, cells_list: list[int], max_timed_layers: int,
                swap_repeats: int, copy_repeats: int) -> list[dict[str, Any]]:
    """One row per conversation length: swap and copy/exchange time per stage, and their ratio."""
    c = geo["chunk_cells"]
    table_chunks = math.ceil(max(cells_list) / c)
    layers = min(geo["stage_layers"], max_timed_layers)
    # StaticMap's layout for one slot: region 0 (the slot) and region 1 (the park table).
    kv = KVCache(layers, 2 * table_chunks, c, geo["kv_heads"], geo["head_dim"], kv_dtype, "cpu",
                 n_slots=1, table_chunks=table_chunks)
    slot_region, park_region = region(0, table_chunks), region(1, table_chunks)
    scale = geo["stage_layers"] / layers
    rows = []
    for cells in cells_list:
        swap_s = time_swap(table_chunks, c, cells, kv, swap_repeats)
        copy_s = timeit(lambda: kv.copy_cells(park_region, slot_region, cells), copy_repeats) * scale
        exch_s = timeit(lambda: kv.exchange(park_region, slot_region, cells), copy_repeats) * scale
        conv_bytes = cells * kv.bytes_per_cell // layers * geo["stage_layers"]
        rows.append({
            "geometry": geo["name"], "kv_dtype": kv_dtype, "cells": cells, "chunks": math.ceil(cells / c),
            "table_chunks": table_chunks, "stage_layers": geo["stage_layers"], "timed_layers": layers,
            "conv_mib": conv_bytes / 2**20,
            "swap_us": swap_s * 1e6, "copy_us": copy_s * 1e6, "exchange_us": exch_s * 1e6,
            "copy_over_swap": copy_s / swap_s, "exchange_over_swap": exch_s / swap_s,
        })
        print(f"  {geo['name']} {kv_dtype} {cells} cells: swap {swap_s * 1e6:.1f} us, "
              f"copy {copy_s * 1e3:.1f} ms", file=sys.stderr, flush=True)
    del kv
    return rows


def pool_bytes(geo: dict[str, Any], kv_dtype: str) -> dict[str, Any]:
    """Per stage, the pool file's K/V bytes with the config's kv_pool_tokens vs the baseline's (parallel + 1) x
    max_context cells (the same config with kv_pool_tokens = 0)."""
    e = geo["cfg"].engine
    dtype = {"auto": "bfloat16"}.get(kv_dtype, kv_dtype)
    off_chunks = (e.parallel + 1) * e.table_chunks

    def layout(n_chunks: int) -> PoolLayout:
        return PoolLayout(geo["stage_layers"], n_chunks, e.chunk_cells, geo["kv_heads"], geo["head_dim"], dtype)

    on = layout(e.n_chunks).data_nbytes if e.pool_on else None
    off = layout(off_chunks).data_nbytes
    return {"config": geo["name"], "kv_dtype": dtype, "kv_pool_tokens": e.kv_pool_tokens,
            "baseline_cells": (e.parallel + 1) * e.max_context, "max_context": e.max_context,
            "parallel": e.parallel, "pool_gib": None if on is None else on / 2**30, "baseline_gib": off / 2**30,
            "pool_over_baseline": None if on is None else on / off}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    notes: list[str] = []
    rows: list[dict[str, Any]] = []
    mem_rows: list[dict[str, Any]] = []
    for name in args.geometries:
        geo = geometry(name)
        notes.append(f"{name}: {geo['stage_layers']} layers per stage, chunk_cells {geo['chunk_cells']}; "
                     f"geometry from {geo['source']}")
        for kv_dtype in args.kv_dtypes:
            rows += bench_moves(geo, kv_dtype, args.cells, args.max_timed_layers, args.swap_repeats,
                                args.copy_repeats)
            mem_rows.append(pool_bytes(geo, kv_dtype))
        if geo["stage_layers"] > args.max_timed_layers:
            notes.append(f"{name}: copy/exchange timed on {args.max_timed_layers} of {geo['stage_layers']} layers "
                         f"and scaled x{geo['stage_layers'] / args.max_timed_layers:g} (linear in layers); "
                         "swap is whole")
    notes += [
        "tables are sized for the longest conversation timed (table_chunks = ceil(max cells / chunk_cells)), "
        "whatever the config's max_context, so every row moves through the same table",
        "swap = ChunkMap.swap + drain_ops + msgpack round trip + TableMirror.apply + KVCache.set_table "
        f"(best of {args.swap_repeats}); copy = KVCache.copy_cells, exchange = KVCache.exchange "
        f"(best of {args.copy_repeats}); per stage, CPU, torch threads {torch.get_num_threads()}",
        "memory: per stage, PoolLayout.data_nbytes with kv_pool_tokens vs with (parallel + 1) x max_context "
        "cells; kv dtype 'bfloat16' stands for the model dtype (the tiny model itself is float32)",
    ]
    return {
        "bench": "pool",
        "columns": ["geometry", "kv_dtype", "cells", "chunks", "timed_layers", "conv_mib", "swap_us", "copy_us",
                    "exchange_us", "copy_over_swap"],
        "rows": rows,
        "tables": [{"title": "pool bytes per stage (kv_pool_tokens) vs (parallel + 1) x max_context",
                    "columns": ["config", "kv_dtype", "kv_pool_tokens", "baseline_cells", "pool_gib",
                                "baseline_gib", "pool_over_baseline"],
                    "rows": mem_rows}],
        "plot": {"x": "cells", "xlabel": "conversation cells", "logx": True, "series": ["geometry", "kv_dtype"],
                 "panels": [{"y": ["swap_us", "copy_us"], "ylabel": "move time per stage (us)", "logy": True,
                             "title": "table swap vs byte copy"},
                            {"y": ["copy_over_swap"], "ylabel": "copy / swap", "logy": True}]},
        "notes": notes,
        "threads": torch.get_num_threads(),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m stages.bench_pool")
    p.add_argument("--json", default=None, help="write the result here (default: stdout)")
    p.add_argument("--cells", type=lambda s: [int(x) for x in s.split(",")], default=[16384, 32768, 65536, 131072])
    p.add_argument("--kv-dtypes", type=lambda s: s.split(","), default=["int8", "bfloat16"])
    p.add_argument("--geometries", type=lambda s: s.split(","), default=list(CONFIGS))
    p.add_argument("--max-timed-layers", type=int, default=2)
    p.add_argument("--swap-repeats", type=int, default=200)
    p.add_argument("--copy-repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    write_result(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
