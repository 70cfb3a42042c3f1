"""coordinator/thinking_budget.py on a byte tokenizer (one token per byte), where every rule can be stepped
through by hand; tests/coordinator/test_grammar.py walks it with the tiny tokenizer and a grammar."""
from __future__ import annotations

import pytest

from coordinator.thinking_budget import BudgetCounter, SectionBudget

MARK = [ord(c) for c in "</think>"]


def counter(tokens: int, opened: bool) -> BudgetCounter:
    return BudgetCounter(SectionBudget(tokens, opened), "<think>", "</think>",
                         encode=lambda s: list(s.encode()), decode=bytes)


def feed(c: BudgetCounter, text: str) -> None:
    for b in text.encode():
        assert c.forced() is None
        c.advance(b)


def take_forced(c: BudgetCounter) -> list[int]:
    out = []
    while (t := c.forced()) is not None:
        out.append(t)
        c.advance(t)
    return out


def test_an_opened_section_is_cut_at_the_budget_and_the_whole_marker_is_forced():
    c = counter(5, opened=True)
    feed(c, "abcde")
    assert c.inside == 5 and take_forced(c) == MARK
    c.advance(ord("x"))  # the answer: nothing more is forced
    assert c.forced() is None


def test_a_section_the_model_closes_first_forces_nothing():
    c = counter(20, opened=True)
    feed(c, "ab</think>\n\n" + "y" * 30)
    assert c.forced() is None


def test_a_completion_that_opens_its_own_section_counts_from_the_marker():
    c = counter(3, opened=False)
    feed(c, "<think>xyz")
    assert take_forced(c) == MARK
    late = counter(3, opened=False)
    feed(late, " <think>" + "q" * 10)  # the section opens only at the very start: this is an answer
    assert late.forced() is None


def test_a_budget_of_zero_forces_the_marker_at_once_and_a_wrong_token_while_forcing_fails():
    c = counter(0, opened=True)
    assert c.forced() == ord("<")
    c.advance(ord("<"))
    with pytest.raises(ValueError, match="the thinking budget forces"):
        c.advance(ord("x"))
    with pytest.raises(ValueError, match=">= 0"):
        counter(-1, opened=True)


def test_a_token_that_finishes_a_character_may_come_before_the_marker():
    c = counter(1, opened=True)
    c.advance("é".encode()[0])  # the budget's last token begins a two-byte character
    assert c.forced() == ord("<")
    c.advance("é".encode()[1])  # the grammar allowed only its second byte (rule 3)
    assert take_forced(c) == MARK
