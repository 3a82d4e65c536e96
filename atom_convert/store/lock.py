"""An exclusive, crash-safe file lock: one holder of a path at a time.

`FileLock` takes `fcntl.flock` on a file, which the kernel releases when its holder dies, so a
crashed holder never blocks the next one. The file names the holder (pid, host, since when) for
the refusal message and is removed on release. The lock file is opened without following a
symlink and written only once it is known to be a lock file (empty, or a holder record): a
symlink, a hard link, a non-regular file or a regular file of other content there is refused,
never written through, truncated or removed (`ForeignPathError`). A forked child (a worker process) closes its
inherited descriptors, so that it never keeps its parent's lock alive. staging.DestinationLock
(one conversion per DST) and the cache's entry locks (engine/cache.py) are FileLocks.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
import weakref
from pathlib import Path
from typing import Any, Callable

from ..errors import BadInputError
from ..files.reading import loads

Notify = Callable[[str], None]


_HELD: "weakref.WeakSet[FileLock]" = weakref.WeakSet()

_RECORD_KEYS = {"pid", "host", "since"}


class ForeignPathError(BadInputError):
    """A path the tool writes (a lock file, a journal, a record, a name beside DST) holds something the
    tool did not write: refused, never written through, truncated or removed."""


def _is_lock_record(data: bytes) -> bool:
    """Whether `data` is what `FileLock` writes (or nothing: a lock file just created)."""
    if not data:
        return True
    try:
        info = loads(data)
    except ValueError:  # UnicodeDecodeError is one
        return False
    return (isinstance(info, dict) and set(info) <= _RECORD_KEYS and isinstance(info.get("pid"), int)
            and all(isinstance(info.get(k, ""), str) for k in ("host", "since")))


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words (for the refusals)."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "no regular file"


LOCK_EXPECTED = "atom-convert's lock file (a regular file naming its holder's pid, host and start time, or empty)"


def refuse_foreign(path: Path | str, found: str, expected: str = LOCK_EXPECTED) -> ForeignPathError:
    """The refusal of a path beside DST or in a cache directory that holds what the tool did not write."""
    return ForeignPathError(
        f"{path}: expected {expected}, found {found}; atom-convert never writes through a symbolic link nor "
        "over, or removes, what it did not write. Move it elsewhere (or remove it yourself if it is expendable) "
        "and run again")


def open_nofollow(path: Path, flags: int, mode: int = 0o644, expected: str = LOCK_EXPECTED) -> int:
    """os.open(path, flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC): a symlink, a directory or another
    non-regular file at `path`, or a regular one with more than one hard link, is refused
    (`refuse_foreign`), never opened for writing through."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):
            raise refuse_foreign(path, f"a symbolic link (to {os.readlink(path)})", expected) from None
        if e.errno == errno.EISDIR:
            raise refuse_foreign(path, "a directory", expected) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise refuse_foreign(path, kind_of(st.st_mode), expected)
        if st.st_nlink > 1:
            raise refuse_foreign(path, f"a regular file with {st.st_nlink} hard links", expected)
    except BaseException:
        os.close(fd)
        raise
    return fd


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
            info = loads(os.pread(fd, 4096, 0) or b"{}")
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
            # Never through a symlink, and not truncated: what is there is checked first (below).
            fd = open_nofollow(self.path, os.O_RDWR | os.O_CREAT)
            try:
                self._take(fd)
                # The previous holder removes the file on release: a lock on that unlinked file
                # protects nothing, so start again on the current file.
                try:
                    same = os.path.samestat(os.fstat(fd), os.lstat(self.path))
                except FileNotFoundError:
                    same = False
                if not same:
                    os.close(fd)
                    continue
                # Under the flock, so stable: a holder writes its record only while it holds it.
                # Empty (just created), or a record of a holder that died: ours to take.
                data = os.pread(fd, 65536, 0)
                if not _is_lock_record(data):
                    shown = data[:40].decode("utf-8", "replace")
                    raise refuse_foreign(self.path, f"a regular file of {os.fstat(fd).st_size} bytes that is not "
                                                    f"an atom-convert lock (it starts {shown!r})")
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
            # While still holding it (see acquire()); only the file locked, never what replaced it.
            if os.path.samestat(os.fstat(self._fd), os.lstat(self.path)):
                os.unlink(self.path)
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
