"""Gated DeltaNet, the linear-attention layer of Qwen3-Next: a short causal convolution, then the gated delta
rule over a fixed-size state per conversation (stages/state_pool.py) instead of attention over the KV pool.

The math, as transformers' Qwen3NextGatedDeltaNet computes it (h: the layer's normed input; nk key heads of dk,
nv value heads of dv, r = nv / nk value heads per key head, K the conv kernel; pool/layer_kinds.py rule 4):

    q | k | v | z | b | a = in_proj(h)                              (rows fused at load, below)
    q | k | v = silu(causal_conv(q | k | v))                         depthwise over conv_dim channels, kernel K
    q, k = l2norm(q), l2norm(k) per key head (float32, eps 1e-6);  q = q / sqrt(dk)
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)      per value head; g <= 0 is a log decay
    per token t and value head h (reading key head h // r), S [dk, dv] float32:
        S = exp(g_t) S
        S = S + k_t (beta_t (v_t - S^T k_t))^T                        the delta rule: correct what S recalls for k_t
        o_t = S^T q_t
    out = out_proj(rmsnorm(o) * norm.weight * silu(z))               gated RMSNorm per value head (plain weight)

Rules:
1. State per conversation and layer: conv = the last K - 1 inputs of the convolution [K - 1, conv_dim] (model
   dtype), recurrent S [nv, dk, dv] (float32). An entry whose step starts at position 0 reads zeros; every step
   writes both back (stages/state_pool.py rules). Prefill in pieces therefore equals prefill in one piece, and
   decode steps continue it.
2. Convolution of a step: every entry's K - 1 state rows and its new rows form one sequence

       [ state_0 | x_0 | state_1 | x_1 | ... ]        T + B (K - 1) rows, B = the step's entries

   and one depthwise conv1d without padding runs over it. The window of a token reaches back K - 1 rows, never
   past its own entry's state rows, so entries never mix. An entry's new conv state is the last K - 1 rows of
   its segment (its state rows too when it read fewer than K - 1 tokens).
3. Delta rule of a step: the decode entries (n == 1) take one recurrent step together (`recurrent_step`); the
   prefill entries (n > 1) together take the chunked form (`chunked_delta_rule`), each zero-padded at its end to
   the longest one's chunks. Zero padding is exact: k = v = beta = 0 and g = 0 leave S as it was.
4. Chunked form (the WY / UT representation, as transformers' torch_chunk_gated_delta_rule): inside a chunk the
   updates of its tokens are solved together with one unit-lower-triangular solve; chunks follow one another in
   a loop over chunks, never over tokens. Float32 throughout; the output is cast to the model dtype.
5. Kernels: this module is the torch reference. On CUDA, flash-linear-attention's `chunk_gated_delta_rule` /
   `fused_recurrent_gated_delta_rule` and causal-conv1d's kernels compute the same things; they may replace
   `chunked_delta_rule`, `recurrent_step` and `causal_conv` behind the same signatures (q, k [B, H, T, dk],
   v [B, H, T, dv], g, beta [B, H, T], state [B, H, dk, dv]), tested against them as the csrc kernels are.

Weights, fused at load from the Hugging Face names (`linear_attn.*`), names relative to the layer:

    linear.in_proj   [2 nk dk + 2 nv dv + 2 nv, hidden]   rows q | k | v | z | b | a, each in head order
                     (in_proj_qkvz groups its rows per key head, [q_g | k_g | v_g | z_g] for g < nk, and
                     in_proj_ba [b_g | a_g]; v_g and z_g hold the r value heads of key head g in order;
                     a GGUF file's in_proj_qkv [q | k | v] and in_proj_z [z] are in head order already)
    linear.conv      [conv_dim, K]     conv1d.weight [conv_dim, 1, K]; channels q | k | v as in_proj's rows
    linear.neg_a     [nv] float32      -exp(A_log)
    linear.dt_bias   [nv] float32
    linear_attn.norm.weight [dv] and linear_attn.out_proj.weight [hidden, nv dv] keep their names
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pool.layer_kinds import LINEAR, LinearGeometry, layer_types
from stages.batch import StepBatch
from stages.quant_linear import fuse_rows, linear, take_rows
from stages.state_pool import StatePool

CHUNK = 64  # tokens per chunk of the chunked form (transformers' and flash-linear-attention's default)
L2_EPS = 1e-6
_TENSORS = ("in_proj_ba.weight", "conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight")
_QKVZ = ("in_proj_qkvz.weight",)  # the checkpoint's per-key-head rows
_QKV_Z = ("in_proj_qkv.weight", "in_proj_z.weight")  # a GGUF file's head-order rows


@dataclass(frozen=True)
class LinearSpec:
    """The linear-attention layers of a model: which global layers (`linear`), their geometry, the norm's eps."""

    geometry: LinearGeometry
    linear: tuple[bool, ...]
    eps: float

    @classmethod
    def from_config(cls, config: dict) -> "LinearSpec | None":
        """None for a model without linear-attention layers (pool/layer_kinds.py, which also refuses bad kinds)."""
        kinds = layer_types(config)
        if LINEAR not in kinds:
            return None
        return cls(LinearGeometry.from_config(config), tuple(k == LINEAR for k in kinds),
                   float(config.get("rms_norm_eps", 1e-6)))


