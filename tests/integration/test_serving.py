"""The serving path end to end: `strata up` (supervisor, coordinator, two CPU stages) behind the official
`openai` and `anthropic` clients.

Oracles we did not write: transformers renders and counts the chat prompts (`oracle_chat_ids`) and gives the
greedy continuation (`oracle_greedy`), so texts and usage numbers are checked against it, not against the
coordinator's own tokenizer. Every test leaves the box clean: the module's finalizer erases every held
conversation and asserts that all cells are free again and no slot is busy.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import re
import time
from pathlib import Path

import pytest

from tests.integration.conftest import (
    oracle_chat_ids,
    oracle_decode,
    oracle_encode,
    oracle_greedy,
)

SYSTEM = "You answer in one short line."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where did the river run?"}]
MAX_TOKENS = 24
GREEDY_A = {"temperature": 0}  # this anthropic client version takes sampling keys only as extra body


@pytest.fixture(scope="module")
def server(strata_up):
    return strata_up(max_context=2048, kv_pool_tokens=4096, chunk_cells=32, prefill_chunk=64)


@pytest.fixture(autouse=True)
def clean(server):
    yield
    server.check_clean()


@pytest.fixture(scope="module")
def model_dir(server) -> str:
    return server.data["model"]


def expected(model_dir: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> tuple[list[int], str, str]:
    """(greedy tokens, their text, the finish reason) from transformers."""
    tokens, ended = oracle_greedy(model_dir, prompt, max_tokens)
    return tokens, oracle_decode(model_dir, tokens), "stop" if ended else "length"


def truncated(choice) -> bool:
    return (choice.model_extra or {})["truncated"]


def test_pipelined_stages_answer_as_stages_in_turns(server, strata_up, model_dir):
    """pool/pipeline.py: two CPU stages on one machine take turns by default (one step in flight, every decoder
    in it); the same box with `engine.pipeline: true` keeps two groups of slots in flight. Four concurrent
    requests, two of them read in pieces, get the same tokens from both, and transformers' greedy ones."""
    piped = strata_up(max_context=2048, kv_pool_tokens=4096, chunk_cells=32, prefill_chunk=64, pipeline=True)
    prompts = [[11 + 29 * i + k for k in range(n)] for i, n in enumerate((20, 75, 140, 45))]

    def answers(srv) -> list[tuple[str, int]]:
        client = srv.openai()

        def run(prompt: list[int]) -> tuple[str, int]:
            r = client.completions.create(model=srv.model, prompt=prompt, max_tokens=32, temperature=0)
            return r.choices[0].text, r.usage.completion_tokens

        with cf.ThreadPoolExecutor(4) as pool:
            out = list(pool.map(run, prompts))
        srv.erase_all()
        return out

    assert server.live()["pipeline_groups"] == 1 and piped.live()["pipeline_groups"] == 2
    turns, pipelined = answers(server), answers(piped)
    assert pipelined == turns
    for p, (text, n) in zip(prompts, turns):
        tokens, want, _ = expected(model_dir, p, 32)
        assert (text, n) == (want, len(tokens))
    piped.check_clean()


