"""Which layers of a checkpoint attend over the KV pool and which carry a linear-attention state instead, and
what that state costs. No torch: the stage (stages/model.py, stages/state_pool.py) and `strata config check`
(which sizes the pool from it) read the same rules.

Rules (Qwen3-Next, as transformers' `Qwen3NextConfig` reads config.json):
1. `layer_types` names one kind per layer: "full_attention" (K/V in the pool, one cell per token) or
   "linear_attention" (Gated DeltaNet, stages/linear_attention.py: a fixed-size state per conversation and no
   cell in the pool). Without `layer_types`, layer i is full attention when (i + 1) % full_attention_interval
   == 0 (default 4), linear otherwise.
2. A kind outside LAYER_TYPES, a `layer_types` whose length is not `num_hidden_layers`, an interval < 1, or a
   linear geometry the stage cannot lay out (value heads not a multiple of key heads, a size < 1) is refused
   with a message naming it (`linear_problem`).
3. Every other architecture has only full-attention layers (a sliding window is still attention over the pool).
4. Linear geometry (`LinearGeometry`), with transformers' defaults for absent keys:
       nk = linear_num_key_heads, nv = linear_num_value_heads (each key head serves nv / nk value heads),
       dk = linear_key_head_dim, dv = linear_value_head_dim, K = linear_conv_kernel_dim,
       conv_dim = 2 * nk * dk + nv * dv        (the channels q | k | v the short convolution runs over)
5. State of one entry (one conversation) for one linear layer: the last K - 1 inputs of the convolution in the
   model dtype, and the recurrent state nv x dk x dv in float32. For the linear layers of a stage:
       state_entry_bytes = n_linear * ((K - 1) * conv_dim * dtype_bytes + 4 * nv * dk * dv)
   e.g. Qwen3-Next-80B (nk 16, nv 32, dk = dv = 128, K 4, 36 linear layers, bfloat16): 36 * (3 * 8192 * 2 +
   4 * 32 * 128 * 128) = 77,266,944 bytes (~74 MiB) per conversation, whatever its length.
"""
from __future__ import annotations

from dataclasses import dataclass

FULL = "full_attention"
LINEAR = "linear_attention"
LAYER_TYPES = (FULL, LINEAR)
# Architectures with linear-attention layers -> their config's default full_attention_interval.
LINEAR_ARCHS = {"Qwen3NextForCausalLM": 4}
# transformers' Qwen3NextConfig defaults for the linear geometry (rule 4).
LINEAR_DEFAULTS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                   "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
STATE_DTYPE_BYTES = 4  # the recurrent state is float32 whatever the model dtype
# Tensors a stage of these architectures holds in float32 whatever the model dtype (stages/model.py): the
# RMSNorms that scale by (1 + weight), kept as float32 1 + weight, and the linear-attention decay parameters.
FLOAT32_HELD = {"Qwen3NextForCausalLM": ("input_layernorm.weight", "post_attention_layernorm.weight",
                                         "q_norm.weight", "k_norm.weight", "model.norm.weight", "linear_attn.A_log",
                                         "linear_attn.dt_bias")}


class LayerKindError(ValueError):
    """A layer kind or linear geometry the stages cannot compute; the message names the key."""


def _arch(config: dict) -> str | None:
    return (config.get("architectures") or [None])[0]


def layer_types(config: dict) -> tuple[str, ...]:
    """One kind per global layer (rules 1-3); LayerKindError names a kind or key the stages cannot compute."""
    n = int(config["num_hidden_layers"])
    arch = _arch(config)
    if arch not in LINEAR_ARCHS:
        return (FULL,) * n
    types = config.get("layer_types")
    if types is not None:
        if len(types) != n:
            raise LayerKindError(f"layer_types has {len(types)} entries but num_hidden_layers is {n}")
        unknown = [(i, t) for i, t in enumerate(types) if t not in LAYER_TYPES]
        if unknown:
            i, t = unknown[0]
            raise LayerKindError(f"layer_types[{i}] = {t!r} is not a layer the stages compute "
                                 f"(known: {', '.join(LAYER_TYPES)})")
        return tuple(types)
    interval = config.get("full_attention_interval", LINEAR_ARCHS[arch])
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise LayerKindError(f"full_attention_interval={interval!r} must be an int >= 1")
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n))


@dataclass(frozen=True)
class LinearGeometry:
    """Rule 4's sizes of a linear-attention layer."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    kernel: int

    @classmethod
    def from_config(cls, config: dict) -> "LinearGeometry":
        values = {k: config.get(k, d) for k, d in LINEAR_DEFAULTS.items()}
        for key, value in values.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayerKindError(f"{key}={value!r} must be an int >= 1")
        g = cls(values["linear_num_key_heads"], values["linear_num_value_heads"], values["linear_key_head_dim"],
                values["linear_value_head_dim"], values["linear_conv_kernel_dim"])
        if g.value_heads % g.key_heads:
            raise LayerKindError(f"linear_num_value_heads={g.value_heads} is not a multiple of "
                                 f"linear_num_key_heads={g.key_heads}")
        return g

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def layer_state_bytes(self, dtype_bytes: int) -> int:
        """One entry's state for one linear layer (rule 5)."""
        conv = (self.kernel - 1) * self.conv_dim * dtype_bytes
        return conv + STATE_DTYPE_BYTES * self.value_heads * self.key_dim * self.value_dim


def linear_problem(config: dict) -> str | None:
    """Why the stages cannot compute this config's layer kinds or linear geometry (rule 2), or None."""
    if _arch(config) not in LINEAR_ARCHS:
        return None  # every layer is full attention; the geometry is checked where the weights are read
    try:
        if LINEAR in layer_types(config):
            LinearGeometry.from_config(config)
    except LayerKindError as err:
        return str(err)
    return None


def full_attention_layers(config: dict, first: int, last: int) -> int:
    """How many of the global layers [first, last) hold K/V in the pool."""
    return sum(t == FULL for t in layer_types(config)[first:last])


def state_entry_bytes(config: dict, first: int, last: int, dtype_bytes: int) -> int:
    """Bytes of one state entry of the stage holding layers [first, last) (rule 5); 0 without linear layers."""
    n_linear = sum(t == LINEAR for t in layer_types(config)[first:last])
    if not n_linear:
        return 0
    return n_linear * LinearGeometry.from_config(config).layer_state_bytes(dtype_bytes)
