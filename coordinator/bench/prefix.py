"""`strata bench prefix`: conversations that share one long prefix (a system prompt, a document), with prefix
sharing on and off (`engine.share_prefixes`), on a pool that holds only a few of them without sharing.

    strata bench prefix --prefix-tokens 8192 --conversations 16 --fit 4

Per variant, `strata up` on a generated config (two CPU stages, `parallel` = conversations, so slots are never
what limits; `kv_pool_tokens` = fit x max_context, so `fit` conversations fill the pool when nothing is shared):
  1. cold     conversation 0 = prefix + its own suffix, alone on an empty pool: TTFT cold;
  2. burst    conversations 1 .. N-1, each prefix + its own suffix, sent together: how many are served and how
              many refused (503 kv_pool_full), their TTFT, and the pool's cells in use at the peak (the JSON view
              polled every 20 ms: cells - free, and the shared and saved cells);
  3. new      one more conversation on the prefix, alone: TTFT on the shared prefix, and its cached tokens;
  4. whole    how many conversations the pool still holds whole (all their tokens) at the end.
Prompts are token ids (/v1/completions), so lengths are exact; suffixes differ from their first token, so two
conversations share exactly the prefix; greedy, `ignore_eos`, so every request generates --output-tokens.
TTFT is the time to the first streamed event that carries a choice, from the client, over HTTP. Without sharing
a new conversation still reuses the prefix by taking one held conversation over (a move, which cuts that one to
the prefix); "whole" shows what that costs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from .peers import ORDINARY_TOKENS
from .report import median, ratio
from .serve import resolve_model, sse_lines
from .strata_server import StrataServer, free_port

POLL_S = 0.02


def box_config(args: argparse.Namespace, share: bool, port: int, root: Path) -> dict[str, Any]:
    """Two CPU stages on the tiny model (or --model), a pool of `fit` conversations."""
    c = args.chunk_cells
    per = -(-(args.prefix_tokens + args.suffix_tokens + args.output_tokens) // c) * c
    half = args.layers // 2
    return {
        "model": args.model,
        "coordinator": {"host": "127.0.0.1", "port": port},
        "engine": {"max_context": per, "parallel": args.conversations, "kv_pool_tokens": args.fit * per,
                   "chunk_cells": c, "prefill_chunk": min(512, per), "threads": args.threads,
                   "max_waiting": 2 * args.conversations, "share_prefixes": share},
        "stages": [{"device": "cpu", "layers": [0, half], "endpoint": f"ipc://{root}/s0"},
                   {"device": "cpu", "layers": [half, args.layers], "endpoint": f"ipc://{root}/s1"}],
    }


def prompts(args: argparse.Namespace) -> list[list[int]]:
    """N + 1 prompts: one prefix, then per conversation a suffix whose first id is its own."""
    rng = random.Random(args.seed)
    prefix = [rng.randrange(5, ORDINARY_TOKENS) for _ in range(args.prefix_tokens)]
    return [prefix + [5 + i] + [rng.randrange(5, ORDINARY_TOKENS) for _ in range(args.suffix_tokens - 1)]
            for i in range(args.conversations + 1)]


async def complete(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion: {"ok", "status", "code", "ttft_s", "cached"}."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0, out = time.perf_counter(), {"ok": False, "status": None, "code": None, "ttft_s": None, "cached": None}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        out["status"] = resp.status_code
        if resp.status_code != 200:
            await resp.aread()
            try:
                out["code"] = resp.json()["error"]["code"]
            except (ValueError, KeyError, TypeError):
                out["code"] = resp.text[:80]
            return out
        async for line in sse_lines(resp):
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                out["code"] = event["error"].get("code")
                return out
            if event.get("choices") and out["ttft_s"] is None:
                out["ttft_s"] = time.perf_counter() - t0
            if event.get("usage"):
                out["cached"] = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    out["ok"] = out["ttft_s"] is not None
    return out


async def pool_view(client: httpx.AsyncClient) -> dict[str, Any]:
    return (await client.get("/metrics", params={"format": "json"})).json()["live"]["kv_pool"]


def held_whole(pool: dict[str, Any], min_tokens: int) -> int:
    """Conversations held (in a slot or parked) with at least `min_tokens` tokens: prefix and suffix whole."""
    entries = [s for s in pool["slots"] if s["state"] == "held"] + pool["parked"]
    return sum(1 for e in entries if e["tokens"] >= min_tokens)


async def scenario(url: str, args: argparse.Namespace, share: bool) -> dict[str, Any]:
    ps = prompts(args)
    n_burst = args.conversations - 1
    limits = httpx.Limits(max_connections=n_burst + 4, max_keepalive_connections=n_burst + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(args.timeout, connect=10)) as cl:
        model = await resolve_model(cl)
        cold = await complete(cl, model, ps[0], args.output_tokens)
        if not cold["ok"]:
            raise RuntimeError(f"the cold request failed: {cold}")
        peak = {"used": 0, "shared": 0, "saved": 0}
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set():
                pool = await pool_view(cl)
                peak["used"] = max(peak["used"], pool["cells"] - pool["free"])
                peak["shared"] = max(peak["shared"], pool["shared"])
                peak["saved"] = max(peak["saved"], pool["saved"])
                await asyncio.sleep(POLL_S)

        watcher = asyncio.create_task(watch())
        burst = await asyncio.gather(*(complete(cl, model, p, args.output_tokens) for p in ps[1:args.conversations]))
        done.set()
        await watcher
        new = await complete(cl, model, ps[args.conversations], args.output_tokens)
        pool = await pool_view(cl)
    served = [r for r in burst if r["ok"]]
    refused = [r for r in burst if r["code"] == "kv_pool_full"]
    others = [r for r in burst if not r["ok"] and r["code"] != "kv_pool_full"]
    if others:
        raise RuntimeError(f"{len(others)} burst requests failed otherwise than kv_pool_full: {others[0]}")
    return {
        "share_prefixes": share,
        "served": 1 + len(served), "refused": len(refused),
        "ttft_cold_ms": cold["ttft_s"] * 1e3,
        "ttft_burst_p50_ms": (median([r["ttft_s"] for r in served]) or 0) * 1e3,
        "ttft_new_ms": new["ttft_s"] * 1e3 if new["ok"] else None,
        "cold_vs_new": ratio(cold["ttft_s"], new["ttft_s"]),
        "new_cached": new["cached"],
        "peak_cells_used": peak["used"], "peak_shared_cells": peak["shared"], "peak_saved_cells": peak["saved"],
        "cells_used_end": pool["cells"] - pool["free"],
        "whole_at_end": held_whole(pool, args.prefix_tokens + args.suffix_tokens),
        "pool_cells": pool["cells"],
    }


def check_args(args: argparse.Namespace) -> None:
    """RuntimeError naming the flag for a shape the scenario cannot run."""
    for flag, least in (("prefix_tokens", 1), ("suffix_tokens", 1), ("output_tokens", 1), ("conversations", 2),
                        ("fit", 1), ("chunk_cells", 1), ("layers", 2), ("threads", 0)):
        if getattr(args, flag) < least:
            raise RuntimeError(f"--{flag.replace('_', '-')} must be at least {least}, got {getattr(args, flag)}")
    if args.conversations + 1 > ORDINARY_TOKENS - 5:
        raise RuntimeError(f"--conversations {args.conversations}: suffixes need a distinct first id each")


def run_prefix(args: argparse.Namespace) -> dict[str, Any]:
    check_args(args)
    rows = []
    for share in (True, False):
        root = Path(tempfile.mkdtemp(prefix="sbp", dir="/tmp"))  # 0700; short, for the ipc path limit
        try:
            port = free_port()
            path = root / "box.yaml"
            path.write_text(yaml.safe_dump(box_config(args, share, port, root)))
            print(f"share_prefixes={share} ...", file=sys.stderr, flush=True)
            with StrataServer(path, port, root / "up.log") as server:
                rows.append(asyncio.run(scenario(server.url, args, share)))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    c = args.chunk_cells
    per = -(-(args.prefix_tokens + args.suffix_tokens + args.output_tokens) // c) * c
    return {
        "bench": "prefix",
        "columns": ["share_prefixes", "served", "refused", "ttft_cold_ms", "ttft_burst_p50_ms", "ttft_new_ms",
                    "cold_vs_new", "new_cached", "peak_cells_used", "peak_saved_cells", "cells_used_end",
                    "whole_at_end"],
        "rows": rows,
        "plot": {"x": "share_prefixes", "series": [],
                 "panels": [{"y": ["served", "whole_at_end"], "ylabel": "conversations", "kind": "bar"},
                            {"y": ["ttft_cold_ms", "ttft_new_ms"], "ylabel": "TTFT (ms)", "kind": "bar"}]},
        "notes": [
            f"{args.conversations} conversations of {args.prefix_tokens} shared + {args.suffix_tokens} own prompt "
            f"tokens, {args.output_tokens} generated each; model {args.model}, two CPU stages, threads "
            f"{args.threads or 'auto'}; pool {args.fit * per} cells = {args.fit} x max_context {per} "
            f"(chunks of {c}); parallel {args.conversations}",
            "served: the cold conversation plus the burst's answered requests; refused: 503 kv_pool_full; "
            "whole_at_end: conversations the pool still holds with all their prompt tokens",
            "ttft_new: one more conversation on the prefix after the burst; cold_vs_new = ttft_cold / ttft_new",
        ],
    }
