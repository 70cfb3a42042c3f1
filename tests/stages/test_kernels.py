"""csrc kernels: they compile to PTX (needs nvcc), and match the torch reference in stages.attention (needs CUDA).

The compile tests build exactly the text `stages.kernels` hands NVRTC (header pasted in), plus the template
instances the loader asks for, and fail on any warning. The comparison tests fill pools at random, shuffle the
tables, mix slot lengths, and check the kernels against `write_kv` / `paged_attention` run on the same device.
"""
from __future__ import annotations

import contextlib
import re
import shutil
import subprocess

import pytest
import torch

from stages import kernels
from stages.attention import paged_attention, write_kv
from stages.batch import StepBatch
from stages.kv_cache import KVCache

F32, F16, BF16, I8 = torch.float32, torch.float16, torch.bfloat16, torch.int8
NVCC = shutil.which("nvcc")
ARCHS = ("sm_80", "sm_86", "sm_90")


def _compile_variants() -> dict[str, list[str]]:
    """Every dtype pair at head_dim 128, plus other head dims and GQA groups on a few pairs."""
    write = [kernels.kv_write_expression(i, o, 128) for i in (F32, F16, BF16) for o in (F32, F16, BF16, I8)]
    write += [kernels.kv_write_expression(BF16, o, d) for o in (BF16, I8) for d in (64, 80, 96, 256)]
    decode: list[str] = []
    for q, kv, head_dim, group in (
        [(q, kv, 128, 4) for q in (F32, F16, BF16) for kv in (F32, F16, BF16, I8)]
        + [(BF16, kv, d, g) for kv in (BF16, I8) for d, g in ((64, 1), (80, 2), (96, 7), (128, 8), (256, 8))]
    ):
        decode.extend(kernels.paged_decode_expressions(q, kv, head_dim, group))
    return {"kv_write.cu": write, "paged_decode.cu": list(dict.fromkeys(decode))}


def test_sources_need_no_header_outside_csrc():
    for name in kernels.SOURCES:
        raw = (kernels.CSRC / name).read_text()
        assert re.findall(r"^#include .*$", raw, flags=re.M) == ['#include "dtypes.cuh"']
        assert not re.findall(r"^\s*#\s*include", kernels.kernel_source(name), flags=re.M)
        assert "struct bf16_t" in kernels.kernel_source(name)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", kernels.SOURCES)
