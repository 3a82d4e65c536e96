"""An exclusive, crash-safe file lock: one holder of a path at a time.

`FileLock` takes `fcntl.flock` on a file, which the kernel releases when its holder dies, so a
crashed holder never blocks the next one. The file names the holder (pid, host, since when) for
the refusal message and is removed on release. A forked child (a worker process) closes its
inherited descriptors, so that it never keeps its parent's lock alive. staging.DestinationLock
(one conversion per DST) and the cache's entry locks (engine/cache.py) are FileLocks.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import weakref
from pathlib import Path
from typing import Any, Callable

from ..errors import BadInputError

Notify = Callable[[str], None]


_HELD: "weakref.WeakSet[FileLock]" = weakref.WeakSet()


def _drop_inherited_locks() -> None:
    """In a forked child (a worker process, procs.py): close the descriptors of the locks the
    parent holds. A flock belongs to the open file, which the child shares: a worker outliving a
    killed converter would otherwise keep DST locked against the resume. Only the descriptor
    is closed (the parent still holds the lock), and the child's copy then releases nothing."""
    for lock in list(_HELD):
        if lock._fd is not None:
            try:
                os.close(lock._fd)
            except OSError:
                pass
            lock._fd = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited_locks)


class FileLock:
    """An exclusive `flock` on `path`, which the kernel releases when its holder dies (so a crashed
    holder never blocks the next one). The file names the holder (pid, host, since when) for the
    messages, and is removed on release.

    wait: False refuses at once when another process holds it (`busy(who)` is the message), True
    waits as long as it takes, a number waits that many seconds and then refuses. Waits poll
    rather than block in flock, so that Ctrl-C works whichever thread receives it.
    """

    def __init__(self, path: Path, *, wait: bool | float = False, notify: Notify = print,
                 busy: Callable[[str], str] | None = None, waiting: Callable[[str], str] | None = None):
        self.path = path
        self.wait = wait
        self.notify = notify
        self._busy = busy or (lambda who: f"{path} is locked by another process ({who})")
        self._waiting = waiting
        self._fd: int | None = None

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except (ValueError, OSError):
            return "holder unknown"
        if not isinstance(info, dict) or "pid" not in info:
            return "holder unknown"
        return (f"pid {info['pid']}" + (f" on {info['host']}" if "host" in info else "")
                + (f", since {info['since']}" if "since" in info else ""))

    def _take(self, fd: int) -> None:
        """flock `fd`, waiting as `wait` says; raises BadInputError when refused."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        who = self._holder(fd)
        if self.wait is False:
            raise BadInputError(self._busy(who))
        if self._waiting is not None:
            self.notify(self._waiting(who))
        deadline = None if self.wait is True else time.monotonic() + float(self.wait)
        while True:
            time.sleep(0.2)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise BadInputError(self._busy(self._holder(fd)) + f" (waited {float(self.wait):g} s)") from None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                self._take(fd)
                # The previous holder removes the file on release: a lock on that unlinked file
                # protects nothing, so start again on the current file.
                try:
                    same = os.path.samestat(os.fstat(fd), os.stat(self.path))
                except FileNotFoundError:
                    same = False
                if not same:
                    os.close(fd)
                    continue
                info = {"pid": os.getpid(), "host": socket.gethostname(),
                        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(info).encode(), 0)
                self._fd = fd
                _HELD.add(self)
                return
            except BaseException:
                os.close(fd)
                raise

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # while still holding it: see acquire()
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)  # releases the flock
            self._fd = None

    def __enter__(self) -> "FileLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
