"""Writers of one shard take turns (engine/writer.py, TAKE_TURNS): each buffered write holds an
open-file-description lock on the writer's own descriptor, so a second writer of the file waits
asleep; with turns off, on a file system not in _TURNS_FS (a network one), or where the file system
has no such locks, the writes go on without them."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from pathlib import Path

import pytest

from atom_convert.engine import writer as writer_mod

pytestmark = pytest.mark.skipif(writer_mod._OFD_SETLKW is None, reason="no open-file-description locks here")


def _shard_io(folder: Path, turns: bool = True) -> writer_mod._ShardIO:
    io = writer_mod._ShardIO(folder, "shard.safetensors", None, {}, None,  # type: ignore[arg-type]
                             os.O_RDWR | os.O_CREAT | os.O_EXCL, direct=False)
    io.turns = turns  # as on a file system in _TURNS_FS, whatever the test folder's is
    return io


def _hold(path: Path) -> int:
    """Another writer's descriptor of the file, holding its turn."""
    fd = os.open(path, os.O_RDWR)
    fcntl.fcntl(fd, writer_mod._OFD_SETLKW, writer_mod._flock_struct(fcntl.F_WRLCK))
    return fd


@pytest.mark.parametrize("turns", [True, False])
def test_a_write_waits_while_another_writer_holds_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           turns: bool) -> None:
    monkeypatch.setattr(writer_mod, "TAKE_TURNS", turns)
    io = _shard_io(tmp_path)
    path = tmp_path / "shard.safetensors.partial"
    other = _hold(path)
    data = os.urandom(100_000)
    t = threading.Thread(target=io.pwrite_all, args=(memoryview(data), 10))
    t.start()
    t.join(0.5)
    try:
        if turns:
            assert t.is_alive() and path.stat().st_size == 0  # waiting, nothing written yet
        else:
            assert not t.is_alive()
    finally:
        os.close(other)  # closing the description gives its turn back
    t.join(10)
    assert not t.is_alive()
    assert path.read_bytes() == bytes(10) + data
    # the writer gave its own turn back: another description takes the file at once
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, writer_mod._flock_struct(fcntl.F_WRLCK))
    finally:
        os.close(fd)
        os.close(io.fd)


def test_a_file_system_without_the_locks_is_written_without_turns(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def no_locks(fd: int, cmd: int, arg: bytes) -> bytes:
        calls.append(cmd)
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(writer_mod.fcntl, "fcntl", no_locks)
    io = _shard_io(tmp_path)
    io.pwrite_all(memoryview(b"abc"), 0)
    io.pwrite_all(memoryview(b"def"), 3)
    os.close(io.fd)
    assert (tmp_path / "shard.safetensors.partial").read_bytes() == b"abcdef"
    assert calls == [writer_mod._OFD_SETLKW] and io.turns is False  # asked once, then never again


@pytest.mark.parametrize("magic,turns", [(0x01021994, True), (0xEF53, True), (0x6969, False), (None, False)])
def test_turns_only_on_local_file_systems(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, magic: int | None,
                                          turns: bool) -> None:
    """tmpfs and ext4 take turns; NFS (0x6969), whose locks go to its server, and a file system whose type
    cannot be read do not."""
    monkeypatch.setattr(writer_mod, "_fs_type", lambda fd: magic)
    io = writer_mod._ShardIO(tmp_path, "shard.safetensors", None, {}, None,  # type: ignore[arg-type]
                             os.O_RDWR | os.O_CREAT | os.O_EXCL, direct=False)
    try:
        assert io.turns is turns
    finally:
        os.close(io.fd)
