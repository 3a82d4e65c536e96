"""Timeline of one conversion: where the cores go while the workers run.

What it records, without changing the conversion (it wraps functions of the package):
- every item (`workers.Item`: layer or group, rank, expert range) with its worker thread, start and end
  (with worker processes, `--worker-mode process`, the default for several workers: from the moment
  the item is handed to a process to the moment its "done" arrives);
- every shard's hashing thread: its start and the moment it sealed the shard;
- every 0.1 s the CPU time (user, sys) of the process and its worker processes, and each open shard's
  written and hashed bytes.

It prints, per group, the items' span and their summed seconds; the end of the last item against the
end of the last hash; and over the largest group's span the **cores busy** (process CPU seconds per
second) against the **items running** (average number in progress). Many items running on few busy
cores means the workers wait on something they share (BENCHMARKS.md, "Issue 9, fourth round"). The
whole record goes to `--json` for plotting.

Usage: python bench/trace_convert.py SRC [--target gfx950] [--tp 8] [--workers N]
       [--worker-mode auto|process|thread] [--json out.json]
(SRC: e.g. a source made by `bench/bench_convert.py --generate-only`; the output goes to a scratch
folder beside SRC, or `--dst`, and is removed afterwards.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from atom_convert.engine import procs as procs_mod  # noqa: E402
from atom_convert.engine import workers as workers_mod  # noqa: E402
from atom_convert.engine import writer as writer_mod  # noqa: E402

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
                                        "part": item.part, "start": started.pop(id(item)), "end": trace.now()})
            run_in_processes(pool, work, task, prepare=timed_prepare, finished=timed_finished, **kw)

        def traced_run_items(work: list[workers_mod.Item], do: Any, **kw: Any) -> None:
            def timed(item: workers_mod.Item, state: object) -> None:
                a = trace.now()
                do(item, state)
                with trace._lock:
                    trace.items.append({"thread": threading.current_thread().name, "group": item.group.key,
                                        "rank": item.rank, "part": item.part, "start": a, "end": trace.now()})
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
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("--dst", type=Path, default=None, help="output folder (default: beside SRC; removed afterwards)")
    ap.add_argument("--target", default="gfx950")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--workers", type=int, default=None, help="default: every usable core")
    ap.add_argument("--worker-mode", default="auto", choices=("auto", "process", "thread"))
    ap.add_argument("--json", type=Path, default=None, help="write the whole record here")
    args = ap.parse_args(argv)

    import atom_convert

    dst = args.dst or args.src.parent / f"{args.src.name}-trace-out"
    if dst.exists():
        raise SystemExit(f"{dst} exists: remove it or pass another --dst")
    tr = Trace()
    tr.install()
    sampler = threading.Thread(target=tr.sample_forever, daemon=True)
    sampler.start()
    start, c0 = tr.now(), tree_cpu()
    try:
        atom_convert.convert(args.src, dst, args.target, tp=args.tp, workers=args.workers,
                             worker_mode=args.worker_mode)
        end, c1 = tr.now(), tree_cpu()
    finally:
        tr.stop()
        shutil.rmtree(dst, ignore_errors=True)
    workers = args.workers or workers_mod.usable_cores()
    print(f"{args.target} tp={args.tp} workers={workers} ({args.worker_mode}): {end - start:.2f} s, CPU "
          f"{c1[0] - c0[0]:.1f} user + {c1[1] - c0[1]:.1f} sys")
    print("\n".join(summary(tr, start, end)))
    if args.json:
        args.json.write_text(json.dumps({"target": args.target, "tp": args.tp, "workers": workers, "start": start,
                                         "end": end, "items": tr.items, "hashes": tr.hashes,
                                         "samples": tr.samples}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
