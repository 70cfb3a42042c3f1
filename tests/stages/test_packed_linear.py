"""stages/packed_linear.py: packed weights multiply like F.linear, one copy of each weight is kept, and a stage
with packed weights gives transformers' logits (the oracle) as the plain stage does."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from stages import packed_linear, packed_rows
from stages.checkpoint import load_checkpoint
from stages.model import StageModel
from stages.packed_linear import PackedEmbedding, PackedLinear, available, pack_layer
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


@pytest.mark.parametrize("min_rows", packed_linear.TUNE_ROWS)
def test_fewer_rows_than_min_rows_give_the_values_of_a_min_rows_product(monkeypatch, min_rows):
    """Rule 5: a product of fewer rows than MIN_ROWS is a MIN_ROWS-row product cut back, so a lone decode row gets
    the values it gets in a step of 4 (oneDNN's own 1-row kernel sums a 3072-long row in another order), with
    either count rule 6 may choose."""
    monkeypatch.setattr(packed_linear, "MIN_ROWS", min_rows)
    monkeypatch.setattr(packed_rows, "MAX_ROWS", 0)  # rule 7 off: these rows go to oneDNN
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(768, 3072, generator=g), torch.randn(768, generator=g)
    x = torch.randn(4, 3072, generator=g)
    p = PackedLinear(w)
    full = linear(x, p, b)
    for rows in (1, 2, 3):
        assert torch.equal(linear(x[:rows], p, b), full[:rows]), rows


def test_the_padding_buffer_is_reused_and_its_extra_rows_are_zeros(monkeypatch):
    """Rule 5: the padded input is one buffer per thread, width and row count; a call of fewer rows than the last
    zeroes the rows the last one wrote, and the buffer serves calls inside inference mode and outside it."""
    monkeypatch.setattr(packed_linear, "MIN_ROWS", 4)
    monkeypatch.setattr(packed_rows, "MAX_ROWS", 0)  # rule 7 off: these rows go to oneDNN
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 80, generator=g)
    p = PackedLinear(w)
    x = torch.randn(3, 80, generator=g)
    with torch.inference_mode():
        got3 = linear(x, p)
    key = (80, torch.float32, 4)
    buf = packed_linear._pads.bufs[key][0]
    got1 = linear(x[2:], p)  # outside inference mode, fewer rows than the last call
    assert packed_linear._pads.bufs[key][0] is buf
    assert torch.equal(buf[0], x[2]) and not buf[1:].any()
    want = F.linear(x.double(), w.double())
    torch.testing.assert_close(got3.double(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got1.double(), want[2:], rtol=1e-5, atol=1e-4)
    monkeypatch.setattr(packed_linear, "MIN_ROWS", 2)  # a buffer of its own for another count
    torch.testing.assert_close(linear(x[:1], p).double(), want[:1], rtol=1e-5, atol=1e-4)
    assert packed_linear._pads.bufs[(80, torch.float32, 2)][0].shape == (2, 80)


def test_the_padding_row_count_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("STRATA_PACKED_MIN_ROWS", "0")
    assert packed_linear._min_rows() == 0
    monkeypatch.delenv("STRATA_PACKED_MIN_ROWS")
    assert packed_linear._min_rows() is None  # rule 6: tune decides
    monkeypatch.setenv("STRATA_PACKED_MIN_ROWS", "four")
    with pytest.raises(ValueError, match="STRATA_PACKED_MIN_ROWS must be a whole number"):
        packed_linear._min_rows()


class Timed:
    """A stand-in weight for `tune`: a product costs `slow_s` when padded to `slow_rows`, nothing otherwise."""

    def __init__(self, nbytes: int, slow_rows: int, slow_s: float = 0.003) -> None:
        self.nbytes, self.shape, self.dtype, self.panels = nbytes, (8, 16), torch.float32, None
        self.slow_rows, self.slow_s, self.calls = slow_rows, slow_s, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if packed_linear.MIN_ROWS == self.slow_rows:
            time.sleep(self.slow_s)
        return x


@pytest.fixture
def untuned(monkeypatch):
    monkeypatch.delenv("STRATA_PACKED_MIN_ROWS", raising=False)
    monkeypatch.setattr(packed_linear, "MIN_ROWS", packed_linear.MIN_ROWS)  # put back after the test
    monkeypatch.setattr(packed_linear, "_tuned", None)


@pytest.mark.parametrize("slow, chosen", [(4, 2), (2, 4)])
def test_tune_keeps_the_row_count_that_multiplies_one_row_sooner(untuned, slow, chosen):
    """Rule 6: the count whose padded 1-row products took less time, timed over the weights in order up to
    TUNE_BYTES; once per process (a second call changes nothing, whatever it is given)."""
    half = packed_linear.TUNE_BYTES // 2
    weights = [Timed(half, slow) for _ in range(4)]
    got = packed_linear.tune(weights, rounds=3)
    assert got["min_rows"] == chosen == packed_linear.MIN_ROWS and got["source"] == "timed"
    assert got["bytes"] == packed_linear.TUNE_BYTES and got["ms"][slow] > got["ms"][chosen]
    assert [w.calls for w in weights] == [6, 6, 0, 0]  # two candidates x 3 rounds, the first TUNE_BYTES only
    assert packed_linear.tune([Timed(half, chosen)], rounds=3) is got and packed_linear.MIN_ROWS == chosen


def test_tune_leaves_the_count_to_the_environment(untuned, monkeypatch):
    monkeypatch.setenv("STRATA_PACKED_MIN_ROWS", "0")
    w = Timed(1024, 4)
    assert packed_linear.tune([w]) == {"min_rows": 0, "source": "environment"}
    assert packed_linear.MIN_ROWS == 0 and w.calls == 0


@pytest.mark.parametrize("panels", [True, False])
def test_a_cpu_stage_tunes_its_row_count_at_load(tmp_path, untuned, monkeypatch, panels):
    """Rule 6 runs once the stage's weights are packed, over them (the runner's load); with every weight read by
    stages/packed_rows.py (rule 7) there is nothing to pad, and nothing is timed."""
    if panels and not packed_rows.available():
        pytest.skip(f"no packed-rows kernel here: {packed_rows.unavailable_reason()}")
    if not panels:
        monkeypatch.setattr(packed_rows, "panels", lambda packed, weight: None)
    from pool.config import config_from_dict
    from stages.runner import StageRunner

    model = make_tiny_model(tmp_path / "m", arch="qwen3", layers=2, hidden=64, heads=4, kv_heads=2)
    cfg = config_from_dict({"model": str(model), "engine": {"max_context": 64, "parallel": 2, "chunk_cells": 16,
                                                             "kv_pool_tokens": 64, "threads": 1, "prefill_chunk": 64},
                            "stages": [{"device": "cpu", "layers": [0, 2], "endpoint": "ipc:///tmp/x"}]})
    runner = StageRunner(cfg, 0, pool_path=tmp_path / "pool")
    try:
        tuned = packed_linear._tuned
        if panels:
            assert all(w.panels is not None for w in runner.model.packed_weights())
            assert tuned == {"min_rows": packed_linear.MIN_ROWS, "source": "packed rows",
                             "max_rows": packed_rows.MAX_ROWS}
            return
        assert tuned is not None and tuned["source"] == "timed" and tuned["min_rows"] in packed_linear.TUNE_ROWS
        assert tuned["bytes"] == sum(w.nbytes for w in runner.model.packed_weights()) > 0
        assert packed_linear.MIN_ROWS == tuned["min_rows"]
    finally:
        runner.close()


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
    # the tied table of a one-stage model is one copy, read by the embedding and the head (rule 9)
    assert ckpt.tie_word_embeddings
    if isinstance(packed.lm_head, PackedLinear):
        assert isinstance(packed.embed, PackedEmbedding) and packed.embed.head is packed.lm_head
    else:  # packed_rows cannot read the panels here: one plain tensor for both
        assert packed.lm_head is packed.embed


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


@pytest.mark.parametrize("rows", [1, 3, 16, 128])
def test_a_dense_weight_used_once_is_multiplied_like_f_linear(rows):
    """Rule 10: a plain float32 weight's product through oneDNN agrees with F.linear to float32 rounding; fewer than
    MIN_ROWS rows and other dtypes are F.linear's own, bit for bit."""
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(96, 64, generator=g), torch.randn(rows, 64, generator=g)
    got = packed_linear.dense(x, w)
    if rows < packed_linear.MIN_ROWS or not available(torch.float32):
        assert torch.equal(got, F.linear(x, w))
    else:
        torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.double(), F.linear(x.double(), w.double()), rtol=1e-4, atol=1e-4)
    assert torch.equal(packed_linear.dense(x.bfloat16(), w.bfloat16()), F.linear(x.bfloat16(), w.bfloat16()))
