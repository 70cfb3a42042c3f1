"""Grammar masks on the last stage: the vectorised unpack against a per-token reference, the refusals, the
sampler's order (masked tokens never sampled, logprobs over the masked distribution) and a runner step."""
from __future__ import annotations

import math
import random

import pytest
import torch

from stages.grammar_mask import apply_masks, mask_bytes, unpack
from stages.sampling import Sampler

from .harness import GREEDY, PROMPT_A


def pack(allowed: set[int], vocab: int) -> bytes:
    """The coordinator's layout, built from int32 words: bit i of word w is token 32 * w + i."""
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)


def reference(logits: torch.Tensor, slots: list[int], allowed: dict[int, set[int]]) -> torch.Tensor:
    """One token at a time: -inf where a masked row's token is not allowed."""
    out = logits.float().clone()
    for b, slot in enumerate(slots):
        if slot in allowed:
            for t in range(logits.shape[1]):
                if t not in allowed[slot]:
                    out[b, t] = -math.inf
    return out


def random_allowed(rng: random.Random, vocab: int) -> set[int]:
    return {t for t in range(vocab) if rng.random() < rng.choice((0.02, 0.5, 0.97))} or {rng.randrange(vocab)}


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 520])
def test_apply_matches_the_per_token_reference(vocab):
    rng = random.Random(vocab)
    slots = [3, 0, 2, 1, 5]
    logits = torch.randn(len(slots), vocab, generator=torch.Generator().manual_seed(vocab))
    before = logits.clone()
    allowed = {3: random_allowed(rng, vocab), 2: random_allowed(rng, vocab), 5: {vocab - 1}}
    got = apply_masks(logits, slots, {s: pack(a, vocab) for s, a in allowed.items()})
    assert torch.equal(got, reference(logits, slots, allowed))
    assert torch.equal(got[1], logits[1]) and torch.equal(got[3], logits[3])  # rows without a mask: untouched
    assert torch.equal(logits, before)  # a new tensor
    assert got.dtype == torch.float32


def test_unpack_reads_bit_i_of_word_w_as_token_32w_plus_i():
    words = [1 << 0, 1 << 31, (1 << 5) | (1 << 7)]
    packed = torch.frombuffer(bytearray(b"".join(w.to_bytes(4, "little") for w in words)), dtype=torch.uint8)
    bits = unpack(packed.view(1, -1), 96)[0]
    assert torch.nonzero(bits).flatten().tolist() == [0, 63, 64 + 5, 64 + 7]


def test_bf16_logits_are_masked_as_float32():
    logits = torch.randn(2, 40).to(torch.bfloat16)
    got = apply_masks(logits, [0, 1], {1: pack({4, 39}, 40)})
    assert got.dtype == torch.float32
    assert torch.equal(got[0], logits[0].float())
    assert torch.isfinite(got[1]).nonzero().flatten().tolist() == [4, 39]


def test_bad_masks_are_refused_naming_the_slot():
    logits = torch.zeros(2, 40)
    good = pack({1}, 40)
    cases = [
        ({7: good}, "slots [7], which sample nothing"),
        ({1: good[:-4]}, "slot 1: its grammar mask has 4 bytes, a vocabulary of 40 needs 8"),
        ({1: good + b"\0\0\0\0"}, "has 12 bytes"),
        ({1: pack({1, 45}, 48)}, "slot 1: its grammar mask allows token ids past the vocabulary (40)"),
        ({1: bytes(mask_bytes(40))}, "slot 1: its grammar mask allows no token"),
        ({1: [1, 2]}, "slot 1: a grammar mask must be bytes, got list"),
    ]
    for masks, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                           .replace("]", r"\]")):
            apply_masks(logits, [0, 1], masks)


def _sampler(vocab: int, params: dict[int, dict]) -> Sampler:
    s = Sampler(4, vocab)
    for slot, p in params.items():
        s.reset(slot, p)
    return s


def test_greedy_takes_the_best_allowed_token_and_logprobs_are_over_the_masked_distribution():
    vocab = 50
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(1)) * 3
    allowed = {7, 11, 30}
    s = _sampler(vocab, {0: {"temperature": 0, "logprobs": 5}, 1: {"temperature": 0, "logprobs": 2}})
    (tok0, lp0, top0), (tok1, lp1, top1) = s.sample(logits, [0, 1], {0: pack(allowed, vocab)})
    best = max(allowed, key=lambda t: logits[0, t].item())
    assert tok0 == best
    masked = torch.full((vocab,), -math.inf)
    masked[list(allowed)] = logits[0, list(allowed)]
    want = masked.log_softmax(-1)
    assert lp0 == pytest.approx(want[best].item(), abs=1e-6)
    assert [t for t, _ in top0] == sorted(allowed, key=lambda t: -logits[0, t].item())  # 3 of the 5 asked
    assert [p for _, p in top0] == pytest.approx([want[t].item() for t, _ in top0], abs=1e-6)
    assert tok1 == logits[1].argmax().item() and len(top1) == 2  # the unmasked row is the plain argmax
    assert lp1 == pytest.approx(logits[1].log_softmax(-1)[tok1].item(), abs=1e-6)


