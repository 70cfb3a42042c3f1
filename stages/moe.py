"""The sparse MLP of Qwen2-MoE, Qwen3-MoE and Qwen3-Next: a router, `num_experts` small MLPs, and (Qwen2-MoE,
Qwen3-Next) a shared expert.

Rules, as transformers computes them (the checkpoints were trained with them, and tests compare against them):
- Which layers are sparse: layer i (global index) is sparse when `i not in mlp_only_layers`, `num_experts > 0`
  and `(i + 1) % decoder_sparse_step == 0`; every other layer keeps the dense MLP of `intermediate_size`.
- Router: `logits = h @ mlp.gate.weight.T` (`[T, E]`, no bias), `probs = softmax(logits)` in float32, the
  `num_experts_per_tok` largest probabilities and their experts (`top_k`). With `norm_topk_prob` the chosen
  probabilities are divided by their sum (they then add up to 1); without it they stay raw softmax values.
  The weights are cast back to the model dtype before they scale the experts' outputs.
- Expert e: `down_e(silu(gate_e(h)) * up_e(h))` of `moe_intermediate_size`; the block's output for a token is
  the weighted sum of its top_k experts' outputs.
- Shared expert (Qwen2-MoE and Qwen3-Next, present whenever the architecture is): a dense MLP of
  `shared_expert_intermediate_size` over every token, scaled by `sigmoid(h @ mlp.shared_expert_gate.weight.T)`
  (one scalar per token) and added to the experts' sum.

Dispatch is grouped by expert: the `T * top_k` (token, expert) pairs are sorted by expert (a stable sort, so
within one expert tokens keep their order), each expert that received at least one pair runs one
`gate_up` and one `down` matmul over exactly its tokens, and the weighted outputs are scatter-added into the
tokens' rows. The work is `T * top_k` token-expert products, never `T * num_experts`; the number of matmul
calls is the number of distinct experts the step's tokens chose (at most `min(E, T * top_k)`).

Weights, stacked at load from the Hugging Face names (`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`):

    experts.gate_up  [E, 2 * moe_intermediate, hidden]   rows [0, I) gate_proj of expert e, rows [I, 2I) up_proj
    experts.down     [E, hidden, moe_intermediate]       down_proj of expert e
    shared_expert.gate_up [2 * shared_intermediate, hidden]   (Qwen2-MoE) shared_expert.gate_proj | up_proj

A GGUF model's quantized experts stay quantized (stages/quant_linear.py): `experts.gate_up` and `experts.down`
are then lists of E packed weights, each expert's gate and up rows fused before packing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stages.quant_linear import Planes, fuse_rows, linear

SHARED_EXPERT_ARCHS = ("Qwen2MoeForCausalLM", "Qwen3NextForCausalLM")
MOE_ARCHS = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM")
_EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class MoESpec:
    """The MoE part of config.json; `sparse` has one entry per global layer (True: the layer routes)."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int  # 0: no shared expert
    sparse: tuple[bool, ...]

    @classmethod
    def from_config(cls, config: dict, arch: str) -> "MoESpec | None":
        """None for a dense architecture; the module docstring's layer rule otherwise."""
        if arch not in MOE_ARCHS:
            return None
        n_layers = int(config["num_hidden_layers"])
        # Qwen3MoeConfig writes `num_local_experts` (its attribute map), the Hub's configs `num_experts`.
        experts = int(config.get("num_experts", config.get("num_local_experts")) or 0)
        step = int(config.get("decoder_sparse_step") or 1)
        dense_only = set(config.get("mlp_only_layers") or [])
        sparse = tuple(i not in dense_only and experts > 0 and (i + 1) % step == 0 for i in range(n_layers))
        shared = int(config.get("shared_expert_intermediate_size") or 0) if arch in SHARED_EXPERT_ARCHS else 0
        return cls(
            num_experts=experts,
            top_k=int(config.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(config.get("moe_intermediate_size") or 0),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            shared_intermediate_size=shared,
            sparse=sparse,
        )


def sparse_tensor_names(prefix: str, spec: MoESpec) -> list[str]:
    """The Hugging Face names of one sparse layer's MLP tensors (`prefix` is "model.layers.{g}.")."""
    names = [prefix + "mlp.gate.weight"]
    names += [f"{prefix}mlp.experts.{e}.{p}.weight" for e in range(spec.num_experts) for p in _EXPERT_PROJ]
    if spec.shared_intermediate_size:
        names += [f"{prefix}mlp.shared_expert.{p}.weight" for p in _EXPERT_PROJ]
        names.append(prefix + "mlp.shared_expert_gate.weight")
    return names


def stack_experts(w: dict[str, torch.Tensor], spec: MoESpec) -> dict[str, torch.Tensor]:
    """Replace one layer's per-expert tensors (names relative to the layer) by the stacked ones (module docstring).

    The per-expert tensors leave the dict as they are copied, so the layer never holds both copies beyond one
    expert's worth.
    """
    first = w["mlp.experts.0.gate_proj.weight"]
    if isinstance(first, Planes):  # kept quantized (stages/quant_linear.py): a list of per-expert weights
        w["experts.gate_up"] = [fuse_rows([w.pop(f"mlp.experts.{e}.gate_proj.weight"),
                                           w.pop(f"mlp.experts.{e}.up_proj.weight")]) for e in range(spec.num_experts)]
        w["experts.down"] = [w.pop(f"mlp.experts.{e}.down_proj.weight") for e in range(spec.num_experts)]
        if spec.shared_intermediate_size:
            p = "mlp.shared_expert."
            w["shared_expert.gate_up"] = fuse_rows([w.pop(p + "gate_proj.weight"), w.pop(p + "up_proj.weight")])
        return w
    inter, hidden = first.shape
    gate_up = first.new_empty(spec.num_experts, 2 * inter, hidden)
    down = first.new_empty(spec.num_experts, hidden, inter)
    for e in range(spec.num_experts):
        p = f"mlp.experts.{e}."
        gate_up[e, :inter] = w.pop(p + "gate_proj.weight")
        gate_up[e, inter:] = w.pop(p + "up_proj.weight")
        down[e] = w.pop(p + "down_proj.weight")
    w["experts.gate_up"], w["experts.down"] = gate_up, down
    if spec.shared_intermediate_size:
        p = "mlp.shared_expert."
        w["shared_expert.gate_up"] = torch.cat([w.pop(p + "gate_proj.weight"), w.pop(p + "up_proj.weight")])
    return w


def route(h: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights `[T, top_k]` in h's dtype, experts int64 `[T, top_k]`) for hidden `h` `[T, hidden]`."""
    logits = linear(h, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def grouped_experts(h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{experts[t, k]}(h[t]) for every token t, grouped by expert (module docstring).

    h `[T, hidden]`, experts and weights `[T, top_k]`, gate_up `[E, 2I, hidden]`, down `[E, hidden, I]` (or lists of
    E kept-quantized weights of those shapes).
    """
    n_tokens, top_k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pair indices t * top_k + k, grouped by expert
    token = order // top_k
    pair_weights = weights.reshape(-1)[order]
    counts = torch.bincount(flat, minlength=len(gate_up)).tolist()  # the one host read of the block
    x = h.index_select(0, token)
    inter = gate_up[0].shape[0] // 2
    out_rows = torch.empty(x.shape[0], down[0].shape[0], dtype=h.dtype, device=h.device)
    at = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(at, at + n)
        gu = linear(x[rows], gate_up[e])
        y = linear(F.silu(gu[:, :inter]) * gu[:, inter:], down[e])
        out_rows[rows] = y * pair_weights[rows, None]
        at += n
    return torch.zeros_like(h).index_add_(0, token, out_rows)


def moe_mlp(h: torch.Tensor, w: dict[str, torch.Tensor], spec: MoESpec) -> torch.Tensor:
    """The sparse MLP's output `[T, hidden]` for the post-attention-normed hidden `h` of one layer."""
    weights, experts = route(h, w["mlp.gate.weight"], spec.top_k, spec.norm_topk_prob)
    out = grouped_experts(h, experts, weights, w["experts.gate_up"], w["experts.down"])
    if spec.shared_intermediate_size:
        gu = linear(h, w["shared_expert.gate_up"])
        shared = linear(F.silu(gu[:, :spec.shared_intermediate_size]) * gu[:, spec.shared_intermediate_size:],
                          w["mlp.shared_expert.down_proj.weight"])
        out = out + torch.sigmoid(linear(h, w["mlp.shared_expert_gate.weight"])) * shared
    return out
