"""Chained decode steps: the next decode step goes out before the token it reads has come back.

Between two decode steps of a slot, its sampled token travels from the last stage to the coordinator, which
builds the next step and sends it to the first stage: ZeroMQ both ways and a coordinator turn, about 1 ms of a
15 ms step of the 104M model on a CPU (docs/BENCHMARKS.md, "Chained decode steps"), and on a layer split the
first stage idles for it whenever the steps in flight cannot cover it (the coordinator shares the host with
the stages). A chained step is sent while the step before it is still in flight; its row for a slot names that
step instead of a token id, and the first stage puts in the token the last stage sampled for the slot there.

Rules:
1. With `engine.chain_steps` (`enabled`: "auto" is on for a box of one stage, `true` on any number of stages),
   up to S + 1 steps are in flight. With one stage, the stage that samples is the one that embeds. With several
   (`ring`), the last stage sends what it sampled, or why a step ended without samples, to the first stage's
   data endpoint: the ring (rule 6). Otherwise S steps, no chain, and a stage refuses a step with `chain` in
   its header (ValueError: nothing run). The ring is not "auto" on several stages: on two CPU stages sharing
   two cores it changed neither the mixed workload's makespan and bubble nor one request's inter-token latency
   (docs/BENCHMARKS.md, "The sample ring"), and it makes stage 0 bind its data endpoint too.
2. A job is chained (`chainable`) when its one step in flight samples its next token and is the oldest step in
   flight (on a layer split, the one the last stage computes or has finished: the first stage would otherwise
   wait for a step it has not even passed on), it has sampled before (a prompt's last piece is not followed),
   it has no grammar (its mask depends on the token), it is not cancelled, and that token is not its last
   (`max_tokens`); and the model keeps no linear-attention state, which cannot be rewound past a token that
   ends the job (rule 5).
3. A chained row has n = 1 and samples; `header["chain"]` holds [[row, step], ...]: the step whose sample of
   the row's slot is its input. Its place in the token ids is CHAINED, which no embedding accepts.
4. The first stage records, per slot, the step id and token of its last sample (`Samples.record`): its own
   samples with one stage, the ring's with several. `Samples.fill` puts them into the step's ids, and refuses
   the whole step (ValueError, nothing run) when the named step is not the slot's last sample there: that step
   failed or was refused, and its requests ended with it.
5. When the token a chained step reads ends its job (a stop token, or a stop string that cancels it), the
   coordinator drops that step's answer. Its K/V went to the cell just past the kept conversation, in a chunk
   the slot had reserved, which any later reader writes before it reads. At most one step per request is
   spent so.
6. The ring (several stages): the last stage sends SAMPLES {step, rows: [[slot, token], ...], box, session}
   for every step it ends, in step order, or {step, error} for one it failed, refused or dropped; the first
   stage binds its data endpoint for them and takes only those with the box token and its coordinator's
   session. Before a chained step runs there, it waits for the named step's SAMPLES (`stages/compute.py`,
   the same keyed wait as a hidden state): SAMPLES of a later step mean the named one will never come, an
   error means it failed; either way the chained step fails (ERROR to the coordinator, an error HIDDEN on),
   having run nothing. A HELLO ends the wait as it ends a wait for a hidden state, and the coordinator sends
   one to the first stage when another stage goes down (coordinator/link.py): that stage's SAMPLES for the
   steps in flight will never come.
"""
from __future__ import annotations

from typing import Any

CHAINED = -1  # the token id in a chained row (rule 3)


def enabled(cfg: Any) -> bool:
    """Rule 1: chained steps on this box."""
    chain = cfg.engine.chain_steps
    return len(cfg.stages) == 1 if chain == "auto" else bool(chain)


def ring(cfg: Any) -> bool:
    """Rules 1 and 6: the last stage sends its samples to the first (chained steps on several stages)."""
    return enabled(cfg) and len(cfg.stages) > 1


def chainable(job: Any, oldest: int | None) -> bool:
    """Rule 2, for a coordinator Job; `oldest` is the id of the oldest step in flight."""
    return (job.in_flight == 1 and job.sample_step == oldest and job.sent == len(job.tokens) and job.generated >= 1
            and job.matcher is None and not job.cancelled and not job.done and job.generated + 1 < job.req.max_tokens)


class Samples:
    """The first stage's side: each slot's last sample (rule 4)."""

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