def test_sampled_tokens_never_leave_the_mask_under_any_filter():
    vocab = 64
    allowed = {2, 5, 40, 63}
    cases = [{"temperature": 1.0, "seed": 1}, {"temperature": 1.5, "top_k": 10, "seed": 2},
             {"temperature": 0.8, "top_p": 0.5, "seed": 3}, {"min_p": 0.2, "seed": 4},
             {"repetition_penalty": 1.5, "frequency_penalty": 1.0, "seed": 5}]
    for params in cases:
        s = _sampler(vocab, {0: params})
        logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(9)) * 4
        logits[0, 0] = 50.0  # the model's favourite is masked out
        seen = {s.sample(logits, [0], {0: pack(allowed, vocab)})[0][0] for _ in range(200)}
        assert seen <= allowed, params
        assert len(seen) > 1 or params.get("top_k") or params.get("top_p") or params.get("min_p"), params


def test_a_mask_and_a_bias_together_give_bias_then_mask():
    vocab = 32
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(4))
    allowed = {1, 2, 3, 4}
    bias = [[2, 5.0], [3, -100], [9, 100]]  # 9 is masked: its +100 cannot bring it back
    s = _sampler(vocab, {0: {"temperature": 0, "logit_bias": bias, "logprobs": 4}})
    tok, lp, top = s.sample(logits, [0], {0: pack(allowed, vocab)})[0]
    x = logits[0].clone()
    x[2] += 5.0
    x[3] = -math.inf
    x[9] += 100
    keep = torch.tensor([t in allowed for t in range(vocab)])
    want = x.masked_fill(~keep, -math.inf).log_softmax(-1)
    assert tok == 2
    assert lp == pytest.approx(want[2].item(), abs=1e-6)
    assert sorted(t for t, _ in top) == [1, 2, 4]  # banned 3 and masked tokens are no alternatives


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_apply_equals_cpu():
    vocab = 151_936
    rng = random.Random(0)
    slots = list(range(8))
    allowed = {s: random_allowed(rng, 2000) | {vocab - 1 - s} for s in slots[::2]}
    masks = {s: pack(a, vocab) for s, a in allowed.items()}
    logits = torch.randn(len(slots), vocab)
    cpu = apply_masks(logits, slots, masks)
    gpu = apply_masks(logits.cuda(), slots, masks)
    assert gpu.device.type == "cuda"
    assert torch.equal(gpu.cpu(), cpu)


def test_a_runner_step_samples_inside_the_mask(local):
    lo = local([[0, 2], [2, 4]])
    free = lo.step([[0, 0, len(PROMPT_A), 1]], PROMPT_A, {0: dict(GREEDY)})[0][1]
    vocab = lo.runners[-1].model.vocab_size
    assert lo.runners[-1].hello()["vocab"] == vocab
    lo.map.release(0)
    allowed = {t for t in range(vocab) if t % 7 == 3 and t != free}
    lo.step_id += 1
    lo.map.reserve(1, len(PROMPT_A))
    lo.sync()
    header = {"step": lo.step_id, "version": lo.map.version, "slots": [[1, 0, len(PROMPT_A), 1]],
              "sampling": {1: dict(GREEDY, logprobs=3)}, "masks": {1: pack(allowed, vocab)}}
    x = None
    ids = torch.tensor(PROMPT_A, dtype=torch.int32)
    for r in lo.runners:
        x = r.step(header, ids, x)
    (slot, token, logprob, top), = x
    assert slot == 1 and token in allowed and token != free
    assert all(t in allowed for t, _ in top) and top[0][0] == token
    header = {"step": lo.step_id + 1, "version": lo.map.version, "slots": [[1, 0, 4, 0]], "sampling": {},
              "masks": {1: pack(allowed, vocab)}}
    with pytest.raises(ValueError, match="grammar masks for slots \\[1\\], which sample nothing"):
        x = None
        for r in lo.runners:
            x = r.step(header, ids[:4], x)
