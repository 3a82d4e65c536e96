"""Timeline of one conversion: where the cores go while the workers run.

What it records, without changing the conversion (it wraps functions of the package):
- every item (`workers.Item`: layer or group, rank, expert range) with its worker thread, start and end
  (with worker processes, `--worker-mode process`, the default for several workers: from the moment
  the item is handed to a process to the moment its "done" arrives);
- every shard's hashing thread: its start and the moment it sealed the shard;
- every 0.1 s the CPU time (user, sys) of the process and its worker processes, and each open shard's
  written and hashed bytes;
- in every process that converts (each worker process, or this one with threads): the seconds its
  producers waited for a free slot in the write-behind queue, its writers waited for their turn at a
  shard file, and spent in `pwrite`, with the bytes written (`Waits`);
- the machine's busy cores over the call (/proc/stat: every process, not only this conversion's).

It prints, per group, the items' span and their summed seconds; the end of the last item against the
end of the last hash; and over the largest group's span the **cores busy** (process CPU seconds per
second) against the **items running** (average number in progress). Many items running on few busy
cores means the workers wait on something they share (BENCHMARKS.md, "Issue 9, fourth round"). Then
the items running in each tenth of the call, the waits summed over the processes, and what the order
the items are handed out in costs: list scheduling of the measured item spans on the same number of
workers, in that order and longest first, against a perfect balance (`list_schedule`; BENCHMARKS.md,
twenty-ninth round). The whole record goes to `--json` for plotting.

Usage: python bench/trace_convert.py SRC [--target gfx950] [--tp 8] [--workers N]
       [--worker-mode auto|process|thread] [--json out.json]
(SRC: e.g. a source made by `bench/bench_convert.py --generate-only`; the output goes to a scratch
folder beside SRC, or `--dst`, and is removed afterwards.)
"""

from __future__ import annotations

import argparse
import heapq
import importlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from atom_convert.engine import procs as procs_mod  # noqa: E402
from atom_convert.engine import workers as workers_mod  # noqa: E402
from atom_convert.engine import write_behind as write_behind_mod  # noqa: E402
from atom_convert.engine import writer as writer_mod  # noqa: E402
from bench_convert import cpu_times  # noqa: E402  (this folder is sys.path[0] when run as a script)

_TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu() -> tuple[float, float]:
    """(user, sys) CPU seconds of this process, its reaped children and its live worker processes."""
    import multiprocessing

    c = os.times()
    user, sys_ = c.user + c.children_user, c.system + c.children_system
    for p in multiprocessing.active_children():
        try:
            with open(f"/proc/{p.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            user += int(fields[11]) / _TICK
            sys_ += int(fields[12]) / _TICK
        except (OSError, IndexError, ValueError):
            pass
    return user, sys_


def list_schedule(durations: list[float], workers: int) -> float:
    """When the last of `durations` ends if each goes, in the order given, to the first worker free
    (as run_items hands items out)."""
    free = [0.0] * max(1, workers)
    for d in durations:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


class Waits:
    """What the converting threads of one process waited for: a free slot in their write-behind queue
    (`_IOThread.submit`), their turn at a shard file (`_ShardIO._turn`), and `pwrite` (seconds and bytes).
    Installed before the conversion, so worker processes inherit the wrappers at their fork; each one
    starts from zero and leaves its sums in `folder` as <pid>.json when it ends."""

    KEYS = ("queue_s", "turn_s", "pwrite_s", "pwrite_bytes")

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.sums = dict.fromkeys(self.KEYS, 0.0)
        self._lock = threading.Lock()

    def add(self, key: str, value: float) -> None:
        with self._lock:
            self.sums[key] += value

    def install(self) -> None:
        submit, turn, pwrite = write_behind_mod._IOThread.submit, writer_mod._ShardIO._turn, writer_mod._pwrite
        init = procs_mod.WorkerProcesses.__init__
        waits = self

        def timed_submit(io: Any, *a: Any) -> None:
            t = time.perf_counter()
            try:
                submit(io, *a)
            finally:
                waits.add("queue_s", time.perf_counter() - t)

        def timed_turn(shard_io: Any, kind: int) -> bool:
            t = time.perf_counter()
            took = turn(shard_io, kind)
            if kind != writer_mod.fcntl.F_UNLCK:
                waits.add("turn_s", time.perf_counter() - t)
            return took

        def timed_pwrite(fd: int, data: memoryview, offset: int) -> int:
            t = time.perf_counter()
            n = pwrite(fd, data, offset)
            waits.add("pwrite_s", time.perf_counter() - t)
            waits.add("pwrite_bytes", n)
            return n

        def traced_init(pool: procs_mod.WorkerProcesses, n: int, *, start: Any, end: Any, **kw: Any) -> None:
            def start_counting(send: Any) -> Any:  # in the worker, right after its fork
                waits.sums = dict.fromkeys(waits.KEYS, 0.0)
                return start(send)

            def leave_sums(state: Any, ok: bool) -> None:
                try:
                    end(state, ok)
                finally:
                    (waits.folder / f"{os.getpid()}.json").write_text(json.dumps(waits.sums))
            init(pool, n, start=start_counting, end=leave_sums, **kw)

        write_behind_mod._IOThread.submit = timed_submit  # type: ignore[method-assign]
        writer_mod._ShardIO._turn = timed_turn  # type: ignore[method-assign]
        writer_mod._pwrite = timed_pwrite  # writer.py looks it up at each call
        procs_mod.WorkerProcesses.__init__ = traced_init  # type: ignore[method-assign]

    def collected(self) -> tuple[int, dict[str, float]]:
        """(processes that left sums, their totals); this process's own sums when none did (threads)."""
        found = [json.loads(p.read_text()) for p in sorted(self.folder.glob("*.json"))]
        if not found:
            return 1, dict(self.sums)
        return len(found), {k: sum(f[k] for f in found) for k in self.KEYS}


class Trace:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.items: list[dict[str, Any]] = []
        self.hashes: list[dict[str, Any]] = []
        self.samples: list[tuple[float, float, float, list[tuple[str, int, int, int]]]] = []
        self.files: list[writer_mod.ShardFile] = []
        self._lock = threading.Lock()
        self._done = threading.Event()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def install(self) -> None:
        """Wrap run_items (each item's span), ShardFile.__init__ (the open shards) and
        ShardFile.hash_and_seal (each shard's hashing span)."""
        run_items, init, hash_and_seal = workers_mod.run_items, writer_mod.ShardFile.__init__, \
            writer_mod.ShardFile.hash_and_seal
        run_in_processes = procs_mod.WorkerProcesses.run_items
        trace = self

        def traced_processes(pool: procs_mod.WorkerProcesses, work: list[workers_mod.Item], task: Any, *,
                             prepare: Any, finished: Any, **kw: Any) -> None:
            started: dict[int, float] = {}

            def timed_prepare(item: workers_mod.Item) -> None:
                prepare(item)
                started[id(item)] = trace.now()

            def timed_finished(item: workers_mod.Item, result: Any) -> None:
                finished(item, result)
                with trace._lock:
                    trace.items.append({"thread": "process", "group": item.group.key, "rank": item.rank,
                                        "span": item.span, "part": item.part, "start": started.pop(id(item)),
                                        "end": trace.now()})
            run_in_processes(pool, work, task, prepare=timed_prepare, finished=timed_finished, **kw)

        def traced_run_items(work: list[workers_mod.Item], do: Any, **kw: Any) -> None:
            def timed(item: workers_mod.Item, state: object) -> None:
                a = trace.now()
                do(item, state)
                with trace._lock:
                    trace.items.append({"thread": threading.current_thread().name, "group": item.group.key,
                                        "rank": item.rank, "span": item.span, "part": item.part, "start": a,
                                        "end": trace.now()})
            run_items(work, timed, **kw)

        def traced_init(sh: writer_mod.ShardFile, *a: Any, **k: Any) -> None:
            init(sh, *a, **k)
            with trace._lock:
                trace.files.append(sh)

        def traced_hash(sh: writer_mod.ShardFile) -> None:
            a = trace.now()
            hash_and_seal(sh)
            with trace._lock:
                trace.hashes.append({"file": sh.rel, "bytes": sh.size, "start": a, "end": trace.now()})

        workers_mod.run_items = traced_run_items  # convert.py calls them through their modules
        procs_mod.WorkerProcesses.run_items = traced_processes  # type: ignore[method-assign]
        writer_mod.ShardFile.__init__ = traced_init  # type: ignore[method-assign]
        writer_mod.ShardFile.hash_and_seal = traced_hash  # type: ignore[method-assign]

    def sample_forever(self) -> None:
        while not self._done.is_set():
            user, sys_ = tree_cpu()
            with self._lock:
                files = [(f.rel, f.frontier, f.hashed, f.size) for f in self.files]
            self.samples.append((self.now(), user, sys_, files))
            time.sleep(0.1)

    def stop(self) -> None:
        self._done.set()


def summary(tr: Trace, start: float, end: float) -> list[str]:
    lines = []
    groups: dict[str, list[dict[str, Any]]] = {}
    for it in tr.items:
        groups.setdefault(it["group"], []).append(it)
    for g, its in groups.items():
        lines.append(f"  {g:12s} {len(its):4d} items, {min(i['start'] for i in its) - start:7.2f} .. "
                     f"{max(i['end'] for i in its) - start:7.2f} s, {sum(i['end'] - i['start'] for i in its):8.1f} item-s")
    if tr.items:
        last = max(i["end"] for i in tr.items) - start
        ends = sorted(h["end"] - start for h in tr.hashes)
        lines.append(f"  last item ends at {last:.2f} s; shards sealed at " + ", ".join(f"{e:.2f}" for e in ends))
        big = max(groups.values(), key=lambda its: sum(i["end"] - i["start"] for i in its))
        a, b = min(i["start"] for i in big), max(i["end"] for i in big)
        pts = [s for s in tr.samples if a <= s[0] <= b]
        if len(pts) >= 2 and b > a:
            busy = (pts[-1][1] + pts[-1][2] - pts[0][1] - pts[0][2]) / (pts[-1][0] - pts[0][0])
            running = sum(min(i["end"], b) - max(i["start"], a) for i in big) / (b - a)
            lines.append(f"  over {big[0]['group']} ({b - a:.2f} s): cores busy {busy:.1f}, items running {running:.1f}")
        else:
            lines.append(f"  over {big[0]['group']} ({b - a:.2f} s): cores busy not measured (shorter than two 0.1 s samples)")
        lines.append("  items running per tenth of the call: " + " ".join(f"{x:.1f}" for x in running_profile(tr, start, end)))
    return lines


def running_profile(tr: Trace, start: float, end: float, bins: int = 10) -> list[float]:
    """The average number of items in progress in each of `bins` equal spans of [start, end]."""
    width = max(end - start, 1e-9) / bins
    out = []
    for k in range(bins):
        lo, hi = start + k * width, start + (k + 1) * width
        out.append(sum(max(0.0, min(i["end"], hi) - max(i["start"], lo)) for i in tr.items) / width)
    return out


def order_cost(tr: Trace, workers: int) -> dict[str, float]:
    """List scheduling of the measured item spans on `workers`: in the order they were handed out,
    longest first, and the perfect balance (their sum over the workers)."""
    spans = [i["end"] - i["start"] for i in sorted(tr.items, key=lambda i: i["start"])]
    return {"handed_out": list_schedule(spans, workers), "longest_first": list_schedule(sorted(spans, reverse=True), workers),
            "balanced": sum(spans) / max(1, workers)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("--dst", type=Path, default=None, help="output folder (default: beside SRC; removed afterwards)")
    ap.add_argument("--target", default="gfx950")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--workers", type=int, default=None, help="default: every usable core")
    ap.add_argument("--worker-mode", default="auto", choices=("auto", "process", "thread"))
    ap.add_argument("--shard-size", default=None, help="the conversion's shard size (default: the tool's)")
    ap.add_argument("--set", action="append", default=[], metavar="atom_convert.MODULE.NAME=JSON",
                    help="a module constant set before the conversion (repeatable)")
    ap.add_argument("--json", type=Path, default=None, help="write the whole record here")
    args = ap.parse_args(argv)

    import atom_convert
    import atom_convert.engine.convert  # noqa: F401  (the engine's modules, for --set)

    for item in args.set:
        target, eq, value = item.partition("=")
        mod, _, name = target.rpartition(".")
        if not eq or not mod.startswith("atom_convert") or not hasattr(importlib.import_module(mod), name):
            raise SystemExit(f"--set {item!r}: expected atom_convert.MODULE.NAME=JSON naming a constant")
        setattr(importlib.import_module(mod), name, json.loads(value))

    dst = args.dst or args.src.parent / f"{args.src.name}-trace-out"
    if dst.exists():
        raise SystemExit(f"{dst} exists: remove it or pass another --dst")
    tr = Trace()
    tr.install()
    scratch = Path(tempfile.mkdtemp(prefix="trace-waits-"))
    waits = Waits(scratch)
    waits.install()
    sampler = threading.Thread(target=tr.sample_forever, daemon=True)
    sampler.start()
    start, c0, m0 = tr.now(), tree_cpu(), cpu_times()[1]
    try:
        atom_convert.convert(args.src, dst, args.target, tp=args.tp, workers=args.workers,
                             worker_mode=args.worker_mode, shard_size=args.shard_size)
        end, c1, m1 = tr.now(), tree_cpu(), cpu_times()[1]
        processes, sums = waits.collected()
    finally:
        tr.stop()
        shutil.rmtree(dst, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    workers = args.workers or workers_mod.usable_cores()
    settings = f"shard size {args.shard_size or 'default'}" + "".join(" " + x for x in args.set)
    print(f"{args.target} tp={args.tp} workers={workers} ({args.worker_mode}) {settings}: {end - start:.2f} s, CPU "
          f"{c1[0] - c0[0]:.1f} user + {c1[1] - c0[1]:.1f} sys; the machine's cores busy {(m1 - m0) / (end - start):.1f}")
    print("\n".join(summary(tr, start, end)))
    print(f"  waits in {processes} converting process(es): write-behind queue full {sums['queue_s']:.2f} s, turn at a "
          f"shard file {sums['turn_s']:.2f} s, pwrite {sums['pwrite_s']:.2f} s for {sums['pwrite_bytes'] / 1e9:.2f} GB")
    cost = order_cost(tr, workers)
    if tr.items:
        print(f"  the hand-out order: the item spans list-scheduled on {workers} workers end at {cost['handed_out']:.2f} s "
              f"in that order, {cost['longest_first']:.2f} s longest first, {cost['balanced']:.2f} s balanced")
    if args.json:
        args.json.write_text(json.dumps({"target": args.target, "tp": args.tp, "workers": workers,
                                         "shard_size": args.shard_size, "set": args.set, "start": start,
                                         "end": end, "items": tr.items, "hashes": tr.hashes,
                                         "samples": tr.samples, "machine_busy_s": m1 - m0,
                                         "waits": {"processes": processes, **sums}, "order": cost}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
