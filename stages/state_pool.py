"""A stage's linear-attention state: fixed-size entries, one per conversation being computed, each holding the
state of every linear-attention layer of this stage (stages/linear_attention.py).

Unlike K/V, this state does not grow with the context: one entry is all a conversation needs however long it is,
so it lives apart from the chunked KV pool, in the stage's own memory.

Layout (E = entries, L = the stage's linear layers, in layer order; C = conv_dim, K = conv kernel):

    conv       [E, L, K - 1, C]        model dtype   the last K - 1 inputs of each layer's causal convolution
    recurrent  [E, L, nv, dk, dv]      float32       the delta rule's state S of each value head
    tokens     [E] (host ints)                       how many tokens of its conversation the entry has absorbed

Entry e is the first index of both arrays, so one entry is one contiguous block of each (copying a conversation's
state is two block copies). Size of one entry, in bytes (pool/layer_kinds.py rule 5):

    entry_nbytes = L * ((K - 1) * C * dtype_bytes + 4 * nv * dk * dv),   C = 2 * nk * dk + nv * dv

Rules:
1. A step names one entry per slot (`StepBatch.state_entries`, by default the slot itself). An entry whose step
   starts at position 0 starts from zeros, whatever it held; any other step continues the entry, and is refused
   unless the entry holds exactly `start` tokens: a linear state cannot be rewound, nor continued by another
   conversation, so a step that would compute on the wrong state is an error naming the slot and the entry.
2. `begin(batch)` checks every entry of the step before any layer runs (a refused step writes nothing) and marks
   them unknown; `commit(batch)` records start + n once every layer ran. A step that fails in between leaves its
   entries unknown: only a step from position 0 may use them again.
3. `forget()` marks every entry unknown (a new coordinator session: its conversations are not this stage's).
4. `copy(src, dst)` makes entry dst a copy of entry src, its token count included: a checkpoint of a row's state
   after a step (header `keep`), or one restored into a slot's entry before a step (header `restore`;
   coordinator/state_checkpoints.py). Both are checked before the step runs anything (`check_copies`).
5. On a CPU stage the entries live in a state file beside the pool file (pool/state_file.py), tokens included, so
   a stage restarted after a crash re-attaches them: its HELLO reports what each entry holds (`held()`), and the
   coordinator keeps the conversations whose entries hold exactly their tokens. A CUDA stage's entries are
   device memory (pool/state_file.py rule 4).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from pool.layer_kinds import LinearGeometry, state_entry_bytes
from pool.memory import PoolMismatch
from pool.state_file import StateFile, StateLayout
from stages.batch import StepBatch
from stages.tensors import mapped

__all__ = ["UNKNOWN", "StatePool", "state_entry_bytes"]  # state_entry_bytes(config, first, last, dtype_bytes)
UNKNOWN = -1  # tokens of an entry whose state is not that of any known prefix


class StatePool:
    """`n_entries` state entries for `n_layers` linear-attention layers of `geometry` (module docstring)."""

    def __init__(self, n_entries: int, n_layers: int, geometry: LinearGeometry, dtype: torch.dtype,
                 device: torch.device | str = "cpu", path: Path | None = None) -> None:
        if n_entries < 1 or n_layers < 1:
            raise ValueError(f"a state pool needs at least one entry and one layer, got {n_entries} x {n_layers}")
        g = geometry
        self.n_entries, self.n_layers, self.geometry = n_entries, n_layers, g
        self.device = torch.device(device)
        self.file: StateFile | None = None
        self.reattached = False
        if path is not None and self.device.type == "cpu":  # rule 5
            self.file, self.reattached = _open_state(path, StateLayout(
                n_entries, n_layers, g.kernel - 1, g.conv_dim, g.value_heads, g.key_dim, g.value_dim,
                str(dtype).removeprefix("torch.")))
            self.conv, self.recurrent = (_view(self.file, which) for which in ("conv", "recurrent"))
            self.tokens: list[int] | memoryview = self.file.tokens
            return
        self.conv = torch.zeros(n_entries, n_layers, g.kernel - 1, g.conv_dim, dtype=dtype, device=self.device)
        self.recurrent = torch.zeros(n_entries, n_layers, g.value_heads, g.key_dim, g.value_dim,
                                     dtype=torch.float32, device=self.device)
        self.tokens = [0] * n_entries  # zeros are the state after 0 tokens

    @property
    def session(self) -> str | None:
        """The coordinator session the entries belong to, when they live in a state file (rule 5)."""
        return self.file.session if self.file is not None else None

    @session.setter
    def session(self, value: str) -> None:
        if self.file is not None:
            self.file.session = value

    @property
    def entry_nbytes(self) -> int:
        """Bytes of one entry: conv and recurrent state of every layer (module docstring formula)."""
        return (self.conv[0].numel() * self.conv.element_size()
                + self.recurrent[0].numel() * self.recurrent.element_size())

    def begin(self, batch: StepBatch) -> None:
        """Rule 2: check every entry of the step against rule 1, then mark them unknown."""
        for (slot, start, _, _), e in zip(batch.slots, batch.state_entries):
            if not 0 <= e < self.n_entries:
                raise ValueError(f"slot {slot}: state entry {e} does not exist (this stage has {self.n_entries})")
            held = self.tokens[e]
            if start > 0 and held != start:
                what = "no valid state" if held == UNKNOWN else f"the state after {held} tokens"
                raise ValueError(
                    f"slot {slot}: state entry {e} holds {what}, but the step continues at position {start}; a "
                    "linear-attention state only continues where it stopped, or starts again at position 0")
        for e in batch.state_entries:
            self.tokens[e] = UNKNOWN

    def commit(self, batch: StepBatch) -> None:
        """Rule 2: every layer ran; each entry now holds start + n tokens."""
        for (_, start, n, _), e in zip(batch.slots, batch.state_entries):
            self.tokens[e] = start + n

    def check_copies(self, pairs: list) -> None:
        """Rule 4: every entry a copy names exists."""
        for pair in pairs:
            src, dst = (int(v) for v in pair)
            for e in (src, dst):
                if not 0 <= e < self.n_entries:
                    raise ValueError(f"state copy {src} -> {dst}: entry {e} does not exist (this stage has "
                                     f"{self.n_entries})")

    def copy(self, src: int, dst: int) -> None:
        """Rule 4: entry `dst` becomes a copy of entry `src` (state and token count); unknown while it changes."""
        if src != dst:
            held = self.tokens[src]
            self.tokens[dst] = UNKNOWN
            self.conv[dst].copy_(self.conv[src])
            self.recurrent[dst].copy_(self.recurrent[src])
            self.tokens[dst] = held

    def forget(self) -> None:
        """Rule 3."""
        for e in range(self.n_entries):
            self.tokens[e] = UNKNOWN

    def held(self) -> list[int]:
        """Tokens each entry holds (UNKNOWN: none known), for a restarted stage's HELLO (rule 5)."""
        return list(self.tokens)

    def close(self) -> None:
        if self.file is not None:
            self.tokens = [UNKNOWN] * self.n_entries  # the file's view goes with it
            self.conv = self.recurrent = None  # type: ignore[assignment]
            self.file.close()
            self.file = None

    def read(self, layer: int, entries: torch.Tensor, fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [B, K - 1, C], recurrent [B, nv, dk, dv]) of local linear layer `layer` for `entries` [B], zeros
        where `fresh` [B] (the entry's step starts at 0); copies, not views."""
        conv, rec = self.conv[entries, layer], self.recurrent[entries, layer]
        conv = torch.where(fresh[:, None, None], 0, conv)  # where, not a product: the old bytes may be anything
        rec = torch.where(fresh[:, None, None, None], 0, rec)
        return conv, rec

    def write(self, layer: int, entries: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor) -> None:
        """Store the step's new conv and recurrent state of `layer` for `entries`."""
        self.conv[entries, layer] = conv.to(self.conv.dtype)
        self.recurrent[entries, layer] = rec


def _open_state(path: Path, layout: StateLayout) -> tuple[StateFile, bool]:
    """(file, re-attached): the state file a crashed stage left when its layout matches, else a fresh one. The
    caller holds the pool file's lock; a file that is not private is refused, never replaced."""
    if os.path.lexists(path):
        try:
            return StateFile.attach(path, layout), True
        except PoolMismatch:
            pass
    return StateFile.create(path, layout), False


def _view(file: StateFile, which: str) -> torch.Tensor:
    return mapped(file.buffer, *file.layout.spec(which))
