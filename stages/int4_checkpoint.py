"""GPTQ and AWQ checkpoints: their packed integer weights as int4 Planes (stages/quant_linear.py), kept quantized.

What is computed (pool/computable.int4_scheme names it; anything else is refused by name):
- GPTQ (quant_method gptq; checkpoint_format "gptq", the default, or "gptq_v2"), bits 4 or 8, and AWQ
  (quant_method awq, version gemm), bits 4.
- Per quantized linear `P` (the decoder layers' projections; the embedding, norms and lm_head stay float):
  GPTQ: `P.qweight` int32 `[K * bits / 32, N]` (packed along K: value k sits at bits `(k % per) * bits` of row
  `k // per`, per = 32 / bits), `P.qzeros` int32 `[groups, N * bits / 32]` (packed along N the same way),
  `P.scales` float16 `[groups, N]`, `P.g_idx` int32 `[K]` (the group of each k); in the "gptq" format a stored
  zero is the zero minus 1 (AutoGPTQ's convention), in "gptq_v2" the zero itself.
  AWQ: `P.qweight` int32 `[K, N / 8]` packed along N in AWQ's order (nibble i of a word holds column
  AWQ_ORDER[i] of its 8), `P.qzeros` int32 `[groups, N / 8]` the same way, `P.scales` float16 `[groups, N]`.
- The weight: `w[n, k] = (q[k, n] - z[g(k), n]) * s[g(k), n]`, g(k) = k // group_size (GPTQ: g_idx[k]). As planes:
  v = q (4 bits: one plane; 8 bits: lo + 16 hi, two), scale s, offset -z * s, group group_size.
- Kept quantized when the groups are contiguous runs of group_size in 32, 64, 128 or 256 (the int4 kernel's
  group sizes); a GPTQ `desc_act` checkpoint whose g_idx is not k // group_size, or group_size -1 (one group
  per row), is dequantized at load instead (`dequantized(...)`, exact; config check says so).
"""
from __future__ import annotations

import torch

from pool.computable import INT4_KERNEL_GROUPS
from stages.quant_linear import Planes

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their `32 / bits` values each (low bits first), spread along `dim`, as int32."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    vals = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., per]
    if dim == 0:  # rows: word row r holds rows r * per .. r * per + per - 1
        return vals.permute(0, 2, 1).reshape(words.shape[0] * per, words.shape[1])
    return vals.reshape(words.shape[0], words.shape[1] * per)


def unpack(scheme: dict, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int32 [K, N], z int32 [groups, N], s float32 [groups, N], g int64 [K]) of one linear's tensors."""
    bits, method = scheme["bits"], scheme["method"]
    if method == "awq":
        order = torch.tensor([AWQ_ORDER.index(c) for c in range(8)])  # column c of 8 <- its nibble
        q, z = (_unpack(t[p], 4, 1).view(t[p].shape[0], -1, 8)[..., order].reshape(t[p].shape[0], -1)
                for p in ("qweight", "qzeros"))
    else:
        q = _unpack(t["qweight"], bits, 0)
        z = _unpack(t["qzeros"], bits, 1)
        if scheme.get("format", "gptq") == "gptq":
            z = z + 1
    s = t["scales"].float()
    k = q.shape[0]
    group = scheme["group"] if scheme["group"] > 0 else k
    g = t["g_idx"].long() if "g_idx" in t else torch.arange(k) // group
    return q, z, s, g


def planes(scheme: dict, t: dict[str, torch.Tensor]) -> Planes | None:
    """The weight `[N, K]` as Planes, or None when its groups are not contiguous kernel-sized runs (module
    docstring: then `dequantized`)."""
    q, z, s, g = unpack(scheme, t)
    k = q.shape[0]
    group = scheme["group"]
    if group not in INT4_KERNEL_GROUPS or k % group or not torch.equal(g, torch.arange(k) // group):
        return None
    s, offset = s.t().contiguous(), (-(z.float() * s)).t().contiguous()  # [N, groups]
    qt = q.t().to(torch.uint8)
    if scheme["bits"] == 4:
        return Planes([qt.contiguous()], [s], offset, scheme["method"].upper(), group)
    return Planes([(qt & 15).contiguous(), (qt >> 4).contiguous()], [s, 16 * s], offset, scheme["method"].upper(),
                  group)


def dequantized(scheme: dict, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight `[N, K]` as float32, for any g_idx."""
    q, z, s, g = unpack(scheme, t)
    return ((q - z[g]).float() * s[g]).t().contiguous()
