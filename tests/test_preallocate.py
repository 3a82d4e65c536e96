"""Shards on tmpfs get their pages allocated ahead of the writers (engine/writer.py, PREALLOCATE): a
thread per shard `fallocate`s it from its start, a step at a time. The bytes are those of a
conversion without it; it is best effort (a refused fallocate leaves the writes to meet the error);
a failed conversion stops it and leaves nothing."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

import atom_convert
from atom_convert.engine import writer as writer_mod
from atom_convert.engine.writer import ShardSetWriter

PRESET = "tiny-deepseek-v3"
STEP = 64 << 10


def _files(root: Path) -> dict[str, bytes]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            raw = p.read_bytes()
            if p.name == "atom_manifest.json":
                m = json.loads(raw)
                m.pop("conversion_seconds", None)
                raw = json.dumps(m, sort_keys=True).encode()
            out[str(p.relative_to(root))] = raw
    return out


@pytest.fixture
def as_tmpfs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Every shard taken for one on tmpfs; the fallocate calls recorded as (file, offset, length)."""
    calls: list[tuple[str, int, int]] = []
    real = writer_mod._fallocate

    def recorded(fd: int, offset: int, length: int) -> None:
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))
        real(fd, offset, length)

    monkeypatch.setattr(writer_mod, "_fs_type", lambda fd: writer_mod._TMPFS_MAGIC)
    monkeypatch.setattr(writer_mod, "_fallocate", recorded)
    return calls


