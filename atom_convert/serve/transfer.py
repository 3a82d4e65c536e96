"""Moving safetensors bytes into tensors: a no-copy CPU mapping and a pinned, multi-stream GPU path.

How it works (GPU, `place_cuda`):
1. Every destination tensor exists before the first byte is read: the caller's (an existing
   Parameter on the device) or a fresh `torch.empty` on the device.
2. Each file's data region is cut into chunks of `chunk_bytes`; the chunks of all files form one
   queue, in file order, so that the disk sees a few large sequential streams.
3. `threads` workers each own two pinned host buffers (pinned on first use, or ahead of the load
   by `prepare_pool`, which the runtime hooks start while the server builds its model) and one CUDA
   stream. A worker takes the next chunk, waits until the copy that last used that buffer has
   finished (an event), reads the chunk into the buffer (the GIL is released during the read), then
   enqueues on its stream one host-to-device copy per destination tensor the chunk overlaps. Reads of
   one chunk overlap the copies of the previous one, and the workers' copies overlap each other.
   The copies and events are torch's (`Tensor.copy_`), or with ATOM_CONVERT_LOAD_SUBMIT=runtime the
   runtime library's own calls through ctypes (serve/runtime_calls.py): about three times the rate
   for 2-8 MB copies, the same for 32 MB ones, and no faster whole on the H100 machine, where the
   reads set the pace (BENCHMARKS.md, eighteenth round).
   A chunk the page cache holds (mincore, asked by the thread about to read it) is `preadv`ed from
   it; any other is read with O_DIRECT straight into the pinned buffer, so a cold byte is not also
   copied through the cache (ATOM_CONVERT_LOAD_DIRECT=0: never).
4. Bytes are copied as bytes: the destination is viewed as uint8, so fp8, e8m0 and fp4 are never
   converted (atom-loading.md §10 item 5).
Readers, chosen by bench/bench_load.py and bench/load_paths.py on the H200 device machine
(BENCHMARKS.md, warm, 2 GB): `preadv` into pinned buffers on 16 threads 29-34 GB/s (the default),
memcpy from a mapping 25 GB/s, `cudaHostRegister` of the mapping 10-12 GB/s in ranges of 64 MB to
1 GB on 2-16 threads (the driver serialises registration: about 20 GB/s of it at most, and it slows
the other threads' copies when mixed with them); cold, all within the disk's rate.

CPU (`place_cpu`): each file is mapped once copy-on-write (`mmap.ACCESS_COPY`) and every tensor is a
view of the mapping, so no byte is copied until something writes to it; a tensor whose file offset is
not 16-byte aligned is copied into its own allocation (`CPU_VIEW_ALIGN`).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..files import libc, safetensors as safetensors_file
from ..errors import BadInputError, ConvertedCheckError
from ..inflight import InFlight, join_in_steps
from . import runtime_calls

log = logging.getLogger(__name__)

DEFAULT_THREADS = 16  # bench_load on the H200 machine: 31 GB/s warm at 16, 25 at 8 (BENCHMARKS.md)
PAGE = 4096
# How a chunk reaches page-locked memory: "pread" into pinned buffers (os.preadv), "mmap" (memcpy
# from a read-only mapping into pinned buffers), "register" (cudaHostRegister of the mapping's chunk,
# then DMA straight from the page cache). Chosen by bench/bench_load.py (BENCHMARKS.md).
READERS = ("pread", "mmap", "register")
DEFAULT_READER = "pread"
HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the mapping is PROT_READ
HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable: page-locked for every context of the process
# A CPU tensor is a view of the mapping only when its file offset is a multiple of this: consumers
# reinterpret rows as 16-byte units (shuffle16, SIMD loads), which a misaligned view refuses. The
# writer packs tensors back to back (safetensors allows no gaps), so some tensors are copied.
CPU_VIEW_ALIGN = 16
DEFAULT_CHUNK_BYTES = 32 << 20
# Pinned buffers per copy thread: a thread reads into one while the copies out of the others run.
DEFAULT_DEPTH = 2
# How a copy thread enqueues its chunk's copies and events: "torch" (Tensor.copy_, torch events) or
# "runtime" (the runtime library's own calls through ctypes, serve/runtime_calls.py; torch's where
# that library cannot be found).
SUBMITTERS = ("torch", "runtime")
DEFAULT_SUBMIT = "torch"
# ATOM_CONVERT_LOAD_RAMP=1: chunks grow from RAMP_MIN_BYTES at the load's start to the chunk size and
# shrink again towards its end (`_ramp_size`). Off by default: in the one sitting that compared them
# (H200, before residency was asked per chunk) it loaded no faster (BENCHMARKS.md, twenty-fifth round).
RAMP = os.environ.get("ATOM_CONVERT_LOAD_RAMP", "0") == "1"
RAMP_MIN_BYTES = 4 << 20
# The pread reader reads what the page cache lacks with O_DIRECT (ATOM_CONVERT_LOAD_DIRECT=0: never).
DIRECT_READS = os.environ.get("ATOM_CONVERT_LOAD_DIRECT", "1") != "0"
# After Ctrl-C, how long the caller waits for the copy threads to finish their chunk in hand
# before it gives up on closing the files (a chunk is one read of DEFAULT_CHUNK_BYTES).
STOP_JOIN_S = 30.0


@dataclass(frozen=True)
class Header:
    path: Path
    data_start: int
    file_size: int
    entries: dict[str, tuple[str, tuple[int, ...], int, int]]  # name -> (st dtype, shape, begin, end)


_FIX_CONVERTED = "The converted directory is incomplete or damaged: convert again."


def _converted_error(problems: list[str], fix: str) -> BadInputError:
    return ConvertedCheckError("\n".join(problems) + f"\n{fix}")


def read_header(path: Path) -> Header:
    """A converted safetensors file's header: where each tensor's bytes lie (reads the header only,
    validated as every safetensors header is: safetensors_file.read_header). ConvertedCheckError
    (a BadInputError) naming the file and the tensor for a missing or malformed file."""
    h = safetensors_file.read_header(path, name=str(path), fix=_FIX_CONVERTED, error=_converted_error)
    entries = {k: (v["dtype"], tuple(v["shape"]), v["data_offsets"][0], v["data_offsets"][1])
               for k, v in h.tensors.items()}
    return Header(path=path, data_start=h.data_start, file_size=h.size, entries=entries)


@dataclass
class TensorSlot:
    """One destination: the runtime dtype and shape, and optionally an existing tensor to fill."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    given: torch.Tensor | None = None
    tensor: torch.Tensor | None = field(default=None, repr=False)
    file_dtype: str | None = None  # the safetensors dtype the manifest says the file stores (None: not compared)
    manifest: str = "the manifest"  # where the expected dtype and shape come from, for messages

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclass
class FileRead:
    path: Path
    header: Header
    slots: list[TensorSlot]

    def located(self) -> list[tuple[TensorSlot, int]]:
        """(slot, absolute file offset), checked against the header (dtype, shape, bytes), in file
        order; ConvertedCheckError naming the file, the tensor, the header's and the manifest's."""
        problems = []
        out = []
        for s in self.slots:
            e = self.header.entries.get(s.name)
            if e is None:
                problems.append(f"{self.path}: tensor {s.name} is not in the file ({s.manifest} names it)")
                continue
            st, shape, b, end = e
            if end - b != s.nbytes or shape != s.shape or (s.file_dtype is not None and st != s.file_dtype):
                said = f"{s.file_dtype} = {s.dtype}" if s.file_dtype is not None and s.file_dtype != st else f"{s.dtype}"
                problems.append(f"{self.path}: tensor {s.name}: the file's header says {st} {list(shape)} ({end - b} "
                                f"bytes), {s.manifest} says {said} {list(s.shape)} ({s.nbytes} bytes)")
                continue
            if self.header.data_start + end > self.header.file_size:
                problems.append(f"{self.path}: tensor {s.name} ends at byte {self.header.data_start + end}, the file has "
                                f"{self.header.file_size}; the file is truncated")
                continue
            out.append((s, self.header.data_start + b))
        if problems:
            raise _converted_error(problems, _FIX_CONVERTED)
        return sorted(out, key=lambda x: x[1])


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (0-dim included)."""
    return t.reshape(-1).view(torch.uint8)


def place_cpu(reads: list[FileRead]) -> int:
    """Map each file copy-on-write; every slot becomes a view of its bytes (or a copy if misaligned).
    Returns the bytes copied."""
    copied = 0
    for fr in reads:
        located = fr.located()
        if not located:
            continue
        with open(fr.path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        buf = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive as long as any view lives
        for s, off in located:
            raw = buf[off:off + s.nbytes]
            if s.given is not None:
                _as_bytes(s.given).copy_(raw)
                s.tensor = s.given
                copied += s.nbytes
            elif off % CPU_VIEW_ALIGN == 0:
                s.tensor = raw.view(s.dtype).view(s.shape)
            else:
                s.tensor = raw.clone().view(s.dtype).view(s.shape)
                copied += s.nbytes
    return copied


_pool_lock = threading.Lock()
_pools: dict[int, dict[int, torch.Tensor]] = {}  # chunk bytes -> buffer index -> pinned buffer
# How the pool's buffers are page-locked: "thp" (anonymous memory on transparent huge pages, registered
# with the runtime: cudaHostRegister) or "torch" (torch's pinned allocator: cudaHostAlloc, 4 KB pages).
# Why thp: a server's first load waits for whatever of its pool the model's build did not leave time to
# pin. On the H200 machine registering huge pages pinned 3.2-3.6 GB/s against torch's 1.8, and with a 1 s
# build the first load ran at 85-92% of a second one against 71-86% (0.5 s: 88% against 63%; BENCHMARKS.md,
# twenty-eighth round). A buffer that cannot be registered is torch's.
PIN_WAYS = ("thp", "torch")
PIN = os.environ.get("ATOM_CONVERT_LOAD_PIN", "thp")
_mapped: list[mmap.mmap] = []  # the registered mappings: never unmapped while the process runs


def _register(nbytes: int) -> torch.Tensor | None:
    """`nbytes` of anonymous memory on huge pages where the kernel gives them, its pages made and
    registered with the runtime as page-locked; None when the runtime refuses (the caller pins with
    torch instead)."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # huge pages where the kernel's THP mode allows them, made in one call (Linux 5.14+); without
    # either, 4 KB pages, faulted in by the registration itself. Not inherited by a process forked
    # later (MADV_DONTFORK): a child has no use for the parent's DMA buffers, and the kernel would
    # otherwise copy every pinned page into it at the fork.
    for advice in (getattr(mmap, "MADV_HUGEPAGE", None), getattr(mmap, "MADV_POPULATE_WRITE", 23),
                   getattr(mmap, "MADV_DONTFORK", None)):
        try:
            if advice is not None:
                mm.madvise(advice)
        except OSError:
            pass
    t = torch.frombuffer(mm, dtype=torch.uint8)
    register = getattr(torch.cuda.cudart(), "cudaHostRegister", None)
    err = register(t.data_ptr(), nbytes, HOST_REGISTER_PORTABLE) if register is not None else None
    if err is None or int(getattr(err, "value", err)) != 0:
        log.debug("load: registering %d bytes as page-locked failed (%s); pinning with torch", nbytes,
                  err if err is not None else "the runtime has no cudaHostRegister")
        del t
        try:
            mm.close()
        except BufferError:  # still viewed somewhere: unmapped when the last view goes
            pass
        return None
    with _pool_lock:
        _mapped.append(mm)
    return t


