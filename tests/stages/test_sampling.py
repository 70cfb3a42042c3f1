"""Sampling: filtered distributions against transformers' own logits processors (the oracle), greedy,
per-slot seeds, and the exact arithmetic of the OpenAI penalties."""
from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from stages.sampling import MAX_LOGPROBS, Sampler, SamplingParams

V = 64


def _logits(b: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * scale


def _hf_probs(logits: torch.Tensor, history: list[int], p: dict) -> torch.Tensor:
    """transformers' chain in our order: repetition penalty, temperature, top-k, top-p, min-p."""
    x = logits.clone()
    ids = torch.tensor([history])
    if p.get("repetition_penalty", 1.0) != 1.0:
        x = RepetitionPenaltyLogitsProcessor(p["repetition_penalty"])(ids, x)
    if p.get("temperature", 1.0) != 1.0:
        x = TemperatureLogitsWarper(p["temperature"])(ids, x)
    if p.get("top_k", 0) > 0:
        x = TopKLogitsWarper(p["top_k"])(ids, x)
    if p.get("top_p", 1.0) < 1.0:
        x = TopPLogitsWarper(p["top_p"])(ids, x)
    if p.get("min_p", 0.0) > 0:
        x = MinPLogitsWarper(p["min_p"])(ids, x)
    return x.softmax(dim=-1)


CASES = [
    {"temperature": 0.7, "top_k": 5},
    {"top_p": 0.8},
    {"top_p": 0.3, "temperature": 1.5},
    {"min_p": 0.1},
    {"temperature": 0.5, "top_k": 20, "top_p": 0.9, "min_p": 0.05},
    {"repetition_penalty": 1.3, "top_k": 10},
    {"repetition_penalty": 0.8, "temperature": 0.9, "top_p": 0.95, "min_p": 0.02},
    {"top_k": 1},
    {"top_p": 0.01},
    {"top_k": V + 10},
    {},
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_filtered_distribution_matches_transformers(case):
    logits = _logits(1, seed=hash(str(case)) % 1000)
    history = [0, 3, 3, 7, 11, 40, 63]
    s = Sampler(n_slots=3, vocab=V)
    s.reset(2, case, history)
    probs, _ = s.distribution(logits, [2])
    want = _hf_probs(logits, history, case)
    assert torch.equal(probs > 0, want > 0), "the kept tokens differ"
    torch.testing.assert_close(probs, want, rtol=1e-5, atol=1e-7)
    if case.get("top_k", 0) and case["top_k"] < V:
        assert int((probs > 0).sum()) <= case["top_k"]


def test_a_batch_of_mixed_parameters_filters_each_row_as_if_alone():
    logits = _logits(len(CASES), seed=5)
    history = [1, 2, 2, 9]
    batch = Sampler(n_slots=len(CASES), vocab=V)
    for slot, case in enumerate(CASES):
        batch.reset(slot, case, history)
    order = list(range(len(CASES)))[::-1]
    probs, _ = batch.distribution(logits[order], order)
    for row, slot in enumerate(order):
        want = _hf_probs(logits[slot:slot + 1], history, CASES[slot])
        assert torch.equal(probs[row:row + 1] > 0, want > 0)
        torch.testing.assert_close(probs[row:row + 1], want, rtol=1e-5, atol=1e-7)


def test_greedy_is_argmax_of_the_penalised_logits():
    logits = _logits(4, seed=1)
    s = Sampler(4, V)
    for slot in range(3):
        s.reset(slot, {"temperature": 0, "top_k": 3, "top_p": 0.5, "seed": slot})
    out = s.sample(logits[:3], [0, 1, 2])
    assert [t for t, _, _ in out] == logits[:3].argmax(dim=-1).tolist()
    # With a repetition penalty the argmax moves off a token seen in the prompt.
    x = torch.zeros(1, V)
    x[0, 10], x[0, 20] = 3.0, 2.0
    s.reset(3, {"temperature": 0, "repetition_penalty": 2.0}, history=[10])
    assert s.sample(x, [3])[0][0] == 20
    assert s.sample(x, [3])[0][0] == 10  # 20 is seen now too: 3 / 2 > 2 / 2


def test_same_seed_same_tokens_alone_and_in_a_batch_of_four():
    steps = [_logits(4, seed=100 + i, scale=1.0) for i in range(40)]
    alone = Sampler(4, V)
    alone.reset(1, {"seed": 1234, "top_p": 0.95})
    solo = [alone.sample(st[1:2], [1])[0][0] for st in steps]

    batch = Sampler(4, V)
    batch.reset(0, {"seed": 7, "temperature": 0.5})
    batch.reset(1, {"seed": 1234, "top_p": 0.95})
    batch.reset(2, {"temperature": 0})
    batch.reset(3, {"top_k": 3, "presence_penalty": 1.0})
    together = []
    for st in steps:
        rows = [3, 1, 0, 2]  # the slot sits in a different row than alone
        together.append(batch.sample(st[rows], rows)[1][0])
    assert together == solo

    other = Sampler(4, V)
    other.reset(1, {"seed": 1235, "top_p": 0.95})
    assert [other.sample(st[1:2], [1])[0][0] for st in steps] != solo
    assert len(set(solo)) > 5  # the seed really samples, it does not collapse to argmax


def test_presence_and_frequency_penalties_change_logits_by_exactly_the_documented_amounts():
    s = Sampler(2, V)
    s.reset(0, {"temperature": 0, "presence_penalty": 0.5, "frequency_penalty": 0.25}, history=[5, 5, 6])
    for token in (3, 7, 3):
        forced = torch.full((1, V), -10.0)
        forced[0, token] = 10.0
        assert s.sample(forced, [0])[0][0] == token
    base = torch.randint(-16, 16, (1, V)).float() / 4  # dyadic: the arithmetic below is exact
    got = s.penalise(base, [0]) - base
    want = torch.zeros(1, V)
    want[0, 3] = -(0.25 * 2 + 0.5)
    want[0, 7] = -(0.25 * 1 + 0.5)
    assert torch.equal(got, want)  # prompt tokens 5, 6 do not count; nothing else moves
    # A fresh request on the slot starts from zero counts.
    s.reset(0, {"presence_penalty": 0.5, "frequency_penalty": 0.25}, history=[3])
    assert torch.equal(s.penalise(base, [0]), base)


def test_repetition_penalty_counts_prompt_and_generated_tokens():
    s = Sampler(1, V)
    s.reset(0, {"temperature": 0, "repetition_penalty": 2.0}, history=[1, 2])
    x = torch.zeros(1, V)
    x[0, 1], x[0, 2], x[0, 9] = 4.0, -4.0, 8.0
    assert s.sample(x, [0])[0][0] == 9
    got = s.penalise(x, [0])
    assert (got[0, 1].item(), got[0, 2].item(), got[0, 9].item()) == (2.0, -8.0, 4.0)


def test_sampled_frequencies_follow_the_distribution_and_never_leave_the_support():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0] + [-9.0] * (V - 6)])
    s = Sampler(1, V)
    s.reset(0, {"seed": 0, "top_k": 4, "temperature": 0.8})
    probs, _ = s.distribution(logits, [0])
    n = 6000
    counts = torch.zeros(V)
    for _ in range(n):
        counts[s.sample(logits, [0])[0][0]] += 1
    assert counts[4:].sum() == 0
    # 4 sigma of a binomial count for each token.
    for t in range(4):
        p = probs[0, t].item()
        assert abs(counts[t].item() - n * p) < 4 * math.sqrt(n * p * (1 - p)), (t, counts[t], n * p)


