"""`strata bench peers`: one checkpoint, served by Strata (1 stage and 2 stages) and run by its peers
(transformers `generate`, llama.cpp through llama-cpp-python when it is installed), same thread budget,
prompts of the same length. Ratios are taken against transformers and llama.cpp, measured in the same run.
`--quant Q8_0|Q4_0|Q4_K|...` serves the checkpoint as one GGUF file with its 2-D weights in that type (Strata
and llama.cpp on the same file; transformers on the float checkpoint); `--gguf FILE` serves a file of the
user's (Strata and llama.cpp only). Strata's rows carry its stages' weights as loaded (strata:stage_weight_bytes).

    build     python -m stages.bench_peers build           a random ~100M checkpoint (qwen3, 12 layers, hidden
                                                           768, MLP 3072, the tiny tokenizer's 512-token vocab)
    strata-N  strata up --config <tmp>/strata-N.yaml       N CPU stages on a free port, threads split evenly;
              the load generator (serve.py) sends the prompts as token ids to /v1/completions
    others    python -m stages.bench_peers hf | llamacpp   in-process, torch / llama.cpp threads = budget

Strata's figures are taken from the client's side of HTTP (they include the API, the scheduler and the
stage-to-stage hops); the in-process peers' from around `generate`. For b concurrent requests of P prompt tokens
generating M tokens each:
    prefill tok/s = b * P / t1            t1: wall time for b requests sent together with max_tokens 1 to finish
    decode tok/s  = (sum n_i - b) / (tM - t1)   tM: the same with max_tokens M (n_i generated, from usage)
each wall time the best of the repeats; exactly how transformers' and llama.cpp's figures are taken, so the
ratios compare like with like. Every peer generates exactly M tokens: Strata's requests send `ignore_eos`, and
the in-process peers do not stop at EOS either (an EOS is sampled like any token, the run goes on), so n_i = M.
Every timed Strata batch sends prompts it has never seen: Strata keeps finished conversations and would otherwise
serve a repeated prompt from its cache (no prefill at all). (Streamed content chunks are no clock here: a random
model's tokens are often incomplete UTF-8 that the detokenizer holds back, so one chunk may carry several tokens.)
The coordinator process also needs some CPU; it is not counted in the thread budget (it runs no model).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from . import run_child
from .report import ratio
from .serve import ServeConfig, make_client, resolve_model, stream_request

STARTUP_S = 300.0
ORDINARY_TOKENS = 500  # the tiny tokenizer's ids below this are ordinary BPE tokens (specials sit at the top)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def strata_config(model_dir: str, n_stages: int, n_layers: int, threads: int, port: int, max_context: int,
                  parallel: int, root: Path) -> dict[str, Any]:
    """A box config for N CPU stages over the checkpoint's layers, split as evenly as it goes; the stage
    sockets in `root`, a private (0700) directory, as a stage requires of its runtime directory."""
    bounds = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    chunk = 256
    max_context = -(-max_context // chunk) * chunk
    return {
        "model": model_dir,
        "coordinator": {"host": "127.0.0.1", "port": port},
        "engine": {"max_context": max_context, "parallel": parallel, "kv_pool_tokens": parallel * max_context,
                   "chunk_cells": chunk, "threads": max(1, threads // n_stages),
                   "prefill_chunk": min(512, max_context)},
        "stages": [{"device": "cpu", "layers": [bounds[i], bounds[i + 1]],
                    "endpoint": f"ipc://{root}/s{i}"} for i in range(n_stages)],
    }


class StrataServer:
    """`strata up` on a config file, as a context manager: waits for /health, stops it with SIGTERM."""

    def __init__(self, config_path: Path, port: int, log_path: Path) -> None:
        self.config_path, self.port, self.log_path = config_path, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "StrataServer":
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "up", "--config", str(self.config_path)],
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"strata up exited with {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"strata up did not answer /health in {STARTUP_S:g} s: {self.tail()}")

    def tail(self, n: int = 1500) -> str:
        self._log.flush()
        return self.log_path.read_text()[-n:]

    def __exit__(self, *exc: object) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # `strata up` stops its children, then exits
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


async def measure_strata(url: str, prompts: dict[int, list[list[int]]], output_tokens: int, concurrency: list[int],
                         repeats: int) -> tuple[list[dict[str, Any]], str]:
    """Prefill and decode rates the way the in-process peers are timed (module docstring), from the time each
    batch of requests takes to finish; returns the rows and the text of the first greedy completion."""
    cfg = ServeConfig(url=url, model=None, api="completions", output_tokens=output_tokens, ignore_eos=True,
                      timeout_s=600.0)

    fresh = iter(range(1, 1 << 30))

    async def batch(b: int, max_tokens: int) -> tuple[float, int]:
        """Wall seconds for b requests sent together to finish, and their generated tokens. Every call sends
        prompts never sent before (same length, another seed): Strata keeps finished conversations and would
        read a repeated prompt from its cache instead of computing it."""
        length = len(prompts[b][0])
        ids = prompt_ids(next(fresh), b, length)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(stream_request(client, cfg, [], max_tokens, prompt_ids=p) for p in ids))
        wall = time.perf_counter() - t0
        failed = [r.error for r in results if not r.ok]
        if failed:
            raise RuntimeError(f"strata at {url}: {failed[0]}")
        return wall, sum(r.output_tokens for r in results)

    async def best(b: int, max_tokens: int) -> tuple[float, int]:
        return min([await batch(b, max_tokens) for _ in range(repeats)], key=lambda x: x[0])

    rows = []
    async with make_client(cfg.url, cfg.api_key, cfg.timeout_s, max(concurrency) + 2) as client:
        cfg.model = await resolve_model(client)
        greedy = await stream_request(client, cfg, [], output_tokens, prompt_ids=prompts[1][0])  # also warms up
        if not greedy.ok:
            raise RuntimeError(f"strata at {url}: {greedy.error}")
        for b in concurrency:
            t_first, _ = await best(b, 1)
            t_all, n_out = await best(b, output_tokens)
            n_prompt = sum(len(p) for p in prompts[b])
            rows.append({"concurrency": b, "prefill_tok_s": n_prompt / t_first,
                         "decode_tok_s": ratio(n_out - b, t_all - t_first), "ttft_ms": t_first * 1e3,
                         "output_tokens": n_out})
    return rows, greedy.text


def run_peers(args: argparse.Namespace) -> dict[str, Any]:
    """Build (or reuse) the checkpoint, run every peer, and return the report result with ratios. Everything
    written on the way (checkpoint, configs, server logs, GGUF) lives in a temp dir removed at the end."""
    with tempfile.TemporaryDirectory(prefix="strata-peers-") as tmp:
        return _run_peers(args, Path(tmp))


def _run_peers(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    notes: list[str] = []
    seed = 0
    gguf_path = None
    if args.gguf:  # a GGUF file of the user's: Strata and llama.cpp serve it, transformers has no checkpoint
        from pool.gguf_meta import GGUFModel

        model_dir, gguf_path = None, str(args.gguf)
        args.layers = GGUFModel(gguf_path).config["num_hidden_layers"]
        args.peers = [p for p in args.peers if p != "transformers"]
        notes.append(f"model: {gguf_path} (transformers is not run on a GGUF file; ratios are against llama.cpp)")
    elif args.model_dir:
        model_dir = args.model_dir
    else:
        built = run_child("stages.bench_peers", ["build", "--dir", str(tmp / "model"), "--arch", args.arch,
                                                 "--layers", str(args.layers), "--hidden", str(args.hidden),
                                                 "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
                                                 "--intermediate", str(args.intermediate),
                                                 "--vocab", str(args.vocab)])
        model_dir = built["model_dir"]
        notes.append(f"checkpoint: random {args.arch}, {args.layers} layers, hidden {args.hidden}, heads "
                     f"{args.heads}, kv_heads {args.kv_heads}, intermediate {args.intermediate}, vocab "
                     f"{built['vocab']}: {built['params'] / 1e6:.1f}M parameters, float32")
    if model_dir and args.quant != "F32":  # one quantized GGUF for Strata and llama.cpp alike
        gguf_path = str(tmp / f"model-{args.quant}.gguf")
        run_child("stages.bench_peers", ["export", "--model-dir", model_dir, "--gguf", gguf_path, "--quant", args.quant])
        notes.append(f"Strata and llama.cpp serve one GGUF file, its 2-D weights in {args.quant}; transformers runs "
                     "the float checkpoint it was quantized from")
    prompts = {b: prompt_ids(seed, b, args.prompt_tokens) for b in sorted(set(args.concurrency) | {1})}
    prompts_path = tmp / "prompts.json"
    prompts_path.write_text(json.dumps({str(b): p for b, p in prompts.items()}))
    sizes = ["--model-dir", model_dir or "", "--prompts", str(prompts_path), "--output-tokens", str(args.output_tokens),
             "--batches", ",".join(map(str, args.concurrency)), "--threads", str(args.threads),
             "--repeats", str(args.repeats)]
    rows: list[dict[str, Any]] = []
    hf_greedy: list[int] = []
    llama_greedy: list[int] = []
    for peer in args.peers:
        print(f"peer {peer} ...", file=sys.stderr, flush=True)
        try:
            if peer == "transformers":
                out = run_child("stages.bench_peers", ["hf", *sizes])
                rows += out["rows"]
                hf_greedy = out["greedy_ids"]
            elif peer == "llama.cpp":
                llama_args = ["llamacpp", *sizes, "--gguf", gguf_path or str(tmp / "model-f32.gguf")]
                try:
                    out = run_child("stages.bench_peers", llama_args)
                except RuntimeError as err:
                    if "exit code -11" not in str(err):
                        raise
                    out = run_child("stages.bench_peers", [*llama_args, "--no-extra-bufts"])
                    notes.append("llama.cpp crashed (SIGSEGV) with its extra CPU buffer types (AMX, repacked quant "
                                 "blocks) on this file and machine; its figures are from a run without them "
                                 "(use_extra_bufts false)")
                if "skipped" in out:
                    notes.append(f"llama.cpp skipped: {out['skipped']}")
                else:
                    rows += out["rows"]
                    notes.append(out.get("note", ""))
                    llama_greedy = out.get("greedy_ids", [])
            elif peer.startswith("strata-") and peer[7:].isdigit():
                rows += run_strata_peer(args, peer, gguf_path or model_dir, tmp, prompts, notes)
            else:
                raise ValueError(f"unknown peer {peer!r}; known: strata-N (N stages), transformers, llama.cpp")
        except RuntimeError as err:  # one peer failing is reported; the others still run
            notes.append(f"{peer} FAILED: {err}")
            print(f"peer {peer} failed: {err}", file=sys.stderr, flush=True)
    for peer, tag in (("transformers", "hf"), ("llama.cpp", "llama")):
        base = {r["concurrency"]: r for r in rows if r["peer"] == peer}
        for r in rows:
            b = base.get(r["concurrency"], {})
            r[f"prefill_vs_{tag}"] = ratio(r.get("prefill_tok_s"), b.get("prefill_tok_s"))
            r[f"decode_vs_{tag}"] = ratio(r.get("decode_tok_s"), b.get("decode_tok_s"))
    texts = [r.pop("greedy_text") for r in rows if "greedy_text" in r]
    if gguf_path and llama_greedy and texts:
        from coordinator.tokenizer import Tokenizer

        expected = Tokenizer.from_gguf(Path(gguf_path)).decode(llama_greedy, skip_special=True)
        same = sum(t == expected for t in texts)
        notes.append(f"greedy check: {same} of {len(texts)} Strata peers' first {args.output_tokens} greedy tokens "
                     "equal llama.cpp's on the same file (compared as text; a random model's logits are close, "
                     "and bfloat16 vs llama.cpp's float32 with 8-bit activations can part ways)")
    if hf_greedy and texts and not gguf_path:
        from coordinator.tokenizer import Tokenizer

        expected = Tokenizer.from_dir(Path(model_dir)).decode(hf_greedy, skip_special=True)  # as Strata streams
        same = all(t == expected for t in texts)
        notes.append(f"greedy check: Strata's first {args.output_tokens} greedy tokens "
                     f"{'equal' if same else 'DIFFER from'} transformers' for the same prompt (compared as text)")
    if hf_greedy and llama_greedy:
        same = llama_greedy == hf_greedy[:len(llama_greedy)]
        notes.append(f"greedy check: llama.cpp's first {len(llama_greedy)} greedy token ids "
                     f"{'equal' if same else 'DIFFER from'} transformers' for the same prompt")
    notes += [
        f"prompts: {args.prompt_tokens} random token ids each (seeded), {args.output_tokens} tokens generated, "
        f"greedy; thread budget {args.threads} for every peer (Strata: engine.threads split over its stages); "
        "CPU",
        "Strata is measured over HTTP from the client (API, scheduler and stage hops included); transformers "
        "and llama.cpp around the call in-process; *_vs_hf / *_vs_llama are ratios against transformers / llama.cpp "
        "at the same concurrency",
    ]
    return {
        "bench": "peers",
        "columns": ["peer", "concurrency", "prefill_tok_s", "decode_tok_s", "ttft_ms", "prefill_vs_hf",
                    "decode_vs_hf", "prefill_vs_llama", "decode_vs_llama", "weights_mib"],
        "rows": rows,
        "plot": {"x": "peer", "series": ["concurrency"],
                 "panels": [{"y": ["decode_tok_s"], "ylabel": "decode tokens / s", "kind": "bar"},
                            {"y": ["prefill_tok_s"], "ylabel": "prefill tokens / s", "kind": "bar"}]},
        "notes": [n for n in notes if n],
    }


def run_strata_peer(args: argparse.Namespace, peer: str, model_dir: str, tmp: Path,
                    prompts: dict[int, list[list[int]]], notes: list[str]) -> list[dict[str, Any]]:
    n_stages = int(peer.split("-", 1)[1])
    port = free_port()
    cfg = strata_config(model_dir, n_stages, args.layers, args.threads, port,
                        max_context=args.prompt_tokens + args.output_tokens + 16, parallel=max(args.concurrency),
                        root=tmp)
    path = tmp / f"{peer}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    with StrataServer(path, port, tmp / f"{peer}.log") as server:
        found, text = asyncio.run(measure_strata(server.url, prompts, args.output_tokens, args.concurrency,
                                                   args.repeats))
        weights = stage_weight_bytes(server.url)
    notes.append(f"{peer}: {n_stages} CPU stage(s), engine.threads {cfg['engine']['threads']} each, "
                 f"layers {[s['layers'] for s in cfg['stages']]}, weights as loaded per stage (MiB) "
                 f"{[round(w / 2**20, 1) for w in weights]}")
    short = [r for r in found if r["output_tokens"] != r["concurrency"] * args.output_tokens]
    if short:
        notes.append(f"{peer}: batches generated fewer than b x {args.output_tokens} tokens despite ignore_eos: "
                     + ", ".join(f"{r['output_tokens']} at concurrency {r['concurrency']}" for r in short))
    out = [{"peer": peer, **r, "weights_mib": round(sum(weights) / 2**20, 1)} for r in found]
    out[0]["greedy_text"] = text
    return out



def stage_weight_bytes(url: str) -> list[float]:
    """Each stage's strata:stage_weight_bytes from /metrics (parsed by prometheus_client), in stage order."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {s.labels["stage"]: s.value for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text)
             for s in fam.samples if s.name == "strata:stage_weight_bytes"}
    return [found[k] for k in sorted(found, key=int)]


def prompt_ids(seed: int, batch: int, length: int) -> list[list[int]]:
    """`batch` prompts of `length` random ordinary token ids (seeded). The in-process peers get the seed-0
    prompts; Strata gets those for the greedy check and fresh seeds for every timed batch."""
    rng = random.Random(f"{seed}-{batch}-{length}")
    return [[rng.randrange(ORDINARY_TOKENS) for _ in range(length)] for _ in range(batch)]
