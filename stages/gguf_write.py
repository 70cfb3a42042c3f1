"""A Hugging Face checkpoint written as a GGUF file, as llama.cpp's converter writes it (numpy and the gguf package).

For `strata bench peers` (llama.cpp reads the same weights as Strata) and the tests (a GGUF oracle of the same
checkpoint). `write_gguf(model_dir, out, qtype)` writes:
- the config as `{arch}.*` keys (llama, qwen2, qwen3, qwen3moe, qwen3next: its ssm.* linear-attention geometry,
  full_attention_interval, the shared expert's size, rope.dimension_count = the rotary part of each head);
- the byte-level BPE vocabulary (tokens, merges, token types: added special tokens CONTROL), padded with UNUSED
  tokens to the embedding's rows; bos/eos and the chat template (when the checkpoint has one);
- every tensor under its llama.cpp name: llama q/k rows permuted as the converter's `LlamaModel.permute`; MoE
  experts stacked per layer; Qwen3-Next reshaped as the converter reshapes it (`_qwen3next_tensors`). Every
  2-D weight that `stages.gguf_quantize.quantizable` allows is stored as `qtype` (a mix, Q4_K_M: as
  `stages.gguf_quantize.tensor_type` says per weight); the rest stays F32, as the converter keeps norms, biases,
  routers and the conv.
With `split_max_tensors`, the file is split as llama.cpp's gguf-split does (`NAME-00001-of-0000N.gguf`, the
metadata in the first); the first file's path is returned.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from stages.gguf_quantize import quantizable, quantize, tensor_type

GGUF_ARCHS = {"Qwen3ForCausalLM": "QWEN3", "Qwen2ForCausalLM": "QWEN2", "LlamaForCausalLM": "LLAMA",
              "Qwen3MoeForCausalLM": "QWEN3MOE", "Qwen3NextForCausalLM": "QWEN3NEXT"}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def float_weights(model_dir: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors checkpoint as float32 numpy (bfloat16 ones too)."""
    from safetensors.torch import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in load_file(str(f)).items()})
    return out


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _qwen3next_tensors(weights: dict[str, np.ndarray], cfg: dict) -> dict[str, np.ndarray]:
    """What llama.cpp's converter does to a Qwen3-Next checkpoint: A_log -> -exp(A_log), dt_bias -> dt_proj.bias,
    the conv weight squeezed, every RMSNorm but the gated one + 1, in_proj_qkvz (rows per key head) -> attn_qkv
    (q | k | v in head order) and attn_gate (z)."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    out: dict[str, np.ndarray] = {}
    for name, t in weights.items():
        if name.endswith(".A_log"):
            t = -np.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if name.endswith("in_proj_qkvz.weight"):
            layer = int(name.split(".")[2])
            parts = t.reshape(nk, -1, t.shape[-1])
            q, k, v, z = np.split(parts, np.cumsum([dk, dk, nv // nk * dv])[:3], axis=1)
            out[f"blk.{layer}.attn_qkv.weight"] = np.concatenate([x.reshape(-1, t.shape[-1]) for x in (q, k, v)])
            out[f"blk.{layer}.attn_gate.weight"] = z.reshape(-1, t.shape[-1])
            continue
        out[name] = t
    return out


def write_gguf(model_dir: str | Path, out: str | Path, qtype: str = "F32", split_max_tensors: int = 0) -> Path:
    """Write the checkpoint at `model_dir` as a GGUF file `out` (module docstring); returns its (first) path."""
    import gguf

    model_dir, out = Path(model_dir), Path(out)
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg["architectures"][0] not in GGUF_ARCHS:
        raise ValueError(f"no GGUF writer for {cfg['architectures'][0]}; supported: {', '.join(GGUF_ARCHS)}")
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
    w.add_rope_dimension_count(int(head_dim * cfg.get("partial_rotary_factor", 1.0)))
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if "num_experts" in cfg:
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in cfg:
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if "linear_num_key_heads" in cfg:
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    rope = cfg.get("rope_scaling") or {}
    if rope:
        w.add_rope_scaling_type(gguf.RopeScalingType[rope["rope_type"].upper()])
        w.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    file_type = {"F32": "ALL_F32", "Q4_K": "MOSTLY_Q4_K_S"}.get(qtype, f"MOSTLY_{qtype}")  # Q4_K_M: MOSTLY_Q4_K_M
    w.add_file_type(getattr(gguf.LlamaFileType, file_type))
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    special = {a["id"]: a["content"] for a in tok.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(max(cfg["vocab_size"], max([*by_id, *special]) + 1)):  # the embedding's rows, padded
        if i in special:
            tokens.append(special[i])
            types.append(gguf.TokenType.CONTROL)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)
    tok_cfg_file = model_dir / "tokenizer_config.json"
    template = json.loads(tok_cfg_file.read_text()).get("chat_template") if tok_cfg_file.is_file() else None
    if template:
        w.add_chat_template(template)
    names = gguf.get_tensor_name_map(arch, n_layers)
    weights = float_weights(model_dir)
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}  # the converter stacks each layer's experts
    for name in [n for n in weights if _EXPERT.fullmatch(n)]:
        layer, e, proj = _EXPERT.fullmatch(name).groups()
        experts.setdefault((int(layer), proj), {})[int(e)] = weights.pop(name)
    for (layer, proj), parts in experts.items():
        weights[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([parts[e] for e in sorted(parts)])
    if arch == gguf.MODEL_ARCH.QWEN3NEXT:
        weights = _qwen3next_tensors(weights, cfg)
    for name, t in weights.items():
        target = name if name.startswith("blk.") else names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert target is not None, name
        if arch == gguf.MODEL_ARCH.LLAMA and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = _permute(t, heads if "q_proj" in name else kv_heads)
        t = np.ascontiguousarray(t)
        kind = tensor_type(target, qtype, n_layers, bool(cfg.get("tie_word_embeddings")))
        if quantizable(name, t, kind):
            w.add_tensor(target, quantize(t, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            w.add_tensor(target, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shards = sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))
    return shards[0] if split_max_tensors and shards else out
