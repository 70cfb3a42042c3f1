"""Which of a stage's two threads reads its sockets: the compute thread while it waits for work or runs work that
ends soon, the I/O thread while the compute thread runs anything that may not.

A stage has an I/O thread, so that a PING is answered while a long step computes, and a compute thread
(stages/server.py). If the I/O thread read every message, each step would cross the two threads three times on
its way: STEP from the ROUTER into the compute thread's queue, HIDDEN from the PULL into `Hidden`, RESULT back
over the inproc pair to the ROUTER, each crossing one more wake-up of an idle thread on the step's path (three of
the five a two-stage decode step makes besides the ZeroMQ hops; docs/BENCHMARKS.md, "Where a two-stage decode
step goes"). The baton lets the thread that runs the work read what it needs and send what it answers itself.

Rules:
1. The ROUTER (the coordinator's messages) and the PULL (the previous stage's HIDDEN, the last stage's SAMPLES)
   are used by one thread at a time, the holder of the baton. It changes hands only when its holder gives it,
   under a lock (the full memory barrier ZeroMQ asks for when a socket moves to another thread).
2. The compute thread holds it while it waits for work: an item from the coordinator, a hidden state, a chained
   step's samples. What comes wakes the thread that runs it; a PING that comes meanwhile is answered by it; and
   its answers (HELLO, RESULT, ERROR, DONE) leave on the ROUTER from the thread that made them.
3. Before work that may outlast `hold_s`, the compute thread gives the baton to the I/O thread, which answers
   PINGs and queues the rest meanwhile, as it would without a baton; the compute thread's answers then go over
   the inproc pair. Such work: SAVE and LOAD (session files, any size), and a step whose rows times the slowest
   seconds per row of the last `RECENT` steps exceeds `hold_s` (the stage's first step, with nothing to go by,
   too). `hold_s` is a tenth of `coordinator.stage_timeout_ms`, so a stage whose step runs ten times longer than
   that bound, or more, can be declared down while it computes; every step held so far took under it.
4. To take the baton back the compute thread sends `B` on the inproc pair after its answers, and waits: the I/O
   thread forwards every answer sent before it, then gives the baton. So the coordinator gets a stage's answers in
   the order they were made, whichever thread sent them.
5. The I/O thread holds the baton until the runner is built (a build can take minutes, and PINGs must be
   answered meanwhile), and again whenever the compute thread stops: shutdown, or a compute thread that failed.
"""
from __future__ import annotations

import threading
from collections import deque

RECENT = 8  # steps whose seconds per row predict the next step's


class Baton:
    """Who holds the stage's sockets (rule 1), and whether a step of so many rows is kept (rule 3)."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self._cond = threading.Condition()
        self._compute = False  # rule 5: the I/O thread holds it first
        self._row_s: deque[float] = deque(maxlen=RECENT)
        self.passes = 0  # times it changed hands (PONG's "baton_passes")

    @property
    def compute_holds(self) -> bool:
        """True while the compute thread holds it. Only the holder changes it, so the holder may read it unlocked."""
        return self._compute

    def give(self, to_compute: bool) -> None:
        """Give the baton (called by its holder only)."""
        with self._cond:
            if self._compute != to_compute:
                self._compute = to_compute
                self.passes += 1
                self._cond.notify_all()

    def wait(self, for_compute: bool, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the baton to come to the compute thread (or the I/O thread); True if
        it has. Taking the lock here is the barrier that makes the sockets safe to use after a pass."""
        with self._cond:
            return self._cond.wait_for(lambda: self._compute == for_compute, timeout)

    def keeps(self, rows: int) -> bool:
        """Whether a step of `rows` rows is expected to end within `hold_s` (rule 3)."""
        if not self._row_s:
            return False
        return rows * max(self._row_s) <= self.hold_s

    def ran(self, rows: int, seconds: float) -> None:
        """Record a step's time, for `keeps`."""
        self._row_s.append(seconds / max(rows, 1))
