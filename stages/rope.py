"""Rotary position embedding: inverse frequencies for each `rope_type`, cos/sin for arbitrary positions.

The inverse frequencies follow transformers' `ROPE_INIT_FUNCTIONS` formula for formula (default, linear,
dynamic, llama3, yarn), because the checkpoints were trained with them and tests compare against them.
Positions are per token, not per sequence: one step mixes slots at different offsets, so cos/sin are built
from a `[T]` position tensor, never from `arange(seq_len)`.

`dynamic` (NTK) rescales the base by the sequence length once it passes `max_position_embeddings`. Here the
length is the token's own slot context (`start + n`), so a slot's frequencies never depend on the other
slots of the step; transformers instead uses the longest sequence of its forward call, so the two agree only
for one sequence read in one call, or within `max_position_embeddings` (where dynamic equals default).
"""
from __future__ import annotations

import math

import torch

from pool.computable import SUPPORTED_ROPE_TYPES, rotary_factor, rotary_problem  # shared with strata config check


class RopeError(ValueError):
    """A rope configuration this engine cannot reproduce; the message names the key."""


def rope_parameters(config: dict) -> dict:
    """One flat dict with `rope_type`, `rope_theta` and the type's keys, from either config.json layout.

    transformers >= 5 writes `rope_parameters` (theta inside); older checkpoints write `rope_theta` at the top
    level and `rope_scaling` (with `type` or `rope_type`, or null). `partial_rotary_factor` is always set
    (`pool.computable.rotary_factor`); other than 1.0 only where the architecture rotates part of each head. llama3 and yarn fall back to
    `max_position_embeddings` for `original_max_position_embeddings`, as transformers does; a top-level
    `original_max_position_embeddings` takes priority, as transformers does.
    """
    raw = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in raw.values()):
        raise RopeError("rope parameters per layer type (nested rope_parameters) are not supported")
    params = dict(raw)
    legacy_type = params.pop("type", None)
    params.setdefault("rope_type", legacy_type or "default")
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["partial_rotary_factor"] = rotary_factor(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise RopeError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params["partial_rotary_factor"] != 1.0:
        why = rotary_problem(config)
        if why is not None:
            raise RopeError(why)
    if rope_type in ("llama3", "yarn"):
        if config.get("original_max_position_embeddings"):
            params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    if rope_type in ("linear", "dynamic", "llama3") and params.get("factor") is None:
        raise RopeError(f"rope_type {rope_type!r} needs a 'factor'")
    return params


def _exponents(dim: int, device: torch.device | str | None) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim


def rope_init(
    params: dict,
    head_dim: int,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 `[head_dim // 2]`, attention_scaling) for normalised `params` (see `rope_parameters`).

    `seq_len` matters only for `dynamic` (below `max_position_embeddings` it equals default).
    `attention_scaling` multiplies cos and sin; it is 1.0 except for yarn.
    """
    rope_type = params["rope_type"]
    base = params["rope_theta"]
    dim = head_dim
    if rope_type == "default":
        return 1.0 / (base ** _exponents(dim, device)), 1.0
    if rope_type == "linear":
        inv_freq = 1.0 / (base ** _exponents(dim, device))
        return inv_freq / params["factor"], 1.0
    if rope_type == "dynamic":
        factor, max_pos = params["factor"], max_position_embeddings
        seq_len = max_pos if seq_len is None else max(seq_len, max_pos)
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** _exponents(dim, device)), 1.0
    if rope_type == "llama3":
        return _llama3(params, dim, device), 1.0
    return _yarn(params, dim, max_position_embeddings, device)


def _llama3(params: dict, dim: int, device: torch.device | str | None) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    inv_freq = 1.0 / (params["rope_theta"] ** _exponents(dim, device))
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn(
    params: dict, dim: int, max_position_embeddings: int | None, device: torch.device | str | None
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, scale attention by `attention_factor`."""
    base = params["rope_theta"]
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp.to(device=device, dtype=torch.float)
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [T, heads, head_dim]` by per-token `cos`/`sin [T, rotary_dim]` (the rotate-half convention); with
    a partial rotary factor (rotary_dim < head_dim) the dims past rotary_dim pass through unrotated."""
    if cos.shape[-1] < x.shape[-1]:
        rot = cos.shape[-1]
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Rope:
    """A model's rotary embedding: `inv_freq` computed once, `cos_sin(positions)` per step."""

    def __init__(self, config: dict, head_dim: int, device: torch.device | str = "cpu") -> None:
        self.params = rope_parameters(config)
        self.head_dim = int(head_dim * self.params["partial_rotary_factor"])  # the rotated dims of each head
        self.max_position_embeddings = config.get("max_position_embeddings")
        self.inv_freq, self.attention_scaling = rope_init(
            self.params, self.head_dim, self.max_position_embeddings, device=device
        )
        self.dynamic = self.params["rope_type"] == "dynamic"

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, context_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[T, head_dim]` in `dtype` for int positions `[T]` (computed in float32, then cast).

        `context_lens [T]` (each token's slot context, start + n) is used only by `dynamic`.
        """
        inv_freq = self.inv_freq[None, :]
        if self.dynamic and context_lens is not None:
            inv_freq = self._dynamic_inv_freq(context_lens)
        freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def _dynamic_inv_freq(self, context_lens: torch.Tensor) -> torch.Tensor:
        """Per-token `[T, head_dim // 2]` NTK frequencies, the `dynamic` formula at each token's context length."""
        dim, max_pos, factor = self.head_dim, self.max_position_embeddings, self.params["factor"]
        seq = torch.clamp(context_lens.to(torch.float64), min=max_pos)
        base = self.params["rope_theta"] * ((factor * seq / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        exps = _exponents(dim, context_lens.device).to(torch.float64)
        return (1.0 / (base[:, None] ** exps[None, :])).to(torch.float32)
