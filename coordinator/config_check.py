"""`strata config check FILE [--set k=v ...]`: what a config will cost, per stage, before anything starts.

It resolves the model without loading a weight: `config.json` for the geometry, and the safetensors
headers (the 8-byte length and the JSON that follows it) for the tensors' shapes and dtypes. No torch.
`tiny` (and `tiny:key=value,...`) is described by `python -m stages.tiny --describe` in a child process
(the coordinator never imports the stage package); its weights then come from the geometry.

Figures per stage (exact bytes; GiB = 2^30 bytes in the table):
- pool: the stage's full-attention layers (pool/layer_kinds.py: a linear-attention layer holds no cell), K and V for every cell of `n_chunks + 1` chunks (the trash chunk
  is allocated too): (n_chunks + 1) * chunk_cells * layers * 2 * kv_heads * head_dim * kv_bytes, plus for
  int8 the float32 scale per cell per head, (n_chunks + 1) * chunk_cells * layers * 2 * kv_heads * 4.
  Cross-checked against `pool.memory.PoolLayout`, which the stage uses to size its file (its header, a
  few KiB, comes on top and is not counted). These are host bytes: the pool file in /dev/shm/strata-<uid>, pinned with
  cudaHostRegister on a CUDA stage, plain host memory on a CPU stage.
- weights: the tensors of its layer range, plus the embedding on the first stage and the final norm and
  lm_head on the last (a tied lm_head is the embedding, loaded by the last stage too); in `engine.dtype`
  when it is set, else as stored.
- window: the device window's frames (`pool.window_plan.plan_frames` with the free memory unknown, so
  `engine.device_cells: auto` is the whole pool: at start a CUDA stage shrinks it to what fits), its cells
  (frames * chunk_cells) and bytes ((frames + 1) * chunk_cells * layers * bytes_per_cell, the trash frame
  included). A CUDA stage always has one; a CPU stage only when `device_cells` is a number (then the
  frames are a second host array, and there is no device figure).
- scratch (CUDA): `pool.window_plan.scratch_bytes`, the device memory a step's transient tensors are
  given, from the model's hidden, intermediate, heads, KV heads, head_dim and vocab (last stage).
- state: on a stage with linear-attention layers, `engine.state_entries` (default 2 x parallel) entries, and
  `engine.state_checkpoints` (default 2 x parallel) more for checkpoints at chunk boundaries, of
  `pool.layer_kinds.state_entry_bytes` each (conv state in the compute dtype, recurrent state in float32), in
  the stage's device memory (coordinator/linear_state.py, coordinator/state_checkpoints.py).
- device (CUDA): weights + window + scratch + state, what the card must hold besides the CUDA context; a note
  per CUDA stage spells it out beside the pinned host pool.
- baseline: (parallel + 1) x max_context cells at the same bytes per cell: what each stage would hold
  without the pool (one full context per slot plus one for a parked conversation).

A `.gguf` model is read from its header (pool/gguf_meta.py: the metadata as config.json, the tensor infos); its
weights are counted as loaded: a quantized weight kept quantized at its packed size (pool/gguf_meta.kept_bytes),
every other tensor in the compute dtype; a note names the formats kept and those dequantized.

Refused (ConfigError, exit 1): what `pool.config` refuses, a model directory without config.json,
a model the stages cannot compute (the same rules as `stages.checkpoint.check_computable`, which refuses it
again at load: an architecture outside SUPPORTED_ARCHS, a `hidden_act` other than silu, a rope type outside
SUPPORTED_ROPE_TYPES or a partial rotary factor (but Qwen3-Next's), a layer kind other than full or linear
attention, any `quantization_config`, a weight stored in a dtype other
than F64/F32/F16/BF16), stages that do not cover the model's layers exactly once, a pool geometry the stage
could not lay out, a `device_cells` a CUDA stage cannot run with (0: it has no other way to reach its K/V).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pool.computable import (FLOAT_ST_DTYPES, FP8_ST_DTYPE, INT4_KERNEL_GROUPS, INT4_PARTS,  # noqa: F401
                             SUPPORTED_ARCHS, SUPPORTED_ROPE_TYPES, auto_dtype, fp8_blocks, int4_scheme,
                             keeps_int4, rotary_problem, uncomputable)
from pool.gguf_meta import int4_bytes
from pool.layer_kinds import FLOAT32_HELD, FULL, layer_types, state_entry_bytes
from pool.config import Config, ConfigError, load_config
from pool.memory import PoolLayout
from pool import pipeline
from pool.window_plan import Geometry, frame_bytes, plan_frames, scratch_bytes, window_bytes

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
# safetensors dtype codes -> bytes per element
ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
            "I8": 1, "U8": 1, "BOOL": 1}
ST_FLOAT = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
LOADABLE_ST = FLOAT_ST_DTYPES  # what stages/ computes: pool/computable.py, shared with the stage package
# The architectures whose weights the config.json geometry formula (dense_tensor_shapes) knows.
DENSE_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
TINY_FALLBACK = {  # the embedded default, if `python -m stages.tiny --describe` cannot run
    "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "torch_dtype": "float32", "tie_word_embeddings": True,
}


@dataclass(frozen=True)
class ModelInfo:
    """The checkpoint as the check sees it."""

    source: str                 # the directory, or "tiny (embedded default, built on first use)"
    arch: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int | None
    dtype: str                  # the stored dtype of the weights (config.json torch_dtype)
    weights_from: str           # "safetensors headers" | "config.json geometry" | "unknown"
    intermediate: int | None = None  # MLP width (config.json intermediate_size), for the scratch estimate
    kinds: tuple[str, ...] = ()  # per layer (pool/layer_kinds.py); only full-attention layers hold pool cells

    def pool_layers(self, first: int, last: int) -> int:
        """The layers of [first, last) with K/V in the pool (all of them when no kinds are known)."""
        return sum(k == FULL for k in self.kinds[first:last]) if self.kinds else last - first


@dataclass(frozen=True)
class StageFigures:
    index: int
    device: str
    layers: tuple[int, int]
    weight_bytes: int | None    # None: not computable (an architecture the geometry formula does not know)
    pool_bytes: int             # host bytes: the pool file's data (pinned on CUDA)
    pool_cells: int             # usable cells, n_chunks * chunk_cells (the trash chunk is in pool_bytes)
    baseline_bytes: int
    pinned: bool = False        # the pool file is cudaHostRegister'ed (a CUDA stage)
    window_frames: int = 0      # 0: no device window (a CPU stage without device_cells)
    window_cells: int = 0       # window_frames * chunk_cells
    window_bytes: int = 0       # (window_frames + 1) frames, the trash frame included
    scratch_bytes: int | None = None  # CUDA only; None elsewhere or when the geometry is incomplete
    device_bytes: int | None = None   # CUDA: weights + window + scratch + state; None elsewhere or when unknown
    state_entries: int = 0      # linear-attention state entries (0: the stage has no linear layer)
    state_bytes: int = 0        # (state_entries + state_checkpoints) x one entry (layer_kinds.state_entry_bytes)
    state_checkpoints: int = 0  # more entries for checkpoints at chunk boundaries (coordinator/state_checkpoints.py)


@dataclass
class Report:
    config: Config
    model: ModelInfo
    kv_dtype: str
    bytes_per_cell: int         # one cell of one layer: K, V and int8 scales
    baseline_cells: int         # (parallel + 1) * max_context
    stages: list[StageFigures]
    notes: list[str] = field(default_factory=list)


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Tensor name -> {"dtype", "shape", "data_offsets"} from a .safetensors file, without reading data."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ConfigError(f"model: {path} is not a safetensors file (shorter than 8 bytes)", key="model")
        (n,) = struct.unpack("<Q", head)
        if n > 100 << 20:
            raise ConfigError(f"model: {path} announces a {n}-byte header; not a safetensors file", key="model")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise ConfigError(f"model: {path} has an unreadable safetensors header", key="model") from None
    header.pop("__metadata__", None)
    return header


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    return sorted(model_dir.glob("*.safetensors"))


def _describe_tiny(model: str) -> tuple[dict, str]:
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    try:
        out = subprocess.run([sys.executable, "-m", "stages.tiny", "--describe", model], capture_output=True,
                             text=True, timeout=60, env=env, check=True)
        return json.loads(out.stdout), "config.json geometry"
    except (OSError, subprocess.SubprocessError, ValueError):
        if model != "tiny":
            raise ConfigError(f"model: cannot describe {model!r} (python -m stages.tiny --describe failed)",
                              key="model") from None
        return dict(TINY_FALLBACK), "unknown"


def refuse_uncomputable(where: str, conf: dict, stored: dict[str, str] | None = None) -> None:
    """ConfigError (key "model") naming the first thing of config.json (read from `where`) the stages would not
    compute, instead of serving wrong output; `stored`: tensor name -> safetensors dtype."""
    def refuse(why: str) -> None:
        raise ConfigError(f"model: {why} (in {where})", key="model")

    why = uncomputable(conf)
    if why is not None:
        refuse(why)
    rope = dict(conf.get("rope_parameters") or conf.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in rope.values()):
        refuse("rope parameters per layer type (nested rope_parameters) are not computed by the stages")
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        refuse(f"rope_type {rope_type!r} is not computed by the stages (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    partial = rotary_problem(conf)
    if partial is not None:
        refuse(partial)
    if rope_type in ("linear", "dynamic", "llama3") and rope.get("factor") is None:
        refuse(f"rope_type {rope_type!r} needs a 'factor'")
    scaled = fp8_blocks(conf) is not None  # block-scaled FP8: F8_E4M3 weights beside their scales are computed
    packed = int4_scheme(conf) is not None  # GPTQ / AWQ: integer parts of a packed linear are computed
    odd = sorted(n for n, dt in (stored or {}).items() if dt not in LOADABLE_ST and n.startswith(("model.", "lm_head."))
                 and not (scaled and dt == FP8_ST_DTYPE and f"{n}_scale_inv" in (stored or {}))
                 and not (packed and n.rsplit(".", 1)[-1] in INT4_PARTS))
    if odd:
        dtype = stored[odd[0]]  # type: ignore[index]
        refuse(f"tensor {odd[0]} is stored as {dtype}; the stages read only {', '.join(LOADABLE_ST)} weights")


def _gguf_model(cfg: Config, notes: list[str]) -> tuple[dict, str, list[tuple[str, int, int, bool]]]:
    """config.json's stand-in and the tensors of a .gguf file (pool/gguf_meta.py), each at its loaded size (a
    quantized weight kept quantized, the rest in the compute dtype)."""
    from pool.gguf_meta import PLANE_COUNTS, GGUFError, GGUFModel, kept_bytes

    try:
        m = GGUFModel(cfg.model)
    except GGUFError as err:
        raise ConfigError(f"model: {err}", key="model") from None
    refuse_uncomputable(str(m.path), m.config)
    dtype = _compute_dtype(cfg, m.dtype)
    keep = _keeps_int4(cfg, dtype)
    size = DTYPE_BYTES[dtype]
    cpu = _all_cpu(cfg)
    tensors: list[tuple[str, int, int, bool]] = []
    kept: dict[str, int] = {}
    for name, t in m.tensors.items():
        embedding = name == "model.embed_tokens.weight"
        packed = kept_bytes(t.type, t.shape, size, embedding, cpu) if keep else None
        if packed is None:
            tensors.append((name, t.numel * size, t.numel, True))
            continue
        kept[t.type] = kept.get(t.type, 0) + 1
        tensors.append((name, packed, t.numel, False))
        if embedding and m.config.get("tie_word_embeddings"):  # the last stage multiplies by it: a QuantLinear,
            head = kept_bytes(t.type, t.shape, size, cpu=cpu)  # or (Q6_K off a CPU stage) the table dequantized
            tensors.append(("lm_head.weight", t.numel * size if head is None else head, t.numel, head is None))
    quantized = m.quantized_types()
    if quantized:
        kinds = ", ".join(f"{n} tensors as {kind}" for kind, n in sorted(quantized.items()))
        held = ", ".join(f"{kind} as bytes" if cpu and PLANE_COUNTS[kind] == 2 else
                         f"{kind} as nibble pairs" if cpu and dtype == "float32" else
                         f"{kind} as {PLANE_COUNTS[kind]} int4 plane{'s' * (PLANE_COUNTS[kind] > 1)}"
                         for kind in sorted(kept)) or "none"
        rest = sorted(set(quantized) - set(kept))
        notes.append(f"model: {m.path.name} stores {kinds}; kept quantized: {held}"
                     + (f"; dequantized at load to {dtype}: {', '.join(rest)}" if rest else "")
                     + "; the weights figures are the sizes as loaded")
    return m.config, str(m.path), tensors


def _keeps_int4(cfg: Config, dtype: str) -> bool:
    """Whether every stage keeps int4 planes packed in `dtype` (pool/computable.keeps_int4, the stages' rule);
    when one would not (a CUDA stage in float16 / float32), all are counted dequantized."""
    return all(keeps_int4(dtype, s.device.split(":")[0]) for s in cfg.stages)


def _compute_dtype(cfg: Config, stored: str) -> str:
    """`engine.dtype`, its `auto` resolved from the stored dtype as the stages resolve it (pool/computable.auto_dtype:
    float32 for CPU stages on a CPU without native 16-bit products)."""
    if cfg.engine.dtype != "auto":
        return cfg.engine.dtype
    return auto_dtype(stored, [s.device.split(":")[0] for s in cfg.stages])


def _all_cpu(cfg: Config) -> bool:
    """Every stage a CPU stage: two int4 planes are then counted as bytes (pool/gguf_meta.int4_bytes)."""
    return all(s.device == "cpu" for s in cfg.stages)


def _fp8_as_loaded(tensors: list[tuple[str, int, int, bool]], stored: dict[str, str], conf: dict,
                   notes: list[str]) -> list[tuple[str, int, int, bool]]:
    """A block-scaled FP8 checkpoint's tensors at their loaded size: each F8_E4M3 weight dequantized with its
    `*_scale_inv` into the model dtype (stages/checkpoint.py), the scales not kept."""
    size = DTYPE_BYTES.get(str(conf.get("dtype") or conf.get("torch_dtype") or "bfloat16"), 2)
    fp8 = {n for n, dt in stored.items() if dt == FP8_ST_DTYPE and f"{n}_scale_inv" in stored}
    out = [(n, numel * size if n in fp8 else b, numel, True if n in fp8 else f) for n, b, numel, f in tensors
           if not (n.endswith("_scale_inv") and n.removesuffix("_scale_inv") in fp8)]
    rows, cols = fp8_blocks(conf)  # type: ignore[misc]
    notes.append(f"model: {len(fp8)} weights are block-scaled FP8 ({rows}x{cols} blocks); dequantized at load to "
                 "the compute dtype (no FP8 matmul on this path), so the weights figures are the dequantized sizes")
    return out


def _int4_as_loaded(cfg: Config, tensors: list[tuple[str, int, int, bool]], conf: dict,
                    notes: list[str]) -> list[tuple[str, int, int, bool]]:
    """A GPTQ / AWQ checkpoint's tensors at their loaded size (stages/int4_checkpoint.py): each packed linear as
    its int4 planes (pool/gguf_meta.int4_bytes) when its groups suit the kernel (not desc_act), else dequantized to
    the compute dtype; the packed parts themselves are not kept."""
    scheme = int4_scheme(conf)
    assert scheme is not None
    dtype = _compute_dtype(cfg, str(conf.get("dtype") or conf.get("torch_dtype") or "float16"))
    size = DTYPE_BYTES.get(dtype, 2)
    keep = (scheme["group"] in INT4_KERNEL_GROUPS and not conf["quantization_config"].get("desc_act")
            and _keeps_int4(cfg, dtype))
    bits = scheme["bits"]
    per_word = 32 // bits if scheme["method"] == "gptq" else 8  # values per int32 of a qweight
    out = [t for t in tensors if t[0].rsplit(".", 1)[-1] not in INT4_PARTS]
    for name, _, words, _ in tensors:
        if name.endswith(".qweight"):
            numel = words * per_word
            loaded = (int4_bytes(1 if bits == 4 else 2, numel, scheme["group"], size, _all_cpu(cfg)) if keep
                      else numel * size)
            out.append((name[: -len("qweight")] + "weight", loaded, numel, False))
    how = "kept quantized as int4 planes" if keep else f"dequantized at load to {dtype}"
    notes.append(f"model: {scheme['method'].upper()} {bits}-bit, group_size {scheme['group']}: projections {how}; the "
                 "weights figures are the sizes as loaded")
    return out


def _model_info(source: str, conf: dict, weights_from: str) -> ModelInfo:
    def need(name: str) -> Any:
        if name not in conf:
            raise ConfigError(f"model: {source}/config.json has no {name}", key="model")
        return conf[name]

    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    return ModelInfo(
        source=source, arch=(conf.get("architectures") or ["?"])[0], num_layers=need("num_hidden_layers"),
        hidden=hidden, heads=heads, kv_heads=conf.get("num_key_value_heads", heads),
        head_dim=conf.get("head_dim") or hidden // heads, vocab=conf.get("vocab_size"),
        dtype=str(conf.get("torch_dtype") or conf.get("dtype") or "float32"), weights_from=weights_from,
        intermediate=conf.get("intermediate_size"), kinds=layer_types(conf),
    )


def dense_tensor_shapes(conf: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors of a Llama/Mistral/Qwen2/Qwen3 checkpoint, named as Hugging Face writes them."""
    h, heads = conf["hidden_size"], conf["num_attention_heads"]
    kv, hd = conf.get("num_key_value_heads", heads), conf.get("head_dim") or h // heads
    inter, vocab, arch = conf["intermediate_size"], conf["vocab_size"], conf["architectures"][0]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(conf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (heads * hd, h)), (p + "self_attn.k_proj.weight", (kv * hd, h)),
                (p + "self_attn.v_proj.weight", (kv * hd, h)), (p + "self_attn.o_proj.weight", (h, heads * hd))]
        if arch == "Qwen2ForCausalLM" or conf.get("attention_bias"):
            out += [(p + "self_attn.q_proj.bias", (heads * hd,)), (p + "self_attn.k_proj.bias", (kv * hd,)),
                    (p + "self_attn.v_proj.bias", (kv * hd,))]
        if arch == "Qwen3ForCausalLM":
            out += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        out += [(p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not conf.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (vocab, h)))
    return out


