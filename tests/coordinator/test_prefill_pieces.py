"""coordinator/prefill_pieces.py: the length of every piece of a prompt, rule by rule."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from coordinator.prefill_pieces import RIDGE, piece_tokens


@pytest.mark.parametrize("total, chunk, stages, q", [
    (0, 512, 2, 0),
    (1, 512, 1, 1),
    (512, 512, 1, 512),
    (513, 512, 1, 257),      # rule 2: 257 + 256, not 512 + 1
    (1100, 512, 1, 367),     # 367 + 367 + 366
    (4000, 512, 1, 500),
    (512, 512, 2, 128),      # rule 1: sqrt(512 / 32) = 4 pieces
    (1024, 512, 2, 171),     # round(5.66) = 6 pieces
    (300, 512, 2, 100),      # round(3.06) = 3 pieces
    (300, 512, 4, 60),       # round(sqrt(3 * 300 / 32)) = 5 pieces
    (100, 32, 2, 25),        # prefill_chunk asks for more: four pieces of 25, not 32 + 32 + 32 + 4
    (16384, 512, 2, 512),    # 23 pieces would be longer than prefill_chunk
    (2 * RIDGE, 512, 2, 2 * RIDGE),  # round(1.41) = 1: two pieces would be read no sooner
    (4 * RIDGE, 512, 2, 2 * RIDGE),
    (2 * RIDGE - 1, 512, 8, 2 * RIDGE - 1),  # two pieces would be shorter than RIDGE
    (3 * RIDGE, 512, 8, RIDGE),  # sqrt(7 * 3) ~ 5 pieces, but only 3 of RIDGE
])
def test_piece_tokens(total, chunk, stages, q):
    assert piece_tokens(total, chunk, stages) == q


@given(total=st.integers(1, 20000), chunk=st.integers(1, 4096), stages=st.integers(1, 8))
def test_pieces_cover_the_prompt_evenly(total, chunk, stages):
    """No piece past prefill_chunk; pieces differ by less than their count; one stage splits only as
    prefill_chunk asks; several stages get several pieces of a prompt of three RIDGEs or more, none shorter than
    RIDGE unless prefill_chunk asks for it."""
    q = piece_tokens(total, chunk, stages)
    pieces = [min(q, total - at) for at in range(0, total, q)]
    assert sum(pieces) == total and max(pieces) <= chunk
    assert pieces[0] - pieces[-1] < len(pieces)
    if stages == 1:
        assert len(pieces) == -(-total // chunk)
    elif chunk >= RIDGE:
        assert len(pieces) == 1 or q >= RIDGE or len(pieces) == -(-total // chunk)
        if total >= 3 * RIDGE:
            assert len(pieces) >= 2
