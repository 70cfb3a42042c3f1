"""GPTQ and AWQ checkpoints (stages/int4_checkpoint.py) against transformers on the same weights dequantized.

The checkpoints are written here from a tiny random model, packed word by word as the formats define them (a
loop over each word's values, not the loader's vectorised unpacking), beside a float32 twin holding
`(q - z) * s`. Oracle: transformers on the twin, every position's logits through a 2-stage split, atol 1e-4 in
float32. A kernel-sized GPTQ / AWQ weight stays quantized (a QuantLinear); a desc_act checkpoint whose g_idx
permutes the groups is dequantized at load and still matches.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from stages.checkpoint import load_checkpoint
from stages.int4_checkpoint import AWQ_ORDER
from stages.model import StageModel
from stages.byte_rows import ByteLinear
from stages.quant_linear import QuantLinear
from stages.tiny import make_tiny_model
from tests.stages.test_gguf import hf_logits, stage_logits


def _quantize(w: torch.Tensor, bits: int, group: int, g_idx: np.ndarray, min_zero: int):
    """Asymmetric integer grid per (group, output column): q [K, N], z [groups, N], s [groups, N] (w is [N, K])."""
    wt = w.t().numpy().astype(np.float64)  # [K, N]
    k, n = wt.shape
    groups = int(g_idx.max()) + 1
    top = (1 << bits) - 1
    q = np.zeros((k, n), np.int64)
    z = np.zeros((groups, n), np.int64)
    s = np.zeros((groups, n), np.float32)
    for g in range(groups):
        rows = g_idx == g
        lo, hi = np.minimum(wt[rows].min(0), 0), np.maximum(wt[rows].max(0), 0)
        scale = np.maximum((hi - lo) / top, 1e-8).astype(np.float16).astype(np.float32)
        zero = np.clip(np.rint(-lo / scale), min_zero, top)
        s[g], z[g] = scale, zero
        q[rows] = np.clip(np.rint(wt[rows] / scale) + zero, 0, top)
    return q, z, s


def _words(values: np.ndarray, bits: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """Pack along the last axis: word c holds values c * per + order[i] at bits i * bits (i = 0, 1, ...)."""
    per = 32 // bits
    order = order or tuple(range(per))
    out = np.zeros((*values.shape[:-1], values.shape[-1] // per), np.uint64)
    for c in range(out.shape[-1]):
        for i in range(per):
            out[..., c] |= values[..., c * per + order[i]].astype(np.uint64) << np.uint64(i * bits)
    return out.astype(np.uint32).view(np.int32)


def _write(src: Path, out: Path, scheme: dict) -> tuple[Path, Path]:
    """(the quantized checkpoint, its float32 twin) of every decoder projection of `src`."""
    method, bits, group = scheme["method"], scheme["bits"], scheme["group"]
    weights = load_file(str(src / "model.safetensors"))
    packed, twin = {}, {}
    rng = np.random.default_rng(0)
    for name, w in weights.items():
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            packed[name] = twin[name] = w
            continue
        k = w.shape[1]
        g_idx = np.arange(k) // group
        if scheme.get("desc_act"):
            g_idx = rng.permutation(g_idx)  # act-order: groups are not contiguous
        v2 = scheme.get("format") == "gptq_v2"
        q, z, s = _quantize(w, bits, group, g_idx, 0 if (method == "awq" or v2) else 1)
        base = name[: -len("weight")]
        twin[name] = torch.from_numpy(((q - z[g_idx]) * s[g_idx]).T.astype(np.float32).copy())
        if method == "awq":
            packed[base + "qweight"] = torch.from_numpy(_words(q, 4, AWQ_ORDER))
            packed[base + "qzeros"] = torch.from_numpy(_words(z, 4, AWQ_ORDER))
        else:
            packed[base + "qweight"] = torch.from_numpy(_words(q.T, bits).T.copy())  # packed along K
            packed[base + "qzeros"] = torch.from_numpy(_words(z - (0 if v2 else 1), bits))
            packed[base + "g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        packed[base + "scales"] = torch.from_numpy(s).half()
    cfg = json.loads((src / "config.json").read_text())
    quant = {"quant_method": method, "bits": bits, "group_size": group}
    quant.update({"version": "gemm", "zero_point": True} if method == "awq" else
                 {"desc_act": bool(scheme.get("desc_act")), "sym": False,
                  "checkpoint_format": scheme.get("format", "gptq")})
    dirs = []
    for sub, tensors, conf in (("q", packed, {**cfg, "quantization_config": quant}), ("twin", twin, cfg)):
        d = out / sub
        shutil.copytree(src, d)
        (d / "config.json").write_text(json.dumps(conf))
        save_file(tensors, str(d / "model.safetensors"))
        dirs.append(d)
    return dirs[0], dirs[1]


SCHEMES = {
    "gptq-4bit-g64": {"method": "gptq", "bits": 4, "group": 64},
    "gptq-4bit-g32-v2": {"method": "gptq", "bits": 4, "group": 32, "format": "gptq_v2"},
    "gptq-8bit-g32": {"method": "gptq", "bits": 8, "group": 32},
    "gptq-4bit-desc-act": {"method": "gptq", "bits": 4, "group": 32, "desc_act": True},
    "awq-4bit-g32": {"method": "awq", "bits": 4, "group": 32},
}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("int4") / "src", arch="qwen3", layers=4, hidden=128, heads=4,
                           kv_heads=2, intermediate=256, seed=11)


@pytest.mark.parametrize("case", list(SCHEMES))
def test_int4_checkpoint_matches_transformers_on_the_dequantized_weights(source, tmp_path, case: str) -> None:
    q, twin = _write(source, tmp_path, SCHEMES[case])
    ckpt = load_checkpoint(q)
    assert ckpt.quantized and ckpt.has_tensor("model.layers.0.self_attn.q_proj.weight")
    torch.testing.assert_close(stage_logits(q, [2]), hf_logits(twin), atol=1e-4, rtol=0)
    model = StageModel(ckpt, 0, 2, "cpu", torch.float32)
    kept = isinstance(model.layers[0]["qkv.weight"], (QuantLinear, ByteLinear))  # 8 bits: two planes as bytes
    assert kept == (not SCHEMES[case].get("desc_act"))  # act-order groups: dequantized at load
    assert isinstance(model.layers[1]["mlp.down_proj.weight"], (QuantLinear, ByteLinear)) == kept


@pytest.mark.parametrize("case", ["gptq-4bit-g64", "gptq-8bit-g32", "awq-4bit-g32", "gptq-4bit-desc-act"])
def test_config_check_weights_are_the_loaded_stages(tmp_path, case: str) -> None:
    """`strata config check` counts each stage's weights as the stage loads them (StageModel.weight_bytes), kept
    quantized or, for act-order groups, dequantized; a llama (no fused q/k norms) with every row count a multiple
    of the CPU packer's 64-row block."""
    from coordinator import config_check
    from pool.config import config_from_dict

    src = make_tiny_model(tmp_path / "src", arch="llama", layers=4, hidden=128, heads=4, kv_heads=2,
                          intermediate=256, seed=3)
    q, _ = _write(src, tmp_path, SCHEMES[case])
    ckpt = load_checkpoint(q)
    for dtype in ("float32", "bfloat16"):
        box = {"model": str(q), "engine": {"max_context": 64, "chunk_cells": 16, "kv_pool_tokens": 64, "parallel": 2,
                                           "prefill_chunk": 16, "dtype": dtype},
               "stages": [{"layers": [0, 2], "endpoint": "ipc:///tmp/int4-0"},
                          {"layers": [2, 4], "endpoint": "ipc:///tmp/int4-1"}]}
        report = config_check.check(config_from_dict(box))
        loaded = [StageModel(ckpt, a, b, "cpu", dtype).weight_bytes() for a, b in ((0, 2), (2, 4))]
        assert [s.weight_bytes for s in report.stages] == loaded, dtype
        assert any(SCHEMES[case]["method"].upper() in n for n in report.notes)
