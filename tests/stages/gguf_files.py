"""Tiny GGUF files made from tiny Hugging Face checkpoints, as llama.cpp's converter writes them (numpy only).

`write_gguf(model_dir, out, qtype)` writes the checkpoint's config as `{arch}.*` keys, its byte-level BPE
vocabulary (tokens, merges, token types: added special tokens CONTROL), bos/eos and the chat template, and
every tensor under its llama.cpp name. Every 2-D weight whose rows split into whole blocks is stored as
`qtype` (stages/gguf_quantize.py); norms and biases stay F32, as the converter keeps
them. llama q/k rows are permuted as the converter's `LlamaModel.permute` does.

With `split_max_tensors`, the file is split as llama.cpp's gguf-split does (`NAME-00001-of-0000N.gguf`, the
metadata in the first); the first file's path is returned.

`write_dequantized_checkpoint(model_dir, qtype, out)` writes the Hugging Face checkpoint whose weights are the
quantized ones dequantized (`gguf.quants.dequantize`): what transformers must compute for a quantized file.
Quantization blocks run along a row, so permuting rows before or after quantizing gives the same bytes.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np

from stages.gguf_quantize import quantizable, quantize

GGUF_ARCHS = {"Qwen3ForCausalLM": "QWEN3", "Qwen2ForCausalLM": "QWEN2", "LlamaForCausalLM": "LLAMA",
              "Qwen3MoeForCausalLM": "QWEN3MOE"}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def _weights(model_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return {k: v.astype(np.float32) for k, v in out.items()}


def _roundtrip(w: np.ndarray, qtype: str) -> np.ndarray:
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    return gguf.quants.dequantize(quantize(w, qtype), t)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: str | Path, out: str | Path, qtype: str = "F32", split_max_tensors: int = 0) -> Path:
    import gguf

    model_dir, out = Path(model_dir), Path(out)
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = getattr(gguf.MODEL_ARCH, GGUF_ARCHS[cfg["architectures"][0]])
    heads, kv_heads, n_layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch], split_max_tensors=split_max_tensors)
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
    if "num_experts" in cfg:
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    rope = cfg.get("rope_scaling") or {}
    if rope:
        w.add_rope_scaling_type(gguf.RopeScalingType[rope["rope_type"].upper()])
        w.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    special = {a["id"]: a["content"] for a in tok.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(max([*by_id, *special]) + 1):
        if i in special:
            tokens.append(special[i])
            types.append(gguf.TokenType.CONTROL)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    w.add_chat_template(tok_cfg["chat_template"])
    names = gguf.get_tensor_name_map(arch, n_layers)
    weights = _weights(model_dir)
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}  # the converter stacks each layer's experts
    for name in [n for n in weights if _EXPERT.fullmatch(n)]:
        layer, e, proj = _EXPERT.fullmatch(name).groups()
        experts.setdefault((int(layer), proj), {})[int(e)] = weights.pop(name)
    for (layer, proj), parts in experts.items():
        weights[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([parts[e] for e in sorted(parts)])
    for name, t in weights.items():
        target = name if name.startswith("blk.") else names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert target is not None, name
        if arch == gguf.MODEL_ARCH.LLAMA and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = _permute(t, heads if "q_proj" in name else kv_heads)
        t = np.ascontiguousarray(t)
        if quantizable(name, t, qtype):
            q = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(target, quantize(t, qtype), raw_dtype=q)
        else:
            w.add_tensor(target, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shards = sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))
    return shards[0] if split_max_tensors and shards else out


def write_dequantized_checkpoint(model_dir: str | Path, qtype: str, out: str | Path) -> Path:
    from safetensors.numpy import save_file

    model_dir, out = Path(model_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.startswith("model"):
            shutil.copy(f, out / f.name)
    weights = {k: np.ascontiguousarray(_roundtrip(v, qtype) if quantizable(k, v, qtype) else v)
               for k, v in _weights(model_dir).items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
