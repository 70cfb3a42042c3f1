"""`strata bench quant`: what a kept-quantized projection (stages/quant_linear.py) costs per step, by rows.

    python -m stages.bench_quant --shapes 768x768,3072x768,768x3072 --rows 1,2,4,8,16,32,64,128,512

For each weight shape [N, K] (GGUF Q4_K and Q8_0 blocks of random values), for each step size (rows of the
activation), the best of `--repeats` wall times of: the int4 kernel (bfloat16 activations; what a step of at most
KERNEL_MAX_ROWS rows runs), dequantize + GEMM (what a longer step runs), and F.linear on the same weight held in
bfloat16 (the baseline: what a dequantized-at-load stage runs). Ratios are against the bfloat16 baseline; the row
count where the kernel stops beating dequantize + GEMM is where KERNEL_MAX_ROWS belongs. Also the weight bytes
of each, so the memory side of the trade is on the same table.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from stages.bench_pool import timeit, write_result
from stages.quant_linear import KERNEL_MAX_ROWS, QuantLinear, planes_from_gguf


def _weight(kind: str, n: int, k: int) -> QuantLinear:
    from stages.gguf_quantize import quantize

    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    planes = planes_from_gguf(kind, quantize(w, kind), (n, k))
    assert planes is not None
    return QuantLinear(planes, torch.bfloat16, "cpu")


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    rows_out: list[dict[str, Any]] = []
    for shape in args.shapes:
        n, k = (int(x) for x in shape.split("x"))
        for kind in args.kinds:
            q = _weight(kind, n, k)
            dense = q.dequantize()  # the same weight in bfloat16, held whole
            for m in args.rows:
                x = torch.randn(m, k).bfloat16()
                base = timeit(lambda: F.linear(x, dense), args.repeats)
                gemm = timeit(lambda: F.linear(x, q.dequantize()), args.repeats)
                kernel = timeit(lambda: sum(torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, q.group, sz)
                                            for p, sz in zip(q.packed, q.scales_zeros)), args.repeats)
                rows_out.append({
                    "shape": shape, "kind": kind, "rows": m, "kernel_ms": kernel * 1e3, "dequant_gemm_ms": gemm * 1e3,
                    "bf16_ms": base * 1e3, "kernel_vs_bf16": base / kernel, "dequant_gemm_vs_bf16": base / gemm,
                    "path": "kernel" if m <= KERNEL_MAX_ROWS else "dequant+gemm",
                    "weight_vs_bf16": q.nbytes / (dense.numel() * 2),
                })
                print(f"  {shape} {kind} rows {m}: {rows_out[-1]}", file=sys.stderr, flush=True)
    return {
        "bench": "quant",
        "columns": ["shape", "kind", "rows", "kernel_ms", "dequant_gemm_ms", "bf16_ms", "kernel_vs_bf16",
                    "dequant_gemm_vs_bf16", "path", "weight_vs_bf16"],
        "rows": rows_out,
        "plot": {"x": "rows", "series": ["shape", "kind"], "logx": True,
                 "panels": [{"y": ["kernel_vs_bf16", "dequant_gemm_vs_bf16"], "ylabel": "speed vs bfloat16 F.linear"}]},
        "notes": [f"torch {torch.__version__}, {args.threads} threads, bfloat16 activations; best of {args.repeats}; "
                  f"KERNEL_MAX_ROWS = {KERNEL_MAX_ROWS} (the kernel runs steps up to that many rows)",
                  "weight_vs_bf16: the packed weight's bytes (planes + scales and zeros) over the same weight in "
                  "bfloat16"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stages.bench_quant")
    p.add_argument("--json", default=None)
    p.add_argument("--shapes", type=lambda s: s.split(","), default=["768x768", "3072x768", "768x3072"])
    p.add_argument("--kinds", type=lambda s: s.split(","), default=["Q4_K", "Q8_0"])
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    write_result(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
