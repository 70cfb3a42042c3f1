"""Block-scaled FP8 checkpoints (quant_method fp8, weight_block_size), as the FP8 releases of Qwen3 / DeepSeek
store them: each projection's weight in F8_E4M3 beside a float32 `weight_scale_inv` of one scale per block, the
embedding, norms and lm_head in float.

Oracle: transformers on the dequantized weights (w * scale per block, written here as a float checkpoint), every
position's logits through a 2-stage split, atol 1e-4 in float32; `strata config check` counts the weights at their
dequantized size, as the stages hold them.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from coordinator import config_check
from pool.config import config_from_dict
from stages.checkpoint import CheckpointError, load_checkpoint
from stages.tiny import make_tiny_model
from tests.stages.test_gguf import hf_logits, stage_logits

BLOCK = [32, 64]  # rows x cols of a scale block: several blocks per weight, partial ones at the edges (rows 48)
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": BLOCK}


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """Per-block max |w| / 448 (e4m3's largest finite value): the scale each block is stored with."""
    n, k = w.shape
    bn, bk = BLOCK
    pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    pad[:n, :k] = w.abs()
    return (pad.reshape(-(-n // bn), bn, -(-k // bk), bk).amax(dim=(1, 3)) / 448).clamp(min=1e-12)


def _expand(scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    return scale.repeat_interleave(BLOCK[0], 0)[:shape[0]].repeat_interleave(BLOCK[1], 1)[:, :shape[1]]


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(the FP8 checkpoint, the same weights dequantized as a float32 checkpoint)."""
    root = tmp_path_factory.mktemp("fp8")
    src = make_tiny_model(root / "src", arch="qwen3", layers=4, hidden=128, heads=4, kv_heads=2, intermediate=176,
                          seed=7)
    weights = load_file(str(src / "model.safetensors"))
    fp8, plain = dict(weights), dict(weights)
    for name, w in weights.items():
        if name.endswith("_proj.weight"):
            scale = _blocks(w)
            q = (w / _expand(scale, w.shape)).to(torch.float8_e4m3fn)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            plain[name] = q.float() * _expand(scale, w.shape)
    cfg = json.loads((src / "config.json").read_text())
    out = []
    for sub, tensors, conf in (("fp8", fp8, {**cfg, "quantization_config": FP8}), ("plain", plain, cfg)):
        d = root / sub
        d.mkdir()
        for f in src.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                (d / f.name).write_bytes(f.read_bytes())
        (d / "config.json").write_text(json.dumps(conf))
        save_file(tensors, str(d / "model.safetensors"))
        out.append(d)
    return out[0], out[1]


def test_fp8_logits_match_transformers_on_the_dequantized_weights(fp8_pair) -> None:
    fp8, plain = fp8_pair
    assert load_checkpoint(fp8).infos["model.layers.0.mlp.down_proj.weight"].dtype == "F8_E4M3"
    ours = stage_logits(fp8, [2])
    torch.testing.assert_close(ours, hf_logits(plain), atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, stage_logits(plain, []), atol=1e-5, rtol=0)


def test_fp8_weight_without_its_scales_is_refused(fp8_pair, tmp_path) -> None:
    fp8, _ = fp8_pair
    d = tmp_path / "noscale"
    d.mkdir()
    for f in fp8.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.3.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.layers.3.self_attn.o_proj.weight.*F8_E4M3"):
        stage_logits(d, [])


def test_config_check_counts_fp8_weights_dequantized(fp8_pair) -> None:
    fp8, plain = fp8_pair

    def box(model: Path) -> dict:
        return {"model": str(model), "engine": {"max_context": 64, "chunk_cells": 16, "kv_pool_tokens": 64,
                                                "parallel": 2, "prefill_chunk": 16},
                "stages": [{"layers": [0, 2], "endpoint": "ipc:///tmp/fp8-0"},
                           {"layers": [2, 4], "endpoint": "ipc:///tmp/fp8-1"}]}

    got = config_check.check(config_from_dict(box(fp8)))
    want = config_check.check(config_from_dict(box(plain)))
    assert [s.weight_bytes for s in got.stages] == [s.weight_bytes for s in want.stages]
    assert any("block-scaled FP8 (32x64 blocks); dequantized at load" in n for n in got.notes)
