"""Checkpoints of a hybrid model's linear-attention state at chunk boundaries, so a branch can reuse a prefix.

A conversation's state entry (coordinator/linear_state.py) holds the state after all of its tokens; it cannot be
rewound. So a prompt that branches inside a held conversation (an answer asked again, an edited last turn) would
read its whole prompt again. Each stage with linear-attention layers keeps `engine.state_checkpoints` more
entries (numbered after the `engine.state_entries` ones, stages/state_pool.py) for copies of the state at chunk
boundaries, and the coordinator owns them as it owns the table entries:

1. A checkpoint is (table, at, entry): entry holds the state of table's conversation after its first `at`
   tokens, a multiple of `engine.chunk_cells`. A step row ending at such a boundary asks the stages to copy the
   row's entry into a checkpoint entry once the step ran (header `"keep": [[row, entry], ...]`); the entry is a
   free one, else the least recently used one not pinned (its checkpoint is forgotten). A boundary the table
   already has a checkpoint at is not kept again.
2. A prefill piece of such a model ends at the first chunk boundary it reaches (the scheduler cuts it there),
   so a prompt leaves a checkpoint at every boundary it crosses, and so does decode. With `engine.chunk_cells`
   below `engine.prefill_chunk` this makes pieces of at most chunk_cells tokens (the defaults, 4096 and 512,
   cut one piece per boundary at most).
3. Checkpoints follow their table: parking and bringing swap them with the table's chunks and entry; a table
   whose conversation is released or evicted loses them; a table cut to n tokens (a job starting at n) loses
   those past n.
4. A prompt matching a held conversation below its end reuses the longest checkpoint at or below the match
   (`best`): the conversation is moved in and cut to that boundary, and the job's first step asks the stages to
   copy the checkpoint into the slot's entry before it runs (header `"restore": [[checkpoint, entry]]`). The
   checkpoint is pinned from admission until that step is built (steps run in order on every stage, so no later
   keep can overwrite it first).
5. A (re)joined stage keeps the checkpoints whose entry it still holds at their boundary (its HELLO's
   `state_held`, coordinator/linear_state.py rule 3); the others are forgotten (`verify`).
A stage still refuses a step whose entry does not hold exactly its start (stages/state_pool.py rule 1), so a
wrong checkpoint can only fail a request, never make an answer wrong.
"""
from __future__ import annotations


class StateCheckpoints:
    """Checkpoint entries [first, first + count) and which (table, at) each holds (module docstring)."""

    def __init__(self, first: int, count: int, chunk_cells: int) -> None:
        self.first, self.count, self.chunk_cells = first, count, chunk_cells
        self.free: list[int] = list(range(first + count - 1, first - 1, -1))  # popped from the end: lowest first
        self.of: dict[int, dict[int, int]] = {}  # table -> {at: entry}
        self.owner: dict[int, tuple[int, int]] = {}  # entry -> (table, at)
        self.used: dict[int, int] = {}  # entry -> last use (a counter)
        self.pinned: set[int] = set()
        self._clock = 0

    def _touch(self, entry: int) -> None:
        self._clock += 1
        self.used[entry] = self._clock

    def _forget(self, entry: int) -> None:
        table, at = self.owner.pop(entry)
        del self.of[table][at]
        if not self.of[table]:
            del self.of[table]
        self.used.pop(entry, None)
        self.pinned.discard(entry)
        self.free.append(entry)

    def keep(self, table: int, at: int) -> int | None:
        """Rule 1: the entry to copy table's state after `at` tokens into; None when it is no boundary, already
        kept, or every entry is pinned."""
        if self.count == 0 or at <= 0 or at % self.chunk_cells or at in self.of.get(table, {}):
            return None
        if not self.free:
            victims = [e for e in self.owner if e not in self.pinned]
            if not victims:
                return None
            self._forget(min(victims, key=lambda e: self.used[e]))
        entry = self.free.pop()
        self.of.setdefault(table, {})[at] = entry
        self.owner[entry] = (table, at)
        self._touch(entry)
        return entry

    def best(self, table: int, reuse: int) -> tuple[int, int] | None:
        """Rule 4: (at, entry) of table's longest checkpoint at or below `reuse`."""
        kept = [at for at in self.of.get(table, {}) if at <= reuse]
        if not kept:
            return None
        at = max(kept)
        return at, self.of[table][at]

    def pin(self, entry: int) -> None:
        self.pinned.add(entry)
        self._touch(entry)

    def unpin(self, entry: int) -> None:
        self.pinned.discard(entry)

    def swap(self, a: int, b: int) -> None:
        """Rule 3: tables a and b exchange their checkpoints."""
        ca, cb = self.of.pop(a, None), self.of.pop(b, None)
        for table, kept in ((b, ca), (a, cb)):
            if kept:
                self.of[table] = kept
                for at, entry in kept.items():
                    self.owner[entry] = (table, at)

    def drop(self, table: int) -> None:
        """Rule 3: a released table loses every checkpoint."""
        self.trim(table, 0)

    def trim(self, table: int, n: int) -> None:
        """Rule 3: table keeps the checkpoints at or below n tokens."""
        for at, entry in list(self.of.get(table, {}).items()):
            if at > n:
                self._forget(entry)

    def verify(self, holds) -> None:
        """Rule 5: forget each checkpoint unless `holds(entry, at)`."""
        for entry, (_, at) in list(self.owner.items()):
            if not holds(entry, at):
                self._forget(entry)

    def check(self) -> None:
        """Every checkpoint entry in exactly one place (for tests)."""
        placed = sorted(list(self.owner) + self.free)
        assert placed == list(range(self.first, self.first + self.count)), (self.owner, self.free)
        assert all(self.of[t][at] == e for e, (t, at) in self.owner.items()), (self.of, self.owner)