def test_logprobs_are_log_softmax_after_penalties_and_temperature_before_filters():
    logits = _logits(2, seed=9)
    s = Sampler(2, V)
    s.reset(0, {"temperature": 0.5, "top_k": 2, "logprobs": 5, "seed": 3})
    s.reset(1, {"temperature": 0, "logprobs": 0})
    (tok0, lp0, top0), (tok1, lp1, top1) = s.sample(logits, [0, 1])
    ref0 = (logits[0] / 0.5).log_softmax(-1)
    assert lp0 == pytest.approx(ref0[tok0].item(), abs=1e-6)
    assert [i for i, _ in top0] == ref0.topk(5).indices.tolist()
    assert [lp for _, lp in top0] == pytest.approx(ref0.topk(5).values.tolist(), abs=1e-6)
    assert tok0 in [i for i, _ in top0[:2]]
    assert top1 == [] and lp1 == pytest.approx(logits[1].log_softmax(-1)[tok1].item(), abs=1e-6)


def test_params_from_dict():
    p = SamplingParams.from_dict({"temperature": 0, "top_k": 40.0, "seed": None, "logprobs": 3})
    assert (p.temperature, p.top_k, p.seed, p.logprobs, p.greedy) == (0.0, 40, None, 3, True)
    assert SamplingParams.from_dict({}) == SamplingParams()
    with pytest.raises(ValueError, match="unknown sampling keys"):
        SamplingParams.from_dict({"temprature": 1.0})
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"min_p": 2}, {"top_k": -1},
                {"top_k": 2.5}, {"repetition_penalty": 0}, {"logprobs": MAX_LOGPROBS + 1},
                {"temperature": float("nan")}, {"seed": "x"}):
        with pytest.raises(ValueError):
            SamplingParams.from_dict(bad)


def test_fresh_seeds_unreset_slots_and_shapes():
    s = Sampler(2, V)
    s.reset(0, {})
    s.reset(1, {})
    assert s.seeds[0] is not None and s.seeds[0] != s.seeds[1]
    s.reset(0, {"seed": 5})
    assert s.seeds[0] == 5
    with pytest.raises(ValueError, match="reset it"):
        Sampler(2, V).sample(torch.zeros(1, V), [1])
    with pytest.raises(ValueError, match="logits shape"):
        s.sample(torch.zeros(1, V + 1), [0])
    with pytest.raises(ValueError, match="out of range"):
        s.reset(2, {})


