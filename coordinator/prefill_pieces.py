"""How long a prefilling slot's pieces are: even pieces, and with several stages short enough to fill the pipeline.

With S stages the scheduler keeps S steps in flight, and a stage that finishes its step waits for the next one,
which is built only when a step comes back from the last stage. A step's cost is about reading the stage's weights
once plus its tokens' compute, so consecutive steps of different costs leave stages idle: stage 0 finishes a
cheap step and waits while stage 1 computes the dear one before it, and stage 1 waits while stage 0 computes a
dear one after a cheap one. Over a prompt read between decode steps each stage idles about one piece's compute
(a 513-token prompt read greedily as 512 + 1 beside decoders, most of a 512-token step). So pieces are short when
there are stages to fill, and even. The rules, for a prompt of T tokens to read (those past the held prefix):

1. It is read in k = max(ceil(T / prefill_chunk), min(n, T // RIDGE)) pieces of q = ceil(T / k) tokens
   (`piece_tokens`), the last one what is left, where n = round(sqrt((S - 1) * T / RIDGE)). RIDGE is the token
   count whose compute costs about one read of the weights (~26 tokens on the 2-core CPU of docs/BENCHMARKS.md,
   and about as many on a consumer GPU, whose compute and memory speeds are both ~100x a core's). n is the
   piece count that reads one prompt alone the soonest through S stages: k pieces take (k + S - 1) steps of
   (one weight read + T / k tokens), least at k = sqrt((S - 1) * T / RIDGE). No piece is longer than
   `prefill_chunk` nor, when it can be helped, shorter than RIDGE (such a step costs its weight read for little).
2. One stage (S = 1): n = 0, so only the even split: 513 tokens are 257 + 256, not 512 + 1. S counts the groups
   of steps in flight (pool/pipeline.py rule 2): stages that take turns read a prompt as one stage does.
3. q depends on T alone, not on how much is still unsent, so a prompt's pieces stay q long whichever step they
   go in; a step's prompt budget (`prefill_chunk` over all its pieces) may still cut one short, and the
   scheduler's own cuts (a state checkpoint's chunk boundary) come on top.
"""
from __future__ import annotations

import math

RIDGE = 32  # tokens whose compute costs about one read of a stage's weights (rule 1)


def piece_tokens(total: int, prefill_chunk: int, stages: int) -> int:
    """Rules 1-2: the length q of every piece of a prompt of `total` tokens to read (0 for none)."""
    if total <= 0:
        return 0
    lone = round(math.sqrt((stages - 1) * total / RIDGE))
    pieces = max(-(-total // prefill_chunk), min(lone, total // RIDGE))
    return -(-total // pieces)
