"""Attention by groups: decodes and prefill pieces read separately, chunk views vs gathers, sliding windows."""
from __future__ import annotations

import random

import pytest
import torch

import stages.attention as attention
from stages.attention import paged_attention, write_kv
from stages.batch import StepBatch
from stages.kv_cache import KVCache

C = 4
N_CHUNKS = 40
TABLE_CHUNKS = 8


def reference(q, keys, values, positions, scale, window):
    """One slot, contiguous keys/values [ctx, KVH, D]: softmax over the cells each query may see."""
    rep = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(rep, 1).double(), values.repeat_interleave(rep, 1).double()
    out = []
    for i, p in enumerate(positions):
        lo = 0 if window is None else max(0, p - window + 1)
        w = (torch.einsum("hd,jhd->hj", q[i].double(), k[lo:p + 1]) * scale).softmax(-1)
        out.append(torch.einsum("hj,jhd->hd", w, v[lo:p + 1]))
    return torch.stack(out).reshape(len(positions), -1)


def test_groups_split_decodes_from_prefill_pieces():
    b = StepBatch.from_slots([[3, 10, 1, 1], [0, 0, 5, 0], [1, 7, 1, 1], [2, 4, 3, 1]])
    kinds = [(g.kind, g.entries, g.max_new, g.max_context) for g in b.groups]
    assert kinds == [("decode", (0, 2), 1, 11), ("prefill", (1,), 5, 5), ("prefill", (3,), 3, 7)]
    decode = b.groups[0]
    assert decode.rows.tolist() == [0, 6] and decode.contexts == (11, 8) and not decode.uniform
    assert b.groups[1].rows == range(1, 6) and b.groups[2].rows == range(7, 10)
    # Decodes first, as the scheduler orders them: their rows are a range (a view of q, no copy).
    b = StepBatch.from_slots([[3, 10, 1, 1], [1, 10, 1, 1], [0, 0, 5, 1]])
    assert b.groups[0].rows == range(0, 2) and b.groups[0].uniform and not b.all_decode
    assert StepBatch.from_slots([[0, 3, 1, 1], [1, 3, 1, 1]]).all_decode


def test_decodes_in_a_mixed_step_cost_one_query_row_each(monkeypatch):
    """The decode group is one call with one query per entry (per head), whatever the prefill piece's length."""
    kv = KVCache(1, N_CHUNKS, 64, 2, 8, "float32", "cpu", 4, 8)
    for s in range(4):
        kv.set_table(s, list(range(s * 8, s * 8 + 8)))
    calls = []
    real = attention.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((tuple(q.shape), tuple(k.shape), kw["attn_mask"] is not None, kw.get("is_causal", False)))
        return real(q, k, v, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    batch = StepBatch.from_slots([[0, 400, 1, 1], [1, 400, 1, 1], [2, 400, 1, 1], [3, 0, 256, 1]])
    q = torch.randn(batch.num_tokens, 4, 8)
    write_kv(kv, 0, batch, torch.randn(batch.num_tokens, 2, 8), torch.randn(batch.num_tokens, 2, 8))
    paged_attention(q, kv, 0, batch, 0.3, cpu_kernel=False)  # the reference's calls
    # Decodes: 3 entries x 2 kv heads, each kv head's 2 query heads as its rows; no mask (one shared context).
    assert calls == [((3, 2, 2, 8), (3, 2, 401, 8), False, False), ((1, 4, 256, 8), (1, 2, 256, 8), False, True)]


def _random_case(seed: int, kv_dtype: str, consecutive: bool):
    rng = random.Random(seed)
    kv = KVCache(1, N_CHUNKS, C, 2, 8, kv_dtype, "cpu", 4, TABLE_CHUNKS)
    for arr in kv.arrays():
        arr.copy_(torch.randint(-100, 100, arr.shape) if arr.dtype == torch.int8 else torch.randn(arr.shape))
    chunks = list(range(N_CHUNKS))
    if not consecutive:
        rng.shuffle(chunks)
    for s in range(4):
        kv.set_table(s, chunks[s * TABLE_CHUNKS:(s + 1) * TABLE_CHUNKS])
    return rng, kv


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["kernel", "sdpa"])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kv_dtype, consecutive, window", [("float32", False, None), ("float32", True, None),
                                                             ("float32", False, 6), ("float32", True, 3),
                                                             ("int8", False, 5), ("bfloat16", True, None)])