def _owners(name: str, n_stages: int, ranges: list[tuple[int, int]], tied: bool) -> list[int]:
    """The stages that load tensor `name` (empty: no stage does)."""
    if name.startswith("model.layers."):
        layer = int(name.split(".")[2])
        return [i for i, (a, b) in enumerate(ranges) if a <= layer < b]
    if name.startswith("model.embed_tokens."):
        return sorted({0, n_stages - 1}) if tied else [0]
    if name.startswith(("model.norm.", "lm_head.")):
        return [n_stages - 1]
    return []


def _stage_weights(cfg: Config, tensors: list[tuple[str, int, int, bool]], conf: dict, notes: list[str],
                   want: int | None) -> list[int]:
    """Bytes per stage as the stages hold them; `tensors` are (name, stored bytes, elements, is floating point), the
    floating-point ones held at `want` bytes each (None: as stored); FLOAT32_HELD tensors are held in float32."""
    tied = bool(conf.get("tie_word_embeddings"))
    ranges = [s.layers for s in cfg.stages]
    tied = tied and all(name != "lm_head.weight" for name, *_ in tensors)
    totals, stray = [0] * len(ranges), []
    for name, stored, numel, is_float in tensors:
        owners = _owners(name, len(ranges), ranges, tied)
        if not owners:
            stray.append(name)
        held = numel * want if (want and is_float) else stored
        if name.endswith(FLOAT32_HELD.get((conf.get("architectures") or [""])[0], ())):
            held = numel * 4
        for i in owners:
            totals[i] += held
    if stray:
        notes.append(f"{len(stray)} tensors belong to no stage and are not counted (e.g. {stray[0]})")
    return totals