# ---- one request per route, streamed and not ---------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_text_and_exact_usage(server, model_dir, stream):
    prompt = oracle_chat_ids(model_dir, MESSAGES)
    tokens, text, reason = expected(model_dir, prompt)
    client = server.openai()
    kw = dict(model=server.model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        resp = client.chat.completions.create(**kw)
        choice, usage = resp.choices[0], resp.usage
        assert choice.message.content == text
        assert (choice.finish_reason, truncated(choice)) == (reason, False)
        streamed = None
    else:
        chunks = list(client.chat.completions.create(**kw, stream=True, logprobs=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        body = [c for c in chunks if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in body) == text
        assert body[-1].choices[0].finish_reason == reason and truncated(body[-1].choices[0]) is False
        streamed = sum(len(c.choices[0].logprobs.content) for c in body if c.choices[0].logprobs)
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    assert usage.prompt_tokens == len(prompt)
    assert usage.completion_tokens == len(tokens) == (streamed if stream else len(tokens))
    assert usage.total_tokens == len(prompt) + len(tokens)
    assert usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_text_logprobs_and_usage(server, model_dir, stream):
    text_prompt = "The children of the village walked along"
    prompt = oracle_encode(model_dir, text_prompt)
    tokens, text, reason = expected(model_dir, prompt)
    client = server.openai()
    kw = dict(model=server.model, prompt=text_prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    if not stream:
        resp = client.completions.create(**kw)
        choice, usage = resp.choices[0], resp.usage
        got, lp, finish = choice.text, choice.logprobs, choice.finish_reason
        per_token = lp.tokens
        assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(per_token)
        assert all(len(top) <= 2 and max(top.values()) == pytest.approx(p, abs=1e-6)
                   for top, p in zip(lp.top_logprobs, lp.token_logprobs))  # greedy: the sampled token is the best
        assert truncated(choice) is False
    else:
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        body = [c for c in chunks if c.choices]
        got = "".join(c.choices[0].text for c in body)
        per_token = [t for c in body if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        finish, usage = body[-1].choices[0].finish_reason, chunks[-1].usage
        assert truncated(body[-1].choices[0]) is False
    assert (got, finish) == (text, reason)
    assert per_token == [oracle_decode(model_dir, [t]) for t in tokens]
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), len(tokens))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_messages_text_and_exact_usage(server, model_dir, stream):
    user = [{"role": "user", "content": "Where did the river run?"}]
    prompt = oracle_chat_ids(model_dir, [{"role": "system", "content": SYSTEM}, *user])
    tokens, text, reason = expected(model_dir, prompt)
    client = server.anthropic()
    kw = dict(model="claude-any", system=SYSTEM, messages=user, max_tokens=MAX_TOKENS, extra_body=GREEDY_A)
    if not stream:
        msg = client.messages.create(**kw)
        got = "".join(b.text for b in msg.content)
    else:
        with client.messages.stream(**kw) as s:
            got = "".join(s.text_stream)
            msg = s.get_final_message()
    assert got == text
    assert msg.model == server.model and msg.role == "assistant"
    assert msg.stop_reason == ("end_turn" if reason == "stop" else "max_tokens") and msg.stop_sequence is None
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == len(prompt)
    assert msg.usage.cache_read_input_tokens == 0
    assert msg.usage.output_tokens == len(tokens)
    assert client.messages.count_tokens(model="claude-any", system=SYSTEM, messages=user).input_tokens == len(prompt)


def _stop_string(text: str) -> tuple[str, int]:
    """A short printable stop string whose first occurrence is past the start of `text`."""
    for i in range(2, len(text) - 2):
        s = text[i:i + 2]
        if re.fullmatch(r"[A-Za-z]{2}", s) and text.find(s) == i:
            return s, i
    raise AssertionError(f"no stop string candidate in {text!r}")


def test_stop_strings_cut_the_text_in_every_family(server, model_dir):
    prompt = oracle_chat_ids(model_dir, MESSAGES)
    tokens, text, _ = expected(model_dir, prompt, 48)
    stop, at = _stop_string(text)
    oa, an = server.openai(), server.anthropic()
    kw = dict(model=server.model, messages=MESSAGES, max_tokens=48, temperature=0, stop=[stop, "never here"])
    whole = oa.chat.completions.create(**kw)
    assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == (text[:at], "stop")
    assert 0 < whole.usage.completion_tokens < len(tokens)

    chunks = list(oa.chat.completions.create(**kw, stream=True, logprobs=True,
                                             stream_options={"include_usage": True}))
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == text[:at]
    assert body[-1].choices[0].finish_reason == "stop"
    streamed = sum(len(c.choices[0].logprobs.content) for c in body if c.choices[0].logprobs)
    assert chunks[-1].usage.completion_tokens == streamed == whole.usage.completion_tokens

    # the completions route takes the rendered prompt as token ids
    comp = oa.completions.create(model=server.model, prompt=prompt, max_tokens=48, temperature=0, stop=stop)
    assert (comp.choices[0].text, comp.choices[0].finish_reason) == (text[:at], "stop")

    msg = an.messages.create(model="m", system=SYSTEM, messages=MESSAGES[1:], max_tokens=48, extra_body=GREEDY_A,
                             stop_sequences=[stop])
    assert (msg.content[0].text, msg.stop_reason, msg.stop_sequence) == (text[:at], "stop_sequence", stop)
    with an.messages.stream(model="m", system=SYSTEM, messages=MESSAGES[1:], max_tokens=48, extra_body=GREEDY_A,
                            stop_sequences=[stop]) as s:
        assert "".join(s.text_stream) == text[:at]
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert final.usage.output_tokens == whole.usage.completion_tokens


# ---- ignore_eos --------------------------------------------------------------------------------------
EARLY_EOS = [418, 442, 469, 411, 246, 346]  # greedy: 4 tokens, then an eos id (logit margins >= 0.025 on the way)


def test_ignore_eos_runs_past_the_eos_to_max_tokens(server, model_dir):
    """A prompt whose greedy continuation ends on an eos after a few tokens: with ignore_eos the same tokens
    come first, then the eos (a token like any other), then what transformers continues with after it."""
    first, ended = oracle_greedy(model_dir, EARLY_EOS, 16)
    assert ended and 0 < len(first) < 8, "the prompt no longer ends early on this checkpoint"
    client = server.openai()
    kw = dict(model=server.model, prompt=EARLY_EOS, max_tokens=16, temperature=0, logprobs=1)
    normal = client.completions.create(**kw)
    assert (normal.choices[0].finish_reason, normal.usage.completion_tokens) == ("stop", len(first))
    assert normal.choices[0].logprobs.tokens == [oracle_decode(model_dir, [t]) for t in first]
    server.erase_all()

    run = client.completions.create(**kw, extra_body={"ignore_eos": True})
    choice, tokens = run.choices[0], run.choices[0].logprobs.tokens
    assert (choice.finish_reason, truncated(choice), run.usage.completion_tokens) == ("length", False, 16)
    assert len(tokens) == 16 and tokens[:len(first)] == normal.choices[0].logprobs.tokens
    assert choice.text.startswith(normal.choices[0].text)
    eos_ids = json.loads((Path(model_dir) / "generation_config.json").read_text())["eos_token_id"]
    eos = [e for e in eos_ids if oracle_decode(model_dir, [e]) == tokens[len(first)]]
    assert eos, f"token {len(first)} is {tokens[len(first)]!r}, not an eos"
    rest, _ = oracle_greedy(model_dir, EARLY_EOS + first + eos[:1], 16 - len(first) - 1)
    assert tokens[len(first) + 1:] == [oracle_decode(model_dir, [t]) for t in rest]


# ---- batching ---------------------------------------------------------------------------------------
def _admitted_and_done(server, ids: set[str]) -> tuple[list[int], list[int]]:
    """Line numbers in the coordinator's log of request.admitted / request.done for these request ids."""
    admitted, done = [], []
    for n, line in enumerate(server.log().splitlines()):
        m = re.search(r"event=request\.(admitted|done) request=(\S+)", line)
        if m and m.group(2) in ids:
            (admitted if m.group(1) == "admitted" else done).append(n)
    return admitted, done


SEEDED = {"temperature": 1.0, "seed": 1234, "extra_body": {"top_k": 40, "repetition_penalty": 1.2},
          "frequency_penalty": 0.5}


@pytest.mark.parametrize("sampling", [{"temperature": 0}, SEEDED], ids=["greedy", "seeded"])
def test_four_concurrent_requests_match_their_solo_runs(server, model_dir, sampling):
    """Different prompts, two of them longer than `prefill_chunk` (read in pieces while the others decode):
    together they return token for token what each returns alone; greedy ones also what transformers does."""
    prompts = [[7 + 31 * i + k for k in range(n)] for i, n in enumerate((20, 75, 140, 45))]
    client = server.openai()

    def run(prompt: list[int]):
        r = client.completions.create(model=server.model, prompt=prompt, max_tokens=64, logprobs=1, **sampling)
        c = r.choices[0]
        return r.id, c.text, c.logprobs.tokens, c.logprobs.token_logprobs, r.usage.completion_tokens

    alone = []
    for p in prompts:
        server.erase_all()
        alone.append(run(p))
    server.erase_all()
    with cf.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(run, prompts))
    admitted, done = _admitted_and_done(server, {t[0] for t in together})
    assert len(admitted) == len(done) == 4 and max(admitted) < min(done), "the four requests did not overlap"
    for p, a, t in zip(prompts, alone, together):
        assert t[1:3] == a[1:3] and t[4] == a[4]  # text and tokens, token for token
        assert t[3] == pytest.approx(a[3], abs=1e-4)
        if sampling is not SEEDED:
            tokens, text, _ = expected(model_dir, p, 64)
            assert a[1] == text and a[4] == len(tokens)


# ---- the conversation cache -------------------------------------------------------------------------
def test_appended_turn_reads_only_its_new_tokens(server, model_dir):
    client = server.openai()
    first = [300 + (k * 7) % 190 for k in range(70)]
    tokens, _, reason = expected(model_dir, first, 20)
    r1 = client.completions.create(model=server.model, prompt=first, max_tokens=20, temperature=0)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0 and r1.usage.completion_tokens == len(tokens)
    conversation = first + tokens + ([511] if reason == "stop" else [])  # every token sampled so far
    turn = conversation + [40, 41, 42, 43, 44]

    def ask():
        r = client.completions.create(model=server.model, prompt=turn, max_tokens=16, temperature=0, logprobs=1)
        return r.choices[0].text, r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs, r.usage

    warm = ask()
    assert warm[3].prompt_tokens == len(turn)
    assert warm[3].prompt_tokens_details.cached_tokens == len(conversation) - 1
    hits = server.metrics_json()["requests"]["prefix_cache_hits"]
    server.erase_all()
    cold = ask()
    assert cold[3].prompt_tokens_details.cached_tokens == 0
    assert cold[:2] == warm[:2] and cold[2] == pytest.approx(warm[2], abs=1e-4)
    assert server.metrics_json()["requests"]["prefix_cache_hits"] == hits  # the cold run reused nothing


def test_appended_chat_turn_reuses_exactly_the_shared_prefix(server, model_dir):
    client = server.openai()
    first = oracle_chat_ids(model_dir, MESSAGES)
    tokens, text, reason = expected(model_dir, first, 20)
    r1 = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=20, temperature=0)
    assert r1.choices[0].message.content == text
    held = first + (tokens if reason == "stop" else tokens[:-1])  # the K/V the slot keeps
    messages = MESSAGES + [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    turn = oracle_chat_ids(model_dir, messages)
    shared = next((i for i, (a, b) in enumerate(zip(turn, held)) if a != b), min(len(turn), len(held)))

    def ask():
        r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=16, temperature=0)
        return r.choices[0].message.content, r.usage

    warm = ask()
    assert warm[1].prompt_tokens == len(turn)
    assert warm[1].prompt_tokens_details.cached_tokens == min(shared, len(turn) - 1) >= len(first)
    server.erase_all()
    cold = ask()
    assert cold[1].prompt_tokens_details.cached_tokens == 0 and cold[0] == warm[0]


# ---- disconnects and metrics ------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["openai", "anthropic"])
def test_a_client_that_disconnects_mid_stream_frees_its_slot_at_once(server, family):
    if family == "openai":
        stream = server.openai().chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=1800,
                                                         temperature=0, stream=True)
        assert [next(stream).choices[0].delta for _ in range(4)][-1].content
    else:
        stream = server.anthropic().messages.create(model="m", system=SYSTEM, messages=MESSAGES[1:],
                                                    max_tokens=1800, extra_body=GREEDY_A, stream=True)
        kinds = [next(stream).type for _ in range(5)]
        assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-1] == "content_block_delta"
    busy = [s for s in server.slots() if s["is_processing"]]
    assert len(busy) == 1
    aborted = server.metrics_json()["requests"]["finished"].get("abort", 0)
    t0 = time.monotonic()
    stream.close()
    while any(s["is_processing"] for s in server.slots()):
        assert time.monotonic() - t0 < 2, "the slot is still busy 2 s after the client left"
        time.sleep(0.01)
    (slot,) = [s for s in server.slots() if s["id"] == busy[0]["id"]]
    assert slot["n_past"] < 1000, slot  # stopped long before max_tokens
    time.sleep(0.2)
    assert server.slots()[slot["id"]]["n_past"] == slot["n_past"]  # and nothing more was computed
    assert server.metrics_json()["requests"]["finished"]["abort"] == aborted + 1


