"""The torch side of `strata bench peers`: build the shared checkpoint, and time the peers that run in-process
(transformers, and llama.cpp through llama-cpp-python). `coordinator.bench.peers` runs this module as child
processes and serves the same checkpoint with Strata over HTTP itself.

    python -m stages.bench_peers build  --dir D [geometry]       -> {"model_dir", "params", "vocab"}
    python -m stages.bench_peers hf     --model-dir D [sizes]    -> {"rows": [...], "greedy_ids": [...]}
    python -m stages.bench_peers llamacpp --model-dir D [sizes]  -> {"rows": [...]} or {"skipped": reason}
    python -m stages.bench_peers export --model-dir D --gguf F --quant Q8_0|Q4_0|Q4_K|...  -> {"gguf": F}
    python -m stages.bench_peers greedy --model-dir D --prompts P --output-tokens M -> {"greedy_ids": [...]}
    python -m stages.bench_peers build-llama-server [--jobs N]  builds llama-server (stages/llama_server.py) once,
                                                                 prints the binary's path

Every peer gets the same thread budget (`--threads`: torch.set_num_threads / llama.cpp n_threads and
n_threads_batch) and the same prompts (`--prompts FILE`, random ids from the tokenizer's ordinary tokens, made
by coordinator.bench.peers), so no peer's tokenizer or template changes the prompt length.

Figures, for a batch of b prompts of P tokens generating exactly M tokens each (greedy; an EOS is sampled like
any other token and does not end the run, as Strata does with `ignore_eos`):
    prefill tok/s = b * P / t(generate 1 token)
    decode tok/s  = b * (M - 1) / (t(generate M tokens) - t(generate 1 token))
each time the best of `--repeats` runs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from stages.bench_pool import timeit, write_result


def load_prompts(path: str) -> dict[int, list[list[int]]]:
    """The prompts every peer gets, written by coordinator.bench.peers: {batch: [[token id, ...], ...]}."""
    return {int(b): p for b, p in json.loads(Path(path).read_text()).items()}


def rates(batch: int, prompt: int, new: int, t_first: float, t_all: float) -> dict[str, Any]:
    """Prefill and decode tok/s from the best times to generate 1 and `new` tokens (module docstring)."""
    return {"prefill_tok_s": batch * prompt / t_first,
            "decode_tok_s": batch * (new - 1) / (t_all - t_first) if t_all > t_first else None,
            "ttft_ms": t_first * 1e3}


def cmd_build(args: argparse.Namespace) -> dict[str, Any]:
    from safetensors import safe_open

    from stages.tiny import make_tiny_model

    out = make_tiny_model(args.dir, arch=args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads,
                          kv_heads=args.kv_heads, intermediate=args.intermediate, vocab=args.vocab or None,
                          seed=args.seed, max_position=args.max_position)
    params = 0
    for f in sorted(Path(out).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                params += _numel(st.get_slice(name).get_shape())
    vocab = json.loads((Path(out) / "config.json").read_text())["vocab_size"]
    return {"model_dir": str(out), "params": params, "vocab": vocab}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _hf_model(args: argparse.Namespace):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    return AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()


def _generate(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """transformers' greedy `generate` of n tokens after the prompts `ids` (a batch of one length)."""
    with torch.inference_mode():
        # eos_token_id None: no EOS stops the run and none is masked (min_new_tokens would mask it)
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=0, eos_token_id=None)


def cmd_hf(args: argparse.Namespace) -> dict[str, Any]:
    model = _hf_model(args)
    rows, greedy = [], []
    prompts = load_prompts(args.prompts)
    for b in args.batches:
        ids = torch.tensor(prompts[b])
        n_prompt = ids.shape[1]
        t_first = timeit(lambda: _generate(model, ids, 1), args.repeats)
        t_all = timeit(lambda: _generate(model, ids, args.output_tokens), args.repeats)
        if b == 1:
            greedy = _generate(model, ids, args.output_tokens)[0, n_prompt:].tolist()
        rows.append({"peer": "transformers", "concurrency": b, **rates(b, n_prompt, args.output_tokens,
                                                                       t_first, t_all)})
        print(f"  transformers batch {b}: {rows[-1]}", file=sys.stderr, flush=True)
    return {"rows": rows, "greedy_ids": greedy, "threads": torch.get_num_threads()}


def cmd_greedy(args: argparse.Namespace) -> dict[str, Any]:
    """transformers' first --output-tokens greedy ids for the batch-1 prompt (the check the server peers are held
    to when transformers is not timed), generated as cmd_hf generates them."""
    ids = torch.tensor(load_prompts(args.prompts)[1])
    return {"greedy_ids": _generate(_hf_model(args), ids, args.output_tokens)[0, ids.shape[1]:].tolist()}


