"""The pool accounting every scheduler test ends with."""
from __future__ import annotations

from coordinator.scheduler import Scheduler


def assert_pool_accounted(sched: Scheduler) -> None:
    """Idle: the held conversations' distinct chunks and the free ones make the pool (a shared chunk once),
    and flushing the cache gives every cell back."""
    m, c = sched.map, sched.cfg.engine.chunk_cells
    distinct = {ch for t in sched.held for ch in m.entries(t)[: m.held_chunks(t)]}
    assert all(j is None for j in sched.jobs)
    assert m.free_cells + len(distinct) * c == m.total_cells
    assert sum(m.held_chunks(t) for t in sched.held) * c == len(distinct) * c + m.saved_cells
    sched.flush_cache()
    assert sched.map.free_cells == sched.map.total_cells