def test_top_p_boundary_is_inclusive_as_in_transformers():
    # Four equal tokens, the rest impossible: cumulative mass is exactly 0.25, 0.5, 0.75, 1.
    logits = torch.full((1, V), -math.inf)
    logits[0, [4, 9, 16, 25]] = 0.0
    s = Sampler(1, V)
    s.reset(0, {"top_p": 0.5})
    probs, _ = s.distribution(logits, [0])
    want = _hf_probs(logits, [], {"top_p": 0.5})
    assert int((probs > 0).sum()) == int((want > 0).sum()) == 2
    assert torch.equal(probs, want)


@pytest.mark.parametrize("penalty_state", [False, True])
def test_all_greedy_batch_gives_what_the_full_path_gives(penalty_state):
    """A batch of greedy, unpenalised rows takes a short path; tokens, logprobs and top lists match the full
    path (distribution), ties included, and the penalty state (allocated by another slot) still records them."""
    s = Sampler(4, V)
    if penalty_state:
        s.reset(3, {"temperature": 0.7, "presence_penalty": 0.5})
    logits = _logits(3, 11)
    logits[1, 5] = logits[1, 9] = logits[1].max() + 1  # a tie: the first index wins on both paths
    for slot, n_top in ((0, 0), (1, 3), (2, 5)):
        s.reset(slot, {"temperature": 0, "logprobs": n_top})
    got = s.sample(logits, [0, 1, 2])
    _, logprobs = s.distribution(logits, [0, 1, 2])
    want_tokens = logits.argmax(-1).tolist()
    assert [t for t, _, _ in got] == want_tokens and want_tokens[1] == 5
    for b, (token, lp, top) in enumerate(got):
        assert lp == logprobs[b, token].item()
        k = (0, 3, 5)[b]
        vals, ids = logprobs[b].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert top == list(zip(ids.tolist(), vals.tolist()))
    if penalty_state:
        assert s._counts[[0, 1, 2], want_tokens].tolist() == [1, 1, 1]


def test_logit_bias_adds_exactly_and_minus_100_bans():
    s = Sampler(2, V)
    s.reset(0, {"temperature": 0, "logit_bias": [[3, 1.5], [7, -0.25], [9, -100]]})
    base = torch.randint(-16, 16, (1, V)).float() / 4
    got = s.penalise(base, [0])
    want = base.clone()
    want[0, 3] += 1.5
    want[0, 7] -= 0.25
    want[0, 9] = -math.inf
    assert torch.equal(got, want)  # nothing else moves
    s.reset(1, {}, history=[1])
    assert torch.equal(s.penalise(base, [1]), base)  # an unbiased row is untouched


def test_a_banned_token_is_never_sampled_and_plus_100_wins_under_greedy():
    logits = _logits(1, seed=21)
    top = int(logits.argmax())
    low = int(logits.argmin())
    s = Sampler(3, V)
    s.reset(0, {"temperature": 0, "logit_bias": [[top, -100]]})
    s.reset(1, {"temperature": 0, "logit_bias": [[low, 100]]})
    s.reset(2, {"temperature": 1.0, "seed": 4, "logit_bias": [[top, -100]]})
    (t0, _, _), (t1, _, _), _ = s.sample(logits.repeat(3, 1), [0, 1, 2])
    masked = logits[0].clone()
    masked[top] = -math.inf
    assert t0 == int(masked.argmax()) != top
    assert t1 == low
    # A sampled row never draws a banned token, even where every token is as likely as it.
    flat = torch.zeros(1, V)
    drawn = {s.sample(flat, [2])[0][0] for _ in range(400)}
    assert top not in drawn and len(drawn) > 10
    probs, logprobs = s.distribution(flat, [2])
    assert probs[0, top] == 0 and logprobs[0, top] == -math.inf


def test_a_biased_greedy_batch_leaves_the_short_path():
    logits = _logits(2, seed=13)
    s = Sampler(2, V)
    s.reset(0, {"temperature": 0, "logprobs": 2})
    s.reset(1, {"temperature": 0, "logprobs": 2, "logit_bias": [[int(logits[1].argmin()), 100]]})
    (t0, lp0, _), (t1, lp1, top1) = s.sample(logits, [0, 1])
    assert t0 == int(logits[0].argmax()) and t1 == int(logits[1].argmin())
    biased = logits[1].clone()
    biased[t1] += 100
    assert lp1 == pytest.approx(biased.log_softmax(-1)[t1].item(), abs=1e-6)  # the logprob includes the bias
    assert top1[0][0] == t1


def test_logit_bias_is_checked():
    p = SamplingParams.from_dict({"logit_bias": [[5, 2], [5, -1.0], [8, 100]]})
    assert p.logit_bias == ((5, -1.0), (8, 100.0)) and p.biased
    assert SamplingParams.from_dict({"logit_bias": None}) == SamplingParams() and not SamplingParams().biased
    for bad in ([[1, 100.5]], [[1, -101]], [[-1, 0]], [[1.5, 0]], [[1, "x"]], [[1, float("nan")]], [1], 7,
                [[True, 1]]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams.from_dict({"logit_bias": bad})
    s = Sampler(1, V)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.reset(0, {"logit_bias": [[V, 1]]})
    with pytest.raises(ValueError, match="bans every token"):
        s.reset(0, {"logit_bias": [[t, -100] for t in range(V)]})
