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


class _IOThread:
    """Writes and hashes buffers in order, off the producer's thread."""

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


class _OpenShard:
    def __init__(self, path: Path, plan: ShardPlan, outputs: dict[str, OutTensor]):
        self.path = path
        self.plan = plan
        self.expected = [(n, outputs[n].nbytes) for n in plan.names]
        self.pos = 0  # index into expected of the tensor being written
        self.fh = open(path, "wb")
        self.sha = hashlib.sha256()
        self.nbytes = 0  # written (IO thread)
        self.hashed = 0  # hashed (hash thread)


class ShardSetWriter:
    """Writes the shards of every rank of one converted set (main model or MTP)."""

    def __init__(self, directory: Path, shards: list[list[ShardPlan]], outputs: list[OutTensor],
                 on_bytes: Callable[[int], None] | None = None):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.by_name = {o.name: o for o in outputs}
        self.queue: dict[int, list[ShardPlan]] = {r: list(s) for r, s in enumerate(shards)}
        self.current: dict[int, _OpenShard | None] = {r: None for r in self.queue}
        self.written: list[WrittenFile] = []
        self.tensor_file: dict[tuple[int, str], str] = {}
        self.on_bytes = on_bytes or (lambda n: None)
        self.io = _IOThread()
        self.hasher = _IOThread()

    # The functions below run on the IO threads, in submission order: writes on one, sha256 on
    # another (each runs at about the disk's speed; in sequence they were the bottleneck).
    @staticmethod
    def _write(sh: _OpenShard, buf: Any) -> None:
        sh.fh.write(buf)
        sh.nbytes += len(buf)

    @staticmethod
    def _hash(sh: _OpenShard, buf: Any) -> None:
        sh.sha.update(buf)
        sh.hashed += len(buf)

    def _finish(self, sh: _OpenShard) -> None:
        sh.fh.flush()
        os.fsync(sh.fh.fileno())
        sh.fh.close()

    def _record(self, sh: _OpenShard) -> None:
        self.written.append(WrittenFile(sh.path.relative_to(self.dir).as_posix(), sh.hashed, sh.sha.hexdigest()))

    def _submit(self, sh: _OpenShard, buf: Any) -> None:
        self.io.submit(self._write, sh, buf)
        self.hasher.submit(self._hash, sh, buf)

    def _shard_for(self, rank: int, name: str) -> _OpenShard:
        sh = self.current[rank]
        if sh is None:
            plan = self.queue[rank].pop(0)
            sh = _OpenShard(self.dir / plan.file, plan, self.by_name)
            head = safetensors_header(
                [(n, self.by_name[n].dtype, self.by_name[n].shape, self.by_name[n].nbytes) for n in plan.names],
                metadata={"format": "pt"},
            )
            self._submit(sh, head)
            self.current[rank] = sh
        want = sh.expected[sh.pos][0]
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
        self.tensor_file[(rank, out.name)] = sh.plan.file
        sh.pos += 1
        if sh.pos == len(sh.expected):
            self.io.submit(self._finish, sh)
            self.hasher.submit(self._record, sh)  # after this file's last hash update
            self.current[rank] = None

    def drain(self) -> None:
        self.io.drain()
        self.hasher.drain()

    def close(self) -> list[WrittenFile]:
        self.io.close()
        self.hasher.close()
        for f in self.written:  # both threads saw the same buffers; the file must hold them all
            size = (self.dir / f.name).stat().st_size
            if size != f.nbytes:
                raise AtomConvertError(f"internal: {f.name} has {size} bytes on disk, {f.nbytes} were written")
        left = [p.file for ps in self.queue.values() for p in ps] + [s.plan.file for s in self.current.values() if s]
        if left:
            raise AtomConvertError(f"internal: shards left incomplete: {left}")
        return self.written

    def abort(self) -> None:
        for t in (self.io, self.hasher):
            try:
                t.close()
            except BaseException:  # noqa: BLE001  the original error matters, not this one
                pass
        for sh in self.current.values():
            if sh is not None and not sh.fh.closed:
                sh.fh.close()
