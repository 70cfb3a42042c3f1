"""coordinator/linear_state.py: state entries follow tables through the conversation cache (rule 1), on the
real chunk map; every entry is always in exactly one place."""
from __future__ import annotations

from coordinator.cache import ConversationCache
from coordinator.conversations import Conversation, Match
from coordinator import linear_state
from coordinator.linear_state import StateEntries, reusable, state_checkpoints, state_entries
from coordinator.state_checkpoints import StateCheckpoints
from pool.chunk_map import ChunkMap


def cache(n_entries: int, n_slots: int = 2) -> ConversationCache:
    c = ConversationCache(ChunkMap(64, 4, 8, n_slots), n_slots)
    c.entries = StateEntries(n_entries, n_slots)
    return c


def hold(c: ConversationCache, slot: int, n: int) -> None:
    assert c.reserve(slot, n)
    c.hold(slot, list(range(n)))


def test_a_parked_conversation_takes_its_entry_and_comes_back_with_it():
    c = cache(3)
    hold(c, 0, 10)
    c.park(0)  # table 2 now holds slot 0's conversation and entry 0; slot 0 takes the free entry 2
    (parked,) = c.parked()
    assert c.entries.of == {parked: 0, 0: 2, 1: 1}
    hold(c, 1, 5)
    c.bring(c.held[parked], 1)  # into slot 1: slot 1's conversation takes the parked table and entry 1
    assert c.entries.of[1] == 0 and c.entries.of[parked] == 1
    c.entries.check()
    c.flush()
    c.entries.check()
    assert c.entries.of == {0: 2, 1: 0} and c.entries.free == [1]


def test_with_no_entry_free_a_park_drops_the_oldest_parked_conversation_or_itself():
    c = cache(3)
    hold(c, 0, 10)
    c.park(0)  # uses the one free entry
    hold(c, 0, 6)
    c.park(0)  # no entry free: the older parked conversation is dropped for its entry
    assert len(c.parked()) == 1 and [len(v.tokens) for v in c.held.values()] == [6]
    assert c.counters["evictions"] == 1
    c.entries.check()
    tight = cache(2)
    hold(tight, 0, 10)
    tight.park(0)  # entries == slots: nothing can keep a state out of a slot, the parked one goes at once
    assert tight.parked() == [] and tight.held == {} and tight.entries.of == {0: 0, 1: 1}
    tight.entries.check()


def test_a_whole_continuation_or_a_checkpoint_is_reusable_and_hellos_give_the_counts():
    conv = Conversation(0, list(range(40)))
    none = StateCheckpoints(4, 0, 16)
    assert reusable(Match(conv, 40), none) is not None and reusable(None, none) is None
    assert reusable(Match(conv, 39), none) is None  # a branch with no checkpoint starts cold
    kept = StateCheckpoints(4, 2, 16)
    assert kept.keep(0, 16) == 4 and kept.keep(0, 32) == 5
    assert (reusable(Match(conv, 39), kept).reuse, reusable(Match(conv, 31), kept).reuse) == (32, 16)
    assert reusable(Match(conv, 15), kept) is None
    hellos = {0: {"state_entries": 0}, 1: {"state_entries": 8, "state_checkpoints": 3}}
    assert state_entries(hellos.get, 2) == 8 and state_entries({0: {}, 1: None}.get, 2) == 0
    assert state_checkpoints(hellos.get, 2) == 3  # only stages that keep state count
    assert state_checkpoints({0: {"state_entries": 8}, 1: None}.get, 2) == 0


def test_a_checkpoint_is_kept_once_per_boundary_and_the_least_recently_used_unpinned_one_goes():
    k = StateCheckpoints(10, 3, 16)
    assert [k.keep(0, 15), k.keep(0, 0), k.keep(0, 16), k.keep(0, 16)] == [None, None, 10, None]
    assert k.keep(1, 16) == 11 and k.keep(1, 32) == 12
    k.pin(10)  # the oldest is pinned: the next oldest (table 1 at 16) goes
    assert k.keep(2, 48) == 11 and k.best(1, 40) == (32, 12) and k.best(2, 48) == (48, 11)
    k.pin(12)
    k.pin(11)
    assert k.keep(3, 16) is None  # every entry pinned: nothing kept
    k.unpin(12)
    assert k.keep(3, 16) == 12 and k.best(1, 40) is None
    k.check()


def test_checkpoints_follow_their_table_and_go_with_it():
    c = cache(3)
    c.entries = StateEntries(3, 2, n_checkpoints=3, chunk_cells=4)
    hold(c, 0, 10)
    k = c.entries.checkpoints
    assert k.keep(0, 4) == 3 and k.keep(0, 8) == 4
    c.park(0)
    (parked,) = c.parked()
    assert k.of == {parked: {4: 3, 8: 4}}  # parked with the conversation
    hold(c, 1, 6)
    assert k.keep(1, 4) == 5
    c.bring(c.held[parked], 1)  # back into slot 1; slot 1's conversation is parked with its own
    assert k.of == {1: {4: 3, 8: 4}, parked: {4: 5}}
    k.trim(1, 7)
    assert k.of[1] == {4: 3} and k.free == [4]
    c.release(parked)
    c.release(1)
    assert k.of == {} and sorted(k.free) == [3, 4, 5]
    k.check()
    c.entries.check()


def test_a_rejoined_stage_keeps_the_conversations_and_checkpoints_its_entries_still_hold():
    """Rule 3: a held table survives when its entry holds exactly its tokens on the rejoined stage; a checkpoint
    when its entry holds its boundary; a stage that reports no held entries (CUDA) keeps none."""
    c = cache(4)
    c.entries = StateEntries(4, 2, n_checkpoints=2, chunk_cells=4)
    hold(c, 0, 10)
    hold(c, 1, 6)
    k = c.entries.checkpoints
    assert k.keep(0, 4) == 4 and k.keep(0, 8) == 5
    hello = {"state_entries": 4, "state_held": [10, 5, -1, 0, 4, 3]}  # slot 1's entry went on a step further
    assert linear_state.lost_states(c.entries, c.held, hello, []) == [1]
    assert k.of == {0: {4: 4}}
    assert linear_state.lost_states(c.entries, c.held, {"state_entries": 4, "state_held": None}, []) == [0, 1]
    assert linear_state.lost_states(c.entries, c.held, {"state_entries": 0}, []) == []  # no linear layers there
    assert linear_state.lost_states(c.entries, c.held, hello, [0]) == [1]  # already lost by its chunks
    k.check()
