"""`strata bench paged`: what reading K/V through chunk tables costs a decode step, against one contiguous K/V
tensor. Run by `coordinator.bench` as a child process (`python -m stages.bench_paged --json PATH ...`).

For each context length, every slot decodes one token at position ctx - 1 (its context is ctx cells):

    paged        the slot's table is a random permutation of pool chunks (no two logical neighbours adjacent
                 in memory); write_kv + paged_attention through it, with a fresh StepBatch per step (a one-layer
                 stage builds the step's gather indices once per step, and so does this): the served path, the
                 CPU decode kernel when it is available (stages/cpu_attention.py)
    paged, sdpa  (attention level) the same through the torch reference: the cells gathered, then SDPA
    contiguous   K, V as one [ctx, kv_heads, head_dim] tensor per slot holding the same values in logical
                 order; the new cell is written in place and plain scaled_dot_product_attention reads it

Two levels: attention only, and one full layer of the tiny model (norms, projections, rope, attention, MLP;
`StageModel` over a middle layer vs the same weights and math over the contiguous tensor). Before any timing,
the two outputs are compared (they must agree to 1e-4), so a timing never stands for a wrong result.
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

from stages import cpu_attention
from stages.attention import paged_attention, write_kv
from stages.batch import StepBatch
from stages.bench_pool import timeit, write_result
from stages.checkpoint import load_checkpoint
from stages.kv_cache import KVCache
from stages.model import StageModel, rms_norm
from stages.rope import apply_rope
from stages.tiny import ensure_tiny

TOLERANCE = 1e-4


class Setup:
    """One context length: a pool with shuffled tables and the same K/V laid out contiguously."""

    def __init__(self, model: StageModel, ctx: int, slots: int, chunk_cells: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.model, self.ctx, self.slots = model, ctx, slots
        table_chunks = math.ceil(ctx / chunk_cells)
        n_chunks = table_chunks * slots
        self.kv = KVCache(1, n_chunks, chunk_cells, model.kv_heads, model.head_dim, torch.float32, "cpu",
                          n_slots=slots, table_chunks=table_chunks)
        perm = torch.randperm(n_chunks, generator=gen).tolist()
        for s in range(slots):
            self.kv.set_table(s, perm[s * table_chunks:(s + 1) * table_chunks])
        shape = self.kv.k[0].shape
        self.kv.k[0].copy_(torch.randn(shape, generator=gen))
        self.kv.v[0].copy_(torch.randn(shape, generator=gen))
        # The same cells in logical order: [slots, ctx, kv_heads, head_dim].
        cells = torch.arange(ctx)
        flat_k, flat_v = self.kv.k[0].view(-1, *shape[2:]), self.kv.v[0].view(-1, *shape[2:])
        idx = torch.stack([self.kv.tables[s, cells // chunk_cells].long() * chunk_cells + cells % chunk_cells
                           for s in range(slots)])
        self.k_flat, self.v_flat = flat_k[idx].clone(), flat_v[idx].clone()
        heads, hd = model.spec.num_heads, model.head_dim
        self.q = torch.randn(slots, heads, hd, generator=gen)
        self.k_new = torch.randn(slots, model.kv_heads, hd, generator=gen)
        self.v_new = torch.randn(slots, model.kv_heads, hd, generator=gen)
        self.x = torch.randn(slots, model.hidden_size, generator=gen)

    def batch(self) -> StepBatch:
        return StepBatch.from_slots([[s, self.ctx - 1, 1, 1] for s in range(self.slots)])

    # -- attention only
    def paged_attention(self, cpu_kernel: bool = True) -> torch.Tensor:
        batch = self.batch()
        write_kv(self.kv, 0, batch, self.k_new, self.v_new)
        return paged_attention(self.q, self.kv, 0, batch, self.model.scale, cpu_kernel=cpu_kernel)

    def paged_sdpa_attention(self) -> torch.Tensor:
        return self.paged_attention(cpu_kernel=False)

    def contiguous_attention(self) -> torch.Tensor:
        return self._sdpa(self.q, self.k_new, self.v_new)

    def _sdpa(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        self.k_flat[:, self.ctx - 1] = k_new
        self.v_flat[:, self.ctx - 1] = v_new
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], self.k_flat.transpose(1, 2), self.v_flat.transpose(1, 2),
            scale=self.model.scale, enable_gqa=q.shape[1] != k_new.shape[1],
        )  # the one query is the last position: it sees every cell, no mask
        return out.reshape(self.slots, -1)

    # -- one full layer
    def paged_layer(self) -> torch.Tensor:
        return self.model.forward(self.batch(), self.kv, self.x)

    @torch.inference_mode()
    def contiguous_layer(self) -> torch.Tensor:
        m, w, x = self.model, self.model.layers[0], self.x
        s, n, eps = m.spec, self.slots, m.spec.rms_norm_eps
        positions = torch.full((n,), self.ctx - 1)
        cos, sin = m.rope.cos_sin(positions, m.dtype)
        h = rms_norm(x, w["input_layernorm.weight"], eps)
        q = F.linear(h, w["self_attn.q_proj.weight"], w.get("self_attn.q_proj.bias")).view(n, s.num_heads, s.head_dim)
        k = F.linear(h, w["self_attn.k_proj.weight"], w.get("self_attn.k_proj.bias")).view(n, s.kv_heads, s.head_dim)
        v = F.linear(h, w["self_attn.v_proj.weight"], w.get("self_attn.v_proj.bias")).view(n, s.kv_heads, s.head_dim)
        if "self_attn.q_norm.weight" in w:
            q = rms_norm(q, w["self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w["self_attn.k_norm.weight"], eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn = self._sdpa(q, k, v)
        x = x + F.linear(attn, w["self_attn.o_proj.weight"], w.get("self_attn.o_proj.bias"))
        h = rms_norm(x, w["post_attention_layernorm.weight"], eps)
        mlp = F.silu(F.linear(h, w["mlp.gate_proj.weight"])) * F.linear(h, w["mlp.up_proj.weight"])
        return x + F.linear(mlp, w["mlp.down_proj.weight"])


def check_same(name: str, a: Callable[[], torch.Tensor], b: Callable[[], torch.Tensor]) -> float:
    """Both paths must give the same output (max abs difference within TOLERANCE); returns the difference."""
    with torch.inference_mode():
        diff = (a() - b()).abs().max().item()
    if not diff <= TOLERANCE:
        raise AssertionError(f"{name}: paged and contiguous outputs differ by {diff} (> {TOLERANCE})")
    return diff


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = ensure_tiny("tiny")
    ckpt = load_checkpoint(model_dir)
    model = StageModel(ckpt, 1, 2, "cpu", torch.float32, pack_weights=False)  # a middle layer; plain F.linear like the contiguous side
    rows = []
    for ctx in args.contexts:
        setup = Setup(model, ctx, args.slots, args.chunk_cells, seed=ctx)
        for level, paged, sdpa, contiguous in (
                ("attention", setup.paged_attention, setup.paged_sdpa_attention, setup.contiguous_attention),
                ("layer", setup.paged_layer, None, setup.contiguous_layer)):
            diff = check_same(f"{level} at {ctx}", paged, contiguous)
            if sdpa is not None:
                diff = max(diff, check_same(f"{level} (sdpa) at {ctx}", sdpa, contiguous))
            with torch.inference_mode():
                t_paged = timeit(paged, args.repeats, warmup=2)
                t_sdpa = timeit(sdpa, args.repeats, warmup=2) if sdpa is not None else None
                t_flat = timeit(contiguous, args.repeats, warmup=2)
            rows.append({"level": level, "context": ctx, "slots": args.slots, "chunks": setup.kv.table_chunks,
                         "paged_us": t_paged * 1e6, "paged_sdpa_us": t_sdpa * 1e6 if t_sdpa else None,
                         "contiguous_us": t_flat * 1e6, "paged_over_contiguous": t_paged / t_flat,
                         "max_abs_diff": diff})
            print(f"  {level} ctx {ctx}: paged {t_paged * 1e6:.0f} us, contiguous {t_flat * 1e6:.0f} us",
                  file=sys.stderr, flush=True)
    cfg = ckpt.config
    return {
        "bench": "paged",
        "columns": ["level", "context", "slots", "chunks", "paged_us", "paged_sdpa_us", "contiguous_us",
                    "paged_over_contiguous", "max_abs_diff"],
        "rows": rows,
        "plot": {"x": "context", "xlabel": "context (cells)", "logx": True, "series": ["level"],
                 "panels": [{"y": ["paged_us", "contiguous_us"], "ylabel": "decode step (us)", "logy": True},
                            {"y": ["paged_over_contiguous"], "ylabel": "paged / contiguous"}]},
        "notes": [
            f"tiny model (qwen3, hidden {cfg['hidden_size']}, heads {cfg['num_attention_heads']}, kv_heads "
            f"{cfg['num_key_value_heads']}, head_dim {model.head_dim}), float32, CPU, torch threads "
            f"{torch.get_num_threads()}; chunk_cells {args.chunk_cells}, tables a random permutation of chunks",
            f"one decode token per slot; best of {args.repeats} after 2 warm-up steps; paged includes building "
            "the StepBatch and its gather indices (once per step)",
            f"outputs of the paths checked equal (max abs diff <= {TOLERANCE}) before timing",
            "paged decode attention: " + ("the CPU kernel (stages/cpu_attention.py); paged_sdpa_us: the torch "
                                          "reference through the same tables" if cpu_attention.available() else
                                          f"the torch reference ({cpu_attention.unavailable_reason()})"),
        ],
        "threads": torch.get_num_threads(),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m stages.bench_paged")
    p.add_argument("--json", default=None, help="write the result here (default: stdout)")
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 8192, 32768])
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--chunk-cells", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    write_result(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
