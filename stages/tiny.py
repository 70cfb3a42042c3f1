"""Random-weight checkpoints in exactly the Hugging Face layout, with a real tokenizer: the "tiny" model.

`make_tiny_model` writes what a Hub download of a Llama / Mistral / Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE /
Qwen3-Next checkpoint holds:
`config.json`, `generation_config.json`, `model.safetensors` (or `model-0000i-of-0000n.safetensors` plus
`model.safetensors.index.json`), `tokenizer.json` and `tokenizer_config.json` with a ChatML chat template.
It needs torch, safetensors and tokenizers only: transformers is a test dependency, and the embedded
default (`model: tiny`) must build on a box without it.

Rules:
- Deterministic: the same arguments give byte-identical files (weights come from one
  `torch.Generator(seed)` in a fixed tensor order; the tokenizer is trained on `CORPUS`, which is part of
  the format).
- Weights: linears, biases and embeddings ~ N(0, WEIGHT_STD^2) with WEIGHT_STD = 0.1, larger than the
  usual 0.02 so that logits are far from flat (greedy decoding then has few near-ties, which makes
  comparisons between implementations meaningful). RMSNorm weights are 1 + N(0, NORM_JITTER^2), so a
  norm applied wrongly changes the output.
- Tokenizer: stages/tiny_tokenizer.py (byte-level BPE trained on `CORPUS`, special tokens, ChatML template).
- `vocab` larger than the tokenizer pads the embedding (as real checkpoints do); smaller is refused.
- `tie_embeddings=None` follows the arch's small public checkpoints: tied for qwen2/qwen3 (no
  `lm_head.weight` in the files), untied for llama/mistral and the MoE archs.
- MoE (qwen2_moe, qwen3_moe): `experts` experts (default 8) of `moe_intermediate` (default 32), `top_k`
  (default 2) per token, every `sparse_step`-th layer sparse (default 1: all), per-expert tensors named as
  on the Hub (`mlp.experts.{e}.gate_proj.weight`, ...); `norm_topk_prob` as the public checkpoints
  (Qwen3-MoE true, Qwen1.5-MoE false); qwen2_moe adds the shared expert (2 * moe_intermediate) and its gate.
- qwen3_next: the MoE of qwen2_moe (norm_topk_prob true); every 4th layer full attention
  (`full_attention_interval`, as on the Hub), with an output gate and a rotary quarter of each head (head_dim
  must divide by 8); the others Gated DeltaNet with kv_heads key heads and heads value heads of head_dim, conv
  kernel 4. Its RMSNorms scale by (1 + weight), so their weights are N(0, NORM_JITTER^2) (the gated norm of the
  linear layers keeps 1 + N(0, NORM_JITTER^2)); A_log ~ A_LOG_MEAN + N(0, 1), a decay slow enough that a
  state remembers some tens of tokens; dt_bias is a bias.

`ensure_tiny("tiny")` builds the embedded default (DEFAULT_SPEC) once into `tiny_cache_dir()` and reuses
it; the cache key covers the spec and the source of every file that shapes the checkpoint (this one and
stages/tiny_tokenizer.py, which holds the corpus), so a changed format never serves a stale build.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from stages import tiny_tokenizer
from stages.tiny_tokenizer import (
    BOS_TOKEN, CHAT_TEMPLATE, CORPUS, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, TOKENIZER_VOCAB, build_tokenizer,
    special_ids, tokenizer_config,
)

__all__ = [
    "ARCHS", "BOS_TOKEN", "CHAT_TEMPLATE", "CORPUS", "DEFAULT_SPEC", "DTYPES", "EOS_TOKEN", "NORM_JITTER", "PAD_TOKEN",
    "SPECIAL_TOKENS", "TOKENIZER_VOCAB", "WEIGHT_STD", "build_tokenizer", "ensure_tiny", "main", "make_tiny_model",
    "MOE_DEFAULTS", "make_weights", "resolve_spec", "special_ids", "tensor_shapes", "tiny_cache_dir", "tiny_config",
]

# torch and safetensors are imported where weights are made, so that `--describe` and a cache hit in
# ensure_tiny stay cheap.

WEIGHT_STD = 0.1
NORM_JITTER = 0.1

# qkv_bias: q/k/v projections carry a bias (Qwen2). qk_norm: per-head RMSNorm on q and k (Qwen3).
ARCHS: dict[str, dict[str, Any]] = {
    "llama": {"cls": "LlamaForCausalLM", "rope_theta": 1e4, "qkv_bias": False, "qk_norm": False, "tie": False},
    "mistral": {"cls": "MistralForCausalLM", "rope_theta": 1e4, "qkv_bias": False, "qk_norm": False, "tie": False},
    "qwen2": {"cls": "Qwen2ForCausalLM", "rope_theta": 1e6, "qkv_bias": True, "qk_norm": False, "tie": True},
    "qwen3": {"cls": "Qwen3ForCausalLM", "rope_theta": 1e6, "qkv_bias": False, "qk_norm": True, "tie": True},
    "qwen2_moe": {"cls": "Qwen2MoeForCausalLM", "rope_theta": 1e6, "qkv_bias": True, "qk_norm": False, "tie": False,
                  "moe": True, "shared_expert": True, "norm_topk_prob": False},
    "qwen3_moe": {"cls": "Qwen3MoeForCausalLM", "rope_theta": 1e6, "qkv_bias": False, "qk_norm": True, "tie": False,
                  "moe": True, "shared_expert": False, "norm_topk_prob": True},
    "qwen3_next": {"cls": "Qwen3NextForCausalLM", "rope_theta": 1e7, "qkv_bias": False, "qk_norm": True, "tie": False,
                   "moe": True, "shared_expert": True, "norm_topk_prob": True, "linear": True},
}
A_LOG_MEAN = -3.0  # qwen3_next: exp(A_log) ~ 0.05, a decay per token of roughly exp(-0.05 * softplus(a + dt_bias))
FULL_ATTENTION_INTERVAL = 4
MOE_DEFAULTS = {"experts": 8, "top_k": 2, "moe_intermediate": 32, "sparse_step": 1}
DTYPES = ("float32", "bfloat16", "float16")

# The embedded default, `model: tiny` in a config.
DEFAULT_SPEC: dict[str, Any] = {
    "arch": "qwen3", "layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2, "seed": 0, "dtype": "float32",
}

def tiny_config(arch: str = "qwen3", layers: int = 4, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                intermediate: int | None = None, vocab: int | None = None, dtype: str = "float32",
                rope_scaling: dict | None = None, max_position: int = 32768,
                tie_embeddings: bool | None = None, experts: int | None = None, top_k: int | None = None,
                moe_intermediate: int | None = None, sparse_step: int | None = None) -> dict[str, Any]:
    """The `config.json` of a tiny checkpoint (pure: no weights, no tokenizer training).

    intermediate (the dense MLP) defaults to 3 * hidden; head_dim is hidden // heads for every arch; the MoE
    keywords (MOE_DEFAULTS) are for the MoE archs only.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; supported: {', '.join(ARCHS)}")
    moe_given = {"experts": experts, "top_k": top_k, "moe_intermediate": moe_intermediate, "sparse_step": sparse_step}
    if not ARCHS[arch].get("moe") and any(v is not None for v in moe_given.values()):
        raise ValueError(f"{', '.join(k for k, v in moe_given.items() if v is not None)}: only for the MoE archs")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    if min(layers, hidden, heads, kv_heads) < 1 or hidden % heads or heads % kv_heads:
        raise ValueError(f"bad geometry: hidden={hidden} heads={heads} kv_heads={kv_heads} layers={layers}"
                         " (hidden must divide by heads, heads by kv_heads)")
    if (hidden // heads) % (8 if ARCHS.get(arch, {}).get("linear") else 2):
        raise ValueError(f"head_dim {hidden // heads} must be even (rotary embedding; qwen3_next: a multiple of 8, "
                         "its rotary quarter even)")
    vocab = TOKENIZER_VOCAB if vocab is None else vocab
    if vocab < TOKENIZER_VOCAB:
        raise ValueError(f"vocab {vocab} is smaller than the tokenizer ({TOKENIZER_VOCAB} tokens)")
    a = ARCHS[arch]
    ids = special_ids()
    cfg: dict[str, Any] = {
        "architectures": [a["cls"]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": intermediate or 3 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "vocab_size": vocab,
        "max_position_embeddings": max_position,
        "rms_norm_eps": 1e-6,
        "rope_theta": a["rope_theta"],
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": a["tie"] if tie_embeddings is None else bool(tie_embeddings),
        "torch_dtype": dtype,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
        "attention_bias": a["qkv_bias"],
        "attention_dropout": 0.0,
        "initializer_range": WEIGHT_STD,
        "use_cache": True,
    }
    if arch == "llama":
        cfg.update(mlp_bias=False, pretraining_tp=1)
    if arch == "mistral":
        cfg.update(sliding_window=None)
    if arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=layers)
    if a.get("linear"):
        cfg.update(partial_rotary_factor=0.25, full_attention_interval=FULL_ATTENTION_INTERVAL,
                   linear_num_key_heads=kv_heads, linear_num_value_heads=heads, linear_key_head_dim=hidden // heads,
                   linear_value_head_dim=hidden // heads, linear_conv_kernel_dim=4)
    if a.get("moe"):
        m = {**MOE_DEFAULTS, **{k: v for k, v in moe_given.items() if v is not None}}
        if not 1 <= m["top_k"] <= m["experts"] or min(m["moe_intermediate"], m["sparse_step"]) < 1:
            raise ValueError(f"bad MoE geometry: experts={m['experts']} top_k={m['top_k']} "
                             f"moe_intermediate={m['moe_intermediate']} sparse_step={m['sparse_step']}")
        cfg.update(num_experts=m["experts"], num_experts_per_tok=m["top_k"], moe_intermediate_size=m["moe_intermediate"],
                   decoder_sparse_step=m["sparse_step"], mlp_only_layers=[], norm_topk_prob=a["norm_topk_prob"],
                   output_router_logits=False, router_aux_loss_coef=0.001)
        if a["shared_expert"]:
            cfg.update(shared_expert_intermediate_size=2 * m["moe_intermediate"])
    if arch == "qwen2_moe":
        cfg.update(qkv_bias=True)  # Qwen2MoeConfig's name for the q/k/v biases
    return cfg


def _sparse(cfg: dict[str, Any], layer: int) -> bool:
    """transformers' rule (stages/moe.py): the layer routes through experts."""
    if not ARCHS[cfg["model_type"]].get("moe"):
        return False
    return (layer not in cfg["mlp_only_layers"] and cfg["num_experts"] > 0
            and (layer + 1) % cfg["decoder_sparse_step"] == 0)


def tensor_shapes(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint in the fixed generation order (HF names)."""
    h, hd, inter, vocab = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    a = ARCHS[cfg["model_type"]]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", (h,)))
        if a.get("linear") and (i + 1) % cfg["full_attention_interval"]:  # a Gated DeltaNet layer
            out += _linear_shapes(cfg, p + "linear_attn.")
        else:
            q_rows = 2 * q if a.get("linear") else q  # qwen3_next: q and the output gate, interleaved per head
            for name, rows in (("q_proj", q_rows), ("k_proj", kv), ("v_proj", kv)):
                out.append((p + f"self_attn.{name}.weight", (rows, h)))
                if a["qkv_bias"]:
                    out.append((p + f"self_attn.{name}.bias", (rows,)))
            if a["qk_norm"]:
                out += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
            out.append((p + "self_attn.o_proj.weight", (h, q)))
        out.append((p + "post_attention_layernorm.weight", (h,)))
        if _sparse(cfg, i):
            out.append((p + "mlp.gate.weight", (cfg["num_experts"], h)))
            mi = cfg["moe_intermediate_size"]
            for e in range(cfg["num_experts"]):
                out += [(p + f"mlp.experts.{e}.gate_proj.weight", (mi, h)),
                        (p + f"mlp.experts.{e}.up_proj.weight", (mi, h)),
                        (p + f"mlp.experts.{e}.down_proj.weight", (h, mi))]
            if a.get("shared_expert"):
                si = cfg["shared_expert_intermediate_size"]
                out += [(p + "mlp.shared_expert.gate_proj.weight", (si, h)),
                        (p + "mlp.shared_expert.up_proj.weight", (si, h)),
                        (p + "mlp.shared_expert.down_proj.weight", (h, si)),
                        (p + "mlp.shared_expert_gate.weight", (1, h))]
            continue
        out += [(p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter))]
    out.append(("model.norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (vocab, h)))
    return out


def _linear_shapes(cfg: dict[str, Any], p: str) -> list[tuple[str, tuple[int, ...]]]:
    """A Gated DeltaNet mixer's tensors (qwen3_next), named and shaped as transformers writes them."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, h = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["hidden_size"]
    conv = 2 * nk * dk + nv * dv
    return [(p + "in_proj_qkvz.weight", (conv + nv * dv, h)), (p + "in_proj_ba.weight", (2 * nv, h)),
            (p + "conv1d.weight", (conv, 1, cfg["linear_conv_kernel_dim"])), (p + "dt_bias", (nv,)),
            (p + "A_log", (nv,)), (p + "norm.weight", (dv,)), (p + "out_proj.weight", (h, nv * dv))]


def make_weights(cfg: dict[str, Any], seed: int) -> dict[str, "torch.Tensor"]:  # noqa: F821
    """Seeded random weights in `tensor_shapes` order, cast to the config's dtype."""
    import torch

    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, cfg["torch_dtype"])
    offset_norms = bool(ARCHS[cfg["model_type"]].get("linear"))  # (1 + weight) RMSNorms
    weights = {}
    for name, shape in tensor_shapes(cfg):
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        if name.endswith("A_log"):
            t = A_LOG_MEAN + t
        elif name.endswith("norm.weight"):
            t = NORM_JITTER * t + (0.0 if offset_norms and "linear_attn" not in name else 1.0)
        else:
            t = WEIGHT_STD * t
        weights[name] = t.to(dtype).contiguous()
    return weights


def _shard_plan(sizes: list[int], shards: int) -> list[int]:
    """Shard index per tensor: contiguous, balanced by bytes, every shard non-empty."""
    n, total, cum, prev, plan = len(sizes), sum(sizes), 0, -1, []
    if not 1 <= shards <= n:
        raise ValueError(f"shards must be between 1 and the number of tensors ({n}), got {shards}")
    for i, size in enumerate(sizes):
        want = cum * shards // total
        s = min(max(want, prev, shards - (n - i)), prev + 1, shards - 1)
        plan.append(s)
        prev, cum = s, cum + size
    return plan


def _write_weights(out: Path, weights: dict[str, "torch.Tensor"], shards: int) -> None:  # noqa: F821
    from safetensors.torch import save_file

    for stale in list(out.glob("model*.safetensors")) + [out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    names = list(weights)
    if shards == 1:
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(out / "model.safetensors", 0o644)  # safetensors writes 0600
        return
    sizes = [weights[k].numel() * weights[k].element_size() for k in names]
    plan = _shard_plan(sizes, shards)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: weights[k] for k, p in zip(names, plan) if p == s}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        os.chmod(out / fname, 0o644)
        weight_map.update({k: fname for k in part})
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / "model.safetensors.index.json", index)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def make_tiny_model(dir: str | os.PathLike, arch: str = "qwen3", layers: int = 4, hidden: int = 64,
                    heads: int = 4, kv_heads: int = 2, intermediate: int | None = None,
                    vocab: int | None = None, seed: int = 0, dtype: str = "float32", shards: int = 1,
                    rope_scaling: dict | None = None, max_position: int = 32768,
                    tie_embeddings: bool | None = None, experts: int | None = None, top_k: int | None = None,
                    moe_intermediate: int | None = None, sparse_step: int | None = None) -> Path:
    """Write a random-weight checkpoint + tokenizer into `dir` (created; old weight files replaced)."""
    cfg = tiny_config(arch, layers, hidden, heads, kv_heads, intermediate, vocab, dtype, rope_scaling,
                      max_position, tie_embeddings, experts, top_k, moe_intermediate, sparse_step)
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    _write_weights(out, make_weights(cfg, seed), shards)
    _write_json(out / "config.json", cfg)
    ids = special_ids()
    _write_json(out / "generation_config.json", {
        "bos_token_id": ids[BOS_TOKEN], "eos_token_id": [ids[EOS_TOKEN], ids["<|endoftext|>"]],
        "pad_token_id": ids[PAD_TOKEN]})
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tokenizer_config(max_position))
    return out


