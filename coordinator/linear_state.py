"""Conversations of a model with linear-attention layers (Qwen3-Next): what the coordinator may reuse.

Such a stage keeps, beside its K/V cells, one state entry per slot (stages/state_pool.py): the conv and
recurrent state after every token the slot's last conversation absorbed. A state cannot be rewound, cut or
shared: it is that of one whole token sequence. A stage says it keeps them in its HELLO (`state_entries` > 0),
and refuses a step that continues an entry holding another prefix. So, while any stage keeps state entries:

1. A held conversation is reused only by a prompt that continues it whole, in the slot that computed it (the
   slot's entry holds exactly its tokens). A branch inside it, or a match below its end, starts cold.
2. Prefix sharing is off: a shared run of chunks would come without the state at its end.
3. A conversation moved out of its slot (parked) loses its state when the slot computes another one: it is
   dropped instead of parked, its cells freed at once. No conversation is ever brought into another slot.
4. A (re)joined stage starts with no state its conversations could continue (the pool file holds K/V only):
   every held conversation is dropped, counted as lost. Session files are refused by such stages.
What this gives up, against the issue's design of state entries that follow tables and checkpoints at chunk
boundaries: reuse across parking, branches and crash re-attach. What it keeps: every answer exact.
"""
from __future__ import annotations

from collections.abc import Callable

from .conversations import Match


def keeps_state(stage_hello: Callable[[int], dict | None], n_stages: int) -> bool:
    """Whether any stage's HELLO reports state entries."""
    return any(((stage_hello(i) or {}).get("state_entries") or 0) > 0 for i in range(n_stages))


def reusable(match: Match | None, n_slots: int) -> Match | None:
    """Rule 1: `match` when the prompt continues its conversation whole in the conversation's own slot."""
    if match is None:
        return None
    conv = match.conversation
    return match if conv.table < n_slots and match.reuse >= len(conv.tokens) else None
