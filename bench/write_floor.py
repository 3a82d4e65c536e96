#!/usr/bin/env python3
"""The machine's floor for writing a conversion's output (issue 29): what the kernel alone costs.

A conversion writes every output byte into pages the output file system has to allocate. This times
that part alone, with no conversion work around it: `--procs` processes at once, each writing
`--gb` GB by `pwrite` of one hot 8 MB buffer

- into a new file under --out (fresh pages, as a conversion's output), and
- into the same file again (pages that exist: the copy alone),
- `shared`: into one new file for all the processes, each writing every P-th 8 MB piece of it, as the
  conversion's workers write into a rank's shard side by side (a file system that writes one call at a
  time per file, as tmpfs and ext4 do under the file's lock, then shows it); with `--share K`, one file
  for each K processes (16 workers over a tp-8 conversion's 8 shards: `--procs 16 --share 2`),
- `shared-turns`: the same, each write taking the file's turn as the conversion's writer does
  (engine/writer.py, TAKE_TURNS: an open-file-description lock, so a waiting writer sleeps),
- `make-pwrite` and `make-mapped`: a conversion's write with the making of the bytes: each 8 MB piece is
  first copied out of a source the process filled before the clock (standing in for the layout step),
  into the hot buffer that is then `pwrite`n (the writer as it is), or straight into the file through a
  shared mapping, the piece's range first allocated with `fallocate` (a full file system fails there,
  not with SIGBUS) and its pages mapped in one `MADV_POPULATE_WRITE` call; `--share K` applies to both
  (each process's first piece is read back and compared after the clock),

and, for comparison, the first touch of as much fresh anonymous memory (a buffer allocated per
item). Reports GB/s over all processes and CPU-seconds (user + system) per GB written, taken from
each process's own rusage, so a whole conversion's CPU per GB can be set against it.

On a disk (`--ways new-fsync,direct`): a new file written through the page cache and then fsynced
(the write-back's wait counted), against the same bytes written with O_DIRECT from a page-aligned
buffer (no page cache pages at all; a file system that refuses O_DIRECT, such as an older tmpfs,
ends the run with its error).

    python bench/write_floor.py [--out /dev/shm] [--procs 1,16] [--gb 1] [--rounds 2] [--ways new,rewrite,anon]
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

BUF = 8 << 20
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # atom_convert, for the shared-turns way


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _one(args: tuple[str, str, int, object, int, int]) -> tuple[float, float, float]:
    """One process's part (process i of p sharing its file; p is 1 for a file each): (start, end,
    CPU-s) of the way named, over n bytes."""
    way, path, n, barrier, i, p = args
    make = way.startswith("make-")
    shared = way.startswith("shared") or (make and p > 1)
    turns = way == "shared-turns"
    if turns:  # imported before the clock starts (the writer's module imports torch)
        import fcntl

        from atom_convert.engine.writer import _OFD_SETLKW, _flock_struct
    aligned = mmap.mmap(-1, BUF)  # page-aligned, as O_DIRECT needs
    buf = np.frombuffer(aligned, dtype=np.uint8)
    buf[:] = np.random.default_rng(os.getpid()).integers(0, 256, BUF, dtype=np.uint8)
    flags = (os.O_CREAT | os.O_RDWR | (os.O_DIRECT if way == "direct" else 0)
             | (os.O_TRUNC if not shared else 0))
    fd = os.open(path, flags, 0o600) if way != "anon" else -1
    src = None
    if make:  # the source, touched before the clock (a warm conversion's source is in the page cache)
        src = np.empty(n, dtype=np.uint8)
        src[::4096] = 7
    try:
        if way == "rewrite":  # the pages first, then the timed rewrite of the same ones
            for off in range(0, n, BUF):
                os.pwrite(fd, buf, off)
        barrier.wait()  # type: ignore[attr-defined]
        c0, t0 = _cpu(), time.perf_counter()
        if way == "anon":
            a = np.empty(n, dtype=np.uint8)
            a[::4096] = 1  # one byte per page: the first touch, nothing else
            del a
        elif way == "make-pwrite":
            for k in range(n // BUF):
                buf[:] = src[k * BUF:(k + 1) * BUF]
                os.pwrite(fd, buf, (k * p + i) * BUF)
        elif way == "make-mapped":
            size = n * p
            os.ftruncate(fd, size)  # every process: the same size, so the order does not matter
            mm = mmap.mmap(fd, size)
            dst = np.frombuffer(mm, dtype=np.uint8)
            for k in range(n // BUF):
                off = (k * p + i) * BUF
                os.posix_fallocate(fd, off, BUF)
                mm.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23), off, BUF)  # 23: Linux 5.14+
                dst[off:off + BUF] = src[k * BUF:(k + 1) * BUF]
            del dst
            mm.close()
        elif shared:
            for k in range(n // BUF):
                if turns:
                    fcntl.fcntl(fd, _OFD_SETLKW, _flock_struct(fcntl.F_WRLCK))
                os.pwrite(fd, buf, (k * p + i) * BUF)
                if turns:
                    fcntl.fcntl(fd, _OFD_SETLKW, _flock_struct(fcntl.F_UNLCK))
        else:
            for off in range(0, n, BUF):
                os.pwrite(fd, buf, off)
            if way in ("new-fsync", "direct"):
                os.fsync(fd)
        t1, c1 = time.perf_counter(), _cpu()
        if shared:
            barrier.wait()  # type: ignore[attr-defined]  (all written: the file is whole)
        # RuntimeError, not SystemExit: the pool passes an Exception on to map(), but loses a worker
        # that raises SystemExit and then waits for its result for ever
        if make and os.pread(fd, BUF, i * BUF) != src[:BUF].tobytes():
            raise RuntimeError(f"{path}: the piece of process {i} at {i * BUF} is not what it made")
        want = n * p if shared else n
        if fd >= 0 and os.fstat(fd).st_size != want:
            raise RuntimeError(f"{path}: {os.fstat(fd).st_size} bytes written, expected {want}")
    finally:
        if fd >= 0:
            os.close(fd)
            if not shared or i == 0:
                os.unlink(path)
    return t0, t1, c1 - c0


def measure(way: str, out: Path, procs: int, nbytes: int, share: int | None = None) -> dict[str, float]:
    ctx = mp.get_context("fork")
    sharing = way.startswith("shared") or (way.startswith("make-") and share)
    k = min(share or procs, procs) if sharing else 1  # processes per file
    with ctx.Manager() as m:
        barrier = m.Barrier(procs)
        with ctx.Pool(procs) as pool:
            res = pool.map(_one, [(way, str(out / f"write-floor-{os.getpid()}-{i // k}.bin"),
                                   nbytes, barrier, i % k, k) for i in range(procs)], chunksize=1)
    wall = max(r[1] for r in res) - min(r[0] for r in res)
    total = nbytes * procs
    return {"gb_per_s": round(total / wall / 1e9, 2), "cpu_s_per_gb": round(sum(r[2] for r in res) / (total / 1e9), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--procs", default="1,16", help="comma-separated process counts")
    ap.add_argument("--gb", type=float, default=1.0, help="GB each process writes")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ways", default="new,rewrite,anon",
                    help="comma-separated: new, rewrite, anon, shared, shared-turns, new-fsync, direct, make-pwrite, "
                         "make-mapped (module docstring)")
    ap.add_argument("--share", type=int, default=None, help="processes per file of the shared ways (default: all)")
    a = ap.parse_args()
    unknown = set(a.ways.split(",")) - {"new", "rewrite", "anon", "shared", "shared-turns", "new-fsync", "direct",
                                        "make-pwrite", "make-mapped"}
    if unknown:
        ap.error(f"--ways: unknown {', '.join(sorted(unknown))}")
    if a.share is not None and (a.share < 1 or any(int(x) % min(a.share, int(x)) for x in a.procs.split(","))):
        ap.error(f"--share {a.share}: must be at least 1 and divide each of --procs {a.procs}")
    n = max(BUF, int(a.gb * 1e9) // BUF * BUF)
    rep = []
    for _ in range(a.rounds):
        for p in (int(x) for x in a.procs.split(",")):
            for way in a.ways.split(","):
                shares = a.share and way.startswith(("shared", "make-"))
                r = {"way": way, "procs": p, **({"share": a.share} if shares else {}),
                     **measure(way, a.out, p, n, a.share)}
                print(json.dumps(r), flush=True)
                rep.append(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
