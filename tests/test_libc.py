"""The C library calls in one place (files/libc.py), each held against what the kernel reports
through another way: /proc/mounts for the file system type, prctl's own getter for the parent
death signal, the file's size and bytes for fallocate."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import signal
from pathlib import Path

import pytest

from atom_convert.files import libc


def _mount_type(path: Path) -> str:
    """The file system type /proc/mounts gives for the mount that holds `path` (its longest prefix)."""
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        _, where, fs, *_ = line.split()
        where = where.replace("\\040", " ")
        if (str(path) == where or str(path).startswith(where.rstrip("/") + "/")) and len(where) > len(best):
            best, kind = where, fs
    return kind


@pytest.mark.skipif(not Path("/proc/mounts").exists(), reason="Linux only")
@pytest.mark.parametrize("where", ["/dev/shm", "tmp"])
def test_fs_type_says_tmpfs_where_the_mount_table_does(where: str, tmp_path: Path) -> None:
    path = Path(where) if where.startswith("/") else tmp_path
    if not path.is_dir():
        pytest.skip(f"no {path}")
    fd = os.open(path, os.O_RDONLY)
    try:
        kind = libc.fs_type(fd)
    finally:
        os.close(fd)
    assert kind is not None
    assert (kind == libc.TMPFS_MAGIC) == (_mount_type(path.resolve()) == "tmpfs")


def test_fs_type_of_a_closed_descriptor_is_none(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY)
    os.close(fd)
    assert libc.fs_type(fd) is None


def test_fallocate_grows_the_file_and_reports_errno(tmp_path: Path) -> None:
    path = tmp_path / "f"
    data = os.urandom(5000)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    try:
        libc.fallocate(fd, 8192, 4096)
        assert os.fstat(fd).st_size == 8192 + 4096
    finally:
        os.close(fd)
    assert path.read_bytes() == data + bytes(8192 + 4096 - len(data))
    with pytest.raises(OSError) as e:
        libc.fallocate(-1, 0, 4096)
    assert e.value.errno == errno.EBADF


@pytest.mark.skipif(not hasattr(os, "fork") or platform.system() != "Linux", reason="Linux only")
def test_parent_death_signal_is_what_prctl_reads_back() -> None:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child sets it and reads it back with PR_GET_PDEATHSIG (2)
        ok = libc.set_parent_death_signal(int(signal.SIGTERM))
        got = ctypes.c_int(-1)
        rc = libc.function("prctl")(2, ctypes.addressof(got))
        os.write(w, f"{int(ok)} {rc} {got.value}".encode())
        os._exit(0)
    os.close(w)
    out = os.read(r, 64).decode()
    os.close(r)
    os.waitpid(pid, 0)
    assert out == f"1 0 {int(signal.SIGTERM)}"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_mmap_threshold_is_taken_by_glibc() -> None:
    assert libc.set_mmap_threshold(1 << 20) is True


def test_a_name_without_a_signature_is_refused() -> None:
    with pytest.raises(KeyError):
        libc.function("system")
