"""Scheduler decisions on the real chunk map, against a link that keeps token ids in cells.

`CellLink` stands in for the stages: it applies the scheduler's table ops to a `TableMirror` (refusing any gap),
writes each step's token ids into cells through the slot's table and derives the "sampled" token from the ids it
reads back through the table. A wrong table, a stale op, a move that loses bytes or a prefix reused from the wrong
conversation all change the tokens, so these tests compare against solo runs token for token.
"""
from __future__ import annotations

import asyncio
import math

import pytest

from coordinator.engine import EngineError, Finished, GenRequest, TokenEvent
from coordinator.link import StageDown, StepFailed
from coordinator.scheduler import Scheduler
from pool import pipeline
from pool.chunk_map import TableMirror
from pool.config import config_from_dict
from pool.step_chain import CHAINED, Samples
from tests.accounting import assert_pool_accounted

STOP = 3


class CellLink:
    def __init__(self, cfg, n_stages: int | None = None, delay: float = 0.0, serial: bool = False) -> None:
        e = cfg.engine
        self.stages_up = [True] * (len(cfg.stages) if n_stages is None else n_stages)
        self.on_stage_up = None
        self.on_stage_down = None
        self.C = e.chunk_cells
        self.tc = e.table_chunks
        self.trash = e.n_chunks
        self.mirror = TableMirror(e.n_chunks, e.table_chunks, e.parallel)
        self.cells = [[-1] * e.chunk_cells for _ in range(e.n_chunks + 1)]
        self.delay = delay
        self.serial = serial  # answers `delay` apart, in order, as one stage computing step after step
        self._free_at = 0.0
        self.steps = 0
        self.max_in_flight = 0
        self._in_flight = 0
        self.samples = Samples()  # what the first stage keeps for chained rows (its own or the ring's samples)
        self.unanswered: set[int] = set()  # steps sent whose answer has not come back
        self.chained = 0  # rows that read a token sampled by the step before
        self.refused: list[int] = []  # steps refused as a stage refuses them (StepFailed)
        self.turns = pipeline.turns(cfg)  # stages in turns: one step computes at a time (pool/pipeline.py)

    def stage_hello(self, index: int) -> dict | None:
        return None  # no stage handshook: no vocabulary for grammars, no linear-attention state

    def send_ops(self, ops, stage=None, snapshot=False) -> None:
        for op in ops:
            if op[0] == "exchange":
                _, _, a, b, cells = op
                for p in range(cells):  # pool off: regions are identity, table t = region t
                    ca, cb = a * self.tc + p // self.C, b * self.tc + p // self.C
                    o = p % self.C
                    self.cells[ca][o], self.cells[cb][o] = self.cells[cb][o], self.cells[ca][o]
            self.mirror.apply(op)

    @staticmethod
    def next_token(ctx: list[int]) -> int:
        h = 0
        for t in ctx:
            h = (h * 1000003 + t) % 2**61
        return 10 + h % 997

    def submit(self, header: dict, tokens: list[int]) -> asyncio.Future:
        # A stage runs a step before it applies any op sent after it (one ordered stream): the work is done
        # at send time, and the delay only stands for the time the result takes to come back.
        try:
            result = self._compute(header, tokens)
        except StepFailed as err:
            self.refused.append(header["step"])
            if self.serial:  # answered in order, after the steps before it
                self.unanswered.add(header["step"])
                return asyncio.ensure_future(self._later(err, header["step"]))
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(err)
            return fut
        except AssertionError as err:
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(err)
            return fut
        self.unanswered.add(header["step"])
        return asyncio.ensure_future(self._later(result, header["step"]))

    async def _later(self, result: dict | Exception, step: int) -> dict:
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        delay = self.delay
        if self.serial:
            now = asyncio.get_running_loop().time()
            self._free_at = max(now, self._free_at) + self.delay
            delay = self._free_at - now
        await asyncio.sleep(delay)
        self._in_flight -= 1
        self.unanswered.discard(step)
        if isinstance(result, Exception):
            raise result
        return result

    def _compute(self, header: dict, tokens: list[int]) -> dict:
        assert header["version"] == self.mirror.version, "step ran against a stale table"
        # pool/pipeline.py rule 4: in turns, a step sent beside one in flight waits for its samples (a chained row)
        assert not (self.turns and self.unanswered) or header.get("chain"), "two steps computing at once in turns"
        self.steps += 1
        if header.get("chain"):
            # rule 2: only the oldest step in flight, which on a layer split has passed the first stage: none newer
            # than the oldest not yet answered
            assert max(s for _, s in header["chain"]) <= min(self.unanswered, default=math.inf), self.unanswered
            tokens = list(tokens)
            try:
                self.samples.fill(header["step"], header["slots"], header["chain"], tokens)
            except ValueError as err:  # the stage refuses the step: nothing runs, the coordinator hears why
                raise StepFailed(header["step"], 0, str(err)) from None
            self.chained += len(header["chain"])
        assert CHAINED not in tokens
        out, i = [], 0
        for slot, start, n, sample in header["slots"]:
            self.mirror.check_write(slot, start, n, self.C)  # what a stage checks: no write into a shared chunk
            ent = self.mirror.entries(slot)
            for k in range(n):
                p = start + k
                assert ent[p // self.C] != self.trash, "write beyond the reserved cells"
                self.cells[ent[p // self.C]][p % self.C] = tokens[i + k]
            i += n
            if sample:
                ctx = [self.cells[ent[p // self.C]][p % self.C] for p in range(start + n)]
                out.append([slot, self.next_token(ctx), -0.5, []])
        self.samples.record(header["step"], out)
        return {"step": header["step"], "tokens": out}


def make_cfg(pool: bool = True, n_stages: int = 2, **engine) -> object:
    e = {"max_context": 256, "parallel": 4, "chunk_cells": 16, "prefill_chunk": 32, "max_waiting": 8}
    if pool:
        e["kv_pool_tokens"] = 1024
    e.update(engine)
    stages = [{"layers": [0, 2], "endpoint": "ipc:///tmp/x0"}, {"layers": [2, 4], "endpoint": "ipc:///tmp/x1"}]
    if n_stages == 1:
        stages = [{"layers": [0, 4], "endpoint": "ipc:///tmp/x0"}]
    return config_from_dict({"engine": e, "stages": stages})


def req(prompt: list[int], max_tokens: int = 12, rid: str = "r") -> GenRequest:
    return GenRequest(rid, list(prompt), max_tokens, stop_token_ids=frozenset({STOP}))


async def run(sched: Scheduler, r: GenRequest) -> tuple[list[int], Finished]:
    toks = []
    async for ev in sched.generate(r):
        if isinstance(ev, TokenEvent):
            toks.append(ev.token)
        else:
            return toks, ev
    raise AssertionError("no Finished event")


async def started(cfg, **kw) -> tuple[Scheduler, CellLink]:
    link = CellLink(cfg, **kw)
    sched = Scheduler(cfg, link)
    await sched.start()
    return sched, link


def prompts() -> list[list[int]]:
    return [[100 + i] * 3 + list(range(200 + i, 200 + i + 20 + 9 * i)) for i in range(4)]


async def solo(cfg, prompt, max_tokens=12):
    sched, _ = await started(cfg)
    try:
        return await run(sched, req(prompt, max_tokens))
    finally:
        await sched.stop()


@pytest.mark.parametrize("piped", [True, False])
@pytest.mark.parametrize("chain", [True, False])
@pytest.mark.parametrize("pool", [True, False])
async def test_concurrent_slots_match_solo_runs(pool, chain, piped):
    """Two stages: pipelined, two slot groups in flight; in turns, one (pool/pipeline.py); with chained steps
    (pool/step_chain.py) one more step that reads the tokens of the oldest (CellLink asserts it names no other,
    and in turns that it has a chained row)."""
    cfg = make_cfg(pool, chain_steps=chain, pipeline=piped)
    alone = [await solo(make_cfg(pool, chain_steps=False), p) for p in prompts()]
    sched, link = await started(cfg, delay=0.001)
    together = await asyncio.gather(*(run(sched, req(p, rid=str(i))) for i, p in enumerate(prompts())))
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert all(f.completion_tokens == 12 and f.reason == "length" for _, f in together)
    assert link.max_in_flight == (2 if piped else 1) + chain
    assert (link.chained > 10) == chain and sched.counters["chained"] == link.chained
    assert_pool_accounted(sched)
    await sched.stop()


@pytest.mark.parametrize("pool", [True, False])
async def test_appended_turn_reads_only_new_tokens(pool):
    cfg = make_cfg(pool)
    sched, _ = await started(cfg)
    p = prompts()[2]
    out, fin = await run(sched, req(p))
    assert fin.cached_tokens == 0
    turn2 = p + out + [7, 8, 9]
    out2, fin2 = await run(sched, req(turn2))
    assert fin2.cached_tokens == len(p) + len(out) - 1  # the last sampled token was never read
    cold, _ = await solo(cfg, turn2)
    assert out2 == cold
    assert_pool_accounted(sched)
    await sched.stop()


@pytest.mark.parametrize("pool", [True, False])
async def test_parked_conversation_comes_back_by_move(pool):
    cfg = make_cfg(pool, parallel=1)
    sched, _ = await started(cfg)
    a, b = prompts()[0], prompts()[1]
    out_a, _ = await run(sched, req(a))
    out_b, _ = await run(sched, req(b))  # a is parked to free the only slot
    assert any(t >= sched.parallel for t in sched.held)
    turn2 = a + out_a + [5]
    out2, fin = await run(sched, req(turn2))  # a comes back into the slot; b is parked in its place
    assert fin.cached_tokens == len(a) + len(out_a) - 1
    assert out2 == (await solo(cfg, turn2))[0]
    turn_b = b + out_b + [6]
    out3, fin3 = await run(sched, req(turn_b))
    assert fin3.cached_tokens == len(b) + len(out_b) - 1
    assert out3 == (await solo(cfg, turn_b))[0]
    assert sched.cache.counters["moves"] >= 3
    assert_pool_accounted(sched)
    await sched.stop()


@pytest.mark.parametrize("share", [False, True], ids=["move", "share"])
async def test_reuse_is_bound_to_its_conversation(share):
    """Two conversations sharing a first prefix: each next turn reuses only what its own table holds. A prompt
    made of their common part takes one of them over when sharing is off (cut to the 20 common tokens); with
    sharing it maps the common part's one full chunk (16 cells) and every conversation stays whole."""
    cfg = make_cfg(True, parallel=1, share_prefixes=share)
    sched, _ = await started(cfg)
    common = list(range(300, 320))
    a, b = common + [1, 2, 3, 4], common + [9, 9, 9, 9, 9, 9]
    out_a, _ = await run(sched, req(a))
    out_b, _ = await run(sched, req(b))
    turns = (a + out_a + [11], b + out_b + [12], common + [42])
    for prompt in turns:
        got, fin = await run(sched, req(prompt))
        assert got == (await solo(cfg, prompt))[0]
    assert fin.cached_tokens == (16 if share else len(common))
    if share:  # 12 tokens sampled, the last one never read: each holds its prompt + 11
        assert sorted(len(c.tokens) for c in sched.held.values()) == sorted(len(p) + 11 for p in turns)
    assert_pool_accounted(sched)
    await sched.stop()


async def test_pool_pressure_refuses_or_truncates_and_frees_everything():
    # 4 slots, a pool of 160 cells (10 chunks of 16): four 60-token prompts cannot all fit.
    cfg = make_cfg(True, max_context=160, kv_pool_tokens=160)
    ps = [[400 + i] + list(range(500 + 7 * i, 500 + 7 * i + 59)) for i in range(4)]
    alone = [await solo(cfg, p, 40) for p in ps]
    sched, _ = await started(cfg, delay=0.001)
    results = await asyncio.gather(*(run(sched, req(p, 40, rid=str(i))) for i, p in enumerate(ps)),
                                   return_exceptions=True)
    refused = [r for r in results if isinstance(r, EngineError)]
    done = [(i, r) for i, r in enumerate(results) if not isinstance(r, BaseException)]
    assert refused and all(e.code == "kv_pool_full" and e.status == 503 and e.retry_after for e in refused)
    assert done
    for i, (toks, fin) in done:
        if fin.truncated:
            assert fin.reason == "length" and toks == alone[i][0][: len(toks)]
        else:
            assert toks == alone[i][0]
    assert sched.counters["refusals"]["kv_pool_full"] == len(refused)
    assert sched.counters["truncations"] == sum(f.truncated for _, (_, f) in done) >= 1
    assert_pool_accounted(sched)
    await sched.stop()


async def test_queue_full_refuses():
    cfg = make_cfg(True, parallel=1, max_waiting=1)
    sched, _ = await started(cfg, delay=0.01)
    tasks = [asyncio.create_task(run(sched, req(prompts()[0], 30, rid=str(i)))) for i in range(4)]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    codes = [r.code for r in results if isinstance(r, EngineError)]
    assert "queue_full" in codes
    assert_pool_accounted(sched)
    await sched.stop()


async def test_closing_the_stream_frees_the_slot():
    cfg = make_cfg(True, parallel=1)
    sched, _ = await started(cfg, delay=0.005)
    gen = sched.generate(req(prompts()[0], 100))
    n = 0
    async for ev in gen:
        n += 1
        if n == 3:
            break
    await gen.aclose()
    for _ in range(100):
        if sched.jobs[0] is None:
            break
        await asyncio.sleep(0.01)
    assert sched.jobs[0] is None
    out, fin = await run(sched, req(prompts()[1]))
    assert out == (await solo(cfg, prompts()[1]))[0]
    assert_pool_accounted(sched)
    await sched.stop()


async def test_context_length_is_refused_before_anything_runs():
    cfg = make_cfg(True)
    sched, link = await started(cfg)
    with pytest.raises(EngineError) as err:
        await run(sched, req(list(range(10, 250)), 100))
    assert err.value.code == "context_length_exceeded" and "340" in err.value.message
    assert link.steps == 0
    await sched.stop()


class FlakyLink(CellLink):
    """Refuses to send one step (as the wire would refuse a header it cannot pack), or fails it on a stage."""

    def __init__(self, cfg, fail_with: Exception) -> None:
        super().__init__(cfg)
        self.fail_with = fail_with

    def submit(self, header: dict, tokens: list[int]) -> asyncio.Future:
        if self.fail_with is not None:
            err, self.fail_with = self.fail_with, None
            if isinstance(err, ValueError):
                raise err
            self._compute(header, tokens)
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(err)
            return fut
        return super().submit(header, tokens)


@pytest.mark.parametrize("failure, status, code", [
    (ValueError("integer out of range for the wire"), 500, "internal_error"),
    (StepFailed(1, 1, "boom"), 500, "step_failed"),
    (StageDown(1, "step 0 passed its deadline"), 503, "stage_down"),
])
async def test_a_failed_step_ends_its_requests_and_the_loop_goes_on(failure, status, code):
    cfg = make_cfg(True)
    link = FlakyLink(cfg, failure)
    sched = Scheduler(cfg, link)
    await sched.start()
    with pytest.raises(EngineError) as err:
        await run(sched, req(prompts()[0]))
    assert (err.value.status, err.value.code) == (status, code)
    assert err.value.retry_after == (cfg.coordinator.retry_after_s if status == 503 else None)  # Retry-After
    out, fin = await run(sched, req(prompts()[1]))
    assert out == (await solo(cfg, prompts()[1]))[0]
    assert_pool_accounted(sched)
    await sched.stop()


class PieceLink(CellLink):
    """Records which steps were in flight together; the step numbered `fail_step` fails on a stage after the next
    one was sent (as a stage failing a piece while the following piece is already on the wire)."""

    def __init__(self, cfg, fail_step: int | None = None, refuse_step: int | None = None) -> None:
        super().__init__(cfg, delay=0.01)
        self.fail_step, self.refuse_step = fail_step, refuse_step
        self.sched: Scheduler | None = None
        self.jobs: list = []  # every job a step carried, to check their counts at the end
        self.sent: list[list] = []
        self.overlaps = 0  # steps sent while an earlier one had not come back
        self.pending: list[asyncio.Future] = []

    def submit(self, header: dict, tokens: list[int]) -> asyncio.Future:
        if self.sched is not None:
            self.jobs += [self.sched.jobs[row[0]] for row in header["slots"]]
        if header["step"] == self.refuse_step:  # the link refuses it at once (as a stage that just went down)
            raise StageDown(0, "refused")
        self.sent.append(header["slots"])
        self.pending = [f for f in self.pending if not f.done()]
        if self.pending:
            self.overlaps += 1
        if header["step"] == self.fail_step:
            self._compute(header, tokens)
            fut = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_later(0.02, fut.set_exception, StepFailed(0, header["step"], "boom"))
        else:
            fut = super().submit(header, tokens)
        self.pending.append(fut)
        return fut


async def test_one_long_prompt_keeps_both_stages_busy_with_its_pieces():
    """Scheduler rule 2: the next piece of a prompt is sent while the one before is in flight (two stages, two
    pieces in flight), contiguous, and the answer is the solo answer of a one-step-at-a-time run."""
    cfg = make_cfg(True, parallel=1, pipeline=True)
    prompt = list(range(300, 400))  # 100 tokens: four even pieces of 25 (prefill_pieces.py rule 1)
    alone = await solo(make_cfg(True, parallel=1, prefill_chunk=128, n_stages=1), prompt)  # one piece
    link = PieceLink(cfg)
    sched = Scheduler(cfg, link)
    await sched.start()
    out, fin = await run(sched, req(prompt))
    assert (out, fin.reason) == (alone[0], "length")
    pieces = [row[0][1:3] for row in link.sent[:4]]
    assert pieces == [[0, 25], [25, 25], [50, 25], [75, 25]]
    assert link.overlaps >= 2 and link.max_in_flight == 2  # pieces go out in pairs, never more than S = 2
    assert_pool_accounted(sched)
    await sched.stop()


@pytest.mark.parametrize("n_stages, prompt_len, pieces", [
    (1, 33, [17, 16]),     # one stage: the even split (rule 3), not 32 + 1
    (2, 128, [64, 64]),    # a prompt under prefill_chunk still gives each stage a piece (rule 1)
    (2, 40, [40]),         # unless its pieces would be too short to pay for their step
])
async def test_pieces_beside_decoders_cost_about_the_same(n_stages, prompt_len, pieces):
    """coordinator/prefill_pieces.py: a prompt arriving while another request decodes is read in even pieces;
    the answers are the solo answers."""
    cfg = make_cfg(True, n_stages=n_stages, parallel=2, prefill_chunk=32 if n_stages == 1 else 256, pipeline=True)
    first, second = list(range(300, 310)), list(range(500, 500 + prompt_len))
    alone = [await solo(cfg, p, max_tokens=m) for p, m in ((first, 40), (second, 4))]
    link = PieceLink(cfg)
    sched = Scheduler(cfg, link)
    await sched.start()
    decoding = asyncio.ensure_future(run(sched, req(first, 40, rid="a")))
    while link.steps < 3:
        await asyncio.sleep(0.001)
    out = await run(sched, req(second, 4, rid="b"))
    assert out[0] == alone[1][0] and (await decoding)[0] == alone[0][0]
    slot_a = link.sent[0][0][0]
    read = [row[1:3] for step in link.sent for row in step if row[0] != slot_a and row[2] > 1]
    assert read == [[sum(pieces[:i]), n] for i, n in enumerate(pieces)]
    assert_pool_accounted(sched)
    await sched.stop()


@pytest.mark.parametrize("how", ["fail", "refused", "cancel"])
async def test_a_prompt_ended_with_a_piece_in_flight_frees_its_slot_once(how):
    """A piece fails on a stage, or the link refuses the next piece, or the client goes, while a piece is in
    flight: the request ends once, the late piece's answer changes nothing, every step the job was in is
    counted back, and the pool's cells all come back."""
    cfg = make_cfg(True, parallel=1, pipeline=True)
    prompt = list(range(300, 400))
    link = PieceLink(cfg, fail_step=1 if how == "fail" else None, refuse_step=2 if how == "refused" else None)
    sched = Scheduler(cfg, link)
    link.sched = sched
    await sched.start()
    if how != "cancel":
        with pytest.raises(EngineError) as err:
            await run(sched, req(prompt))
        assert err.value.code == ("step_failed" if how == "fail" else "stage_down")
    else:
        task = asyncio.ensure_future(run(sched, req(prompt)))
        for _ in range(2000):
            if link.overlaps:
                break
            await asyncio.sleep(0.001)
        assert link.overlaps, "the second piece never went out while the first was in flight"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    for _ in range(200):
        if sched.jobs[0] is None and sched.in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert sched.jobs[0] is None and sched.in_flight == 0
    assert link.jobs and all(job.in_flight == 0 for job in link.jobs)
    out, _ = await run(sched, req(prompts()[1]))
    assert out == (await solo(cfg, prompts()[1]))[0]
    assert_pool_accounted(sched)
    await sched.stop()


async def test_a_prefill_piece_joins_a_step_full_of_decoders():
    """Scheduler: the cap of ceil(active / S) slots per step counts decoders only. Three slots decode (cap 2 of 4
    active on 2 stages) when a long prompt arrives: a step carrying 2 decoders also carries a piece of it, and
    every answer is its solo answer."""
    cfg = make_cfg(True, parallel=4, pipeline=True)
    sched, link, later = await decoders_then_a_long_prompt(cfg)
    mixed = [rows for rows in later if sum(1 for r in rows if r[2] == 1) == 2 and any(r[2] > 1 for r in rows)]
    assert mixed, later
    assert_pool_accounted(sched)
    await sched.stop()


async def decoders_then_a_long_prompt(cfg) -> tuple[Scheduler, "PieceLink", list]:
    """Three slots decode 40 tokens each when a 100-token prompt arrives; every answer is checked against its
    solo run. (scheduler, link, the steps sent from the prompt's arrival on)."""
    link = PieceLink(cfg)
    sched = Scheduler(cfg, link)
    await sched.start()
    short = prompts()[:3]
    runs = [asyncio.ensure_future(run(sched, req(p, max_tokens=40, rid=f"d{i}"))) for i, p in enumerate(short)]
    for _ in range(2000):
        if sum(1 for j in sched.jobs if j is not None and j.generated > 0) == 3:
            break
        await asyncio.sleep(0.001)
    long_prompt = list(range(300, 400))
    first = len(link.sent)
    runs.append(asyncio.ensure_future(run(sched, req(long_prompt, rid="long"))))
    outs = await asyncio.gather(*runs)
    for (out, _), prompt, n in zip(outs, [*short, long_prompt], [40, 40, 40, 12]):
        assert out == (await solo(cfg, prompt, max_tokens=n))[0]
    return sched, link, link.sent[first:]


# ---- chained decode steps (pool/step_chain.py), one stage ---------------------------------------------------
async def steps_of(cfg, prompt, max_tokens=12) -> tuple[int, int]:
    """(steps, chained rows) of a solo run on a stage that computes a step in 10 ms."""
    sched, link = await started(cfg, delay=0.01, serial=True)
    await run(sched, req(prompt, max_tokens))
    await sched.stop()
    return link.steps, link.chained


@pytest.mark.parametrize("pool", [True, False])
async def test_one_stage_chains_its_decode_steps_and_answers_as_solo_runs(pool):
    """Rules 1-3: on a box of one stage the next decode step goes out while the one before computes, reading the
    token the stage sampled; the answers are those of unchained two-stage runs, and no step is spent."""
    cfg = make_cfg(pool, n_stages=1)
    alone = [await solo(make_cfg(pool), p) for p in prompts()]
    assert sched_chaining(make_cfg(pool)) == 0 and sched_chaining(cfg) == 1  # "auto": one stage only
    assert sched_chaining(make_cfg(pool, chain_steps=True)) == 1
    assert sched_chaining(make_cfg(pool, n_stages=1, chain_steps=False)) == 0
    plain = await steps_of(make_cfg(pool, chain_steps=False), prompts()[0])
    chained = await steps_of(cfg, prompts()[0])
    # 12 tokens: the prompt's last piece samples one, one plain decode step, then up to 10 chained; no step more.
    # A step goes out plain only when the scheduler's turn comes after the step before it is back (an event loop
    # held up for the 10 ms a step takes here, as on a loaded CI machine): that costs the overlap, never a step.
    assert plain == (chained[0], 0) and 5 <= chained[1] <= 10
    sched, link = await started(cfg, delay=0.001, serial=True)
    together = await asyncio.gather(*(run(sched, req(p, rid=str(i))) for i, p in enumerate(prompts())))
    assert together == alone
    assert link.max_in_flight == 2 and link.chained > 10
    assert_pool_accounted(sched)
    await sched.stop()


def sched_chaining(cfg) -> bool:
    return Scheduler(cfg, CellLink(cfg)).chaining


@pytest.mark.parametrize("pool", [True, False])
async def test_a_stop_token_read_by_a_chained_step_spends_one_step_and_the_turn_goes_on(pool):
    """Rule 5: the step chained after the stop token is dropped; the kept conversation ends before the stop
    token, and its next turn (which writes that cell first) answers as a cold run."""
    cfg = make_cfg(pool, n_stages=1, parallel=1)
    p = prompts()[1]
    want, _ = await solo(make_cfg(pool), p)
    # answers 10 ms apart: the chained step is always on the wire before the one it reads comes back, on a busy
    # machine too (the count of chained rows below depends on it)
    sched, link = await started(cfg, delay=0.01, serial=True)
    stop = GenRequest("s", list(p), 12, stop_token_ids=frozenset({want[4]}))
    out, fin = await run(sched, stop)
    assert out == want[:4] and fin.reason == "stop" and fin.completion_tokens == 4
    assert link.chained == 4  # tokens 3, 4, 5 and the one past the stop token: the last is dropped
    turn2 = p + out + [7, 8, 9]
    out2, fin2 = await run(sched, req(turn2))
    assert fin2.cached_tokens == len(p) + 4
    assert out2 == (await solo(make_cfg(pool), turn2))[0]
    assert_pool_accounted(sched)
    await sched.stop()


class LostSampleLink(CellLink):
    """Step `fail_step` fails on the stage without running (nothing written, nothing sampled); its answer comes
    in order, after the step chained on it was sent."""

    def __init__(self, cfg, fail_step: int) -> None:
        super().__init__(cfg, delay=0.005, serial=True)
        self.fail_step = fail_step

    def submit(self, header: dict, tokens: list[int]) -> asyncio.Future:
        if header["step"] != self.fail_step:
            return super().submit(header, tokens)
        self.unanswered.add(header["step"])
        return asyncio.ensure_future(self._later(StepFailed(header["step"], 0, "boom"), header["step"]))


async def test_a_step_chained_on_a_failed_one_is_refused_and_the_loop_goes_on():
    """Rule 4: the stage refuses a step that names a sample it never made; the request fails once, with the
    first failure, and the next request answers as a solo run."""
    cfg = make_cfg(True, n_stages=1, parallel=1)
    link = LostSampleLink(cfg, fail_step=2)  # the first decode step, with a chained one behind it
    sched = Scheduler(cfg, link)
    await sched.start()
    with pytest.raises(EngineError) as err:
        await run(sched, req(prompts()[0]))
    assert err.value.code == "step_failed" and "boom" in err.value.message
    assert link.refused == [3]  # the step chained on step 2 named a sample the stage never made
    out, _ = await run(sched, req(prompts()[1]))
    assert out == (await solo(cfg, prompts()[1]))[0]
    assert sched.in_flight == 0
    assert_pool_accounted(sched)
    await sched.stop()


class EarlyAnswerLink(CellLink):
    """A chained step's answer is in when it is sent, before the answer of the step it follows: what the
    scheduler sees when both answers are read in one turn before the later step's task first runs."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg, delay=0.005)
        self.early = 0

    def submit(self, header: dict, tokens: list[int]) -> asyncio.Future:
        if not header.get("chain"):
            return super().submit(header, tokens)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self._compute(header, tokens))
        self.early += 1
        return fut


@pytest.mark.parametrize("n_stages", [1, 2])
async def test_answers_are_applied_in_the_order_the_steps_were_sent(n_stages):
    """A chained step whose answer is in before the answer of the step it follows still gives its request the
    tokens in order: the answer waits until the one before it is applied (every answer is the solo run's)."""
    cfg = make_cfg(True, n_stages=n_stages, chain_steps=True, pipeline=True)
    alone = [await solo(make_cfg(True, chain_steps=False), p) for p in prompts()]
    link = EarlyAnswerLink(cfg)
    sched = Scheduler(cfg, link)
    await sched.start()
    together = await asyncio.gather(*(run(sched, req(p, rid=str(i))) for i, p in enumerate(prompts())))
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert link.early >= len(prompts()) and sched.in_flight == 0
    assert_pool_accounted(sched)
    await sched.stop()


async def test_stages_in_turns_send_one_step_at_a_time_with_every_decoder():
    """pool/pipeline.py rules 1-2: two CPU stages on one machine take turns by default. One step is in flight,
    it carries every decoding slot (one group), a prompt arriving beside them is read in the even pieces of one
    stage, and every answer is its solo answer."""
    cfg = make_cfg(True, parallel=4)
    assert pipeline.turns(cfg) and pipeline.groups(cfg) == 1
    assert not pipeline.turns(make_cfg(True, parallel=4, pipeline=True))
    sched, link, later = await decoders_then_a_long_prompt(cfg)
    pieces = [row[1:3] for rows in later for row in rows if row[2] > 1]
    assert pieces == [[0, 25], [25, 25], [50, 25], [75, 25]]  # prefill_chunk 32: the even split of one stage
    decoding = [rows for rows in later if any(r[2] > 1 for r in rows)]
    assert all(sum(1 for r in rows if r[2] == 1) == 3 for rows in decoding), decoding  # all three, every step
    assert link.max_in_flight == 1 and link.overlaps == 0
    assert_pool_accounted(sched)
    await sched.stop()
