"""One step's tokens and the index tensors every layer of the step shares.

A step header lists `[[slot, start, n, sample], ...]`: slot `slot` reads `n` new tokens at positions
`start .. start+n-1`, so its context after the step is `start + n` cells. The step's token rows are the
concatenation of the entries in header order (entry b owns rows `cu_seqlens[b] .. cu_seqlens[b+1]-1`), which is
the order of the token ids frame and of the hidden states passed between stages.

Attention reads the step in groups (`groups`), so that no entry pays for another's shape:

    decode group     every entry with n == 1: one query row each, padded only to the group's longest context
    prefill groups   one per entry with n > 1: its own rows and its own context, no padding at all

A step that mixes a 256-token prompt piece with decodes therefore costs the decodes one row each, not 256.

`query_index`, `query_pos`, `query_valid`, `token_seq`, `token_row` describe the whole step as one padded
batch (`B` entries, `Q` = the largest n); attention no longer uses them, so they are built only when read:

    query_index [B, Q]   token row of query (b, i); padding repeats the entry's first row
    query_pos   [B, Q]   its position; padding rows use position 0
    token_seq / token_row [T]   the way back: token t is query (token_seq[t], token_row[t])

Building a step makes one tensor (the positions) plus what the groups need; every other index tensor is made
on first read.

`state_entries[b]` is the linear-attention state entry (stages/state_pool.py) entry b reads and writes; by default
its slot. Two entries of one step never name the same state entry (they would race on it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass(frozen=True)
class AttentionGroup:
    """Entries of a step that attention reads in one call (see the module docstring).

    Rows `rows` of the step's queries belong to the group, in entry order: a `range` when they are
    consecutive (a view of the queries, no copy), else an int64 tensor. `contexts[i]` is entry i's context
    (start + n); `first` is its first position (start). `uniform`: every entry has context `max_context`.
    """

    kind: str  # "decode" | "prefill"
    entries: tuple[int, ...]
    slots: tuple[int, ...]
    firsts: tuple[int, ...]
    contexts: tuple[int, ...]
    max_new: int  # Q: 1 for the decode group, n for a prefill entry
    max_context: int  # L: the group's longest context
    rows: range | torch.Tensor

    @property
    def uniform(self) -> bool:
        return min(self.contexts) == self.max_context

    @property
    def num_rows(self) -> int:
        return len(self.entries) * self.max_new


@dataclass(eq=False)
class StepBatch:
    """One step's entries and index tensors; build it with `StepBatch.from_slots`.

    Every layer needs `positions` (rotary) and the attention groups; the other tensors (int64 unless stated)
    are made from Python lists the first time something reads them, so a step pays only for what its
    stage uses (a small decode step is short enough for a dozen tensor constructions to show).
    """

    slots: list[tuple[int, int, int, int]]
    device: torch.device
    num_tokens: int  # T
    max_new: int  # Q, the largest n
    max_context: int  # L, the longest start + n
    positions: torch.Tensor  # [T]
    sample_slots: list[int]  # the slots of the entries with sample=1, in entry order
    groups: list[AttentionGroup]  # the decode group first (when there are decodes), then one per prefill entry
    cu: list[int]  # cu_seqlens as a list
    state_entries: list[int] = field(default_factory=list)  # per entry; from_slots: the slot unless given
    # Per-step values derived from the KV tables (attention fills it): the tables must not change mid-step.
    cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    @property
    def all_decode(self) -> bool:
        """Every entry reads one token (the decode group is the whole step, rows in order)."""
        return self.max_new == 1

    @cached_property
    def slot_ids(self) -> torch.Tensor:
        """[B] slot of each entry."""
        return self._tensor([e[0] for e in self.slots])

    @cached_property
    def starts(self) -> torch.Tensor:
        """[B] first position of each entry."""
        return self._tensor([e[1] for e in self.slots])

    @cached_property
    def counts(self) -> torch.Tensor:
        """[B] n of each entry."""
        return self._tensor([e[2] for e in self.slots])

    @cached_property
    def context_lens(self) -> torch.Tensor:
        """[B] start + n of each entry."""
        return self._tensor([e[1] + e[2] for e in self.slots])

    @cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """int32 [B + 1]: entry b owns rows cu_seqlens[b] .. cu_seqlens[b+1]-1."""
        return self._tensor(self.cu, torch.int32)

    @cached_property
    def token_slot(self) -> torch.Tensor:
        """[T] slot of each token."""
        return self._tensor([slot for slot, _, n, _ in self.slots for _ in range(n)])

    @cached_property
    def token_context(self) -> torch.Tensor:
        """[T] context length (start + n) of each token's entry."""
        return self._tensor([start + n for _, start, n, _ in self.slots for _ in range(n)])

    @cached_property
    def sample_rows(self) -> torch.Tensor:
        """[S] last token row of each entry with sample=1, in entry order."""
        return self._tensor([self.cu[b + 1] - 1 for b, e in enumerate(self.slots) if e[3]])

    # The whole step as one padded batch (module docstring); attention does not use it.
    @cached_property
    def token_seq(self) -> torch.Tensor:
        return self._tensor([b for b, (_, _, n, _) in enumerate(self.slots) for _ in range(n)])

    @cached_property
    def token_row(self) -> torch.Tensor:
        return self._tensor([i for _, _, n, _ in self.slots for i in range(n)])

    @cached_property
    def query_valid(self) -> torch.Tensor:
        counts = torch.tensor([e[2] for e in self.slots])
        return self._dev(torch.arange(self.max_new)[None, :] < counts[:, None])

    @cached_property
    def query_index(self) -> torch.Tensor:
        i = torch.arange(self.max_new)[None, :]
        cu = torch.tensor(self.cu[:-1], dtype=torch.int64)[:, None]
        return self._dev(cu + torch.where(self.query_valid.cpu(), i, 0))

    @cached_property
    def query_pos(self) -> torch.Tensor:
        i = torch.arange(self.max_new)[None, :]
        starts = torch.tensor([e[1] for e in self.slots])[:, None]
        return self._dev(torch.where(self.query_valid.cpu(), starts + i, 0))

    def _tensor(self, values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return self._dev(torch.tensor(values, dtype=dtype))

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    @classmethod
    def from_slots(cls, slots: list, device: torch.device | str = "cpu",
                   state_entries: list[int] | None = None) -> "StepBatch":
        """Build the step from `[[slot, start, n, sample], ...]` and, optionally, one state entry per entry.

        Rules: at least one entry; n >= 1; start >= 0; sample is 0 or 1; a slot appears at most once per step
        (two entries writing one table in one step would race), and so does a state entry.
        """
        entries = [tuple(int(v) for v in e) for e in slots]
        if not entries:
            raise ValueError("a step needs at least one slot")
        seen: set[int] = set()
        for slot, start, n, sample in entries:
            if n < 1 or start < 0 or sample not in (0, 1) or slot < 0:
                raise ValueError(f"bad step entry [slot={slot}, start={start}, n={n}, sample={sample}]")
            if slot in seen:
                raise ValueError(f"slot {slot} appears twice in one step")
            seen.add(slot)
        states = [e[0] for e in entries] if state_entries is None else [int(v) for v in state_entries]
        if len(states) != len(entries) or min(states) < 0 or len(set(states)) != len(states):
            raise ValueError(f"state entries {list(state_entries or [])} for {len(entries)} step entries: one "
                             "non-negative entry each, none twice")
        device = torch.device(device)
        cu = [0]
        for e in entries:
            cu.append(cu[-1] + e[2])
        if cu[-1] == len(entries):  # a decode step: one row per entry
            positions = [e[1] for e in entries]
        else:
            positions = [p for _, start, n, _ in entries for p in range(start, start + n)]
        return cls(
            slots=entries,
            device=device,
            num_tokens=cu[-1],
            max_new=max(e[2] for e in entries),
            max_context=max(e[1] + e[2] for e in entries),
            positions=torch.tensor(positions, dtype=torch.int64).to(device, non_blocking=True),
            sample_slots=[e[0] for e in entries if e[3]],
            groups=_groups(entries, cu, device),
            cu=cu,
            state_entries=states,
        )


def _groups(entries: list[tuple[int, int, int, int]], cu: list[int], device: torch.device) -> list[AttentionGroup]:
    """The decode group (entries with n == 1, if any), then one prefill group per entry with n > 1."""
    groups = []
    decode = [b for b, e in enumerate(entries) if e[2] == 1]
    if decode:
        rows_l = [cu[b] for b in decode]
        rows: range | torch.Tensor = range(rows_l[0], rows_l[-1] + 1)
        if list(rows) != rows_l:
            rows = torch.tensor(rows_l, dtype=torch.int64).to(device, non_blocking=True)
        groups.append(AttentionGroup(
            "decode", tuple(decode), tuple(entries[b][0] for b in decode), tuple(entries[b][1] for b in decode),
            tuple(entries[b][1] + 1 for b in decode), 1, max(entries[b][1] + 1 for b in decode), rows))
    for b, (slot, start, n, _) in enumerate(entries):
        if n > 1:
            groups.append(AttentionGroup("prefill", (b,), (slot,), (start,), (start + n,), n, start + n,
                                         range(cu[b], cu[b + 1])))
    return groups