def _stage_figures(cfg: Config, i: int, info: ModelInfo, per_cell: int, kv_dtype: str, weight_bytes: int | None,
                   baseline_cells: int, entry_bytes: int = 0) -> StageFigures:
    """Stage i's host pool, device window, scratch and device total (module docstring)."""
    e, s = cfg.engine, cfg.stages[i]
    n_layers = info.pool_layers(*s.layers)
    pool_bytes = (e.n_chunks + 1) * e.chunk_cells * n_layers * per_cell
    try:
        layout = PoolLayout(n_layers, e.n_chunks, e.chunk_cells, info.kv_heads, info.head_dim, kv_dtype)
    except ValueError as err:
        raise ConfigError(f"engine.chunk_cells={e.chunk_cells}: stage {i} cannot lay out its pool: {err}",
                          key="engine.chunk_cells") from None
    if layout.data_nbytes != pool_bytes:  # two derivations of one number; a difference is a bug
        raise AssertionError(f"pool bytes {pool_bytes} != PoolLayout.data_nbytes {layout.data_nbytes}")
    cuda = s.device.startswith("cuda")
    frame = frame_bytes(e.chunk_cells, per_cell, n_layers)
    frames = plan_frames(e, s.device, frame, i)  # free memory unknown: "auto" is the whole pool
    window = window_bytes(frames, frame)
    entries = e.n_state_entries if entry_bytes else 0
    checkpoints = e.n_state_checkpoints if entry_bytes else 0
    scratch = device = None
    if cuda and info.intermediate is not None and info.vocab is not None:
        is_last = i == len(cfg.stages) - 1
        scratch = scratch_bytes(e, Geometry(info.hidden, info.intermediate, info.heads, info.kv_heads, info.head_dim,
                                            info.vocab, is_last))
        device = None if weight_bytes is None else weight_bytes + window + scratch + (entries + checkpoints) * entry_bytes
    return StageFigures(i, s.device, s.layers, weight_bytes, pool_bytes, e.n_chunks * e.chunk_cells,
                        baseline_cells * n_layers * per_cell, cuda, frames, frames * e.chunk_cells, window, scratch,
                        device, entries, (entries + checkpoints) * entry_bytes, checkpoints)