def _alloc_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("atom-convert-alloc-")]


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_preallocated_shards_are_the_same_bytes(tiny_checkpoint: Callable[..., Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch, as_tmpfs: list[tuple[str, int, int]],
                                                mode: str) -> None:
    src = tiny_checkpoint(PRESET, "fp8")
    opts: dict[str, Any] = dict(target="gfx950", tp=2, workers=3, worker_mode=mode, shard_size="1MB")
    monkeypatch.setattr(writer_mod, "PREALLOCATE", 0)
    atom_convert.convert(src, tmp_path / "plain", **opts)
    assert as_tmpfs == []  # 0: off
    monkeypatch.setattr(writer_mod, "PREALLOCATE", STEP)
    atom_convert.convert(src, tmp_path / "pre", **opts)
    assert _files(tmp_path / "pre") == _files(tmp_path / "plain")
    # every shard was allocated from its start to its end, a step at a time
    shards = {p.name: p.stat().st_size for p in (tmp_path / "pre").rglob("*.safetensors")}
    assert len(shards) > 2
    by_file: dict[str, list[tuple[int, int]]] = {}
    for path, offset, length in as_tmpfs:
        by_file.setdefault(Path(path).name.removesuffix(writer_mod.PARTIAL_SUFFIX), []).append((offset, length))
    assert set(by_file) == set(shards)
    for name, steps in by_file.items():
        assert steps[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(steps, steps[1:])), (name, steps[:3])
        assert all(n <= STEP for _, n in steps) and steps[-1][0] + steps[-1][1] == shards[name]
    deadline = time.monotonic() + 10
    while _alloc_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _alloc_threads() == []


def test_a_refused_preallocation_is_left_to_the_writes(tiny_checkpoint: Callable[..., Path], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """fallocate failing (a full tmpfs, ENOSPC) stops the preallocation of that shard; the conversion
    goes on and its bytes are the same."""
    src = tiny_checkpoint(PRESET, "fp8")
    refused: list[int] = []

    def full(fd: int, offset: int, length: int) -> None:
        refused.append(offset)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    opts: dict[str, Any] = dict(target="gfx950", tp=2, workers=2, worker_mode="thread", shard_size="1MB")
    atom_convert.convert(src, tmp_path / "plain", **opts)
    monkeypatch.setattr(writer_mod, "_fs_type", lambda fd: writer_mod._TMPFS_MAGIC)
    monkeypatch.setattr(writer_mod, "_fallocate", full)
    monkeypatch.setattr(writer_mod, "PREALLOCATE", STEP)
    atom_convert.convert(src, tmp_path / "pre", **opts)
    shards = list((tmp_path / "pre").rglob("*.safetensors"))
    assert refused and set(refused) == {0} and len(refused) == len(shards)  # once per shard, then no more
    assert _files(tmp_path / "pre") == _files(tmp_path / "plain")


def test_fallocate_allocates_and_changes_no_byte(tmp_path: Path) -> None:
    """The system call: the file grows to the range's end, bytes already there stay, and an error is
    an OSError with its errno (a descriptor not open for writing: EBADF)."""
    path = tmp_path / "f"
    data = os.urandom(10_000)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    try:
        writer_mod._fallocate(fd, 4096, 1 << 20)
        assert os.fstat(fd).st_size == 4096 + (1 << 20)
    finally:
        os.close(fd)
    assert path.read_bytes() == data + bytes(4096 + (1 << 20) - len(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as e:
            writer_mod._fallocate(fd, 0, 1 << 21)
        assert e.value.errno == errno.EBADF
    finally:
        os.close(fd)


class Boom(RuntimeError):
    pass


def test_a_failed_conversion_stops_the_preallocation_and_leaves_nothing(
        tiny_checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        as_tmpfs: list[tuple[str, int, int]]) -> None:
    src = tiny_checkpoint(PRESET, "fp8")
    real_write, real_alloc = ShardSetWriter.write, writer_mod._fallocate
    writes = [0]

    def slow(fd: int, offset: int, length: int) -> None:  # the allocation still running at the failure
        time.sleep(0.02)
        real_alloc(fd, offset, length)

    def write(self: ShardSetWriter, *args: Any, **kwargs: Any) -> None:
        writes[0] += 1
        if writes[0] == 6:
            raise Boom("a worker failed")
        real_write(self, *args, **kwargs)

    monkeypatch.setattr(writer_mod, "PREALLOCATE", 4096)
    monkeypatch.setattr(writer_mod, "_fallocate", slow)
    monkeypatch.setattr(ShardSetWriter, "write", write)
    dst = tmp_path / "out"
    with pytest.raises(Boom):
        atom_convert.convert(src, dst, target="gfx950", tp=2, workers=2, worker_mode="thread", shard_size="1MB")
    assert not dst.exists() and [p.name for p in tmp_path.iterdir()] == []
    # stopped at its next step (20 ms), not after the 256 steps of a whole 1 MB shard
    deadline = time.monotonic() + 1
    while _alloc_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _alloc_threads() == []


@pytest.mark.skipif(writer_mod._OFD_SETLKW is None, reason="no open-file-description locks here")
def test_each_step_takes_the_files_turn(tmp_path: Path) -> None:
    """A step waits while a writer (another open file description) holds the file's turn, and gives
    the turn back after each step."""
    import fcntl

    path = tmp_path / "shard.partial"
    path.write_bytes(b"")
    sh = object.__new__(writer_mod.ShardFile)  # the fields preallocate reads
    sh.size, sh.aborted, sh.closed, sh.turns = 3 * STEP, False, False, True
    writer = os.open(path, os.O_RDWR)
    fcntl.fcntl(writer, writer_mod._OFD_SETLKW, writer_mod._flock_struct(fcntl.F_WRLCK))
    t = threading.Thread(target=sh.preallocate, args=(os.open(path, os.O_WRONLY), STEP))
    t.start()
    t.join(0.5)
    try:
        assert t.is_alive() and path.stat().st_size == 0  # waiting for the turn, nothing allocated
    finally:
        fcntl.fcntl(writer, writer_mod._OFD_SETLKW, writer_mod._flock_struct(fcntl.F_UNLCK))
    t.join(10)
    assert not t.is_alive() and path.stat().st_size == 3 * STEP and path.read_bytes() == bytes(3 * STEP)
    fcntl.fcntl(writer, fcntl.F_OFD_SETLK, writer_mod._flock_struct(fcntl.F_WRLCK))  # given back: free at once
    os.close(writer)
