"""A hybrid linear-attention model (tiny Qwen3-Next: layers 0-2 Gated DeltaNet, layer 3 full attention) served by
`strata up` on two CPU stages (stage 0 holds no full-attention layer, so no pool cells) behind the official
client, against transformers' greedy tokens on the same checkpoint. The conversation rules of
coordinator/linear_state.py: a held conversation continued whole reuses its cells and its state, in its slot or
parked and brought back (the state entry follows the table); a prompt that branches inside it reuses the
longest checkpoint of its state at a chunk boundary below the branch (coordinator/state_checkpoints.py; a
state cannot be rewound); concurrent requests give their solo tokens; a session file keeps the state with the
cells; a restarted stage keeps the held conversations its state file holds. Two slots, three state entries, four checkpoints (the default 2 x parallel)."""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import pytest

from tests.integration.conftest import Server, oracle_decode, oracle_greedy

MAX = 10


@pytest.fixture(scope="module")
def hybrid(strata_up):
    return strata_up(model={"arch": "qwen3_next", "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "seed": 5},
                     saves=True, max_context=256, kv_pool_tokens=1024, parallel=2, state_entries=3)


@pytest.fixture(autouse=True)
def clean(hybrid):
    yield
    hybrid.check_clean()


def complete(server: Server, prompt: list[int]) -> tuple[str, int, str]:
    """(greedy text, cached prompt tokens, finish reason) of /v1/completions on token ids."""
    r = server.openai().completions.create(model=server.model, prompt=prompt, max_tokens=MAX, temperature=0)
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens, r.choices[0].finish_reason


def want(server: Server, prompt: list[int]) -> tuple[list[int], str]:
    """transformers' greedy (ids, text) for `prompt`, MAX tokens of it (the random model never ends sooner)."""
    ids, ended = oracle_greedy(server.data["model"], prompt, MAX)
    assert not ended and len(ids) == MAX
    return ids, oracle_decode(server.data["model"], ids)


PROMPT = [40 + 3 * k for k in range(37)]


def test_a_whole_continuation_reuses_the_slot_and_a_branch_its_longest_checkpoint(hybrid):
    ids, text = want(hybrid, PROMPT)
    assert complete(hybrid, PROMPT) == (text, 0, "length")
    turn = PROMPT + ids + [7, 8, 9]  # the held conversation is PROMPT + ids[:-1]: the turn continues it whole
    assert complete(hybrid, turn) == (want(hybrid, turn)[1], len(PROMPT) + MAX - 1, "length")
    branch = PROMPT[:30] + [11, 12]  # shares 30 tokens: a state cannot be rewound, but it was kept at 16
    assert complete(hybrid, branch) == (want(hybrid, branch)[1], 16, "length")


def test_an_answer_asked_again_and_a_branch_inside_the_answer_reuse_checkpoints(hybrid):
    """coordinator/state_checkpoints.py: prefill pieces end at every chunk boundary (16 cells) and decode keeps
    the boundary it reaches, so asking again reuses 32 of 37 prompt tokens, and a prompt that branches after
    8 answer tokens (48 tokens in) reuses the checkpoint decode kept at 48; and none is read wrong: each answer
    is transformers' on its whole prompt."""
    slot_action(hybrid, "erase")
    a = [90 + k for k in range(40)]
    ids, text = want(hybrid, a)
    assert complete(hybrid, a) == (text, 0, "length")
    assert complete(hybrid, a) == (text, 32, "length")  # held a + ids[:-1]; the match stops inside the prompt
    branch = a + ids[:8] + [99, 98]
    assert complete(hybrid, branch) == (want(hybrid, branch)[1], 48, "length")


def test_a_parked_conversation_keeps_its_state_and_continues_exactly(hybrid):
    a = [30 + k for k in range(25)]
    ids_a, text_a = want(hybrid, a)
    assert complete(hybrid, a)[0] == text_a  # slot 0, entry 0
    for i in range(2):  # two more conversations take both slots: a is parked with its entry
        other = [120 + 9 * i + k for k in range(20)]
        assert complete(hybrid, other)[:2] == (want(hybrid, other)[1], 0)
    assert len(hybrid.live()["kv_pool"]["parked"]) == 1
    turn = a + ids_a + [5, 6]
    assert complete(hybrid, turn) == (want(hybrid, turn)[1], len(a) + MAX - 1, "length")


def test_concurrent_requests_give_their_solo_tokens(hybrid):
    prompts = [[60 + 5 * i + k for k in range(20 + 7 * i)] for i in range(4)]
    solo = [want(hybrid, p)[1] for p in prompts]
    with cf.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: complete(hybrid, p)[0], prompts))
    assert together == solo


def slot_action(server: Server, action: str, slot: int | None = None, filename: str | None = None):
    path = "/slots" if slot is None else f"/slots/{slot}"
    r = server.http.post(path, params={"action": action}, json=None if filename is None else {"filename": filename})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_saved_conversation_restores_with_its_state_and_continues_exactly(hybrid):
    """Stage 0 (linear layers only) saves just the state entry, stage 1 its cells and its entry; a restore into
    the other slot after both slots computed other prompts continues as transformers does, reusing the whole
    conversation (a stage refuses to continue an entry that does not hold exactly its tokens)."""
    a = [50 + 2 * k for k in range(33)]
    ids, _ = want(hybrid, a)
    slot_action(hybrid, "erase")
    complete(hybrid, a)
    held = [s for s in hybrid.live()["kv_pool"]["slots"] if s["tokens"] == len(a) + MAX - 1]
    assert len(held) == 1, hybrid.live()["kv_pool"]["slots"]
    slot = held[0]["slot"]
    saved = slot_action(hybrid, "save", slot, "hybrid")
    assert saved["n_saved"] == len(a) + MAX - 1
    slot_action(hybrid, "erase")
    for i in range(2):  # both slots' entries and cells now hold other conversations
        other = [200 + 5 * i + k for k in range(30)]
        assert complete(hybrid, other)[:2] == (want(hybrid, other)[1], 0)
    restored = slot_action(hybrid, "restore", 1 - slot, "hybrid")
    assert (restored["n_restored"], restored["n_read"]) == (saved["n_saved"], saved["n_written"]), restored
    turn = a + ids + [5, 6]
    assert complete(hybrid, turn) == (want(hybrid, turn)[1], len(a) + MAX - 1, "length")


def test_a_restarted_stage_keeps_the_held_conversations_its_state_file_holds(hybrid):
    """stages/state_pool.py rule 5: stage 0 (linear layers only) is SIGKILLed while idle; restarted, it re-attaches
    its state file, so the held conversation is not lost and its next turn reuses it whole, as transformers
    continues it; the checkpoints come back with it (a branch reuses the one at 32)."""
    slot_action(hybrid, "erase")
    ids, text = want(hybrid, PROMPT)
    assert complete(hybrid, PROMPT)[0] == text
    lost, pid = hybrid.live()["counters"]["lost"], hybrid.stage_pid(0)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 90
    while hybrid.stage_pid(0) == pid or hybrid.http.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the restarted stage was not taken back"
        time.sleep(0.1)
    assert hybrid.live()["counters"]["lost"] == lost
    branch = PROMPT[:35] + [4]
    assert complete(hybrid, branch) == (want(hybrid, branch)[1], 32, "length")
    ids, _ = want(hybrid, branch)
    turn = branch + ids + [7]
    assert complete(hybrid, turn) == (want(hybrid, turn)[1], len(branch) + MAX - 1, "length")
