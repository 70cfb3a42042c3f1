"""One step's tokens and the index tensors every layer of the step shares.

A step header lists `[[slot, start, n, sample], ...]`: slot `slot` reads `n` new tokens at positions
`start .. start+n-1`, so its context after the step is `start + n` cells. The step's token rows are the
concatenation of the entries in header order (entry b owns rows `cu_seqlens[b] .. cu_seqlens[b+1]-1`), which is
the order of the token ids frame and of the hidden states passed between stages.

Attention works on a padded view, one row per entry (`B` entries, `Q` = the largest n, `L` = the longest
context):

    query_index [B, Q]   token row of query (b, i); padding repeats the entry's first row
    query_pos   [B, Q]   its position; padding rows use position 0, so they see cell 0 only (never a row of
                         nothing, which would make softmax NaN) and their output is dropped
    token_seq / token_row [T]   the way back: token t is query (token_seq[t], token_row[t])
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepBatch:
    """Index tensors (int64 unless stated) of one step; build it with `StepBatch.from_slots`."""

    slots: list[tuple[int, int, int, int]]
    device: torch.device
    num_tokens: int  # T
    max_new: int  # Q, the largest n
    max_context: int  # L, the longest start + n
    slot_ids: torch.Tensor  # [B] slot of each entry
    starts: torch.Tensor  # [B]
    counts: torch.Tensor  # [B] n
    context_lens: torch.Tensor  # [B] start + n
    cu_seqlens: torch.Tensor  # int32 [B + 1]
    positions: torch.Tensor  # [T]
    token_slot: torch.Tensor  # [T] slot of each token
    token_seq: torch.Tensor  # [T] entry of each token
    token_row: torch.Tensor  # [T] index among its entry's new tokens
    token_context: torch.Tensor  # [T] context length of its entry
    query_index: torch.Tensor  # [B, Q]
    query_pos: torch.Tensor  # [B, Q]
    query_valid: torch.Tensor  # bool [B, Q]
    sample_rows: torch.Tensor  # [S] last token row of each entry with sample=1, in entry order
    sample_slots: list[int]  # the slots of those rows
    # Per-step values derived from the KV tables (attention fills it): the tables must not change mid-step.
    cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    @classmethod
    def from_slots(cls, slots: list, device: torch.device | str = "cpu") -> "StepBatch":
        """Build the step's index tensors from `[[slot, start, n, sample], ...]`.

        Rules: at least one entry; n >= 1; start >= 0; sample is 0 or 1; a slot appears at most once per step
        (two entries writing one table in one step would race).
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
        slot_ids = torch.tensor([e[0] for e in entries], dtype=torch.int64)
        starts = torch.tensor([e[1] for e in entries], dtype=torch.int64)
        counts = torch.tensor([e[2] for e in entries], dtype=torch.int64)
        samples = torch.tensor([e[3] for e in entries], dtype=torch.bool)
        n_seqs = len(entries)
        context_lens = starts + counts
        cu = torch.zeros(n_seqs + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(counts, 0)
        num_tokens = int(cu[-1])
        token_seq = torch.repeat_interleave(torch.arange(n_seqs), counts)
        token_row = torch.arange(num_tokens) - cu[token_seq]
        positions = starts[token_seq] + token_row
        max_new = int(counts.max())
        i = torch.arange(max_new)[None, :]
        query_valid = i < counts[:, None]
        query_index = cu[:-1, None] + torch.where(query_valid, i, 0)
        query_pos = torch.where(query_valid, starts[:, None] + i, 0)
        sample_rows = (cu[1:] - 1)[samples]

        def dev(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return cls(
            slots=entries,
            device=torch.device(device),
            num_tokens=num_tokens,
            max_new=max_new,
            max_context=int(context_lens.max()),
            slot_ids=dev(slot_ids),
            starts=dev(starts),
            counts=dev(counts),
            context_lens=dev(context_lens),
            cu_seqlens=dev(cu.to(torch.int32)),
            positions=dev(positions),
            token_slot=dev(slot_ids[token_seq]),
            token_seq=dev(token_seq),
            token_row=dev(token_row),
            token_context=dev(context_lens[token_seq]),
            query_index=dev(query_index),
            query_pos=dev(query_pos),
            query_valid=dev(query_valid),
            sample_rows=dev(sample_rows),
            sample_slots=[e[0] for e in entries if e[3]],
        )
