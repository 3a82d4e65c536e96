"""Moving safetensors bytes into tensors: a no-copy CPU mapping and a pinned, multi-stream GPU path.

How it works (GPU, `place_cuda`):
1. Every destination tensor exists before the first byte is read: the caller's (an existing
   Parameter on the device) or a fresh `torch.empty` on the device.
2. Each file's data region is cut into chunks of `chunk_bytes`; the chunks of all files form one
   queue, in file order, so that the disk sees a few large sequential streams.
3. `threads` workers each own two pinned host buffers and one CUDA stream. A worker takes the next
   chunk, waits until the copy that last used that buffer has finished (an event), `preadv`s the
   chunk into the buffer (the GIL is released during the read), then enqueues on its stream one
   host-to-device copy per destination tensor the chunk overlaps. Reads of one chunk overlap the
   copies of the previous one, and the workers' copies overlap each other.
4. Bytes are copied as bytes: the destination is viewed as uint8, so fp8, e8m0 and fp4 are never
   converted (atom-loading.md §10 item 5).
Readers, chosen by bench/bench_load.py on the H200 device machine (BENCHMARKS.md, warm, 2 GB):
`preadv` into pinned buffers on 16 threads 32.1 GB/s (the default), memcpy from a mapping 25.1 GB/s,
`cudaHostRegister` of the mapping per chunk 15.0 GB/s; cold, all within the disk's rate.

CPU (`place_cpu`): each file is mapped once copy-on-write (`mmap.ACCESS_COPY`) and every tensor is a
view of the mapping, so no byte is copied until something writes to it; a tensor whose file offset is
not 16-byte aligned is copied into its own allocation (`CPU_VIEW_ALIGN`).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..files import safetensors as safetensors_file
from ..errors import BadInputError, ConvertedCheckError
from ..inflight import InFlight, join_in_steps

log = logging.getLogger(__name__)

DEFAULT_THREADS = 16  # bench_load on the H200 machine: 31 GB/s warm at 16, 25 at 8 (BENCHMARKS.md)
PAGE = 4096
# How a chunk reaches page-locked memory: "pread" into pinned buffers (os.preadv), "mmap" (memcpy
# from a read-only mapping into pinned buffers), "register" (cudaHostRegister of the mapping's chunk,
# then DMA straight from the page cache). Chosen by bench/bench_load.py (BENCHMARKS.md).
READERS = ("pread", "mmap", "register")
DEFAULT_READER = "pread"
HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the mapping is PROT_READ
# A CPU tensor is a view of the mapping only when its file offset is a multiple of this: consumers
# reinterpret rows as 16-byte units (shuffle16, SIMD loads), which a misaligned view refuses. The
# writer packs tensors back to back (safetensors allows no gaps), so some tensors are copied.
CPU_VIEW_ALIGN = 16
DEFAULT_CHUNK_BYTES = 32 << 20
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
_pools: dict[tuple[int, int], list[torch.Tensor]] = {}


def _pinned(count: int, chunk: int) -> list[torch.Tensor]:
    """Pinned host buffers, kept for the process: a server loads the model and its drafter, and
    pinning costs about as much per byte as copying (field notes: ~4 GB/s)."""
    with _pool_lock:
        pool = _pools.setdefault((chunk, 0), [])
        while len(pool) < count:
            pool.append(torch.empty(chunk, dtype=torch.uint8, pin_memory=True))
        return pool[:count]


def place_cuda(reads: list[FileRead], device: torch.device, *, threads: int | None = None,
               chunk_bytes: int | None = None, reader: str | None = None) -> str:
    """Returns the reader used."""
    with _run_lock:  # the pinned pool is shared: one GPU load at a time per process
        return _place_cuda(reads, device, threads=threads, chunk_bytes=chunk_bytes, reader=reader)


_run_lock = threading.Lock()


def _place_cuda(reads: list[FileRead], device: torch.device, *, threads: int | None,
                chunk_bytes: int | None, reader: str | None = None) -> str:
    import numpy as np  # here, not at import time: only this GPU path needs it

    threads = threads or int(os.environ.get("ATOM_CONVERT_LOAD_THREADS", DEFAULT_THREADS))
    chunk = chunk_bytes or int(os.environ.get("ATOM_CONVERT_LOAD_CHUNK", DEFAULT_CHUNK_BYTES))
    reader = reader or os.environ.get("ATOM_CONVERT_LOAD_READER", DEFAULT_READER)
    if reader not in READERS:
        raise BadInputError(f"load reader {reader!r} is not one of {', '.join(READERS)} (ATOM_CONVERT_LOAD_READER)")
    chunk = max(PAGE, chunk // PAGE * PAGE)
    # Destinations first, so that no allocation waits behind a copy.
    jobs: list[tuple[Path, int, int, list[tuple[torch.Tensor, int, int]]]] = []  # file, offset, length, pieces
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
        lo, hi = spans[0][1] // PAGE * PAGE, max(e for _, _, e in spans)
        i = 0
        for a in range(lo, hi, chunk):
            b = min(a + chunk, hi)
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
                jobs.append((fr.path, a, b - a, pieces))
    if not jobs:
        return reader
    threads = max(1, min(threads, len(jobs)))
    bufs = _pinned(2 * threads, chunk) if reader != "register" else []
    paths = sorted({j[0] for j in jobs})
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}
    maps: dict[Path, Any] = {}
    for p, fd in fds.items():
        if reader == "pread":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        else:  # one read-only mapping per file; readahead of the whole file is asked for at once
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            mm.madvise(mmap.MADV_WILLNEED)
            maps[p] = (mm, np.frombuffer(mm, dtype=np.uint8))
    next_job = iter(range(len(jobs)))
    lock = threading.Lock()
    errors: list[BaseException] = []
    inflight = InFlight()  # stopped when the caller is interrupted: each thread ends after its chunk
    cudart = torch.cuda.cudart() if reader == "register" else None

    def fill(w: int, slot: int, path: Path, off: int, n: int) -> torch.Tensor:
        """The chunk's bytes in page-locked host memory."""
        if reader == "register":
            arr = maps[path][1][off:off + n]
            ptr = arr.ctypes.data
            err = cudart.cudaHostRegister(ptr, n, HOST_REGISTER_READ_ONLY)
            if int(getattr(err, "value", err)) != 0:
                raise RuntimeError(f"cudaHostRegister of {path} bytes {off}..{off + n} failed ({err})")
            return torch.from_numpy(arr)  # read-only mapping (its warning is silenced): only read from
        buf = bufs[2 * w + slot]
        if reader == "mmap":
            np.copyto(buf.numpy()[:n], maps[path][1][off:off + n])
            return buf
        mv = memoryview(buf.numpy())[:n]
        got = 0
        while got < n:
            r = os.preadv(fds[path], [mv[got:]], off + got)
            if r <= 0:
                raise BadInputError(f"{path}: read ended at byte {off + got}; the file is truncated, convert again")
            got += r
        return buf

    def worker(w: int) -> None:
        with torch.cuda.device(device):
            stream = torch.cuda.Stream(device)
            pending: list[Any] = [None, None]  # per buffer slot: (event, registered pointer or None)
            k = 0
            while not errors and not inflight.stopped:
                with lock:
                    idx = next(next_job, None)
                if idx is None:
                    break
                path, off, n, pieces = jobs[idx]
                slot = k % 2
                if pending[slot] is not None:
                    ev, ptr = pending[slot]
                    ev.synchronize()  # the last copy out of this buffer is done
                    if ptr is not None:
                        cudart.cudaHostUnregister(ptr)
                src = fill(w, slot, path, off, n)
                with torch.cuda.stream(stream):
                    for dst, at, length in pieces:
                        dst.copy_(src[at:at + length], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                pending[slot] = (ev, src.data_ptr() if reader == "register" else None)
                k += 1
            stream.synchronize()
            for p in pending:
                if p is not None and p[1] is not None:
                    cudart.cudaHostUnregister(p[1])

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
            for fd in fds.values():
                os.close(fd)
    if errors:
        raise errors[0]
    return reader
