#!/usr/bin/env python3
"""How bytes get from a file to the GPU fastest, on this machine (issue 29): the candidate paths
side by side in one run, before one becomes the loader's default.

Writes `--files` safetensors files of `--file-gb` each (a few large uint8 tensors, random bytes),
then measures, all in this one process after CUDA is initialised:
- the machine: the disk's cold read (buffered and O_DIRECT, several threads), a page-cache memcpy
  into pinned buffers on 16 threads, pinned host-to-device;
- warm: atom_convert's pread-into-pinned pipeline (serve/transfer.py as it is), and DMA straight from
  the file's mapping registered with cudaHostRegister, in ranges of R bytes registered by T
  threads at once (unregistered when the copies are done), with and without MAP_POPULATE, and
  copies straight from the mapping as pageable memory (`pageable16x32`: the runtime stages them);
- cold: the pread pipeline and O_DIRECT reads into pinned buffers;
- the loader's pool pinned either way (transfer.PIN): a spec ending in `@torch` or `@thp`, e.g.
  `pipe16x32d2@torch`, and a sixth `--first-call` field;
- `--concurrent`: the read half and a host-to-device stream at once but not chained, each one's rate
  beside the other's (do they contend for host memory, or does the chaining cost?).
Each method's GPU bytes are compared with the files' at three 4 KB places per tensor (its start, middle, end).

    python bench/load_paths.py --workdir /tmp/lp [--files 4 --file-gb 0.5]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO, REPO / "bench"):
    sys.path.insert(0, str(_p))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_load import drop_cache, pinned_h2d  # noqa: E402

GB = 1e9
PAGE = 4096
REG_READ_ONLY = 0x08


def make_files(work: Path, count: int, nbytes: int) -> list[Path]:
    from safetensors.torch import save_file
    work.mkdir(parents=True, exist_ok=True)
    out = []
    g = torch.Generator().manual_seed(0)
    for i in range(count):
        p = work / f"rank0-{i}.safetensors"
        out.append(p)
        if p.exists() and p.stat().st_size >= nbytes:
            continue
        # a few large tensors and a small one, as a converted rank's file holds
        sizes = [nbytes // 2, nbytes // 4, nbytes // 4 - 4096, 4096 + 7]
        tensors = {f"t{i}.{k}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for k, n in enumerate(sizes)}
        save_file(tensors, str(p))
    return out


def disk_read(files: list[Path], threads: int, direct: bool, chunk: int = 16 << 20) -> float:
    jobs = [(p, off) for p in files for off in range(0, p.stat().st_size, chunk)]
    it, lock = iter(jobs), threading.Lock()

    def work() -> None:
        buf = mmap.mmap(-1, chunk)  # page aligned, as O_DIRECT wants
        fds: dict[Path, int] = {}
        while True:
            with lock:
                j = next(it, None)
            if j is None:
                break
            p, off = j
            if p not in fds:
                fds[p] = os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            os.preadv(fds[p], [buf], off)
        for fd in fds.values():
            os.close(fd)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def memcpy_pinned(files: list[Path], threads: int, chunk: int = 64 << 20, thp: bool = False) -> float:
    """Seconds to memcpy every byte of `files` from the page cache into pinned buffers (torch's, or one
    THP mapping registered with CUDA)."""
    maps = []
    for p in files:
        with open(p, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        maps.append(np.frombuffer(mm, dtype=np.uint8))
    jobs = [(a, off) for a in maps for off in range(0, a.size, chunk)]
    it, lock = iter(jobs), threading.Lock()
    if thp:
        pool = thp_pinned(threads * chunk).numpy()
        bufs = [pool[w * chunk:(w + 1) * chunk] for w in range(threads)]
    else:
        bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True).numpy() for _ in range(threads)]

    def work(w: int) -> None:
        while True:
            with lock:
                j = next(it, None)
            if j is None:
                break
            a, off = j
            n = min(chunk, a.size - off)
            np.copyto(bufs[w][:n], a[off:off + n])

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work, args=(w,)) for w in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def headers(files: list[Path]) -> list[Any]:
    from atom_convert.serve.transfer import read_header
    return [read_header(p) for p in files]


def destinations(hdrs: list[Any], dev: torch.device) -> list[list[tuple[torch.Tensor, int, int]]]:
    """Per file: (GPU uint8 tensor, absolute begin, end)."""
    out = []
    for h in hdrs:
        spans = []
        for name, (_st, shape, b, e) in sorted(h.entries.items(), key=lambda kv: kv[1][2]):
            spans.append((torch.empty(e - b, dtype=torch.uint8, device=dev), h.data_start + b, h.data_start + e))
        out.append(spans)
    return out


def check(files: list[Path], dsts: list[list[tuple[torch.Tensor, int, int]]]) -> bool:
    ok = True
    for p, spans in zip(files, dsts):
        with open(p, "rb") as f:
            for t, b, e in spans:
                for at in (0, (e - b) // 2, max(0, e - b - 4096)):
                    n = min(4096, e - b - at)
                    f.seek(b + at)
                    want = np.frombuffer(f.read(n), dtype=np.uint8)
                    got = t[at:at + n].cpu().numpy()
                    ok &= bool((want == got).all())
    return ok


def pieces_of(spans: list[tuple[torch.Tensor, int, int]], a: int, b: int) -> list[tuple[torch.Tensor, int, int]]:
    out = []
    for t, s0, s1 in spans:
        x0, x1 = max(s0, a), min(s1, b)
        if x1 > x0:
            out.append((t[x0 - s0:x1 - s0], x0 - a, x1 - x0))
    return out


def use_pin(way: str) -> None:
    """The loader's pool pinned this way from here on (transfer.PIN: "thp" or "torch"); a change drops the
    buffers pinned the other way (left pinned, unused), so the next call pins its pool anew."""
    from atom_convert.serve import transfer
    if transfer.PIN != way:
        transfer.PIN = way
        transfer._pools.clear()


def ours(files: list[Path], dev: torch.device, threads: int = 16, reader: str = "pread", thp: bool = False,
         chunk: int | None = None) -> Callable[[], Any]:
    from atom_convert.serve.transfer import FileRead, TensorSlot, place_cuda
    hdrs = headers(files)
    if thp:
        use_pin("thp")

    def run() -> Any:
        reads = [FileRead(h.path, h, [TensorSlot(n, torch.uint8, shape) for n, (_st, shape, _b, _e) in h.entries.items()])
                 for h in hdrs]
        place_cuda(reads, dev, threads=threads, reader=reader, chunk_bytes=chunk)
        return [[(s.tensor, h.data_start + h.entries[s.name][2], h.data_start + h.entries[s.name][3])
                 for s in fr.slots] for fr, h in zip(reads, hdrs)]
    return run


def mapped_jobs(files: list[Path], dsts: list[list[tuple[torch.Tensor, int, int]]], rng: int,
                flags: int = mmap.MAP_SHARED) -> tuple[list[Any], list[tuple[Any, int, int, list[Any]]]]:
    """Each file mapped read-only and cut into ranges of `rng` bytes from the page its first tensor
    starts in: (the mappings, to keep alive; the jobs: (array, offset, length, pieces))."""
    maps, jobs = [], []
    for p, spans in zip(files, dsts):
        fd = os.open(p, os.O_RDONLY)
        mm = mmap.mmap(fd, 0, flags=flags, prot=mmap.PROT_READ)
        os.close(fd)
        arr = np.frombuffer(mm, dtype=np.uint8)
        maps.append((mm, arr))
        lo, hi = spans[0][1] // PAGE * PAGE, max(e for _, _, e in spans)
        for a in range(lo, hi, rng):
            b = min(a + rng, hi)
            jobs.append((arr, a, b - a, pieces_of(spans, a, b)))
    return maps, jobs


def run_threads(work: Callable[[int], None], threads: int) -> None:
    """work(w) on `threads` threads, joined; the read-only mappings' warning silenced (only read)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ts = [threading.Thread(target=work, args=(w,)) for w in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()


