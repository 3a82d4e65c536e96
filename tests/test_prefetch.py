"""The readahead thread (atom_convert/engine/prefetch.py): the byte ranges it reads, in item order, how
far ahead it goes, the wait that holds an item until its bytes are read, and that an item's
`needs` name every source tensor its producers read (EP and MoE-TP, fp8, bf16 and MXFP4)."""

from __future__ import annotations

import errno
import importlib
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

import atom_convert
from atom_convert.engine import prefetch
from atom_convert.engine.prefetch import Prefetcher, byte_ranges
from atom_convert.files.source import SourceCheckpoint

convert_mod = importlib.import_module("atom_convert.engine.convert")  # the package attribute is the function

PRESET = "tiny-deepseek-v3"


@pytest.fixture()
def source(tiny_checkpoint: Callable[..., Path]) -> SourceCheckpoint:
    return SourceCheckpoint(tiny_checkpoint(PRESET, "fp8"))


def _chunks(names: list[str], k: int) -> list[list[str]]:
    """`names` cut into k items of consecutive names (a stand-in for items' needs)."""
    return [names[i * len(names) // k:(i + 1) * len(names) // k] for i in range(k)]


SLOW_STEP = 4096  # the Prefetcher's step in the tests that read through slow_disk


@pytest.fixture()
def slow_disk(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Each step (a Prefetcher made with step=SLOW_STEP reads 4 KB steps) takes 2 ms: slow enough to
    be caught mid-way. Returns the (offset, bytes) of every step, in order."""
    asked: list[tuple[int, int]] = []
    real = prefetch.populate

    def populate(fd: int, off: int, n: int) -> None:
        asked.append((off, n))
        time.sleep(0.002)
        real(fd, off, n)

    monkeypatch.setattr(prefetch, "populate", populate)
    return asked


def test_byte_ranges_cover_every_tensor_merged_in_file_order(source: SourceCheckpoint) -> None:
    names = list(source.names())
    ranges = byte_ranges(source, reversed(names))
    assert ranges == sorted(ranges)
    for (f1, _, b1), (f2, a2, _) in zip(ranges, ranges[1:]):
        assert f1 != f2 or a2 > b1 + prefetch._MERGE_GAP  # merged when closer than the gap
    for n in names:
        i = source.info(n)
        assert sum(f == i.file and a <= i.begin and i.begin + i.nbytes <= b for f, a, b in ranges) == 1, n


def test_populate_reads_mapped_bytes_and_refuses_past_the_end_without_sigbus(tmp_path: Path) -> None:
    """populate maps, populates and unmaps a range of any alignment; a range past the end of the
    file is an OSError (EFAULT), never a SIGBUS that would kill the conversion."""
    if prefetch._LIBC is None:
        pytest.skip("no MADV_POPULATE_READ through libc on this platform")
    f = tmp_path / "data"
    f.write_bytes(os.urandom(3 << 20))
    fd = os.open(f, os.O_RDONLY)
    try:
        try:
            prefetch.populate(fd, 12_345, 2 << 20)  # unaligned start and length
        except OSError as e:
            if e.errno == errno.EINVAL:
                pytest.skip("a kernel before 5.14: no MADV_POPULATE_READ")
            raise
        prefetch.populate(fd, 0, 3 << 20)  # the whole file
        with pytest.raises(OSError) as e:
            prefetch.populate(fd, (3 << 20) - 10, 8192)
        assert e.value.errno == errno.EFAULT
    finally:
        os.close(fd)


def test_items_read_in_order_each_tensor_once_and_wait_read_waits_for_its_bytes(
        source: SourceCheckpoint, slow_disk: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefetch, "_MERGE_GAP", 0)
    names = sorted(source.names(), key=lambda n: (source.info(n).file, -source.info(n).begin))  # not file order
    items = _chunks(names, 4)
    items.insert(2, items[1][:3])  # an item whose tensors an earlier item read: nothing left to read
    step_of_item: list[int] = []

    def needs(i: int) -> list[str]:
        step_of_item.append(len(slow_disk))
        return items[i]

    p = Prefetcher(source, len(items), needs, ahead=1 << 40, step=SLOW_STEP)
    try:
        p.reached(len(items) - 1)
        p.wait_read(1)
        with p._cond:
            done = p._done
        assert done >= 1
        assert done < len(items) - 1, "the readahead finished before the first wait; the test needs a slower disk"
        p.wait_read(len(items) - 1)
        with p._cond:
            assert p._done == len(items) - 1
    finally:
        p.close()
    step_of_item.append(len(slow_disk))
    per_item = [slow_disk[a:b] for a, b in zip(step_of_item, step_of_item[1:])]
    assert per_item[2] == []  # read by item 1 already
    read: list[tuple[int, int]] = []
    for i, steps in enumerate(per_item):
        # each item's steps are its tensors' bytes in file order, ascending within a file
        want = sum(source.info(n).nbytes for n in dict.fromkeys(items[i]) if n not in {m for it in items[:i] for m in it})
        assert sum(n for _, n in steps) == want, i
        read.extend(steps)
    assert sum(n for _, n in read) == sum(source.info(n).nbytes for n in names)  # every byte once


def test_reads_at_most_ahead_bytes_beyond_the_newest_started_item(source: SourceCheckpoint,
                                                                   slow_disk: list[tuple[int, int]]) -> None:
    items = _chunks(sorted(source.names()), 6)
    asked: list[int] = []

    def needs(i: int) -> list[str]:
        asked.append(i)
        return items[i]

    p = Prefetcher(source, len(items), needs, ahead=1, step=SLOW_STEP)
    try:
        time.sleep(0.5)
        assert asked == [0]  # none started: the first item only (then 1 byte or more is ahead)
        p.reached(2)
        p.wait_read(2)
        time.sleep(0.5)
        assert asked == [0, 1, 2, 3]  # up to the newest started item, and one beyond it
    finally:
        p.close()


def test_without_populate_it_advises_and_waits(source: SourceCheckpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel without MADV_POPULATE_READ (EINVAL): posix_fadvise(WILLNEED) for every byte instead."""
    advised: list[tuple[int, int]] = []
    real_fadvise = os.posix_fadvise

    def no_populate(fd: int, off: int, n: int) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    def fadvise(fd: int, off: int, n: int, advice: int) -> None:
        advised.append((off, n))
        real_fadvise(fd, off, n, advice)

    monkeypatch.setattr(prefetch, "populate", no_populate)
    monkeypatch.setattr(prefetch.os, "posix_fadvise", fadvise)
    names = sorted(source.names())
    p = Prefetcher(source, 1, lambda i: names, ahead=1 << 40, step=4096)
    try:
        p.wait_read(0)
        with p._cond:
            assert p._done == 0
    finally:
        p.close()
    want = sum(b - a for _, a, b in byte_ranges(source, names))
    assert sum(n for _, n in advised) == want
    assert max(n for _, n in advised) <= 4096  # in steps of step= bytes
    # populate=False (a bench's switch): the same advice, populate never tried
    advised.clear()
    monkeypatch.setattr(prefetch, "populate", lambda fd, off, n: pytest.fail("populate with populate=False"))
    p = Prefetcher(source, 1, lambda i: names, ahead=1 << 40, populate=False)
    try:
        p.wait_read(0)
    finally:
        p.close()
    assert sum(n for _, n in advised) == want


def test_wait_read_ends_on_close_on_a_failed_readahead_and_without_the_gate(source: SourceCheckpoint,
                                                                           slow_disk: list[tuple[int, int]],
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    items = _chunks(sorted(source.names()), 4)
    last = len(items) - 1
    # closed while an item waits for bytes the readahead may not read yet (nothing started)
    p = Prefetcher(source, len(items), items.__getitem__, ahead=1, step=SLOW_STEP)
    closer = threading.Timer(0.3, p.close)
    closer.start()
    t0 = time.monotonic()
    p.wait_read(last)
    assert 0.2 < time.monotonic() - t0 < 5
    closer.join()
    # a readahead that fails (a file that cannot be opened): the wait ends with it
    monkeypatch.setattr(Prefetcher, "_fd", lambda self, file: (_ for _ in ()).throw(OSError(5, "I/O error")))
    p = Prefetcher(source, len(items), items.__getitem__, step=SLOW_STEP)
    try:
        p.reached(last)
        t0 = time.monotonic()
        p.wait_read(last)
        assert time.monotonic() - t0 < 5
    finally:
        p.close()
    # the gate off: no wait at all
    p = Prefetcher(source, len(items), items.__getitem__, ahead=1, step=SLOW_STEP, gate=False)
    try:
        t0 = time.monotonic()
        p.wait_read(last)
        assert time.monotonic() - t0 < 0.1
    finally:
        p.close()


@pytest.mark.parametrize("case", ["fp8-tp2", "fp8-tp2-ep", "bf16-tp2", "mxfp4-tp2"])
def test_an_items_needs_name_every_source_tensor_it_reads(case: str, tiny_checkpoint: Callable[..., Path],
                                                          quark_checkpoint: Callable[..., Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Each item (its experts cut into 3 ranges) reads only tensors its `needs` name: what the
    readahead brings in before the item starts is what the item then reads."""
    fmt, tp, *rest = case.split("-")
    src = quark_checkpoint("tiny-kimi-k2", "template") if fmt == "mxfp4" else tiny_checkpoint(PRESET, fmt)
    real_items = convert_mod.workers_mod.items
    monkeypatch.setattr(convert_mod.workers_mod, "items",
                        lambda groups, tp, workers=1, parts=None: real_items(groups, tp, parts=3))
    captured: list[tuple[int, Callable[[int], Any]]] = []

    class Recording(Prefetcher):
        def __init__(self, source: SourceCheckpoint, count: int, needs: Callable[[int], Any], **kw: Any):
            captured.append((count, needs))
            super().__init__(source, count, needs, **kw)

    monkeypatch.setattr(convert_mod, "Prefetcher", Recording)
    current = threading.local()
    read: dict[int, set[str]] = {}
    real_convert_item, real_view = convert_mod._convert_item, SourceCheckpoint._view
    works: list[list[Any]] = []

    def convert_item(item: Any, *a: Any) -> None:
        current.item = item
        try:
            real_convert_item(item, *a)
        finally:
            current.item = None

    def view(self: SourceCheckpoint, info: Any, *a: Any, **kw: Any) -> Any:
        item = getattr(current, "item", None)
        if item is not None:
            read.setdefault(id(item), set()).add(info.name)
        return real_view(self, info, *a, **kw)

    real_run_items = convert_mod.workers_mod.run_items

    def run_items(work: list[Any], *a: Any, **kw: Any) -> Any:
        works.append(work)
        return real_run_items(work, *a, **kw)

    monkeypatch.setattr(convert_mod, "_convert_item", convert_item)
    monkeypatch.setattr(SourceCheckpoint, "_view", view)
    monkeypatch.setattr(convert_mod.workers_mod, "run_items", run_items)
    atom_convert.convert(src, tmp_path / "out", target="gfx950", tp=int(tp[2:]), ep=bool(rest), workers=2,
                         worker_mode="thread")
    assert len(works) == len(captured) >= 1
    cut = 0
    for work, (count, needs) in zip(works, captured):
        assert count == len(work)
        for i, item in enumerate(work):
            cut += item.part is not None and item.part[0] > 0
            missing = read.get(id(item), set()) - set(needs(i))
            assert not missing, (item.group.key, item.rank, item.part, sorted(missing)[:5])
    assert cut, "no layer's experts were cut into ranges"