def tiny_cache_dir() -> Path:
    """Where built tiny checkpoints live: `$STRATA_CACHE`, else ~/.cache/strata."""
    env = os.environ.get("STRATA_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "strata"


_SPEC_KEYS = ("arch", "layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "seed", "dtype",
              "shards", "rope_scaling", "max_position", "tie_embeddings", "experts", "top_k", "moe_intermediate",
              "sparse_step")


def _parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        return text


def resolve_spec(name_or_spec: str | dict[str, Any]) -> dict[str, Any]:
    """Turn a model name or spec into `make_tiny_model` keyword arguments.

    "tiny" is DEFAULT_SPEC; "tiny:arch=llama,layers=2" is DEFAULT_SPEC with those changes; a dict is
    keyword arguments for make_tiny_model as they stand (its defaults fill the rest). Unknown keys are
    refused.
    """
    if isinstance(name_or_spec, str):
        name, _, rest = name_or_spec.partition(":")
        if name != "tiny":
            raise ValueError(f"not a tiny model name: {name_or_spec!r} (expected 'tiny' or 'tiny:key=value,...')")
        spec = dict(DEFAULT_SPEC)
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"bad tiny spec item {item!r} in {name_or_spec!r} (expected key=value)")
            spec[key.strip()] = _parse_value(value.strip())
    else:
        spec = dict(name_or_spec)
    unknown = sorted(set(spec) - set(_SPEC_KEYS))
    if unknown:
        raise ValueError(f"unknown tiny spec keys {unknown}; known: {', '.join(_SPEC_KEYS)}")
    return spec