def registered(files: list[Path], dev: torch.device, rng: int, threads: int, populate: bool,
               stats: dict[str, float], register: bool = True) -> Callable[[], Any]:
    """DMA straight from each file's mapping, registered in ranges of `rng` bytes by `threads` threads
    (unregistered after); `register=False`: the same copies from the mapping as pageable memory."""
    hdrs = headers(files)
    cudart = torch.cuda.cudart() if register else None

    def run() -> Any:
        dsts = destinations(hdrs, dev)
        maps, jobs = mapped_jobs(files, dsts, rng, mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0))
        it, lock = iter(jobs), threading.Lock()
        regs: list[int] = []
        reg_s = [0.0] * threads

        def work(w: int) -> None:
            with torch.cuda.device(dev):
                st = torch.cuda.Stream(dev)
                while True:
                    with lock:
                        j = next(it, None)
                    if j is None:
                        break
                    arr, a, n, pcs = j
                    if register:
                        ptr = arr[a:].ctypes.data
                        t0 = time.perf_counter()
                        err = cudart.cudaHostRegister(ptr, n, REG_READ_ONLY)
                        reg_s[w] += time.perf_counter() - t0
                        if int(getattr(err, "value", err)) != 0:
                            raise RuntimeError(f"register failed {err}")
                        with lock:
                            regs.append(ptr)
                    src = torch.from_numpy(arr[a:a + n])
                    with torch.cuda.stream(st):
                        for d, at, ln in pcs:
                            d.copy_(src[at:at + ln], non_blocking=True)
                st.synchronize()

        run_threads(work, threads)
        t0 = time.perf_counter()
        for ptr in regs:
            cudart.cudaHostUnregister(ptr)
        stats["unregister_s"] = time.perf_counter() - t0
        stats["register_s_per_thread"] = max(reg_s)
        return dsts
    return run


