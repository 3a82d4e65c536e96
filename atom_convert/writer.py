"""Streaming safetensors writer.

The safetensors library writes a file from a dict of complete tensors; a
stacked expert tensor of one DeepSeek-V3 layer is 7.5 GB, so that would hold
a whole layer in memory. Here each shard's header is written up front from the
plan (names, dtypes, shapes are known before any data is read) and tensor
bytes are then appended as the producers yield them, one expert at a time.
Two background threads do the writes and the sha256, overlapping with each
other and with the producers' reads and shuffles (file.write and hashlib
release the GIL).
The files are plain safetensors: `safe_open` reads them.

Crash safety: each shard is a `ShardFile`, written under `<name>.partial` and sealed once
its last byte is written and hashed: fsynced, renamed to its final name, the directory
fsynced, and its size and sha256 appended to the staging journal (staging.py). A killed
run leaves only sealed shards (kept by a resume) and `.partial` files (removed by it).
`abort()` never waits long: the IO threads drop their queued work and are joined with a
timeout, so Ctrl-C cannot hang on a stuck write.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from .errors import AtomConvertError
from .plan import OutTensor, ShardPlan
from .quant.formats import ST_DTYPE
from .staging import PARTIAL_SUFFIX, Journal, Sealed, fsync_dir

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


def shard_header(plan: ShardPlan, outputs: dict[str, OutTensor]) -> bytes:
    """The exact first bytes of a planned shard; their sha256 identifies the shard's plan in the journal."""
    return safetensors_header([(n, outputs[n].dtype, outputs[n].shape, outputs[n].nbytes) for n in plan.names],
                              metadata={"format": "pt"})


def header_digest(plan: ShardPlan, outputs: dict[str, OutTensor]) -> str:
    return hashlib.sha256(shard_header(plan, outputs)).hexdigest()


class FaultHook:
    """Test-only: ATOM_CONVERT_TEST_SIGNAL_AT_BYTE="N:SIGNAME" makes the process send itself
    SIGNAME once N shard bytes have been written (the tests kill a conversion at chosen points
    with it; the writer otherwise never reads it). The buffer crossing N is written up to
    byte N first, so a kill leaves a shard cut at exactly that point."""

    ENV = "ATOM_CONVERT_TEST_SIGNAL_AT_BYTE"

    def __init__(self, at: int, signum: int):
        self.at, self.signum, self.done = at, signum, 0

    @classmethod
    def from_env(cls) -> "FaultHook | None":
        spec = os.environ.get(cls.ENV)
        if not spec:
            return None
        at, name = spec.split(":")
        return cls(int(at), int(getattr(signal, name)))

    def write(self, fh: Any, buf: Any) -> None:
        n = len(buf)
        if self.done < self.at <= self.done + n:
            cut = self.at - self.done
            fh.write(buf[:cut])
            fh.flush()
            os.kill(os.getpid(), self.signum)
            fh.write(buf[cut:])
        else:
            fh.write(buf)
        self.done += n


