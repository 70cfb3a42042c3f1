"""StepBatch indices, KVCache tables and byte moves, write_kv and paged_attention against a slow reference."""
from __future__ import annotations

import math
import random

import pytest
import torch

from stages.attention import dequantize_int8, paged_attention, quantize_int8, write_kv
from stages.batch import StepBatch
from stages.kv_cache import KVCache

C = 4  # chunk_cells
N_CHUNKS = 24
TABLE_CHUNKS = 8


def make_kv(kv_heads=2, head_dim=8, kv_dtype="float32", n_layers=2, n_slots=4, storage=None) -> KVCache:
    return KVCache(n_layers, N_CHUNKS, C, kv_heads, head_dim, kv_dtype, "cpu", n_slots, TABLE_CHUNKS, storage)


def test_step_batch_indices():
    b = StepBatch.from_slots([[3, 10, 2, 1], [0, 0, 3, 0], [1, 5, 1, 1]])
    assert b.num_tokens == 6 and b.max_new == 3 and b.max_context == 12 and b.num_seqs == 3
    assert b.positions.tolist() == [10, 11, 0, 1, 2, 5]
    assert b.token_slot.tolist() == [3, 3, 0, 0, 0, 1]
    assert b.token_seq.tolist() == [0, 0, 1, 1, 1, 2]
    assert b.token_row.tolist() == [0, 1, 0, 1, 2, 0]
    assert b.token_context.tolist() == [12, 12, 3, 3, 3, 6]
    assert b.cu_seqlens.tolist() == [0, 2, 5, 6] and b.cu_seqlens.dtype == torch.int32
    assert b.context_lens.tolist() == [12, 3, 6]
    assert b.sample_rows.tolist() == [1, 5] and b.sample_slots == [3, 1]
    assert b.query_index.tolist() == [[0, 1, 0], [2, 3, 4], [5, 5, 5]]
    assert b.query_pos.tolist() == [[10, 11, 0], [0, 1, 2], [5, 0, 0]]
    assert b.query_valid.tolist() == [[True, True, False], [True, True, True], [True, False, False]]


@pytest.mark.parametrize("slots", [[], [[0, 0, 0, 1]], [[0, -1, 2, 1]], [[0, 0, 2, 2]], [[1, 0, 2, 1], [1, 2, 1, 1]]])
def test_step_batch_refuses_bad_entries(slots):
    with pytest.raises(ValueError):
        StepBatch.from_slots(slots)


def test_tables_start_at_trash_and_update_in_place():
    kv = make_kv()
    assert kv.tables.dtype == torch.int32 and kv.tables.shape == (4, TABLE_CHUNKS)
    assert (kv.tables == kv.trash).all() and kv.trash == N_CHUNKS
    ptr = kv.tables.data_ptr()
    kv.set_table(2, [5, 1, 9] + [N_CHUNKS] * 5)
    assert kv.tables.data_ptr() == ptr
    assert kv.tables[2].tolist() == [5, 1, 9] + [N_CHUNKS] * 5 and (kv.tables[[0, 1, 3]] == N_CHUNKS).all()
    with pytest.raises(ValueError):
        kv.set_table(0, [1, 2])
    with pytest.raises(ValueError):
        kv.set_table(0, [N_CHUNKS + 1] * TABLE_CHUNKS)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_array_shapes_and_storage_callable(kv_dtype):
    calls = []
    buf = bytearray(1 << 20)
    at = [0]

    def storage(layer, which, dtype, shape):  # how a stage wraps its shared-memory file
        calls.append((layer, which, dtype, shape))
        n = math.prod(shape)
        t = torch.frombuffer(buf, dtype=dtype, count=n, offset=at[0]).view(shape)
        at[0] += n * dtype.itemsize
        return t

    kv = make_kv(kv_dtype=kv_dtype, storage=storage)
    shape, scale_shape = (N_CHUNKS + 1, C, 2, 8), (N_CHUNKS + 1, C, 2)
    expect = [(layer, "k", kv.dtype, shape) for layer in range(2)] + [(layer, "v", kv.dtype, shape) for layer in range(2)]
    if kv_dtype == "int8":
        expect += [(layer, w, torch.float32, scale_shape) for w in ("k_scale", "v_scale") for layer in range(2)]
    assert sorted(calls, key=str) == sorted(expect, key=str)
    assert kv.bytes_per_cell == 2 * (2 * 2 * 8 * kv.dtype.itemsize + (2 * 2 * 4 if kv_dtype == "int8" else 0))
    # Writes go to the caller's memory.
    kv.set_table(0, [3] + [N_CHUNKS] * 7)
    k = torch.ones(1, 2, 8)
    write_kv(kv, 1, StepBatch.from_slots([[0, 2, 1, 1]]), k, k)
    assert any(buf)


