"""Quantize float rows into GGUF blocks, for the GGUF files `strata bench peers --quant` and the tests write.

`quantize(w, qtype)`: `gguf.quants.quantize` for the types it writes (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16, ...),
and Q4_K and Q6_K, which it cannot write, by `quantize_q4_k` and `quantize_q6_k`. Q4_K: per 32-weight sub-block an
asymmetric 4-bit grid (its min clamped to <= 0), the sub-block's scale and min as 6-bit multiples of the 256-weight
superblock's f16 `d` and `dmin`, laid out as ggml's block_q4_K (d, dmin, 12 bytes of packed 6-bit scales and mins,
128 bytes of nibbles: per 64 weights, sub-block 2c in the low nibbles and 2c + 1 in the high ones). Q6_K: per
16-weight sub-block a symmetric 6-bit grid, its scale an int8 multiple of the superblock's f16 `d`. Plain min/max
fits, not llama.cpp's search for the best scales: the blocks are valid, read by gguf and llama.cpp alike, a little
less accurate. numpy only.
"""
from __future__ import annotations

import re

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


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K blocks of float rows `[..., K]` (K a multiple of 256), which gguf.quants cannot write: per 16-weight
    sub-block a symmetric 6-bit grid (q - 32, q in 0..63), its scale an int8 multiple of the superblock's f16 d,
    laid out as ggml's block_q6_K (ql[128]: low 4 bits, qh[64]: high 2 bits, scales[16], d; per 128 weights, weight
    l and 64 + l in byte l of its ql's low and high nibbles (l < 64), weight 32 j + l in bits 2j of its qh byte l)."""
    rows = w.reshape(-1, 16, 16).astype(np.float32)  # [superblocks, sub-block, weight]
    scale = np.abs(rows).max(-1) / 31
    d = (scale.max(-1, keepdims=True) / 127).astype(np.float16)
    safe = lambda a: np.where(a == 0, 1, a)  # noqa: E731
    sc = np.clip(np.rint(scale / safe(d.astype(np.float32))), 0, 127).astype(np.int8)
    s = d.astype(np.float32) * sc
    q = (np.clip(np.rint(rows / safe(s)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    lo, hi = q & 15, q >> 4  # [superblocks, half, j, l]: weight 128 half + 32 j + l
    ql = np.concatenate([lo[:, :, 0] | lo[:, :, 2] << 4, lo[:, :, 1] | lo[:, :, 3] << 4], axis=2)  # [sb, half, 64]
    qh = hi[:, :, 0] | hi[:, :, 1] << 2 | hi[:, :, 2] << 4 | hi[:, :, 3] << 6  # [sb, half, 32]
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8)], axis=1)
    return out.reshape(*w.shape[:-1], w.shape[-1] // 256 * 210)


# llama.cpp's mixed file types: the type most 2-D weights take; `tensor_type` says which take Q6_K instead.
MIXES = {"Q4_K_M": "Q4_K"}
_MORE_BITS = re.compile(r"(?:blk|model\.layers)\.(\d+)\.(?:attn_v|ffn_down|self_attn\.v_proj|mlp\.down_proj)\.weight")


def tensor_type(name: str, qtype: str, n_layers: int, tied: bool) -> str:
    """The GGUF type a file of type `qtype` stores 2-D weight `name` (a GGUF or a Hugging Face name) in: `qtype`, or
    for a mix (MIXES) llama.cpp's choice for Q4_K_M: Q6_K for the output (the embedding when it is tied), and for
    attn_v and ffn_down in the first and last eighth of the layers and every third layer between them; Q4_K for
    the rest."""
    if qtype not in MIXES:
        return qtype
    if name in ("output.weight", "lm_head.weight") or (tied and name in ("token_embd.weight",
                                                                           "model.embed_tokens.weight")):
        return "Q6_K"
    m = _MORE_BITS.fullmatch(name)
    if m:
        i, eighth = int(m.group(1)), n_layers // 8
        if i < eighth or i >= 7 * n_layers // 8 or (i - eighth) % 3 == 2:
            return "Q6_K"
    return MIXES[qtype]


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
    if qtype == "Q6_K":
        return quantize_q6_k(w)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