def linear_tensor_names(prefix: str, head_order: bool = False) -> list[str]:
    """The names of one linear-attention layer's mixer (`prefix` is "model.layers.{g}."); `head_order`: the
    q | k | v and z projections come apart in head order (a GGUF file), not as in_proj_qkvz."""
    return [f"{prefix}linear_attn.{t}" for t in (_QKV_Z if head_order else _QKVZ) + _TENSORS]


def _head_order(groups: int, parts: list[int]) -> torch.Tensor:
    """Row indices that take rows grouped per key head, [p0_g | p1_g | ...] for g < groups, to the order
    p0 (all heads) | p1 (all heads) | ..."""
    rows = torch.arange(groups * sum(parts)).view(groups, sum(parts)).split(parts, dim=1)
    return torch.cat([t.reshape(-1) for t in rows])


def fuse_linear(w: dict[str, torch.Tensor], g: LinearGeometry) -> dict[str, torch.Tensor]:
    """Replace one layer's `linear_attn` projections and gates (names relative to the layer) by the fused
    tensors of the module docstring; kept-quantized projections (Planes) are reordered and fused as planes."""
    nk, dk, r, dv = g.key_heads, g.key_dim, g.value_heads // g.key_heads, g.value_dim
    if "linear_attn.in_proj_qkvz.weight" in w:
        parts = [take_rows(w.pop("linear_attn.in_proj_qkvz.weight"), _head_order(nk, [dk, dk, r * dv, r * dv]))]
    else:
        parts = [w.pop("linear_attn.in_proj_qkv.weight"), w.pop("linear_attn.in_proj_z.weight")]
    parts.append(take_rows(w.pop("linear_attn.in_proj_ba.weight"), _head_order(nk, [r, r])))
    w["linear.in_proj"] = fuse_rows(parts)
    w["linear.conv"] = w.pop("linear_attn.conv1d.weight").reshape(g.conv_dim, g.kernel).contiguous()
    w["linear.neg_a"] = -w.pop("linear_attn.A_log").float().exp()
    w["linear.dt_bias"] = w.pop("linear_attn.dt_bias").float()
    return w


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (transformers' and flash-linear-attention's l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of `x` over its last dim scaled by `weight`, then times silu(gate), in transformers' casts."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


# --- the delta rule --------------------------------------------------------------------------------------

def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: q, k [B, H, dk] (q scaled), v [B, H, dv], g, beta [B, H], state [B, H, dk, dv], all
    float32. Returns (o [B, H, dv], the new state)."""
    state = state * g.exp()[..., None, None]
    recalled = (state * k[..., None]).sum(dim=-2)
    delta = (v - recalled) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole sequence per row (rule 4): q, k [B, H, T, dk] (q scaled), v [B, H, T, dv], g, beta [B, H, T],
    state [B, H, dk, dv], float32, T a multiple of `chunk` (zero-padded at the end: rule 3). Returns
    (o [B, H, T, dv], the state after the last token)."""
    b, h, t, dk = k.shape
    if t % chunk:
        raise ValueError(f"chunked_delta_rule: {t} tokens are not a whole number of chunks of {chunk}")
    n, dv = t // chunk, v.shape[-1]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(b, h, n, chunk).cumsum(dim=-1)  # log of the decay from the chunk's start to each token
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(later, float("-inf")).exp()  # token j -> token i
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its strict lower part; solve_triangular takes the diagonal as 1
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * decay
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty(b, h, n, chunk, dv, dtype=v.dtype, device=v.device)
    for i in range(n):
        v_new = new_v[:, :, i] - k_cum[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + inner[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(b, h, t, dv), state


# --- one step of one layer -------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    """Index tensors every linear layer of a step shares (rules 2 and 3), kept in `batch.cache`."""

    entries: torch.Tensor  # [B] state entry of each step entry
    fresh: torch.Tensor  # [B] bool: the entry's step starts at position 0
    ext_index: torch.Tensor  # [T + B (K - 1)] rows of cat(x, state rows) in rule 2's order
    out_index: torch.Tensor  # [T] conv output row of each token
    tail_index: torch.Tensor  # [B, K - 1] rows of the extended sequence that become each entry's conv state
    decode: list[int]  # step entries with n == 1 ...
    decode_rows: torch.Tensor  # ... and their token rows
    prefill: list[int]  # step entries with n > 1 ...
    prefill_rows: torch.Tensor  # ... their token rows, in order
    pad_index: torch.Tensor  # [P, Tp] token row of each padded position (T: the zero row)
    pad_valid: torch.Tensor  # [P, Tp] bool
    chunk: int


def _plan(batch: StepBatch, kernel: int) -> _Plan:
    key = ("linear_plan", kernel)
    if key in batch.cache:
        return batch.cache[key]
    t, s = batch.num_tokens, kernel - 1
    ext, out, tail = [], [], []
    for i, (_, _, n, _) in enumerate(batch.slots):
        seg = len(ext)
        ext += [t + i * s + j for j in range(s)] + list(range(batch.cu[i], batch.cu[i] + n))
        out += [seg + j for j in range(n)]
        tail.append([seg + n + j for j in range(s)])
    decode = [i for i, e in enumerate(batch.slots) if e[2] == 1]
    prefill = [i for i, e in enumerate(batch.slots) if e[2] > 1]
    longest = max((batch.slots[i][2] for i in prefill), default=0)
    chunk = CHUNK  # fixed, so that an entry's chunks do not depend on the other entries of its step
    padded = -(-longest // chunk) * chunk
    pad = [[batch.cu[i] + j if j < batch.slots[i][2] else t for j in range(padded)] for i in prefill]

    def dev(values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(batch.device, non_blocking=True)

    pad_index = dev(pad).reshape(len(prefill), padded)
    plan = _Plan(
        entries=dev(batch.state_entries), fresh=dev([e[1] == 0 for e in batch.slots], torch.bool),
        ext_index=dev(ext), out_index=dev(out), tail_index=dev(tail).reshape(len(batch.slots), s),
        decode=decode, decode_rows=dev([batch.cu[i] for i in decode]),
        prefill=prefill, prefill_rows=dev([r for i in prefill for r in range(batch.cu[i], batch.cu[i + 1])]),
        pad_index=pad_index, pad_valid=pad_index < t, chunk=chunk,
    )
    batch.cache[key] = plan
    return plan


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor,
                                                                                                     torch.Tensor]:
    """Rule 2: silu(conv(x)) `[T, C]` for the step's rows `x [T, C]`, and the new conv state `[B, K - 1, C]`,
    from the entries' conv state `state [B, K - 1, C]` and the depthwise kernel `weight [C, K]`."""
    c = x.shape[-1]
    seq = torch.cat([x, state.reshape(-1, c).to(x.dtype)]).index_select(0, plan.ext_index)
    y = F.conv1d(seq.T.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=c)[0].T
    return F.silu(y.index_select(0, plan.out_index)).to(x.dtype), seq[plan.tail_index]


def linear_attention(h: torch.Tensor, w: dict[str, torch.Tensor], spec: LinearSpec, batch: StepBatch,
                     state: StatePool, layer: int) -> torch.Tensor:
    """The mixer's output `[T, hidden]` for the normed hidden `h [T, hidden]` of local linear layer `layer`; reads
    and writes the step's state entries of that layer (rule 1)."""
    g = spec.geometry
    nk, nv, dk, dv = g.key_heads, g.value_heads, g.key_dim, g.value_dim
    plan = _plan(batch, g.kernel)
    n = h.shape[0]
    mixed, z, b, a = linear(h, w["linear.in_proj"]).split([g.conv_dim, nv * dv, nv, nv], dim=-1)
    conv_state, rec = state.read(layer, plan.entries, plan.fresh)
    mixed, conv_state = causal_conv(mixed, w["linear.conv"], conv_state, plan)
    q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
    q = l2norm(q.float().view(n, nk, dk)) * dk**-0.5
    k = l2norm(k.float().view(n, nk, dk))
    if nv != nk:  # each key head serves nv / nk consecutive value heads
        q, k = q.repeat_interleave(nv // nk, dim=1), k.repeat_interleave(nv // nk, dim=1)
    v = v.float().view(n, nv, dv)
    beta = torch.sigmoid(b).float()
    decay = w["linear.neg_a"] * F.softplus(a.float() + w["linear.dt_bias"])

    out = torch.empty(n, nv, dv, dtype=torch.float32, device=h.device)
    new_rec = torch.empty_like(rec)
    if plan.decode:
        rows, entries = plan.decode_rows, plan.decode
        o, s = recurrent_step(q[rows], k[rows], v[rows], decay[rows], beta[rows], rec[entries])
        out[rows], new_rec[entries] = o, s
    if plan.prefill:
        def padded(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [P, H, Tp, ...], zeros past each entry
            x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[plan.pad_index]
            return x.transpose(1, 2)

        o, s = chunked_delta_rule(padded(q), padded(k), padded(v), padded(decay), padded(beta),
                                  rec[plan.prefill], plan.chunk)
        out[plan.prefill_rows] = o.transpose(1, 2)[plan.pad_valid]
        new_rec[plan.prefill] = s
    state.write(layer, plan.entries, conv_state, new_rec)

    o = gated_rms_norm(out.to(h.dtype), z.view(n, nv, dv), w["linear_attn.norm.weight"], spec.eps)
    return linear(o.reshape(n, nv * dv), w["linear_attn.out_proj.weight"])
