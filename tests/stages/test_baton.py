"""stages/baton.py: who holds a stage's sockets, and which steps the compute thread keeps them through."""
from __future__ import annotations

import threading

from stages.baton import RECENT, Baton


def test_the_io_thread_holds_it_first_and_only_a_change_of_hands_counts():
    baton = Baton(0.15)
    assert not baton.compute_holds and baton.passes == 0
    baton.give(to_compute=False)  # already the I/O thread's
    assert baton.passes == 0
    baton.give(to_compute=True)
    baton.give(to_compute=True)
    assert baton.compute_holds and baton.passes == 1
    baton.give(to_compute=False)
    assert not baton.compute_holds and baton.passes == 2


def test_wait_returns_once_the_baton_comes_and_times_out_otherwise():
    baton = Baton(0.15)
    assert not baton.wait(for_compute=True, timeout=0.05)
    assert baton.wait(for_compute=False, timeout=0.0)
    got = []
    waiter = threading.Thread(target=lambda: got.append(baton.wait(for_compute=True, timeout=10)))
    waiter.start()
    baton.give(to_compute=True)
    waiter.join(10)
    assert got == [True]


def test_the_first_step_is_never_kept():
    assert not Baton(100.0).keeps(1)


def test_a_step_is_kept_when_its_rows_at_the_slowest_recent_rate_end_within_hold_s():
    baton = Baton(0.15)
    baton.ran(1, 0.010)   # 10 ms per row
    baton.ran(64, 0.064)  # 1 ms per row: a prefill is cheaper per row, the slowest rate counts
    assert baton.keeps(15)  # 150 ms
    assert not baton.keeps(16)  # 160 ms
    baton.ran(0, 0.02)  # a step of no rows counts as one row
    assert baton.keeps(7) and not baton.keeps(8)


def test_only_the_last_recent_steps_predict():
    baton = Baton(0.15)
    baton.ran(1, 0.1)  # one slow step: 100 ms per row
    assert not baton.keeps(2)
    for _ in range(RECENT - 1):
        baton.ran(1, 0.001)
    assert not baton.keeps(2)  # still among the last RECENT
    baton.ran(1, 0.001)
    assert baton.keeps(2) and baton.keeps(150) and not baton.keeps(151)
