"""stages/cpu_attention.py: the C decode kernel gives the torch reference's attention (rules 1-3), and its library
is built, trusted and refused as rules 4-5 say."""
from __future__ import annotations

import os
import stat

import pytest
import torch

from stages import cpu_attention
from stages.attention import paged_attention, write_kv
from stages.batch import StepBatch
from stages.kv_cache import KVCache

needs_kernel = pytest.mark.skipif(not cpu_attention.available(), reason=f"no CPU decode kernel here: "
                                  f"{cpu_attention.unavailable_reason()}")


def _pool(seed: int, kv_heads: int, head_dim: int, c: int, n_chunks: int, n_slots: int, table_chunks: int,
          kv_dtype=torch.float32) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    kv = KVCache(1, n_chunks, c, kv_heads, head_dim, kv_dtype, "cpu", n_slots=n_slots, table_chunks=table_chunks)
    order = torch.randperm(n_chunks, generator=g).tolist()
    for s in range(n_slots):
        kv.set_table(s, order[s * table_chunks:(s + 1) * table_chunks])
    for arr in kv.arrays():  # int8 values with scales that make them about N(0, 1), or floats
        if arr.dtype == torch.int8:
            arr.copy_(torch.randint(-127, 128, arr.shape, generator=g))
        elif kv.quantized:
            arr.copy_(torch.rand(arr.shape, generator=g) * 0.02 + 0.001)
        else:
            arr.copy_(torch.randn(arr.shape, generator=g))
    return kv


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
@pytest.mark.parametrize("kv_heads,group,head_dim", [(2, 3, 64), (4, 1, 32), (1, 8, 128), (8, 2, 16)])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("part", [None, 64])
def test_the_kernel_gives_the_reference_attention(kv_dtype, kv_heads, group, head_dim, window, part):
    c, table_chunks = 16, 20
    kv = _pool(kv_heads * 100 + head_dim, kv_heads, head_dim, c, 4 * table_chunks + 3, 4, table_chunks, kv_dtype)
    g = torch.Generator().manual_seed(7)
    contexts = [1, 17, 200, 319]  # one cell, a chunk and one, several parts, a nearly full table
    batch = StepBatch.from_slots([[s, ctx - 1, 1, 1] for s, ctx in enumerate(contexts)])
    heads = kv_heads * group
    q = torch.randn(len(contexts), heads, head_dim, generator=g)
    write_kv(kv, 0, batch, torch.randn(len(contexts), kv_heads, head_dim, generator=g),
             torch.randn(len(contexts), kv_heads, head_dim, generator=g))
    want = paged_attention(q, kv, 0, batch, head_dim**-0.5, window, cpu_kernel=False)
    plan = cpu_attention.Plan(batch.groups[0], window, torch.get_num_threads(), part)
    got = cpu_attention._run(cpu_attention._library()[0], q, kv, 0, plan, head_dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    # The default path of paged_attention is the kernel.
    torch.testing.assert_close(paged_attention(q, kv, 0, batch, head_dim**-0.5, window), want, rtol=1e-5, atol=2e-6)


@needs_kernel
def test_a_step_of_decodes_and_a_prompt_piece_takes_the_kernel_for_the_decodes_only():
    kv = _pool(3, 2, 32, 16, 30, 3, 10)
    g = torch.Generator().manual_seed(3)
    batch = StepBatch.from_slots([[0, 70, 1, 1], [1, 0, 9, 1], [2, 33, 1, 1]])
    q = torch.randn(batch.num_tokens, 4, 32, generator=g)
    write_kv(kv, 0, batch, torch.randn(batch.num_tokens, 2, 32, generator=g),
             torch.randn(batch.num_tokens, 2, 32, generator=g))
    want = paged_attention(q, kv, 0, batch, 0.3, None, cpu_kernel=False)
    torch.testing.assert_close(paged_attention(q, kv, 0, batch, 0.3), want, rtol=1e-5, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("kv_heads,group,head_dim", [(2, 3, 64), (1, 8, 128), (8, 2, 16)])
@pytest.mark.parametrize("window", [None, 40])
def test_a_bfloat16_pool_gives_the_float32_attention_of_its_values_to_bfloat16_rounding(kv_heads, group, head_dim,
                                                                                        window):
    """Rule 1: bfloat16 queries over a bfloat16 pool, against the reference in float32 over the same values."""
    c, table_chunks, seed = 16, 20, kv_heads * 10 + head_dim
    kv16 = _pool(seed, kv_heads, head_dim, c, 4 * table_chunks + 3, 4, table_chunks, "bfloat16")
    kv32 = _pool(seed, kv_heads, head_dim, c, 4 * table_chunks + 3, 4, table_chunks)
    for a, b in zip(kv32.arrays(), kv16.arrays()):
        a.copy_(b)
    g = torch.Generator().manual_seed(8)
    contexts = [1, 17, 200, 319]
    batch = StepBatch.from_slots([[s, ctx - 1, 1, 1] for s, ctx in enumerate(contexts)])
    q = torch.randn(len(contexts), kv_heads * group, head_dim, generator=g).bfloat16()
    k, v = (torch.randn(len(contexts), kv_heads, head_dim, generator=g).bfloat16() for _ in range(2))
    write_kv(kv16, 0, batch, k, v)
    write_kv(kv32, 0, batch, k.float(), v.float())
    assert cpu_attention.usable(kv16, q)
    got = paged_attention(q, kv16, 0, batch, head_dim**-0.5, window)
    want = paged_attention(q.float(), kv32, 0, batch, head_dim**-0.5, window, cpu_kernel=False)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-3)


def test_other_pools_and_dtypes_stay_on_the_reference():
    q = torch.randn(1, 4, 32)
    assert cpu_attention.usable(_pool(0, 2, 32, 16, 4, 1, 2, kv_dtype="bfloat16"), q.bfloat16()) == \
        cpu_attention.available()  # a bfloat16 stage (rule 1)
    assert not cpu_attention.usable(_pool(0, 2, 32, 16, 4, 1, 2, kv_dtype="bfloat16"), q)
    assert not cpu_attention.usable(_pool(0, 2, 32, 16, 4, 1, 2), q.bfloat16())
    assert cpu_attention.usable(_pool(0, 2, 32, 16, 4, 1, 2, kv_dtype="int8"), q) == cpu_attention.available()
    assert cpu_attention.usable(_pool(0, 2, 32, 16, 4, 1, 2), q) == cpu_attention.available()


def test_part_sizes_spread_a_long_context_over_the_threads():
    assert cpu_attention.part_cells(160, 2) == 128
    assert cpu_attention.part_cells(1024, 2) == 128
    assert cpu_attention.part_cells(4096, 2) == 512
    assert cpu_attention.part_cells(100_000, 2) == 1024
    assert cpu_attention.part_cells(4096, 8) == 128


@pytest.fixture
def fresh_library(monkeypatch):
    """`_library` rebuilt under the test's environment, and rebuilt again afterwards for the other tests."""
    cpu_attention._library.cache_clear()
    yield monkeypatch
    cpu_attention._library.cache_clear()


def test_the_library_is_built_into_a_private_directory_and_reused(fresh_library, tmp_path):
    cache = tmp_path / "kernels"
    fresh_library.setenv("STRATA_KERNEL_CACHE", str(cache))
    lib = cpu_attention.build()
    assert stat.S_IMODE(os.lstat(cache).st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(lib).st_mode) == 0o600 and lib.parent == cache
    mtime = os.lstat(lib).st_mtime_ns
    assert cpu_attention.build() == lib and os.lstat(lib).st_mtime_ns == mtime  # the cached one, not rebuilt
    assert [p.name for p in cache.iterdir()] == [lib.name]  # no build leftovers


def test_a_cache_directory_open_to_others_is_refused(fresh_library, tmp_path):
    cache = tmp_path / "kernels"
    cache.mkdir(mode=0o755)
    os.chmod(cache, 0o755)
    fresh_library.setenv("STRATA_KERNEL_CACHE", str(cache))
    with pytest.raises(cpu_attention.KernelRefused, match="not a private directory"):
        cpu_attention.build()
    assert not cpu_attention.available()
    assert "not a private directory" in cpu_attention.unavailable_reason()
    assert list(cache.iterdir()) == []


def test_a_link_or_a_writable_file_in_place_of_the_library_is_refused(fresh_library, tmp_path):
    cache = tmp_path / "kernels"
    fresh_library.setenv("STRATA_KERNEL_CACHE", str(cache))
    lib = cpu_attention.build()
    target = tmp_path / "elsewhere.so"
    target.write_bytes(lib.read_bytes())
    lib.unlink()
    lib.symlink_to(target)
    with pytest.raises(cpu_attention.KernelRefused, match="not a regular file"):
        cpu_attention.build()
    lib.unlink()
    lib.write_bytes(target.read_bytes())
    os.chmod(lib, 0o666)
    with pytest.raises(cpu_attention.KernelRefused, match="not a regular file"):
        cpu_attention.build()


def test_without_a_compiler_or_when_turned_off_the_reference_runs(fresh_library, tmp_path):
    fresh_library.setenv("STRATA_KERNEL_CACHE", str(tmp_path / "kernels"))
    fresh_library.setenv("CC", str(tmp_path / "no-such-cc"))
    assert not cpu_attention.available()
    assert "no C compiler" in cpu_attention.unavailable_reason()
    kv = _pool(1, 2, 32, 16, 8, 1, 4)
    assert not cpu_attention.usable(kv, torch.randn(1, 4, 32))
    cpu_attention._library.cache_clear()
    fresh_library.delenv("CC")
    fresh_library.setenv("STRATA_CPU_KERNELS", "0")
    assert not cpu_attention.available() and cpu_attention.unavailable_reason() == "STRATA_CPU_KERNELS=0"


def test_a_library_that_computes_wrong_is_not_used(fresh_library, tmp_path, monkeypatch):
    """Rule 5: the first-use check against the reference; a source whose result is off fails it."""
    bad = tmp_path / "bad.c"
    source = cpu_attention.SOURCE.read_text()
    wrong = source.replace("s[r][i] = dot * scale;", "s[r][i] = dot * scale * 0.5f;")
    assert wrong != source
    bad.write_text(wrong)
    monkeypatch.setattr(cpu_attention, "SOURCE", bad)
    fresh_library.setenv("STRATA_KERNEL_CACHE", str(tmp_path / "kernels"))
    assert not cpu_attention.available()
    assert "disagrees with the torch reference" in cpu_attention.unavailable_reason()