def pageable(files: list[Path], dev: torch.device, threads: int, chunk: int) -> Callable[[], Any]:
    """Copies straight from each file's read-only mapping (pageable memory) on T threads, a stream
    each: the runtime stages the bytes through its own small pinned buffers, which may stay in the
    CPU's caches (a byte would then cross host memory twice, not three times)."""
    return registered(files, dev, chunk, threads, False, {}, register=False)


def direct(files: list[Path], dev: torch.device, threads: int, chunk: int) -> Callable[[], Any]:
    """O_DIRECT reads of page-aligned chunks into pinned buffers (two per thread), then H2D."""
    hdrs = headers(files)
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2 * threads)]

    def run() -> Any:
        dsts = destinations(hdrs, dev)
        jobs = []
        for p, spans in zip(files, dsts):
            lo = spans[0][1] // PAGE * PAGE
            hi = max(e for _, _, e in spans)
            for a in range(lo, hi, chunk):
                b = min(a + chunk, hi)
                jobs.append((p, a, b - a, pieces_of(spans, a, b)))
        it, lock = iter(jobs), threading.Lock()

        def work(w: int) -> None:
            fds: dict[Path, int] = {}
            with torch.cuda.device(dev):
                st = torch.cuda.Stream(dev)
                evs: list[Any] = [None, None]
                k = 0
                while True:
                    with lock:
                        j = next(it, None)
                    if j is None:
                        break
                    p, a, n, pcs = j
                    if p not in fds:
                        fds[p] = os.open(p, os.O_RDONLY | os.O_DIRECT)
                    s = k % 2
                    if evs[s] is not None:
                        evs[s].synchronize()
                    buf = bufs[2 * w + s]
                    want = (n + PAGE - 1) // PAGE * PAGE
                    mv = memoryview(buf.numpy())[:want]
                    got = 0
                    while got < n:
                        r = os.preadv(fds[p], [mv[got:]], a + got)
                        if r <= 0:
                            raise RuntimeError("short read")
                        got += r
                    with torch.cuda.stream(st):
                        for d, at, ln in pcs:
                            d.copy_(buf[at:at + ln], non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(st)
                    evs[s] = ev
                    k += 1
                st.synchronize()
            for fd in fds.values():
                os.close(fd)

        ts = [threading.Thread(target=work, args=(w,)) for w in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return dsts
    return run


def hybrid(files: list[Path], dev: torch.device, preaders: int, regs: int, group: int, chunk: int = 32 << 20,
           stats: dict[str, float] | None = None) -> Callable[[], Any]:
    """One queue of page-aligned chunks in file order: `preaders` threads take from its front and
    pread into two pinned buffers each (the loader's pipeline); `regs` threads take up to `group`
    contiguous chunks of one file from its back, cudaHostRegister that range of the file's mapping
    and DMA straight from it. The two meet where their rates say."""
    import collections
    hdrs = headers(files)
    cudart = torch.cuda.cudart()
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2 * preaders)]

    def run() -> Any:
        dsts = destinations(hdrs, dev)
        q: Any = collections.deque()
        arrs = {}
        for p, spans in zip(files, dsts):
            fd = os.open(p, os.O_RDONLY)
            mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            os.close(fd)
            arrs[p] = np.frombuffer(mm, dtype=np.uint8)
            lo = spans[0][1] // PAGE * PAGE
            hi = max(e for _, _, e in spans)
            for a in range(lo, hi, chunk):
                q.append((p, a, min(a + chunk, hi) - a, spans))
        lock = threading.Lock()
        registered_ptrs: list[int] = []
        done_by = {"pread": 0, "register": 0}

        def pread_worker(w: int) -> None:
            fds: dict[Path, int] = {}
            with torch.cuda.device(dev):
                st = torch.cuda.Stream(dev)
                evs: list[Any] = [None, None]
                k = 0
                while True:
                    with lock:
                        if not q:
                            break
                        p, a, n, spans = q.popleft()
                        done_by["pread"] += n
                    if p not in fds:
                        fds[p] = os.open(p, os.O_RDONLY)
                    s = k % 2
                    if evs[s] is not None:
                        evs[s].synchronize()
                    buf = bufs[2 * w + s]
                    mv = memoryview(buf.numpy())[:n]
                    got = 0
                    while got < n:
                        got += os.preadv(fds[p], [mv[got:]], a + got)
                    with torch.cuda.stream(st):
                        for d, at, ln in pieces_of(spans, a, a + n):
                            d.copy_(buf[at:at + ln], non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(st)
                    evs[s] = ev
                    k += 1
                st.synchronize()
            for fd in fds.values():
                os.close(fd)

        def reg_worker(w: int) -> None:
            with torch.cuda.device(dev):
                st = torch.cuda.Stream(dev)
                while True:
                    with lock:
                        if not q:
                            break
                        p, a, n, spans = q.pop()
                        while len(q) and n < group * chunk and q[-1][0] == p and q[-1][1] + q[-1][2] == a:
                            _, a, m, _ = q.pop()
                            n += m
                        done_by["register"] += n
                    arr = arrs[p]
                    ptr = arr[a:].ctypes.data
                    err = cudart.cudaHostRegister(ptr, n, REG_READ_ONLY)
                    if int(getattr(err, "value", err)) != 0:
                        raise RuntimeError(f"register failed {err}")
                    with lock:
                        registered_ptrs.append(ptr)
                    src = torch.from_numpy(arr[a:a + n])
                    with torch.cuda.stream(st):
                        for d, at, ln in pieces_of(spans, a, a + n):
                            d.copy_(src[at:at + ln], non_blocking=True)
                st.synchronize()

        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ts = [threading.Thread(target=pread_worker, args=(w,)) for w in range(preaders)]
            ts += [threading.Thread(target=reg_worker, args=(w,)) for w in range(regs)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        for ptr in registered_ptrs:
            cudart.cudaHostUnregister(ptr)
        if stats is not None:
            stats["registered_fraction"] = round(done_by["register"] / max(1, sum(done_by.values())), 3)
        return dsts
    return run


def h2d_only(files: list[Path], dev: torch.device, threads: int, chunk: int, submit: str = "torch",
             depth: int = 2) -> Callable[[], Any]:
    """The pipeline's GPU half alone: the same chunks and copies from pinned buffers, nothing read,
    enqueued by torch or by the runtime library's calls (serve/transfer.py's queues)."""
    from atom_convert.serve import runtime_calls
    from atom_convert.serve.transfer import _RuntimeQueue, _TorchQueue
    hdrs = headers(files)
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(depth * threads)]
    rt = runtime_calls.calls() if submit == "runtime" else None
    if submit == "runtime" and rt is None:
        raise SystemExit("no runtime library found in the process")

    def run() -> Any:
        dsts = destinations(hdrs, dev)
        jobs = []
        for spans in dsts:
            lo = spans[0][1] // PAGE * PAGE
            hi = max(e for _, _, e in spans)
            for a in range(lo, hi, chunk):
                jobs.append(pieces_of(spans, a, min(a + chunk, hi)))
        it, lock = iter(jobs), threading.Lock()

        def work(w: int) -> None:
            with torch.cuda.device(dev):
                st = torch.cuda.Stream(dev)
                q = _TorchQueue(st, depth) if rt is None else _RuntimeQueue(st, depth, rt)
                k = 0
                while True:
                    with lock:
                        pcs = next(it, None)
                    if pcs is None:
                        break
                    q.wait(k % depth)
                    q.enqueue(k % depth, bufs[depth * w + k % depth], pcs)
                    k += 1
                q.finish()
                q.release()

        ts = [threading.Thread(target=work, args=(w,)) for w in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return None
    return run


def thp_pinned(nbytes: int) -> torch.Tensor:
    """Page-locked host memory as the loader's pool makes it (transfer._register: an anonymous mapping
    on transparent huge pages, registered with the runtime), kept for the process."""
    from atom_convert.serve import transfer
    t = transfer._register(nbytes)
    if t is None:
        raise RuntimeError(f"the runtime did not register {nbytes} bytes (transfer._register)")
    return t


def pool_rates(count: int = 32, chunk: int = 32 << 20) -> dict[str, float]:
    out = {}
    t0 = time.perf_counter()
    a = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
    out["torch_pin_32x32MB_gbps"] = round(count * chunk / (time.perf_counter() - t0) / GB, 2)
    del a
    t0 = time.perf_counter()
    b = thp_pinned(count * chunk)
    out["thp_register_1GB_gbps"] = round(count * chunk / (time.perf_counter() - t0) / GB, 2)
    del b
    t0 = time.perf_counter()
    ts = [threading.Thread(target=lambda: thp_pinned(2 * chunk)) for _ in range(count // 2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out["thp_register_16threads_gbps"] = round(count * chunk / (time.perf_counter() - t0) / GB, 2)
    t0 = time.perf_counter()
    ts = [threading.Thread(target=lambda: torch.empty(2 * chunk, dtype=torch.uint8, pin_memory=True))
          for _ in range(count // 2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out["torch_pin_16threads_gbps"] = round(count * chunk / (time.perf_counter() - t0) / GB, 2)
    return out


def pread_h2d_ceiling(files: list[Path], threads: int, chunk: int, thp: bool) -> float:
    """preadv of the page cache into pinned buffers (no GPU copy): the read half of the pipeline."""
    jobs = [(p, off) for p in files for off in range(0, p.stat().st_size, chunk)]
    it, lock = iter(jobs), threading.Lock()
    if thp:
        pool = thp_pinned(threads * chunk).numpy()
        bufs = [pool[w * chunk:(w + 1) * chunk] for w in range(threads)]
    else:
        bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True).numpy() for _ in range(threads)]

    def work(w: int) -> None:
        fds: dict[Path, int] = {}
        mv = memoryview(bufs[w])
        while True:
            with lock:
                j = next(it, None)
            if j is None:
                break
            p, off = j
            if p not in fds:
                fds[p] = os.open(p, os.O_RDONLY)
            os.preadv(fds[p], [mv], off)
        for fd in fds.values():
            os.close(fd)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work, args=(w,)) for w in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def concurrent_halves(files: list[Path], dev: torch.device, threads: int, chunk: int) -> dict[str, float]:
    """The pipeline's two halves at once but not chained: `threads` threads preadv the page cache into
    pinned buffers (pread_h2d_ceiling) while one stream copies another pinned 1 GB buffer to the GPU
    over and over. Each half's rate over the same window says whether they contend for host memory
    (both fall) or the pipeline's chaining is what costs (their rates hold beside each other)."""
    h = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    piece, stop, moved = 256 << 20, threading.Event(), [0]
    started = threading.Event()

    def dma() -> None:
        st = torch.cuda.Stream(dev)
        with torch.cuda.stream(st):
            while not stop.is_set():
                for a in range(0, h.numel(), piece):
                    d[a:a + piece].copy_(h[a:a + piece], non_blocking=True)
                st.synchronize()
                moved[0] += h.numel()
                started.set()

    t = threading.Thread(target=dma)
    t.start()
    started.wait()  # the DMA is running before the reads start
    b0, t0 = moved[0], time.perf_counter()
    sec = pread_h2d_ceiling(files, threads, chunk, False)
    b1, t1 = moved[0], time.perf_counter()
    stop.set()
    t.join()
    total = sum(p.stat().st_size for p in files)
    return {"read_gbps": round(total / sec / GB, 2), "h2d_gbps": round((b1 - b0) / (t1 - t0) / GB, 2)}


def traced(fn: Callable[[], Any], dev: torch.device) -> dict[str, Any]:
    """One warm call of the loader (`fn`, a pipe/rt/mmap spec) with every chunk's read, wait and copies
    timed: the reads and waits on the host clock, the copies by timing events recorded on the thread's
    stream before and after them, placed on the host clock through one event recorded at the start.
    Torch's queue only (the runtime-call queue records its own events)."""
    from atom_convert.serve import transfer
    rec: dict[str, list[Any]] = {"read": [], "wait": [], "copy": []}
    read0, wait0, enq0 = transfer._read_chunk, transfer._TorchQueue.wait, transfer._TorchQueue.enqueue

    def read(fd, dfd, mv, off, n, path, cached=None):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        how = read0(fd, dfd, mv, off, n, path, cached)
        rec["read"].append((threading.get_ident(), t0, time.perf_counter(), n))
        return how

    def wait(self, slot):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        wait0(self, slot)
        rec["wait"].append((threading.get_ident(), t0, time.perf_counter()))

    def enqueue(self, slot, src, pieces):  # type: ignore[no-untyped-def]
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(self.stream)
        t0 = time.perf_counter()
        enq0(self, slot, src, pieces)
        b.record(self.stream)
        rec["copy"].append((threading.get_ident(), t0, time.perf_counter(), a, b, sum(p[2] for p in pieces)))

    transfer._read_chunk, transfer._TorchQueue.wait, transfer._TorchQueue.enqueue = read, wait, enqueue
    try:
        torch.cuda.synchronize(dev)
        ref = torch.cuda.Event(enable_timing=True)
        ref.record()
        t_ref = time.perf_counter()
        fn()
        torch.cuda.synchronize(dev)
        t_end = time.perf_counter()
    finally:
        transfer._read_chunk, transfer._TorchQueue.wait, transfer._TorchQueue.enqueue = read0, wait0, enq0
    ids = {t: i for i, t in enumerate(sorted({r[0] for r in rec["read"]}))}
    ms = lambda t: round((t - t_ref) * 1e3, 3)  # noqa: E731
    out = {"wall_ms": ms(t_end),
           "read": [(ids.get(t, -1), ms(a), ms(b), n) for t, a, b, n in rec["read"]],
           "wait": [(ids.get(t, -1), ms(a), ms(b)) for t, a, b in rec["wait"]],
           "copy": [(ids.get(t, -1), ms(a), ms(b), round(ref.elapsed_time(e0), 3), round(ref.elapsed_time(e1), 3), n)
                    for t, a, b, e0, e1, n in rec["copy"]]}
    return out


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/lp"))
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--file-gb", type=float, default=0.5)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cold", default="pread16,direct8x16,direct16x16,direct4x64")
    ap.add_argument("--warm", default="pread16,reg:256:4,reg:256:8,reg:1024:2,reg:64:16,regpop:256:8")
    ap.add_argument("--first-call", default="", help="list of CHUNK_MB[:MODEL_BUILD_S[:SUBMIT[:THREADS[:DEPTH[:PIN]]]]]: "
                    "load_into's first and second call in a fresh process each, warm (PIN: thp or torch, "
                    "transfer.PIN)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--skip-ceilings", action="store_true")
    ap.add_argument("--repeat", type=int, default=3, help="warm calls per method")
    ap.add_argument("--rounds", type=int, default=1, help="the --warm list run this many times over, interleaved")
    ap.add_argument("--submit", choices=("torch", "runtime"), default=None, help="ATOM_CONVERT_LOAD_SUBMIT for "
                    "the loader's calls (the first-call children included)")
    ap.add_argument("--concurrent", default="", help="list of THREADSxCHUNK_MB: the read half and a pinned "
                    "host-to-device stream at once, not chained (concurrent_halves), each rate beside the other's")
    ap.add_argument("--trace", default="", help="list of warm specs (pipe/rt/mmap) to run once more with every "
                    "chunk's read, wait and copies timed (traced); written to --out's folder as trace-SPEC.json")
    ap.add_argument("--pools", action="store_true", help="also time pinning (torch, THP + cudaHostRegister) and a "
                    "memcpy into a THP pool")
    a = ap.parse_args()
    if a.submit:
        os.environ["ATOM_CONVERT_LOAD_SUBMIT"] = a.submit
    from atom_convert.serve import transfer
    default_pin = transfer.PIN
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    torch.empty(1, device=dev)  # a server's CUDA context exists before it loads weights
    files = make_files(a.workdir, a.files, int(a.file_gb * GB))
    if a.child:
        c, prep, submit, threads, depth, pin = (a.child.split(":") + [""] * 5)[:6]
        threads = threads or "16"
        use_pin(pin or default_pin)
        if submit:
            os.environ["ATOM_CONVERT_LOAD_SUBMIT"] = submit
        if depth:
            os.environ["ATOM_CONVERT_LOAD_DEPTH"] = depth
        if prep:  # as the runtime hooks do: the pool pinned while the server builds its model
            from atom_convert.serve.transfer import prepare_pool
            t = prepare_pool(int(threads), int(c) << 20)
            time.sleep(float(prep))  # stand-in for the model build (ATOM's takes seconds at full width)
            print("pool pinned before the load:", t is not None and not t.is_alive(), file=sys.stderr)
        fn = ours(files, dev, int(threads), chunk=int(c) << 20)
        total_c = sum(h.file_size - h.data_start for h in headers(files))
        out = []
        for _ in range(2):
            sec, d = timed(fn)
            out.append(round(total_c / sec / GB, 2))
            del d
            torch.cuda.empty_cache()
        print(json.dumps({"chunk_mb": int(c), "model_build_s": float(prep or 0), "first": out[0], "second": out[1],
                          "submit": os.environ.get("ATOM_CONVERT_LOAD_SUBMIT", "torch"), "threads": int(threads),
                          "depth": int(os.environ.get("ATOM_CONVERT_LOAD_DEPTH", "2")), "pin": transfer.PIN}))
        return 0
    if a.first_call:
        import subprocess
        disk_read(files, 8, False)
        for c in a.first_call.split(","):
            r = subprocess.run([sys.executable, __file__, "--workdir", str(a.workdir), "--files", str(a.files),
                                "--file-gb", str(a.file_gb), "--child", c], capture_output=True, text=True)
            print("first-call", r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-2000:], flush=True)
    total = sum(h.file_size - h.data_start for h in headers(files))
    rep: dict[str, Any] = {"bytes": total, "files": len(files), "gpu": torch.cuda.get_device_name(dev),
                           "cores": os.cpu_count(), "torch": torch.__version__}
    rate = lambda s: round(total / s / GB, 2)  # noqa: E731
    drop_cache(files)
    rep["disk_buffered_8"] = rate(disk_read(files, 8, False))
    drop_cache(files)
    rep["disk_direct_8x16"] = rate(disk_read(files, 8, True))
    drop_cache(files)
    rep["disk_direct_16x16"] = rate(disk_read(files, 16, True))
    disk_read(files, 8, False)  # warm the cache
    rep["memcpy_pinned_16"] = rate(memcpy_pinned(files, 16))
    rep["pinned_h2d"] = round(pinned_h2d(dev), 2)
    if a.pools:  # run 3 of BENCHMARKS' thirteenth round
        rep["pools"] = pool_rates()
        rep["memcpy_thp_16"] = rate(memcpy_pinned(files, 16, thp=True))
    for t in () if a.skip_ceilings else (8, 16):
        for c in (8, 32):
            rep[f"pread_only_{t}x{c}_torchpin"] = rate(pread_h2d_ceiling(files, t, c << 20, False))
            rep[f"pread_only_{t}x{c}_thp"] = rate(pread_h2d_ceiling(files, t, c << 20, True))
    for spec in filter(None, a.concurrent.split(",")):
        t, c = spec.split("x")
        rep[f"read_alone_{spec}"] = rate(pread_h2d_ceiling(files, int(t), int(c) << 20, False))
        rep[f"concurrent_{spec}"] = concurrent_halves(files, dev, int(t), int(c) << 20)
        rep[f"read_alone_{spec}_again"] = rate(pread_h2d_ceiling(files, int(t), int(c) << 20, False))
    print(json.dumps(rep), flush=True)

    def method(spec: str) -> tuple[Callable[[], Any], dict[str, float]]:
        st: dict[str, float] = {}
        spec, _, pin = spec.partition("@")  # pipe16x32d2@torch: the pool pinned by torch (use_pin)
        use_pin(pin or default_pin)
        if spec.startswith(("pipe", "rt")):  # pipe16x4d3: the pread pipeline, 16 threads, 4 MB chunks, 3 buffers
            # a thread, copies enqueued by torch; rt16x4d3: the same through the runtime's calls; rts: its events
            # wait asleep (blocking sync) instead of spinning
            from atom_convert.serve import transfer
            # (a trailing "ramp" / "noramp": transfer.RAMP on / off, chunks small at the load's ends or not)
            kind = "rts" if spec.startswith("rts") else "rt" if spec.startswith("rt") else "pipe"
            transfer.RAMP = spec.endswith("ramp") and not spec.endswith("noramp")
            t, _, rest = spec[len(kind):].removesuffix("noramp").removesuffix("ramp").partition("x")
            c, _, d = rest.partition("d")
            os.environ["ATOM_CONVERT_LOAD_DEPTH"] = d or "2"
            os.environ["ATOM_CONVERT_LOAD_SUBMIT"] = "torch" if kind == "pipe" else "runtime"
            transfer._RuntimeQueue.blocking = kind == "rts"
            return ours(files, dev, int(t), chunk=int(c) << 20), st
        if spec.startswith("mmap"):  # mmap16x32: the loader's mmap reader (memcpy out of the file's mapping)
            t, _, c = spec[4:].partition("x")
            return ours(files, dev, int(t), reader="mmap", chunk=(int(c) << 20) if c else None), st
        if spec.startswith("pread"):  # pread16, pread16thp, pread16thp8 (chunk MB), pread16nodirect
            from atom_convert.serve import transfer
            transfer.DIRECT_READS = not spec.endswith("nodirect")
            rest = spec[5:].removesuffix("nodirect")
            transfer.RAMP = False
            thp = "thp" in rest
            t, _, c = rest.partition("thp")
            return ours(files, dev, int(t), thp=thp, chunk=(int(c) << 20) if c else None), st
        if spec.startswith("pageable"):  # pageable16x32: copies from the mapping, pageable (`pageable`)
            t, c = spec[8:].split("x")
            return pageable(files, dev, int(t), int(c) << 20), st
        if spec.startswith("direct"):
            t, c = spec[6:].split("x")
            return direct(files, dev, int(t), int(c) << 20), st
        if spec.startswith("h2d"):  # h2d16x8: torch's copies; h2drt16x8d3: the runtime's calls, 3 buffers a thread
            rest = spec[3:]
            submit = "runtime" if rest.startswith("rt") else "torch"
            t, _, c = rest.removeprefix("rt").partition("x")
            c, _, d = c.partition("d")
            return h2d_only(files, dev, int(t), int(c) << 20, submit, int(d or 2)), st
        if spec.startswith("hyb"):
            _, pt, rt, g = spec.split(":")
            return hybrid(files, dev, int(pt), int(rt), int(g), stats=st), st
        if spec.startswith("pread"):
            pass
        kind, r, t = spec.split(":")
        return registered(files, dev, int(r) << 20, int(t), kind == "regpop", st), st

    cold: dict[str, Any] = {}
    for spec in filter(None, a.cold.split(",")):
        fn, st = method(spec)
        drop_cache(files)
        s, d = timed(fn)
        cold[spec] = {"gbps": rate(s), "ok": check(files, d) if d is not None else None, **st}
        print("cold", spec, cold[spec], flush=True)
        del d
        torch.cuda.empty_cache()
    rep["cold"] = cold
    disk_read(files, 8, False)
    warm: dict[str, Any] = {}
    for spec in [x for _ in range(a.rounds) for x in a.warm.split(",") if x]:
        fn, st = method(spec)
        runs = warm.get(spec, {}).get("gbps", [])
        ok = warm.get(spec, {}).get("ok")
        for _ in range(a.repeat):
            s, d = timed(fn)
            runs.append(rate(s))
            good = check(files, d) if d is not None else None
            ok = good if ok is None else ok and good is not False
            del d
            torch.cuda.empty_cache()
        warm[spec] = {"gbps": runs, "ok": ok, **{k: round(v, 4) for k, v in st.items()}}
        print("warm", spec, warm[spec], flush=True)
    rep["warm"] = warm
    for spec in filter(None, a.trace.split(",")):
        fn, _ = method(spec)
        fn()  # the pool pinned, as in a warm call
        tr = traced(fn, dev)
        print("trace", spec, "wall ms", tr["wall_ms"], "chunks", len(tr["read"]), flush=True)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            (a.out.parent / f"trace-{spec}.json").write_text(json.dumps(tr))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(rep, indent=1))
    print(json.dumps(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
