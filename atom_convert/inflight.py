"""Which of a pool's threads are still at work, known without Thread.join or Thread.is_alive.

Why: Ctrl-C must stop a pool of threads and then wait (bounded) until none of them reads or
writes any more, before files are closed or removed under them. Thread.join cannot tell that
after an interrupt: on CPython 3.11, a KeyboardInterrupt raised inside join() while the thread
still runs marks that thread as stopped (the bpo-45274 handler in `_wait_for_tstate_lock`
releases the running thread's lock), so is_alive() turns False and a later join returns at once.
Each thread registers itself here instead: `enter()` as it begins (refused once stopped, so a
thread started after the stop never begins its work) and `leave()` as it ends.

Until the interrupt, the waiting thread joins the pool in steps (`join_in_steps`): the kernel may
hand a Ctrl-C to any thread, and then it only flags the main thread, whose handler (the
KeyboardInterrupt) runs once it wakes; an untimed join would never wake.
"""

from __future__ import annotations

import threading
import time
from typing import Iterable

STEP_S = 0.2  # how often a waiting thread wakes to notice a Ctrl-C


def join_in_steps(threads: Iterable[threading.Thread]) -> None:
    """Join every thread, waking every STEP_S so that a pending Ctrl-C is raised here."""
    for t in threads:
        while t.is_alive():
            t.join(STEP_S)


class InFlight:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0
        self.stopped = False  # read by the threads between their steps

    def enter(self) -> bool:
        """A thread begins its work: False (do nothing) once the pool is stopped."""
        with self._cond:
            if self.stopped:
                return False
            self._inside += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._inside -= 1
            self._cond.notify_all()

    def stop_and_wait(self, timeout: float) -> int:
        """Stop the pool and wait up to `timeout` seconds for the threads inside to leave (in
        steps, so that a second Ctrl-C is noticed); returns how many are still inside."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self.stopped = True
            while self._inside and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(min(left, STEP_S))
            return self._inside
