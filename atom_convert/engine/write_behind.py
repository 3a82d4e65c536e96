"""The write-behind thread of a worker: its writes run in order, off its producing thread.

A worker hands each buffer to its own `_IOThread`, which runs the write (writer.py: `pwrite` at
the buffer's offset, then marks the byte range done) while the worker produces the next one.
Every wait is in short steps, so that a stop (another worker failed, Ctrl-C, SIGTERM) is noticed
even when a write is stuck; `Cancelled` is what a worker raises then.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable


class Cancelled(Exception):
    """Raised in a worker when another worker failed or the run was interrupted: stop at the next buffer."""


class _IOThread:
    """Runs a worker's writes in order, off its producing thread (write-behind: the producer
    prepares the next expert while the previous one is copied into the page cache)."""

    # Waits here are in short steps: a process-directed signal (Ctrl-C, SIGTERM) is handled on
    # the main thread, and only waits that return now and then let everything notice a stop
    # when a write is stuck (a dead network filesystem).
    _POLL_S = 0.2

    def __init__(self, depth: int = 4, stop: threading.Event | None = None):
        self._q: queue.Queue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._aborted = threading.Event()
        self._stop = stop or threading.Event()
        self._t = threading.Thread(target=self._run, name="atom-convert-writer", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                if self._error is None and not self._aborted.is_set():
                    fn, args = item
                    try:
                        fn(*args)
                    except BaseException as e:  # noqa: BLE001  re-raised on the submitting thread
                        self._error = e
                    del fn, args
                del item  # do not keep the last buffer (and the file pages it views) alive
            finally:
                self._q.task_done()

    def _check(self) -> None:
        if self._error is not None:
            raise self._error
        if self._stop.is_set() or self._aborted.is_set():
            raise Cancelled()

    def drain(self) -> None:
        """Block until every submitted write is done."""
        with self._q.all_tasks_done:
            while self._q.unfinished_tasks:
                if self._stop.is_set() or self._aborted.is_set():
                    raise Cancelled()
                self._q.all_tasks_done.wait(self._POLL_S)
        self._check()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        while True:
            self._check()
            try:
                self._q.put((fn, args), timeout=self._POLL_S)
                return
            except queue.Full:
                continue

    def close(self) -> None:
        while True:
            self._check()
            try:
                self._q.put(None, timeout=self._POLL_S)
                break
            except queue.Full:
                continue
        while self._t.is_alive():  # join in steps: a stop is still noticed
            self._t.join(self._POLL_S)
            if self._stop.is_set():
                raise Cancelled()
        if self._error is not None:
            raise self._error

    def abort(self, timeout: float = 10.0) -> None:
        """Stop soon: queued writes are dropped; the running one (a single write) may finish.
        Waits at most `timeout` s; the thread is a daemon, so a write stuck for ever cannot keep
        the process alive either."""
        self._aborted.set()
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
            self._q.task_done()
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass
        self._t.join(timeout)
