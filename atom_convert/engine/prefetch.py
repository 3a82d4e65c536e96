"""Read the source ahead of the workers, in the order the workers need it, so that the disk streams.

Why: the workers read the source through memory mappings, a slice of an expert at
a time, from several threads at once. On a cold page cache each first touch is a
page fault that waits for the disk, and many threads faulting in different places
turn one sequential read into scattered small ones: on the device machine a cold
conversion took 24.5 s where the same conversion from the page cache took 13.8 s
and a plain copy 18.8 s (BENCHMARKS.md, issue 9).

How it works: one thread walks the items in the order they are handed out (workers.py)
and reads each item's source tensors that no earlier item read (`needs(i)`), merged into
byte ranges in file order, `step` bytes at a time. Item order, not file order: the
safetensors library stores tensors by dtype, then by name, so expert 100 comes before
expert 2 in a file, and an item of the first experts would otherwise wait for most of the
layer. Under MoE tensor parallel, the items of one range of experts for every rank read the
same tensors: the first reads them, the others find nothing left to read.

A step is read by populating a mapping of it (`populate`): the thread waits while the
kernel's fault readahead streams the step in, and nothing is copied into this process.
Where the kernel lacks MADV_POPULATE_READ (before Linux 5.14) it asks for the step with
posix_fadvise(WILLNEED) and waits on one byte of the step before.

Items wait for it (`wait_read(i)`): item i starts once its bytes are read, so that sixteen
workers do not fault in pages of a cold file ahead of the readahead (on the device machine
the faster gfx950 conversion was then the slower one from a cold cache, BENCHMARKS.md,
issue 9, fifth round). The wait is bounded (`gate_timeout_s`) and ends when the thread stops,
so a slow or failed readahead costs time, never correctness: a page not yet read is faulted
in by the worker.

How far ahead: at most `ahead` bytes beyond the newest item a worker has started
(`reached`), so that the page cache holds the items in progress and the next ones, not the
model, and read-ahead pages are not evicted before their item uses them.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
import time
import types
from typing import TYPE_CHECKING, Any, Callable, Iterable

from ..files import libc
from .workers import available_memory

if TYPE_CHECKING:
    from ..files.source import SourceCheckpoint

log = logging.getLogger(__name__)

STEP_BYTES = 32 << 20  # default bytes per read request (Prefetcher's step)
_MERGE_GAP = 1 << 20  # ranges closer than this are read as one (the gap is read too)
GATE_TIMEOUT_S = 60.0  # default longest wait of an item for its bytes (Prefetcher's gate_timeout_s)
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22) if sys.platform.startswith("linux") else None
AHEAD_MIN, AHEAD_MAX = 2 << 30, 16 << 30


def default_ahead() -> int:
    """Bytes read beyond the newest started item: an eighth of the memory available now, within
    [AHEAD_MIN, AHEAD_MAX] (the page cache also holds the output until it is hashed)."""
    return min(AHEAD_MAX, max(AHEAD_MIN, available_memory() // 8))


def _libc_calls() -> Any:
    """libc's mmap, madvise and munmap (files/libc.py): through ctypes, which releases the GIL around
    each call. A populate waits for the disk, and Python's own mmap.madvise holds the GIL meanwhile,
    which would stall the hashing threads and the dispatch of this process. None where unavailable."""
    calls = {name: libc.function(name) for name in ("mmap", "madvise", "munmap")}
    return types.SimpleNamespace(**calls) if all(calls.values()) else None


_LIBC = _libc_calls() if _MADV_POPULATE_READ is not None else None
_MAP_FAILED = ctypes.c_void_p(-1).value


def populate(fd: int, off: int, n: int) -> None:
    """Bring bytes [off, off + n) of the file into the page cache; returns when they are there.
    A page beyond the end of the file fails with EFAULT (the kernel refuses to populate it
    rather than raise SIGBUS); OSError(ENOSYS) where libc cannot be called."""
    if _LIBC is None:
        raise OSError(errno.ENOSYS, "mmap/madvise through libc are not available")
    lo = off - off % mmap.ALLOCATIONGRANULARITY
    length = off + n - lo
    addr = _LIBC.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, lo)
    if addr is None or addr == _MAP_FAILED:
        e = ctypes.get_errno()
        raise OSError(e, f"mmap: {os.strerror(e)}")
    try:
        if _LIBC.madvise(addr, length, _MADV_POPULATE_READ) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"madvise(MADV_POPULATE_READ): {os.strerror(e)}")
    finally:
        _LIBC.munmap(addr, length)


def byte_ranges(source: "SourceCheckpoint", names: Iterable[str]) -> list[tuple[str, int, int]]:
    """The data byte ranges (file, begin, end; relative to the file's data section) of these
    source tensors, merged when closer than _MERGE_GAP, in file order."""
    spans = sorted((i.file, i.begin, i.begin + i.nbytes) for i in (source.info(n) for n in names))
    merged: list[tuple[str, int, int]] = []
    for f, a, b in spans:
        if merged and merged[-1][0] == f and a <= merged[-1][2] + _MERGE_GAP:
            merged[-1] = (f, merged[-1][1], max(b, merged[-1][2]))
        else:
            merged.append((f, a, b))
    return merged


class Prefetcher:
    """The readahead thread of one converted set, over `count` items in the order they are handed
    out; `needs(i)`: the source tensor names item i reads. `reached(i)`: a worker started item i;
    `wait_read(i)`: block until its bytes are read; `close()` stops the thread (bounded wait).

    Options (the defaults are the conversion's; benches and tests change them): `ahead` (module
    docstring; default `default_ahead()`); `step`: bytes per read request; `gate`: items wait for
    their bytes in `wait_read` (False: they never wait); `gate_timeout_s`: for at most this long;
    `populate`: read by populating a mapping (False: the posix_fadvise path, as on a kernel
    without MADV_POPULATE_READ). Populate rather than posix_fadvise(WILLNEED): on the 2-core box's
    virtio disk the advice, paced by a one-byte read, read a cold 4 GB file at 0.39-0.52 GB/s,
    populating at 1.05-1.21 GB/s, dd at 0.81 (BENCHMARKS.md, issue 9, eighth round)."""

    def __init__(self, source: "SourceCheckpoint", count: int, needs: Callable[[int], Iterable[str]],
                 ahead: int | None = None, *, step: int = STEP_BYTES, gate: bool = True,
                 gate_timeout_s: float = GATE_TIMEOUT_S, populate: bool = True):
        if step <= 0:
            raise ValueError(f"prefetch step must be positive, got {step}")
        self._step = step
        self._gate = gate
        self._gate_timeout_s = gate_timeout_s
        self._source = source
        self._count = count
        self._needs = needs
        self._ahead = default_ahead() if ahead is None else ahead
        self._newest = -1
        self._cond = threading.Condition()
        self._stop = False
        self._ended = False  # the thread has returned (done, stopped, or an error)
        self._done = -1  # items [0, _done] are read
        self._bytes = 0  # bytes read so far
        self._bytes_after: dict[int, int] = {}  # item -> _bytes once it was read
        self._fds: dict[str, int] = {}
        self._populate = populate and _LIBC is not None
        self._thread = threading.Thread(target=self._run, name="atom-convert-prefetch", daemon=True)
        self._thread.start()

    def reached(self, index: int) -> None:
        with self._cond:
            if index > self._newest:
                self._newest = index
                self._cond.notify_all()

    def wait_read(self, index: int) -> None:
        """Block until item `index`'s bytes are read (module docstring); at most `gate_timeout_s`,
        and not at all once the thread has ended (or without the gate)."""
        if not self._gate:
            return
        deadline = time.monotonic() + self._gate_timeout_s
        with self._cond:
            while not (self._stop or self._ended) and self._done < index:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(min(left, 0.5))

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(5.0)
        if not self._thread.is_alive():
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def _ahead_of_newest(self) -> int:
        """Bytes read for items after the newest started one (under the lock)."""
        if self._newest >= self._done:
            return 0
        return self._bytes - self._bytes_after.get(self._newest, 0)

    def _wait_for(self, index: int) -> bool:
        """Block until item `index` may be read: the workers have reached it, or what is read
        beyond the newest started item is under `ahead`; False when stopped."""
        with self._cond:
            while not self._stop and self._newest < index and self._ahead_of_newest() >= self._ahead:
                self._cond.wait(0.5)
            return not self._stop

    def _fd(self, file: str) -> tuple[int, int]:
        m = self._source._mapping(file)  # a Hub source waits for the download here
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(self._source.path / file, os.O_RDONLY)
        return fd, m.data_start

    def _read(self, ranges: list[tuple[str, int, int]]) -> None:
        """Read these ranges into the page cache, a step at a time; returns once they are in."""
        pending: tuple[int, int] | None = None  # (fd, last byte) of the advised step in flight
        for file, a, b in ranges:
            fd, start = self._fd(file)
            for off in range(start + a, start + b, self._step):
                if self._stop:
                    return
                n = min(self._step, start + b - off)
                if self._populate:
                    try:
                        populate(fd, off, n)
                        continue
                    except OSError as e:
                        if e.errno not in (errno.EINVAL, errno.ENOSYS):
                            raise
                        self._populate = False  # a kernel before 5.14: the advice below
                os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
                if pending is not None:
                    os.pread(pending[0], 1, pending[1])  # wait for the step before
                pending = (fd, off + n - 1)
        if pending is not None:
            os.pread(pending[0], 1, pending[1])

    def _run(self) -> None:
        try:
            seen: set[str] = set()
            for i in range(self._count):
                if not self._wait_for(i):
                    return
                names = [n for n in dict.fromkeys(self._needs(i)) if n not in seen and n in self._source]
                seen.update(names)
                ranges = byte_ranges(self._source, names)
                self._read(ranges)
                if self._stop:
                    return
                with self._cond:
                    self._bytes += sum(b - a for _, a, b in ranges)
                    self._bytes_after[i] = self._bytes
                    self._done = i
                    self._cond.notify_all()
        except Exception as e:  # noqa: BLE001  an optimisation only: the workers read what is missing
            log.debug("prefetch stopped: %s", e)
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()