FAMILIES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
    "vllm:request_success", "strata:kv_pool_cells", "strata:kv_pool_free_cells", "strata:kv_pool_held_cells",
    "strata:kv_pool_evictions", "strata:requests_refused", "strata:requests_truncated",
}


def test_metrics_text_agrees_with_the_json_view(server):
    from prometheus_client.parser import text_string_to_metric_families

    client = server.openai()
    for i in range(server.cfg.engine.parallel + 1):  # one conversation more than slots: one is parked
        client.completions.create(model=server.model, prompt=[20 + 40 * i + k for k in range(30)], max_tokens=4,
                                  temperature=0)
    server.wait_idle()
    text = server.http.get("/metrics").text
    snap = server.metrics_json()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert FAMILIES <= set(fams), FAMILIES - set(fams)

    def value(name: str, **labels: str) -> float:
        (v,) = [s.value for s in fams[name].samples if s.labels.items() >= labels.items()
                and not s.name.endswith("_created")]
        return v

    pool = snap["live"]["kv_pool"]
    assert len(pool["parked"]) == 1 and pool["free"] < pool["cells"]
    assert value("strata:kv_pool_cells") == pool["cells"] == 4096
    assert value("strata:kv_pool_free_cells") == pool["free"]
    held = {s.labels["slot"]: s.value for s in fams["strata:kv_pool_held_cells"].samples}
    want = {str(s["slot"]): s["cells"] for s in pool["slots"]}
    want.update({f"parked:{p['table']}": p["cells"] for p in pool["parked"]})
    assert held == want and sum(held.values()) + pool["free"] == pool["cells"]
    assert value("vllm:kv_cache_usage_perc") == pytest.approx((pool["cells"] - pool["free"]) / pool["cells"])
    assert value("vllm:num_requests_running") == snap["live"]["running"] == 0
    assert value("vllm:num_requests_waiting") == snap["live"]["waiting"] == 0
    req = snap["requests"]
    for key in ("prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits"):
        assert value(f"vllm:{key}") == req[key]
    for reason, n in req["finished"].items():
        assert value("vllm:request_success", finished_reason=reason) == n
    e2e = [s for s in fams["vllm:e2e_request_latency_seconds"].samples if s.name.endswith("_count")]
    assert e2e[0].value == snap["latency_seconds"]["e2e"]["count"] == sum(req["finished"].values()) - \
        req["finished"].get("abort", 0) - req["finished"].get("error", 0)
    counters = snap["live"]["counters"]
    assert value("strata:kv_pool_evictions") == counters["evictions"]
    assert value("strata:requests_truncated") == counters["truncations"]
