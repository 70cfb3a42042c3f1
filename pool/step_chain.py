"""Chained decode steps: the next decode step goes out before the token it reads has come back.

A stage that both embeds and samples (a box of one stage) waits, between two decode steps, for its answer to
reach the coordinator and for the next step to come back: ZeroMQ both ways and a coordinator turn, about 1 ms of
a 15 ms step of the 104M model on a CPU (docs/BENCHMARKS.md, "Chained decode steps"). A chained step is sent
while the step before it still computes; its row for a slot names that step instead of a token id, and the stage
puts in the token it sampled for the slot there. The next step then already waits in the stage's queue.

Rules:
1. Only on a box whose one stage is first and last, with `engine.chain_steps` (`enabled`). With several
   stages the token would travel from the last stage to the first, and the S steps the scheduler keeps in
   flight already cover the hop. A stage that is not both refuses a step with `chain` in its header
   (ValueError: nothing run).
2. A job is chained (`chainable`) when its one step in flight samples its next token, it has sampled before
   (a prompt's last piece is not followed), it has no grammar (its mask depends on the token), it is not
   cancelled, and that token is not its last (`max_tokens`); and the model keeps no linear-attention state,
   which cannot be rewound past a token that ends the job (rule 5). Up to two steps are then in flight.
3. A chained row has n = 1 and samples; `header["chain"]` holds [[row, step], ...]: the step whose sample of
   the row's slot is its input. Its place in the token ids is CHAINED, which no embedding accepts.
4. The stage records, per slot, the step id and token of its last sample (`Samples.record`). `Samples.fill`
   puts them into the step's ids, and refuses the whole step (ValueError, nothing run) when the named step is
   not the slot's last sample there: that step failed or was refused, and its requests ended with it.
5. When the token a chained step reads ends its job (a stop token, or a stop string that cancels it), the
   coordinator drops that step's answer. Its K/V went to the cell just past the kept conversation, in a chunk
   the slot had reserved, which any later reader writes before it reads. At most one step per request is
   spent so.
"""
from __future__ import annotations

from typing import Any

CHAINED = -1  # the token id in a chained row (rule 3)


def enabled(cfg: Any) -> bool:
    """Rule 1: chained steps on this box."""
    return len(cfg.stages) == 1 and cfg.engine.chain_steps


def chainable(job: Any) -> bool:
    """Rule 2, for a coordinator Job."""
    return (job.in_flight == 1 and job.sent == len(job.tokens) and job.generated >= 1 and job.matcher is None
            and not job.cancelled and not job.done and job.generated + 1 < job.req.max_tokens)


class Samples:
    """The stage side: each slot's last sample (rule 4)."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, int]] = {}  # slot -> (step, token)

    def clear(self) -> None:
        """A new coordinator session: its step ids start again."""
        self._last.clear()

    def record(self, step: int, rows: list) -> None:
        """The [[slot, token, ...], ...] that `step` sampled."""
        for row in rows:
            self._last[int(row[0])] = (step, int(row[1]))

    def fill(self, step: int, slots: list, chain: list, ids: Any) -> None:
        """Put each chained row's token into `ids` (the step's token ids, in place); ValueError per rules 3-4."""
        offsets, at = [], 0
        for _, _, n, _ in slots:
            offsets.append(at)
            at += n
        for entry in chain:
            row, after = int(entry[0]), int(entry[1])
            if not 0 <= row < len(slots):
                raise ValueError(f"step {step}: chain names row {row}, outside its {len(slots)} slots")
            slot, _, n, sample = slots[row]
            if n != 1 or not sample:
                raise ValueError(f"step {step}: chained row {row} (slot {slot}) must read one token and sample")
            last = self._last.get(int(slot))
            if last is None or last[0] != after:
                raise ValueError(f"step {step} reads slot {slot}'s token from step {after}, which sampled nothing "
                                 f"for it here (it failed or was refused)")
            ids[offsets[row]] = last[1]
