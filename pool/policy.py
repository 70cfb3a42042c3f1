"""Which held conversations give their chunks back when a reserve would fail (a pure function, no state).

Rules of `eviction_plan(free_cells, own_cells, want_cells, candidates)`:
 1. need = want_cells - own_cells - free_cells: the cells the pool lacks for a table that already holds
    `own_cells` and wants `want_cells`. need <= 0 -> [] (nothing to evict; the reserve fits as is).
 2. Victims are taken in this order: rank ascending (0 = nothing worth keeping, 1 = a cached or parked
    conversation; higher ranks are kept longer still), then least recently used first (smaller `last_used`),
    then the lower id, so equal candidates always give the same plan.
 3. Victims are taken in that order until their cells together cover need; the plan is that prefix, in
    order. It is not the smallest set that would cover need: evicting strictly by the order keeps the
    conversations most likely to be reused, and keeps the outcome easy to predict and test.
 4. A candidate holding no cells is never a victim: evicting it frees nothing.
 5. If all candidates together do not cover need, the plan is None: evict nobody (a refusal that keeps
    every conversation beats one that throws some away and still refuses).

All quantities are in cells. free_cells, own_cells and every `Candidate.cells` are whole chunks
(`ChunkMap.free_cells`, `held_cells`; a candidate's cells are what evicting it alone gives back,
`ChunkMap.exclusive_cells`: the chunks no other table holds); want_cells may be exact. Then need > 0 exactly
when the reserve fails, and a covered need means the reserve succeeds after the evictions. The requesting
table itself must not be among the candidates.

Shared chunks (pool/chunk_map.py rules 12-17): a chunk several tables hold is free only once the last of them
lets go, so it is in no candidate's cells. When the candidates' own cells do not cover need,
`shared_eviction_plan(free_cells, own_cells, want_cells, candidates, freed_by)` counts the chunks that only
candidates hold: `freed_by(ids)` is what evicting all of `ids` gives back (`ChunkMap.cells_freed_by`).
 6. If evicting every candidate would not cover need, the plan is None (rule 5).
 7. Otherwise victims are taken in the order of rule 2 until freed_by(victims) covers need, skipping every
    candidate whose eviction can never give anything back (each of its chunks is also held by a table that
    is not a candidate: the requester, a running request). The plan is that list, in order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass(frozen=True)
class Candidate:
    """A conversation that could give its chunks back: its table id, rank, last use (any monotonic clock,
    e.g. a step counter) and the cells it holds."""

    id: int
    rank: int
    last_used: float
    cells: int


def eviction_plan(
    free_cells: int, own_cells: int, want_cells: int, candidates: Iterable[Candidate]
) -> list[int] | None:
    """Ids to evict, in order, so that a table holding `own_cells` can reach `want_cells`; [] when nothing
    needs evicting, None when even evicting every candidate would not be enough (rules in the module doc)."""
    need = want_cells - own_cells - free_cells
    if need <= 0:
        return []
    plan: list[int] = []
    for c in sorted(candidates, key=lambda c: (c.rank, c.last_used, c.id)):
        if c.cells <= 0:
            continue
        plan.append(c.id)
        need -= c.cells
        if need <= 0:
            return plan
    return None


def shared_eviction_plan(free_cells: int, own_cells: int, want_cells: int, candidates: Iterable[Candidate],
                         freed_by: Callable[[list[int]], int]) -> list[int] | None:
    """Ids to evict, in order, counting the chunks that only candidates hold together (rules 6-7); None when
    evicting every candidate would not be enough."""
    need = want_cells - own_cells - free_cells
    if need <= 0:
        return []
    order = [c.id for c in sorted(candidates, key=lambda c: (c.rank, c.last_used, c.id))]
    everyone = freed_by(order)
    if everyone < need:
        return None
    plan: list[int] = []
    for i, cid in enumerate(order):
        if freed_by(order[:i] + order[i + 1:]) == everyone:
            continue  # without it the others free as much: nothing of it can ever be given back
        plan.append(cid)
        if freed_by(plan) >= need:
            return plan
    return plan