def test_storage_with_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="layer 0 k"):
        make_kv(storage=lambda layer, which, dtype, shape: torch.zeros(3, dtype=dtype))


def test_write_kv_lands_in_each_tokens_cell_and_nowhere_else():
    kv = make_kv()
    for arr in kv.arrays():
        arr.normal_()
    before = [a.clone() for a in kv.arrays()]
    kv.set_table(1, [7, 2, 11] + [N_CHUNKS] * 5)
    kv.set_table(3, [0, 5] + [N_CHUNKS] * 6)
    # slot 1 writes positions 2..9 (chunks 7, 2, 11); slot 3 writes 3..4 (chunks 0, 5).
    batch = StepBatch.from_slots([[1, 2, 8, 1], [3, 3, 2, 0]])
    k = torch.arange(10, dtype=torch.float32)[:, None, None].expand(10, 2, 8) + 100
    write_kv(kv, 1, batch, k, -k)
    expected_cells = {(7, 2): 0, (7, 3): 1, (2, 0): 2, (2, 1): 3, (2, 2): 4, (2, 3): 5, (11, 0): 6, (11, 1): 7,
                      (0, 3): 8, (5, 0): 9}
    for (chunk, off), t in expected_cells.items():
        assert (kv.k[1][chunk, off] == 100 + t).all() and (kv.v[1][chunk, off] == -100 - t).all()
        before[1][chunk, off] = kv.k[1][chunk, off]
        before[3][chunk, off] = kv.v[1][chunk, off]
    for arr, old in zip(kv.arrays(), before):
        assert torch.equal(arr, old)  # layer 0 untouched, no other cell of layer 1 changed, trash untouched


def test_write_past_the_reserved_chunks_lands_in_trash():
    kv = make_kv()
    kv.set_table(0, [4] + [N_CHUNKS] * 7)  # only cells 0..3 reserved
    k = torch.full((3, 2, 8), 7.0)
    write_kv(kv, 0, StepBatch.from_slots([[0, 3, 3, 1]]), k, k)
    assert (kv.k[0][4, 3] == 7).all()
    assert (kv.k[0][N_CHUNKS, :2] == 7).all()
    assert int((kv.k[0] != 0).any(-1).any(-1).sum()) == 3  # three cells written in all


def test_int8_quantisation_error_is_at_most_half_a_step():
    x = torch.randn(50, 3, 16) * torch.rand(50, 3, 1) * 10
    x[0, 0] = 0
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and s.shape == (50, 3) and s.dtype == torch.float32
    torch.testing.assert_close(s, x.abs().amax(-1) / 127)
    err = (dequantize_int8(q, s, torch.float32) - x).abs()
    assert (err <= s[..., None] / 2 + 1e-6).all()
    assert (q[0, 0] == 0).all() and q.abs().max() == 127


