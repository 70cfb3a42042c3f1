"""`strata bench peers`: one checkpoint, served by Strata (1 stage and 2 stages) and run by its peers
(transformers `generate`, llama.cpp through llama-cpp-python when it is installed, llama.cpp's own server
`llama-server` when it is built: llama_server.py), same thread budget, prompts of the same length. Ratios are
taken against transformers, llama.cpp and llama-server, measured in the same run.
`--quant Q8_0|Q4_0|Q4_K|...` serves the checkpoint as one GGUF file with its 2-D weights in that type (Strata
and llama.cpp on the same file; transformers on the float checkpoint); `--gguf FILE` serves a file of the
user's (Strata and llama.cpp only). Strata's rows carry its stages' weights as loaded (strata:stage_weight_bytes).

    build     python -m stages.bench_peers build           a random ~100M checkpoint (qwen3, 12 layers, hidden
                                                           768, MLP 3072, the tiny tokenizer's 512-token vocab)
    strata-N  strata up --config <tmp>/strata-N.yaml       N CPU stages on a free port, in turns, each with the
              whole thread budget (strata-Np: pipelined, the budget split evenly; pool/pipeline.py);
              the load generator (serve.py) sends the prompts as token ids to /v1/completions
    others    python -m stages.bench_peers hf | llamacpp   in-process, torch / llama.cpp threads = budget
    llama-server[-f32]  llama-server -np <slots> ...      on the llama.cpp peer's GGUF file, measured like Strata

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

`--workload mixed` replaces the batches by the mixed-length workload of workload.py (N requests of different
prompt and output lengths, all at once or with Poisson arrivals) run once against every server peer (strata-N,
llama-server); the in-process peers, which cannot take requests as they come, are left out, and transformers'
greedy ids for the check prompt come from `python -m stages.bench_peers greedy`. Each server gets `--slots`
slots of cells for the workload's longest request.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from . import llama_server, run_child
from .report import ratio
from .serve import ServeConfig, make_client, resolve_model, stream_request
from .strata_server import StrataServer, free_port, slot_cells, stage_weight_bytes, strata_config
from .workload import COLUMNS as WORKLOAD_COLUMNS
from .workload import WorkloadSpec, measure_workload, spec_from_args

ORDINARY_TOKENS = 500  # the tiny tokenizer's ids below this are ordinary BPE tokens (specials sit at the top)


async def measure_batches(url: str, prompts: dict[int, list[list[int]]], output_tokens: int, concurrency: list[int],
                          repeats: int) -> tuple[list[dict[str, Any]], str]:
    """Prefill and decode rates of a server peer (Strata, llama-server) the way the in-process peers are timed
    (module docstring), from the time each batch of requests takes to finish; returns the rows and the text of
    the first greedy completion."""
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
            raise RuntimeError(f"server at {url}: {failed[0]}")
        return wall, sum(r.output_tokens for r in results)

    async def best(b: int, max_tokens: int) -> tuple[float, int]:
        return min([await batch(b, max_tokens) for _ in range(repeats)], key=lambda x: x[0])

    rows = []
    async with make_client(cfg.url, cfg.api_key, cfg.timeout_s, max(concurrency) + 2) as client:
        cfg.model = await resolve_model(client)
        greedy = await stream_request(client, cfg, [], output_tokens, prompt_ids=prompts[1][0])  # also warms up
        if not greedy.ok:
            raise RuntimeError(f"server at {url}: {greedy.error}")
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


def checkpoint_layers(model_dir: str | Path) -> int:
    """The decoder layers of a checkpoint directory, from its config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("text_config", config)["num_hidden_layers"])


