"""Token sampling on the last stage: logit bias, penalties, temperature, top-k, top-p, min-p, per-slot seeds.

A request's sampling parameters arrive once, in the step header that starts it (`Sampler.reset`); every
later step only says which slots to sample. The sampler keeps, per slot, the parameters, a
`torch.Generator` and (when a penalty needs them) which tokens the conversation has seen and how often
each was generated.

Order (one row of logits, float32):
  0. logit_bias: x[id] += bias for each (id, bias) of the request (OpenAI's `logit_bias`, bias in
                 [-100, 100]); a bias of -100 bans the token (x[id] = -inf: it is never sampled, greedy or not);
     grammar mask (stages/grammar_mask.py, the step's "masks"): x[id] = -inf for every id the slot's grammar
                 does not allow next, so such a token is never sampled, greedy or not, and every logprob is
                 over the masked distribution. It is applied as the logits arrive, which gives what applying
                 it after the bias gives (-inf + bias = -inf), and the short greedy path below keeps it;
  1. penalties:  repetition (transformers' rule, over prompt + generated tokens: a seen token's logit
                 x becomes x * r if x < 0 else x / r), then
                 x -= frequency_penalty * count + presence_penalty * (count > 0)
                 over generated tokens only (OpenAI's rule; the prompt does not count);
  2. temperature: x /= temperature (temperature 0 = greedy: the token is argmax of the penalised logits
                 and no filter below matters);
  3. top_k (0 = off; ties with the k-th logit are kept), 4. top_p (1 = off), 5. min_p (0 = off),
     each as transformers' TopK/TopP/MinPLogitsWarper does it;
  6. sample from softmax of what is left.
The reported logprob of a token (sampled or in the top list) is log_softmax of the logits after steps 0-2,
before any filter: it says how likely the model (with bias, penalties and temperature) found the token, not
how likely the truncated distribution made it. Greedy rows use temperature 1 for it. The top list holds only
tokens that can be sampled: a banned or masked token (logprob -inf) is no alternative.

Reproducibility: a row draws exactly one uniform number from its slot's own CPU generator per sampled
token and picks the token by inverse CDF, so a seed gives the same tokens whatever else is in the batch
and on any device (up to the logits themselves). Rows whose parameters are the defaults pass through every
step unchanged (x / 1, x - 0, no mask), so the batch is processed as one tensor without per-row branches.
A batch whose rows are all greedy, unbiased and unpenalised (the common decode step) skips the steps that
cannot change anything for it: its tokens are the argmax of the logits and its logprobs one log_softmax,
the same values the full path gives.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .grammar_mask import apply_masks

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
MAX_BIAS = 100.0  # OpenAI's range of a logit_bias value is [-MAX_BIAS, MAX_BIAS]; -MAX_BIAS bans the token

SampleResult = tuple[int, float, list[tuple[int, float]]]


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling parameters; the defaults change nothing (plain sampling at temperature 1)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, ids distinct

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"sampling.{name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("top_k", "logprobs", "seed"):
            value = getattr(self, name)
            if value is None and name == "seed":
                continue
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"sampling.{name} must be an integer, got {value!r}")
            object.__setattr__(self, name, value)
        checks = [
            (self.temperature >= 0, "temperature must be >= 0 (0 = greedy)"),
            (self.top_k >= 0, "top_k must be >= 0 (0 = off)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0 (1 = off)"),
            (0 <= self.logprobs <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"sampling.{message}; got {self}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SamplingParams":
        """Build from a plain dict (the step header). Unknown keys are refused; a None value means the
        default (clients send null for what they leave unset)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling keys {unknown}; known: {sorted(known)}")
        return cls(**{k: v for k, v in d.items() if v is not None})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) != (0.0, 0.0, 1.0)

    @property
    def biased(self) -> bool:
        return bool(self.logit_bias)