def _memory_notes(cfg: Config, stages: list[StageFigures]) -> list[str]:
    """Where each stage's bytes live: device total and pinned host pool per CUDA stage, the /dev/shm total."""
    e, out = cfg.engine, []
    for s in stages:
        if s.pinned:
            out.append(f"stage {s.index} on {s.device}: device = weights {_gib(s.weight_bytes)} + window "
                       f"{_gib(s.window_bytes)} ({s.window_frames} frames of {e.chunk_cells} cells) + scratch "
                       f"{_gib(s.scratch_bytes)} = {_gib(s.device_bytes)} GiB; pinned host pool "
                       f"{_gib(s.pool_bytes)} GiB (the pool file, cudaHostRegister'ed)")
        elif s.window_frames:
            out.append(f"stage {s.index} on {s.device}: window {_gib(s.window_bytes)} GiB ({s.window_frames} frames "
                       f"of {e.chunk_cells} cells), a second host array beside the pool file ({_gib(s.pool_bytes)} "
                       f"GiB)")
    if any(s.pinned for s in stages) and e.device_cells == "auto":
        out.append("engine.device_cells=auto: the window figures are the whole pool; the free device memory is not "
                   "known here, and at start a CUDA stage shrinks its window to what fits after the weights and "
                   "the scratch (set a number of cells to fix it)")
    pinned = sum(s.pool_bytes for s in stages if s.pinned)
    if pinned:
        out.append(f"pool files: {_gib(sum(s.pool_bytes for s in stages))} GiB of host memory (/dev/shm) for all "
                   f"stages, {_gib(pinned)} GiB of it pinned (LimitMEMLOCK)")
    return out


