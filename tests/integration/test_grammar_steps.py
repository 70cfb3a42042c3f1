"""Grammar masks end to end without HTTP: a Scheduler over two real CPU stage processes and the random tiny
model. Whatever noise the model prefers, a request with a JSON-schema grammar must end with "stop" on text
that parses and follows the schema, greedy and sampled; an unconstrained request in the same steps must give
exactly its solo tokens; a grammar the engine refuses fails that request alone."""
from __future__ import annotations

import asyncio
import json

import pytest

from coordinator import grammar as g
from coordinator.engine import EngineError, Finished, GenRequest, TokenEvent
from coordinator.scheduler import Scheduler
from coordinator.tokenizer import Tokenizer
from tests.accounting import assert_pool_accounted

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "unit", "ok"],
          "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
                         "days": {"type": "integer", "minimum": 1, "maximum": 9},
                         "unit": {"enum": ["C", "F"]}, "ok": {"type": "boolean"}}}


def valid(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"city", "days", "unit", "ok"} and value["city"].isalpha() and len(value["city"]) <= 8
            and type(value["days"]) is int and 1 <= value["days"] <= 9 and value["unit"] in ("C", "F")
            and type(value["ok"]) is bool)


async def started(box) -> tuple[Scheduler, Tokenizer, list[dict]]:
    """A scheduler over a fresh two-stage box; the list collects every step header it sends."""
    b = box(2, max_context=256, kv_pool_tokens=1024, prefill_chunk=64)
    b.start_all()
    link = b.link()
    await link.start()
    headers: list[dict] = []
    submit = link.submit

    def recording(header: dict, tokens: list[int]):
        headers.append(header)
        return submit(header, tokens)

    link.submit = recording
    tok = Tokenizer.from_dir(b.data["model"])
    sched = Scheduler(b.cfg, link, tokenizer=tok)
    await sched.start()
    return sched, tok, headers


def request(tok: Tokenizer, rid: str, text: str, sampling: dict, grammar: str | None = None,
            max_tokens: int = 80, bias: list | None = None) -> GenRequest:
    prompt = tok.chat_ids([{"role": "user", "content": text}])
    return GenRequest(rid, prompt, max_tokens, {**sampling, "logit_bias": bias}, frozenset(tok.eos_ids),
                      grammar=grammar)


async def run(sched: Scheduler, req: GenRequest) -> tuple[list[int], Finished]:
    tokens = []
    async for ev in sched.generate(req):
        if isinstance(ev, TokenEvent):
            tokens.append(ev.token)
        else:
            return tokens, ev
    raise AssertionError("no Finished event")


async def test_schema_answers_validate_greedy_and_sampled(box):
    sched, tok, headers = await started(box)
    grammar = g.json_schema(SCHEMA, strict=True)
    try:
        for i, sampling in enumerate([{"temperature": 0.0}, {"temperature": 1.0, "seed": 7},
                                      {"temperature": 1.0, "seed": 8, "top_k": 5}]):
            tokens, fin = await run(sched, request(tok, f"s{i}", "Weather?", sampling, grammar))
            text = tok.decode(tokens)
            assert fin.reason == "stop" and fin.completion_tokens == len(tokens), (fin, text)
            assert valid(text), text
        free, _ = await run(sched, request(tok, "free", "Weather?", {"temperature": 0.0}, max_tokens=20))
        with pytest.raises(json.JSONDecodeError):
            json.loads(tok.decode(free))  # the model on its own writes no such thing
        assert any("masks" in h for h in headers)
        assert_pool_accounted(sched)
    finally:
        await sched.stop()
        sched.link.close()


async def test_an_unconstrained_request_beside_constrained_ones_keeps_its_solo_tokens(box):
    sched, tok, headers = await started(box)
    grammar = g.json_schema(SCHEMA, strict=True)
    greedy = {"temperature": 0.0}
    try:
        plain = [request(tok, f"p{i}", f"Tell me a story, part {i}.", greedy, max_tokens=24) for i in range(2)]
        alone = [await run(sched, r) for r in plain]
        sched.flush_cache()
        constrained = [request(tok, f"c{i}", "Weather?", {"temperature": 1.0, "seed": 20 + i}, grammar)
                       for i in range(2)]
        headers.clear()
        tasks = []
        for r in (r for pair in zip(constrained, plain) for r in pair):  # slots 0-3: c0, p0, c1, p1
            tasks.append(asyncio.ensure_future(run(sched, r)))
            for _ in range(2000):  # admitted before the next one arrives, so each step group mixes the two kinds
                if any(j is not None and j.req.request_id == r.request_id for j in sched.jobs):
                    break
                await asyncio.sleep(0.001)
        together = await asyncio.gather(*tasks)
        for (tokens, fin), r in zip(together[::2], constrained):
            assert fin.reason == "stop" and valid(tok.decode(tokens)), tok.decode(tokens)
        assert [t for t, _ in together[1::2]] == [t for t, _ in alone]
        mixed = [h for h in headers if "masks" in h and any(s[3] and s[0] not in h["masks"] for s in h["slots"])]
        assert mixed, "no step sampled a masked and an unmasked slot together"
        assert_pool_accounted(sched)
    finally:
        await sched.stop()
        sched.link.close()


async def test_refused_grammars_fail_their_request_alone(box):
    sched, tok, _ = await started(box)
    greedy = {"temperature": 0.0}
    try:
        with pytest.raises(EngineError) as err:
            await run(sched, request(tok, "bad", "Weather?", greedy, '{"grammars": [{"lark_grammar": "start: ("}]}'))
        assert err.value.status == 400 and err.value.message.startswith("grammar: the grammar is invalid")
        grammar = g.json_object()
        first = [t for t in range(tok.vocab_size) if tok.decode([t]).startswith("{")]
        banned = request(tok, "ban", "Weather?", greedy, grammar, bias=[[t, -100] for t in first])
        other = request(tok, "ok", "Weather?", greedy, g.json_schema(SCHEMA, strict=True))
        results = await asyncio.gather(run(sched, banned), run(sched, other), return_exceptions=True)
        assert isinstance(results[0], EngineError) and results[0].status == 400
        assert "logit_bias bans every token the grammar allows next" in results[0].message
        tokens, fin = results[1]
        assert fin.reason == "stop" and valid(tok.decode(tokens))
        assert_pool_accounted(sched)
    finally:
        await sched.stop()
        sched.link.close()