def _pin_way() -> str:
    """PIN, or a BadInputError naming ATOM_CONVERT_LOAD_PIN when it is none of PIN_WAYS."""
    if PIN not in PIN_WAYS:
        raise BadInputError(f"ATOM_CONVERT_LOAD_PIN={PIN!r} is not one of {', '.join(PIN_WAYS)}; set it to one, "
                            f"or unset it")
    return PIN


def _pinned_buffer(index: int, chunk: int) -> torch.Tensor:
    """Pinned host buffer `index` of `chunk` bytes, kept for the process (a server loads the model
    and its drafter). Pinning costs far more per byte than copying, and the driver serialises it,
    so a buffer is made on first use by the copy thread that owns it, or ahead of the load by
    `prepare_pool`; how, PIN says."""
    with _pool_lock:
        pool = _pools.setdefault(chunk, {})
        buf = pool.get(index)
    if buf is None:
        made = _register(chunk) if _pin_way() == "thp" else None
        buf = made if made is not None else torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
        with _pool_lock:
            if index in pool:  # another thread made it meanwhile: keep one (a registered spare stays mapped)
                return pool[index]
            pool[index] = buf
    return buf


_preparing: list[threading.Thread] = []


def prepare_pool(threads: int | None = None, chunk_bytes: int | None = None) -> threading.Thread | None:
    """Pin the GPU path's buffers in a background thread, so that the first load of a process does
    not wait for them: the runtime hooks call this when a server starts building its model, which
    takes longer than pinning (bench/load_paths.py: a first call at 2.9 GB/s against 29 GB/s
    for the second one, warm, when the pool was pinned inside the call). Returns the thread (None
    without a CUDA device); `place_cuda` uses whatever it has pinned and pins the rest itself."""
    if not torch.cuda.is_available():
        return None
    threads = threads or _env_count("ATOM_CONVERT_LOAD_THREADS", DEFAULT_THREADS)
    chunk = _chunk_size(chunk_bytes)
    depth = _depth()

    def pin() -> None:
        try:
            for i in range(depth * threads):
                _pinned_buffer(i, chunk)
        except Exception as e:  # a pool that cannot be pinned now is pinned (or refused) by the load itself
            log.debug("prepare_pool: %s", e)

    t = threading.Thread(target=pin, name="atom-convert-pin", daemon=True)
    t.start()
    _preparing.append(t)
    return t