def export_gguf(model_dir: str, out: Path, qtype: str = "F32") -> Path:
    """The checkpoint as a GGUF file for llama.cpp (stages/gguf_write.py: the converter's layout, `qtype` weights)."""
    from stages.gguf_write import write_gguf

    return write_gguf(model_dir, out, qtype)


def cmd_llamacpp(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import llama_cpp
    except ImportError:
        return {"skipped": "llama-cpp-python is not installed (pip install llama-cpp-python builds llama.cpp "
                           "from source)"}
    try:
        import gguf  # noqa: F401  (the writer export_gguf uses)
    except ImportError:
        return {"skipped": "the gguf package (the GGUF writer) is not installed"}
    if args.no_extra_bufts:
        without_extra_bufts(llama_cpp)
    gguf_path = Path(args.gguf or Path(args.model_dir) / "model-f32.gguf")
    if not gguf_path.exists():
        export_gguf(args.model_dir, gguf_path, args.quant)
    rows: list[dict[str, Any]] = []
    greedy: list[int] = []
    all_prompts = load_prompts(args.prompts)
    for b in args.batches:
        prompts = all_prompts[b]
        n_prompt = len(prompts[0])
        llm = llama_cpp.Llama(str(gguf_path), n_ctx=n_prompt + args.output_tokens + 8,
                              n_threads=args.threads, n_threads_batch=args.threads, n_batch=512, verbose=False)
        # llama-cpp-python's high-level API runs one sequence at a time: b prompts are run one after another,
        # which is what a client of it gets; the figure is the aggregate rate over all of them.

        def gen(n: int, prompts: list[list[int]] = prompts, llm: Any = llm) -> list[int]:
            for p in prompts:
                llm.reset()  # forget the previous prompt: generate() would otherwise reuse a common prefix
                out: list[int] = []
                for tok in llm.generate(p, temp=0.0, top_k=1, reset=True):  # never stops at EOS by itself
                    out.append(tok)
                    if len(out) >= n:
                        break
            return out

        t_first = timeit(lambda: gen(1), args.repeats)
        t_all = timeit(lambda: gen(args.output_tokens), args.repeats)
        if b == 1:
            greedy = gen(args.output_tokens)
        rows.append({"peer": "llama.cpp", "concurrency": b, **rates(b, n_prompt, args.output_tokens,
                                                                    t_first, t_all)})
        print(f"  llama.cpp batch {b}: {rows[-1]}", file=sys.stderr, flush=True)
        del llm
    return {"rows": rows, "greedy_ids": greedy, "version": getattr(llama_cpp, "__version__", "?"),
            "note": "llama.cpp (llama-cpp-python) runs the b sequences one after another (its Python API is "
                    f"single-sequence); GGUF {gguf_path.name}"}


def without_extra_bufts(llama_cpp: Any) -> None:
    """Make every `llama_cpp.Llama` load with `use_extra_bufts` false: llama.cpp's extra CPU buffer types (AMX,
    repacked quant blocks) are left out (llama-cpp-python has no argument for it)."""
    import llama_cpp.llama as high_level

    default = llama_cpp.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    high_level.llama_cpp.llama_model_default_params = params


def cmd_export(args: argparse.Namespace) -> dict[str, Any]:
    export_gguf(args.model_dir, Path(args.gguf), args.quant)
    return {"gguf": args.gguf}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m stages.bench_peers")
    p.add_argument("cmd", choices=["build", "hf", "llamacpp", "export", "greedy", "build-llama-server"])
    p.add_argument("--json", default=None)
    p.add_argument("--dir", default=None)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--gguf", default=None)
    p.add_argument("--quant", default="F32", help="export: the GGUF type of the 2-D weights")
    p.add_argument("--no-extra-bufts", action="store_true", help="llamacpp: load without llama.cpp's extra buffer types")
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--vocab", type=int, default=0, help="0: the tokenizer's size")
    p.add_argument("--max-position", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", default=None, help="JSON {batch: [[ids]]} (hf, llamacpp)")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--jobs", type=int, default=None, help="build-llama-server: compile jobs (default: the CPUs)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cmd == "build-llama-server":
        from stages import llama_server

        return llama_server.main(["build", *(["--jobs", str(args.jobs)] if args.jobs else [])])
    result = {"build": cmd_build, "hf": cmd_hf, "llamacpp": cmd_llamacpp, "export": cmd_export,
              "greedy": cmd_greedy}[args.cmd](args)
    write_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
