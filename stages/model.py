"""A stage's slice of a Llama-family decoder: layers [first, last) of a checkpoint, attention through the pool.

One decoder layer, as in transformers' Llama / Mistral / Qwen2 / Qwen3 (and their MoE kin, below):

    h = x + o_proj(attention(rope(norm_q(q_proj(rms(x)))), rope(norm_k(k_proj(rms(x)))), v_proj(rms(x))))
    out = h + down_proj(silu(gate_proj(rms(h))) * up_proj(rms(h)))

Qwen2 adds q/k/v biases, Qwen3 per-head RMSNorms on q and k (`norm_q`, `norm_k`); any bias the checkpoint
holds is applied, so a Llama with `attention_bias` or `mlp_bias` works too. Mistral uses a sliding window on
every layer, Qwen2/Qwen3 on the layers `layer_types` (or `max_window_layers`) name when `use_sliding_window`.

Qwen2-MoE and Qwen3-MoE layers are the Qwen2 / Qwen3 layer with the MLP of a sparse layer replaced by the
routed experts of stages/moe.py (`mlp_only_layers` and `decoder_sparse_step` keep some layers dense); their
sliding windows follow transformers' rules for each (Qwen3-MoE: every layer when `use_sliding_window`).

Qwen3-Next mixes two layer kinds (pool/layer_kinds.py): a linear-attention layer replaces attention by the Gated
DeltaNet of stages/linear_attention.py, whose state lives in a StatePool (stages/state_pool.py), not in the KV
pool; a full-attention layer is the Qwen3 layer with an output gate, `attention(...) * sigmoid(gate)` before
o_proj (q_proj's rows interleave q and gate per head), a rotary embedding over the first `head_dim *
partial_rotary_factor` dims of each head, and every RMSNorm but the gated one scaling by (1 + weight) (kept as
float32 `1 + weight` at load, applied before the cast back, as transformers does). Its MLPs are Qwen2-MoE's.

The first stage also holds the embedding, the last one the final norm and lm_head (the embedding when tied).
Local layer l of the stage is global layer `first + l`. The KV cache holds the full-attention layers only, in
order (`kv_layers[l]`: layer l's index there, None for a linear layer); the state pool the linear ones
(`linear_layers[l]`).

Fused at load time, so a step makes fewer, larger calls (each call has a fixed cost that a small batch of
decodes does not hide):

    qkv.weight       [q | k | v] rows of q_proj, k_proj, v_proj        one linear for all three
                     (+ [| gate] with an output gate: q_proj's gate rows, after v)
    gate_up.weight   [gate | up] rows of gate_proj, up_proj            one linear for both
    experts.*        a sparse layer's experts stacked along a first expert axis (stages/moe.py); unlike the
                     rows above, the per-expert names do not stay in the layer's dict

q and k are normed and rotated together as one `[T, heads + kv_heads, head_dim]` tensor. Each output element
is the same dot product (or the same elementwise formula) as with separate calls; the original names stay in
a layer's dict as row views of the fused tensors (no second copy). Missing biases are zeros in a fused bias.
A GGUF file's quantized weights stay quantized (stages/quant_linear.py): the layer's dict then holds a
QuantLinear (or a RowStack, when a fused projection's parts are stored in different formats) where a float
weight would be, fused before packing and without row views of the parts; `linear(x, w, bias)` multiplies
either kind, and the embedding is a QuantEmbedding. `keep_quantized=False` dequantizes them at load instead.
On a CPU stage the float weights a step multiplies are then packed for oneDNN (stages/packed_linear.py; the
parts' row views are dropped with the plain copy; a tied table on a stage with both ends is packed once and the
embedding reads its rows from the packed memory; `pack_weights=False` keeps the plain tensors and views).
Rotary cos/sin are kept per position in a table grown on demand (except `dynamic` rope, whose frequencies
depend on the context length).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pool.computable import auto_dtype
from stages import cpu_ops, decode_layer
from stages.attention import paged_attention, write_kv
from stages.byte_rows import ByteLinear
from stages.batch import StepBatch
from stages.checkpoint import Checkpoint, CheckpointError
from stages.kv_cache import KVCache
from stages.linear_attention import LinearSpec, fuse_linear, linear_attention, linear_tensor_names
from stages.moe import MoESpec, moe_mlp, sparse_tensor_names, stack_experts
from stages.packed_linear import PackedLinear, pack_layer, pack_tied, pack_weight
from stages.quant_linear import (Planes, QuantEmbedding, RowStack, embed, fuse_rows, kernel_dtype_ok, linear, pack,
                                 take_rows, weight_bytes)
from stages.rope import Rope, apply_rope
from stages.state_pool import StatePool
from stages.window import StepView

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
QK_NORM_ARCHS = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM")
GATED_ARCHS = ("Qwen3NextForCausalLM",)  # attention output gate; (1 + weight) RMSNorms
_OFFSET_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight")
ROPE_TABLE_MIN = 1024  # positions in the first rotary table
ROPE_TABLE_MAX = 65536  # past this, cos/sin are computed per step (a table would be [positions, head_dim] x 2)


@dataclass(frozen=True)
class ModelSpec:
    """The shape of the model, read from config.json once; `sliding_windows` has one entry per global layer."""

    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    sliding_windows: tuple[int | None, ...]
    moe: MoESpec | None = None  # None: every layer's MLP is dense
    linear: LinearSpec | None = None  # None: every layer is attention over the pool
    gated: bool = False  # attention output gate and (1 + weight) RMSNorms (GATED_ARCHS)

    @classmethod
    def from_config(cls, config: dict, arch: str) -> "ModelSpec":
        """The spec of a config that `stages.checkpoint.check_computable` accepted (it refuses the rest)."""
        heads = int(config["num_attention_heads"])
        n_layers = int(config["num_hidden_layers"])
        moe = MoESpec.from_config(config, arch)
        dense = moe is None or not all(moe.sparse)
        return cls(
            arch=arch,
            num_layers=n_layers,
            hidden_size=int(config["hidden_size"]),
            num_heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            intermediate_size=int(config["intermediate_size"] if dense else config.get("intermediate_size") or 0),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            sliding_windows=_sliding_windows(config, arch, n_layers),
            moe=moe,
            linear=LinearSpec.from_config(config),
            gated=arch in GATED_ARCHS,
        )

    def is_sparse(self, layer: int) -> bool:
        """Global layer `layer` routes through experts (stages/moe.py) instead of a dense MLP."""
        return self.moe is not None and self.moe.sparse[layer]

    def is_linear(self, layer: int) -> bool:
        """Global layer `layer` is linear attention (stages/linear_attention.py): no K/V in the pool."""
        return self.linear is not None and self.linear.linear[layer]


def _sliding_windows(config: dict, arch: str, n_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding window (None = full attention), following each architecture's transformers rule."""
    window = config.get("sliding_window")
    if arch == "MistralForCausalLM":
        return (window,) * n_layers
    if not (window and config.get("use_sliding_window")):
        return (None,) * n_layers
    if arch == "Qwen3MoeForCausalLM":
        return (window,) * n_layers
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM"):
        types = config.get("layer_types")
        if types:
            return tuple(window if t == "sliding_attention" else None for t in types)
        first_sliding = config.get("max_window_layers", n_layers)
        if arch == "Qwen2MoeForCausalLM":  # transformers' Qwen2MoeConfig: even layers below max_window_layers
            return tuple(window if i % 2 == 0 and i < first_sliding else None for i in range(n_layers))
        return tuple(window if i >= first_sliding else None for i in range(n_layers))
    return (None,) * n_layers


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it: normalise in float32, cast back, then scale by the weight.

    In float32 throughout, torch's fused `rms_norm` computes the same values in one call instead of six
    (pinned by a test); other dtypes keep transformers' order of casts.
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:  # a float32 (1 + weight) of a gated arch: scaled before the cast back
        return (xf * weight).to(x.dtype)
    return weight * xf.to(x.dtype)


