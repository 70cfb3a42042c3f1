"""stages/packed_linear.py: packed weights multiply like F.linear, one copy of each weight is kept, and a stage
with packed weights gives transformers' logits (the oracle) as the plain stage does."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stages import packed_linear
from stages.checkpoint import load_checkpoint
from stages.model import StageModel
from stages.packed_linear import PackedLinear, available, pack_layer
from stages.quant_linear import linear
from stages.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(not available(torch.float32), reason="torch has no oneDNN linear here")


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 64, 300])
def test_a_packed_weight_multiplies_every_row_count_like_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(200, 96, generator=g), torch.randn(200, generator=g)
    x = torch.randn(rows, 96, generator=g)
    p = PackedLinear(w)
    want = F.linear(x.double(), w.double(), b.double())
    for bias in (b, None):
        got = linear(x, p, bias)
        assert got.shape == (rows, 200) and got.dtype == torch.float32
        ref = want if bias is not None else want - b.double()
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)
    assert p.nbytes == w.numel() * 4


def test_fewer_rows_than_min_rows_give_the_values_of_a_min_rows_product():
    """Rule 5: a product of 1-3 rows is a 4-row product cut back, so a lone decode row gets the values it gets
    in a step of 4 (oneDNN's own 1-row kernel sums a 3072-long row in another order)."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(768, 3072, generator=g), torch.randn(768, generator=g)
    x = torch.randn(4, 3072, generator=g)
    p = PackedLinear(w)
    full = linear(x, p, b)
    for rows in (1, 2, 3):
        assert torch.equal(linear(x[:rows], p, b), full[:rows]), rows



def test_the_padding_buffer_is_reused_and_its_extra_rows_are_zeros():
    """Rule 5: the padded input is one buffer per thread and width; a call of fewer rows than the last zeroes the
    rows the last one wrote, and the buffer serves calls inside inference mode and outside it."""
    if packed_linear.MIN_ROWS < 4:
        pytest.skip("padding is off (STRATA_PACKED_MIN_ROWS)")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 80, generator=g)
    p = PackedLinear(w)
    x = torch.randn(3, 80, generator=g)
    with torch.inference_mode():
        got3 = linear(x, p)
    buf = packed_linear._pads.bufs[(80, torch.float32)][0]
    got1 = linear(x[2:], p)  # outside inference mode, fewer rows than the last call
    assert packed_linear._pads.bufs[(80, torch.float32)][0] is buf
    assert torch.equal(buf[0], x[2]) and not buf[1:].any()
    want = F.linear(x.double(), w.double())
    torch.testing.assert_close(got3.double(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got1.double(), want[2:], rtol=1e-5, atol=1e-4)

def test_the_padding_row_count_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("STRATA_PACKED_MIN_ROWS", "0")
    assert packed_linear._min_rows() == 0
    monkeypatch.delenv("STRATA_PACKED_MIN_ROWS")
    assert packed_linear._min_rows() == 4
    monkeypatch.setenv("STRATA_PACKED_MIN_ROWS", "four")
    with pytest.raises(ValueError, match="STRATA_PACKED_MIN_ROWS must be a whole number"):
        packed_linear._min_rows()


def test_packing_a_layer_drops_the_part_views_and_keeps_the_rest(tmp_path):
    ckpt = load_checkpoint(make_tiny_model(tmp_path / "m", arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2))
    plain = StageModel(ckpt, 0, 2, pack_weights=False)
    packed = StageModel(ckpt, 0, 2)
    w = packed.layers[1]
    for name in ("qkv.weight", "self_attn.o_proj.weight", "gate_up.weight", "mlp.down_proj.weight"):
        assert isinstance(w[name], PackedLinear), name
    assert not any(k in w for k in ("self_attn.q_proj.weight", "mlp.up_proj.weight"))
    assert torch.equal(w["qkv.bias"], plain.layers[1]["qkv.bias"])  # biases and norms stay plain tensors
    assert packed.weight_bytes() == plain.weight_bytes()
    # the tied table of a one-stage model stays one plain tensor, read by the embedding and the head
    assert (packed.lm_head is packed.embed) == ckpt.tie_word_embeddings


def test_packing_is_off_where_the_environment_says_so(monkeypatch):
    monkeypatch.setenv("STRATA_PACKED_WEIGHTS", "0")
    available.cache_clear()
    try:
        assert not available(torch.float32)
        layer = {"qkv.weight": torch.randn(8, 4)}
        assert isinstance(pack_layer(layer)["qkv.weight"], torch.Tensor)
    finally:
        monkeypatch.delenv("STRATA_PACKED_WEIGHTS")
        available.cache_clear()
    assert available(torch.float32)


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_packed_and_plain_stages_both_give_transformers_logits(tmp_path, arch):
    """The oracle tests of test_model_vs_transformers run the packed stage (the default); here the plain one runs
    beside it on the same prompt, pieces and greedy decode, and both stay within the oracle's tolerance."""
    from tests.stages.test_model_vs_transformers import ATOL, Stack, build_hf, hf_logits, prompt_ids, random_tables, run_one

    model = build_hf(tmp_path / arch, arch)
    got = {}
    for pack in (True, False):
        stack = Stack(tmp_path / arch, [1], pack_weights=pack)
        assert isinstance(stack.models[0].layers[0]["qkv.weight"], PackedLinear) == pack
        (table,) = random_tables(seed=3, sizes=[8])
        stack.set_table(1, table)
        got[pack] = run_one(stack, 1, prompt_ids(2, 70), [33, 37], 24)
    assert got[True][1] == got[False][1]  # the same greedy tokens
    ref = hf_logits(model, prompt_ids(2, 70) + got[True][1])
    for pack in (True, False):
        torch.testing.assert_close(got[pack][0], ref, atol=ATOL, rtol=0)
