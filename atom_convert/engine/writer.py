"""Streaming safetensors writer, written in any order by several workers.

The safetensors library writes a file from a dict of complete tensors; a
stacked expert tensor of one DeepSeek-V3 layer is 7.5 GB, so that would hold
a whole layer in memory. Here the plan fixes every shard's header (names,
dtypes, shapes are known before any data is read), hence every tensor's byte
offset in its file; tensor bytes are written there with `pwrite` as the
producers yield them, one expert at a time, by whichever worker produced them
and in whatever order the workers finish. The bytes on disk therefore do not
depend on the number of workers or on the order of completion.

How it works:
1. A shard file is opened when its first tensor is written: the header goes
   to offset 0 (its layout: shard_header.py), and a hashing thread for that file starts.
2. Each worker hands its buffers to its own write-behind thread (`_IOThread`, write_behind.py),
   which `pwrite`s them at their offsets (the whole 64 KiB blocks of a large buffer with O_DIRECT,
   the rest through the page cache: DIRECT_MIN_BYTES below), takes the leaves of the whole 64 KiB blocks of the
   file that lie in the buffer (store/digest.py: `xxh3_blocks`) while the bytes are still in
   its core's caches, and marks the byte range done with those leaves (a worker process sends
   them to the converting process with the range).
3. A shard's hashing thread follows the contiguous done prefix of its file and hashes only
   the blocks whose leaf no writer sent (those that straddle two buffers, and the short last
   block), read back through a mapping (they are in the page cache: just written). When the
   prefix reaches the end, the thread computes the file's digest from its leaves, fsyncs and
   seals the file. Hashing never waits for the order of production beyond those few blocks.
4. Crash safety: a shard is written under `<name>.partial` and sealed once its last byte
   is written and hashed: fsynced, renamed to its final name, the directory fsynced, and
   its size and digest appended to the staging journal (staging.py). A killed run leaves
   only sealed shards (kept by a resume) and `.partial` files (removed by it). `abort()`
   never waits long: threads are joined with timeouts, so Ctrl-C cannot hang on a stuck write.
The files are plain safetensors: `safe_open` reads them.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import mmap
import os
import stat
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from ..errors import AtomConvertError
from ..files.libc import TMPFS_MAGIC as _TMPFS_MAGIC, fallocate as _fallocate, fs_type as _fs_type
from ..store import digest
from ..store.manifest import WrittenFile
from ..layout.plan import OutTensor, ShardPlan
from ..store.lock import kind_of, refuse_foreign
from ..store.staging import PARTIAL_SUFFIX, Journal, Sealed, fsync_dir
from .shard_header import _ALIGN, header_digest, safetensors_header, shard_header, shard_layout  # noqa: F401
from .write_behind import Cancelled, _IOThread


def _as_bytes(t: torch.Tensor) -> Any:
    """A zero-copy byte view (numpy) of a contiguous tensor of any dtype."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _pwrite(fd: int, data: memoryview, offset: int) -> int:
    """One `os.pwrite` (a module function so that tests can inject disk-full and other faults)."""
    return os.pwrite(fd, data, offset)


# Direct writes. A buffer's whole 64 KiB blocks of the file (store/digest.py's blocks) are written
# around the page cache (O_DIRECT, through a second descriptor of the same file) when they come to
# at least DIRECT_MIN_BYTES; the rest of the buffer, and so every block that straddles two buffers,
# goes through the page cache, where the shard's hashing thread reads those blocks back. Writing
# through the page cache costs the kernel a page allocation and a copy per 4 KB, and the write-back
# later: on the 2-core box 0.55-1.9 CPU-s per GB with the fsync, at 0.7-1.5 GB/s, where O_DIRECT
# took 0.02 CPU-s per GB at 1.6-1.8 GB/s (bench/write_floor.py, BENCHMARKS.md, twentieth round).
# Not on tmpfs (its pages are the file: nothing to save) nor where the file system refuses O_DIRECT.
DIRECT_MIN_BYTES = 1 << 20  # 0: every byte through the page cache
_DIRECT_ALIGN = 4096  # memory alignment O_DIRECT needs (a logical block of any disk)
_BOUNCE_BYTES = 8 << 20  # an aligned copy of a buffer whose memory is not aligned, this much at a time
_bounce = threading.local()  # per writing thread: its aligned copy buffer