def _run_peers(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    notes: list[str] = []
    seed = 0
    gguf_path = None
    if args.gguf:  # a GGUF file of the user's: Strata and llama.cpp serve it, transformers has no checkpoint
        from pool.gguf_meta import GGUFModel

        model_dir, gguf_path = None, str(args.gguf)
        args.layers = GGUFModel(gguf_path).config["num_hidden_layers"]
        args.peers = [p for p in args.peers if p != "transformers"]
        notes.append(f"model: {gguf_path} (transformers is not run on a GGUF file; ratios are against llama.cpp "
                     "and llama-server)")
    elif args.model_dir:
        model_dir = args.model_dir
        args.layers = checkpoint_layers(model_dir)  # the stages split the checkpoint's layers, not --layers
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
    spec = spec_from_args(args, ORDINARY_TOKENS) if args.workload == "mixed" else None
    if spec is not None:
        in_process = [p for p in args.peers if p in ("transformers", "llama.cpp")]
        if in_process:
            notes.append(f"{', '.join(in_process)}: not run on the mixed workload (an in-process peer takes its "
                         "requests a batch at a time, not as they arrive)")
        args.peers = [p for p in args.peers if p not in in_process]
    prompts = {b: prompt_ids(seed, b, args.prompt_tokens) for b in sorted(set(args.concurrency) | {1})}
    prompts_path = tmp / "prompts.json"
    prompts_path.write_text(json.dumps({str(b): p for b, p in prompts.items()}))
    sizes = ["--model-dir", model_dir or "", "--prompts", str(prompts_path), "--output-tokens", str(args.output_tokens),
             "--batches", ",".join(map(str, args.concurrency)), "--threads", str(args.threads),
             "--repeats", str(args.repeats)]
    rows: list[dict[str, Any]] = []
    hf_greedy: list[int] = []
    llama_greedy: list[int] = []
    if spec is not None and model_dir and not gguf_path:  # the greedy reference the in-process peer gives
        try:
            hf_greedy = run_child("stages.bench_peers", ["greedy", *sizes])["greedy_ids"]
        except RuntimeError as err:
            notes.append(f"no greedy check against transformers: {err}")
    binary: tuple[str | None, str] | None = None  # llama-server's, located at the first llama-server peer
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
            elif peer in llama_server.PEERS:
                binary = binary or llama_server.locate(args.llama_server)
                if binary[0] is None:
                    notes.append(f"{peer} skipped: {binary[1]}")
                    continue
                gguf = gguf_path or f32_gguf(model_dir, tmp)
                rows += run_llama_server_peer(args, peer, binary[0], gguf, tmp, prompts, notes, spec)
            elif peer.startswith("strata-") and peer[7:].rstrip("p").isdigit():
                rows += run_strata_peer(args, peer, gguf_path or model_dir, tmp, prompts, notes, spec)
            else:
                raise ValueError(f"unknown peer {peer!r}; known: strata-N (N stages), strata-Np (pipelined), "
                                 "transformers, llama.cpp, llama-server, llama-server-f32")
        except RuntimeError as err:  # one peer failing is reported; the others still run
            notes.append(f"{peer} FAILED: {err}")
            print(f"peer {peer} failed: {err}", file=sys.stderr, flush=True)
    if spec is None:
        for peer, tag in (("transformers", "hf"), ("llama.cpp", "llama"), ("llama-server", "ls")):
            base = {r["concurrency"]: r for r in rows if r["peer"] == peer}
            for r in rows:
                b = base.get(r["concurrency"], {})
                r[f"prefill_vs_{tag}"] = ratio(r.get("prefill_tok_s"), b.get("prefill_tok_s"))
                r[f"decode_vs_{tag}"] = ratio(r.get("decode_tok_s"), b.get("decode_tok_s"))
    else:
        mixed_ratios(rows)
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
    for r in rows:
        if "greedy_ids" in r:
            ids, stop = r.pop("greedy_ids"), r.pop("greedy_stop")
            reference, against = (llama_greedy, "llama.cpp") if gguf_path else (hf_greedy, "transformers")
            notes.append(llama_server.greedy_note(r["peer"], ids, stop, reference, against, args.output_tokens)
                         if reference else f"greedy check: {r['peer']}'s ids not checked (no {against} ids)")
    if spec is not None:
        return mixed_result(args, spec, rows, notes)
    notes += [
        f"prompts: {args.prompt_tokens} random token ids each (seeded), {args.output_tokens} tokens generated, "
        f"greedy; thread budget {args.threads} for every peer (Strata: each stage in turns has all of it, "
        "pipelined stages split it); CPU",
        "Strata and llama-server are measured over HTTP from the client (API, scheduler and stage hops included); "
        "transformers and llama.cpp around the call in-process; *_vs_hf / *_vs_llama / *_vs_ls are ratios against "
        "transformers / llama.cpp / llama-server at the same concurrency",
    ]
    return {
        "bench": "peers",
        "columns": present(rows, ["peer", "concurrency", "prefill_tok_s", "decode_tok_s", "ttft_ms", "prefill_vs_hf",
                                  "decode_vs_hf", "prefill_vs_llama", "decode_vs_llama", "prefill_vs_ls",
                                  "decode_vs_ls", "weights_mib"]),
        "rows": rows,
        "plot": {"x": "peer", "series": ["concurrency"],
                 "panels": [{"y": ["decode_tok_s"], "ylabel": "decode tokens / s", "kind": "bar"},
                            {"y": ["prefill_tok_s"], "ylabel": "prefill tokens / s", "kind": "bar"}]},
        "notes": [n for n in notes if n],
    }


def present(rows: list[dict[str, Any]], columns: list[str]) -> list[str]:
    """The columns, less the ratio columns (`*_vs_*`) no row has a value for (their peer did not run)."""
    return [c for c in columns if "_vs_" not in c or any(r.get(c) is not None for r in rows)]


def peer_slots(args: argparse.Namespace, spec: WorkloadSpec | None) -> int:
    """Slots of a server peer: --slots, else 8 for the mixed workload and the largest batch for the other."""
    return args.slots or (8 if spec is not None else max(args.concurrency))


def peer_cells(args: argparse.Namespace, spec: WorkloadSpec | None) -> int:
    """Cells per slot of a server peer: the longest request's, in whole chunks."""
    return slot_cells(spec.max_context if spec is not None else args.prompt_tokens + args.output_tokens)


def mixed_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's ratios against llama-server's row (llama-server-f32's when only it ran), in place."""
    base = next((r for name in llama_server.PEERS for r in rows if r["peer"] == name), {})
    for r in rows:
        for key, tag in (("out_tok_s", "out_tok_s"), ("makespan_s", "makespan"), ("ttft_p50_ms", "ttft_p50"),
                         ("e2e_p50_s", "e2e_p50")):
            r[f"{tag}_vs_ls"] = ratio(r.get(key), base.get(key))


def mixed_result(args: argparse.Namespace, spec: WorkloadSpec, rows: list[dict[str, Any]],
                 notes: list[str]) -> dict[str, Any]:
    notes += [
        f"mixed workload: {spec.describe()}; token-id prompts to /v1/completions, greedy, ignore_eos; every server "
        f"peer has {peer_slots(args, spec)} slots of {peer_cells(args, spec)} cells; thread budget {args.threads} "
        "for every peer (Strata: each stage in turns has all of it, pipelined stages split it); CPU",
        "from the client over HTTP: tokens from the server's usage; makespan = first send to the end of the last "
        "stream; out_tok_s = output tokens / makespan; TTFT in ms, end-to-end latency (e2e) in s; *_vs_ls = the "
        "figure / llama-server's (for out_tok_s higher is better, for the times lower is)",
    ]
    for r in rows:
        if r.get("first_error"):
            notes.append(f"{r['peer']}: first error: {r['first_error']}")
    return {
        "bench": "peers",
        "workload": {"name": "mixed", **spec.__dict__},
        "columns": present(rows, ["peer", *WORKLOAD_COLUMNS, "out_tok_s_vs_ls", "makespan_vs_ls", "ttft_p50_vs_ls",
                                  "e2e_p50_vs_ls", "weights_mib"]),
        "rows": rows,
        "plot": {"x": "peer", "panels": [{"y": ["out_tok_s"], "ylabel": "output tokens / s", "kind": "bar"},
                                         {"y": ["ttft_p50_ms", "ttft_p90_ms"], "ylabel": "TTFT (ms)", "kind": "bar"},
                                         {"y": ["e2e_p50_s", "e2e_p90_s"], "ylabel": "latency (s)", "kind": "bar"}]},
        "notes": [n for n in notes if n],
    }


def f32_gguf(model_dir: str, tmp: Path) -> str:
    """The F32 GGUF of the checkpoint the llama.cpp peer reads (tmp/model-f32.gguf), written once."""
    path = tmp / "model-f32.gguf"
    if not path.exists():
        run_child("stages.bench_peers", ["export", "--model-dir", model_dir, "--gguf", str(path), "--quant", "F32"])
    return str(path)


async def greedy_text(url: str, prompt: list[int], n: int) -> str:
    """The text of a server's first n greedy tokens for `prompt` (ignore_eos); also warms the server up."""
    cfg = ServeConfig(url=url, api="completions", ignore_eos=True, timeout_s=600.0)
    async with make_client(url, None, cfg.timeout_s, 2) as client:
        cfg.model = await resolve_model(client)
        res = await stream_request(client, cfg, [], n, prompt_ids=prompt)
    if not res.ok:
        raise RuntimeError(f"server at {url}: {res.error}")
    return res.text


def measure_server(url: str, args: argparse.Namespace, prompts: dict[int, list[list[int]]],
                   spec: WorkloadSpec | None) -> tuple[list[dict[str, Any]], str]:
    """A server peer's rows (the batches, or the one row of the mixed workload) and its greedy text."""
    if spec is None:
        return asyncio.run(measure_batches(url, prompts, args.output_tokens, args.concurrency, args.repeats))
    text = asyncio.run(greedy_text(url, prompts[1][0], args.output_tokens))
    row = asyncio.run(measure_workload(url, spec))
    row.pop("model", None)
    return [row], text


def short_note(peer: str, rows: list[dict[str, Any]], output_tokens: int) -> str:
    """A note on batches that generated fewer than b x M tokens (none when every batch generated them all)."""
    short = [r for r in rows if "concurrency" in r and r["output_tokens"] != r["concurrency"] * output_tokens]
    if not short:
        return ""
    return (f"{peer}: batches generated fewer than b x {output_tokens} tokens despite ignore_eos: "
            + ", ".join(f"{r['output_tokens']} at concurrency {r['concurrency']}" for r in short))


def run_strata_peer(args: argparse.Namespace, peer: str, model_dir: str, tmp: Path,
                    prompts: dict[int, list[list[int]]], notes: list[str],
                    spec: WorkloadSpec | None = None) -> list[dict[str, Any]]:
    name = peer.split("-", 1)[1]
    n_stages = int(name.rstrip("p"))
    port = free_port()
    cfg = strata_config(model_dir, n_stages, args.layers, args.threads, port, max_context=peer_cells(args, spec),
                        parallel=peer_slots(args, spec), root=tmp, pipeline=True if name.endswith("p") else "auto",
                        dtype=args.dtype, int8_activations=args.int8_activations == "on")
    path = tmp / f"{peer}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    with StrataServer(path, port, tmp / f"{peer}.log") as server:
        found, text = measure_server(server.url, args, prompts, spec)
        weights = stage_weight_bytes(server.url)
    notes.append(f"{peer}: {n_stages} CPU stage(s), engine.pipeline {cfg['engine']['pipeline']}, "
                 f"engine.threads {cfg['engine']['threads']} each, engine.dtype {cfg['engine']['dtype']}, "
                 f"engine.int8_activations {cfg['engine']['int8_activations']}, "
                 f"layers {[s['layers'] for s in cfg['stages']]}, parallel {cfg['engine']['parallel']}, "
                 f"weights as loaded per stage (MiB) {[round(w / 2**20, 1) for w in weights]}")
    notes.append(short_note(peer, found, args.output_tokens))
    out = [{"peer": peer, **r, "weights_mib": round(sum(weights) / 2**20, 1)} for r in found]
    out[0]["greedy_text"] = text
    return out


def run_llama_server_peer(args: argparse.Namespace, peer: str, binary: str, gguf: str, tmp: Path,
                          prompts: dict[int, list[list[int]]], notes: list[str],
                          spec: WorkloadSpec | None = None) -> list[dict[str, Any]]:
    port = free_port()
    cmd, note = llama_server.peer_cmd(args, peer, binary, gguf, port, peer_slots(args, spec), peer_cells(args, spec))
    with llama_server.LlamaServer(cmd, port, tmp / f"{peer}.log") as server:
        ids, stop = llama_server.greedy_ids(server.url, prompts[1][0], args.output_tokens)
        found, _ = measure_server(server.url, args, prompts, spec)
    notes.append(note)
    notes.append(short_note(peer, found, args.output_tokens))
    out = [{"peer": peer, **r} for r in found]
    out[0]["greedy_ids"], out[0]["greedy_stop"] = ids, stop
    return out


def prompt_ids(seed: int, batch: int, length: int) -> list[list[int]]:
    """`batch` prompts of `length` random ordinary token ids (seeded). The in-process peers get the seed-0
    prompts; Strata gets those for the greedy check and fresh seeds for every timed batch."""
    rng = random.Random(f"{seed}-{batch}-{length}")
    return [[rng.randrange(ORDINARY_TOKENS) for _ in range(length)] for _ in range(batch)]
