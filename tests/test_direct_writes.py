"""The writer's direct writes (engine/writer.py, DIRECT_MIN_BYTES): a buffer's whole 64 KiB blocks go
to the file with O_DIRECT, every other byte through the page cache; the file holds exactly the bytes
given, whatever the buffer's offset, length and memory alignment, after a short direct write or a
refusal too; a conversion is byte-identical with and without them, on threads and on processes."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import atom_convert
from atom_convert.engine import writer as writer_mod
from atom_convert.store import digest

BLOCK = digest.BLOCK


def _direct_here(folder: Path) -> bool:
    """Whether this folder's file system takes O_DIRECT writes and is not tmpfs (the writer skips it)."""
    p = folder / "probe"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        return writer_mod._direct_fd(fd, writer_mod._fs_type(fd)) is not None and writer_mod._fs_type(fd) != writer_mod._TMPFS_MAGIC
    finally:
        os.close(fd)
        p.unlink()


@pytest.fixture()
def direct_dir(tmp_path: Path) -> Path:
    if not hasattr(os, "O_DIRECT") or not _direct_here(tmp_path):
        pytest.skip("this file system takes no O_DIRECT writes (or is tmpfs)")
    return tmp_path


def _calls(monkeypatch: pytest.MonkeyPatch, log: Path | None = None) -> list[tuple[bool, int, int]]:
    """Every write the writer makes: (through O_DIRECT, offset, bytes); with `log`, also appended to
    that file (worker processes write there)."""
    seen: list[tuple[bool, int, int]] = []
    real = writer_mod._pwrite

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        seen.append((direct, offset, len(data)))
        if log is not None:
            with open(log, "a") as f:
                f.write(f"{int(direct)} {offset} {len(data)}\n")
        return real(fd, data, offset)

    monkeypatch.setattr(writer_mod, "_pwrite", pwrite)
    return seen


def _shard_io(folder: Path) -> writer_mod._ShardIO:
    return writer_mod._ShardIO(folder, "shard.safetensors", None, {}, None,  # type: ignore[arg-type]
                               os.O_RDWR | os.O_CREAT | os.O_EXCL)


def _aligned_bytes(n: int, shift: int) -> memoryview:
    """n random bytes starting `shift` bytes after a page boundary."""
    m = mmap.mmap(-1, n + shift)
    a = np.frombuffer(m, dtype=np.uint8)
    a[:] = np.random.default_rng(n + shift).integers(0, 256, n + shift, dtype=np.uint8)
    return memoryview(m)[shift:]


