"""Two int4 planes held as bytes (stages/byte_rows.py, csrc/cpu_byte_rows.c).

Oracles: `gguf.quants.dequantize` of the same blocks and F.linear over it in float64; the kernel's own rule that a
row's values do not depend on the other rows of a call; and the first-use check, which must refuse a wrong source.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pool.gguf_meta import ZERO_POINTS, kept_bytes
from stages import byte_rows
from stages.byte_rows import MAX_ROWS, ByteLinear
from stages.quant_linear import Planes, QuantLinear, pack, planes_from_gguf
from tests.stages.harness import gguf_blocks, use_wrong_source

gguf = pytest.importorskip("gguf")
needs_kernel = pytest.mark.skipif(not byte_rows.available(), reason=f"no byte-rows kernel here: "
                                  f"{byte_rows.unavailable_reason()}")
N, K = 100, 512  # 100 rows: the threads' shares are not equal
TWO_PLANES = ["Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K"]  # Q6_K: groups of 16
ONE_PLANE = ["Q4_0", "Q4_1", "Q4_K"]


@pytest.fixture
def fresh_library(monkeypatch):
    byte_rows._library.cache_clear()
    byte_rows._int4pack_ok.cache_clear()
    yield monkeypatch
    byte_rows._library.cache_clear()
    byte_rows._int4pack_ok.cache_clear()


def blocks(kind: str, seed: int = 0) -> np.ndarray:
    """Raw blocks of a [N, K] tensor (tests/stages/harness.py gguf_blocks)."""
    return gguf_blocks(kind, N, K, seed)


def weights(kind: str, seed: int = 0):
    raw = blocks(kind, seed)
    w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])).reshape(N, K)
    return planes_from_gguf(kind, raw, (N, K)), w


@needs_kernel
@pytest.mark.parametrize("kind", TWO_PLANES)
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS, MAX_ROWS + 1, 40])
def test_products_match_the_dequantized_weights(kind: str, rows: int) -> None:
    """Rules 1-3: packed as bytes; the kernel (up to MAX_ROWS rows) and dequantize + GEMM (more) both multiply
    gguf's own dequantized weight: float32 to float32 rounding, bfloat16 within one rounding of the output."""
    planes, w = weights(kind)
    assert byte_rows.takes(planes, torch.bfloat16) and byte_rows.takes(planes, torch.float32)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(N)
    want = F.linear(x.double(), w.double(), bias.double())
    q32 = pack(planes, torch.float32, "cpu")
    # a byte per value, a float32 scale per group and (rule 8) an offset where the format's is not -zero * scale
    assert isinstance(q32, ByteLinear) and (q32.offset is None) == (kind in ZERO_POINTS)
    assert q32.nbytes == N * K + (4 if kind in ZERO_POINTS else 8) * N * K // planes.group
    assert q32.nbytes == kept_bytes(kind, (N, K), 4, cpu=True)
    got = q32(x, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, N)
    torch.testing.assert_close(got.double(), want, atol=2e-6 * want.abs().max().item(), rtol=1e-5)  # float32 rounding
    # of outputs up to ~900 (the k-quants' random scales); a wrong weight misses by whole units
    qb = pack(planes, torch.bfloat16, "cpu")
    xb = x.bfloat16()
    ref = F.linear(xb.double(), w.double())
    got = qb(xb)
    assert got.dtype == torch.bfloat16
    tol = 2e-2 if rows > MAX_ROWS else 8e-3  # the GEMM also rounds the weight to bfloat16
    assert (got.double() - ref).abs().max() <= tol * ref.abs().max()


@needs_kernel
@pytest.mark.parametrize("int8", [True, False])
def test_a_product_of_no_rows_is_empty(int8: bool) -> None:
    """0 rows (the head of a step whose pieces sample nothing) give a [0, N] float32 product, not the kernel's
    refusal."""
    planes, _ = weights("Q6_K")
    q = pack(planes, torch.float32, "cpu")
    q.int8_activations = int8
    got = q(torch.empty(0, K))
    assert got.shape == (0, N) and got.dtype == torch.float32


