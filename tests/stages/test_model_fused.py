"""What StageModel fuses at load time: row views instead of second copies, and the rotary table's values."""
from __future__ import annotations

import torch

from stages.batch import StepBatch
from stages.checkpoint import load_checkpoint
from stages.model import StageModel
from stages.tiny import make_tiny_model


def test_fused_weights_are_the_checkpoints_rows_and_the_parts_are_views(tmp_path):
    ckpt = load_checkpoint(make_tiny_model(tmp_path / "m", arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2))
    m = StageModel(ckpt, 0, 2)
    raw = ckpt.tensors([f"model.layers.1.self_attn.{p}_proj.{t}" for p in "qkv" for t in ("weight", "bias")])
    w = m.layers[1]
    want = torch.cat([raw[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(w["qkv.weight"], want)
    assert torch.equal(w["qkv.bias"], torch.cat([raw[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"]))
    base = w["qkv.weight"].untyped_storage().data_ptr()
    for p in "qkv":
        assert w[f"self_attn.{p}_proj.weight"].untyped_storage().data_ptr() == base
    assert w["mlp.up_proj.weight"].untyped_storage().data_ptr() == w["gate_up.weight"].untyped_storage().data_ptr()
    assert "gate_up.bias" not in w  # no MLP bias in the checkpoint: none made up


def test_qk_norm_weight_repeats_each_norm_per_head(tmp_path):
    ckpt = load_checkpoint(make_tiny_model(tmp_path / "m", arch="qwen3", layers=1, hidden=64, heads=4, kv_heads=2))
    w = StageModel(ckpt, 0, 1).layers[0]
    assert w["qk_norm.weight"].shape == (6, 16)
    assert all(torch.equal(w["qk_norm.weight"][h], w["self_attn.q_norm.weight"]) for h in range(4))
    assert all(torch.equal(w["qk_norm.weight"][h], w["self_attn.k_norm.weight"]) for h in (4, 5))


def test_rotary_table_rows_equal_cos_sin_computed_per_step(tmp_path):
    ckpt = load_checkpoint(make_tiny_model(tmp_path / "m", arch="llama", layers=1, hidden=64, heads=4, kv_heads=2))
    m = StageModel(ckpt, 0, 1)
    for slots in ([[0, 5, 3, 1]], [[0, 1500, 1, 1], [1, 2, 1, 1]], [[2, 0, 40, 0], [1, 3000, 2, 1]]):
        batch = StepBatch.from_slots(slots)
        cos, sin = m._cos_sin(batch)
        want_cos, want_sin = m.rope.cos_sin(batch.positions, m.dtype)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert m._rope_cos.shape[0] == 4096  # grown to the power of two past the longest context
