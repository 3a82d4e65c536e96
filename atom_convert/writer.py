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
   to offset 0, and a hashing thread for that file starts.
2. Each worker hands its buffers to its own write-behind thread (`_IOThread`),
   which `pwrite`s them at their offsets and marks the byte range done.
3. A shard's hashing thread follows the contiguous done prefix of its file and
   feeds sha256 by reading the bytes back with `preadv` (they are in the page
   cache: just written). Hashing never waits for the order of production, and
   the files hash in parallel (file writes, reads and hashlib release the GIL).
   When the prefix reaches the end, the thread fsyncs and closes the file.
The files are plain safetensors: `safe_open` reads them.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from .errors import AtomConvertError
from .plan import OutTensor, ShardPlan
from .quant.formats import ST_DTYPE

_ALIGN = 8  # header padded so that tensor data starts 8-byte aligned (as safetensors does)


def safetensors_header(entries: list[tuple[str, torch.dtype, tuple[int, ...], int]],
                       metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length plus the JSON header for tensors laid out back to back in order."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    off = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def _as_bytes(t: torch.Tensor) -> Any:
    """A zero-copy byte view (numpy) of a contiguous tensor of any dtype."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


class Cancelled(Exception):
    """Raised in a worker when another worker failed: stop at the next buffer."""


class _IOThread:
    """Runs a worker's writes in order, off its producing thread (write-behind: the producer
    prepares the next expert while the previous one is copied into the page cache)."""

    def __init__(self, depth: int = 4):
        self._q: queue.Queue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._t = threading.Thread(target=self._run, name="atom-convert-writer", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    fn, args = item
                    try:
                        fn(*args)
                    except BaseException as e:  # noqa: BLE001  re-raised on the main thread
                        self._error = e
                    del fn, args
                del item  # do not keep the last buffer (and the file pages it views) alive
            finally:
                self._q.task_done()

    def drain(self) -> None:
        """Block until every submitted write is done."""
        self._q.join()
        if self._error is not None:
            raise self._error

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        if self._error is not None:
            raise self._error
        self._q.put((fn, args))

    def close(self) -> None:
        self._q.put(None)
        self._t.join()
        if self._error is not None:
            raise self._error


@dataclass
class WrittenFile:
    name: str
    nbytes: int
    sha256: str


@dataclass
class _Piece:
    """Bytes to write at an absolute file offset."""

    offset: int
    data: Any  # a buffer (numpy byte view or bytes)


_HASH_READ = 8 << 20  # read-back block of the hashing threads


class _OpenShard:
    """One shard file being written: its fd, the done byte ranges, and its hashing thread."""

    def __init__(self, path: Path, plan: ShardPlan, header: bytes, offsets: dict[str, int], size: int):
        self.path = path
        self.plan = plan
        self.header = header
        self.offsets = offsets  # tensor name -> absolute offset of its bytes
        self.size = size  # header + data
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.cond = threading.Condition()
        self.ends: dict[int, int] = {}  # done ranges not yet joined to the prefix: start -> end
        self.frontier = 0  # bytes [0, frontier) are written
        self.nbytes = 0  # bytes written (any order)
        self.hashed = 0
        self.sha = hashlib.sha256()
        self.aborted = False
        self.error: BaseException | None = None
        self.closed = False
        self.written: set[str] = set()  # tensors whose bytes were all handed over
        self.thread: threading.Thread | None = None

    def done(self, start: int, n: int) -> None:
        """Bytes [start, start + n) are in the file (called after pwrite returned)."""
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
        """The hashing thread: sha256 of the written prefix as it grows; fsync and close at the end."""
        try:
            buf = bytearray(min(_HASH_READ, max(self.size, 1)))
            view = memoryview(buf)
            while self.hashed < self.size:
                with self.cond:
                    while self.frontier <= self.hashed and not self.aborted:
                        self.cond.wait()
                    if self.aborted:
                        return
                    ready = self.frontier
                while self.hashed < ready:
                    n = os.preadv(self.fd, [view[:min(len(buf), ready - self.hashed)]], self.hashed)
                    if n <= 0:
                        raise AtomConvertError(f"internal: {self.path.name}: read back {n} bytes at {self.hashed}")
                    self.sha.update(view[:n])
                    self.hashed += n
            os.fsync(self.fd)
        except BaseException as e:  # noqa: BLE001  reported by close()
            self.error = e
        finally:
            self.close_fd()

    def close_fd(self) -> None:
        with self.cond:
            if not self.closed:
                self.closed = True
                os.close(self.fd)


class ShardSetWriter:
    """Writes the shards of every rank of one converted set (main model or MTP).

    Thread-safe: workers call `write` for any (rank, tensor) in any order; each tensor's
    bytes land at the offset the plan gives it.
    """

    def __init__(self, directory: Path, shards: list[list[ShardPlan]], outputs: list[OutTensor],
                 on_bytes: Callable[[int], None] | None = None, stop: threading.Event | None = None):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.by_name = {o.name: o for o in outputs}
        self.plans = [p for ps in shards for p in ps]
        # slot: a rank, or the caller's extra slot for files every rank shares
        self.place: dict[tuple[int, str], ShardPlan] = {(slot, n): p for slot, ps in enumerate(shards)
                                                        for p in ps for n in p.names}
        self.written: list[WrittenFile] = []
        self.tensor_file: dict[tuple[int, str], str] = {}
        self._on_bytes = on_bytes or (lambda n: None)
        self.stop = stop or threading.Event()
        self._lock = threading.Lock()
        self._open: dict[str, _OpenShard] = {}
        self._local = threading.local()

    # Runs on the workers' write-behind threads. One buffer per call, written at its offset.
    @staticmethod
    def _write(sh: _OpenShard, piece: _Piece) -> None:
        mv = memoryview(piece.data).cast("B")
        off, left = piece.offset, mv
        while len(left):
            n = os.pwrite(sh.fd, left, off)
            off += n
            left = left[n:]
        sh.done(piece.offset, len(mv))

    def _progress(self, n: int) -> None:
        with self._lock:
            self._on_bytes(n)

    def _write_and_count(self, sh: _OpenShard, piece: _Piece) -> None:
        if self.stop.is_set():
            raise Cancelled()
        n = len(memoryview(piece.data).cast("B"))
        self._write(sh, piece)
        self._progress(n)

    def _shard(self, plan: ShardPlan) -> _OpenShard:
        with self._lock:
            sh = self._open.get(plan.file)
            if sh is None:
                outs = [self.by_name[n] for n in plan.names]
                header = safetensors_header([(o.name, o.dtype, o.shape, o.nbytes) for o in outs], metadata={"format": "pt"})
                offsets, off = {}, len(header)
                for o in outs:
                    offsets[o.name] = off
                    off += o.nbytes
                sh = _OpenShard(self.dir / plan.file, plan, header, offsets, off)
                self._open[plan.file] = sh
                sh.thread = threading.Thread(target=sh.hash_and_seal, name=f"atom-convert-hash-{plan.file}", daemon=True)
                sh.thread.start()
                self._write(sh, _Piece(0, header))
        return sh

    def use_io(self, io: "_IOThread | None") -> None:
        """Route the calling thread's writes through `io` (its write-behind thread); None: inline."""
        self._local.io = io

    def write(self, rank: int, out: OutTensor, chunks: Iterable[torch.Tensor]) -> None:
        """Write one rank's (slot's) tensor from its producer's chunks at the tensor's planned offset,
        through the calling worker's write-behind thread (`use_io`)."""
        io: _IOThread | None = getattr(self._local, "io", None)
        if self.stop.is_set():
            raise Cancelled()
        plan = self.place.get((rank, out.name))
        if plan is None:
            raise AtomConvertError(f"internal: {out.name} (rank {rank}) is in no planned shard")
        sh = self._shard(plan)
        with self._lock:
            if out.name in sh.written:
                raise AtomConvertError(f"internal: {out.name} (rank {rank}) written twice")
            sh.written.add(out.name)
        base, total = sh.offsets[out.name], 0
        for c in chunks:
            if self.stop.is_set():
                raise Cancelled()
            if c.dtype != out.dtype:
                raise AtomConvertError(f"internal: {out.name} produced {c.dtype}, planned {out.dtype}")
            buf = _as_bytes(c)
            if total + len(buf) > out.nbytes:
                total += len(buf)
                break
            piece = _Piece(base + total, buf)
            total += len(buf)
            if io is None:
                self._write_and_count(sh, piece)
            else:
                io.submit(self._write_and_count, sh, piece)
            del buf, piece, c  # hold no chunk while the producer makes the next one
        if total != out.nbytes:
            raise AtomConvertError(
                f"internal: {out.name} produced {total} bytes, planned {out.nbytes} ({out.dtype}, {list(out.shape)})"
            )
        with self._lock:
            self.tensor_file[(rank, out.name)] = plan.file

    def close(self) -> list[WrittenFile]:
        """Wait for every file's hash and fsync; check that every planned byte was written."""
        missing = [p.file for p in self.plans if p.file not in self._open]
        short = [f"{sh.plan.file} ({sh.frontier} of {sh.size} bytes)" for sh in self._open.values()
                 if sh.frontier != sh.size]
        if missing or short:
            self.abort()
            raise AtomConvertError(f"internal: shards left incomplete: {missing + short}")
        for sh in self._open.values():
            assert sh.thread is not None
            sh.thread.join()
        errors = [sh.error for sh in self._open.values() if sh.error is not None]
        if errors:
            raise errors[0]
        for p in self.plans:
            sh = self._open[p.file]
            size = sh.path.stat().st_size
            if size != sh.size or sh.hashed != sh.size or sh.nbytes != sh.size:
                raise AtomConvertError(f"internal: {p.file} has {size} bytes on disk, {sh.nbytes} were written, "
                                       f"{sh.hashed} hashed, {sh.size} planned")
            self.written.append(WrittenFile(p.file, sh.size, sh.sha.hexdigest()))
        return self.written

    def abort(self) -> None:
        """Stop the hashing threads and close every file (the caller removes the directory)."""
        self.stop.set()
        for sh in list(self._open.values()):
            with sh.cond:
                sh.aborted = True
                sh.cond.notify_all()
        for sh in list(self._open.values()):
            if sh.thread is not None:
                sh.thread.join()
            sh.close_fd()