@needs_kernel
@pytest.mark.parametrize("kind", TWO_PLANES + ONE_PLANE)
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
def test_int8_activations_are_the_product_of_the_quantized_rows(kind: str, rows: int) -> None:
    """Rule 7: with 8-bit rows the kernel gives the exact product of the quantized rows (reference_q8, float64) to
    float32 rounding, a block of zeros and a value far over the others included; that is not the float product, but
    within the rows' quantization error of it."""
    planes, w = weights(kind)
    q = pack(planes, torch.float32, "cpu")
    q.int8_activations = True
    assert q.int8_activations
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    x[:, 64:96] = 0  # d = 0: the block adds nothing
    x[0, 200] = 1e3  # its block's other values round to 0 or +-1
    bias = torch.randn(N)
    got = q(x, bias).double()
    values = byte_rows.unpack(q.q, q.bits, K)
    want = byte_rows.reference_q8(x, values, q.scale, q.offsets, q.group, bias)
    torch.testing.assert_close(got, want, atol=4e-6 * want.abs().max().item(), rtol=1e-5)
    exact = F.linear(x.double(), w.double(), bias.double())
    err = ((got - exact).abs().max() / exact.abs().max()).item()
    assert 0 < err < 0.02, err
    a, d = byte_rows.quantize_q8(x)
    assert torch.equal(d[:, 2], torch.zeros(rows)) and a.abs().max() == 127 and torch.equal(a, a.round())


