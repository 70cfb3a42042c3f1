"""What StageModel fuses at load time: row views instead of second copies, and the rotary table's values."""
from __future__ import annotations

import torch

from stages.batch import StepBatch
from stages.checkpoint import load_checkpoint
from stages.model import StageModel
from stages.tiny import make_tiny_model


def test_fused_weights_are_the_checkpoints_rows_and_the_parts_are_views(tmp_path):
    ckpt = load_checkpoint(make_tiny_model(tmp_path / "m", arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2))
    m = StageModel(ckpt, 0, 2, pack_weights=False)  # the plain layout (packed: tests/stages/test_packed_linear.py)
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


def test_qk_norm_is_rms_norm_per_part_without_a_per_head_copy(tmp_path):
    """q and k heads normed together equal rms_norm of each part with its own weight, bit for bit, in float32,
    bfloat16 and a gated arch's float32 (1 + weight) on bfloat16 rows; the stage holds q_norm and k_norm once."""
    from stages.model import qk_norm, rms_norm

    ckpt = load_checkpoint(make_tiny_model(tmp_path / "m", arch="qwen3", layers=1, hidden=64, heads=4, kv_heads=2))
    w = StageModel(ckpt, 0, 1).layers[0]
    assert w["self_attn.q_norm.weight"].shape == w["self_attn.k_norm.weight"].shape == (16,)
    assert not any("qk_norm" in name for name in w)
    g = torch.Generator().manual_seed(0)
    for x_dtype, w_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                             (torch.bfloat16, torch.float32)):
        qk = (torch.randn(5, 6, 16, generator=g) * 3).to(x_dtype)
        qn, kn = (1 + torch.randn(2, 16, generator=g) * 0.2).to(w_dtype)
        got = qk_norm(qk, qn, kn, 4, 1e-6)
        assert got.dtype == x_dtype
        assert torch.equal(got[:, :4], rms_norm(qk[:, :4], qn, 1e-6))
        assert torch.equal(got[:, 4:], rms_norm(qk[:, 4:], kn, 1e-6))


def test_rotary_table_rows_equal_cos_sin_computed_per_step(tmp_path):
    ckpt = load_checkpoint(make_tiny_model(tmp_path / "m", arch="llama", layers=1, hidden=64, heads=4, kv_heads=2))
    m = StageModel(ckpt, 0, 1)
    for slots in ([[0, 5, 3, 1]], [[0, 1500, 1, 1], [1, 2, 1, 1]], [[2, 0, 40, 0], [1, 3000, 2, 1]]):
        batch = StepBatch.from_slots(slots)
        cos, sin = m._cos_sin(batch)
        want_cos, want_sin = m.rope.cos_sin(batch.positions, m.dtype)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert m._rope_cos.shape[0] == 4096  # grown to the power of two past the longest context


def test_float32_rms_norm_is_bit_for_bit_transformers_formula():
    """The fused call stands in for transformers' formula only because it gives the same bits."""
    from stages.model import rms_norm

    g = torch.Generator().manual_seed(0)
    for shape in ((1, 64), (4, 128), (3, 6, 32), (512, 768), (5, 16, 64)):
        x = torch.randn(*shape, generator=g) * 3
        w = 1 + 0.2 * torch.randn(shape[-1], generator=g)
        want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        assert torch.equal(rms_norm(x, w, 1e-6), want)
        strided = torch.cat([x, x], -1)[..., :shape[-1]]  # the same values as a strided view (a column slice)
        assert torch.equal(rms_norm(strided, w, 1e-6), want)