def test_compiles_to_ptx_without_warnings(name, arch, tmp_path):
    expressions = _compile_variants()[name]
    # Taking each instance's address instantiates it, as NVRTC's name expressions do for the loader.
    refs = ",\n".join(f"  (void*)&{e}" for e in expressions)
    src = tmp_path / name
    src.write_text(kernels.kernel_source(name) + f"\nvoid* strata_instances[] = {{\n{refs}\n}};\n")
    ptx = tmp_path / "out.ptx"
    run = subprocess.run(
        [NVCC, "-ptx", f"-arch={arch}", "-std=c++17", "--Werror", "all-warnings", "-o", str(ptx), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr.strip() == "" and run.stdout.strip() == ""
    assert ptx.read_text().count(".entry ") == len(expressions)


def test_decode_splits_rules():
    # Few blocks and a long span: split until two blocks per SM, partitions of at least 256 cells.
    assert kernels.decode_splits(span=4096, blocks=2, sm_count=132) == (16, 256)
    assert kernels.decode_splits(span=100_000, blocks=8, sm_count=132) == (33, 3031)
    # Enough blocks already, or a short span: one partition holding the whole span.
    assert kernels.decode_splits(span=4096, blocks=300, sm_count=132) == (1, 4096)
    assert kernels.decode_splits(span=200, blocks=1, sm_count=132) == (1, 200)
    for span in (1, 255, 256, 257, 1000, 5000, 12345):
        for blocks in (1, 3, 64, 1000):
            splits, cells = kernels.decode_splits(span, blocks, 108)
            assert splits * cells >= span > (splits - 1) * cells  # covered, and the last partition is not empty
            assert cells >= min(span, kernels.MIN_PARTITION_CELLS)
    with pytest.raises(ValueError):
        kernels.decode_splits(0, 1, 108)


def test_block_sizes_follow_head_dim():
    assert [kernels.reduce_threads(d) for d in (32, 64, 80, 96, 128, 256)] == [32, 64, 96, 96, 128, 256]
    assert kernels.decode_shared_bytes(128, 4) == 4 * 4 * 130 * 4
    assert kernels.decode_shared_bytes(256, 8) <= kernels.STATIC_SHARED_BYTES < kernels.decode_shared_bytes(256, 16)


def test_expressions_name_the_dtypes():
    assert kernels.kv_write_expression(BF16, I8, 128) == "kv_write<bf16_t, i8_t, 128>"
    assert kernels.paged_decode_expressions(F16, F32, 64, 2) == (
        "paged_decode_partial<f16_t, float, 64, 2>", "paged_decode_reduce<f16_t, 64>")


def test_cpu_pool_is_refused_with_the_reason():
    kv = KVCache(1, 4, 4, 2, 8, "float32", "cpu", 2, 2)
    kv.set_table(0, [1, 2])
    k = torch.randn(1, 2, 8)
    with pytest.raises(kernels.KernelsUnavailable, match="stages.attention"):
        kernels.kv_write(kv, 0, StepBatch.from_slots([[0, 3, 1, 1]]), k, k)
    with pytest.raises(kernels.KernelsUnavailable, match="stages.attention"):
        kernels.paged_decode(torch.randn(1, 4, 8), kv, 0, StepBatch.from_slots([[0, 3, 1, 1]]), 0.3)
    if not kernels.available():
        assert isinstance(kernels.unavailable_reason(), str)


def test_bad_steps_are_refused_before_any_launch():
    kv = KVCache(1, 4, 4, 2, 8, "float32", "cpu", 2, 2)
    with pytest.raises(ValueError, match="one token per entry"):
        kernels.paged_decode(torch.randn(3, 4, 8), kv, 0, StepBatch.from_slots([[0, 0, 2, 1], [1, 0, 1, 1]]), 0.3)
    with pytest.raises(ValueError, match="kv heads evenly"):
        kernels.paged_decode(torch.randn(1, 3, 8), kv, 0, StepBatch.from_slots([[0, 0, 1, 1]]), 0.3)
    with pytest.raises(ValueError, match="exceeds a table"):
        kernels.paged_decode(torch.randn(1, 4, 8), kv, 0, StepBatch.from_slots([[0, 8, 1, 1]]), 0.3)
    with pytest.raises(ValueError, match="one dtype"):
        kernels.kv_write(kv, 0, StepBatch.from_slots([[0, 0, 1, 1]]), torch.randn(1, 2, 8), torch.randn(1, 2, 8, dtype=F16))


# ---- against the torch reference, on a CUDA device -------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not kernels.available(), reason=f"needs CUDA and cupy: {kernels.unavailable_reason()}")
C, TABLE_CHUNKS, N_SLOTS = 64, 40, 4  # a table reaches 2560 cells
N_CHUNKS = N_SLOTS * TABLE_CHUNKS + 7


def random_pool(kv_dtype: str, kv_heads: int, head_dim: int, reserved: dict[int, int], seed: int) -> KVCache:
    """A CUDA pool with random bytes everywhere; slot s holds `reserved[s]` chunks drawn from a shuffled list."""
    torch.manual_seed(seed)
    kv = KVCache(2, N_CHUNKS, C, kv_heads, head_dim, kv_dtype, "cuda", N_SLOTS, TABLE_CHUNKS)
    for arr in kv.k + kv.v:
        if kv.quantized:
            arr.copy_(torch.randint(-127, 128, arr.shape, dtype=I8))
        else:
            arr.normal_()
    for arr in kv.k_scale + kv.v_scale:
        arr.uniform_(0.001, 0.03)
    free = torch.randperm(N_CHUNKS).tolist()
    for slot, n in reserved.items():
        own = [free.pop() for _ in range(n)]
        kv.set_table(slot, own + [kv.trash] * (TABLE_CHUNKS - n))
    return kv


def clone_pool(kv: KVCache) -> KVCache:
    twin = KVCache(2, N_CHUNKS, C, kv.kv_heads, kv.head_dim, kv.kv_dtype, "cuda", N_SLOTS, TABLE_CHUNKS)
    for mine, theirs in zip(twin.arrays(), kv.arrays()):
        mine.copy_(theirs)
    twin.tables.copy_(kv.tables)
    return twin


def new_rows(n: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of mixed magnitude, one of them all zero (an int8 scale of 0)."""
    x = torch.randn(n, kv_heads, head_dim, device="cuda") * torch.rand(n, kv_heads, 1, device="cuda") * 8
    x[0, 0] = 0
    return x.to(dtype)


@needs_cuda
@pytest.mark.parametrize("kv_dtype,in_dtype", [("float32", F32), ("float16", F16), ("bfloat16", BF16),
                                               ("bfloat16", F32), ("int8", F32), ("int8", F16), ("int8", BF16)])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_kv_write_matches_write_kv(kv_dtype, in_dtype, head_dim):
    kv_heads = 2
    ref = random_pool(kv_dtype, kv_heads, head_dim, {0: 1, 1: 3, 2: 40, 3: 2}, seed=head_dim)
    ours = clone_pool(ref)
    # Prefill pieces crossing chunk boundaries, a decode at a chunk's last cell, one far into a long table.
    batch = StepBatch.from_slots([[1, 50, 100, 0], [0, 0, 5, 1], [3, 127, 1, 1], [2, 2000, 3, 1]], device="cuda")
    k = new_rows(batch.num_tokens, kv_heads, head_dim, in_dtype)
    v = new_rows(batch.num_tokens, kv_heads, head_dim, in_dtype) * 3
    for layer in (1, 0):
        write_kv(ref, layer, batch, k, v)
        kernels.kv_write(ours, layer, batch, k, v)
    torch.cuda.synchronize()
    for mine, theirs in zip(ours.arrays(), ref.arrays()):
        assert torch.equal(mine, theirs)  # values and int8 scales, every cell including the trash chunk


@needs_cuda
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_kv_write_past_reserved_cells_lands_in_trash(kv_dtype):
    ref = random_pool(kv_dtype, 2, 64, {0: 1, 1: 1}, seed=1)
    ours = clone_pool(ref)
    trash_before = ref.k[0][ref.trash].clone()
    # Slot 0 owns cells 0..63 and writes 60..69; slot 1 owns 0..63 and writes 200..201 (all trash).
    batch = StepBatch.from_slots([[0, 60, 10, 1], [1, 200, 2, 1]], device="cuda")
    k = new_rows(batch.num_tokens, 2, 64, BF16)
    write_kv(ref, 0, batch, k, k)
    kernels.kv_write(ours, 0, batch, k, k)
    torch.cuda.synchronize()
    for mine, theirs in zip(ours.arrays(), ref.arrays()):
        assert torch.equal(mine, theirs)
    changed = (ours.k[0][ours.trash] != trash_before).any(-1).any(-1)
    assert changed.nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 8, 9]  # offsets 64..69 % 64, 200..201 % 64


def reference_backend(q_dtype: torch.dtype):
    """fp32: the math backend, whose matmuls follow allow_tf32 (off), so the reference is true fp32."""
    if q_dtype == F32:
        return torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH])
    return contextlib.nullcontext()


DECODE_CASES = [  # heads, kv_heads, head_dim, window
    (4, 4, 64, None),
    (8, 2, 128, None),
    (8, 1, 80, 7),
    (16, 2, 128, 600),
]


@needs_cuda
@pytest.mark.parametrize("q_dtype,kv_dtype,atol", [(F32, "float32", 1e-4), (F16, "float16", 2e-2),
                                                    (BF16, "bfloat16", 2e-2), (F32, "int8", 1e-4),
                                                    (BF16, "int8", 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,window", DECODE_CASES)
@pytest.mark.parametrize("contexts", [(1, 17, 64, 250), (2500, 1, 700, 65)], ids=["one-partition", "split-k"])
def test_paged_decode_matches_paged_attention(q_dtype, kv_dtype, atol, heads, kv_heads, head_dim, window, contexts):
    slots = [2, 0, 3, 1]
    reserved = {slot: -(-ctx // C) for slot, ctx in zip(slots, contexts)}
    kv = random_pool(kv_dtype, kv_heads, head_dim, reserved, seed=len(contexts) + head_dim)
    batch = StepBatch.from_slots([[slot, ctx - 1, 1, 1] for slot, ctx in zip(slots, contexts)], device="cuda")
    q = torch.randn(len(slots), heads, head_dim, device="cuda").to(q_dtype)
    scale = head_dim ** -0.5
    with reference_backend(q_dtype):
        ref = paged_attention(q, kv, 1, batch, scale, window)
    out = kernels.paged_decode(q, kv, 1, batch, scale, window)
    assert out.shape == ref.shape == (len(slots), heads * head_dim) and out.dtype == q_dtype
    torch.testing.assert_close(out, ref, atol=atol, rtol=1e-2 if q_dtype != F32 else 1e-4)


@needs_cuda
def test_paged_decode_follows_the_written_cells():
    """kv_write then paged_decode sees the new token: changing only the last cell changes the output."""
    kv = random_pool("bfloat16", 2, 64, {0: 2}, seed=3)
    batch = StepBatch.from_slots([[0, 99, 1, 1]], device="cuda")
    q = torch.randn(1, 4, 64, device="cuda", dtype=BF16)
    kernels.kv_write(kv, 0, batch, *(new_rows(1, 2, 64, BF16) for _ in range(2)))
    first = kernels.paged_decode(q, kv, 0, batch, 0.125)
    kernels.kv_write(kv, 0, batch, *(new_rows(1, 2, 64, BF16) * 5 for _ in range(2)))
    second = kernels.paged_decode(q, kv, 0, batch, 0.125)
    ref = paged_attention(q, kv, 0, batch, 0.125)
    torch.testing.assert_close(second, ref, atol=2e-2, rtol=1e-2)
    assert not torch.allclose(first, second, atol=1e-2)
