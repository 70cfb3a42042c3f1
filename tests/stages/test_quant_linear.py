"""Kept-quantized weights (stages/quant_linear.py) against the gguf package's own dequantization.

Oracles: `gguf.quants.dequantize` of the same blocks (the planes must be exactly it), and F.linear on those
dequantized weights (float32: to float32 rounding on both CPU paths; bfloat16: within the bfloat16 rounding of
activations and scales, far below the format's 4-bit step). Both CPU paths run: the int4 kernel (at most
KERNEL_MAX_ROWS rows, bfloat16) and dequantize + GEMM.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from stages import byte_rows
from stages.byte_rows import ByteLinear
from stages.quant_linear import (KERNEL_MAX_ROWS, PLANE_FORMATS, QuantEmbedding, QuantLinear, RowStack,
                                 cpu_layout_ok, fuse_rows, linear, pack, planes_from_gguf)
from pool.gguf_meta import kept_bytes
from tests.stages.harness import gguf_blocks

gguf = pytest.importorskip("gguf")
N, K = 96, 512  # 96 rows: not a multiple of the CPU packer's 64-row block


def blocks(kind: str, n: int = N, k: int = K, seed: int = 0) -> np.ndarray:
    """A [n, k] tensor's raw blocks (tests/stages/harness.py gguf_blocks)."""
    return gguf_blocks(kind, n, k, seed)


def dequantized(kind: str, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])).reshape(N, K)


def test_packer_layout_is_the_one_read_back() -> None:
    assert cpu_layout_ok()


@pytest.mark.parametrize("kind", PLANE_FORMATS)
def test_planes_are_gguf_dequantization(kind: str) -> None:
    raw = blocks(kind)
    planes = planes_from_gguf(kind, raw, (N, K))
    assert planes is not None and len(planes.values) == (1 if kind.startswith("Q4") else 2)
    assert all(int(v.max()) <= 15 for v in planes.values)
    torch.testing.assert_close(planes.dequantize(), dequantized(kind, raw), atol=0, rtol=1e-6)


def test_formats_without_planes_are_none() -> None:
    assert planes_from_gguf("Q3_K", blocks("Q3_K"), (N, K)) is None


def test_q6_k_is_kept_only_as_bytes(monkeypatch) -> None:
    """Q6_K's groups of 16 (two planes, the high one 2 bits): bytes on a CPU stage with the byte-rows kernel (1.25
    bytes per value: a float32 scale per 16, the offset -32 s made from it, as pool/gguf_meta.kept_bytes counts it),
    else dequantized at load (torch's int4 kernels take groups of 32 and more), the same weight either way."""
    raw = blocks("Q6_K")
    planes = planes_from_gguf("Q6_K", raw, (N, K))
    assert planes.group == 16 and int(planes.values[1].max()) == 3
    assert kept_bytes("Q6_K", (N, K), 4, cpu=True) == N * K * 5 // 4 and kept_bytes("Q6_K", (N, K), 2) is None
    if byte_rows.available():
        held = pack(planes, torch.float32, "cpu")
        assert isinstance(held, ByteLinear) and held.nbytes == kept_bytes("Q6_K", (N, K), 4, cpu=True)
    monkeypatch.setattr(byte_rows, "available", lambda: False)
    for dtype in (torch.float32, torch.bfloat16):
        plain = pack(planes, dtype, "cpu")
        assert isinstance(plain, torch.Tensor) and plain.dtype == dtype
        assert torch.equal(plain, dequantized("Q6_K", raw).to(dtype))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q5_K", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 3, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 80])
def test_quant_linear_matches_dequantized_weights(kind: str, rows: int) -> None:
    raw = blocks(kind)
    w = dequantized(kind, raw)
    planes = planes_from_gguf(kind, raw, (N, K))
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(N)
    q32 = pack(planes, torch.float32, "cpu")
    held = ByteLinear if byte_rows.takes(planes, torch.float32) and byte_rows.available() else QuantLinear
    assert isinstance(q32, held)
    want = F.linear(x.double(), w.double(), bias.double())
    # float32 rounding of outputs up to ~900 (the k-quants' random scales); a wrong weight misses by whole units
    torch.testing.assert_close(q32(x, bias).double(), want, atol=2e-6 * want.abs().max().item(), rtol=1e-5)
    qb = pack(planes, torch.bfloat16, "cpu")
    xb = x.bfloat16()
    ref = F.linear(xb.float(), w)
    got = qb(xb).float()
    assert got.dtype == torch.float32 and got.shape == (rows, N)
    # bfloat16 scales (2^-9 relative) and bfloat16 output rounding; a wrong layout is off by ~100 %
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max()


def test_kernel_and_gemm_paths_agree_in_bfloat16() -> None:
    raw = blocks("Q4_K")
    qb = pack(planes_from_gguf("Q4_K", raw, (N, K)), torch.bfloat16, "cpu")
    x = torch.randn(KERNEL_MAX_ROWS + 1, K).bfloat16()
    gemm = qb(x)  # one row past the kernel's limit: dequantize + F.linear
    kernel = torch.cat([qb(x[:KERNEL_MAX_ROWS]), qb(x[KERNEL_MAX_ROWS:])])
    assert (gemm.float() - kernel.float()).abs().max() <= 0.02 * gemm.float().abs().max()


