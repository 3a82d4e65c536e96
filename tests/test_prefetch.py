"""The readahead thread (atom_convert/prefetch.py): the byte ranges it reads, how far ahead it
goes, and the wait that holds an item until its share of its group has been read ahead."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from atom_convert import prefetch
from atom_convert.convert import make_plan
from atom_convert.prefetch import Prefetcher, group_ranges
from atom_convert.source import SourceCheckpoint

PRESET = "tiny-deepseek-v3"
TP = 2


@pytest.fixture()
def slow_disk(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Readahead in 4 KB steps, each request 2 ms: the thread is slow enough to be caught mid-group.
    Returns the (offset, bytes) of every request, in order."""
    asked: list[tuple[int, int]] = []

    def fadvise(fd: int, off: int, n: int, advice: int) -> None:
        asked.append((off, n))
        time.sleep(0.002)
        os.posix_fadvise(fd, off, n, advice)

    monkeypatch.setattr(prefetch, "STEP", 4096)
    monkeypatch.setattr(prefetch, "os", SimpleNamespace(posix_fadvise=fadvise, pread=os.pread, open=os.open,
                                                        close=os.close, O_RDONLY=os.O_RDONLY,
                                                        POSIX_FADV_WILLNEED=os.POSIX_FADV_WILLNEED))
    return asked


@pytest.fixture()
def source(tiny_checkpoint: Callable[..., Path]) -> SourceCheckpoint:
    return SourceCheckpoint(tiny_checkpoint(PRESET, "fp8"))


def _groups(src: SourceCheckpoint) -> list[Any]:
    return make_plan(src, tp=TP).main.groups


def test_group_ranges_cover_every_source_tensor_once_in_file_order(source: SourceCheckpoint) -> None:
    for g in _groups(source):
        ranges = group_ranges(source, g, TP)
        assert ranges == sorted(ranges)
        for (f1, _, b1), (f2, a2, _) in zip(ranges, ranges[1:]):
            assert f1 != f2 or a2 > b1 + prefetch._MERGE_GAP  # merged when closer than the gap
        names = {n for o in g.outputs for r in range(TP) for n in o.sources_of(r) if n in source}
        for n in names:
            i = source.info(n)
            assert any(f == i.file and a <= i.begin and i.begin + i.nbytes <= b for f, a, b in ranges), n


def test_wait_read_returns_once_the_share_is_read(source: SourceCheckpoint, slow_disk: list[tuple[int, int]]) -> None:
    groups = _groups(source)
    k = max(range(len(groups)), key=lambda i: sum(b - a for _, a, b in group_ranges(source, groups[i], TP)))
    p = Prefetcher(source, groups, TP)
    try:
        p.reached(k)
        for f in (0.25, 0.5, 1.0):
            p.wait_read(k, f)
            with p._cond:
                total, read = p._total[k], p._read.get(k, 0)
            assert read >= f * total, (f, read, total)
            if f < 1.0:  # caught mid-group: the wait did not simply outlast the whole read
                assert read < total, "the readahead finished before the first waits; the test needs a slower disk"
        assert read == total
        # It goes one group ahead of the newest one reached, not further.
        time.sleep(0.2)
        with p._cond:
            assert not any(i > k + 1 for i in p._total), sorted(p._total)
    finally:
        p.close()


def test_wait_read_ends_on_close_on_a_failed_readahead_and_without_the_gate(source: SourceCheckpoint,
                                                                           slow_disk: list[tuple[int, int]],
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    groups = _groups(source)
    last = len(groups) - 1
    # closed while an item waits for a group the readahead may not start yet
    p = Prefetcher(source, groups, TP)
    closer = threading.Timer(0.3, p.close)
    closer.start()
    t0 = time.monotonic()
    p.wait_read(last, 1.0)
    assert 0.2 < time.monotonic() - t0 < 5
    closer.join()
    # a readahead that fails (a file that cannot be opened): the wait ends with it
    monkeypatch.setattr(Prefetcher, "_fd", lambda self, file: (_ for _ in ()).throw(OSError(5, "I/O error")))
    p = Prefetcher(source, groups, TP)
    try:
        p.reached(last)
        t0 = time.monotonic()
        p.wait_read(last, 1.0)
        assert time.monotonic() - t0 < 5
    finally:
        p.close()
    # the gate off: no wait at all, nothing read
    monkeypatch.setattr(prefetch, "GATE", False)
    p = Prefetcher(source, groups, TP)
    try:
        t0 = time.monotonic()
        p.wait_read(last, 1.0)
        assert time.monotonic() - t0 < 0.1
    finally:
        p.close()
