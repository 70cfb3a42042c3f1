"""The conversation cache: the authoritative chunk map and the conversations held in it between requests.

A held conversation is idle: it sits in a slot whose request ended (table = the slot) or in a parked table
(table >= n_slots). Every change of a table goes through `map`, whose op log the scheduler sends to every stage.

Rules:
- Parking moves a slot's conversation into a fresh table by swapping the two tables: no K/V byte moves with the
  pool on. Pool off (StaticMap) there is one park region: a new park gives the older parked conversation way,
  and the swap is a byte exchange on the stages.
- Bringing a parked conversation into a slot is the same swap; the slot's previous conversation, if any, takes
  the parked table's place (it stays held).
- `reserve` backs cells for a table, evicting idle conversations in `pool.policy.eviction_plan` order (all held
  conversations rank 1: cached, worth keeping; then least recently used) when that is what it takes, and
  evicts nobody when even all of them would not cover it. A conversation counts the cells only it holds (a
  chunk it shares with another table is freed only by the last holder); when those do not cover it, the
  chunks only held conversations share count too (`pool.policy.shared_eviction_plan`).
- A model with linear-attention state: each table's state entry moves with its chunks (`entries`,
  coordinator/linear_state.py rule 1), and so do its state checkpoints (coordinator/state_checkpoints.py); a
  park with no entry free drops an older parked conversation.
- `share(slot, chunks)` maps a shared run of full chunks (pool/chunk_map.py rules 12-17) into an empty slot;
  releasing or evicting a table drops its references, and frees only the chunks no other table holds.
"""
from __future__ import annotations

import logging

from pool.chunk_map import ChunkMap, StaticMap
from pool.logs import event
from pool.policy import Candidate, eviction_plan, shared_eviction_plan

from .conversations import Conversation
from .linear_state import StateEntries

log = logging.getLogger("strata.cache")

RANK_CACHED = 1  # a held or parked conversation someone may come back to


class ConversationCache:
    def __init__(self, map: ChunkMap | StaticMap, n_slots: int) -> None:
        self.map = map
        self.n_slots = n_slots
        self.held: dict[int, Conversation] = {}  # table -> conversation (idle slots and parked tables)
        self.counters = {"evictions": 0, "moves": 0, "shares": 0}
        self.entries: StateEntries | None = None  # a model with linear-attention state (linear_state.py rule 1)

    def parked(self) -> list[int]:
        return [t for t in self.held if t >= self.n_slots]

    def hold(self, table: int, tokens: list[int], answer_at: int | None = None) -> None:
        """`table` keeps the conversation whose K/V fill its cells [0, len(tokens)), its last answer from
        `answer_at` on; the tail is given back (and a shared chunk `tokens` ends inside, which the map never
        keeps in part)."""
        self.map.shrink(table, len(tokens))
        self.held[table] = Conversation(table, tokens[: self.map.held_cells(table)], answer_at=answer_at)

    def release(self, table: int) -> None:
        """Drop what `table` holds (a parked table is dropped with it)."""
        self.held.pop(table, None)
        self.map.release(table)
        if self.entries is not None:
            self.entries.checkpoints.drop(table)
        if table >= self.n_slots:
            self.map.drop_table(table)
            if self.entries is not None:
                self.entries.drop(table)

    def evict(self, table: int) -> None:
        self.release(table)
        self.counters["evictions"] += 1

    def flush(self) -> int:
        """Every held conversation gives its cells back; returns the cells freed."""
        before = self.map.free_cells
        for table in list(self.held):
            self.release(table)
        return self.map.free_cells - before

    def park_table(self) -> int | None:
        """A fresh table for a parked conversation; StaticMap's one park region is freed for it if taken."""
        table = self.map.new_table()
        if table is None:
            for t in self.parked():
                self.evict(t)
            table = self.map.new_table()
        return table

    def park(self, slot: int) -> None:
        """Move a slot's held conversation out of the slot, keeping it."""
        conv = self.held.pop(slot)
        table = self.park_table()
        if table is None:
            self.map.release(slot)
            return
        self.map.swap(slot, table)
        conv.table = table
        self.held[table] = conv
        self.counters["moves"] += 1
        if self.entries is not None:
            self._entry_for(slot, table)

    def _entry_for(self, slot: int, parked: int) -> None:
        """The slot whose conversation just went to `parked` (with its state entry) takes a free entry; with
        none free, an older parked conversation is dropped for its entry, else `parked` itself (rule 1)."""
        assert self.entries is not None
        self.entries.swap(slot, parked)
        if self.entries.give(slot):
            return
        older = sorted((c.last_used, t) for t, c in self.held.items() if t >= self.n_slots and t != parked)
        self.evict(older[0][1] if older else parked)
        self.entries.give(slot)

    def entry_for_table(self, table: int) -> bool:
        """Give fresh parked `table` a state entry: a free one, else the least recently used other parked
        conversation is dropped for its entry. False when there is none to take."""
        assert self.entries is not None
        if self.entries.give(table):
            return True
        older = sorted((c.last_used, t) for t, c in self.held.items() if t >= self.n_slots and t != table)
        if not older:
            return False
        self.evict(older[0][1])
        return self.entries.give(table)

    def bring(self, conv: Conversation, slot: int) -> None:
        """Move held `conv` into `slot` (admission by move); the slot's own conversation takes its table."""
        if conv.table == slot:
            return
        parked = conv.table
        self.map.swap(slot, parked)
        if self.entries is not None:
            self.entries.swap(slot, parked)
        self.counters["moves"] += 1
        del self.held[parked]
        other = self.held.pop(slot, None)
        if other is not None:
            other.table = parked
            self.held[parked] = other
        else:
            self.map.drop_table(parked)
            if self.entries is not None:
                self.entries.drop(parked)
        conv.table = slot
        self.held[slot] = conv

    def share(self, slot: int, chunks: list[int]) -> None:
        """Map a shared run (`ChunkMap.lookup`) into `slot`, which must hold nothing."""
        self.map.share(slot, chunks)
        self.counters["shares"] += 1

    def reserve(self, table: int, cells: int) -> bool:
        """Back `cells` cells of `table`, evicting idle conversations if that is what it takes."""
        if self.map.reserve(table, cells):
            return True
        cands = [Candidate(t, RANK_CACHED, c.last_used, self.map.exclusive_cells(t))
                 for t, c in self.held.items() if t != table]
        free, own = self.map.free_cells, self.map.held_cells(table)
        plan = eviction_plan(free, own, cells, cands)
        if plan is None:
            plan = shared_eviction_plan(free, own, cells, cands, self.map.cells_freed_by)
        if not plan:
            return False
        for t in plan:
            self.evict(t)
            event(log, "pool.evict", table=t, cells_free=self.map.free_cells)
        return self.map.reserve(table, cells)
