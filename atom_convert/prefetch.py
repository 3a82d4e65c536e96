"""Read the source ahead of the workers, in file order, so that the disk streams.

Why: the workers read the source through memory mappings, a slice of an expert at
a time, from several threads at once. On a cold page cache each first touch is a
page fault that waits for the disk, and many threads faulting in different places
turn one sequential read into scattered small ones: on the device machine a cold
conversion took 24.5 s where the same conversion from the page cache took 13.8 s
and a plain copy 18.8 s (BENCHMARKS.md, issue 9).

How it works: one thread walks the source byte ranges of each group (a decoder
layer: every rank's sources), merged and sorted by file and offset, and asks the
kernel to read them (`posix_fadvise(WILLNEED)`, in steps of `STEP` bytes). After
issuing a step it reads one byte at the end of the step before, which waits for
that step's pages: at most two steps are in flight, the walk goes at the disk's
pace, and nothing is copied into this process. It stays at most one group ahead
of the newest group a worker has started (`reached`), so the page cache holds the
current and the next layer, not the model. Correctness never depends on it: a page
not yet read is faulted in by the worker as before.

Items wait for it (`wait_read`): an item that needs the first fraction f of its group's
bytes (a range of experts: the experts are stored in order) starts once that much has
been read ahead. Why: sixteen workers faulting in pages of a cold file ahead of the
readahead turn its sequential read into scattered ones; on the device machine the
faster gfx950 conversion was the slower one from a cold cache (BENCHMARKS.md, issue 9,
fifth round). The wait is bounded (GATE_TIMEOUT_S) and ends when the thread stops, so a
slow or failed readahead costs time, never correctness.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from .plan import Group

if TYPE_CHECKING:
    from .source import SourceCheckpoint

log = logging.getLogger(__name__)

STEP = 32 << 20  # bytes per readahead request
_MERGE_GAP = 1 << 20  # ranges closer than this are read as one (the gap is read too)
GATE = True  # items wait for their share of the readahead (wait_read); False: they do not (benches)
GATE_TIMEOUT_S = 60.0


def group_ranges(source: "SourceCheckpoint", group: Group, tp: int) -> list[tuple[str, int, int]]:
    """The data byte ranges (file, begin, end; relative to the file's data section) the group's
    outputs read for every rank, merged, in file order."""
    names: dict[str, None] = {}
    for out in group.outputs:
        for r in range(tp):
            for n in out.sources_of(r):
                if n in source:
                    names.setdefault(n, None)
    spans = sorted((source.info(n).file, source.info(n).begin, source.info(n).begin + source.info(n).nbytes)
                   for n in names)
    merged: list[tuple[str, int, int]] = []
    for f, a, b in spans:
        if merged and merged[-1][0] == f and a <= merged[-1][2] + _MERGE_GAP:
            merged[-1] = (f, merged[-1][1], max(b, merged[-1][2]))
        else:
            merged.append((f, a, b))
    return merged


class Prefetcher:
    """The readahead thread of one converted set. `reached(i)`: a worker started an item of group
    `i` (groups in the order the workers take them); `close()` stops it (bounded wait)."""

    def __init__(self, source: "SourceCheckpoint", groups: list[Group], tp: int):
        self._source = source
        self._groups = groups
        self._tp = tp
        self._newest = -1
        self._cond = threading.Condition()
        self._stop = False
        self._ended = False  # the thread has returned (done, stopped, or an error)
        self._total: dict[int, int] = {}  # group -> bytes it reads ahead
        self._read: dict[int, int] = {}  # group -> bytes read so far
        self._fds: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name="atom-convert-prefetch", daemon=True)
        self._thread.start()

    def reached(self, index: int) -> None:
        with self._cond:
            if index > self._newest:
                self._newest = index
                self._cond.notify_all()

    def wait_read(self, index: int, fraction: float) -> None:
        """Block until `fraction` of group `index`'s bytes have been read ahead (module docstring);
        at most GATE_TIMEOUT_S, and not at all once the thread has ended."""
        if not GATE:
            return
        deadline = time.monotonic() + GATE_TIMEOUT_S
        with self._cond:
            while not (self._stop or self._ended):
                total = self._total.get(index)
                if total is not None and self._read.get(index, 0) >= fraction * total:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(min(left, 0.5))

    def _confirm(self, index: int, n: int) -> None:
        with self._cond:
            self._read[index] = self._read.get(index, 0) + n
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(5.0)
        if not self._thread.is_alive():
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def _wait_for(self, index: int) -> bool:
        """Block until group `index` may be read ahead (the newest started group is at most one
        before it); False when stopped."""
        with self._cond:
            while not self._stop and self._newest < index - 1:
                self._cond.wait(0.5)
            return not self._stop

    def _fd(self, file: str) -> tuple[int, int]:
        m = self._source._mapping(file)  # a Hub source waits for the download here
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(self._source.path / file, os.O_RDONLY)
        return fd, m.data_start

    def _run(self) -> None:
        try:
            for i, g in enumerate(self._groups):
                if not self._wait_for(i):
                    return
                ranges = group_ranges(self._source, g, self._tp)
                with self._cond:
                    self._total[i] = sum(b - a for _, a, b in ranges)
                    self._cond.notify_all()
                pending: tuple[int, int, int] | None = None  # (fd, last byte, bytes) of the step in flight
                for file, a, b in ranges:
                    fd, start = self._fd(file)
                    for off in range(start + a, start + b, STEP):
                        if self._stop:
                            return
                        n = min(STEP, start + b - off)
                        os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
                        if pending is not None:
                            os.pread(pending[0], 1, pending[1])  # wait for the step before
                            self._confirm(i, pending[2])
                        pending = (fd, off + n - 1, n)
                if pending is not None:  # the group's last step, for the items waiting on it
                    os.pread(pending[0], 1, pending[1])
                    self._confirm(i, pending[2])
        except Exception as e:  # noqa: BLE001  an optimisation only: the workers read what is missing
            log.debug("prefetch stopped: %s", e)
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()
