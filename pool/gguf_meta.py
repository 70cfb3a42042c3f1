"""A GGUF file read as the stages and the coordinator see a checkpoint: a config dict, tensor names, no weights.

No torch: the `gguf` package (numpy only) memory-maps the file, so opening it reads the header and the
tensor infos, not the weights. Both sides use this module: the stages to load their layers
(stages/gguf_weights.py), the coordinator for `strata config check` and the tokenizer
(coordinator/gguf_tokenizer.py).

Rules:
- Architectures: `general.architecture` in ARCHS (llama, qwen2, qwen3, qwen3moe, qwen3next), mapped to the Hugging Face
  class the stages compute. Anything else is refused, naming it. qwen3moe: expert_count, expert_used_count,
  expert_feed_forward_length; every layer routes and the chosen weights are normalized (norm_topk_prob) unless
  expert_weights_norm is false, as llama.cpp computes it; its stacked `ffn_{gate,up,down}_exps` [experts, rows, cols] are one Hugging Face
  name per expert (`GGUFTensor.expert`: a slice of the stacked tensor).
- qwen3next (HYBRID_ARCHS), as llama.cpp's converter writes it: the MoE keys above plus
  expert_shared_feed_forward_length; the linear-attention geometry from ssm.group_count (key heads),
  ssm.time_step_rank (value heads), ssm.state_size (key head size), ssm.inner_size / value heads (value head
  size), ssm.conv_kernel; which layers are linear from attention.recurrent_layers, else full_attention_interval;
  rope.dimension_count is the rotary part of each head (partial_rotary_factor). Its tensors: attn_qkv (the q | k | v
  rows in head order, each part whole) and attn_gate (z) stand for in_proj_qkvz, whose rows the checkpoint groups
  per key head (`linear_attn.in_proj_qkv` / `in_proj_z`, which the stage fuses; a legacy ssm_in is in_proj_qkvz
  itself); ssm_ba is in_proj_ba as stored; ssm_a is -exp(A_log) and every RMSNorm but the gated ssm_norm is stored
  as 1 + weight (`stored_as_offset`), both undone at load (stages/gguf_weights.py); ssm_conv1d is the conv weight
  with its middle axis squeezed; ffn_gate_inp_shexp is the shared expert's gate.
- The config dict is what config.json would hold, built from `{arch}.*` keys: block_count,
  embedding_length, feed_forward_length, attention.head_count(_kv), attention.key_length (= head_dim; a
  value_length or rope.dimension_count that differs is refused), rope.freq_base, context_length,
  attention.layer_norm_rms_epsilon, rope.scaling.{type,factor,original_context_length} (linear, yarn; yarn's
  beta_fast/beta_slow; its other keys are refused).
  vocab_size is the embedding's row count; tie_word_embeddings is "no output.weight".
- Tensor names: llama.cpp's `token_embd`, `blk.N.attn_q` ... map to the Hugging Face names (`hf_name`), so the
  stages ask for the same names as from a safetensors checkpoint. A tensor without a counterpart is refused
  (`rope_freqs`, llama3's frequencies as a tensor, among them): loading it silently would serve wrong output.
- Stored types: FLOAT_TYPES are read as floats; QUANT_TYPES are quantized: a 2-D weight in one of
  PLANE_COUNTS stays quantized as that many int4 planes (stages/quant_linear.py; `kept_bytes` is its size as
  loaded; Q6_K, groups of 16, only on a CPU stage, as bytes), any other is dequantized at load with
  `gguf.quants.dequantize` to the compute dtype; other types are refused.
- `llama` q/k rows are stored permuted by llama.cpp's converter (pairs interleaved for its rope); the stages
  un-permute them at load (`PERMUTED_ARCHS`). qwen2/qwen3 are stored as in the checkpoint.
- dtype ("auto"): the embedding's float type; a quantized embedding means bfloat16 (QUANTIZED_AUTO_DTYPE).
"""
from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "qwen3moe": "Qwen3MoeForCausalLM", "qwen3next": "Qwen3NextForCausalLM"}
PERMUTED_ARCHS = ("llama",)
MOE_ARCHS = ("qwen3moe", "qwen3next")
HYBRID_ARCHS = ("qwen3next",)
FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# Formats kept quantized -> int4 planes per weight (stages/quant_linear.py's decomposition).
PLANE_COUNTS = {"Q4_0": 1, "Q4_1": 1, "Q4_K": 1, "Q5_0": 2, "Q5_1": 2, "Q5_K": 2, "Q8_0": 2, "Q6_K": 2}
# Weights per scale where not 32: Q6_K's 16-weight sub-blocks, which only a CPU stage's bytes multiply
# (stages/byte_rows.py); another stage dequantizes Q6_K at load (torch's int4 kernels take groups of 32 and more).
PLANE_GROUPS = {"Q6_K": 16}
# Formats whose offset is the scale times a fixed zero point (w = s * (q - zero)): a CPU stage's bytes and nibble
# pairs keep no offsets for them (stages/byte_rows.py rule 8).
ZERO_POINTS = {"Q8_0": 128, "Q6_K": 32, "Q5_0": 16, "Q4_0": 8}
QUANTIZED_AUTO_DTYPE = "bfloat16"
FINGERPRINT_SAMPLE_BYTES = 64

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    **{f"attn_{x}.{kind}": f"self_attn.{x}_proj.{kind}" for x in "qkv" for kind in ("weight", "bias")},
}
# qwen3next's own tensors: the linear-attention mixer, the shared expert, the post-attention norm.
_HYBRID_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_in.weight": "linear_attn.in_proj_qkvz.weight", "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight", "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm.weight": "linear_attn.norm.weight", "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    **{f"ffn_{x}_shexp.weight": f"mlp.shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")},
}
# A MoE layer's experts, stacked [experts, rows, cols] in one tensor each; the HF names are one per expert.
_EXPERT_NAMES = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                 "ffn_down_exps.weight": "down_proj"}
# yarn keys with no counterpart in the Hugging Face yarn parameters the stages compute.
_YARN_UNMAPPED = ("rope.scaling.attn_factor", "rope.scaling.yarn_log_multiplier", "rope.scaling.yarn_ext_factor",
                  "rope.scaling.yarn_attn_factor")
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def kept_bytes(kind: str, shape: tuple[int, ...], dtype_bytes: int, embedding: bool = False,
               cpu: bool = False) -> int | None:
    """Bytes a weight of GGUF type `kind` takes kept quantized (stages/quant_linear.py), None when it is not kept:
    per plane 4 bits per weight and per 32 weights (PLANE_GROUPS) a scale and a zero in the compute dtype (a
    QuantLinear), or float32 scales and one float32 offset for all planes (the embedding's QuantEmbedding); on a CPU
    stage (`cpu`) two planes are held as bytes (`int4_bytes`, the embedding too), and only there a weight of groups
    of 16 (Q6_K). A CPU stage pads a packed weight's rows to a multiple of 64 (not counted: a real model's row
    counts are multiples of 64)."""
    planes = PLANE_COUNTS.get(kind)
    if planes is None or len(shape) != 2:
        return None
    rows, cols = shape
    group = PLANE_GROUPS.get(kind, 32)
    groups = rows * cols // group
    if embedding and not (cpu and (planes == 2 or dtype_bytes == 4)):  # a CPU stage's are bytes or nibble pairs
        return planes * (rows * cols // 2 + 4 * groups) + 4 * groups
    if group < 32 and not cpu:
        return None
    return int4_bytes(planes, rows * cols, group, dtype_bytes, cpu, offsets=kind not in ZERO_POINTS)


def int4_bytes(planes: int, numel: int, group: int, dtype_bytes: int, cpu: bool = False, offsets: bool = True) -> int:
    """A QuantLinear's bytes: per plane 4 bits per weight, and a scale and a zero per `group` weights. On a CPU stage
    (`cpu`) two planes are one byte per weight and a float32 scale and offset per group, and one plane in float32
    half a byte per weight and the same (stages/byte_rows.py's ByteLinear, on a CPU with AVX-512 or AVX2; without
    it the planes, which differ only in float32); without `offsets` (ZERO_POINTS) the scale alone."""
    per_group = 8 if offsets else 4
    if cpu and planes == 2:
        return numel + per_group * (numel // group)
    if cpu and planes == 1 and dtype_bytes == 4:
        return numel // 2 + per_group * (numel // group)
    return planes * (numel // 2 + 2 * dtype_bytes * (numel // group))


class GGUFError(ValueError):
    """A GGUF file the stages cannot serve; the message names the file and the key, tensor or type."""


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def hf_name(name: str, arch: str = "") -> str | None:
    """The Hugging Face name of a llama.cpp tensor name of architecture `arch` (None: no counterpart)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK.fullmatch(name)
    names = {**_LAYER_NAMES, **_HYBRID_NAMES} if arch in HYBRID_ARCHS else _LAYER_NAMES
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    return None


def stored_as_offset(arch: str, name: str) -> bool:
    """Whether tensor `name` (Hugging Face) is stored as 1 + weight: llama.cpp's converter adds 1 to every
    qwen3next RMSNorm weight that the model scales by (1 + weight), all but the linear-attention gated norm."""
    return arch in HYBRID_ARCHS and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's info: `shape` in numpy (row-major, Hugging Face) order, `nbytes` as stored."""

    name: str                # the GGUF name
    type: str                # GGMLQuantizationType name: F32, Q8_0, ...
    shape: tuple[int, ...]
    nbytes: int
    offset: int              # absolute byte offset of the data in its file
    expert: int | None = None  # one expert's slice of a stacked tensor `name` (shape and nbytes: the slice's)
    shard: int = 0           # the file of a split GGUF that holds it (GGUFModel.readers[shard])

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def quantized(self) -> bool:
        return self.type not in FLOAT_TYPES


SHARD_NAME = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")  # llama.cpp's gguf-split naming


class GGUFModel:
    """A GGUF file's config dict (`.config`, as config.json), tensors by Hugging Face name (`.tensors`) and the
    open reader (`.reader`, memory-mapped; `.readers`: one per file of a split GGUF); `.field(key)` reads one
    metadata value.

    A split GGUF (llama.cpp's gguf-split: `NAME-00001-of-0000N.gguf`, `split.count` N) is named by its first
    file; the metadata is read from it, the tensors from every file. Naming another file of the split, or a split
    with a file missing, is refused naming the file."""

    def __init__(self, path: str | Path) -> None:
        try:
            import gguf
        except ImportError:  # pragma: no cover - a dependency
            raise GGUFError(f"{path}: reading GGUF files needs the gguf package (pip install gguf)") from None
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise GGUFError(f"model: {path} is not a file")
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # noqa: BLE001 - the reader raises assorted errors on a damaged file
            raise GGUFError(f"{self.path} is not a readable GGUF file: {e}") from e
        self.readers = [self.reader, *self._other_shards(gguf)]
        self._reader_tensors = {(i, t.name): t for i, r in enumerate(self.readers) for t in r.tensors}
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHS:
            raise GGUFError(f"{self.path}: general.architecture {self.arch!r} is not computed by the stages; "
                            f"supported: {', '.join(ARCHS)}")
        self.tensors: dict[str, GGUFTensor] = {}
        for shard, t in ((i, t) for i, r in enumerate(self.readers) for t in r.tensors):
            kind = t.tensor_type.name
            if kind not in FLOAT_TYPES and kind not in QUANT_TYPES:
                raise GGUFError(f"{self.path}: tensor {t.name!r} is stored as {kind}; the stages read "
                                f"{', '.join([*FLOAT_TYPES, *QUANT_TYPES])}")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            m = _BLOCK.fullmatch(t.name)
            if m and m.group(2) in _EXPERT_NAMES and len(shape) == 3:
                n = shape[0]
                for e in range(n):
                    hf = f"model.layers.{m.group(1)}.mlp.experts.{e}.{_EXPERT_NAMES[m.group(2)]}.weight"
                    self.tensors[hf] = GGUFTensor(t.name, kind, shape[1:], int(t.n_bytes) // n, int(t.data_offset), e,
                                                  shard)
                continue
            name = hf_name(t.name, self.arch)
            if name is None:
                raise GGUFError(f"{self.path}: tensor {t.name!r} has no counterpart the stages compute")
            if name.endswith("linear_attn.conv1d.weight"):  # the converter squeezes [channels, 1, kernel]
                shape = (shape[0], 1, shape[-1])
            elif name.endswith("mlp.shared_expert_gate.weight"):
                shape = (1, shape[-1])
            self.tensors[name] = GGUFTensor(t.name, kind, shape, int(t.n_bytes), int(t.data_offset), shard=shard)
        self.config = self._config()

    def _other_shards(self, gguf: Any) -> list[Any]:
        """Readers of the files after the first of a split GGUF (class docstring); none for a single file."""
        count = int(self.field("split.count", 1) or 1)
        if count <= 1:
            return []
        m = SHARD_NAME.fullmatch(self.path.name)
        if int(self.field("split.no", 0)) != 0 or m is None or int(m.group(3)) != count:
            raise GGUFError(f"{self.path} is file {int(self.field('split.no', 0)) + 1} of a {count}-file split GGUF; "
                            f"name its first file (NAME-00001-of-{count:05d}.gguf)")
        out = []
        for i in range(2, count + 1):
            path = self.path.with_name(f"{m.group(1)}-{i:05d}-of-{count:05d}.gguf")
            if not path.is_file():
                raise GGUFError(f"{self.path}: file {i} of the {count}-file split, {path.name}, is missing")
            try:
                out.append(gguf.GGUFReader(str(path)))
            except Exception as e:  # noqa: BLE001 - the reader raises assorted errors on a damaged file
                raise GGUFError(f"{path} is not a readable GGUF file: {e}") from e
        return out

    def reader_tensor(self, info: GGUFTensor) -> Any:
        """The gguf ReaderTensor that holds `info` (its data memory-mapped)."""
        return self._reader_tensors[info.shard, info.name]

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.get_field(key)
        return default if f is None else f.contents()

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    @property
    def dtype(self) -> str:
        """The "auto" compute dtype (module docstring)."""
        embed = self.tensors.get("model.embed_tokens.weight")
        return FLOAT_TYPES.get(embed.type, QUANTIZED_AUTO_DTYPE) if embed else "float32"

    def quantized_types(self) -> dict[str, int]:
        """Stored quantized type -> number of tensors in it."""
        out: dict[str, int] = {}
        for t in {t.name: t for t in self.tensors.values()}.values():  # a stacked tensor once
            if t.quantized:
                out[t.type] = out.get(t.type, 0) + 1
        return out

    def fingerprint(self) -> str:
        """sha256 over the header (metadata and tensor infos, every byte before the data) and each tensor's
        first 64 bytes (the same sampling as a safetensors checkpoint's fingerprint)."""
        h = hashlib.sha256()
        for r in self.readers:
            h.update(bytes(r.data[: r.data_offset]))
        stored = {(t.shard, t.offset): t for t in self.tensors.values()}  # a stacked tensor once
        for key in sorted(stored):
            t = stored[key]
            data = self.readers[t.shard].data
            h.update(bytes(data[t.offset: t.offset + min(FINGERPRINT_SAMPLE_BYTES, t.nbytes)]))
        return h.hexdigest()

    def _need(self, key: str) -> Any:
        value = self.arch_field(key)
        if value is None:
            raise GGUFError(f"{self.path}: metadata {self.arch}.{key} is missing")
        return value

    def _config(self) -> dict[str, Any]:
        """The config.json the file stands for (module docstring)."""
        def one(key: str, value: Any) -> int:
            if isinstance(value, list):  # per-layer values (e.g. feed_forward_length): only uniform ones
                if len(set(value)) != 1:
                    raise GGUFError(f"{self.path}: {self.arch}.{key} differs per layer ({value}); not computed")
                value = value[0]
            return int(value)

        heads = one("attention.head_count", self._need("attention.head_count"))
        hidden = int(self._need("embedding_length"))
        head_dim = int(self.arch_field("attention.key_length") or hidden // heads)
        rotary = self.arch_field("rope.dimension_count")
        for key in ("attention.value_length", "rope.dimension_count"):
            value = self.arch_field(key)
            if key == "rope.dimension_count" and self.arch in HYBRID_ARCHS:
                continue  # a rotary part of each head (partial_rotary_factor), below
            if value is not None and int(value) != head_dim:
                raise GGUFError(f"{self.path}: {self.arch}.{key}={value} differs from the head size {head_dim}; "
                                "not computed by the stages")
        embed = self.tensors.get("model.embed_tokens.weight")
        if embed is None:
            raise GGUFError(f"{self.path}: tensor token_embd.weight is missing")
        n_ctx = int(self.arch_field("context_length") or 4096)
        config: dict[str, Any] = {
            "architectures": [ARCHS[self.arch]],
            "model_type": self.arch,
            "hidden_size": hidden,
            "intermediate_size": one("feed_forward_length", self._need("feed_forward_length") if self.arch not in
                                     MOE_ARCHS else self.arch_field("feed_forward_length", 0)),
            "num_hidden_layers": int(self._need("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": one("attention.head_count_kv", self.arch_field("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "hidden_act": "silu",
            "vocab_size": embed.shape[0],
            "max_position_embeddings": n_ctx,
            "rms_norm_eps": float(self.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.arch_field("rope.freq_base", 10000.0)),
            "rope_scaling": self._rope_scaling(n_ctx),
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            "torch_dtype": self.dtype,
        }
        if self.arch in MOE_ARCHS:
            # Every layer routes; llama.cpp normalizes the chosen experts' weights for qwen3moe unless
            # expert_weights_norm says otherwise (its checkpoints' norm_topk_prob).
            config.update(num_experts=int(self._need("expert_count")), num_experts_per_tok=int(
                self._need("expert_used_count")), moe_intermediate_size=int(self._need("expert_feed_forward_length")),
                norm_topk_prob=bool(self.arch_field("expert_weights_norm", True)), decoder_sparse_step=1,
                mlp_only_layers=[])
        if self.arch in HYBRID_ARCHS:
            config.update(self._hybrid_config(head_dim, int(rotary or head_dim), config["num_hidden_layers"]))
        for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                          ("eos_token_id", "tokenizer.ggml.eos_token_id")):
            if self.field(name) is not None:
                config[key] = int(self.field(name))
        return config

    def _hybrid_config(self, head_dim: int, rotary: int, n_layers: int) -> dict[str, Any]:
        """qwen3next's keys (module docstring): the linear-attention geometry from `ssm.*`, which layers are
        linear, the rotary part of each head, the shared expert."""
        value_heads = int(self._need("ssm.time_step_rank"))
        inner = int(self._need("ssm.inner_size"))
        if inner % value_heads:
            raise GGUFError(f"{self.path}: {self.arch}.ssm.inner_size={inner} is not a multiple of "
                            f"ssm.time_step_rank={value_heads}")
        if rotary > head_dim or rotary % 2:
            raise GGUFError(f"{self.path}: {self.arch}.rope.dimension_count={rotary} is not an even part of the "
                            f"head size {head_dim}")
        out: dict[str, Any] = {
            "linear_num_key_heads": int(self._need("ssm.group_count")), "linear_num_value_heads": value_heads,
            "linear_key_head_dim": int(self._need("ssm.state_size")), "linear_value_head_dim": inner // value_heads,
            "linear_conv_kernel_dim": int(self._need("ssm.conv_kernel")),
            "partial_rotary_factor": rotary / head_dim,
            # llama.cpp computes qwen3next with the chosen experts' weights normalized, whatever the metadata says
            "norm_topk_prob": True,
            "shared_expert_intermediate_size": int(self._need("expert_shared_feed_forward_length")),
        }
        recurrent = self.arch_field("attention.recurrent_layers")
        if recurrent is not None:
            if len(recurrent) < n_layers:
                raise GGUFError(f"{self.path}: {self.arch}.attention.recurrent_layers has {len(recurrent)} entries "
                                f"for {n_layers} layers")
            out["layer_types"] = ["linear_attention" if r else "full_attention" for r in recurrent[:n_layers]]
        else:
            out["full_attention_interval"] = int(self.arch_field("full_attention_interval", 4))
        return out

    def _rope_scaling(self, n_ctx: int) -> dict[str, Any] | None:
        kind = self.arch_field("rope.scaling.type")
        factor = self.arch_field("rope.scaling.factor")
        if kind in (None, "none") and factor in (None, 0.0, 1.0):
            return None
        if kind == "linear" or (kind is None and factor):
            return {"rope_type": "linear", "factor": float(factor)}
        if kind == "yarn":
            for key in _YARN_UNMAPPED:
                if self.arch_field(key) is not None:
                    raise GGUFError(f"{self.path}: {self.arch}.{key} is not computed by the stages")
            out = {"rope_type": "yarn", "factor": float(factor),
                   "original_max_position_embeddings": int(self.arch_field("rope.scaling.original_context_length",
                                                                           n_ctx))}
            for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
                if self.arch_field(key) is not None:
                    out[name] = float(self.arch_field(key))
            return out
        raise GGUFError(f"{self.path}: {self.arch}.rope.scaling.type={kind!r} is not computed by the stages "
                        "(supported: none, linear, yarn)")