def test_random_steps_match_the_reference(seed, kv_dtype, consecutive, window, cpu_kernel):
    """Random mixes of decodes and prefill pieces, slots in any order, tables consecutive (views) or not; float32
    decodes through the CPU kernel (stages/cpu_attention.py) where it is available, or through SDPA."""
    rng, kv = _random_case(seed, kv_dtype, consecutive)
    dtype = torch.bfloat16 if kv_dtype == "bfloat16" else torch.float32
    tol = {"float32": 1e-5, "bfloat16": 3e-2, "int8": 5e-2}[kv_dtype]
    g = torch.Generator().manual_seed(seed)
    fed = {s: 0 for s in range(4)}
    history = {s: ([], []) for s in range(4)}
    for _ in range(8):
        slots = []
        for s in rng.sample(range(4), rng.randint(1, 4)):
            room = TABLE_CHUNKS * C - fed[s]
            if room < 1:
                continue
            n = 1 if fed[s] and rng.random() < 0.6 else rng.randint(1, min(room, 11))
            slots.append([s, fed[s], n, 1])
            fed[s] += n
        if not slots:
            break
        batch = StepBatch.from_slots(slots)
        t = batch.num_tokens
        q, k, v = (torch.randn(t, h, 8, generator=g).to(dtype) for h in (4, 2, 2))
        write_kv(kv, 0, batch, k, v)
        out = paged_attention(q, kv, 0, batch, 0.35, window, cpu_kernel=cpu_kernel)
        assert out.shape == (t, 32) and out.dtype == dtype
        row = 0
        for slot, start, n, _ in slots:
            history[slot][0].append(k[row:row + n].float())
            history[slot][1].append(v[row:row + n].float())
            keys, values = torch.cat(history[slot][0]), torch.cat(history[slot][1])
            want = reference(q[row:row + n].float(), keys, values, range(start, start + n), 0.35, window)
            torch.testing.assert_close(out[row:row + n].double(), want, atol=tol, rtol=0)
            row += n


def test_view_and_gather_give_the_same_bits():
    """A lone slot with consecutive chunks is read as a view; the same values through a shuffled table agree."""
    outs = []
    for consecutive in (True, False):
        _, kv = _random_case(0, "float32", consecutive)
        torch.manual_seed(3)
        for arr in kv.arrays():
            arr.normal_()
        cells = torch.tensor([kv.host_tables[0][p // C] * C + p % C for p in range(20)])
        values = torch.randn(20, 2, 8, generator=torch.Generator().manual_seed(5))
        kv.k[0].view(-1, 2, 8)[cells] = values
        kv.v[0].view(-1, 2, 8)[cells] = -values
        batch = StepBatch.from_slots([[0, 19, 1, 1]])
        read = attention._read(kv, batch, 0, None)
        assert (read.first is not None) == consecutive
        q = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(7))
        outs.append(paged_attention(q, kv, 0, batch, 0.35, cpu_kernel=False))
    assert torch.equal(outs[0], outs[1])


def test_scratch_buffers_are_reused_per_name_and_grow():
    kv = KVCache(1, 4, C, 2, 8, "float32", "cpu", 1, 2)
    a = kv.scratch("k", (3, 2, 8), torch.float32)
    assert a.shape == (3, 2, 8) and kv.scratch("k", (2, 2, 8), torch.float32).data_ptr() == a.data_ptr()
    assert kv.scratch("v", (3, 2, 8), torch.float32).data_ptr() != a.data_ptr()
    big = kv.scratch("k", (10, 2, 8), torch.float32)
    assert big.shape == (10, 2, 8) and kv.scratch("k", (10, 2, 8), torch.float32).data_ptr() == big.data_ptr()