def check(cfg: Config) -> Report:
    """Resolve the model, check the layer split against it, and compute every stage's figures."""
    notes = list(cfg.notes())
    tensors: list[tuple[str, int, int, bool]] = []  # name, stored bytes, numel, is_float
    if cfg.model == "tiny" or cfg.model.startswith("tiny:"):
        conf, weights_from = _describe_tiny(cfg.model)
        refuse_uncomputable(cfg.model, conf)
        source = f"{cfg.model} (embedded default, built on first use)"
    elif cfg.model.endswith(".gguf"):
        conf, source, tensors = _gguf_model(cfg, notes)
        weights_from = "GGUF header"
    else:
        model_dir = Path(cfg.model).expanduser()
        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"model: {cfg.model} has no config.json (a Hugging Face checkpoint directory, or tiny)",
                              key="model")
        conf, source = json.loads((model_dir / "config.json").read_text()), str(model_dir)
        stored: dict[str, str] = {}
        for path in _weight_files(model_dir):
            for name, t in read_safetensors_header(path).items():
                numel = math.prod(t["shape"])
                tensors.append((name, t["data_offsets"][1] - t["data_offsets"][0], numel, t["dtype"] in ST_FLOAT))
                stored[name] = t["dtype"]
        refuse_uncomputable(str(model_dir / "config.json"), conf, stored)
        weights_from = "safetensors headers" if tensors else "config.json geometry"
        if fp8_blocks(conf) is not None:
            tensors = _fp8_as_loaded(tensors, stored, conf, notes)
        if int4_scheme(conf) is not None:
            tensors = _int4_as_loaded(cfg, tensors, conf, notes)
    info = _model_info(source, conf, weights_from)
    cfg.check_layers(info.num_layers)
    max_pos = conf.get("max_position_embeddings")
    if max_pos and cfg.engine.max_context > max_pos and not conf.get("rope_scaling"):
        notes.append(f"engine.max_context={cfg.engine.max_context} exceeds the model's max_position_embeddings="
                     f"{max_pos} (no rope_scaling in config.json)")

    stored = DTYPE_BYTES.get(info.dtype, 2)
    if not tensors and info.weights_from == "config.json geometry":
        if info.arch in DENSE_ARCHS and "intermediate_size" in conf:
            tensors = [(n, math.prod(s) * stored, math.prod(s), True) for n, s in dense_tensor_shapes(conf)]
        else:
            info = ModelInfo(**{**info.__dict__, "weights_from": "unknown"})
    compute = _compute_dtype(cfg, info.dtype)
    as_stored = cfg.engine.dtype == "auto" and compute == info.dtype
    want = None if as_stored else DTYPE_BYTES[compute]
    if cfg.engine.dtype == "auto" and not as_stored:
        notes.append(f"engine.dtype=auto computes in {compute}, not the model's {info.dtype}: this CPU has no native "
                     f"{info.dtype} products (torch would convert each one through float32); set engine.dtype to "
                     f"{info.dtype} to keep the weights and K/V at its size")
    weights = _stage_weights(cfg, tensors, conf, notes, want) if tensors else None

    e = cfg.engine
    kv_dtype = "int8" if e.kv_dtype == "int8" else compute
    if kv_dtype not in DTYPE_BYTES:
        raise ConfigError(f"engine.kv_dtype: the model dtype {kv_dtype} is not a KV dtype; set engine.dtype", key="engine.kv_dtype")
    per_cell = 2 * info.kv_heads * info.head_dim * DTYPE_BYTES[kv_dtype]
    if kv_dtype == "int8":
        per_cell += 2 * info.kv_heads * 4
    baseline_cells = (e.parallel + 1) * e.max_context
    stages = [_stage_figures(cfg, i, info, per_cell, kv_dtype, weights[i] if weights else None, baseline_cells,
                             state_entry_bytes(conf, *cfg.stages[i].layers, DTYPE_BYTES.get(compute, 2)))
              for i in range(len(cfg.stages))]
    notes += _memory_notes(cfg, stages)
    return Report(cfg, info, kv_dtype, per_cell, baseline_cells, stages, notes)


