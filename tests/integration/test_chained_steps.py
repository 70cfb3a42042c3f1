"""Chained decode steps (pool/step_chain.py) over real processes: `strata up` with one CPU stage, which samples
and embeds, and with two, where the last stage sends its samples to the first (the ring), in turns and pipelined,
behind the official `openai` client.

The oracle is transformers' greedy continuation; concurrent requests are compared with their solo runs, and the
coordinator's count of chained rows (`strata:decode_rows_chained`) shows the steps were chained. A refused
chained step would fail its request (a 500), so every answer here also says no step was refused.
"""
from __future__ import annotations

import concurrent.futures as cf

import pytest

from tests.integration.conftest import oracle_decode, oracle_greedy

EARLY_EOS = [418, 442, 469, 411, 246, 346]  # greedy: 4 tokens, then an eos id (as in test_serving.py)
SEEDED = {"temperature": 1.0, "seed": 77, "extra_body": {"top_k": 40, "repetition_penalty": 1.2}}


@pytest.fixture(scope="module", params=[(1, "auto"), (2, "auto"), (2, True)],
                ids=["one-stage", "ring", "ring-pipelined"])
def server(strata_up, request):
    """Two CPU stages take turns by default (pool/pipeline.py): the ring's chained step then waits at stage 0 for
    the samples of the one step in flight; pipelined, it joins two groups of slots in flight."""
    n_stages, piped = request.param
    return strata_up(n_stages=n_stages, max_context=1024, kv_pool_tokens=4096, chunk_cells=32, prefill_chunk=64,
                     chain_steps=True, pipeline=piped)


@pytest.fixture(autouse=True)
def clean(server):
    yield
    server.check_clean()


def chained(server) -> int:
    return server.live()["counters"]["chained"]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, SEEDED], ids=["greedy", "seeded"])
def test_chained_requests_match_their_solo_runs_and_transformers(server, sampling):
    prompts = [[9 + 37 * i + k for k in range(n)] for i, n in enumerate((12, 90, 30, 150))]
    client = server.openai()

    def run(prompt: list[int]):
        r = client.completions.create(model=server.model, prompt=prompt, max_tokens=40, logprobs=1, **sampling)
        c = r.choices[0]
        return c.text, c.logprobs.tokens, c.logprobs.token_logprobs, r.usage.completion_tokens

    before = chained(server)
    alone = []
    for p in prompts:
        server.erase_all()
        alone.append(run(p))
    assert chained(server) > before
    server.erase_all()
    with cf.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(run, prompts))
    for p, a, t in zip(prompts, alone, together):
        assert t[:2] == a[:2] and t[3] == a[3]
        assert t[2] == pytest.approx(a[2], abs=1e-4)
        if sampling is not SEEDED:
            tokens, _ = oracle_greedy(server.data["model"], p, 40)
            assert a[0] == oracle_decode(server.data["model"], tokens) and a[3] == len(tokens)


def test_an_eos_read_by_a_chained_step_ends_the_answer_and_the_next_turn_is_right(server):
    """pool/step_chain.py rule 5: the step chained after the eos is dropped; the answer ends at the eos, and the
    next turn, which continues the kept conversation, is transformers' continuation of it."""
    model = server.data["model"]
    first, ended = oracle_greedy(model, EARLY_EOS, 16)
    assert ended and 2 <= len(first) < 8, "the prompt no longer ends early on this checkpoint"
    client = server.openai()
    before = chained(server)
    r1 = client.completions.create(model=server.model, prompt=EARLY_EOS, max_tokens=16, temperature=0)
    assert (r1.choices[0].finish_reason, r1.usage.completion_tokens) == ("stop", len(first))
    # at most one row chained for each of token 3 up to the eos and one after it (whose answer is dropped);
    # fewer when a step's answer came back before the coordinator's next turn
    assert 1 <= chained(server) - before <= len(first)
    turn = EARLY_EOS + first + [40, 41, 42]
    r2 = client.completions.create(model=server.model, prompt=turn, max_tokens=12, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens == len(EARLY_EOS) + len(first)
    tokens, _ = oracle_greedy(model, turn, 12)
    assert r2.choices[0].text == oracle_decode(model, tokens)


def test_a_stop_string_ends_a_chained_answer_and_frees_the_slot(server):
    """A stop string cancels the request while its chained step is in flight; the text ends before the stop
    string and the slot is free again (the autouse check)."""
    model = server.data["model"]
    prompt = [5, 250, 17, 99, 3, 41]
    tokens, _ = oracle_greedy(model, prompt, 24)
    text = oracle_decode(model, tokens)
    stop = text[len(text) // 2:][:3]
    assert stop.strip(), text
    r = server.openai().completions.create(model=server.model, prompt=prompt, max_tokens=24, temperature=0,
                                           stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:text.index(stop)]
