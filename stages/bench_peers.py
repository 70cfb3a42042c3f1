"""The torch side of `strata bench peers`: build the shared checkpoint, and time the peers that run in-process
(transformers, and llama.cpp through llama-cpp-python). `coordinator.bench.peers` runs this module as child
processes and serves the same checkpoint with Strata over HTTP itself.

    python -m stages.bench_peers build  --dir D [geometry]       -> {"model_dir", "params"}
    python -m stages.bench_peers hf     --model-dir D [sizes]    -> {"rows": [...], "greedy_ids": [...]}
    python -m stages.bench_peers llamacpp --model-dir D [sizes]  -> {"rows": [...]} or {"skipped": reason}

Every peer gets the same thread budget (`--threads`: torch.set_num_threads / llama.cpp n_threads and
n_threads_batch) and the same prompts (`--prompts FILE`, random ids from the tokenizer's ordinary tokens, made
by coordinator.bench.peers), so no peer's tokenizer or template changes the prompt length.

Figures, for a batch of b prompts of P tokens generating M tokens each (greedy, EOS suppressed):
    prefill tok/s = b * P / t(generate 1 token)
    decode tok/s  = b * (M - 1) / (t(generate M tokens) - t(generate 1 token))
each time the best of `--repeats` runs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from stages.bench_pool import write_result



def load_prompts(path: str) -> dict[int, list[list[int]]]:
    """The prompts every peer gets, written by coordinator.bench.peers: {batch: [[token id, ...], ...]}."""
    return {int(b): p for b, p in json.loads(Path(path).read_text()).items()}


def best(fn: Callable[[], Any], repeats: int) -> float:
    """Least wall time of `fn()` over `repeats` runs after one warm-up (seconds)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def rates(batch: int, prompt: int, new: int, t_first: float, t_all: float) -> dict[str, Any]:
    return {"prefill_tok_s": batch * prompt / t_first,
            "decode_tok_s": batch * (new - 1) / (t_all - t_first) if t_all > t_first else None,
            "ttft_ms": t_first * 1e3}


def cmd_build(args: argparse.Namespace) -> dict[str, Any]:
    from safetensors import safe_open

    from stages.tiny import make_tiny_model

    out = make_tiny_model(args.dir, arch=args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads,
                          kv_heads=args.kv_heads, vocab=args.vocab, seed=args.seed, max_position=args.max_position)
    params = 0
    for f in sorted(Path(out).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                params += _numel(st.get_slice(name).get_shape())
    return {"model_dir": str(out), "params": params}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def cmd_hf(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    rows, greedy = [], []
    prompts = load_prompts(args.prompts)
    for b in args.batches:
        ids = torch.tensor(prompts[b])
        n_prompt = ids.shape[1]
        mask = torch.ones_like(ids)

        def gen(n: int, ids: torch.Tensor = ids, mask: torch.Tensor = mask) -> torch.Tensor:
            with torch.inference_mode():
                return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=0, eos_token_id=eos)

        t_first = best(lambda: gen(1), args.repeats)
        t_all = best(lambda: gen(args.output_tokens), args.repeats)
        if b == 1:
            greedy = gen(args.output_tokens)[0, n_prompt:].tolist()
        rows.append({"peer": "transformers", "concurrency": b, **rates(b, n_prompt, args.output_tokens,
                                                                       t_first, t_all)})
        print(f"  transformers batch {b}: {rows[-1]}", file=sys.stderr, flush=True)
    return {"rows": rows, "greedy_ids": greedy, "threads": torch.get_num_threads()}


def cmd_llamacpp(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import llama_cpp
    except ImportError:
        return {"skipped": "llama-cpp-python is not installed (pip install llama-cpp-python builds llama.cpp "
                           "from source)"}
    try:
        from stages.gguf_export import export_gguf
    except ImportError as err:
        return {"skipped": f"no GGUF converter: {err}"}
    gguf_path = Path(args.gguf or Path(args.model_dir) / "model-f32.gguf")
    if not gguf_path.exists():
        export_gguf(args.model_dir, gguf_path)
    rows = []
    all_prompts = load_prompts(args.prompts)
    for b in args.batches:
        prompts = all_prompts[b]
        n_prompt = len(prompts[0])
        llm = llama_cpp.Llama(str(gguf_path), n_ctx=n_prompt + args.output_tokens + 8,
                              n_threads=args.threads, n_threads_batch=args.threads, n_batch=512, verbose=False)
        # llama-cpp-python's high-level API runs one sequence at a time: b prompts are run one after another,
        # which is what a client of it gets; the figure is the aggregate rate over all of them.

        def gen(n: int) -> None:
            for p in prompts:
                out = 0
                for _tok in llm.generate(p, temp=0.0, top_k=1, reset=True):
                    out += 1
                    if out >= n:
                        break

        t_first = best(lambda: gen(1), args.repeats)
        t_all = best(lambda: gen(args.output_tokens), args.repeats)
        rows.append({"peer": "llama.cpp", "concurrency": b, **rates(b, n_prompt, args.output_tokens,
                                                                    t_first, t_all)})
        print(f"  llama.cpp batch {b}: {rows[-1]}", file=sys.stderr, flush=True)
        del llm
    return {"rows": rows, "version": getattr(llama_cpp, "__version__", "?"),
            "note": "llama.cpp (llama-cpp-python) runs the b sequences one after another (its Python API is "
                    "single-sequence); f32 GGUF"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m stages.bench_peers")
    p.add_argument("cmd", choices=["build", "hf", "llamacpp"])
    p.add_argument("--json", default=None)
    p.add_argument("--dir", default=None)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--gguf", default=None)
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--max-position", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", default=None, help="JSON {batch: [[ids]]} (hf, llamacpp)")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = {"build": cmd_build, "hf": cmd_hf, "llamacpp": cmd_llamacpp}[args.cmd](args)
    write_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
