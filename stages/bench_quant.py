"""`strata bench quant`: what a kept-quantized projection (stages/quant_linear.py) costs per step, by rows.

    python -m stages.bench_quant --shapes 768x768,3072x768,768x3072 --rows 1,2,4,8,16,32,64,128,512

For each weight shape [N, K] (GGUF blocks of random values, `--kinds`), for each step size (rows of the
activation), the best of `--repeats` wall times of, in bfloat16: torch's int4 kernel on the planes (a QuantLinear's
step of at most KERNEL_MAX_ROWS rows), the planes dequantized + GEMM (a longer step), the planes held as
stages/byte_rows.py's bytes or nibble pairs (a ByteLinear's step: its kernel up to its MAX_ROWS, else its
dequantize + GEMM) and F.linear on the same weight held in bfloat16 (the baseline: what a dequantized-at-load stage
runs); in float32: the planes (a QuantLinear, which dequantizes for every product) and the ByteLinear. Also the
planes' dequantize alone, by stages/byte_rows.py's library (rule 6) and by torch's code. Ratios are against the
bfloat16 baseline; the row count where the kernel stops beating dequantize + GEMM is where KERNEL_MAX_ROWS
belongs. The weight bytes of each, so the memory side of the trade is on the same table. The ByteLinear columns
are empty where its kernel is unavailable.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from stages import byte_rows
from stages.bench_pool import timeit, write_result
from stages.byte_rows import ByteLinear
from stages.quant_linear import KERNEL_MAX_ROWS, Planes, QuantLinear, planes_from_gguf


def _planes(kind: str, n: int, k: int) -> Planes:
    from stages.gguf_quantize import quantize

    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    planes = planes_from_gguf(kind, quantize(w, kind), (n, k))
    assert planes is not None
    return planes


def _torch_dequantize(q: QuantLinear) -> torch.Tensor:
    """QuantLinear.dequantize by torch's code (stages/byte_rows.py's rule 6 off)."""
    ok, byte_rows._int4pack_ok = byte_rows._int4pack_ok, lambda: False
    try:
        return q.dequantize()
    finally:
        byte_rows._int4pack_ok = ok


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    rows_out: list[dict[str, Any]] = []
    for shape in args.shapes:
        n, k = (int(x) for x in shape.split("x"))
        for kind in args.kinds:
            planes = _planes(kind, n, k)
            q = QuantLinear(planes, torch.bfloat16, "cpu")
            q32 = QuantLinear(planes, torch.float32, "cpu")
            held = byte_rows.available() and byte_rows.takes(planes, torch.float32)
            b16, b32 = (ByteLinear(planes, torch.bfloat16), ByteLinear(planes, torch.float32)) if held else (None, None)
            dense = q.dequantize()  # the same weight in bfloat16, held whole
            dequant = {"dequant_ms": timeit(q.dequantize, args.repeats) * 1e3,
                       "dequant_torch_ms": timeit(lambda: _torch_dequantize(q), args.repeats) * 1e3}
            for m in args.rows:
                x = torch.randn(m, k).bfloat16()
                x32 = x.float()
                base = timeit(lambda: F.linear(x, dense), args.repeats)
                gemm = timeit(lambda: F.linear(x, q.dequantize()), args.repeats)
                kernel = timeit(lambda: sum(torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, q.group, sz)
                                            for p, sz in zip(q.packed, q.scales_zeros)), args.repeats)
                row = {"shape": shape, "kind": kind, "rows": m, "kernel_ms": kernel * 1e3,
                       "dequant_gemm_ms": gemm * 1e3, "bytes_ms": None, "bf16_ms": base * 1e3,
                       "planes_f32_ms": timeit(lambda: q32(x32), args.repeats) * 1e3, "bytes_f32_ms": None,
                       "kernel_vs_bf16": base / kernel, "dequant_gemm_vs_bf16": base / gemm,
                       "path": "kernel" if m <= KERNEL_MAX_ROWS else "dequant+gemm",
                       "weight_vs_bf16": q.nbytes / (dense.numel() * 2), **dequant}
                if held:
                    row["bytes_ms"] = timeit(lambda: b16(x), args.repeats) * 1e3
                    row["bytes_f32_ms"] = timeit(lambda: b32(x32), args.repeats) * 1e3
                    row["bytes_weight_vs_bf16"] = b16.nbytes / (dense.numel() * 2)
                rows_out.append(row)
                print(f"  {shape} {kind} rows {m}: {rows_out[-1]}", file=sys.stderr, flush=True)
    return {
        "bench": "quant",
        "columns": ["shape", "kind", "rows", "kernel_ms", "dequant_gemm_ms", "bytes_ms", "bf16_ms", "planes_f32_ms",
                    "bytes_f32_ms", "path", "weight_vs_bf16", "dequant_ms", "dequant_torch_ms"],
        "rows": rows_out,
        "plot": {"x": "rows", "series": ["shape", "kind"], "logx": True,
                 "panels": [{"y": ["kernel_vs_bf16", "dequant_gemm_vs_bf16"], "ylabel": "speed vs bfloat16 F.linear"}]},
        "notes": [f"torch {torch.__version__}, {args.threads} threads, bfloat16 activations; best of {args.repeats}; "
                  f"KERNEL_MAX_ROWS = {KERNEL_MAX_ROWS} (the kernel runs steps up to that many rows)",
                  "weight_vs_bf16: the packed weight's bytes (planes + scales and zeros) over the same weight in "
                  "bfloat16",
                  "bytes_ms / bytes_f32_ms: the planes held as stages/byte_rows.py's bytes or nibble pairs (its "
                  f"kernel up to {byte_rows.MAX_ROWS} rows, then its dequantize + GEMM), in bfloat16 / float32; "
                  "planes_f32_ms: the planes in float32 (QuantLinear: dequantize + GEMM for every product)",
                  "dequant_ms: the planes' dequantize (stages/byte_rows.py rule 6 where available); "
                  "dequant_torch_ms: by torch's code"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stages.bench_quant")
    p.add_argument("--json", default=None)
    p.add_argument("--shapes", type=lambda s: s.split(","), default=["768x768", "3072x768", "768x3072"])
    p.add_argument("--kinds", type=lambda s: s.split(","), default=["Q4_K", "Q4_0", "Q8_0", "Q5_0"])
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    write_result(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
