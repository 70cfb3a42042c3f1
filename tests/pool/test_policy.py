"""eviction_plan: exact victim orders for every rule in pool/policy.py."""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from pool.policy import Candidate, eviction_plan, shared_eviction_plan


def cand(id: int, rank: int = 1, last_used: float = 0, cells: int = 16) -> Candidate:
    return Candidate(id=id, rank=rank, last_used=last_used, cells=cells)


def test_no_need_gives_empty_plan_not_none():
    many = [cand(1), cand(2)]
    assert eviction_plan(free_cells=32, own_cells=0, want_cells=32, candidates=many) == []
    assert eviction_plan(free_cells=16, own_cells=16, want_cells=32, candidates=many) == []
    assert eviction_plan(free_cells=0, own_cells=48, want_cells=32, candidates=[]) == []  # a shrink
    assert eviction_plan(free_cells=0, own_cells=0, want_cells=0, candidates=[]) == []


def test_need_counts_own_and_free_cells():
    cands = [cand(7, cells=16), cand(8, last_used=1, cells=16)]
    # need = 64 - 16 - 16 = 32 -> both
    assert eviction_plan(16, 16, 64, cands) == [7, 8]
    # need = 64 - 32 - 16 = 16 -> one
    assert eviction_plan(16, 32, 64, cands) == [7]
    # need = 1 -> one whole candidate
    assert eviction_plan(15, 0, 16, cands) == [7]


def test_rank_before_recency():
    cands = [
        cand(1, rank=1, last_used=0),   # parked, oldest of all
        cand(2, rank=0, last_used=50),  # worth nothing, recently used
        cand(3, rank=0, last_used=10),
    ]
    assert eviction_plan(0, 0, 16, cands) == [3]
    assert eviction_plan(0, 0, 32, cands) == [3, 2]
    assert eviction_plan(0, 0, 48, cands) == [3, 2, 1]


def test_least_recently_used_first_then_lower_id():
    cands = [cand(9, last_used=5), cand(4, last_used=5), cand(6, last_used=2), cand(5, last_used=7)]
    assert eviction_plan(0, 0, 64, cands) == [6, 4, 9, 5]
    assert eviction_plan(0, 0, 17, cands) == [6, 4]


def test_order_does_not_depend_on_input_order():
    cands = [cand(1, 0, 3), cand(2, 1, 1), cand(3, 0, 3), cand(4, 1, 0), cand(5, 2, 0)]
    plans = {tuple(eviction_plan(0, 0, 80, list(p))) for p in itertools.permutations(cands)}
    assert plans == {(1, 3, 4, 2, 5)}


def test_stops_as_soon_as_need_is_covered():
    cands = [cand(1, cells=10), cand(2, last_used=1, cells=100), cand(3, last_used=2, cells=5)]
    # 10 is short of 11; 10 + 100 covers it; 3 is kept although evicting it too would be cheap.
    assert eviction_plan(0, 0, 11, cands) == [1, 2]
    # Strict order, not the smallest cover: [2] alone would do, but 1 comes first.
    assert eviction_plan(0, 0, 100, cands) == [1, 2]


def test_not_enough_evicts_nobody():
    cands = [cand(1, cells=16), cand(2, cells=16)]
    assert eviction_plan(0, 0, 33, cands) is None
    assert eviction_plan(0, 0, 16, []) is None
    assert eviction_plan(0, 0, 32, cands) == [1, 2]  # exactly enough is enough


def test_empty_candidates_are_never_victims():
    cands = [cand(1, rank=0, cells=0), cand(2, cells=16), cand(3, rank=0, cells=-4)]
    assert eviction_plan(0, 0, 16, cands) == [2]
    assert eviction_plan(0, 0, 17, cands) is None


def test_candidate_is_frozen():
    c = cand(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.cells = 0  # type: ignore[misc]


# ---- shared chunks: rules 6-7 ---------------------------------------------------------------------------------
def freed_by(holders: dict[int, set[int]], chunk_cells: int = 16):
    """What evicting `ids` frees when chunk c is held by the tables holders[c] (-1: a table that is not a
    candidate, e.g. the requester)."""
    return lambda ids: sum(chunk_cells for h in holders.values() if h <= set(ids))


def test_chunks_only_candidates_share_are_freed_by_the_last_of_them():
    # chunk 0: shared by 1 and 2; chunk 1: 2 alone; chunk 2: shared by 3 and the requester (-1)
    holders = {0: {1, 2}, 1: {2}, 2: {3, -1}}
    cands = [cand(1, last_used=0, cells=0), cand(2, last_used=1, cells=16), cand(3, last_used=2, cells=0)]
    assert eviction_plan(0, 0, 32, cands) is None  # their own cells cover 16 of the 32 missing
    assert shared_eviction_plan(0, 0, 32, cands, freed_by(holders)) == [1, 2]
    assert shared_eviction_plan(0, 0, 16, cands, freed_by(holders)) == [1, 2]  # 1 first, though only 2 frees alone
    assert shared_eviction_plan(0, 0, 48, cands, freed_by(holders)) is None  # chunk 2 stays with the requester
    assert shared_eviction_plan(32, 0, 32, cands, freed_by(holders)) == []


def test_a_candidate_that_can_free_nothing_is_skipped():
    holders = {0: {2, 3}, 1: {1, -1}, 2: {3}}
    cands = [cand(1, last_used=0, cells=0), cand(2, last_used=1, cells=0), cand(3, last_used=2, cells=16)]
    assert shared_eviction_plan(0, 0, 32, cands, freed_by(holders)) == [2, 3]  # 1 holds only the requester's
    assert shared_eviction_plan(0, 0, 16, cands, freed_by(holders)) == [2, 3]  # in order: 2 comes before 3
    assert shared_eviction_plan(0, 16, 48, cands, freed_by(holders)) == [2, 3]
    assert shared_eviction_plan(0, 0, 64, cands, freed_by(holders)) is None