def _reopen(fd: int, flags: int = 0) -> int | None:
    """A new open file description of the same open file, for writing (with `flags`), or None where it
    is refused. Through /proc/self/fd: the same inode, never the name again."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_CLOEXEC | flags)
    except OSError:  # no /proc, or a file system that refuses the flags (O_DIRECT)
        return None


def _direct_fd(fd: int, fs_type: int | None) -> int | None:
    """A second descriptor of the same open file, for O_DIRECT writes; None where direct writes are
    off, on tmpfs (`fs_type`, the file's `_fs_type`), or refused."""
    if not DIRECT_MIN_BYTES or not hasattr(os, "O_DIRECT") or fs_type in (None, _TMPFS_MAGIC):
        return None
    return _reopen(fd, os.O_DIRECT)


def _aligned(mv: memoryview) -> memoryview:
    """`mv`'s bytes at an address O_DIRECT accepts: `mv` itself, or a copy in this thread's buffer."""
    if not mv.readonly:  # (a read-only buffer's address is not at hand: it is copied)
        at = ctypes.c_char.from_buffer(mv)
        aligned = ctypes.addressof(at) % _DIRECT_ALIGN == 0
        del at  # releases the buffer
        if aligned:
            return mv
    buf = getattr(_bounce, "buf", None)
    if buf is None:
        buf = _bounce.buf = mmap.mmap(-1, _BOUNCE_BYTES)  # page-aligned
    out = memoryview(buf)[:len(mv)]
    out[:] = mv
    return out


# Writers of one file take turns. A file system holds a file's lock (the inode's i_rwsem) across each
# buffered write, and a second process writing the same file does not sleep on it: the kernel spins
# while the holder copies, so two workers writing one rank's shard burn two cores for one's bytes
# (bench/write_floor.py's `shared` way; BENCHMARKS.md, twenty-second round). Around each buffered
# write a worker takes an open-file-description lock on its own descriptor of the file (F_OFD_SETLKW;
# worker processes open the file each for themselves), so a waiting writer sleeps and its core works.
# Only on local file systems that lock a file across a buffered write: a network file system would
# send every lock to its server.
TAKE_TURNS = True
_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", None)  # Linux 3.15+
_TURNS_FS = frozenset({_TMPFS_MAGIC, 0xEF53, 0x58465342, 0x9123683E})  # tmpfs, ext2/3/4, xfs, btrfs


def _flock_struct(kind: int) -> bytes:
    """A `struct flock` over the whole file (l_type, l_whence, l_start, l_len 0 = to the end, l_pid 0)."""
    return struct.pack("hh4xqqi4x", kind, os.SEEK_SET, 0, 0, 0)


# tmpfs: a thread per shard allocates the file's pages ahead of the writers (fallocate, this many bytes
# at a time), so that a write holds the file's lock (one write at a time) for its copy alone, not also
# for the allocation of each new 4 KB page. Off (0) until 16 cores measure it: on the 2-core box it was
# a third faster at tp 8 in one sitting, and in a later one about the same at tp 8 and slower at tp 1
# (BENCHMARKS.md, thirty-second round).
PREALLOCATE = 0


class FaultHook:
    """The writer's fault-injection interface, for tests: production passes none (`fault=None`).

    Before each buffer a shard writes, the writer asks the hook `cut(n)`: None, or an offset
    inside the n bytes; then it writes that many bytes, calls `fire()` and writes the rest, so a
    test can kill or interrupt a conversion with a shard cut at an exact byte
    (tests/fault_launcher.py has the hook the crash tests use). A hook reaches the writers as
    their `fault=` argument, from their caller; the writer holds no hook of its own and reads no
    environment variable."""

    def cut(self, n: int) -> int | None:
        """Count `n` bytes about to be written; where the fault falls inside them, the offset."""
        return None

    def fire(self) -> None:
        """Inject the fault (the writer calls it with exactly `cut(n)` bytes of the buffer written)."""

    @staticmethod
    def for_run() -> "FaultHook | None":
        """None: the conversion driver (convert.py) asks for a hook here and passes it to the writers;
        a test replaces the driver's `FaultHook` name with one that returns its hook
        (tests/fault_launcher.py); nothing is read from the environment."""
        return None


@dataclass
class _Piece:
    """Bytes to write at an absolute file offset."""

    offset: int
    data: Any  # a buffer (numpy byte view or bytes)


HASH_READ_BYTES = 8 << 20  # default block of the hashing threads (ShardSetWriter's hash_read)



def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Sorted block numbers as runs [a, b) of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for i in blocks:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _unlink_own_leftover(final: Path, suffix: str) -> None:
    """Remove `final + suffix` when it is a regular file (an interrupted write of ours in the
    staging directory); anything else there is refused, left as it is."""
    tmp = final.with_name(final.name + suffix)
    try:
        st = os.lstat(tmp)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise refuse_foreign(tmp, kind_of(st.st_mode) if not stat.S_ISLNK(st.st_mode)
                             else f"a symbolic link (to {os.readlink(tmp)})", "a shard being written (a regular file)")
    os.unlink(tmp)


class _ShardIO:
    """A shard's `.partial` file open for positional writes (`pwrite`), with the test fault hook."""

    def __init__(self, root: Path, rel: str, plan: ShardPlan, offsets: dict[str, int], fault: FaultHook | None,
                 flags: int, direct: bool = True):
        self.rel = rel
        self.plan = plan
        self.final = root / rel
        self.tmp = self.final.with_name(self.final.name + PARTIAL_SUFFIX)
        self.offsets = offsets  # tensor name -> absolute offset of its bytes
        self.fault = fault
        self.written: dict[str, list[tuple[int, int]]] = {}  # tensor -> unit ranges handed over
        # never through a symlink planted at the name (a leftover of ours is unlinked first, then the
        # file is created exclusively: O_EXCL with O_CREAT does not follow one)
        self.fd = self._io(os.open, self.tmp, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)  # umask applies
        # whole blocks around the page cache (DIRECT_MIN_BYTES), unless the writer keeps the output cached
        fs_type = _fs_type(self.fd)  # one fstatfs: it decides the direct writes and the turns
        self.dfd = _direct_fd(self.fd, fs_type) if direct else None
        self.direct_bytes = 0  # bytes written through dfd
        self.turns = fs_type in _TURNS_FS  # _turn
        self.fs_type = fs_type

    def _io(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run an OS call, naming this shard in the error (pwrite and fsync raise without a path)."""
        try:
            return fn(*args)
        except OSError as e:
            if e.filename is None:
                raise OSError(e.errno, e.strerror, str(self.tmp)) from e
            raise

    def pwrite(self, data: Any, offset: int) -> None:
        """Write all of `data` at `offset`."""
        mv = memoryview(data).cast("B")
        cut = self.fault.cut(len(mv)) if self.fault is not None else None
        if cut is not None:  # test hook: the fault fires with exactly `cut` bytes of this buffer written
            self.pwrite_all(mv[:cut], offset)
            self.fault.fire()  # type: ignore[union-attr]
            self.pwrite_all(mv[cut:], offset + cut)
        else:
            self.pwrite_all(mv, offset)

    def pwrite_all(self, mv: memoryview, offset: int) -> None:
        if self.dfd is not None and len(mv) >= DIRECT_MIN_BYTES:
            block = digest.BLOCK
            a, b = -offset % block, (offset + len(mv)) // block * block - offset  # the whole blocks: [a, b)
            if b - a >= DIRECT_MIN_BYTES:
                self._buffered(mv[:a], offset)
                done = self._direct(mv[a:b], offset + a)
                self._buffered(mv[a + done:], offset + a + done)  # the tail, and what a short write left
                return
        self._buffered(mv, offset)

    def _buffered(self, mv: memoryview, offset: int) -> None:
        if not len(mv):
            return
        locked = self._turn(fcntl.F_WRLCK)
        try:
            while len(mv):
                n = self._io(_pwrite, self.fd, mv, offset)
                offset += n
                mv = mv[n:]
        finally:
            if locked:
                self._turn(fcntl.F_UNLCK)

    def _turn(self, kind: int) -> bool:
        """Take (F_WRLCK) or give back (F_UNLCK) this descriptor's turn at the file (TAKE_TURNS); False
        where turns are off or the file system has no such locks (then never asked again)."""
        if not (TAKE_TURNS and self.turns and _OFD_SETLKW is not None):
            return False
        try:
            fcntl.fcntl(self.fd, _OFD_SETLKW, _flock_struct(kind))
            return True
        except OSError:
            self.turns = False
            return False

    def _direct(self, mv: memoryview, offset: int) -> int:
        """Write whole blocks with O_DIRECT; the bytes written (all, unless a write came back short
        or the file system refused it: the caller writes the rest through the page cache)."""
        done, dfd = 0, self.dfd
        while dfd is not None and done < len(mv):
            piece = _aligned(mv[done:done + _BOUNCE_BYTES])
            try:
                n = self._io(_pwrite, dfd, piece, offset + done)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.close_direct()  # an alignment this file system does not take: no more direct writes
                return done
            done += n
            self.direct_bytes += n
            if n < len(piece):
                return done
        return done

    def close_direct(self) -> None:
        dfd, self.dfd = self.dfd, None
        if dfd is not None:
            os.close(dfd)


class ShardFile(_ShardIO):
    """One shard from its first byte to its seal, written in any order by several threads (or
    worker processes, which write through descriptors of their own and report what they wrote).

    Bytes go to `<final>.partial` at their offsets (`pwrite`, then `done`); the shard's own
    hashing thread (`hash_and_seal`) follows the contiguous written prefix, and at the end
    fsyncs, renames the file to its final name, fsyncs the directory and records the shard in
    the journal. `discard` removes an unsealed shard.
    """

    def __init__(self, root: Path, rel: str, plan: ShardPlan, header: bytes, offsets: dict[str, int], size: int,
                 journal: Journal, fault: FaultHook | None = None, *, hash_from_map: bool = True,
                 hash_read: int = HASH_READ_BYTES, direct: bool = True):
        _unlink_own_leftover(root / rel, PARTIAL_SUFFIX)
        super().__init__(root, rel, plan, offsets, fault, os.O_RDWR | os.O_CREAT | os.O_EXCL, direct)
        self.hash_from_map = hash_from_map  # ShardSetWriter's docstring
        self.hash_read = hash_read
        self.header = header
        self.size = size  # header + data
        self.journal = journal
        self.cond = threading.Condition()
        self.ends: dict[int, int] = {}  # done ranges not yet joined to the prefix: start -> end
        self.frontier = 0  # bytes [0, frontier) are written
        self.nbytes = 0  # bytes written (any order)
        self.hashed = 0  # the leaves of bytes [0, hashed) are in (a block boundary, or size)
        self.leaves = digest.Leaves(size)  # the file's block leaves (store/digest.py), from any writer
        self.aborted = False
        self.error: BaseException | None = None
        self.closed = False
        self.sealed: Sealed | None = None
        self.thread: threading.Thread | None = None

    def done(self, start: int, n: int, leaves: tuple[int, bytes] | None = None) -> None:
        """Bytes [start, start + n) are in the file (called after pwrite returned); `leaves`: (first
        block, leaves) of the whole blocks in them (digest.leaves_within), None when not taken."""
        if leaves is not None and leaves[1]:
            self.leaves.put(*leaves)  # before the frontier passes them: the hashing thread then skips them
        with self.cond:
            self.nbytes += n
            self.ends[start] = start + n
            advanced = False
            while self.frontier in self.ends:
                self.frontier = self.ends.pop(self.frontier)
                advanced = True
            if advanced:
                self.cond.notify_all()

    def hash_and_seal(self) -> None:
        """The hashing thread: the leaves no writer sent, block by block as the written prefix
        passes them; then the digest, fsync and seal."""
        try:
            block = digest.BLOCK
            window = max(1, self.hash_read // block)  # blocks read back at a time
            view = None if self.hash_from_map else memoryview(bytearray(min(window * block, max(self.size, 1))))
            while self.hashed < self.size:
                with self.cond:
                    while self.frontier < min(self.hashed + block, self.size) and not self.aborted:
                        self.cond.wait(0.5)
                    if self.aborted:
                        return
                    ready = self.frontier
                lo, hi = self.hashed // block, (self.leaves.count if ready == self.size else ready // block)
                for a, b in _runs(self.leaves.missing(lo, hi)):
                    for w in range(a, b, window):
                        self._hash_blocks(w, min(w + window, b), view)
                self.hashed = min(hi * block, self.size)
            self._io(os.fsync, self.fd)
            self.close_fd()
            with self.cond:
                if self.aborted:  # an abort while the last bytes were hashed: leave it unsealed
                    return
            self._seal()
        except BaseException as e:  # noqa: BLE001  reported by close()
            self.error = e
        finally:
            self.close_fd()

    def start_preallocation(self, step: int) -> None:
        """Start `preallocate` on a thread, through a file description of its own (so that it takes
        turns with this process's writers); nothing where one cannot be opened."""
        fd = _reopen(self.fd)
        if fd is not None:
            threading.Thread(target=self.preallocate, args=(fd, step), name=f"atom-convert-alloc-{self.plan.file}",
                             daemon=True).start()

    def preallocate(self, fd: int, step: int) -> None:
        """Allocate the file's pages from its start, `step` bytes at a time, through `fd` (an open
        file description of its own, which this thread closes), until done or the shard is aborted
        or closed. Each step takes the file's turn (TAKE_TURNS) like a write, so that the writers
        wait for it asleep. Best effort: a full file system is reported by the write that meets it."""
        turns = TAKE_TURNS and self.turns and _OFD_SETLKW is not None
        try:
            off = 0
            while off < self.size and not (self.aborted or self.closed):
                n = min(step, self.size - off)
                if turns:
                    fcntl.fcntl(fd, _OFD_SETLKW, _flock_struct(fcntl.F_WRLCK))
                try:
                    _fallocate(fd, off, n)
                finally:
                    if turns:
                        fcntl.fcntl(fd, _OFD_SETLKW, _flock_struct(fcntl.F_UNLCK))
                off += n
        except OSError:  # ENOSPC (a full tmpfs), ENOSYS (no fallocate), a refused lock: the writes go on
            pass
        finally:
            os.close(fd)

    def _hash_blocks(self, a: int, b: int, view: memoryview | None) -> None:
        """The leaves of blocks [a, b), all written, read back through a read-only mapping of them
        (the page cache's pages themselves, where reading them back with preadv into `view` copies
        every byte once more: 60-61 against 64-67 CPU-s for a 15.8 GB conversion on the 2-core box,
        BENCHMARKS.md, issue 9, sixth round)."""
        start, end = a * digest.BLOCK, min(b * digest.BLOCK, self.size)
        if view is None:
            lo = start // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
            mm = self._io(lambda: mmap.mmap(self.fd, end - lo, prot=mmap.PROT_READ, offset=lo))
            try:
                with memoryview(mm) as mv:
                    self.leaves.hash_blocks(list(range(a, b)), lambda s, e: mv[s - lo:e - lo])
            finally:
                mm.close()
            return
        got = 0
        while got < end - start:
            n = self._io(os.preadv, self.fd, [view[got:end - start]], start + got)
            if n <= 0:
                raise AtomConvertError(f"internal: {self.rel}: read back {n} bytes at {start + got}")
            got += n
        self.leaves.hash_blocks(list(range(a, b)), lambda s, e: view[s - start:e - start])

    def _seal(self) -> None:
        if not (self.nbytes == self.hashed == self.size):
            raise AtomConvertError(f"internal: {self.rel}: {self.nbytes} bytes written, {self.hashed} hashed, "
                                   f"{self.size} planned")
        self._io(os.rename, self.tmp, self.final)
        self._io(fsync_dir, self.final.parent)
        s = Sealed(self.rel, self.size, self.leaves.hexdigest(), hashlib.sha256(self.header).hexdigest())
        self._io(self.journal.record, s)
        self.sealed = s

    def close_fd(self) -> None:
        with self.cond:
            if not self.closed:
                self.closed = True
                self.close_direct()
                os.close(self.fd)

    def discard(self) -> None:
        """Remove the file of a shard that was not sealed."""
        if self.sealed is None:
            try:
                self.tmp.unlink()
            except FileNotFoundError:
                pass


class ShardSetWriter:
    """Writes the shards of every rank of one converted set (main model or MTP) into
    `root/subdir`, skipping the shards in `kept` (sealed by an earlier, interrupted run).

    Thread-safe: workers call `write` for any (slot, tensor) in any order; each tensor's
    bytes land at the offset the plan gives it.

    `fault`: a test's fault hook (FaultHook), None in production. How the hashing threads read
    the written bytes (the same digest either way; benches compare them): `hash_from_map`
    through a read-only mapping of the file (the default), else read back with preadv;
    `hash_read` bytes at a time. `direct`: large buffers' whole blocks go around the page cache
    (DIRECT_MIN_BYTES); False leaves every written byte in the page cache, for a load that follows.
    """

    def __init__(self, root: Path, subdir: str, shards: list[list[ShardPlan]], outputs: list[OutTensor],
                 journal: Journal, kept: dict[str, Sealed] | None = None,
                 on_bytes: Callable[[int], None] | None = None, stop: threading.Event | None = None,
                 fault: FaultHook | None = None, *, hash_from_map: bool = True, hash_read: int = HASH_READ_BYTES,
                 direct: bool = True):
        if hash_read <= 0:
            raise ValueError(f"hash_read must be positive, got {hash_read}")
        self.hash_from_map, self.hash_read = hash_from_map, hash_read
        self.direct = direct
        self.root = root
        self.prefix = f"{subdir}/" if subdir else ""
        self.dir = root / subdir if subdir else root
        self.dir.mkdir(parents=True, exist_ok=True)
        self.journal = journal
        self.fault = fault
        kept = kept or {}
        self.by_name = {o.name: o for o in outputs}
        self.plans = [p for ps in shards for p in ps]
        self.kept = {p.file: kept[self.prefix + p.file] for p in self.plans if self.prefix + p.file in kept}
        # slot: a rank, or the caller's extra slot for files every rank shares
        self.place: dict[tuple[int, str], ShardPlan] = {(slot, n): p for slot, ps in enumerate(shards)
                                                        for p in ps for n in p.names}
        self.tensor_file: dict[tuple[int, str], str] = {k: p.file for k, p in self.place.items()}
        self._on_bytes = on_bytes or (lambda n: None)
        self.stop = stop or threading.Event()
        self._lock = threading.Lock()
        self._open: dict[str, ShardFile] = {}
        self._local = threading.local()

    def is_sealed(self, slot: int, name: str) -> bool:
        """True when the shard holding `name` for `slot` was kept from an earlier run: skip producing it."""
        p = self.place.get((slot, name))
        return p is not None and p.file in self.kept

    @property
    def kept_bytes(self) -> int:
        return sum(s.nbytes for s in self.kept.values())

    # Runs on the workers' write-behind threads. One buffer per call, written at its offset.
    @staticmethod
    def _write(sh: ShardFile, piece: _Piece) -> None:
        sh.pwrite(piece.data, piece.offset)
        sh.done(piece.offset, len(memoryview(piece.data).cast("B")), digest.leaves_within(piece.data, piece.offset))

    def _progress(self, n: int) -> None:
        with self._lock:
            self._on_bytes(n)

    def _write_and_count(self, sh: ShardFile, piece: _Piece) -> None:
        if self.stop.is_set():
            raise Cancelled()
        n = len(memoryview(piece.data).cast("B"))
        self._write(sh, piece)
        self._progress(n)

    def _shard(self, plan: ShardPlan) -> ShardFile:
        with self._lock:
            sh = self._open.get(plan.file)
            if sh is None:
                header, offsets, size = shard_layout(plan, self.by_name)
                sh = ShardFile(self.root, self.prefix + plan.file, plan, header, offsets, size, self.journal,
                               self.fault, hash_from_map=self.hash_from_map, hash_read=self.hash_read,
                               direct=self.direct)
                self._open[plan.file] = sh
                t = threading.Thread(target=sh.hash_and_seal, name=f"atom-convert-hash-{plan.file}", daemon=True)
                t.start()
                # Set once started: a Ctrl-C or SIGTERM raised in this thread before start() returned
                # leaves sh.thread None, and abort() must not join a thread not (yet) started
                # (RuntimeError). A thread that did start sees sh.aborted and returns: it has
                # nothing to hash, the header is written below.
                sh.thread = t
                self._write(sh, _Piece(0, header))
                if PREALLOCATE > 0 and sh.fs_type == _TMPFS_MAGIC:
                    sh.start_preallocation(PREALLOCATE)
        return sh

    def open_shards(self, slot: int, names: Iterable[str]) -> None:
        """Create (header, hashing thread) the unsealed shards that hold these tensors of `slot`:
        the converting process does it before a worker process, which opens the files by name
        and never creates one, writes into them (procs.py)."""
        for n in names:
            plan = self.place.get((slot, n))
            if plan is not None and plan.file not in self.kept:
                self._shard(plan)

    def written_elsewhere(self, file: str, start: int, n: int, leaves: tuple[int, bytes] | None = None) -> None:
        """A worker process wrote bytes [start, start + n) of the shard `file` (ProcessShardWriter),
        and took the `leaves` of the whole blocks in them."""
        sh = self._open.get(file)
        if sh is None:
            raise AtomConvertError(f"internal: a worker process wrote {file}, which is not open")
        sh.done(start, n, leaves)
        self._progress(n)

    def use_io(self, io: "_IOThread | None") -> None:
        """Route the calling thread's writes through `io` (its write-behind thread); None: inline."""
        self._local.io = io

    def write(self, rank: int, out: OutTensor, chunks: Iterable[torch.Tensor],
              part: tuple[int, int] | None = None) -> None:
        """Write one rank's (slot's) tensor from its producer's chunks at the tensor's planned offset,
        through the calling worker's write-behind thread (`use_io`); `part`: only units [a, b) of
        it (plan.OutTensor.units), at their place in the tensor."""
        io: _IOThread | None = getattr(self._local, "io", None)
        if self.stop.is_set():
            raise Cancelled()
        plan = self.place.get((rank, out.name))
        if plan is None:
            raise AtomConvertError(f"internal: {out.name} (rank {rank}) is in no planned shard")
        if plan.file in self.kept:
            raise AtomConvertError(f"internal: {out.name} (rank {rank}) is in {plan.file}, sealed by an earlier run")
        sh = self._shard(plan)
        a, b = part if part is not None else (0, out.units or 1)
        if part is not None and not 0 <= a < b <= out.units:
            raise AtomConvertError(f"internal: {out.name} (rank {rank}): units {part} of {out.units}")
        with self._lock:
            # What was written, as unit ranges: a range is written once, and ranges never overlap
            # (close() checks that every byte of every shard was written).
            if any(x < b and a < y for x, y in sh.written.get(out.name, ())):
                raise AtomConvertError(f"internal: {out.name} (rank {rank}) units {a}..{b} written twice")
            sh.written.setdefault(out.name, []).append((a, b))
        expected = out.nbytes if part is None else (b - a) * out.unit_bytes
        base, total = sh.offsets[out.name] + a * (out.unit_bytes if part is not None else 0), 0
        for c in chunks:
            if self.stop.is_set():
                raise Cancelled()
            if c.dtype != out.dtype:
                raise AtomConvertError(f"internal: {out.name} produced {c.dtype}, planned {out.dtype}")
            buf = _as_bytes(c)
            if total + len(buf) > expected:
                total += len(buf)
                break
            piece = _Piece(base + total, buf)
            total += len(buf)
            if io is None:
                self._write_and_count(sh, piece)
            else:
                io.submit(self._write_and_count, sh, piece)
            del buf, piece, c  # hold no chunk while the producer makes the next one
        if total != expected:
            raise AtomConvertError(
                f"internal: {out.name} produced {total} bytes, planned {expected} ({out.dtype}, {list(out.shape)}"
                f"{'' if part is None else f', units {a}..{b} of {out.units}'})"
            )

    def close(self) -> list[WrittenFile]:
        """Wait for every file's hash and seal; every planned shard of the set, kept or written."""
        missing = [p.file for p in self.plans if p.file not in self._open and p.file not in self.kept]
        short = [f"{sh.plan.file} ({sh.frontier} of {sh.size} bytes)" for sh in self._open.values()
                 if sh.frontier != sh.size]
        if missing or short:
            raise AtomConvertError(f"internal: shards left incomplete: {missing + short}")
        for sh in self._open.values():
            assert sh.thread is not None
            while sh.thread.is_alive():  # in steps: Ctrl-C still reaches the main thread
                sh.thread.join(0.2)
        errors = [sh.error for sh in self._open.values() if sh.error is not None]
        if errors:
            raise errors[0]
        files = []
        for p in self.plans:
            if p.file in self.kept:
                k = self.kept[p.file]
                files.append(WrittenFile(p.file, k.nbytes, k.digest))
                continue
            sh = self._open[p.file]
            if sh.sealed is None or sh.hashed != sh.size or sh.nbytes != sh.size:
                raise AtomConvertError(f"internal: {p.file}: {sh.nbytes} bytes written, {sh.hashed} hashed, "
                                       f"{sh.size} planned, sealed: {sh.sealed is not None}")
            size = sh.final.stat().st_size
            if size != sh.size:
                raise AtomConvertError(f"internal: {p.file} has {size} bytes on disk, {sh.size} planned")
            files.append(WrittenFile(p.file, sh.size, sh.sealed.digest))
        return files

    def abort(self, timeout: float = 10.0) -> None:
        """Stop the hashing threads (bounded wait), close every file and remove the unsealed ones."""
        self.stop.set()
        for sh in list(self._open.values()):
            with sh.cond:
                sh.aborted = True
                sh.cond.notify_all()
        for sh in list(self._open.values()):
            if sh.thread is not None:
                sh.thread.join(timeout)
            sh.close_fd()
            sh.discard()


class _ReportingShard(_ShardIO):
    """A shard file as a worker process writes it: its own descriptor (the converting process
    created the file), and each buffer written is reported, with the leaves of its whole blocks."""

    def __init__(self, root: Path, rel: str, plan: ShardPlan, offsets: dict[str, int], fault: FaultHook | None,
                 report: Callable[[str, int, int, tuple[int, bytes] | None], None], direct: bool = True):
        super().__init__(root, rel, plan, offsets, fault, os.O_WRONLY, direct)
        self._report = report

    def done(self, start: int, n: int, leaves: tuple[int, bytes] | None = None) -> None:
        self._report(self.plan.file, start, n, leaves)

    def close_fd(self) -> None:
        self.close_direct()
        os.close(self.fd)


class ProcessShardWriter(ShardSetWriter):
    """The writer inside a worker process (procs.py): the same `write` (planned offsets, unit
    ranges, write-behind thread), through this process's own descriptors; `report(file, start, n,
    leaves)` tells the converting process what was written and the leaves of its whole blocks,
    whose `written_elsewhere` feeds the shard's hashing thread and the progress bar. It never creates, seals or removes a file."""

    def __init__(self, root: Path, subdir: str, shards: list[list[ShardPlan]], outputs: list[OutTensor],
                 kept: dict[str, Sealed] | None, stop: Any, fault: FaultHook | None,
                 report: Callable[[str, int, int, tuple[int, bytes] | None], None], direct: bool = True):
        super().__init__(root, subdir, shards, outputs, None, kept, stop=stop, fault=fault,  # type: ignore[arg-type]
                         direct=direct)
        self._report = report

    def _shard(self, plan: ShardPlan) -> Any:
        with self._lock:
            sh = self._open.get(plan.file)
            if sh is None:
                _, offsets, _ = shard_layout(plan, self.by_name)
                sh = _ReportingShard(self.root, self.prefix + plan.file, plan, offsets, self.fault, self._report,
                                     self.direct)
                self._open[plan.file] = sh  # type: ignore[assignment]
        return sh

    def close(self) -> list[WrittenFile]:
        with self._lock:
            for sh in self._open.values():
                sh.close_fd()
            self._open.clear()
        return []

    def abort(self, timeout: float = 10.0) -> None:
        self.close()  # the converting process decides about the files