# Every file whose text shapes a checkpoint's bytes; a change to any of them gives new cache keys.
_SOURCES = (Path(__file__), Path(tiny_tokenizer.__file__))
_SOURCE_DIGEST = hashlib.sha256(b"".join(hashlib.sha256(p.read_bytes()).digest() for p in _SOURCES)).hexdigest()


def ensure_tiny(name_or_spec: str | dict[str, Any] = "tiny", cache_dir: str | os.PathLike | None = None) -> Path:
    """Build the named tiny checkpoint once into the cache and return its directory.

    Atomic: it is built in a temporary directory beside the final one and renamed into place, so a
    directory under its final name is always complete. Processes racing on the same spec each build,
    one rename wins and the others discard their copy (the builds are byte-identical anyway).
    """
    spec = resolve_spec(name_or_spec)
    key = hashlib.sha256((json.dumps(spec, sort_keys=True) + _SOURCE_DIGEST).encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir is not None else tiny_cache_dir()
    final = root / f"tiny-{spec.get('arch', 'qwen3')}-{key}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache is read by every process of the box
    try:
        make_tiny_model(tmp, **spec)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> int:
    """`python -m stages.tiny DIR [options]`; `--describe` prints config.json without building."""
    p = argparse.ArgumentParser(prog="python -m stages.tiny", description=__doc__.splitlines()[0])
    p.add_argument("dir", nargs="?", help="output directory (not needed with --describe)")
    p.add_argument("--arch", default="qwen3", choices=list(ARCHS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--max-position", type=int, default=32768)
    p.add_argument("--rope-scaling", type=json.loads, default=None,
                   help='JSON, e.g. \'{"rope_type": "linear", "factor": 2.0}\'')
    p.add_argument("--tie-embeddings", choices=["auto", "yes", "no"], default="auto")
    p.add_argument("--experts", type=int, default=None, help=f"MoE archs (default {MOE_DEFAULTS['experts']})")
    p.add_argument("--top-k", type=int, default=None, help=f"MoE archs (default {MOE_DEFAULTS['top_k']})")
    p.add_argument("--moe-intermediate", type=int, default=None,
                   help=f"MoE archs (default {MOE_DEFAULTS['moe_intermediate']})")
    p.add_argument("--sparse-step", type=int, default=None,
                   help="MoE archs: every n-th layer routes (default 1: all)")
    p.add_argument("--describe", nargs="?", const="", metavar="SPEC",
                   help="print the config.json of SPEC ('tiny', 'tiny:k=v,...'; empty: the other options)")
    a = p.parse_args(argv)
    tie = {"auto": None, "yes": True, "no": False}[a.tie_embeddings]
    kwargs = dict(arch=a.arch, layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads,
                  intermediate=a.intermediate, vocab=a.vocab, dtype=a.dtype, rope_scaling=a.rope_scaling,
                  max_position=a.max_position, tie_embeddings=tie, experts=a.experts, top_k=a.top_k,
                  moe_intermediate=a.moe_intermediate, sparse_step=a.sparse_step)
    if a.describe is not None:
        if a.describe:
            kwargs = {k: v for k, v in resolve_spec(a.describe).items() if k not in ("seed", "shards")}
        print(json.dumps(tiny_config(**kwargs), indent=2, sort_keys=True))
        return 0
    if not a.dir:
        p.error("DIR is required unless --describe is given")
    out = make_tiny_model(a.dir, seed=a.seed, shards=a.shards, **kwargs)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
