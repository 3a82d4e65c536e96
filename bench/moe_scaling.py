"""Does the MoE expert loop scale with worker threads, and with worker processes?

The question it answers (BENCHMARKS.md, "Issue 9, fourth round"): on the 16-core device a conversion
kept 5-6 cores busy during the MoE layer whatever the number of worker threads. If the same
producer work scales with processes (each its own interpreter, GIL and address space) but not with
threads, the limit is one the threads share (the GIL, or the one address space's page-fault and
TLB-shootdown costs), and converting the expert loop in processes is the way on.

What it runs: the real producers of the plan's largest MoE group (`atom_convert.engine.convert.make_plan`,
the w13/w2 outputs with expert units), cut into (rank, expert range) items as the converter cuts
them, each item's chunks written one after another into its worker's own scratch file (or, with
`--sink null`, dropped after production). Threads pull items from one queue; processes are forked
before any thread starts and take every N-th item. Torch runs on one intra-op thread everywhere.
Reported per configuration: wall seconds, output GB/s, CPU seconds (children included) and cores
busy (CPU seconds per wall second).

Usage: python bench/moe_scaling.py SRC [--target gfx950] [--tp 8] [--workers 1,4,8,16]
       [--mode thread,process] [--sink file|null] [--scratch DIR] [--json out.json]
(SRC: e.g. made by `bench/bench_convert.py --generate-only`.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from atom_convert.layout import buffers  # noqa: E402
from atom_convert.engine import workers as workers_mod  # noqa: E402
from atom_convert.engine.planning import make_plan  # noqa: E402
from atom_convert.layout.plan import Group, OutTensor  # noqa: E402
from atom_convert.files.source import SourceCheckpoint  # noqa: E402
from atom_convert.engine.writer import _as_bytes  # noqa: E402  the writer's own zero-copy byte view


def moe_group(src: SourceCheckpoint, target: str, tp: int) -> tuple[Group, list[OutTensor]]:
    plan = make_plan(src, target=target, tp=tp)
    groups = [(g, [o for o in g.outputs if o.units]) for g in plan.main.groups]
    g, outs = max(groups, key=lambda x: sum(o.nbytes for o in x[1]))
    if not outs:
        raise SystemExit(f"{src.path}: no MoE layer with stacked experts in the plan")
    return g, outs


def items_for(group: Group, outs: list[OutTensor], tp: int, workers: int) -> list[tuple[list[int], tuple[int, int]]]:
    """(ranks, expert range) as the converter cuts and orders them (workers.items)."""
    units = max(o.units for o in outs)
    return [(it.ranks, it.part or (0, units)) for it in workers_mod.items([group], tp, workers)]


def run_item(src: SourceCheckpoint, outs: list[OutTensor], ranks: list[int], part: tuple[int, int], fd: int | None,
             pool: buffers.BufferPool) -> int:
    """One item's chunks, rank after rank, sharing column views as the converter does."""
    n = 0
    with buffers.using(pool), (src.sharing_columns() if len(ranks) > 1 else contextlib.nullcontext()):
        for rank in ranks:
            cache: dict[str, Any] = {}
            for o in outs:
                for c in o.produce(rank, cache, part=part):
                    b = _as_bytes(c)
                    if fd is not None:
                        mv = memoryview(b)
                        while len(mv):
                            mv = mv[os.write(fd, mv):]
                    n += b.nbytes
                    del b, c
    return n


def one_config(src_path: Path, target: str, tp: int, workers: int, mode: str, sink: str, scratch: Path) -> dict[str, Any]:
    src = SourceCheckpoint(src_path)
    group, outs = moe_group(src, target, tp)
    work = items_for(group, outs, tp, workers)
    files = [scratch / f"w{i}.bin" for i in range(workers)]

    def open_sink(i: int) -> int | None:
        return os.open(files[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if sink == "file" else None

    c0, t0 = os.times(), time.perf_counter()
    total = 0
    if mode == "thread":
        q: queue.SimpleQueue[tuple[list[int], tuple[int, int]] | None] = queue.SimpleQueue()
        for w in work:
            q.put(w)
        for _ in range(workers):
            q.put(None)
        done: list[int] = []
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            fd, pool, n = open_sink(i), buffers.BufferPool(1 << 30), 0
            try:
                while (w := q.get()) is not None:
                    n += run_item(src, outs, w[0], w[1], fd, pool)
            except BaseException as e:  # noqa: BLE001  reported below
                errors.append(e)
            finally:
                if fd is not None:
                    os.close(fd)
                done.append(n)
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        total = sum(done)
    else:
        pids = []
        rfd, wfd = os.pipe()
        for i in range(workers):
            pid = os.fork()
            if pid == 0:  # child: its share of the items, then its byte count on the pipe
                code = 1
                try:
                    os.close(rfd)
                    fd, pool = open_sink(i), buffers.BufferPool(1 << 30)
                    n = sum(run_item(src, outs, r, p, fd, pool) for r, p in work[i::workers])
                    if fd is not None:
                        os.close(fd)
                    os.write(wfd, f"{n}\n".encode())
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
        os.close(wfd)
        with os.fdopen(rfd) as r:
            total = sum(int(x) for x in r.read().split())
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            if status:
                raise SystemExit(f"a worker process failed (status {status})")
    wall = time.perf_counter() - t0
    c1 = os.times()
    cpu = (c1.user - c0.user) + (c1.system - c0.system) + (c1.children_user - c0.children_user) \
        + (c1.children_system - c0.children_system)
    for f in files:
        f.unlink(missing_ok=True)
    return {"mode": mode, "workers": workers, "target": target, "tp": tp, "group": group.key, "items": len(work),
            "sink": sink, "bytes": total, "wall_s": wall, "GBps": total / wall / 1e9, "cpu_s": cpu,
            "cores_busy": cpu / wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("--target", default="gfx950")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--workers", default="1,4,8,16", help="comma-separated worker counts")
    ap.add_argument("--mode", default="thread,process", help="thread, process or both (comma-separated)")
    ap.add_argument("--sink", choices=("file", "null"), default="file")
    ap.add_argument("--scratch", type=Path, default=None, help="folder for the workers' files (default: beside SRC)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # before any op: forked children must not inherit a started OpenMP pool
    scratch = args.scratch or args.src.parent / f"{args.src.name}-moe-scaling"
    scratch.mkdir(parents=True, exist_ok=False)
    rows = []
    try:
        for w in (int(x) for x in args.workers.split(",")):
            for mode in args.mode.split(","):
                row = one_config(args.src, args.target, args.tp, w, mode, args.sink, scratch)
                rows.append(row)
                print(f"{mode:7s} x{w:3d} ({row['items']} items of {row['group']}): {row['wall_s']:6.2f} s, "
                      f"{row['GBps']:5.2f} GB/s out, CPU {row['cpu_s']:6.1f} s, cores busy {row['cores_busy']:4.1f}",
                      flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
