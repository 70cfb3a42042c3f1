"""`strata bench`: benchmarks whose every figure is a ratio against a baseline or a peer measured in the same run.

    strata bench pool     move a conversation by table swap (pool on) vs byte copy (pool off); pool bytes
    strata bench paged    decode step through shuffled chunk tables vs one contiguous K/V tensor
    strata bench window   decode step and bytes moved per token through the device window vs window off; the
                          same rule computed for the dual-3080 box, next to the seeds' figures
    strata bench serve    load generator for any OpenAI-compatible server (TTFT, ITL, tok/s; appended turn;
                          --workload mixed: many requests of mixed lengths, makespan and latency percentiles)
    strata bench peers    the same checkpoint served by Strata (1 and 2 stages) vs transformers, llama.cpp and
                          llama-server (--workload mixed: Strata vs llama-server on the mixed workload)
    strata bench soak     many clients for a bounded time (both APIs, streams, disconnects), then the pool checked
    strata bench prefix   conversations on one long shared prefix, prefix sharing on vs off: how many fit, TTFT
    strata bench masks    what a grammar mask costs per sampled token (build, advance + mask), per grammar
    strata bench quant    a kept-quantized projection per step: int4 kernel and dequantize + GEMM vs bfloat16

Each prints a table, and writes <out>/<name>.json and <out>/<name>.png (default out: bench-out/).
The coordinator never imports the stage package: the benchmarks that need torch (pool, paged, window, quant, and
the torch parts of peers) run as `python -m stages.bench_*` child processes that write their result as JSON.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .report import machine_info, render, write_report


def int_list(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4]; every value a positive int."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def word_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return values


def int_range(text: str) -> tuple[int, int]:
    """"64-1024" -> (64, 1024), both included; "128" -> (128, 128). Positive, low <= high."""
    parts = text.split("-")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        low, high = 0, -1
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected a range LOW-HIGH of positive integers, got {text!r}")
    return low, high


PEERS = ("transformers", "llama.cpp", "llama-server", "llama-server-f32")


def peer_list(text: str) -> list[str]:
    """Peers of `strata bench peers`: strata-N (Strata on N stages; strata-Np: pipelined, pool/pipeline.py),
    transformers, llama.cpp, llama-server, llama-server-f32."""
    values = word_list(text)
    for v in values:
        if v not in PEERS and not re.fullmatch(r"strata-[1-9][0-9]*p?", v):
            raise argparse.ArgumentTypeError(f"unknown peer {v!r}; known: strata-N (N stages), strata-Np (N stages "
                                             f"pipelined), {', '.join(PEERS)}")
    return values


def run_child(module: str, args: list[str]) -> dict[str, Any]:
    """Run `python -m <module> --json FILE <args>` (progress goes to our stderr) and return its result."""
    with tempfile.TemporaryDirectory(prefix="strata-bench-") as tmp:
        path = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", module, "--json", str(path), *args]
        proc = subprocess.run(cmd, stdout=sys.stderr)
        if proc.returncode != 0 or not path.exists():
            raise RuntimeError(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
        return json.loads(path.read_text())


def publish(result: dict[str, Any], out: str, plot: bool = True) -> dict[str, Path]:
    """Stamp the machine, print the table, write JSON and PNG; return the paths written."""
    result.setdefault("machine", machine_info())
    paths = write_report(result, out, plot=plot)
    print(render(result))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return paths


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="bench", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--out", default="bench-out", help="directory for <bench>.json and <bench>.png")
        sp.add_argument("--no-plot", action="store_true", help="skip the PNG")

    def mixed(sp: argparse.ArgumentParser) -> None:  # the mixed-length workload (workload.py)
        sp.add_argument("--workload", choices=["levels", "mixed"], default="levels",
                        help="levels: fixed lengths per concurrency level; mixed: --requests of mixed lengths")
        sp.add_argument("--prompt-range", type=int_range, default=(64, 1024), help="mixed: prompt tokens, LOW-HIGH")
        sp.add_argument("--output-range", type=int_range, default=(16, 128), help="mixed: output tokens, LOW-HIGH")
        sp.add_argument("--arrivals", choices=["all", "poisson"], default="all",
                        help="mixed: every request at once, or Poisson arrivals at --rate")
        sp.add_argument("--rate", type=float, default=4.0, help="mixed, poisson: requests per second")

    pool = sub.add_parser("pool", help="table swap vs byte copy; pool bytes vs (parallel + 1) x max_context")
    common(pool)
    pool.add_argument("--cells", type=int_list, default=[16384, 32768, 65536, 131072])
    pool.add_argument("--kv-dtypes", type=word_list, default=["int8", "bfloat16"])
    pool.add_argument("--geometries", type=word_list, default=["cpu-tiny", "dual-3080"])
    pool.add_argument("--max-timed-layers", type=int, default=2,
                      help="copy at most this many layers and scale to the stage's layer count")
    pool.add_argument("--swap-repeats", type=int, default=200)
    pool.add_argument("--copy-repeats", type=int, default=3)
    pool.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")

    quant = sub.add_parser("quant", help="kept-quantized projection: int4 kernel, dequantize + GEMM vs bfloat16")
    common(quant)
    quant.add_argument("--shapes", type=word_list, default=["768x768", "3072x768", "768x3072"])
    quant.add_argument("--kinds", type=word_list, default=["Q4_K", "Q4_0", "Q8_0", "Q5_0"])
    quant.add_argument("--rows", type=int_list, default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    quant.add_argument("--repeats", type=int, default=20)
    quant.add_argument("--threads", type=int, default=2)

    paged = sub.add_parser("paged", help="decode step through shuffled chunk tables vs contiguous K/V")
    common(paged)
    paged.add_argument("--contexts", type=int_list, default=[1024, 8192, 32768])
    paged.add_argument("--slots", type=int, default=1, help="slots decoding together in the step")
    paged.add_argument("--repeats", type=int, default=20)
    paged.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")

    window = sub.add_parser("window", help="decode through the device window vs window off; dual-3080 computed")
    common(window)
    window.add_argument("--contexts", type=int_list, default=[1024, 4096, 16384, 32768])
    window.add_argument("--long", action="store_true", help="add 65536 and 131072 cells to the contexts")
    window.add_argument("--frames", type=int_list, default=[1, 2, 4], help="small windows, in frames")
    window.add_argument("--chunk-cells", type=int, default=256)
    window.add_argument("--kv-dtype", choices=["int8", "auto"], default="int8")
    window.add_argument("--steps", type=int, default=16, help="timed decode steps per variant")
    window.add_argument("--warmup", type=int, default=2, help="untimed decode steps before them")
    window.add_argument("--threads", type=int, default=1, help="torch threads (0: the stage's default)")
    window.add_argument("--json", action="store_true", help="also print the whole result as JSON")

    serve = sub.add_parser("serve", help="load generator for an OpenAI-compatible server")
    common(serve)
    serve.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8080")
    serve.add_argument("--concurrency", type=int_list, default=[1, 2, 4])
    serve.add_argument("--prompt-tokens", type=int, default=256)
    serve.add_argument("--output-tokens", type=int, default=64)
    serve.add_argument("--requests", type=int, default=None, help="requests per level (default 2 x concurrency, "
                       "at least 4); mixed: requests in all (default 32)")
    serve.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    serve.add_argument("--api", choices=["chat", "completions"], default="chat")
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM / llama.cpp extension)")
    serve.add_argument("--long-tokens", type=int, default=None,
                       help="appended-turn case: tokens of the held conversation (default 4 x --prompt-tokens; "
                            "0 skips it)")
    serve.add_argument("--question-tokens", type=int, default=16)
    serve.add_argument("--trials", type=int, default=3)
    serve.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    mixed(serve)
    serve.add_argument("--token-ids", type=int, default=500, help="mixed: prompt ids are drawn from [0, N)")

    soak = sub.add_parser("soak", help="many clients for a bounded time; errors, latency, pool free after erase")
    common(soak)
    soak.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8080")
    soak.add_argument("--clients", type=int, default=64)
    soak.add_argument("--seconds", type=float, default=60.0)
    soak.add_argument("--api-key", default=None)
    soak.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--max-tokens", type=int, default=64, help="upper bound of a request's max_tokens")
    soak.add_argument("--stream-share", type=float, default=0.5)
    soak.add_argument("--disconnect-share", type=float, default=0.25, help="of streams, dropped mid-stream")
    soak.add_argument("--timeout", type=float, default=120.0, help="seconds per request")

    prefix = sub.add_parser("prefix", help="conversations sharing one long prefix: engine.share_prefixes on vs off")
    common(prefix)
    prefix.add_argument("--prefix-tokens", type=int, default=8192)
    prefix.add_argument("--suffix-tokens", type=int, default=64, help="each conversation's own prompt tokens")
    prefix.add_argument("--output-tokens", type=int, default=8)
    prefix.add_argument("--conversations", type=int, default=16)
    prefix.add_argument("--fit", type=int, default=4, help="conversations the pool holds without sharing")
    prefix.add_argument("--chunk-cells", type=int, default=256)
    prefix.add_argument("--model", default="tiny")
    prefix.add_argument("--layers", type=int, default=4, help="the model's decoder layers, split over two stages")
    prefix.add_argument("--threads", type=int, default=0, help="torch threads per stage (0: the cores split)")
    prefix.add_argument("--seed", type=int, default=0)
    prefix.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")

    masks = sub.add_parser("masks", help="grammar mask cost per sampled token, per grammar the API builds")
    common(masks)
    masks.add_argument("--model", default="", help="a checkpoint directory whose tokenizer to use")
    masks.add_argument("--vocab", type=int, default=32000, help="without --model: the trained tokenizer's size")
    masks.add_argument("--tokens", type=int, default=256, help="tokens per walk at most")
    masks.add_argument("--walks", type=int, default=4)
    masks.add_argument("--seed", type=int, default=0)

    peers = sub.add_parser("peers", help="Strata (1 and 2 stages) vs transformers, llama.cpp and llama-server, "
                           "same weights")
    common(peers)
    peers.add_argument("--arch", default="qwen3")
    peers.add_argument("--layers", type=int, default=12)
    peers.add_argument("--hidden", type=int, default=768)
    peers.add_argument("--heads", type=int, default=12)
    peers.add_argument("--kv-heads", type=int, default=4)
    peers.add_argument("--intermediate", type=int, default=3072)
    peers.add_argument("--vocab", type=int, default=0, help="0: the tokenizer's size (every id decodes to text)")
    peers.add_argument("--prompt-tokens", type=int, default=128)
    peers.add_argument("--output-tokens", type=int, default=32)
    peers.add_argument("--concurrency", type=int_list, default=[1, 4])
    peers.add_argument("--threads", type=int, default=2, help="the thread budget every peer gets")
    peers.add_argument("--repeats", type=int, default=3, help="each wall time is the best of this many runs")
    peers.add_argument("--peers", type=peer_list, default=["strata-1", "strata-2", "transformers", "llama.cpp"])
    peers.add_argument("--model-dir", default=None, help="reuse this checkpoint instead of building one")
    peers.add_argument("--quant", default="F32", choices=["F32", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K",
                                                        "Q6_K", "Q4_K_M"],
                       help="serve the checkpoint as a GGUF file with its 2-D weights in this type (Strata and "
                            "llama.cpp on the same file; Q4_K_M: Q4_K, and Q6_K where llama.cpp's Q4_K_M has it)")
    peers.add_argument("--gguf", default=None, help="a GGUF file to serve (Strata vs llama.cpp; no transformers)")
    peers.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                       help="Strata's engine.dtype (auto: the checkpoint's; a quantized GGUF's bfloat16, or "
                            "float32 on a CPU without native 16-bit products)")
    peers.add_argument("--int8-activations", choices=["on", "off"], default="on",
                       help="Strata's engine.int8_activations (decode rows by quantized weights as 8-bit rows)")
    mixed(peers)
    peers.add_argument("--requests", type=int, default=None, help="mixed: requests in all (default 32)")
    peers.add_argument("--seed", type=int, default=0, help="mixed: the workload's seed")
    peers.add_argument("--slots", type=int, default=0, help="slots of every server peer (Strata's engine.parallel, "
                       "llama-server -np); 0: 8 for the mixed workload, the largest --concurrency otherwise")
    peers.add_argument("--llama-server", default=None, help="the llama-server binary (default: the one "
                       "`python -m stages.bench_peers build-llama-server` built)")
    peers.add_argument("--llama-kv", choices=["f16", "f32", "q8_0"], default="f16",
                       help="llama-server's K/V cache type (llama-server-f32: f32)")
    peers.add_argument("--llama-flash-attn", choices=["auto", "on", "off"], default="auto",
                       help="llama-server's flash attention (llama-server-f32: off)")
    peers.add_argument("--llama-repack", choices=["on", "off"], default="on",
                       help="llama-server's repacking of quantized weights for the CPU (off: --no-repack, for a CPU "
                       "where loading a repacked file crashes)")
    return p


def _child_args(args: argparse.Namespace, names: list[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        value = getattr(args, name.replace("-", "_"))
        out += [f"--{name}", ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plot = not args.no_plot
    try:
        if args.bench == "pool":
            result = run_child("stages.bench_pool", _child_args(args, [
                "cells", "kv-dtypes", "geometries", "max-timed-layers", "swap-repeats", "copy-repeats", "threads"]))
        elif args.bench == "paged":
            result = run_child("stages.bench_paged", _child_args(args, ["contexts", "slots", "repeats", "threads"]))
        elif args.bench == "quant":
            result = run_child("stages.bench_quant", _child_args(args, ["shapes", "kinds", "rows", "repeats",
                                                                        "threads"]))
        elif args.bench == "window":
            result = run_child("stages.bench_window", _child_args(args, [
                "contexts", "frames", "chunk-cells", "kv-dtype", "steps", "warmup", "threads"])
                + (["--long"] if args.long else []))
        elif args.bench == "serve" and args.workload == "mixed":
            from .workload import run_mixed_serve, spec_from_args

            result = run_mixed_serve(args.url, spec_from_args(args, args.token_ids), api_key=args.api_key,
                                     model=args.model, timeout_s=args.timeout)
        elif args.bench == "serve":
            from .serve import ServeConfig, run_serve_sync

            cfg = ServeConfig(url=args.url, model=args.model, api=args.api, prompt_tokens=args.prompt_tokens,
                              output_tokens=args.output_tokens, seed=args.seed, api_key=args.api_key,
                              ignore_eos=args.ignore_eos, timeout_s=args.timeout)
            long_tokens = 4 * args.prompt_tokens if args.long_tokens is None else args.long_tokens
            result = run_serve_sync(cfg, args.concurrency, args.requests, long_tokens=long_tokens,
                                    question_tokens=args.question_tokens, trials=args.trials)
        elif args.bench == "soak":
            from .soak import SoakConfig, run_soak_sync

            result = run_soak_sync(SoakConfig(
                url=args.url, clients=args.clients, seconds=args.seconds, api_key=args.api_key, model=args.model,
                seed=args.seed, timeout_s=args.timeout, stream_share=args.stream_share,
                disconnect_share=args.disconnect_share, max_tokens=args.max_tokens))
        elif args.bench == "masks":
            from .masks import run_masks

            result = run_masks(args)
        elif args.bench == "prefix":
            from .prefix import run_prefix

            result = run_prefix(args)
        else:
            from .peers import run_peers

            result = run_peers(args)
    except (RuntimeError, OSError) as err:
        print(f"strata bench {args.bench}: {err}", file=sys.stderr)
        return 1
    publish(result, args.out, plot=plot)
    if getattr(args, "json", False) is True:
        print(json.dumps(result, indent=2))
    if args.bench == "soak":  # a soak is also a check: unexpected outcomes or a dirty pool fail it
        return 0 if result["summary"]["clean"] and not result["summary"]["unexpected"] else 1
    return 0
