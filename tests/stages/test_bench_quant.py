"""`strata bench quant` (stages/bench_quant.py): every path it names is timed on the same planes, and each
column is the path the stages take."""
from __future__ import annotations

import argparse

import pytest

from stages import bench_quant, byte_rows

pytest.importorskip("gguf")


def test_each_path_is_timed_on_the_same_planes() -> None:
    args = argparse.Namespace(shapes=["64x64"], kinds=["Q4_0", "Q8_0"], rows=[1, 9], repeats=1, threads=1)
    result = bench_quant.run(args)
    rows = {(r["kind"], r["rows"]): r for r in result["rows"]}
    assert set(rows) == {("Q4_0", 1), ("Q4_0", 9), ("Q8_0", 1), ("Q8_0", 9)}
    for r in rows.values():
        assert all(r[c] > 0 for c in ("kernel_ms", "dequant_gemm_ms", "bf16_ms", "planes_f32_ms", "dequant_ms",
                                      "dequant_torch_ms")), r
        assert (r["bytes_ms"] is not None) == (r["bytes_f32_ms"] is not None) == byte_rows.available()
    if byte_rows.available():  # 0.625 / 2 bytes per value as nibble pairs, 1.125 / 2 as bytes (a float32 scale per
        # 32, the offsets made from it: byte_rows rule 8), against bfloat16's 2
        assert rows[("Q4_0", 1)]["bytes_weight_vs_bf16"] == pytest.approx(0.3125)
        assert rows[("Q8_0", 1)]["bytes_weight_vs_bf16"] == pytest.approx(0.5625)
    assert set(result["columns"]) <= set(rows[("Q8_0", 1)])