def test_memory_of_one_and_two_plane_formats() -> None:
    n, k = 128, 512
    one = QuantLinear(planes_from_gguf("Q4_0", blocks("Q4_0", n, k), (n, k)), torch.bfloat16, "cpu")
    two = QuantLinear(planes_from_gguf("Q8_0", blocks("Q8_0", n, k), (n, k)), torch.bfloat16, "cpu")
    bf16 = n * k * 2
    assert one.nbytes == n * k // 2 + (k // 32) * n * 2 * 2  # nibbles + a bf16 scale and zero per 32
    assert one.nbytes / bf16 == pytest.approx(0.3125)
    assert two.nbytes == 2 * one.nbytes


@pytest.mark.parametrize("third", ["floats", "Q6_K", "Q5_K"])
def test_fused_rows_of_mixed_formats(third: str) -> None:
    """q and k in Q4_K, v stored as floats, in Q6_K (as a Q4_K_M file keeps some attn_v) or in Q5_K (two planes,
    groups of 32, where Q6_K's are 16: not fused with it either): one RowStack, its product the dequantized one."""
    q = planes_from_gguf("Q4_K", blocks("Q4_K", seed=1), (N, K))
    k = planes_from_gguf("Q4_K", blocks("Q4_K", seed=2), (N, K))
    v = torch.randn(32, K) if third == "floats" else planes_from_gguf(third, blocks(third, seed=3), (N, K))
    parts = [q, k, v] if third != "Q5_K" else [q, k, planes_from_gguf("Q6_K", blocks("Q6_K", seed=4), (N, K)), v]
    fused = fuse_rows(parts)
    assert isinstance(fused, RowStack) and len(fused.parts) == len(parts) - 1
    assert fused.shape == (sum(p.shape[0] for p in parts), K)
    packed = pack(fused, torch.float32, "cpu")
    held = ByteLinear if byte_rows.available() else QuantLinear  # one plane in float32 (stages/byte_rows.py rule 1)
    assert isinstance(packed.parts[0], held) and packed.parts[0].shape == (2 * N, K)
    x = torch.randn(5, K)
    w = torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts])
    want = F.linear(x.double(), w.double())
    # float32 rounding of outputs up to ~1,000 (the k-quants' random scales); a wrong weight misses by whole units
    torch.testing.assert_close(linear(x, packed).double(), want, atol=2e-6 * want.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("kind", ["Q4_K", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_lookup_is_exact(kind: str, dtype: torch.dtype, monkeypatch) -> None:
    """A lookup is the table's rows as gguf dequantizes them, rounded to the compute dtype: held as a ByteLinear's
    bytes or nibble pairs where the byte-rows kernel takes the planes (one plane: float32 only), else as nibble
    pairs dequantized by torch; each at the size `strata config check` counts for it."""
    raw = blocks(kind)
    ids = torch.tensor([[5, 0, 95], [5, 40, 7]])
    want = dequantized(kind, raw)[ids].to(dtype)
    for kernel in (True, False):
        monkeypatch.setattr(byte_rows, "available", lambda: kernel and byte_rows._library()[0] is not None)
        table = QuantEmbedding(planes_from_gguf(kind, raw, (N, K)), dtype, "cpu")
        got = table.lookup(ids)
        assert got.dtype == dtype and got.shape == (2, 3, K)
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=1e-6 if dtype == torch.float32 else 2**-8)
        bytes_form = table.bytes is not None
        assert bytes_form == (kernel and byte_rows.available() and (kind != "Q4_K" or dtype == torch.float32))
        assert table.nbytes == kept_bytes(kind, (N, K), dtype.itemsize, embedding=True, cpu=bytes_form)
        assert table.nbytes < N * K * 2


def test_row_permutation_before_packing() -> None:
    raw = blocks("Q5_K")
    planes = planes_from_gguf("Q5_K", raw, (N, K))
    order = torch.randperm(N, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(planes.rows(order).dequantize(), dequantized("Q5_K", raw)[order], atol=0, rtol=0)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q5_K", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 40])
def test_cuda_kernel_matches_dequantized_weights(kind: str, rows: int) -> None:
    """tinygemm's int4 kernel (every step on CUDA) against F.linear on gguf's dequantized weights; the embedding
    lookup on the device. N=128 (CUDA's packer wants rows in multiples of 8)."""
    n = 128
    raw = blocks(kind, n, K)
    w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])).reshape(n, K)
    planes = planes_from_gguf(kind, raw, (n, K))
    q = pack(planes, torch.bfloat16, "cuda")
    assert isinstance(q, QuantLinear)
    x = torch.randn(rows, K).bfloat16()
    ref = F.linear(x.float(), w)
    got = q(x.cuda()).float().cpu()
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max()
    table = QuantEmbedding(planes, torch.float32, "cuda")
    ids = torch.tensor([0, 7, 127])
    torch.testing.assert_close(table.lookup(ids.cuda()).cpu(), w[ids], atol=0, rtol=1e-6)