@pytest.mark.parametrize("offset,n,shift", [
    (0, 4 * BLOCK, 0),               # whole blocks from page-aligned memory: all direct
    (12_345, 5 * BLOCK + 77, 0),     # a head and a tail around the blocks
    (BLOCK - 1, 3 * BLOCK + 2, 123), # memory off the page: through the aligned copy
    (7, BLOCK + 100, 0),             # not one whole block inside: all through the page cache
    (3 * BLOCK, (9 << 20) + 5, 11),  # more than one copy buffer
])
def test_whole_blocks_go_direct_and_the_file_holds_exactly_the_bytes(direct_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     offset: int, n: int, shift: int) -> None:
    monkeypatch.setattr(writer_mod, "DIRECT_MIN_BYTES", BLOCK)
    data = _aligned_bytes(n, shift)
    calls = _calls(monkeypatch)
    io = _shard_io(direct_dir)
    io.pwrite_all(data, offset)
    io.close_direct()
    os.close(io.fd)
    got = (direct_dir / "shard.safetensors.partial").read_bytes()
    assert got[offset:] == bytes(data) and got[:offset] == bytes(offset)
    first, last = -(-offset // BLOCK) * BLOCK, (offset + n) // BLOCK * BLOCK
    direct = [(o, k) for d, o, k in calls if d]
    buffered = [(o, k) for d, o, k in calls if not d]
    if last - first >= BLOCK:
        assert direct[0][0] == first and sum(k for _, k in direct) == last - first == io.direct_bytes
        assert all(o % BLOCK == 0 and k % BLOCK == 0 for o, k in direct)
        assert sum(k for _, k in buffered) == n - (last - first)
        assert all(o + k <= first or o >= last for o, k in buffered)  # blocks that may straddle: cached
    else:
        assert direct == [] and sum(k for _, k in buffered) == n


@pytest.mark.parametrize("fault", ["short", "EINVAL"])
def test_a_short_or_refused_direct_write_is_finished_through_the_page_cache(direct_dir: Path,
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           fault: str) -> None:
    """A direct write that comes back short (a disk filling up) or is refused (an alignment the file
    system does not take): the rest of the buffer is written through the page cache; after a refusal
    the shard writes no more directly."""
    monkeypatch.setattr(writer_mod, "DIRECT_MIN_BYTES", BLOCK)
    real = writer_mod._pwrite
    hit: list[int] = []

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and not hit:
            hit.append(offset)
            if fault == "EINVAL":
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            return real(fd, data[:BLOCK], offset)
        return real(fd, data, offset)

    monkeypatch.setattr(writer_mod, "_pwrite", pwrite)
    data = _aligned_bytes(6 * BLOCK + 9, 0)
    io = _shard_io(direct_dir)
    io.pwrite_all(data, 100)
    assert (io.dfd is None) == (fault == "EINVAL")
    io.pwrite_all(data, 100 + len(data))
    io.close_direct()
    os.close(io.fd)
    got = (direct_dir / "shard.safetensors.partial").read_bytes()
    assert got == bytes(100) + bytes(data) + bytes(data) and hit


def test_no_direct_writes_on_tmpfs_or_when_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        fd = os.open(shm / f"atom-convert-test-{os.getpid()}", os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
        try:
            if writer_mod._fs_type(fd) == writer_mod._TMPFS_MAGIC:
                assert writer_mod._direct_fd(fd, writer_mod._fs_type(fd)) is None
        finally:
            os.close(fd)
            os.unlink(shm / f"atom-convert-test-{os.getpid()}")
    monkeypatch.setattr(writer_mod, "DIRECT_MIN_BYTES", 0)
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        assert writer_mod._direct_fd(fd, writer_mod._fs_type(fd)) is None
    finally:
        os.close(fd)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_conversion_is_the_same_with_and_without_direct_writes(tiny_checkpoint: Callable[..., Path],
                                                                 direct_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 mode: str) -> None:
    """Every shard byte-identical and the manifests' digests equal, with direct writes down to one
    block (so that the tiny model's tensors take them) and with none; the direct path was taken,
    also inside the worker processes."""
    src = tiny_checkpoint("tiny-deepseek-v3", "fp8")
    log = direct_dir / "writes.log"
    _calls(monkeypatch, log)
    monkeypatch.setattr(writer_mod, "DIRECT_MIN_BYTES", BLOCK)
    a = atom_convert.convert(src, direct_dir / "direct", target="gfx942", tp=2, workers=2, worker_mode=mode)
    direct_writes = [line for line in log.read_text().splitlines() if line.startswith("1 ")]
    assert direct_writes, "no write took the direct path"
    monkeypatch.setattr(writer_mod, "DIRECT_MIN_BYTES", 0)
    log.unlink()
    b = atom_convert.convert(src, direct_dir / "buffered", target="gfx942", tp=2, workers=2, worker_mode=mode)
    assert not [line for line in log.read_text().splitlines() if line.startswith("1 ")]
    assert a["files"] == b["files"]  # names, sizes and digests (store/digest.py's written digest)
    files = sorted(p.relative_to(direct_dir / "direct") for p in (direct_dir / "direct").rglob("*.safetensors"))
    assert files
    for rel in files:
        assert (direct_dir / "direct" / rel).read_bytes() == (direct_dir / "buffered" / rel).read_bytes(), rel


def _direct_lines(log: Path) -> list[str]:
    lines = log.read_text().splitlines() if log.exists() else []
    assert lines, "the writer wrote nothing"
    return [line for line in lines if line.startswith("1 ")]


@pytest.mark.parametrize("mode", ["thread", "process"])
@pytest.mark.parametrize("keep_cached,available,direct", [
    (False, 1 << 40, True),   # the default of convert and the CLI: direct, whatever the memory
    (True, 1, False),         # asked for: through the page cache, even where it does not fit
    (None, 1 << 40, False),   # auto, the output fits in half of the available memory: cached
    (None, 1, True),          # auto, it does not: direct
])
def test_keep_cached_decides_the_direct_writes(tiny_checkpoint: Callable[..., Path], direct_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch, mode: str, keep_cached: bool | None,
                                               available: int, direct: bool) -> None:
    from atom_convert.engine import workers as workers_mod

    src = tiny_checkpoint("tiny-deepseek-v3", "fp8")
    log = direct_dir / "writes.log"
    _calls(monkeypatch, log)
    monkeypatch.setattr(writer_mod, "DIRECT_MIN_BYTES", BLOCK)
    monkeypatch.setattr(workers_mod, "available_memory", lambda: available)
    atom_convert.convert(src, direct_dir / "out", target="gfx942", tp=2, workers=2, worker_mode=mode,
                         max_memory="1GB", keep_cached=keep_cached)
    assert bool(_direct_lines(log)) == direct


def test_ensure_converted_keeps_what_fits_cached_and_the_cli_asks_for_it(tiny_checkpoint: Callable[..., Path],
                                                                         direct_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A serving start loads right after `ensure_converted`: its output stays in the page cache when
    it fits. The command line writes direct unless `--keep-cached` is given."""
    from click.testing import CliRunner

    from atom_convert.cli import cli

    src = tiny_checkpoint("tiny-deepseek-v3", "fp8")
    log = direct_dir / "writes.log"
    _calls(monkeypatch, log)
    monkeypatch.setattr(writer_mod, "DIRECT_MIN_BYTES", BLOCK)
    atom_convert.ensure_converted(src, direct_dir / "cache", target="gfx942", tp=2, workers=1)
    assert not _direct_lines(log)
    for flags, direct in (([], True), (["--keep-cached"], False)):
        log.unlink()
        r = CliRunner().invoke(cli, ["convert", str(src), str(direct_dir / f"cli{len(flags)}"), "--target", "gfx942",
                                     "--tp", "2", "--workers", "1", *flags])
        assert r.exit_code == 0, r.output
        assert bool(_direct_lines(log)) == direct


def test_keep_cached_takes_only_a_choice(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    with pytest.raises(atom_convert.BadInputError, match="keep_cached must be True, False or None, got 'yes'"):
        atom_convert.convert(tiny_checkpoint("tiny-deepseek-v3", "fp8"), tmp_path / "out", keep_cached="yes")  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()
