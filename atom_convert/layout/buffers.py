"""Reusable output buffers for the producers, so that each expert's output is not a fresh allocation.

Why: a producer makes one output chunk per expert and rank (a shuffled [2*I/tp, H] w13 piece of a
few MB), the writer thread writes it and drops it. With glibc serving such blocks by their own
mapping (convert.py's mmap threshold, which keeps the heap from growing), every chunk is a new
mapping whose pages fault in one 4 KB page at a time, are zeroed by the kernel and are unmapped
after the write: 16 GB of output is ~4 million page faults. Shuffling a [512, 7168] fp8 piece
into a fresh tensor took 1.62 ms, into a reused one 0.10 ms (the 2-core box, one thread).

How it works: `BufferPool` keeps free anonymous memory slabs (private, as transparent huge pages where the
kernel gives them), each of one rounded size. `empty(shape, dtype)` hands out a
tensor over a free slab (`torch.frombuffer`: a storage of its own), and a finalizer on that storage
puts the slab back when the last view of the tensor goes, whichever thread drops it (the writer's
thread, after its pwrite). A slab is reused only when nothing can still see the tensor, so a chunk
that something keeps (a cache, a caller) simply stays out of the pool. Free slabs beyond
`keep_bytes` are released. Producers call the module-level `empty`, which uses the pool installed
for the calling thread (`using`) and is plain `torch.empty` elsewhere (reference, verify, tests).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import threading
import weakref
from typing import Iterator, Sequence

import torch

MIN_BYTES = 1 << 20  # smaller tensors come from torch's allocator (the heap)
_ROUND = 1 << 16  # slab sizes are rounded up to this, so that near sizes share slabs

_local = threading.local()


class BufferPool:
    """Slabs of anonymous memory handed out as tensors and taken back when their last view dies."""

    def __init__(self, keep_bytes: int, *, private: bool = True):
        self.keep_bytes = keep_bytes  # free slabs beyond this are released, the least recently freed first
        # private: slabs are private anonymous memory asked for as transparent huge pages (2 MB faults
        # where the kernel's THP mode is "madvise" or "always"), not shared anonymous memory (shmem,
        # 4 KB faults, each page zeroed); a worker process's slabs are its own either way. Warm
        # V3-width fp8 at tp 1, 2-core box: 5.8-7.0 and 9.6-10.3 s against 8.8-9.5 and 12.9-13.3 s
        # shared (two sittings); the device: 5.05-5.11 against 5.17-5.79 s. At tp 8 no difference
        # beyond the noise on the device and in the box's second sitting (BENCHMARKS.md, fifteenth round)
        self.private = private
        self._free: list[tuple[int, mmap.mmap]] = []  # (size, slab), least recently freed first
        self._free_bytes = 0
        self._lock = threading.Lock()
        self.made = 0  # slabs mapped (tests, benches)
        self.reused = 0  # hand-outs served by a free slab

    def _take(self, size: int) -> mmap.mmap:
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):  # the most recently freed of this size
                if self._free[i][0] == size:
                    self._free_bytes -= size
                    self.reused += 1
                    return self._free.pop(i)[1]
            self.made += 1
        if not self.private:
            return mmap.mmap(-1, size)  # anonymous, page-aligned (int64 / complex128 views need 16 bytes)
        slab = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                slab.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # a kernel without THP: 4 KB pages
                pass
        return slab

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        size = -(-nbytes // _ROUND) * _ROUND
        slab = self._take(size)
        t = torch.frombuffer(slab, dtype=torch.uint8, count=nbytes)
        weakref.finalize(t.untyped_storage(), self._give_back, size, slab)
        return t.view(dtype).view(shape)

    def _give_back(self, size: int, slab: mmap.mmap) -> None:
        with self._lock:
            if size > self.keep_bytes:
                return  # never kept: unmapped when its last reference goes
            self._free.append((size, slab))
            self._free_bytes += size
            while self._free_bytes > self.keep_bytes:  # sizes no longer asked for go first
                self._free_bytes -= self._free.pop(0)[0]

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._free_bytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._free_bytes = 0


@contextlib.contextmanager
def using(pool: BufferPool | None) -> Iterator[None]:
    """Make `empty` draw from `pool` on the calling thread (None: torch.empty)."""
    before = getattr(_local, "pool", None)
    _local.pool = pool
    try:
        yield
    finally:
        _local.pool = before


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """`torch.empty(shape, dtype=dtype, device=device)`, from the calling thread's pool when one is
    installed and the tensor is a CPU tensor of at least MIN_BYTES."""
    pool: BufferPool | None = getattr(_local, "pool", None)
    if (pool is not None and (device is None or torch.device(device).type == "cpu")
            and math.prod(shape) * dtype.itemsize >= MIN_BYTES):
        return pool.empty(shape, dtype)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """`torch.zeros`, from the pool as `empty` is (a reused slab is zeroed by a memset, not a page fault)."""
    return empty(shape, dtype).zero_()