@needs_kernel
def test_int8_activations_in_bfloat16_and_the_forms_they_take() -> None:
    """Rule 7 in bfloat16 (bytes: the float kernel's form there), one rounding of the quantized rows' product; nibble
    pairs whose K is not a multiple of 64 keep float rows."""
    planes, _ = weights("Q8_0")
    q = pack(planes, torch.bfloat16, "cpu")
    q.int8_activations = True
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(5)).bfloat16()
    want = byte_rows.reference_q8(x.float(), byte_rows.unpack(q.q, 8, K), q.scale, q.offsets, q.group)
    got = q(x)
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max() <= 8e-3 * want.abs().max()
    v = torch.randint(0, 16, (8, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    odd = ByteLinear(Planes([v], [torch.rand(8, 3)], torch.rand(8, 3)), torch.float32)
    odd.int8_activations = True
    assert odd.bits == 4 and not odd.int8_activations


@needs_kernel
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_values_do_not_depend_on_the_other_rows(dtype, int8: bool) -> None:
    """Rules 2 and 7: the same row alone and among up to MAX_ROWS others gives the same bits (a decode step's row
    does not change with the requests beside it)."""
    planes, _ = weights("Q8_0")
    q = pack(planes, dtype, "cpu")
    q.int8_activations = int8
    x = torch.randn(MAX_ROWS, K, generator=torch.Generator().manual_seed(3)).to(dtype)
    alone = torch.cat([q(x[i:i + 1]) for i in range(MAX_ROWS)])
    for rows in range(2, MAX_ROWS + 1):
        assert torch.equal(q(x[:rows]), alone[:rows]), rows


@needs_kernel
@pytest.mark.parametrize("kind", ONE_PLANE)
@pytest.mark.parametrize("rows", [1, 5, MAX_ROWS + 1])
def test_one_plane_in_float32_is_held_as_nibble_pairs(kind: str, rows: int) -> None:
    """Rule 1: one plane in float32 is two values per byte (0.75 bytes per value, as the plane took in float32; Q4_0
    0.625, rule 8), read back as gguf's values exactly and multiplied to float32 rounding by the kernel and by
    dequantize + GEMM; in bfloat16 it keeps torch's int4 kernel."""
    planes, w = weights(kind)
    assert byte_rows.takes(planes, torch.float32) and not byte_rows.takes(planes, torch.bfloat16)
    assert isinstance(pack(planes, torch.bfloat16, "cpu"), QuantLinear)
    q = pack(planes, torch.float32, "cpu")
    assert isinstance(q, ByteLinear) and q.bits == 4 and q.nbytes == N * K * (5 if kind == "Q4_0" else 6) // 8
    assert q.nbytes == kept_bytes(kind, (N, K), 4, cpu=True)
    assert torch.equal(q.dequantize(), w)  # s * v + b of float32 scales: gguf's own float32 values
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(N)
    want = F.linear(x.double(), w.double(), bias.double())
    torch.testing.assert_close(q(x, bias).double(), want, atol=2e-6 * want.abs().max().item(), rtol=1e-5)


@needs_kernel
def test_the_dequantized_weight_is_one_rounding_of_the_exact_one() -> None:
    """Rule 3: a prefill piece's weight, s * q + b rounded once to float32, and from there to bfloat16 to nearest
    even (the values of torch's own conversion), for bytes and nibble pairs."""
    for kind in ("Q8_0", "Q5_K", "Q4_K", "Q6_K"):
        planes, _ = weights(kind)
        exact = planes.scales[0].double().repeat_interleave(planes.group, 1) * byte_rows.unpack(
            ByteLinear(planes, torch.float32).q, 8 if len(planes.values) == 2 else 4, K).double()
        exact = exact + planes.offset.double().repeat_interleave(planes.group, 1)
        assert torch.equal(ByteLinear(planes, torch.float32).dequantize(), exact.float()), kind
        assert torch.equal(ByteLinear(planes, torch.bfloat16).dequantize(), exact.float().bfloat16()), kind


@needs_kernel
def test_rows_are_read_in_place_and_an_id_outside_the_table_is_refused() -> None:
    """An embedding's lookup (`ByteLinear.rows`): the rows of `dequantize`, in any order and repeated, for bytes and
    nibble pairs in float32 and bfloat16; an id outside the table raises IndexError."""
    for kind in ("Q8_0", "Q4_K", "Q6_K"):
        planes, _ = weights(kind)
        for dtype in (torch.float32, torch.bfloat16):
            w = ByteLinear(planes, dtype)
            ids = torch.tensor([3, 0, w.shape[0] - 1, 3])
            assert torch.equal(w.rows(ids), w.dequantize()[ids]), (kind, dtype)
            for bad in (w.shape[0], -1):
                with pytest.raises(IndexError):
                    w.rows(torch.tensor([0, bad]))


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_K", "Q4_0", "Q8_0"])
def test_torch_packed_planes_are_dequantized_as_torch_does(monkeypatch, kind: str) -> None:
    """Rule 6: a QuantLinear's weight dequantized by the library (transposed) is torch's code's, bit for bit, for one
    plane and two, 100 rows (a partial 64-row block)."""
    planes, _ = weights(kind)
    for dtype in (torch.bfloat16, torch.float32):
        q = QuantLinear(planes, dtype, "cpu")
        assert byte_rows._int4pack_ok()
        ours = q.dequantize()
        monkeypatch.setattr(byte_rows, "_int4pack_ok", lambda: False)
        assert torch.equal(ours, q.dequantize()), dtype
        monkeypatch.undo()


def test_a_wrong_int4pack_dequantize_leaves_it_to_torch(fresh_library, tmp_path) -> None:
    """Rule 6's check refuses a wrong source without refusing the byte-rows kernel."""
    use_wrong_source(byte_rows, ("base[i] = e[1] - 8.0f * e[0];", "base[i] = e[1] - 7.0f * e[0];"), tmp_path,
                     fresh_library)
    if not byte_rows.available():
        pytest.skip(f"no byte-rows kernel here: {byte_rows.unavailable_reason()}")
    assert not byte_rows._int4pack_ok()
    planes, w = weights("Q4_0")
    q = QuantLinear(planes, torch.float32, "cpu")
    assert byte_rows.int4pack_transposed(q.packed, q.scales_zeros, q.rows, N, K, 32, torch.float32) is None
    torch.testing.assert_close(q.dequantize(), w)


def test_the_switch_keeps_the_int4_planes(fresh_library) -> None:
    """Rule 5: STRATA_BYTE_ROWS=0 leaves two planes to stages/quant_linear.py."""
    fresh_library.setenv("STRATA_BYTE_ROWS", "0")
    planes, _ = weights("Q8_0")
    assert not byte_rows.available() and byte_rows.unavailable_reason() == "STRATA_BYTE_ROWS=0"
    assert isinstance(pack(planes, torch.bfloat16, "cpu"), QuantLinear)


def test_other_forms_keep_the_int4_planes() -> None:
    """Rule 1: two planes whose high scale is not 16 times the low one stay QuantLinear."""
    two, _ = weights("Q8_0")
    two.scales[1] = two.scales[1] * 1.5
    assert not byte_rows.takes(two, torch.float32) and isinstance(pack(two, torch.float32, "cpu"), QuantLinear)


@needs_kernel
def test_the_kernel_refuses_what_it_cannot_compute() -> None:
    """Arguments out of its range are an error, not a read past the arrays: rows 0 (which `_multiply` answers with
    an empty product without calling it) or over MAX_ROWS, a group that is not a multiple of 32."""
    planes, _ = weights("Q8_0")
    q = ByteLinear(planes, torch.float32)
    fns = byte_rows._library()[0]
    for x, group in ((torch.randn(MAX_ROWS + 1, K), 32), (torch.randn(1, K), 48)):
        with pytest.raises(ValueError, match="refused"):
            byte_rows._multiply(fns, x, q.q, 8, q.scale, q.offsets, group, None)
    x, out = torch.randn(1, K), torch.empty(1, N)
    for name in ("strata_byte_rows", "strata_byte_rows_q8"):
        assert fns[name](x.data_ptr(), 0, K, q.q.data_ptr(), 8, q.scale.data_ptr(), q.offsets.data_ptr(), 0.0, N, 32,
                         None, out.data_ptr(), 1) != 0


ISA = byte_rows._library()[0]["strata_byte_rows_isa"]() if byte_rows.available() else 0  # csrc/cpu_isa.h


@pytest.mark.parametrize("edit", [  # (the AVX-512 source's edit, the AVX2 one's)
    (("off[m] = fmaf(OFFSET(bn, sn, zero, h), sums[m * groups + h], off[m]);", "off[m] += 0.0f;"),) * 2,  # the
    # offsets forgotten
    (("_mm512_set1_ps(sn[g])", "_mm512_set1_ps(sn[0])"),  # every group scaled by the first one's scale
     ("_mm256_set1_ps(sn[g])", "_mm256_set1_ps(sn[0])")),
    (("_mm512_srli_epi32(b, 4)", "_mm512_srli_epi32(b, 3)"),  # the high nibbles misread
     ("_mm256_srli_epi32(lo, 4)", "_mm256_srli_epi32(lo, 3)")),
    (("_mm512_set1_epi32(0x7FFF), odd", "_mm512_set1_epi32(0x8000), odd"),  # bfloat16 rounded off by one: up from
     ("HALF_BF16 _mm256_set1_epi32(0x7FFF)", "HALF_BF16 _mm256_set1_epi32(0x8000)")),  # just under halfway, odd word
    (("_mm512_reduce_add_ps(acc[m]) + off[m]", "_mm512_reduce_add_ps(acc[0]) + off[m]"),
     ("strata_reduce16(lo[m], hi[m]) + off[m]", "strata_reduce16(lo[0], hi[0]) + off[m]")),
    (("ones16 = _mm256_set1_epi16(1)", "ones16 = _mm256_set1_epi16(2)"),) * 2,  # 8-bit rows: every product doubled
    (("_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC", "_MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC"),) * 2,  # 8-bit
    # rows rounded toward zero
    (("setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)", "setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)"),) * 2,  # 8-bit rows out of order
    (("if ((in += 16) == group) g++", "if ((in += 32) >= group) g++"),) * 2,  # bytes: each half block a group
    (("{0, 0, 0, 0, 1, 1, 1, 1}, {2", "{0, 0, 0, 0, 0, 0, 0, 0}, {2"),) * 2,  # a pair of nibble blocks, one scale
    (("_mm256_set1_ps(128.0f)", "_mm256_set1_ps(127.0f)"),) * 2,  # bytes' offsets, 8 groups a step
    # groups of 16 (Q6_K): a block's last 16 values scaled by its first 16's scale, in each of the three functions;
    # the 8-bit rows' sum of a block's last 16 values taken from its first 16
    (("w1 = _mm512_mul_ps(w1, sb)", "w1 = _mm512_mul_ps(w1, sa)"), ("v < 2 ? sa : sb", "sa")),
    (("sn[gh[2 * blk + 1]]", "sn[gh[2 * blk]]"),) * 2,
    (("_mm512_set1_ps(sh), v1", "_mm512_set1_ps(sg), v1"), ("j < 2 ? sg : sh", "sg")),
    (("2 * blk + 1] = d * (float)sum[1]", "2 * blk + 1] = d * (float)sum[0]"),) * 2,
    # rule 8: offsets made from the scales with the wrong sign, 8 at a time in the 8-bit rows' sum; a zero point's
    # offsets left out where they do not cancel
    (("-(zero) * (sn)[g]", "(zero) * (sn)[g]"),) * 2,
    (("_mm256_set1_ps(-zero)", "_mm256_set1_ps(zero)"),) * 2,
    (("zero == 128.0f", "zero == 32.0f"),) * 2,
], ids=["offsets", "scales", "nibbles", "bfloat16", "rows", "int8-pairs", "int8-round", "int8-order", "int8-halves",
        "int8-pick",
        "int8-offsets", "sixteen", "sixteen-int8", "sixteen-dequant", "sixteen-int8-offsets", "zero", "zero-int8",
        "zero-skipped"])
def test_a_library_that_computes_wrong_is_not_used(fresh_library, tmp_path, edit) -> None:
    """Rule 5: the first-use check against float64 F.linear and torch's dequantized weight; a source wrong in one
    place fails it, and the planes keep stages/quant_linear.py's packing."""
    if not ISA:
        pytest.skip(f"no byte-rows kernel here: {byte_rows.unavailable_reason()}")
    use_wrong_source(byte_rows, edit[ISA == 256], tmp_path, fresh_library)
    assert not byte_rows.available()
    assert "disagrees with" in byte_rows.unavailable_reason()
    planes, _ = weights("Q8_0")
    assert isinstance(pack(planes, torch.float32, "cpu"), QuantLinear)
