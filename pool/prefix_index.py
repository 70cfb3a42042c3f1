"""The index of shareable chunks: full chunks of written K/V, found by the token ids they hold and every token
before them (bookkeeping only, no torch). ChunkMap owns one; its rules 12-17 say how tables use it.

    table that wrote them:  [ c0 | c1 | c2 | c3 (partial) | trash ... ]      C = chunk_cells
    keys:                   c0 <- (ROOT, ids[0:C])
                            c1 <- (c0,   ids[C:2C])
                            c2 <- (c1,   ids[2C:3C])
                            c3    none: not full, so a later write into it would change what a sharer reads

Rules:
 1. Only a full chunk is registered: all C cells hold written K/V (ChunkMap.publish is told so by the caller,
    who knows which steps have come back). A partial chunk never is.
 2. A chunk's key is (parent, its C token ids): parent is the chunk before it in the table that published it
    (ROOT for entry 0), registered itself. The parent stands exactly for every token before the chunk, down
    to entry 0, so a key names one prefix of token ids and nothing else: the chain that vLLM's prefix cache
    builds from hashes, built here from chunk ids, which cannot collide. Keys are looked up in a dict, whose hash
    only picks the bucket: the match is decided on the ids themselves, so no hash collision can hand over
    another conversation's cells.
 3. One chunk per key. A second chunk written with the same tokens (both prefilled before either was
    published) stays private, and so do the chunks after it (their parent is not registered).
 4. `match(ids, limit)` walks from ROOT and returns the chunks of the longest run of whole chunks of `ids` that
    are registered, at most `limit` of them.
 5. `remove(chunk)` forgets a chunk's key. ChunkMap removes it when the chunk is freed, and when the one table
    holding it is about to write into it. A registered chunk's parent is held as long as the chunk is (every
    table naming a chunk at entry i names its parent at entry i - 1: tables hold prefixes and a shared run is
    mapped from entry 0), so a parent's id is never handed out again while a key names it.
"""
from __future__ import annotations

from typing import Sequence

ROOT = -1  # the parent of entry 0

Key = tuple[int, tuple[int, ...]]


class PrefixIndex:
    """Registered full chunks by (parent, token ids); the module docstring states the rules."""

    def __init__(self, chunk_cells: int) -> None:
        self.chunk_cells = chunk_cells
        self._chunk_of: dict[Key, int] = {}
        self._key_of: dict[int, Key] = {}

    def __len__(self) -> int:
        return len(self._key_of)

    def registered(self, chunk: int) -> bool:
        return chunk in self._key_of

    def key_of(self, chunk: int) -> Key | None:
        return self._key_of.get(chunk)

    def key(self, parent: int, ids: Sequence[int]) -> Key:
        """The key of a chunk holding `ids` after `parent`; ValueError unless `ids` is one whole chunk."""
        if len(ids) != self.chunk_cells:
            raise ValueError(f"a chunk's key holds {self.chunk_cells} token ids, got {len(ids)}")
        return parent, tuple(ids)

    def add(self, chunk: int, parent: int, ids: Sequence[int]) -> bool:
        """Register `chunk` as holding `ids` after `parent` (rules 2-3). False, registering nothing, when the
        parent is not registered or another chunk already has that key; True when registered (or already so)."""
        if parent != ROOT and parent not in self._key_of:
            return False
        key = self.key(parent, ids)
        have = self._chunk_of.get(key)
        if have is not None:
            return have == chunk
        if chunk in self._key_of:
            raise ValueError(f"chunk {chunk} is already registered under another key")
        self._chunk_of[key] = chunk
        self._key_of[chunk] = key
        return True

    def remove(self, chunk: int) -> None:
        """Forget `chunk`'s key (nothing when it has none)."""
        key = self._key_of.pop(chunk, None)
        if key is not None:
            del self._chunk_of[key]

    def match(self, ids: Sequence[int], limit: int) -> list[int]:
        """The registered chunks holding ids[0:C], ids[C:2C], ... in a chain from ROOT, at most `limit`."""
        c, run, parent = self.chunk_cells, [], ROOT
        for i in range(min(limit, len(ids) // c)):
            chunk = self._chunk_of.get((parent, tuple(ids[i * c:(i + 1) * c])))
            if chunk is None:
                break
            run.append(chunk)
            parent = chunk
        return run