def reference_attention(q, keys, values, positions, scale, window):
    """Slow reference for one slot: q [n, H, D] at `positions`, keys/values [ctx, KVH, D] contiguous."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    k = keys.repeat_interleave(heads // kv_heads, dim=1).float()
    v = values.repeat_interleave(heads // kv_heads, dim=1).float()
    out = []
    for i, p in enumerate(positions):
        lo = 0 if window is None else max(0, p - window + 1)
        scores = torch.einsum("hd,jhd->hj", q[i].float(), k[lo:p + 1]) * scale
        out.append(torch.einsum("hj,jhd->hd", scores.softmax(-1), v[lo:p + 1]))
    return torch.stack(out).reshape(len(positions), -1)


CASES = [(4, 4, torch.float32, "float32", None), (4, 2, torch.float32, "float32", None),
         (8, 1, torch.float32, "float32", 5), (4, 2, torch.float32, "float32", 9),
         (4, 2, torch.bfloat16, "bfloat16", None), (4, 2, torch.float32, "int8", None)]


@pytest.mark.parametrize("heads, kv_heads, dtype, kv_dtype, window", CASES)
def test_paged_attention_matches_slow_reference(heads, kv_heads, dtype, kv_dtype, window):
    head_dim, scale = 8, 8**-0.5
    kv = make_kv(kv_heads=kv_heads, head_dim=head_dim, kv_dtype=kv_dtype, n_layers=1)
    for arr in kv.arrays():
        arr.copy_(torch.randint(-100, 100, arr.shape) if arr.dtype == torch.int8 else torch.randn(arr.shape) * 5)
    chunks = list(range(0, N_CHUNKS, 2))
    random.Random(0).shuffle(chunks)
    for slot in range(3):
        kv.set_table(slot, chunks[slot * 4:(slot + 1) * 4] + [N_CHUNKS] * 4)
    g = torch.Generator().manual_seed(1)
    history = {s: ([], []) for s in range(3)}  # what each slot has written, in position order
    steps = [  # mixed prefill pieces and decodes, slots at different offsets, not in slot order
        [[2, 0, 6, 1], [0, 0, 1, 1]],
        [[0, 1, 9, 1], [1, 0, 13, 0], [2, 6, 1, 1]],
        [[1, 13, 1, 1], [2, 7, 3, 1], [0, 10, 1, 1]],
    ]
    for slots in steps:
        batch = StepBatch.from_slots(slots)
        t = batch.num_tokens
        q = torch.randn(t, heads, head_dim, generator=g).to(dtype)
        k = torch.randn(t, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(t, kv_heads, head_dim, generator=g).to(dtype)
        write_kv(kv, 0, batch, k, v)
        out = paged_attention(q, kv, 0, batch, scale, window)
        assert out.shape == (t, heads * head_dim) and out.dtype == dtype
        row = 0
        for slot, start, n, _ in slots:
            history[slot][0].append(k[row:row + n])
            history[slot][1].append(v[row:row + n])
            keys, values = torch.cat(history[slot][0]), torch.cat(history[slot][1])
            assert keys.shape[0] == start + n
            want = reference_attention(q[row:row + n], keys, values, list(range(start, start + n)), scale, window)
            tol = {"float32": 1e-5, "bfloat16": 3e-2, "int8": 5e-2}[kv_dtype]
            torch.testing.assert_close(out[row:row + n].float(), want, atol=tol, rtol=0)
            row += n


def test_copy_cells_copies_exactly_the_first_cells():
    kv = make_kv(kv_dtype="int8")
    for arr in kv.arrays():
        arr.copy_(torch.randint(-100, 100, arr.shape))
    before = [a.clone() for a in kv.arrays()]
    src, dst = [3, 8, 1] + [N_CHUNKS] * 5, [10, 4, 6] + [N_CHUNKS] * 5
    kv.copy_cells(src, dst, 10)  # two whole chunks and 2 cells of the third
    for arr, old in zip(kv.arrays(), before):
        want = old.clone()
        want[10], want[4], want[6, :2] = old[3], old[8], old[1, :2]
        assert torch.equal(arr, want)


def test_exchange_swaps_cells_both_ways():
    kv = make_kv()
    for arr in kv.arrays():
        arr.normal_()
    before = [a.clone() for a in kv.arrays()]
    a, b = [0, 2] + [N_CHUNKS] * 6, [7, 9] + [N_CHUNKS] * 6
    kv.exchange(a, b, 6)
    for arr, old in zip(kv.arrays(), before):
        want = old.clone()
        want[0], want[7] = old[7], old[0]
        want[2, :2], want[9, :2] = old[9, :2], old[2, :2]
        assert torch.equal(arr, want)
    with pytest.raises(ValueError):
        kv.exchange(a, b, TABLE_CHUNKS * C + 1)
