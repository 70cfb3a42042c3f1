"""The torch side of `strata bench peers`: build the shared checkpoint, and time the peers that run in-process
(transformers, and llama.cpp through llama-cpp-python). `coordinator.bench.peers` runs this module as child
processes and serves the same checkpoint with Strata over HTTP itself.

    python -m stages.bench_peers build  --dir D [geometry]       -> {"model_dir", "params", "vocab"}
    python -m stages.bench_peers hf     --model-dir D [sizes]    -> {"rows": [...], "greedy_ids": [...]}
    python -m stages.bench_peers llamacpp --model-dir D [sizes]  -> {"rows": [...]} or {"skipped": reason}
    python -m stages.bench_peers export --model-dir D --gguf F --quant Q8_0|Q4_0|Q4_K|...  -> {"gguf": F}

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


def cmd_hf(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    rows, greedy = [], []
    prompts = load_prompts(args.prompts)
    for b in args.batches:
        ids = torch.tensor(prompts[b])
        n_prompt = ids.shape[1]
        mask = torch.ones_like(ids)

        def gen(n: int, ids: torch.Tensor = ids, mask: torch.Tensor = mask) -> torch.Tensor:
            with torch.inference_mode():
                # eos_token_id None: no EOS stops the run and none is masked (min_new_tokens would mask it)
                return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                      pad_token_id=0, eos_token_id=None)

        t_first = timeit(lambda: gen(1), args.repeats)
        t_all = timeit(lambda: gen(args.output_tokens), args.repeats)
        if b == 1:
            greedy = gen(args.output_tokens)[0, n_prompt:].tolist()
        rows.append({"peer": "transformers", "concurrency": b, **rates(b, n_prompt, args.output_tokens,
                                                                       t_first, t_all)})
        print(f"  transformers batch {b}: {rows[-1]}", file=sys.stderr, flush=True)
    return {"rows": rows, "greedy_ids": greedy, "threads": torch.get_num_threads()}


GGUF_ARCHS = {"Qwen3ForCausalLM": "QWEN3", "Qwen2ForCausalLM": "QWEN2", "LlamaForCausalLM": "LLAMA"}


def _permute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's LLAMA arch rotates interleaved pairs; HF Llama rotates halves: reorder q/k rows as its
    converter does. (Qwen2/Qwen3 use the halves convention in llama.cpp too: no reorder.)"""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export_gguf(model_dir: str, out: Path, qtype: str = "F32") -> Path:
    """Write the checkpoint as a GGUF with the `gguf` package: the config as llama.cpp keys, the byte-level BPE
    tokenizer (vocab padded to vocab_size), every tensor under llama.cpp's name; with `qtype` other than F32,
    every 2-D weight whose rows split into whole blocks stored in it (stages/gguf_quantize.py)."""
    import gguf

    from stages.gguf_quantize import quantizable, quantize
    from safetensors.torch import load_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    arch_cls = cfg["architectures"][0]
    if arch_cls not in GGUF_ARCHS:
        raise RuntimeError(f"no GGUF export for {arch_cls}; supported: {', '.join(GGUF_ARCHS)}")
    arch = getattr(gguf.MODEL_ARCH, GGUF_ARCHS[arch_cls])
    heads, kv_heads, n_layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    file_type = {"F32": "ALL_F32", "Q4_K": "MOSTLY_Q4_K_S"}.get(qtype, f"MOSTLY_{qtype}")
    w.add_file_type(getattr(gguf.LlamaFileType, file_type))
    tok = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    special = {a["id"]: a["content"] for a in tok.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(cfg["vocab_size"]):
        if i in special:
            tokens.append(special[i]); types.append(gguf.TokenType.CONTROL)
        elif i in by_id:
            tokens.append(by_id[i]); types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]"); types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    names = gguf.get_tensor_name_map(arch, n_layers)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    for name, t in tensors.items():
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise RuntimeError(f"no GGUF name for tensor {name}")
        t = t.float()
        if arch == gguf.MODEL_ARCH.LLAMA and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = _permute_rope(t, heads if "q_proj" in name else kv_heads)
        a = t.contiguous().numpy()
        if quantizable(name, a, qtype):
            w.add_tensor(target, quantize(a, qtype), raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            w.add_tensor(target, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


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
    p.add_argument("cmd", choices=["build", "hf", "llamacpp", "export"])
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
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = {"build": cmd_build, "hf": cmd_hf, "llamacpp": cmd_llamacpp, "export": cmd_export}[args.cmd](args)
    write_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