def _bias_pairs(value: Any) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (id, bias) pairs: from pairs (the wire's [[id, bias], ...]) or a mapping; a later
    pair for the same id wins. Ids are integers >= 0, biases finite numbers in [-MAX_BIAS, MAX_BIAS]."""
    if not isinstance(value, (Mapping, list, tuple)):
        raise ValueError(f"sampling.logit_bias must be [[token id, bias], ...], got {value!r}")
    items = value.items() if isinstance(value, Mapping) else value
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ValueError(f"sampling.logit_bias entries must be [token id, bias] pairs, got {item!r}")
        token, bias = item
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"sampling.logit_bias: token ids must be integers >= 0, got {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise ValueError(f"sampling.logit_bias: a bias must be a number in [-{MAX_BIAS:g}, {MAX_BIAS:g}], "
                             f"got {bias!r} for token {token}")
        out[token] = float(bias)
    return tuple(out.items())


class Sampler:
    """Per-slot sampling state for `n_slots` decode slots over a vocabulary of `vocab` logits."""

    def __init__(self, n_slots: int, vocab: int, device: str | torch.device = "cpu") -> None:
        self.n_slots, self.vocab, self.device = n_slots, vocab, torch.device(device)
        self.params: list[SamplingParams | None] = [None] * n_slots
        self.seeds: list[int | None] = [None] * n_slots
        self._generators: list[torch.Generator | None] = [None] * n_slots
        f32 = dict(dtype=torch.float32, device=self.device)
        # Per-slot parameters as device rows, so a step gathers them with one index.
        self._temperature = torch.ones(n_slots, **f32)
        self._top_k = torch.zeros(n_slots, dtype=torch.long, device=self.device)
        self._top_p = torch.ones(n_slots, **f32)
        self._min_p = torch.zeros(n_slots, **f32)
        self._presence = torch.zeros(n_slots, **f32)
        self._frequency = torch.zeros(n_slots, **f32)
        self._repetition = torch.ones(n_slots, **f32)
        # [n_slots, vocab] penalty state, allocated when the first penalised request arrives (it is
        # n_slots * vocab * 5 bytes). Rows of unpenalised slots stay zero and are never read meaningfully.
        self._seen: torch.Tensor | None = None  # prompt + generated tokens (repetition penalty)
        self._counts: torch.Tensor | None = None  # generated tokens only (presence / frequency)
        # Per slot (ids, biases) on the device, bans as -inf; None without a logit_bias. Sparse: a request
        # biases a few tokens, and a dense [n_slots, vocab] row would be 4 * vocab bytes per slot.
        self._bias: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_slots

    def reset(self, slot: int, params: Mapping[str, Any] | SamplingParams, history: Sequence[int] = ()) -> None:
        """Start a request on `slot`: its parameters, a generator seeded with `seed` (a fresh random seed
        when None, kept in `self.seeds`), and `history` (the prompt ids) for the repetition penalty."""
        p = params if isinstance(params, SamplingParams) else SamplingParams.from_dict(params)
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.n_slots})")
        bias = self._bias_row(p)
        seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.params[slot], self.seeds[slot] = p, seed
        self._generators[slot] = torch.Generator().manual_seed(seed)
        for row, value in ((self._temperature, p.temperature), (self._top_k, p.top_k), (self._top_p, p.top_p),
                           (self._min_p, p.min_p), (self._presence, p.presence_penalty),
                           (self._frequency, p.frequency_penalty), (self._repetition, p.repetition_penalty)):
            row[slot] = value
        self._bias[slot] = bias
        if p.penalised and self._seen is None:
            self._seen = torch.zeros(self.n_slots, self.vocab, dtype=torch.bool, device=self.device)
            self._counts = torch.zeros(self.n_slots, self.vocab, dtype=torch.int32, device=self.device)
        if self._seen is not None:
            self._seen[slot].zero_()
            self._counts[slot].zero_()
            ids = [t for t in history if 0 <= t < self.vocab]
            if ids:
                self._seen[slot, torch.tensor(ids, dtype=torch.long, device=self.device)] = True

    def _bias_row(self, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A request's logit_bias as device tensors; refused: an id past the vocabulary, every token banned."""
        if not p.biased:
            return None
        ids = [t for t, _ in p.logit_bias]
        if max(ids) >= self.vocab:
            raise ValueError(f"sampling.logit_bias: token id {max(ids)} is outside the vocabulary [0, {self.vocab})")
        values = [-math.inf if b <= -MAX_BIAS else b for _, b in p.logit_bias]
        if sum(1 for v in values if v == -math.inf) >= self.vocab:
            raise ValueError("sampling.logit_bias bans every token of the vocabulary")
        return (torch.tensor(ids, dtype=torch.long, device=self.device),
                torch.tensor(values, dtype=torch.float32, device=self.device))

    def penalise(self, logits: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """Steps 0-1 on float32 logits [B, V] (a new tensor); unbiased, unpenalised rows come back unchanged."""
        x = logits.float().clone()
        for row, slot in enumerate(slots):
            bias = self._bias[slot]
            if bias is not None:
                x[row].index_add_(0, bias[0], bias[1])
        if self._seen is None or not any(self._slot(s).penalised for s in slots):
            return x
        idx = torch.tensor(slots, dtype=torch.long, device=x.device)
        r = self._repetition[idx, None]
        x = torch.where(self._seen[idx], torch.where(x < 0, x * r, x / r), x)
        counts = self._counts[idx].float()
        return x - self._frequency[idx, None] * counts - self._presence[idx, None] * (counts > 0).float()

    def filter(self, x: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """Steps 3-5 on tempered logits [B, V]: removed tokens become -inf (a new tensor)."""
        params = [self._slot(s) for s in slots]
        idx = torch.tensor(slots, dtype=torch.long, device=x.device)
        k_max = min(max(p.top_k for p in params), x.shape[1])
        if k_max > 0:
            k = self._top_k[idx].clamp(max=k_max)
            kth = x.topk(k_max, dim=-1).values.gather(1, (k - 1).clamp(min=0)[:, None])
            kth = torch.where((k > 0)[:, None], kth, -math.inf)  # top_k 0: keep everything
            x = x.masked_fill(x < kth, -math.inf)
        if any(p.top_p < 1 for p in params):
            sorted_x, order = x.sort(dim=-1)  # ascending, as TopPLogitsWarper
            cumulative = sorted_x.softmax(dim=-1).cumsum(dim=-1)
            remove = cumulative <= (1 - self._top_p[idx, None])
            remove[:, -1] = False
            remove &= (self._top_p[idx] < 1)[:, None]
            x = x.masked_fill(remove.scatter(1, order, remove), -math.inf)
        if any(p.min_p > 0 for p in params):
            probs = x.softmax(dim=-1)
            remove = probs < self._min_p[idx, None] * probs.amax(dim=-1, keepdim=True)
            remove.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
            x = x.masked_fill(remove, -math.inf)
        return x

    def distribution(self, logits: torch.Tensor, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs, logprobs) per row of `logits` [B, V]: the distribution a token is drawn from after
        steps 0-5 (one-hot at the argmax of the biased, penalised logits for greedy rows) and the reported
        logprobs (log_softmax after steps 0-2)."""
        self._check_shape(logits, slots)
        params = [self._slot(s) for s in slots]
        idx = torch.tensor(slots, dtype=torch.long, device=logits.device)
        x = self.penalise(logits, slots)
        greedy = torch.tensor([p.greedy for p in params], device=x.device)
        x = x / torch.where(greedy, 1.0, self._temperature[idx])[:, None]
        logprobs = x.log_softmax(dim=-1)
        if not any(p.greedy for p in params):
            return self.filter(x, slots).softmax(dim=-1), logprobs
        one_hot = torch.zeros_like(x).scatter_(1, x.argmax(dim=-1, keepdim=True), 1.0)
        if all(p.greedy for p in params):
            return one_hot, logprobs
        return torch.where(greedy[:, None], one_hot, self.filter(x, slots).softmax(dim=-1)), logprobs

    def sample(self, logits: torch.Tensor, slots: list[int],
               masks: Mapping[int, bytes] | None = None) -> list[SampleResult]:
        """Sample one token per row of `logits` [B, V] for `slots` (row b belongs to slots[b]); `masks` holds
        the grammar masks of the slots that have one (step 0).

        Returns (token, logprob, top) per row, top being the `logprobs` most likely (id, logprob) pairs,
        most likely first (empty when 0), and records each token in its slot's state.
        """
        params = [self._slot(s) for s in slots]
        if masks:
            logits = apply_masks(logits, slots, masks)
        if all(p.greedy and not p.penalised and not p.biased for p in params):
            # What `distribution` gives for such rows, without its one-hot: the argmax of the logits and the
            # log_softmax at temperature 1 (x / 1 and the unbiased, unpenalised copy change no value).
            self._check_shape(logits, slots)
            x = logits.float()
            tokens, logprobs = x.argmax(dim=-1), x.log_softmax(dim=-1)
            return self._finish(tokens, logprobs, slots, params)
        probs, logprobs = self.distribution(logits, slots)
        tokens = probs.argmax(dim=-1)
        if not all(p.greedy for p in params):
            # Inverse CDF with one uniform per sampled row from the slot's own generator; greedy rows
            # draw nothing (their one-hot row would give the argmax anyway).
            u = torch.tensor([0.0 if p.greedy else torch.rand((), generator=self._generators[s],
                                                              dtype=torch.float64).item()
                              for s, p in zip(slots, params)], dtype=torch.float64, device=probs.device)
            cdf = probs.double().cumsum(dim=-1)
            drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=self.vocab - 1)
            # Rounding could land past the last token with mass; the top token is then the honest answer.
            tokens = torch.where(probs.gather(1, drawn) > 0, drawn, tokens[:, None])[:, 0]
        return self._finish(tokens, logprobs, slots, params)

    def _finish(self, tokens: torch.Tensor, logprobs: torch.Tensor, slots: list[int],
                params: list[SamplingParams]) -> list[SampleResult]:
        """Record the chosen tokens in the penalty state and return (token, logprob, top) per row."""
        chosen = logprobs.gather(1, tokens[:, None])[:, 0]
        n_top = min(max(p.logprobs for p in params), self.vocab)
        if self._seen is not None:
            idx = torch.tensor(slots, dtype=torch.long, device=tokens.device)
            self._seen[idx, tokens] = True
            self._counts.index_put_((idx, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
        tokens_l, chosen_l = tokens.tolist(), chosen.tolist()
        top_lp, top_ids = logprobs.topk(n_top, dim=-1) if n_top else (None, None)
        top_ids_l, top_lp_l = (top_ids.tolist(), top_lp.tolist()) if n_top else ([], [])
        return [(tokens_l[b], chosen_l[b],
                 [(i, lp) for i, lp in zip(top_ids_l[b][:p.logprobs], top_lp_l[b][:p.logprobs]) if lp > -math.inf]
                 if p.logprobs else [])
                for b, p in enumerate(params)]

    def _check_shape(self, logits: torch.Tensor, slots: list[int]) -> None:
        """Logits come as one row per slot, each over the whole vocabulary."""
        if logits.dim() != 2 or logits.shape != (len(slots), self.vocab):
            raise ValueError(f"logits shape {tuple(logits.shape)} != ({len(slots)}, {self.vocab})")

    def _slot(self, slot: int) -> SamplingParams:
        p = self.params[slot]
        if p is None:
            raise ValueError(f"slot {slot} has no request: reset it before sampling")
        return p
