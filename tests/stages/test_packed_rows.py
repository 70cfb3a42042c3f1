"""stages/packed_rows.py: few rows multiplied straight from oneDNN's packed memory give F.linear's values (rules
1-3), only where the memory has the checked layout, only up to MAX_ROWS rows, and the stage that uses it still
gives transformers' logits (the oracle tests of test_packed_linear and test_model_vs_transformers run it)."""
from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from stages import packed_linear, packed_rows
from stages.checkpoint import load_checkpoint
from stages.model import StageModel
from stages.packed_linear import PackedLinear
from stages.quant_linear import embed, linear
from stages.tiny import make_tiny_model

AVX2 = frozenset({"avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
needs_kernel = pytest.mark.skipif(not packed_rows.available(),
                                  reason=f"no packed-rows kernel here: {packed_rows.unavailable_reason()}")


@needs_kernel
@pytest.mark.parametrize("shape", [(200, 96), (64, 64), (1280, 770), (768, 3072)])
def test_few_rows_from_the_packed_memory_are_f_linear(shape):
    """Rules 1-2: N and K that are not whole panels too, with and without a bias, 1 to MAX_ROWS rows."""
    g = torch.Generator().manual_seed(shape[0])
    w, b = torch.randn(*shape, generator=g) / shape[1] ** 0.5, torch.randn(shape[0], generator=g)
    p = PackedLinear(w)
    assert p.panels is not None and (p.panels.n, p.panels.k) == shape
    for rows in range(1, packed_rows.MAX_ROWS + 1):
        x = torch.randn(rows, shape[1], generator=g)
        want = F.linear(x.double(), w.double(), b.double())
        with torch.inference_mode():
            for bias in (b, None):
                got = linear(x, p, bias)
                ref = want if bias is not None else want - b.double()
                assert got.shape == (rows, shape[0]) and got.dtype == torch.float32
                torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_a_row_has_the_same_values_whatever_the_other_rows_of_its_step():
    """Rule 3: one sum per output in k order, so row 0 of a step of 1 to MAX_ROWS rows is the same bits."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(640, 3072, generator=g)
    p = PackedLinear(w)
    x = torch.randn(packed_rows.MAX_ROWS, 3072, generator=g)
    with torch.inference_mode():
        alone = linear(x[:1], p)
        for rows in range(2, packed_rows.MAX_ROWS + 1):
            step = linear(x[:rows], p)
            assert torch.equal(step[:1], alone), rows
            assert torch.equal(step[rows - 1:rows], linear(x[rows - 1:rows], p)), rows


@needs_kernel
def test_more_rows_than_max_rows_go_to_onednn(monkeypatch):
    """Rule 2: a prefill piece is oneDNN's product; a decode step is the kernel's."""
    calls = []
    real = packed_rows.multiply
    monkeypatch.setattr(packed_rows, "multiply", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))
    g = torch.Generator().manual_seed(2)
    w = torch.randn(128, 64, generator=g)
    p = PackedLinear(w)
    for rows in (1, packed_rows.MAX_ROWS, packed_rows.MAX_ROWS + 1, 300):
        x = torch.randn(rows, 64, generator=g)
        torch.testing.assert_close(linear(x, p).double(), F.linear(x.double(), w.double()), rtol=1e-5, atol=1e-4)
    assert calls == [1, packed_rows.MAX_ROWS]


@needs_kernel
def test_memory_that_is_not_the_weight_in_panels_is_not_read():
    """Rule 1: the whole packed memory is compared with the plain weight; one value off, a wrong shape or a
    bfloat16 weight leaves the weight to oneDNN."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(100, 80, generator=g)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, packed_linear.PACK_ROWS)
    assert packed_rows.panels(packed, w) is not None
    other = w.clone()
    other[99, 79] += 1.0  # the last value of the last, partial panel
    assert packed_rows.panels(packed, other) is None
    other = w.clone()
    other[0, 0] += 1.0
    assert packed_rows.panels(packed, other) is None
    assert packed_rows.panels(packed, w[:, :64].contiguous()) is None  # another size than the memory's
    assert packed_rows.panels(packed, w.bfloat16()) is None
    assert packed_rows.panels(w, w) is None  # a plain tensor is not oneDNN's memory
    if not packed_linear.available(torch.bfloat16):  # oneDNN packs no bfloat16 weight on this CPU
        assert not packed_rows.bf16_available()
        return
    bf = PackedLinear(w.bfloat16())
    assert (bf.panels is not None) == packed_rows.bf16_available()  # rule 7: its own layout, checked the same way
    if bf.panels is not None:
        other = w.bfloat16()
        other[99, 79] += 1.0
        assert packed_rows.panels(bf.packed, other) is None
        assert packed_rows.panels(bf.packed, w.bfloat16()[:, :79].contiguous()) is None


needs_bf16 = pytest.mark.skipif(not packed_rows.bf16_available(),
                                reason=f"no bfloat16 packed rows here: {packed_rows._bf16()}")


@needs_bf16
@pytest.mark.parametrize("shape", [(200, 96), (64, 64), (1280, 771), (768, 3072)])
def test_bfloat16_rows_from_the_packed_memory_are_f_linear_to_its_rounding(shape):
    """Rule 7: odd K (the last pair closed by the padding's zero), N not whole panels, bias or none, 1 to MAX_ROWS
    rows; each output within bfloat16's rounding of the exact product of the bfloat16 inputs."""
    g = torch.Generator().manual_seed(shape[1])
    w = (torch.randn(*shape, generator=g) / shape[1] ** 0.5).bfloat16()
    b = torch.randn(shape[0], generator=g).bfloat16()
    p = PackedLinear(w)
    assert p.panels is not None and p.panels.dtype == torch.bfloat16 and p.panels.kp % 32 == 0
    for rows in range(1, packed_rows.MAX_ROWS + 1):
        x = torch.randn(rows, shape[1], generator=g).bfloat16()
        for bias in (b, None):
            with torch.inference_mode():
                got = linear(x, p, bias)
            want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            assert got.shape == (rows, shape[0]) and got.dtype == torch.bfloat16
            torch.testing.assert_close(got.double(), want, rtol=2 ** -7, atol=1e-3)


@needs_bf16
def test_a_bfloat16_row_has_the_same_values_whatever_the_other_rows_of_its_step():
    g = torch.Generator().manual_seed(6)
    p = PackedLinear(torch.randn(640, 3071, generator=g).bfloat16())
    x = torch.randn(packed_rows.MAX_ROWS, 3071, generator=g).bfloat16()
    with torch.inference_mode():
        alone = linear(x[:1], p)
        for rows in range(2, packed_rows.MAX_ROWS + 1):
            assert torch.equal(linear(x[:rows], p)[:1], alone), rows


@needs_bf16
def test_bfloat16_rows_read_back_from_the_panels_are_the_weight_rows():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(200, 71, generator=g).bfloat16()
    p = PackedLinear(w).panels
    ids = torch.tensor([0, 199, 63, 64, 128, 191, 192, 5, 5])
    assert torch.equal(packed_rows.rows(p, ids), w[ids])
    assert torch.equal(packed_rows.rows(p, torch.arange(200)), w)


@needs_kernel
def test_every_float_weight_of_a_cpu_stage_is_read_from_its_panels(tmp_path):
    """Rule 1 at packing: oneDNN lays out each weight a step multiplies (the lm_head too) as the kernel reads."""
    ckpt = load_checkpoint(make_tiny_model(tmp_path / "m", arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2))
    model = StageModel(ckpt, 0, 2)
    weights = model.packed_weights()
    assert weights and all(w.panels is not None for w in weights)


@needs_kernel
def test_rows_read_back_from_the_panels_are_the_weight_rows():
    """Rule 6: any row, in the last (partial) panel too, in any order and repeated, bit for bit."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 72, generator=g)  # 200 = 3 whole panels and 8 rows of a fourth; K padded 72 -> 80
    p = PackedLinear(w).panels
    ids = torch.tensor([0, 199, 63, 64, 128, 191, 192, 5, 5, 199])
    assert torch.equal(packed_rows.rows(p, ids), w[ids])
    assert torch.equal(packed_rows.rows(p, torch.arange(200)), w)
    assert packed_rows.rows(p, torch.tensor([[7, 8], [9, 10]])).shape == (4, 72)


@needs_kernel
@pytest.mark.parametrize("arch,dtype", [("qwen3", torch.float32), ("qwen2", torch.float32),
                                        ("qwen3", torch.bfloat16)])
def test_a_tied_table_is_packed_once_and_the_embedding_reads_it(tmp_path, arch, dtype):
    """stages/packed_linear.py rule 9: one stage with both ends of a tied model holds the table once, packed; the
    embedding reads the plain table's rows from it, the head multiplies at packed_rows' pace, and the stage gives
    the logits of the same stage unpacked."""
    ckpt = load_checkpoint(make_tiny_model(tmp_path / arch, arch=arch, layers=2, hidden=64, heads=4, kv_heads=2,
                                           vocab=None))
    assert ckpt.tie_word_embeddings
    if dtype == torch.bfloat16 and not packed_rows.bf16_available():
        pytest.skip(f"no bfloat16 packed rows here: {packed_rows._bf16()}")
    plain = StageModel(ckpt, 0, 2, dtype=dtype, pack_weights=False)
    packed = StageModel(ckpt, 0, 2, dtype=dtype)
    assert isinstance(packed.lm_head, PackedLinear) and packed.lm_head.panels is not None
    assert isinstance(packed.embed, packed_linear.PackedEmbedding) and packed.embed.head is packed.lm_head
    assert packed.lm_head in packed.packed_weights()
    assert packed.weight_bytes() == plain.weight_bytes()  # counted once, as the plain stage holds it
    ids = torch.arange(plain.vocab_size)
    assert torch.equal(embed(ids, packed.embed), plain.embed[ids])
    from stages.batch import StepBatch
    from stages.kv_cache import KVCache
    pools = [KVCache(2, 8, 16, 2, 16, dtype, "cpu", n_slots=1, table_chunks=8) for _ in range(2)]
    for kv in pools:
        kv.set_table(0, list(range(8)))
    prompt = torch.tensor([3, 9, 27, 81, 243, 100, 7])
    for slots, ids in (([[0, 0, 7, 1]], prompt), ([[0, 7, 1, 1]], torch.tensor([11]))):
        got = packed.forward(StepBatch.from_slots(slots), pools[0], ids)
        want = plain.forward(StepBatch.from_slots(slots), pools[1], ids)
        tol = 1e-4 if dtype == torch.float32 else 5e-2  # bfloat16: the products' roundings differ
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_the_row_count_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("STRATA_PACKED_ROWS", "0")
    assert packed_rows._max_rows() == 0
    monkeypatch.setenv("STRATA_PACKED_ROWS", "12")
    assert packed_rows._max_rows() == 12
    monkeypatch.delenv("STRATA_PACKED_ROWS")
    for flags, rows in ((AVX512, packed_rows.DEFAULT_ROWS), (AVX2, packed_rows.AVX2_DEFAULT_ROWS)):  # rule 2
        monkeypatch.setattr(packed_rows, "cpu_flags", lambda: flags)
        assert packed_rows._max_rows() == rows
    for bad in ("eight", "65", "-1"):
        monkeypatch.setenv("STRATA_PACKED_ROWS", bad)
        with pytest.raises(ValueError, match="STRATA_PACKED_ROWS must be a whole number"):
            packed_rows._max_rows()


@pytest.mark.parametrize("env", [{"STRATA_CPU_KERNELS": "0"}, {"STRATA_PACKED_ROWS": "0"}])
def test_turned_off_every_row_goes_to_onednn(monkeypatch, env):
    """Rule 5: either switch leaves the library unloaded and every weight without panels."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(packed_rows, "MAX_ROWS", packed_rows._max_rows())
    packed_rows._library.cache_clear()
    try:
        assert not packed_rows.available() and packed_rows.unavailable_reason() == next(
            f"{k}={v}" for k, v in env.items())
        w = torch.randn(64, 32)
        p = PackedLinear(w)
        assert p.panels is None
        x = torch.randn(1, 32)
        torch.testing.assert_close(linear(x, p).double(), F.linear(x.double(), w.double()), rtol=1e-5, atol=1e-4)
    finally:
        packed_rows._library.cache_clear()


def test_a_kernel_that_disagrees_with_f_linear_is_refused(monkeypatch):
    """Rule 5: the first-use check runs the kernel; one that sums wrong leaves it unavailable, with the reason."""
    if not packed_rows.available():
        pytest.skip(f"no packed-rows kernel here: {packed_rows.unavailable_reason()}")
    fns = dict(packed_rows._library()[0])
    good = fns["strata_packed_rows"]

    def off_by_one(x, rows, k, address, n, kp, bias, out, threads):
        rc = good(x, rows, k, address, n, kp, bias, out, threads)
        torch.frombuffer((ctypes.c_float * 1).from_address(out), dtype=torch.float32)[0] += 1.0
        return rc

    fns["strata_packed_rows"] = off_by_one
    with pytest.raises(packed_rows.KernelRefused, match="disagrees with F.linear"):
        packed_rows._self_check(fns)
