"""The reasoning section split (coordinator/reasoning.py): whole texts with exact expected splits, and every
cut of them into deltas giving the same split."""
from __future__ import annotations

import random

import pytest

from coordinator import reasoning
from coordinator.reasoning import ThinkSplitter, prompt_opens_thinking, split, template_thinks

CASES = [
    # (text, prompt opened the section, expected (reasoning, answer))
    ("<think>\nsky is blue\n</think>\n\nBlue.", False, ("\nsky is blue\n", "Blue.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("sky is blue\n</think>\n\nBlue.", True, ("sky is blue\n", "Blue.")),
    ("no section here", False, ("", "no section here")),
    ("Answer first <think>then</think>", False, ("", "Answer first <think>then</think>")),
    ("<think>never closed, ran out", False, ("never closed, ran out", "")),
    ("still thinking </thi", True, ("still thinking </thi", "")),
    ("</think>", True, ("", "")),
    ("<thin", False, ("", "<thin")),
    ("", True, ("", "")),
    ("a < b and </ c </think>\n\n<think> stays in the answer", True,
     ("a < b and </ c ", "<think> stays in the answer")),
]


@pytest.mark.parametrize("text,inside,want", CASES)
def test_split_whole(text, inside, want):
    assert split(text, inside) == want


def _streamed(text: str, inside: bool, cuts: list[int]) -> tuple[str, str]:
    s = ThinkSplitter(inside)
    r, a = [], []
    last = 0
    for c in cuts + [len(text)]:
        x, y = s.feed(text[last:c])
        r.append(x)
        a.append(y)
        last = c
    x, y = s.flush()
    return "".join(r) + x, "".join(a) + y


@pytest.mark.parametrize("text,inside,want", CASES)
def test_every_cut_gives_the_same_split(text, inside, want):
    for step in (1, 2, 3):
        assert _streamed(text, inside, list(range(step, len(text), step))) == want
    rng = random.Random(7)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 5)))) if len(text) > 1 else []
        assert _streamed(text, inside, cuts) == want


def test_a_marker_prefix_is_held_until_known():
    s = ThinkSplitter(inside=True)
    assert s.feed("abc </th") == ("abc ", "")
    assert s.feed("ink>\n\nok") == ("", "ok")
    assert s.reasoning_done


def test_templates_and_prompts():
    assert template_thinks("{{ '<think>\\n' }}") and not template_thinks("plain") and not template_thinks(None)
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<think>old</think> user turn")
    assert reasoning.prompt_closes_thinking("assistant\n<think>\n\n</think>\n\n")
    assert not reasoning.prompt_closes_thinking("<think>old</think> user turn<|im_start|>assistant\n")
    assert not reasoning.prompt_closes_thinking("assistant\n<think>\n")
    assert reasoning.THINK_OPEN == "<think>" and reasoning.THINK_CLOSE == "</think>"


def test_a_reasoning_grammar_lets_the_section_close_before_its_budget(tokenizer):
    from coordinator import grammar as g
    from coordinator.thinking_budget import SectionBudget

    gt = g.GrammarTokenizer.for_tokenizer(tokenizer, tokenizer.vocab_size)
    for opened in (True, False):
        budget = gt.budget(SectionBudget(50, opened), tokenizer)
        m = g.Matcher(gt, g.after_reasoning(g.json_object(), opened, "<think>", "</think>"), budget=budget)
        for t in tokenizer.encode(("" if opened else "<think>") + 'hmm</think>\n\n{"a": 1}'):
            m.mask()
            m.advance(t)
        assert m.finished
