"""coordinator/linear_state.py: state entries follow tables through the conversation cache (rule 1), on the
real chunk map; every entry is always in exactly one place."""
from __future__ import annotations

from coordinator.cache import ConversationCache
from coordinator.conversations import Conversation, Match
from coordinator.linear_state import StateEntries, reusable, state_entries
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


def test_only_a_whole_continuation_is_reusable_and_hellos_give_the_count():
    conv = Conversation(0, list(range(10)))
    assert reusable(Match(conv, 10)) is not None and reusable(Match(conv, 9)) is None and reusable(None) is None
    hellos = {0: {"state_entries": 0}, 1: {"state_entries": 8}}
    assert state_entries(hellos.get, 2) == 8 and state_entries({0: {}, 1: None}.get, 2) == 0
