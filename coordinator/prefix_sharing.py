"""Prefix sharing at admission: which cells a new request takes from the pool as they are, and from where
(pool on with `engine.share_prefixes`; the StaticMap baseline never shares).

Two ways to reuse K/V exist. A move takes over one held conversation's table (coordinator/conversations.py:
`best_match`, `worth_taking`, `ConversationCache.bring`): no chunk is mapped twice, the partial tail chunk
comes along, and the conversation is cut to what the prompt shares with it. A shared run maps full chunks
that other tables hold, held or running, into the request's fresh table (pool/chunk_map.py rules 12-17):
nobody is cut, and the request reads the partial rest itself.

    held or running table   [ c0 | c1 | c2 | c3 (partial) ]          c0..c2 full and published
    new request's table     [ c0 | c1 | c2 | n0 | n1 ... ]           n0: its own, first written cell = 3C

Rules, in this order:
 1. Publish first (`shared_run`): a running request's cells [0, fed) (its steps came back from the last stage,
    so every stage wrote them) and a held conversation's tokens are offered to the chunk map; only whole
    chunks become shareable.
 2. The run is the longest chain of published chunks holding the prompt's first tokens, at most
    (len(prompt) - 1) // C chunks: the last prompt token is always read, its logits give the first token.
 3. A continuation moves (`choose` -> "move"): a held conversation the prompt continues whole, or a next turn
    of it, a prompt longer than the conversation that keeps its whole last prompt and parts from it inside
    its last answer (a client sends the answer back as text, which need not tokenize as it was sampled: the
    sampled tail is dead). Nothing is mapped twice and the partial chunk at the match's end is kept, which a
    shared run could never give. Only a longer shared run beats it (another table holds more).
 4. Otherwise a non-empty shared run is mapped ("share"): a second conversation on the same system prompt,
    and a branch inside a held conversation (a prompt that diverges inside it, an answer asked again), keep
    the other conversation whole, at the cost of reading again less than one chunk of the branch's prefix.
 5. Otherwise a match `worth_taking` (a branch that shares less than one whole chunk) moves as without
    sharing ("move"), if the move keeps anything: a move keeps no chunk another table also holds in part
    (`kept_by_move`), and a move that would keep nothing would only cut the conversation. Otherwise the
    request starts cold ("cold").

The partial chunk after a shared run is never shared, not copied on first write: a copy would need a new
byte-moving op on every stage, ordered with the steps and with generations of its own, to save at most C - 1
tokens of prefill, which the request reads anyway in the same step as its own first tokens. So a request's
first written cell is a chunk boundary past its shared run, and no step the scheduler builds writes into a
shared chunk (a stage refuses one that would: pool/mirror.py `check_write`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from .conversations import Match

if TYPE_CHECKING:
    from .scheduler import Scheduler

Choice = Literal["move", "share", "cold"]


def shared_run(sched: Scheduler, prompt: list[int]) -> list[int]:
    """Rules 1-2: publish what every table has written, then the chunks of the prompt's longest shared run
    ([] when sharing is off)."""
    if not sched.sharing:
        return []
    for slot, job in enumerate(sched.jobs):
        if job is not None and job.fed > 0:
            sched.map.publish(slot, job.tokens, job.fed)
    for table, conv in sched.held.items():
        sched.map.publish(table, conv.tokens)
    return sched.map.lookup(prompt, (len(prompt) - 1) // sched.map.chunk_cells)


def kept_by_move(sched: Scheduler, match: Match) -> int:
    """The cells a move of `match` keeps: its reuse, cut to a chunk boundary when it ends inside a chunk that
    another table also holds (pool/chunk_map.py rule 6)."""
    c, reuse = sched.map.chunk_cells, match.reuse
    if not sched.sharing or reuse % c == 0:
        return reuse
    chunk = sched.map.entries(match.conversation.table)[reuse // c]
    return reuse - reuse % c if sched.map.refs(chunk) > 1 else reuse


def choose(match: Match | None, kept: int, shared_cells: int, prompt_len: int) -> Choice:
    """Rules 3-5: how a prompt of `prompt_len` tokens with this `worth_taking` match (or None), keeping `kept`
    cells if moved, and this shared run is admitted."""
    if match is not None and kept >= shared_cells:
        conv = match.conversation
        next_turn = prompt_len > len(conv.tokens) and match.reuse >= conv.answer_start
        if match.reuse >= len(conv.tokens) or next_turn:
            return "move"
    if shared_cells > 0:
        return "share"
    return "move" if match is not None and kept > 0 else "cold"
