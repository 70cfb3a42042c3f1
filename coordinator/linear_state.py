"""Conversations of a model with linear-attention layers (Qwen3-Next): their state entries, and what may be reused.

Such a stage keeps, beside its K/V cells, a pool of state entries (stages/state_pool.py, `engine.state_entries`,
default 2 x parallel): each the conv and recurrent state after every token one conversation absorbed, a fixed
size however long it is. A state cannot be rewound, cut or shared: it is that of one whole token sequence. A
stage says it keeps entries in its HELLO (`state_entries`: how many), and refuses a step that continues an entry
holding another prefix, so no rule here can make an answer wrong, only slower.

While any stage keeps entries, the coordinator owns which entry each table's conversation lives in
(`StateEntries`), as it owns which chunks each table holds, and every step names each row's entry in its header
(`"states": [entry, ...]`, in the order of `"slots"`):

1. Entries follow tables. Slot s starts with entry s; the others are free. Parking swaps the slot's entry into
   the parked table with its chunks (no state byte moves); the slot then takes a free entry. With none free, the
   least recently used other parked conversation is dropped for its entry, and with no other parked one the
   conversation just parked is dropped instead (its entry stays with the slot). Bringing a parked conversation
   into a slot swaps the two tables' entries as it swaps their chunks; a dropped parked table frees its entry.
2. A held conversation is reused by a prompt that continues it whole (its entry holds exactly its tokens), from
   its slot or, brought in, from its parked table. A branch inside it, or a match below its end, reuses the
   longest checkpoint of its state at a chunk boundary below the branch (coordinator/state_checkpoints.py), or
   starts cold; prefix sharing is off (a shared run of chunks would come without the state at its end).
3. A (re)joined stage keeps a held conversation only if the entry its table owns still holds exactly its tokens:
   a CPU stage's entries live in a state file beside its pool file and its HELLO says what each holds
   (`state_held`, stages/state_pool.py rule 5); a CUDA stage reports none, and every held conversation is
   dropped, counted as lost. Checkpoints whose entry does not hold their boundary are forgotten. A session file keeps a
   conversation's state with its cells (coordinator/slot_files.py): a restore gives its table an entry.
"""
from __future__ import annotations

from collections.abc import Callable

from .conversations import Match
from .state_checkpoints import StateCheckpoints


def state_entries(stage_hello: Callable[[int], dict | None], n_stages: int) -> int:
    """The fewest state entries any stage that keeps them reports (0: none keeps any)."""
    counts = [int((stage_hello(i) or {}).get("state_entries") or 0) for i in range(n_stages)]
    kept = [c for c in counts if c > 0]
    return min(kept) if kept else 0


def reusable(match: Match | None, checkpoints: StateCheckpoints) -> Match | None:
    """Rule 2: `match` when the prompt continues its conversation whole; else cut to the longest checkpoint of
    its state at or below the match (coordinator/state_checkpoints.py rule 4), or None."""
    if match is None or match.reuse >= len(match.conversation.tokens):
        return match
    best = checkpoints.best(match.conversation.table, match.reuse)
    return None if best is None else Match(match.conversation, best[0])


def state_checkpoints(stage_hello: Callable[[int], dict | None], n_stages: int) -> int:
    """The fewest checkpoint entries any stage that keeps state reports (coordinator/state_checkpoints.py)."""
    counts = [int(h.get("state_checkpoints") or 0) for h in (stage_hello(i) or {} for i in range(n_stages))
              if h.get("state_entries")]
    return min(counts) if counts else 0


def lost_states(entries: "StateEntries", held: dict, hello: dict, lost: list[int]) -> list[int]:
    """Rule 3: the held tables (beside `lost`) whose state a (re)joined stage with `hello` no longer holds;
    forgets the checkpoints it does not hold either. A stage without linear layers holds every state it has."""
    if not hello.get("state_entries"):
        return []
    have = hello.get("state_held") or []

    def holds(entry: int | None, n: int) -> bool:
        return entry is not None and 0 <= entry < len(have) and have[entry] == n

    entries.checkpoints.verify(holds)
    return [t for t, conv in held.items() if t not in lost and not holds(entries.of.get(t), len(conv.tokens))]


class StateEntries:
    """Which state entry each table (slot or parked) holds (rule 1), and its checkpoints (entries numbered after
    these, coordinator/state_checkpoints.py); the cache keeps both in step with the map."""

    def __init__(self, n_entries: int, n_slots: int, n_checkpoints: int = 0, chunk_cells: int = 1) -> None:
        if n_entries < n_slots:
            raise ValueError(f"{n_entries} state entries for {n_slots} slots: every slot needs one")
        self.n_entries, self.n_slots = n_entries, n_slots
        self.checkpoints = StateCheckpoints(n_entries, n_checkpoints, chunk_cells)
        self.of: dict[int, int] = {s: s for s in range(n_slots)}  # table -> entry
        self.free: list[int] = list(range(n_entries - 1, n_slots - 1, -1))  # popped from the end: lowest first

    def swap(self, a: int, b: int) -> None:
        """Tables a and b exchange their entries (a table without one gives none)."""
        ea, eb = self.of.pop(a, None), self.of.pop(b, None)
        if eb is not None:
            self.of[a] = eb
        if ea is not None:
            self.of[b] = ea
        self.checkpoints.swap(a, b)

    def drop(self, table: int) -> None:
        """A dropped parked table's entry becomes free (and its checkpoints)."""
        self.checkpoints.drop(table)
        e = self.of.pop(table, None)
        if e is not None:
            self.free.append(e)

    def give(self, slot: int) -> bool:
        """Make sure `slot` has an entry: False when it has none and none is free."""
        if slot in self.of:
            return True
        if not self.free:
            return False
        self.of[slot] = self.free.pop()
        return True

    def rows(self, slots: list[int]) -> list[int]:
        """The step header's `states` for these slots."""
        return [self.of[s] for s in slots]

    def check(self) -> None:
        """Every entry in exactly one place, every slot with one (for tests)."""
        placed = list(self.of.values()) + self.free
        assert sorted(placed) == list(range(self.n_entries)), (self.of, self.free)
        assert all(s in self.of for s in range(self.n_slots)), self.of