def qk_norm(qk: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, heads: int, eps: float) -> torch.Tensor:
    """`rms_norm` of every head of `qk` [T, heads + kv_heads, head_dim], scaled by q_norm on the first `heads`
    heads and by k_norm on the rest: one normalisation over all heads, then two scalings in place (the same
    values and casts as rms_norm per part, without a per-head copy of the weights)."""
    if qk.dtype == torch.float32 and q_norm.dtype == torch.float32:
        out = F.rms_norm(qk, (qk.shape[-1],), None, eps)
    else:
        out = qk.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
        if q_norm.dtype != torch.float32:  # scaled after the cast back, as rms_norm does in the model dtype
            out = out.to(qk.dtype)
    out[:, :heads] *= q_norm
    out[:, heads:] *= k_norm
    return out.to(qk.dtype)


def resolve_dtype(dtype: torch.dtype | str | None, ckpt: Checkpoint, device_kinds: list[str] | None = None
                  ) -> torch.dtype:
    """None or "auto" -> the checkpoint's dtype, or with the box's stage devices (`device_kinds`, "cpu" / "cuda")
    pool/computable.auto_dtype's choice; a name in float32/bfloat16/float16 -> that dtype."""
    if dtype is None or dtype == "auto":
        if device_kinds is None:
            return ckpt.dtype
        return _DTYPES[auto_dtype(str(ckpt.dtype).removeprefix("torch."), device_kinds)]
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; supported: auto, {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    return dtype


class StageModel:
    """Layers [first, last) of `ckpt` on `device` in `dtype`; `forward(batch, kv, x)` runs one step."""

    def __init__(
        self,
        ckpt: Checkpoint,
        first: int,
        last: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str | None = None,
        keep_quantized: bool = True,
        pack_weights: bool = True,
        int8_activations: bool = False,
    ) -> None:
        n = ckpt.num_layers
        if not 0 <= first < last <= n:
            raise ValueError(f"layer range [{first}, {last}) is not inside the model's {n} layers")
        self.spec = ModelSpec.from_config(ckpt.config, ckpt.arch)
        self.first, self.last = first, last
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, ckpt)
        self.scale = self.spec.head_dim**-0.5
        self.rope = Rope(ckpt.config, self.spec.head_dim, self.device)
        self.sliding_windows = self.spec.sliding_windows[first:last]
        linear = [self.spec.is_linear(g) for g in range(first, last)]
        self.kv_layers = [None if x else linear[:i].count(False) for i, x in enumerate(linear)]
        self.linear_layers = [linear[:i].count(True) if x else None for i, x in enumerate(linear)]

        names = self._tensor_names(ckpt)
        # A GGUF file's quantized weights stay quantized (stages/quant_linear.py), loaded a layer at a time so the
        # unpacked planes of one layer at most are held beside the packed ones.
        self.quantized = (keep_quantized and getattr(ckpt, "quantized", False)
                          and kernel_dtype_ok(self.dtype, self.device))
        label = f"layers {first}-{last - 1}"
        if self.quantized:
            self.layers = []
            for g in range(first, last):
                part = [n for n in names if n.startswith(f"model.layers.{g}.")]
                w = ckpt.tensors(part, self.device, self.dtype, label=f"layer {g}", keep_quantized=True)
                self.layers.append(self._pack(self._layer_weights(w, g)))
            rest = [n for n in names if not n.startswith("model.layers.")]
            w = ckpt.tensors(rest, self.device, self.dtype, label=label, keep_quantized=True)
        else:
            w = ckpt.tensors(names, self.device, self.dtype, label=label)
            self.layers = [self._layer_weights(w, g) for g in range(first, last)]
        self._rope_cos: torch.Tensor | None = None  # [positions, head_dim] in the model dtype
        self._rope_sin: torch.Tensor | None = None
        self.cpu_ops = self.device.type == "cpu" and self.dtype == torch.float32  # stages/cpu_ops.py, its rule 1
        self._decode_layers: list[decode_layer.Layer | None] | None = None  # stages/decode_layer.py, made at first use
        self._decode_head: decode_layer.Head | None | bool = False  # its rule 6, made at first use (False: not yet)
        self.embed = w.get("model.embed_tokens.weight") if self.is_first else None
        self.norm = w.get("model.norm.weight")
        if self.spec.gated and self.norm is not None:
            self.norm = 1.0 + self.norm.float()
        self.lm_head = None
        if self.is_last:
            self.lm_head = w["model.embed_tokens.weight" if ckpt.tie_word_embeddings else "lm_head.weight"]
        if isinstance(self.embed, Planes):
            self.embed = QuantEmbedding(self.embed, self.dtype, self.device)
        if isinstance(self.lm_head, Planes):
            self.lm_head = pack(self.lm_head, self.dtype, self.device)
        if pack_weights and self.device.type == "cpu":  # stages/packed_linear.py
            self.layers = [pack_layer(layer) for layer in self.layers]
            if self.lm_head is not self.embed:
                self.lm_head = pack_weight(self.lm_head)
            elif self.lm_head is not None:  # a tied table: one copy, read by both (packed_linear rule 9)
                self.lm_head, self.embed = pack_tied(self.lm_head)
        for w in self._byte_linears():  # decode rows as 8-bit rows (engine.int8_activations, byte_rows rule 7)
            w.int8_activations = int8_activations

    def _pack(self, layer: dict) -> dict:
        """A layer's dict with its Planes packed (QuantLinear, lists of them for experts)."""
        def one(v):
            if isinstance(v, (Planes, RowStack)):
                return pack(v, self.dtype, self.device)
            if isinstance(v, list):
                return [one(x) for x in v]
            return v
        return {k: one(v) for k, v in layer.items()}

    def _byte_linears(self) -> list[ByteLinear]:
        """The stage's weights held as byte rows (stages/byte_rows.py), in experts' lists and RowStacks too."""
        def flat(w: object) -> list:
            if isinstance(w, (list, RowStack)):
                return [x for v in (w.parts if isinstance(w, RowStack) else w) for x in flat(v)]
            return [w] if isinstance(w, ByteLinear) else []
        return flat([v for layer in self.layers for v in layer.values()] + [self.lm_head])

    def packed_weights(self) -> list[PackedLinear]:
        """The stage's packed weights in the order a step multiplies them (stages/packed_linear.py rule 6)."""
        found = [w for layer in self.layers for w in layer.values() if isinstance(w, PackedLinear)]
        return found + ([self.lm_head] if isinstance(self.lm_head, PackedLinear) else [])

    def weight_bytes(self) -> int:
        """Bytes the stage's weights take as loaded (quantized ones packed; a storage shared by views, as the
        parts of a fused tensor, once)."""
        seen: dict[int, int] = {}
        other = 0

        def add(w: object) -> None:
            nonlocal other
            if isinstance(w, torch.Tensor):
                seen[w.untyped_storage().data_ptr()] = w.untyped_storage().nbytes()
            elif isinstance(w, (list, tuple)):
                for x in w:
                    add(x)
            elif w is not None:
                other += weight_bytes(w)

        for w in [self.embed, self.norm, self.lm_head, *(t for layer in self.layers for t in layer.values())]:
            add(w)
        return sum(seen.values()) + other

    def _layer_weights(self, w: dict[str, torch.Tensor], g: int) -> dict[str, torch.Tensor]:
        """Global layer g's tensors out of the stage's load, by names relative to the layer, fused."""
        p = f"model.layers.{g}."
        layer = {key[len(p):]: w.pop(key) for key in [k for k in w if k.startswith(p)]}
        if self.spec.is_sparse(g):
            stack_experts(layer, self.spec.moe)
        if self.spec.gated:
            for name in _OFFSET_NORMS:
                if name in layer:
                    layer[name] = 1.0 + layer[name].float()
        if self.spec.is_linear(g):
            fuse_linear(layer, self.spec.linear.geometry)  # type: ignore[union-attr]
        return _fuse(layer, self.spec)

    def _tensor_names(self, ckpt: Checkpoint) -> list[str]:
        """Every tensor this stage needs; optional biases only when the checkpoint has them."""
        names: list[str] = []
        for g in range(self.first, self.last):
            p = f"model.layers.{g}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            projections = [] if self.spec.is_linear(g) else [f"self_attn.{m}" for m in _ATTN]
            if self.spec.is_linear(g):
                names += linear_tensor_names(p, ckpt.has_tensor(p + "linear_attn.in_proj_qkv.weight"))
            if self.spec.is_sparse(g):
                names += sparse_tensor_names(p, self.spec.moe)
            else:
                projections += [f"mlp.{m}" for m in _MLP]
            for m in projections:
                names.append(p + m + ".weight")
                if ckpt.has_tensor(p + m + ".bias"):
                    names.append(p + m + ".bias")
            if self.spec.arch in QK_NORM_ARCHS and not self.spec.is_linear(g):
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if self.is_first:
            names.append("model.embed_tokens.weight")
        if self.is_last:
            names.append("model.norm.weight")
            names.append("model.embed_tokens.weight" if ckpt.tie_word_embeddings else "lm_head.weight")
        return names

    @property
    def is_first(self) -> bool:
        return self.first == 0

    @property
    def is_last(self) -> bool:
        return self.last == self.spec.num_layers

    @property
    def num_local_layers(self) -> int:
        return self.last - self.first

    @property
    def num_kv_layers(self) -> int:
        """Local layers with K/V in the pool (the full-attention ones)."""
        return sum(i is not None for i in self.kv_layers)

    @property
    def num_linear_layers(self) -> int:
        return sum(i is not None for i in self.linear_layers)

    def new_state_pool(self, n_entries: int, path: Path | None = None) -> StatePool | None:
        """A StatePool of `n_entries` for this stage's linear layers (in the state file `path` on a CPU stage,
        stages/state_pool.py rule 5); None when it holds none."""
        if not self.num_linear_layers:
            return None
        return StatePool(n_entries, self.num_linear_layers, self.spec.linear.geometry, self.dtype,  # type: ignore[union-attr]
                         self.device, path)

    @property
    def kv_heads(self) -> int:
        return self.spec.kv_heads

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim

    @property
    def hidden_size(self) -> int:
        return self.spec.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def __call__(self, batch: StepBatch, kv: KVCache | StepView, x: torch.Tensor, logits_all: bool = False,
                 state: StatePool | None = None) -> torch.Tensor:
        return self.forward(batch, kv, x, logits_all, state)

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv: KVCache | StepView, x: torch.Tensor, logits_all: bool = False,
                state: StatePool | None = None) -> torch.Tensor:
        """Run one step. `x`: int token ids `[T]` on the first stage, hidden `[T, hidden]` otherwise; `state`: the
        stage's StatePool (`new_state_pool`), needed when it holds linear-attention layers.

        Returns hidden `[T, hidden]` (model dtype) on a non-last stage; on the last stage float32 logits for
        `batch.sample_rows` (`[S, vocab]`), or for every row with `logits_all=True`.
        """
        if kv.n_layers != self.num_kv_layers or kv.kv_heads != self.kv_heads or kv.head_dim != self.head_dim:
            raise ValueError(
                f"KV cache has {kv.n_layers} layers x {kv.kv_heads} kv heads x {kv.head_dim}, the stage needs "
                f"{self.num_kv_layers} x {self.kv_heads} x {self.head_dim}"
            )
        if self.num_linear_layers and (state is None or state.n_layers != self.num_linear_layers):
            raise ValueError(f"the stage holds {self.num_linear_layers} linear-attention layers and needs a state "
                             f"pool of as many, got {'none' if state is None else state.n_layers}")
        if x.shape[0] != batch.num_tokens:
            raise ValueError(f"step has {batch.num_tokens} tokens but the input has {x.shape[0]} rows")
        if self.is_first:
            h = embed(x.to(self.device, torch.long), self.embed)
        else:
            h = x.to(self.device, self.dtype)
        cos, sin = self._cos_sin(batch)
        if state is not None and self.num_linear_layers:
            state.begin(batch)
        fused = self._decode_step(batch, kv, cos, sin)
        every = fused and all(self._decode_layers) and fused.rows <= min(one.max_rows for one in self._decode_layers)
        if every:  # stages/decode_layer.py rule 5: the stage's layers in one call
            h = fused.run_all(self._decode_layers, self.kv_layers, list(self.sliding_windows), h)
        else:
            for local, layer in enumerate(self.layers):
                one = fused and self._decode_layers[local]
                if one and fused.rows <= one.max_rows:
                    h = fused.run(one, self.kv_layers[local], self.sliding_windows[local], h)
                else:
                    h = self._layer(local, layer, h, cos, sin, batch, kv, state)
        if state is not None and self.num_linear_layers:
            state.commit(batch)
        if not self.is_last:
            return h
        if not logits_all and not batch.sample_slots:  # only pieces that sample nothing: no head to run
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        head = fused and self.decode_head()
        if head and fused.rows <= head.max_rows and (logits_all or len(batch.sample_slots) == batch.num_tokens):
            return fused.logits(head, h)  # stages/decode_layer.py rule 6
        rows = h if logits_all or len(batch.sample_slots) == batch.num_tokens else h[batch.sample_rows]
        return linear(self._add_norm(rows, None, self.norm)[1], self.lm_head).float()

    def decode_layers(self) -> list[decode_layer.Layer | None]:
        """stages/decode_layer.py's Layer for each local layer (None: the layer keeps the Python path), found once."""
        if self._decode_layers is None:
            s = self.spec
            self._decode_layers = [None if s.gated or self.linear_layers[i] is not None else
                                   decode_layer.Layer.of(w, s.hidden_size, s.head_dim)
                                   for i, w in enumerate(self.layers)]
        return self._decode_layers

    def decode_head(self) -> decode_layer.Head | None:
        """stages/decode_layer.py's Head of the last stage (None: the Python path), found once."""
        if self._decode_head is False:
            self._decode_head = decode_layer.Head.of(self.norm, self.lm_head, self.spec.hidden_size)
        return self._decode_head

    def _decode_step(self, batch: StepBatch, kv: KVCache | StepView, cos: torch.Tensor,
                     sin: torch.Tensor) -> decode_layer.Step | None:
        """The step's arguments to stages/decode_layer.py's one call per dense layer, or None where its rule 1
        keeps the Python path for the whole step."""
        s = self.spec
        if not (self.cpu_ops and any(self.decode_layers())):  # none for a gated arch
            return None
        return decode_layer.Step.of(batch, kv, cos, sin, s.hidden_size, s.num_heads, s.rms_norm_eps, self.scale)

    def _cos_sin(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[T, head_dim]` of the step's positions: rows of the table (built as `Rope.cos_sin` builds
        them, so the values are the same), grown to the next power of two past the longest context seen."""
        if self.rope.dynamic or batch.max_context > ROPE_TABLE_MAX:
            return self.rope.cos_sin(batch.positions, self.dtype, batch.token_context)
        if self._rope_cos is None or self._rope_cos.shape[0] < batch.max_context:
            n = min(ROPE_TABLE_MAX, max(ROPE_TABLE_MIN, 1 << (batch.max_context - 1).bit_length()))
            self._rope_cos, self._rope_sin = self.rope.cos_sin(torch.arange(n, device=self.device), self.dtype)
        return self._rope_cos[batch.positions], self._rope_sin[batch.positions]

    def _layer(
        self,
        local: int,
        w: dict[str, torch.Tensor],
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: StepBatch,
        kv: KVCache | StepView,
        state: StatePool | None,
    ) -> torch.Tensor:
        s, n = self.spec, x.shape[0]
        eps, heads, kv_heads, head_dim = s.rms_norm_eps, s.num_heads, s.kv_heads, s.head_dim
        h = self._add_norm(x, None, w["input_layernorm.weight"])[1]
        entry = self.linear_layers[local]
        if entry is not None:
            mixed = linear_attention(h, w, s.linear, batch, state, entry)  # type: ignore[arg-type]
        else:
            qkv = linear(h, w["qkv.weight"], w.get("qkv.bias"))
            qk = qkv[:, :(heads + kv_heads) * head_dim].view(n, heads + kv_heads, head_dim)
            v = qkv[:, (heads + kv_heads) * head_dim:(heads + 2 * kv_heads) * head_dim].view(n, kv_heads, head_dim)
            q_norm, k_norm = w.get("self_attn.q_norm.weight"), w.get("self_attn.k_norm.weight")
            if not (self.cpu_ops and cpu_ops.qk_norm_rope_(qkv, heads, kv_heads, head_dim, q_norm, k_norm, eps, cos,
                                                           sin)):
                if q_norm is not None:
                    qk = qk_norm(qk, q_norm, k_norm, heads, eps)
                qk = apply_rope(qk, cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            attn = _attend(kv, self.kv_layers[local], batch, q, k, v, self.scale,  # type: ignore[arg-type]
                           self.sliding_windows[local])
            if s.gated:
                attn = attn * torch.sigmoid(qkv[:, (heads + 2 * kv_heads) * head_dim:])
            mixed = _linear(attn, w, "self_attn.o_proj")
        x, h = self._add_norm(x, mixed, w["post_attention_layernorm.weight"])
        if "experts.gate_up" in w:
            return x + moe_mlp(h, w, s.moe)
        gate_up = linear(h, w["gate_up.weight"], w.get("gate_up.bias"))
        mlp = cpu_ops.silu_mul(gate_up) if self.cpu_ops else None
        if mlp is None:
            inter = gate_up.shape[-1] // 2
            mlp = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        return x + _linear(mlp, w, "mlp.down_proj")

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, rms_norm(s)) for s = x + residual (s = x when residual is None): one call of stages/cpu_ops.py
        where its rule 1 holds, the torch code otherwise."""
        eps = self.spec.rms_norm_eps
        done = cpu_ops.rms_norm(x, weight, eps, residual) if self.cpu_ops else None
        if done is not None:
            return done
        if residual is not None:
            x = x + residual
        return x, rms_norm(x, weight, eps)


def _attend(kv: KVCache | StepView, layer: int, batch: StepBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            scale: float, window: int | None) -> torch.Tensor:
    """Write the step's new K/V and attend: straight through the pool (`KVCache`), or through the device
    window's view of it (stages/window.py), which does the same over frames."""
    if isinstance(kv, KVCache):
        write_kv(kv, layer, batch, k, v)
        return paged_attention(q, kv, layer, batch, scale, window)
    return kv.attend(layer, batch, q, k, v, scale, window)


def _linear(x: torch.Tensor, w: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return linear(x, w[name + ".weight"], w.get(name + ".bias"))



def _split_gate(w: dict[str, torch.Tensor], spec: ModelSpec) -> None:
    """q_proj of a gated arch holds [q_h | gate_h] rows per head: keep the q rows, move the gate rows apart."""
    rows = torch.arange(spec.num_heads * 2 * spec.head_dim).view(spec.num_heads, 2, spec.head_dim)
    for kind in ("weight", "bias"):
        name = f"self_attn.q_proj.{kind}"
        if name in w:
            q = w[name]
            w[name] = take_rows(q, rows[:, 0].reshape(-1))
            w[f"self_attn.q_gate.{kind}"] = take_rows(q, rows[:, 1].reshape(-1))


def _fuse(w: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Add the fused tensors (module docstring) to one layer's dict; the parts become row views of them."""
    attn = [f"self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj")]
    if spec.gated:
        _split_gate(w, spec)
        attn.append("self_attn.q_gate")
    for fused, parts in (("qkv", attn), ("gate_up", ["mlp.gate_proj", "mlp.up_proj"])):
        if parts[0] + ".weight" not in w:
            continue  # a sparse layer has no dense MLP
        weights = [w[p + ".weight"] for p in parts]
        bias_like = next((w[p + ".bias"] for p in parts if p + ".bias" in w), None)
        if bias_like is not None:
            w[fused + ".bias"] = torch.cat([w.get(p + ".bias", bias_like.new_zeros(t.shape[0]))
                                            for p, t in zip(parts, weights)])
        if any(isinstance(t, Planes) for t in weights):  # kept quantized: fused before packing, no row views
            w[fused + ".weight"] = fuse_rows(weights)
            for p in parts:
                w.pop(p + ".weight")
                w.pop(p + ".bias", None)
            continue
        w[fused + ".weight"] = torch.cat(weights)
        at = 0
        for p, t in zip(parts, weights):
            rows = t.shape[0]
            w[p + ".weight"] = w[fused + ".weight"][at:at + rows]
            if fused + ".bias" in w:
                w[p + ".bias"] = w[fused + ".bias"][at:at + rows]
            at += rows
    return w