def _env_count(name: str, default: int) -> int:
    """A positive whole number from the environment variable `name` (`default` when unset);
    BadInputError naming the variable and its value otherwise."""
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise BadInputError(f"{name}={text!r}: expected a whole number of at least 1 (default {default}); "
                            f"set it to one, or unset it")
    return value


def _depth() -> int:
    return _env_count("ATOM_CONVERT_LOAD_DEPTH", DEFAULT_DEPTH)


def _chunk_size(chunk_bytes: int | None) -> int:
    chunk = chunk_bytes or _env_count("ATOM_CONVERT_LOAD_CHUNK", DEFAULT_CHUNK_BYTES)
    return max(PAGE, chunk // PAGE * PAGE)


def _ramp_size(done: int, total: int, chunk: int, threads: int) -> int:
    """The next chunk's size under RAMP, `done` of `total` bytes cut so far: small at both ends of the
    load, `chunk` in between. The idea: the pipeline's first copy cannot start before a thread has read
    a whole chunk, and its last copies run after every read is done (with 16 threads x 32 MB, up to
    0.5 GB each way with nothing beside it). Each chunk is 2/threads of the bytes between it and the
    nearer end (an eighth at 16 threads), at least RAMP_MIN_BYTES: the sizes grow by about 2x per round
    of the threads from the start and shrink likewise towards the end. Measured, it started the first
    copy 7 ms sooner but loaded no faster (more chunks to enqueue; BENCHMARKS.md, twenty-fifth round)."""
    edge = min(done, total - done)
    size = 2 * edge // max(threads, 1) // PAGE * PAGE
    return min(chunk, max(RAMP_MIN_BYTES, size))


def _open_direct(path: Path) -> int | None:
    """A second descriptor of `path` with O_DIRECT (reads that bypass the page cache), or None where
    the file system refuses it (tmpfs) or the platform has none."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag or not DIRECT_READS:
        return None
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None


_RESIDENT_BIT = bytes(i & 1 for i in range(256))


def _mincore() -> Any:
    """libc's mincore(2) (files/libc.py), or None where it cannot be called."""
    return libc.function("mincore")


class Residency:
    """Whether a chunk's pages sit in the page cache, asked by the thread about to read it: mincore(2)
    on a read-only mapping of the file, which faults nothing in and starts no read (a non-blocking
    read, RWF_NOWAIT, starts readahead of what it could not return, so the disk would be read twice).
    Asked per chunk, not once per file before the load: mincore walks the cache page by page, and for
    a whole 2 GB rank on the calling thread that was 18 ms before the first read began, a quarter of
    a warm load on the device machine (BENCHMARKS.md, twenty-fifth round); per chunk it is spread over
    the threads, beside the others' reads (warm loads there 28.5-31.8 GB/s against 22.5-25.8 before,
    twenty-sixth round). A page evicted or cached after the question only changes
    which read is used, never the bytes."""

    def __init__(self, fd: int, size: int):
        self.map: mmap.mmap | None = None
        self.base = 0
        lib = _mincore()
        if lib is None or size == 0:
            return
        import numpy as np

        self.map = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        self.base = np.frombuffer(self.map, dtype=np.uint8).ctypes.data
        self.size = size

    def cached(self, off: int, n: int) -> bool | None:
        """All of bytes [off, off + n) in the page cache now (None: unknown)."""
        if self.map is None:
            return None
        fn = _mincore()
        first = off // PAGE * PAGE
        span = min(off + n, self.size) - first
        if span <= 0:
            return None
        vec = (ctypes.c_ubyte * ((span + PAGE - 1) // PAGE))()
        if fn(self.base + first, span, vec) != 0:
            return None
        return b"\x00" not in bytes(vec).translate(_RESIDENT_BIT)  # bit 0: the page is resident

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
            self.map = None


def _read_chunk(fd: int, dfd: int | None, mv: memoryview, off: int, n: int, path: Path,
                cached: bool | None = None) -> str:
    """Read bytes [off, off + n) of the file into `mv` (page-aligned, at least n rounded up to a page
    long when `dfd` is given). A chunk the page cache holds (`cached`) is copied from it; any other
    is read with the O_DIRECT descriptor `dfd` straight from the disk into `mv`, bypassing the
    cache's extra copy (on the H200 machine, whose disk reads 1.8-2.1 GB/s, cold loads ran at 1.9-2.4
    GB/s direct against 1.2-1.9 buffered: bench/load_paths.py, BENCHMARKS.md; the gain is meant for
    disks that outrun a buffered copy). Returns how the bytes came: "direct" or "buffered"."""
    got = 0
    if dfd is not None and cached is False and off % PAGE == 0:
        end = n + (-n % PAGE)  # O_DIRECT: file offset, length and address on page boundaries
        while got < n:
            try:
                r = os.preadv(dfd, [mv[got:end]], off + got)
            except OSError:  # the file system refused this direct read after all: read it buffered
                break
            if r == 0:
                raise BadInputError(f"{path}: read ended at byte {off + got}; the file is truncated, convert again")
            got += r
            if r % PAGE:  # the end of the file
                break
        if got >= n:
            return "direct"
        got -= got % PAGE
    while got < n:
        r = os.preadv(fd, [mv[got:n]], off + got)
        if r <= 0:
            raise BadInputError(f"{path}: read ended at byte {off + got}; the file is truncated, convert again")
        got += r
    return "buffered"


def place_cuda(reads: list[FileRead], device: torch.device, *, threads: int | None = None,
               chunk_bytes: int | None = None, reader: str | None = None, submit: str | None = None) -> str:
    """Returns the reader used."""
    with _run_lock:  # the pinned pool is shared: one GPU load at a time per process
        return _place_cuda(reads, device, threads=threads, chunk_bytes=chunk_bytes, reader=reader, submit=submit)


_run_lock = threading.Lock()


class _TorchQueue:
    """A copy thread's stream, its copies enqueued by torch, one event per pinned buffer."""

    def __init__(self, stream: Any, depth: int):
        self.stream = stream
        self.events: list[Any] = [None] * depth

    def wait(self, slot: int) -> None:
        """Until the copies out of buffer `slot` are done (at once if none was enqueued)."""
        if self.events[slot] is not None:
            self.events[slot].synchronize()

    def enqueue(self, slot: int, src: torch.Tensor, pieces: list[tuple[torch.Tensor, int, int]]) -> None:
        with torch.cuda.stream(self.stream):
            for dst, at, length in pieces:
                dst.copy_(src[at:at + length], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.events[slot] = ev

    def finish(self) -> None:
        """Wait for every copy enqueued."""
        self.stream.synchronize()

    def release(self) -> None:
        """Give back what the queue holds (after `finish`, or after an error)."""


class _RuntimeQueue(_TorchQueue):
    """The same through the runtime library's own calls: a ctypes call per copy (no dispatch, no
    GIL held while it runs) and events made once per thread, recorded again for each chunk."""

    blocking = False  # whether a wait sleeps (blocking-sync events) instead of spinning

    def __init__(self, stream: Any, depth: int, rt: runtime_calls.RuntimeCalls):
        super().__init__(stream, depth)
        self.rt = rt
        self.handle = stream.cuda_stream
        self.events = [rt.new_event(self.blocking) for _ in range(depth)]
        self.recorded = [False] * depth

    def wait(self, slot: int) -> None:
        if self.recorded[slot]:
            self.rt.wait(self.events[slot])

    def enqueue(self, slot: int, src: torch.Tensor, pieces: list[tuple[torch.Tensor, int, int]]) -> None:
        base, rt, handle = src.data_ptr(), self.rt, self.handle
        for dst, at, length in pieces:
            rt.copy_to_device(dst.data_ptr(), base + at, length, handle)
        rt.record(self.events[slot], handle)
        self.recorded[slot] = True

    def release(self) -> None:
        events, self.events = self.events, []
        for ev in events:  # the runtime frees an event still pending once its work is done
            try:
                self.rt.free_event(ev)
            except runtime_calls.RuntimeCallError as e:
                log.debug("load: %s", e)


def _place_cuda(reads: list[FileRead], device: torch.device, *, threads: int | None,
                chunk_bytes: int | None, reader: str | None = None, submit: str | None = None) -> str:
    import numpy as np  # here, not at import time: only this GPU path needs it

    chunk = _chunk_size(chunk_bytes)
    depth = _depth()
    reader = reader or os.environ.get("ATOM_CONVERT_LOAD_READER", DEFAULT_READER)
    if reader not in READERS:
        raise BadInputError(f"load reader {reader!r} is not one of {', '.join(READERS)} (ATOM_CONVERT_LOAD_READER)")
    submit = submit or os.environ.get("ATOM_CONVERT_LOAD_SUBMIT", DEFAULT_SUBMIT)
    if submit not in SUBMITTERS:
        raise BadInputError(f"load submit {submit!r} is not one of {', '.join(SUBMITTERS)} (ATOM_CONVERT_LOAD_SUBMIT)")
    _pin_way()  # checked with the other settings, before a file is opened or a buffer pinned
    rt = runtime_calls.calls() if submit == "runtime" else None
    if submit == "runtime" and rt is None:
        log.debug("load: no runtime library found in the process; copies are enqueued by torch")
    # Destinations first, so that no allocation waits behind a copy.
    jobs: list[tuple[Path, int, int, list[tuple[torch.Tensor, int, int]]]] = []  # file, offset, length, pieces
    ranges: list[tuple[Path, int, int, list[tuple[torch.Tensor, int, int]]]] = []  # file, data lo, hi, spans
    threads = threads or _env_count("ATOM_CONVERT_LOAD_THREADS", DEFAULT_THREADS)
    for fr in reads:
        located = fr.located()
        if not located:
            continue
        spans = []
        for s, off in located:
            if s.given is None:
                s.tensor = torch.empty(s.shape, dtype=s.dtype, device=device)
            else:
                s.tensor = s.given
            spans.append((_as_bytes(s.tensor), off, off + s.nbytes))
        # chunks start on page boundaries (a registered range must cover whole pages)
        ranges.append((fr.path, spans[0][1] // PAGE * PAGE, max(e for _, _, e in spans), spans))
    total = sum(hi - lo for _, lo, hi, _ in ranges)
    done = 0  # bytes of all files cut so far: where the ramp stands
    for path, lo, hi, spans in ranges:
        i, a = 0, lo
        while a < hi:
            b = min(a + (_ramp_size(done, total, chunk, threads) if RAMP else chunk), hi)
            done += b - a
            pieces = []
            while i < len(spans) and spans[i][2] <= a:
                i += 1
            j = i
            while j < len(spans) and spans[j][1] < b:
                dst, s0, s1 = spans[j]
                x0, x1 = max(s0, a), min(s1, b)
                if x1 > x0:
                    pieces.append((dst[x0 - s0:x1 - s0], x0 - a, x1 - x0))
                j += 1
            if pieces:
                jobs.append((path, a, b - a, pieces))
            a = b
    if not jobs:
        return reader
    threads = max(1, min(threads, len(jobs)))
    paths = sorted({j[0] for j in jobs})
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}
    dfds: dict[Path, int | None] = {}
    resident: dict[Path, Residency] = {}
    maps: dict[Path, Any] = {}
    for p, fd in fds.items():
        if reader == "pread":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            dfds[p] = _open_direct(p)
            if dfds[p] is not None:
                resident[p] = Residency(fd, os.fstat(fd).st_size)
        else:  # one read-only mapping per file; readahead of the whole file is asked for at once
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            mm.madvise(mmap.MADV_WILLNEED)
            maps[p] = (mm, np.frombuffer(mm, dtype=np.uint8))
    next_job = iter(range(len(jobs)))
    lock = threading.Lock()
    errors: list[BaseException] = []
    inflight = InFlight()  # stopped when the caller is interrupted: each thread ends after its chunk
    cudart = torch.cuda.cudart() if reader == "register" else None
    read_as: dict[str, int] = {}  # bytes per way they came ("cache", "direct", "buffered")

    def fill(w: int, slot: int, path: Path, off: int, n: int) -> torch.Tensor:
        """The chunk's bytes in page-locked host memory."""
        if reader == "register":
            arr = maps[path][1][off:off + n]
            ptr = arr.ctypes.data
            err = cudart.cudaHostRegister(ptr, n, HOST_REGISTER_READ_ONLY)
            if int(getattr(err, "value", err)) != 0:
                raise RuntimeError(f"cudaHostRegister of {path} bytes {off}..{off + n} failed ({err})")
            return torch.from_numpy(arr)  # read-only mapping (its warning is silenced): only read from
        buf = _pinned_buffer(depth * w + slot, chunk)
        if reader == "mmap":
            np.copyto(buf.numpy()[:n], maps[path][1][off:off + n])
            return buf
        dfd = dfds.get(path) if buf.data_ptr() % PAGE == 0 else None
        cached = resident[path].cached(off, n) if dfd is not None else None
        how = _read_chunk(fds[path], dfd, memoryview(buf.numpy()), off, n, path, cached)
        with lock:
            read_as[how] = read_as.get(how, 0) + n
        return buf

    def worker(w: int) -> None:
        with torch.cuda.device(device):
            stream = torch.cuda.Stream(device)
            queue = _TorchQueue(stream, depth) if rt is None else _RuntimeQueue(stream, depth, rt)
            registered: list[int | None] = [None] * depth  # per buffer slot: the registered pointer
            k = 0
            try:
                while not errors and not inflight.stopped:
                    with lock:
                        idx = next(next_job, None)
                    if idx is None:
                        break
                    path, off, n, pieces = jobs[idx]
                    slot = k % depth
                    queue.wait(slot)  # the last copy out of this buffer is done
                    if registered[slot] is not None:
                        cudart.cudaHostUnregister(registered[slot])
                        registered[slot] = None
                    src = fill(w, slot, path, off, n)
                    if reader == "register":
                        registered[slot] = src.data_ptr()
                    queue.enqueue(slot, src, pieces)
                    k += 1
                queue.finish()
                for ptr in registered:
                    if ptr is not None:
                        cudart.cudaHostUnregister(ptr)
            finally:
                queue.release()

    def run(w: int) -> None:
        if not inflight.enter():
            return
        try:
            worker(w)
        except BaseException as e:  # reported on the caller's thread
            errors.append(e)
        finally:
            inflight.leave()

    pool = [threading.Thread(target=run, args=(w,), name=f"atom-convert-load-{w}") for w in range(threads)]
    reading = True  # whether a thread may still read from fds and maps
    try:
        with warnings.catch_warnings():  # "register" wraps the read-only mapping; only reads are issued
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for t in pool:
                t.start()
            join_in_steps(pool)
        reading = False
    except BaseException:
        # Ctrl-C (or a signal handler's exception) on this thread while the threads copy. The files
        # are closed only once no thread reads them: the number of a closed descriptor is given to
        # the next file opened, so a late pread could copy another file's bytes into a parameter.
        # Which threads still copy is counted by the threads themselves (inflight.py says why not
        # Thread.is_alive); a thread the interrupt kept from beginning never will.
        still = inflight.stop_and_wait(STOP_JOIN_S)
        reading = still > 0
        if reading:
            log.warning("load: %d copy thread(s) still reading %.0f s after the interrupt; their files are left "
                        "open until the process exits", still, STOP_JOIN_S)
        raise
    finally:
        if not reading:
            for mm, arr in maps.values():
                del arr
            maps.clear()
            for r in resident.values():
                r.close()
            for fd in [*fds.values(), *(d for d in dfds.values() if d is not None)]:
                os.close(fd)
    if errors:
        raise errors[0]
    if read_as:
        log.debug("load: bytes read %s", read_as)
    return reader
