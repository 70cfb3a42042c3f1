"""Continuous batching over `engine.parallel` slots, on the one authoritative chunk map.

Each loop turn:
  1. admit waiting requests into slots (prefix reuse from the conversation cache, table moves, the
     prompt's cells reserved up front; refusal when the pool cannot cover it after evictions);
  2. while fewer than G steps are in flight (G groups, pool/pipeline.py: the number of stages S when they are
     pipelined, 1 when they take turns), build a step from the slots with tokens to send: decode slots whose
     last token came back read it, prefilling slots the next piece of their prompt (at most `prefill_chunk`
     prompt tokens per step, so a long prompt never stalls the decoders for long; even pieces, shorter with
     several groups so the steps in flight cost about the same: coordinator/prefill_pieces.py), also while
     their earlier pieces are in flight: every stage runs steps in the order they were sent, so a piece always
     finds the K/V and state of the pieces before it, and one long prompt keeps S pipelined stages busy;
  3. table ops reach every stage before the step that needs them (one ordered stream per stage).

With chained steps (`engine.chain_steps`: one stage by default), up to G + 1 steps are in flight: a decoding
slot whose token is sampled by the oldest step in flight joins the next step at once; the first stage reads that
token from the last one (with one stage, its own sample), so no stage waits for a coordinator turn between
decode steps (pool/step_chain.py). Stages in turns send that step only when it has such a row (it then waits
at the first stage until the step before is done).

Answers are applied in the order the steps were sent, whatever order their tasks wake in: with two steps of one
request in flight, the later answer applied first would put its token before the earlier one's (`_run_step`).

A step carries at most ceil(active / G) decoding slots, so with pipelined stages up to S groups are in flight
and every stage works at the same time; prefill pieces are not counted in that cap (only in `prefill_chunk`),
so a step full of decoders still carries a piece and the steps in flight cost about the same: a step of
decoders alone beside one with a 512-token piece would leave each stage idle while the other computes the piece.

Prefix sharing (pool on, `engine.share_prefixes`; coordinator/prefix_sharing.py): a new request maps the full
chunks another conversation (held or running) has written for the same first tokens and prefills the rest; a
conversation continuing itself still moves in by a table swap.

Pool full, in this order: idle held conversations give way (`pool.policy.eviction_plan`), then a new request
is refused with `kv_pool_full`; a decoding slot that cannot grow ends with `length` and `truncated`.

A stage that goes down fails the requests running or waiting; idle held conversations stay until it is back.
Its HELLO then reports the chunk generations its pool file holds (a restarted CPU stage re-attaches the file):
a conversation whose chunks all have the generations of the chunk map is kept, the others are dropped.
Session files (`save_slot`, `restore_slot`, coordinator/slot_files.py) pin their slot while they run.

A request with a grammar gets its Matcher in `generate`, before it waits (a refused grammar is a 400 there);
every step that samples it carries its mask in `header["masks"]`, and the sampled token advances the matcher;
a finished grammar's eos ends the request with "stop", ignore_eos or not (coordinator/grammar.py rules 8-9).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator

from pool.chunk_map import ChunkMap, StaticMap
from pool.config import Config
from pool import pipeline, step_chain
from pool.logs import event

from . import linear_state, views
from .cache import ConversationCache
from .conversations import best_match, worth_taking
from .engine import EngineError, Finished, GenRequest, TokenEvent
from .grammar import GrammarError, Matcher
from .link import StageDown, StageLink, StepFailed
from .prefill_pieces import piece_tokens
from .prefix_sharing import choose, kept_by_move, shared_run

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

log = logging.getLogger("strata.scheduler")


@dataclass
class Job:
    """One request from admission to its end."""

    req: GenRequest
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    slot: int | None = None
    tokens: list[int] = field(default_factory=list)  # prompt + generated, all known tokens
    fed: int = 0  # tokens whose K/V are written (cells [0, fed))
    sent: int = 0  # tokens handed to steps: cells [fed, sent) are being written by steps in flight
    cached: int = 0
    generated: int = 0
    in_flight: int = 0  # its steps on the wire (several only while it prefills)
    cancelled: bool = False
    done: bool = False
    matcher: Matcher | None = None  # the request's grammar position, when it has a grammar
    restore: int | None = None  # a state checkpoint its first step copies into the slot's entry (pinned till then)
    sample_step: int = 0  # the last step that samples it (a chained step names it: pool/step_chain.py)

    @property
    def prefilling(self) -> bool:
        """Still reading the prompt (nothing sampled yet); cells for the whole prompt are already reserved."""
        return self.generated == 0


class Scheduler:
    """The Engine the HTTP front talks to; it owns the chunk map, the slots and the conversation cache."""

    def __init__(self, cfg: Config, link: StageLink, model_name: str = "tiny",
                 tokenizer: "Tokenizer | None" = None) -> None:
        e = cfg.engine
        self.cfg = cfg
        self.link = link
        self.model_name = model_name
        self.tokenizer = tokenizer  # what grammars are matched against; None: a grammar is refused
        self.max_context = e.max_context
        self.parallel = e.parallel
        map_cls = ChunkMap if e.pool_on else StaticMap
        self.cache = ConversationCache(map_cls(e.n_chunks, e.chunk_cells, e.table_chunks, e.parallel), e.parallel)
        self.map = self.cache.map
        self.held = self.cache.held
        self.sharing = e.pool_on and e.share_prefixes  # coordinator/prefix_sharing.py
        self.chaining = step_chain.enabled(cfg)  # one more step in flight, chained (pool/step_chain.py)
        self.groups = pipeline.groups(cfg)  # steps in flight and groups of decoders (pool/pipeline.py)
        self.turns = pipeline.turns(cfg)
        self.jobs: list[Job | None] = [None] * e.parallel  # the job running in each slot
        self.waiting: deque[Job] = deque()
        self.flight: set[int] = set()  # the ids of the steps in flight (the oldest is what a chained row reads)
        self._last_run: asyncio.Task | None = None  # the last step sent: it applies its answer, then ends
        self.step_ids = itertools.count(1)
        self.counters = {"refusals": {}, "truncations": 0, "lost": 0, "chained": 0}
        self.pinned: set[int] = set()  # slots a session file save or restore is using: no admission there
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        link.on_stage_up = self._stage_up
        link.on_stage_down = self._stage_down
        link.op_generations = self.map.generations_of  # the stages keep them to tell what survives a crash

    # ---- Engine protocol -------------------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="scheduler")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def save_slot(self, slot: int, filename: str) -> dict:
        """llama.cpp's `POST /slots/{id}?action=save`: the idle slot's conversation into session files."""
        from .slot_files import save_slot

        return await save_slot(self, slot, filename)

    async def restore_slot(self, slot: int, filename: str) -> dict:
        """llama.cpp's `POST /slots/{id}?action=restore`: a saved conversation into the idle slot."""
        from .slot_files import restore_slot

        return await restore_slot(self, slot, filename)

    async def generate(self, req: GenRequest) -> AsyncIterator[TokenEvent | Finished]:
        if not req.prompt:
            raise EngineError.invalid("the prompt is empty")
        if len(req.prompt) + req.max_tokens > self.max_context:
            raise EngineError.context_length(len(req.prompt), req.max_tokens, self.max_context)
        if not all(self.link.stages_up):
            raise EngineError.stage_down("a stage is down; retry when /health is ok",
                                         retry_after=self.cfg.coordinator.retry_after_s)
        if len(self.waiting) >= self.cfg.engine.max_waiting:
            self._refused("queue_full")
            raise EngineError.queue_full(self.cfg.coordinator.retry_after_s)
        matcher = await self._matcher(req) if req.grammar is not None else None
        job = Job(req, tokens=list(req.prompt), matcher=matcher)
        self.waiting.append(job)
        self._wake.set()
        try:
            while True:
                item = await job.events.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if isinstance(item, Finished):
                    return
        finally:
            if not job.done:
                self._cancel(job)

    def live_metrics(self) -> dict:
        return views.live_metrics(self)

    def health(self) -> dict:
        return views.health(self)

    def slots(self) -> list[dict]:
        return views.slots(self)

    def flush_cache(self) -> int:
        """Give back every idle held conversation's cells (slots and parked tables); returns cells freed."""
        freed = self.cache.flush()
        self._wake.set()
        return freed

    def erase_slot(self, slot: int) -> int:
        """Drop the conversation held by an idle slot (llama.cpp `POST /slots/{id}?action=erase`)."""
        self.check_idle(slot)
        conv = self.held.get(slot)
        self.cache.release(slot)
        self._wake.set()
        return len(conv.tokens) if conv else 0

    def check_idle(self, slot: int) -> None:
        """400 for a slot that does not exist, 409 `slot_busy` for one running a request or pinned."""
        if not 0 <= slot < self.parallel:
            raise EngineError.invalid(f"slot {slot} does not exist (0..{self.parallel - 1})", param="id")
        if self.jobs[slot] is not None or slot in self.pinned:
            what = "processing a request" if self.jobs[slot] is not None else "being saved or restored"
            raise EngineError(409, "slot_busy", f"slot {slot} is {what}", type="invalid_request_error")

    # ---- admission -------------------------------------------------------------------------------
    def _refused(self, code: str) -> None:
        self.counters["refusals"][code] = self.counters["refusals"].get(code, 0) + 1

    def _idle_slot(self, exclude: int | None = None) -> int | None:
        """A slot with no job: an empty one first, else the least recently used held one."""
        free = [s for s in range(self.parallel) if self.jobs[s] is None and s != exclude and s not in self.pinned]
        empty = [s for s in free if s not in self.held]
        if empty:
            return empty[0]
        if not free:
            return None
        return min(free, key=lambda s: self.held[s].last_used)

    def _admit(self, job: Job) -> bool:
        """Place a waiting job in a slot. False when no slot is idle (it keeps waiting).

        The slot is the matched conversation's own slot when it sits in one; otherwise an idle slot, whose held
        conversation is parked (moved out) first. A parked match comes into the slot by a table swap, which
        parks the slot's previous conversation in the matched table's place. A match not `worth_taking` is none.
        A move or a shared run of full chunks, whichever coordinator/prefix_sharing.py `choose`s.
        """
        prompt = job.req.prompt
        stateful = self.keeps_state()
        match = best_match(prompt, [c for c in self.held.values() if c.table not in self.pinned])
        if match is not None and not worth_taking(match, len(prompt)):
            match = None
        if stateful:
            match = linear_state.reusable(match, self.cache.entries.checkpoints)
        shared = [] if stateful else shared_run(self, prompt)
        kept = kept_by_move(self, match) if match else 0
        how = choose(match, kept, len(shared) * self.map.chunk_cells, len(prompt))
        if how != "move":
            match = None
        if how != "share":
            shared = []
        if match is not None and match.conversation.table < self.parallel:
            slot = match.conversation.table
        else:
            slot = self._idle_slot()
            if slot is None:
                return False
        reuse, restore = 0, None
        if match is not None:
            reuse = match.reuse
            if stateful and reuse < len(match.conversation.tokens):  # a branch: from a checkpoint of its state
                restore = self.cache.entries.checkpoints.best(match.conversation.table, reuse)[1]
            self.cache.bring(match.conversation, slot)
        elif slot in self.held:
            self.cache.park(slot)
        self.held.pop(slot, None)
        self.map.shrink(slot, reuse)
        reuse = min(reuse, self.map.held_cells(slot))  # a chunk another table holds is never kept in part
        if shared:
            self.cache.share(slot, shared)
            reuse = len(shared) * self.map.chunk_cells
        if stateful:
            self.cache.entries.checkpoints.trim(slot, reuse)  # state_checkpoints.py rule 3
            if restore is not None:
                self.cache.entries.checkpoints.pin(restore)
        if not self.cache.reserve(slot, len(prompt)):
            if restore is not None:  # the slot's entry does not hold prompt[:reuse]: nothing to keep
                self.cache.entries.checkpoints.unpin(restore)
                self.cache.release(slot)
            elif reuse and not shared:
                self.cache.hold(slot, list(prompt[:reuse]))
            else:
                self.cache.release(slot)
            self._refused("kv_pool_full")
            event(log, "request.refused", request=job.req.request_id, code="kv_pool_full", cells=len(prompt))
            job.done = True
            job.events.put_nowait(
                EngineError.kv_pool_full(len(prompt), self.map.free_cells, self.cfg.coordinator.retry_after_s)
            )
            return True
        job.slot, job.fed, job.sent, job.cached, job.restore = slot, reuse, reuse, reuse, restore
        self.jobs[slot] = job
        event(log, "request.admitted", request=job.req.request_id, slot=slot, prompt=len(prompt), cached=reuse)
        return True

    def keeps_state(self) -> bool:
        """Whether the stages keep linear-attention state entries (the cache then maps them to tables)."""
        return self._state_entries() > 0

    def _state_entries(self) -> int:
        """The state entries the stages keep (0: a model without linear attention), the cache's map of them
        made on first sight (coordinator/linear_state.py)."""
        n = linear_state.state_entries(self.link.stage_hello, len(self.cfg.stages))
        if n and self.cache.entries is None:
            self.cache.entries = self._new_entries(n)
        return n

    def _new_entries(self, n: int) -> linear_state.StateEntries:
        k = linear_state.state_checkpoints(self.link.stage_hello, len(self.cfg.stages))
        return linear_state.StateEntries(n, self.parallel, k, self.map.chunk_cells)

    # ---- grammars ----------------------------------------------------------------------------------
    async def _matcher(self, req: GenRequest) -> Matcher:
        """The request's Matcher over the last stage's vocabulary, built in a worker thread (grammar.py rule 9)."""
        vocab = (self.link.stage_hello(len(self.cfg.stages) - 1) or {}).get("vocab")
        try:
            return await asyncio.to_thread(Matcher.for_request, self.tokenizer, vocab, req.grammar,
                                           req.sampling.get("logit_bias"), req.thinking)
        except GrammarError as err:
            raise EngineError.invalid(f"grammar: {err}", param="grammar") from None

    def _grammar_failed(self, job: Job, err: GrammarError, internal: bool = False) -> None:
        message = f"grammar: {err}"
        self._fail(job, EngineError.internal(message) if internal else EngineError.invalid(message, param="grammar"))

    # ---- steps -----------------------------------------------------------------------------------
    def _build_step(self) -> tuple[dict, list[int], list[Job]] | None:
        ready = [j for j in self.jobs
                 if j is not None and not j.done and (j.sent < len(j.tokens) or self._chainable(j))]
        if not ready:
            return None
        if self.turns and self.flight and not any(self._chainable(j) for j in ready):
            return None  # pool/pipeline.py rule 4: a second step in flight waits at stage 0 for its samples
        active = sum(1 for j in self.jobs if j is not None)
        cap = max(1, math.ceil(active / self.groups))
        ready.sort(key=lambda j: (j.prefilling, j.slot))  # decoders first: they are cheap and latency-bound
        budget = self.cfg.engine.prefill_chunk
        slots, tokens, members, sampling, masks = [], [], [], {}, {}
        c, checkpoints = self.map.chunk_cells, None  # state checkpoints at chunk boundaries (state_checkpoints.py)
        if self.cache.entries is not None and self.cache.entries.checkpoints.count:
            checkpoints = self.cache.entries.checkpoints
        restores: list[list[int]] = []
        keeps: list[list[int]] = []
        chain: list[list[int]] = []
        decoders = 0
        for job in ready:
            start = job.sent
            todo = len(job.tokens) - start
            chained = todo == 0  # its input is the token its step in flight samples (pool/step_chain.py)
            if job.prefilling:  # prefill pieces join any step, within the budget; the cap counts decoders
                if budget <= 0:
                    continue
                q = piece_tokens(len(job.tokens) - job.cached, self.cfg.engine.prefill_chunk, self.groups)
                n = min(todo, budget, q)
                if checkpoints is not None:
                    n = min(n, (start // c + 1) * c - start)  # a piece ends at the next boundary (rule 2)
                budget -= n
            else:
                if decoders >= cap:
                    continue
                decoders += 1
                n = 1
                if not self.cache.reserve(job.slot, start + 1):
                    if not chained:  # a chained one ends so when the token in flight comes back
                        self._finish(job, "length", truncated=True)
                    continue
            sample = int(chained or start + n == len(job.tokens))
            if sample and job.matcher is not None:
                try:
                    masks[job.slot] = job.matcher.mask()
                except GrammarError as err:  # e.g. logit_bias bans all the grammar allows: this request alone
                    self._grammar_failed(job, err)
                    continue
            if start == job.cached and job.generated == 0:
                params = dict(job.req.sampling, logprobs=job.req.logprobs)
                if params.get("repetition_penalty", 1.0) != 1.0:
                    params["history"] = list(job.req.prompt)
                sampling[job.slot] = params
            if checkpoints is not None:
                if job.restore is not None:
                    restores.append([job.restore, self.cache.entries.of[job.slot]])
                    checkpoints.unpin(job.restore)
                    job.restore = None
                kept = checkpoints.keep(job.slot, start + n)
                if kept is not None:
                    keeps.append([len(slots), kept])
            if chained:
                chain.append([len(slots), job.sample_step])
            slots.append([job.slot, start, n, sample])
            tokens.extend(job.tokens[start : start + n] if not chained else [step_chain.CHAINED])
            members.append(job)
            job.sent = start + n
        if not members:
            return None
        sid = next(self.step_ids)
        for job, row in zip(members, slots):
            if row[3]:
                job.sample_step = sid
        header = {"step": sid, "version": self.map.version, "slots": slots, "sampling": sampling}
        if chain:
            header["chain"] = chain
            self.counters["chained"] += len(chain)
        if masks:
            header["masks"] = masks
        if self.cache.entries is not None:
            header["states"] = self.cache.entries.rows([row[0] for row in slots])
        if restores:  # coordinator/state_checkpoints.py rules 1 and 4
            header["restore"] = restores
        if keeps:
            header["keep"] = keeps
        return header, tokens, members

    @property
    def in_flight(self) -> int:
        """Steps on the wire, not yet answered."""
        return len(self.flight)

    def _chainable(self, job: Job) -> bool:
        """pool/step_chain.py rules 1-2: `job` joins the next step before its token in flight comes back."""
        return (self.chaining and self.cache.entries is None
                and step_chain.chainable(job, min(self.flight, default=None)))

    def _step_error(self, err: Exception, step: int) -> EngineError:
        if isinstance(err, StageDown):
            return EngineError.stage_down(str(err), retry_after=self.cfg.coordinator.retry_after_s)
        if isinstance(err, StepFailed):  # the stage is fine; this step's work failed there
            return EngineError(500, "step_failed", str(err))
        log.error("step %s failed: %r", step, err)
        return EngineError.internal(f"step {step} failed: {err}")

    def _fail_step(self, members: list[Job], err: EngineError, sent: bool = True) -> None:
        for job in members:
            job.in_flight -= sent  # a step the link refused never counted as in flight
            self._fail(job, err)  # a later piece of it still in flight comes back to a done job

    async def _run_step(self, header: dict, fut: asyncio.Future, members: list[Job],
                        before: asyncio.Task | None) -> None:
        """Apply a step's answer once it came and the task of the step sent before it (`before`) has ended, so
        answers are applied in the order the steps were sent. Two answers can be read in one turn before the
        task of the later step first runs; awaiting its done future would not yield, and a chained step's token
        would reach the request before the token of the step it follows."""
        try:
            try:
                result, error = await fut, None
            except Exception as err:  # noqa: BLE001 - a broken step ends its requests, never hangs them
                result, error = None, err
            if before is not None and not before.done():
                await asyncio.wait([before])  # ended, however it ended
        finally:
            self.flight.discard(header["step"])
            self._wake.set()
        if error is not None:
            self._fail_step(members, self._step_error(error, header["step"]))
        else:
            self._apply(header, result, members)

    def _apply(self, header: dict, result: dict, members: list[Job]) -> None:
        """A step's answer: each member's sampled token, or its end."""
        sampled = {row[0]: row for row in result.get("tokens", [])}
        for job, (slot, start, n, sample) in zip(members, header["slots"]):
            job.in_flight -= 1
            if job.done:  # ended while this piece was in flight (an earlier piece failed)
                continue
            job.fed = start + n
            if job.cancelled:
                if not job.in_flight:
                    self._end(job)
                continue
            if not sample:
                continue
            _, token, logprob, top = sampled[slot]
            job.generated += 1
            if token in job.req.stop_token_ids or (job.matcher is not None and job.matcher.finished):
                self._finish(job, "stop")
                continue
            if job.matcher is not None:
                try:
                    job.matcher.advance(token)
                except GrammarError as err:  # the last stage sampled past its mask
                    self._grammar_failed(job, err, internal=True)
                    continue
            job.tokens.append(token)
            job.events.put_nowait(TokenEvent(token, logprob, [tuple(t) for t in top] if top else None,
                                             cached_tokens=job.cached if job.generated == 1 else None))
            if job.generated >= job.req.max_tokens:
                self._finish(job, "length")

    def _finish(self, job: Job, reason: str, truncated: bool = False) -> None:
        if truncated:
            self.counters["truncations"] += 1
        completion = job.generated - (1 if reason == "stop" and job.generated else 0)
        job.events.put_nowait(Finished(reason, truncated, len(job.req.prompt), job.cached, completion))
        event(log, "request.done", request=job.req.request_id, slot=job.slot, reason=reason, truncated=truncated,
              cells=self.map.held_cells(job.slot), tokens=completion)
        self._end(job)

    def _fail(self, job: Job, err: EngineError) -> None:
        if not job.done:
            job.events.put_nowait(err)
        self._end(job, keep=False)

    def _end(self, job: Job, keep: bool = True) -> None:
        """The job leaves its slot; the slot keeps the conversation whose K/V it holds."""
        job.done = True
        slot = job.slot
        if slot is None or self.jobs[slot] is not job:
            return
        self.jobs[slot] = None
        if job.restore is not None:  # ended before its first step: the slot's entry holds another state
            self.cache.entries.checkpoints.unpin(job.restore)
            keep = False
        if keep and job.fed > 0:
            self.cache.hold(slot, job.tokens[: job.fed], answer_at=len(job.req.prompt))
        else:
            self.cache.release(slot)
        self._wake.set()

    def _cancel(self, job: Job) -> None:
        job.cancelled = True
        if job in self.waiting:
            self.waiting.remove(job)
            job.done = True
        elif not job.in_flight:
            self._end(job)
        self._wake.set()

    # ---- stages coming and going -----------------------------------------------------------------
    def _stage_down(self, index: int, reason: str) -> None:
        """Running and waiting requests fail; idle held conversations wait for the stage to come back, when
        `_stage_up` keeps the ones its pool file still holds."""
        err = EngineError.stage_down(f"stage {index} is down: {reason}",
                                     retry_after=self.cfg.coordinator.retry_after_s)
        for job in [j for j in self.jobs if j is not None]:
            self._fail(job, err)
        for job in self.waiting:
            self._fail(job, err)
        self.waiting.clear()

    def _stage_up(self, index: int) -> None:
        """A (re)joined stage gets the whole table state; pending ops go to the others first, so the
        snapshot and the other stages' mirrors stand at the same version. Before that, held conversations
        whose chunks the stage's generations do not vouch for are dropped (ChunkMap.intact)."""
        hello = self.link.stage_hello(index) or {}
        gens = hello.get("generations")
        lost = [t for t in self.held if not self.map.intact(t, gens)]
        n_entries = self._state_entries()
        if n_entries:  # and whose state entry the stage does not still hold (linear_state.py rule 3)
            lost += linear_state.lost_states(self.cache.entries, self.held, hello, lost)
        for table in lost:
            self.cache.release(table)
        self.counters["lost"] += len(lost)
        event(log, "stage.verified", stage=index, kept=len(self.held), lost=len(lost),
              reattached=hello.get("pool", {}).get("reattached"))
        pending = self.map.drain_ops()
        if pending:
            for i in range(len(self.cfg.stages)):
                if i != index:
                    self.link.send_ops(pending, stage=i)
        self.link.send_ops(self.map.snapshot_ops(), stage=index, snapshot=True)
        self._wake.set()

    # ---- the loop --------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                self._turn()
            except Exception:  # noqa: BLE001 - the loop outlives any one request's failure
                log.exception("scheduler turn failed")
            await self._wake.wait()

    def _turn(self) -> None:
        """Admit what fits, then fill the pipeline with steps (ops always on the wire before their step)."""
        while self.waiting and all(self.link.stages_up):
            job = self.waiting[0]
            try:
                if not self._admit(job):
                    break
            except Exception as err:  # noqa: BLE001 - one bad request must not block the queue
                log.exception("admission of %s failed", job.req.request_id)
                self._fail(job, EngineError.internal(f"admission failed: {err}"))
            self.waiting.popleft()
        while self.in_flight < self.groups + self.chaining and all(self.link.stages_up):
            built = self._build_step()
            self.send_ops()
            if built is None:
                break
            header, tokens, members = built
            try:
                fut = self.link.submit(header, tokens)  # on the wire before any later op
            except Exception as err:  # noqa: BLE001 - e.g. a stage just went down, a header the wire refuses
                self._fail_step(members, self._step_error(err, header["step"]), sent=False)
                continue
            for job in members:
                job.in_flight += 1
            self.flight.add(header["step"])
            self._last_run = asyncio.create_task(self._run_step(header, fut, members, self._last_run))
        self.send_ops()

    def send_ops(self) -> None:
        """The chunk map's ops since the last drain, to every stage (before any step that needs them)."""
        ops = self.map.drain_ops()
        if ops:
            self.link.send_ops(ops)