def _gib(n: int | None) -> str:
    """GiB with two decimals; small figures keep their significant digits (0.000488, not 0.00)."""
    if n is None:
        return "?"
    v = n / GIB
    return f"{v:.2f}" if v >= 0.01 or v == 0 else f"{v:.6f}".rstrip("0")


class _Dumper(yaml.SafeDumper):
    """Block style, except lists of plain values (`layers: [0, 2]`), as people write them."""


_Dumper.add_representer(list, lambda d, v: d.represent_sequence(
    "tag:yaml.org,2002:seq", v, flow_style=all(not isinstance(x, (list, dict)) for x in v)))


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML that `load_config` reads back to the same config."""
    return yaml.dump(cfg.model_dump(mode="json"), Dumper=_Dumper, sort_keys=False)


def _window_rule(cells: int | str) -> str:
    if cells == "auto":
        return "off on CPU stages; on CUDA stages the whole pool, shrunk at start to what fits"
    return "off on CPU stages; CUDA stages refuse it" if cells == 0 else "on every stage"


def _pipeline_rule(cfg: Config) -> str:
    """pool/pipeline.py rules 1-3, as this config resolves them."""
    if len(cfg.stages) == 1:
        return "one stage"
    if pipeline.turns(cfg):
        threads = f"engine.threads {cfg.engine.threads} each" if cfg.engine.threads else "all its machine's cores"
        return f"in turns: one step in flight, every decoding slot in it, each stage computing it with {threads}"
    return (f"pipelined: up to {len(cfg.stages)} steps in flight, the decoding slots in {len(cfg.stages)} groups, "
            "every stage computing at once")


def format_report(report: Report) -> str:
    """A table (stage, device, layers, weights, host pool, pool cells, window, device total), totals, the exact
    bytes per stage, notes, the resolved YAML."""
    m, e = report.model, report.config.engine
    lines = [
        f"model: {m.source}",
        f"  {m.arch}, {m.num_layers} layers, hidden {m.hidden}, {m.heads} heads, {m.kv_heads} KV heads, "
        f"head_dim {m.head_dim}, {m.dtype}; weights from {m.weights_from}",
        f"pool: {'on' if e.pool_on else 'off (baseline: one full-context region per slot + 1)'}, "
        f"{e.n_chunks} chunks of {e.chunk_cells} cells + 1 trash chunk per stage, "
        f"KV {report.kv_dtype}, {report.bytes_per_cell} B per cell per layer",
        f"device window: engine.device_cells={e.device_cells} ({_window_rule(e.device_cells)})",
        f"steps: engine.pipeline={e.pipeline} ({_pipeline_rule(report.config)})",
        "",
        f"{'stage':>5}  {'device':<8}  {'layers':<10}  {'weights GiB':>11}  {'pool GiB':>9}  {'pool cells':>10}  "
        f"{'window GiB':>10}  {'device GiB':>10}",
    ]
    for s in report.stages:
        window = _gib(s.window_bytes) if s.window_frames else "-"
        device = _gib(s.device_bytes) if s.pinned else "-"
        lines.append(f"{s.index:>5}  {s.device:<8}  {f'[{s.layers[0]}, {s.layers[1]})':<10}  "
                     f"{_gib(s.weight_bytes):>11}  {_gib(s.pool_bytes):>9}  {s.pool_cells:>10}  {window:>10}  "
                     f"{device:>10}")
    weights = [s.weight_bytes for s in report.stages]
    total_w = None if None in weights else sum(weights)  # type: ignore[arg-type]
    lines.append(f"{'total':>5}  {'':<8}  {'':<10}  {_gib(total_w):>11}  "
                 f"{_gib(sum(s.pool_bytes for s in report.stages)):>9}")
    lines.append("")
    for s in report.stages:
        weights = "?" if s.weight_bytes is None else s.weight_bytes
        host = "pinned host memory" if s.pinned else "plain host memory"
        lines.append(f"stage {s.index}: weights {weights} B, pool {s.pool_bytes} B ({host}); without the pool "
                     f"(parallel + 1) x max_context = {report.baseline_cells} cells: {s.baseline_bytes} B "
                     f"({_gib(s.baseline_bytes)} GiB)")
        if s.state_entries:
            n = s.state_entries + s.state_checkpoints
            lines.append(f"stage {s.index}: linear-attention state {s.state_entries} entries (engine.state_entries) "
                         f"+ {s.state_checkpoints} checkpoints (engine.state_checkpoints) x {s.state_bytes // n} B "
                         f"= {s.state_bytes} B ({_gib(s.state_bytes)} GiB, in {'device' if s.pinned else 'host'} "
                         "memory)")
        if s.window_frames:
            line = (f"stage {s.index}: window {s.window_frames} frames = {s.window_cells} cells, + 1 trash frame: "
                    f"{s.window_bytes} B")
            if s.pinned:
                line += (f"; scratch {'?' if s.scratch_bytes is None else s.scratch_bytes} B; device "
                         f"{'?' if s.device_bytes is None else s.device_bytes} B")
            lines.append(line)
    lines += [f"note: {n}" for n in report.notes]
    lines += ["", "# resolved config", to_yaml(report.config).rstrip()]
    return "\n".join(lines) + "\n"


def main_check(argv: list[str] | None = None) -> int:
    """`strata config check FILE [--set k=v ...]`: print the report; 1 with the message when refused."""
    p = argparse.ArgumentParser(prog="strata config check", description=__doc__.splitlines()[0])
    p.add_argument("file", help="box YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set engine.kv_pool_tokens=8192")
    args = p.parse_args(argv)
    try:
        report = check(load_config(args.file, args.overrides))
    except ConfigError as err:
        print(f"{args.file}: {err}", file=sys.stderr)
        return 1
    sys.stdout.write(format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main_check())