class _IOThread:
    """Runs functions (writes, hashes) in order, off the producer's thread."""

    def __init__(self, depth: int = 4):
        self._q: queue.Queue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._aborted = threading.Event()
        self._t = threading.Thread(target=self._run, name="atom-convert-writer", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                if self._error is None and not self._aborted.is_set():
                    fn, args = item
                    try:
                        fn(*args)
                    except BaseException as e:  # noqa: BLE001  re-raised on the main thread
                        self._error = e
                    del fn, args
                del item  # do not keep the last buffer (and the file pages it views) alive
            finally:
                self._q.task_done()

    # The main thread waits on this thread in short steps: a process-directed signal (Ctrl-C,
    # SIGTERM) may be delivered to any thread, and only a wait that returns now and then lets
    # the main thread run its handler when this thread is stuck (a dead network filesystem).
    _POLL_S = 0.2

    def drain(self) -> None:
        """Block until every submitted function has run."""
        with self._q.all_tasks_done:
            while self._q.unfinished_tasks:
                self._q.all_tasks_done.wait(self._POLL_S)
        if self._error is not None:
            raise self._error

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        while True:
            if self._error is not None:
                raise self._error
            try:
                self._q.put((fn, args), timeout=self._POLL_S)
                return
            except queue.Full:
                continue

    def close(self) -> None:
        while True:
            try:
                self._q.put(None, timeout=self._POLL_S)
                break
            except queue.Full:
                continue
        while self._t.is_alive():  # join in steps: a signal still reaches the main thread
            self._t.join(0.5)
        if self._error is not None:
            raise self._error

    def abort(self, timeout: float = 10.0) -> None:
        """Stop soon: queued functions are dropped; the running one (a single write) may finish.
        Waits at most `timeout` s; the thread is a daemon, so a write stuck for ever (a dead
        network filesystem) cannot keep the process alive either."""
        self._aborted.set()
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
            self._q.task_done()
        try:
            self._q.put_nowait(None)
        except queue.Full:  # the thread is the only consumer; with the queue emptied this cannot happen
            pass
        self._t.join(timeout)


@dataclass
class WrittenFile:
    name: str
    nbytes: int
    sha256: str


class ShardFile:
    """One shard from its first byte to its seal, the unit a parallel writer can run many of.

    Bytes are written under `<final>.partial` by one thread (`write`, then `writes_done`) and
    hashed by another (`hash`, then `hashes_done`), each in order; whichever of the two
    finishes last seals the shard: checks the sizes, renames it to its final name, fsyncs the
    directory and records it in the journal. `discard` removes an unsealed shard.
    """

    def __init__(self, root: Path, rel: str, plan: ShardPlan, header: bytes, expected_bytes: int,
                 journal: Journal, fault: FaultHook | None = None):
        self.rel = rel
        self.plan = plan
        self.final = root / rel
        self.tmp = self.final.with_name(self.final.name + PARTIAL_SUFFIX)
        self.header = header
        self.expected_bytes = expected_bytes  # header + tensors
        self.journal = journal
        self.fault = fault
        self.sha = hashlib.sha256()
        self.nbytes = 0  # written (IO thread)
        self.hashed = 0  # hashed (hash thread)
        self.sealed: Sealed | None = None
        self.pos = 0  # index in plan.names of the tensor being produced (main thread)
        self._parts_done = 0
        self._lock = threading.Lock()
        self.fh = self._io(open, self.tmp, "wb")

    def _io(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run an OS call, naming this shard in the error (fh.write and fsync raise without a path)."""
        try:
            return fn(*args)
        except OSError as e:
            if e.filename is None:
                raise OSError(e.errno, e.strerror, str(self.tmp)) from e
            raise

    def write(self, buf: Any) -> None:
        if self.fault is not None:
            self._io(self.fault.write, self.fh, buf)
        else:
            self._io(self.fh.write, buf)
        self.nbytes += len(buf)

    def hash(self, buf: Any) -> None:
        self.sha.update(buf)
        self.hashed += len(buf)

    def writes_done(self) -> None:
        self._io(self.fh.flush)
        self._io(os.fsync, self.fh.fileno())
        self._io(self.fh.close)
        self._part_done()

    def hashes_done(self) -> None:
        self._part_done()

    def _part_done(self) -> None:
        with self._lock:
            self._parts_done += 1
            if self._parts_done < 2:
                return
        self._seal()

    def _seal(self) -> None:
        if not (self.nbytes == self.hashed == self.expected_bytes):
            raise AtomConvertError(f"internal: {self.rel}: {self.nbytes} bytes written, {self.hashed} hashed, "
                                   f"{self.expected_bytes} planned")
        self._io(os.rename, self.tmp, self.final)
        self._io(fsync_dir, self.final.parent)
        s = Sealed(self.rel, self.nbytes, self.sha.hexdigest(), hashlib.sha256(self.header).hexdigest())
        self._io(self.journal.record, s)
        self.sealed = s

    def discard(self) -> None:
        if not self.fh.closed:
            try:
                self.fh.close()
            except OSError:
                pass
        try:
            self.tmp.unlink()
        except FileNotFoundError:
            pass


class ShardSetWriter:
    """Writes the shards of every rank of one converted set (main model or MTP) into `root/subdir`,
    skipping the shards in `kept` (sealed by an earlier, interrupted run)."""

    def __init__(self, root: Path, subdir: str, shards: list[list[ShardPlan]], outputs: list[OutTensor],
                 journal: Journal, kept: dict[str, Sealed] | None = None,
                 on_bytes: Callable[[int], None] | None = None, fault: FaultHook | None = None):
        self.root = root
        self.prefix = f"{subdir}/" if subdir else ""
        self.dir = root / subdir if subdir else root
        self.dir.mkdir(parents=True, exist_ok=True)
        self.journal = journal
        self.fault = fault
        kept = kept or {}
        self.by_name = {o.name: o for o in outputs}
        self.kept = {p.file: kept[self.prefix + p.file] for r in shards for p in r if self.prefix + p.file in kept}
        self.queue: dict[int, list[ShardPlan]] = {r: [p for p in s if p.file not in self.kept]
                                                  for r, s in enumerate(shards)}
        self.current: dict[int, ShardFile | None] = {r: None for r in self.queue}
        self.open_files: list[ShardFile] = []
        self.tensor_file: dict[tuple[int, str], str] = {(r, n): p.file for r, s in enumerate(shards)
                                                        for p in s for n in p.names}
        self._sealed_names = {(r, n) for r, s in enumerate(shards) for p in s if p.file in self.kept
                              for n in p.names}
        self.on_bytes = on_bytes or (lambda n: None)
        self.io = _IOThread()
        self.hasher = _IOThread()

    def is_sealed(self, rank: int, name: str) -> bool:
        """True when the shard holding `name` for `rank` was kept from an earlier run: skip producing it."""
        return (rank, name) in self._sealed_names

    @property
    def kept_bytes(self) -> int:
        return sum(s.nbytes for s in self.kept.values())

    # The functions below run on the IO threads, in submission order: writes on one, sha256 on
    # another (each runs at about the disk's speed; in sequence they were the bottleneck).
    @staticmethod
    def _write(sh: ShardFile, buf: Any) -> None:
        sh.write(buf)

    @staticmethod
    def _hash(sh: ShardFile, buf: Any) -> None:
        sh.hash(buf)

    def _submit(self, sh: ShardFile, buf: Any) -> None:
        self.io.submit(self._write, sh, buf)
        self.hasher.submit(self._hash, sh, buf)

    def _shard_for(self, rank: int, name: str) -> ShardFile:
        sh = self.current[rank]
        if sh is None:
            plan = self.queue[rank].pop(0)
            head = shard_header(plan, self.by_name)
            sh = ShardFile(self.root, self.prefix + plan.file, plan, head, len(head) + plan.nbytes, self.journal,
                           self.fault)
            self.open_files.append(sh)
            self._submit(sh, head)
            self.current[rank] = sh
        want = sh.plan.names[sh.pos]
        if want != name:
            raise AtomConvertError(f"internal: writer expected {want} next in {sh.plan.file}, got {name}")
        return sh

    def write(self, rank: int, out: OutTensor, chunks: Iterable[torch.Tensor]) -> None:
        sh = self._shard_for(rank, out.name)
        total = 0
        for c in chunks:
            if c.dtype != out.dtype:
                raise AtomConvertError(f"internal: {out.name} produced {c.dtype}, planned {out.dtype}")
            buf = _as_bytes(c)
            total += len(buf)
            if total > out.nbytes:
                break
            self._submit(sh, buf)
            self.on_bytes(len(buf))
        if total != out.nbytes:
            raise AtomConvertError(
                f"internal: {out.name} produced {total} bytes, planned {out.nbytes} ({out.dtype}, {list(out.shape)})"
            )
        sh.pos += 1
        if sh.pos == len(sh.plan.names):
            self.io.submit(ShardFile.writes_done, sh)
            self.hasher.submit(ShardFile.hashes_done, sh)  # after this file's last hash update
            self.current[rank] = None

    def drain(self) -> None:
        self.io.drain()
        self.hasher.drain()

    def close(self) -> list[WrittenFile]:
        """Wait for the last seals; every planned shard of the set, kept or written, as a WrittenFile."""
        self.io.close()
        self.hasher.close()
        left = [p.file for ps in self.queue.values() for p in ps] + [s.plan.file for s in self.current.values() if s]
        unsealed = [sh.rel for sh in self.open_files if sh.sealed is None]
        if left or unsealed:
            raise AtomConvertError(f"internal: shards left incomplete: {left + unsealed}")
        files = [WrittenFile(f, s.nbytes, s.sha256) for f, s in self.kept.items()]
        files += [WrittenFile(sh.plan.file, sh.sealed.nbytes, sh.sealed.sha256)
                  for sh in self.open_files if sh.sealed is not None]
        return files

    def abort(self) -> None:
        """Stop the IO threads (bounded wait) and remove the shards not sealed."""
        for t in (self.io, self.hasher):
            t.abort()
        for sh in self.open_files:
            if sh.sealed is None:
                sh.discard()
