"""Quantize float rows into GGUF blocks, for the GGUF files `strata bench peers --quant` and the tests write.

`quantize(w, qtype)`: `gguf.quants.quantize` for the types it writes (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16, ...),
and Q4_K, which it cannot write, by `quantize_q4_k`: per 32-weight sub-block an asymmetric 4-bit grid (its min
clamped to <= 0), the sub-block's scale and min as 6-bit multiples of the 256-weight superblock's f16 `d` and
`dmin`, laid out as ggml's block_q4_K (d, dmin, 12 bytes of packed 6-bit scales and mins, 128 bytes of nibbles:
per 64 weights, sub-block 2c in the low nibbles and 2c + 1 in the high ones). A plain min/max fit, not llama.cpp's
search for the best scales: the blocks are valid Q4_K, read by gguf and llama.cpp alike, a little less accurate.
numpy only.
"""
from __future__ import annotations

import numpy as np


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Q4_K blocks of float rows `[..., K]` (K a multiple of 256), which gguf.quants cannot write: per 32-weight
    sub-block an asymmetric 4-bit grid (min clamped to <= 0), its scale and min as 6-bit multiples of the
    superblock's f16 d and dmin, laid out as ggml's block_q4_K."""
    rows = w.reshape(-1, 8, 32).astype(np.float32)  # [superblocks, sub-block, weight]
    lo, hi = np.minimum(rows.min(-1), 0), rows.max(-1)
    scale, mins = (hi - lo) / 15, -lo
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (mins.max(-1, keepdims=True) / 63).astype(np.float16)
    safe = lambda a: np.where(a == 0, 1, a)  # noqa: E731
    sc = np.clip(np.rint(scale / safe(d.astype(np.float32))), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(mins / safe(dmin.astype(np.float32))), 0, 63).astype(np.uint8)
    s, b = d.astype(np.float32) * sc, dmin.astype(np.float32) * m
    q = np.clip(np.rint((rows + b[..., None]) / safe(s)[..., None]), 0, 15).astype(np.uint8)
    packed = np.empty((rows.shape[0], 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    packed[:, 4:8] = m[:, :4] | (m[:, 4:] >> 4) << 6
    packed[:, 8:12] = (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4
    qs = (q[:, 0::2] | q[:, 1::2] << 4).reshape(-1, 128)  # per 64 weights: sub-block 2c low, 2c + 1 high
    out = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed, qs], axis=1)
    return out.reshape(*w.shape[:-1], w.shape[-1] // 256 * 144)


# Weights llama.cpp's converter keeps in F32 whatever the file type: the MoE routers and shared-expert gates, and
# the short convolution of a linear-attention layer.
F32_WEIGHTS = ("mlp.gate.weight", "shared_expert_gate.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight",
               "conv1d.weight")


def quantizable(name: str, w: np.ndarray, qtype: str) -> bool:
    """Whether a writer stores tensor `name` in `qtype`: a 2-D weight (3-D: stacked experts), not a norm, router or
    conv (F32_WEIGHTS), whose rows split into whole blocks; llama.cpp's converter keeps the rest in F32."""
    import gguf

    if qtype == "F32" or w.ndim not in (2, 3) or not name.endswith(".weight") or name.endswith("norm.weight"):
        return False
    if name.endswith(F32_WEIGHTS):
        return False
    block, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    return w.shape[-1] % block == 0


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    import gguf

    if qtype == "Q4_K":
        return quantize_q4_k(w)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
