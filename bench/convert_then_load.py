#!/usr/bin/env python3
"""A serving start that converts first: the conversion, then every rank's load, with and without
`--keep-cached` (the writer's direct writes; issue 29, BENCHMARKS.md twenty-first round).

Each run, cold: the page cache dropped, then `atom-convert convert SRC DST --tp N --target T
--workers W [--keep-cached]` in a child process, then every rank's load at once, one child process
a rank. A rank's child starts before the clock does (Python, torch, CUDA, the module tree and the
pinned pool: what a server does while it builds its model), says it is ready, and loads when told
to: `load_into` onto cuda:<rank % GPUs>, or where there is no GPU (or with --read), the rank's files
read whole, the bytes its load would read. The load's time is from "go" to the last rank's end.
A cold copy of the source (bench_convert.py's: each file copied and fsynced) gives the scale. Variants alternate, pairs in one run.

Usage: python bench/convert_then_load.py SRC [--tp 8] [--target gfx950] [--workers N] [--pairs 3]
       [--read] [--no-drop] [--out report.json]
(SRC: e.g. a source made by `bench/bench_convert.py --generate-only --keep-source`; DST and the
copy go to --workdir, default beside SRC, and are removed afterwards.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_convert import child_copy, drop_caches  # noqa: E402

VARIANTS = {"direct": [], "keep-cached": ["--keep-cached"]}

CHILD = r"""
import json, sys, time
from pathlib import Path
import torch
dst, rank, target, read, files = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1", sys.argv[5:]
if not read:
    import atom_convert
    from atom_convert.serve.load import module_tree, rank_view
    from atom_convert.serve.transfer import prepare_pool
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    torch.empty(1, device=dev)
    pool = prepare_pool()
    if pool is not None:
        pool.join()
    tree = module_tree(rank_view(dst, rank))
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
if read:
    n = 0
    for f in files:
        with open(Path(dst) / f, "rb", buffering=0) as fh:
            while chunk := fh.read(16 << 20):
                n += len(chunk)
else:
    st = atom_convert.load_into(tree, dst, rank=rank, device=dev, target=target)
    torch.cuda.synchronize(dev)
    n = st.bytes
print(json.dumps({"rank": rank, "s": time.perf_counter() - t0, "bytes": n}), flush=True)
"""


def rank_files(dst: Path, rank: int) -> list[str]:
    """The files rank `rank` reads (the manifest's own list, through the loader's view)."""
    from atom_convert.serve.load import rank_view

    return sorted({ref.file for ref in rank_view(dst, rank).tensors.values()})


def load_all(dst: Path, tp: int, target: str, read: bool) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    kids = [subprocess.Popen([sys.executable, "-c", CHILD, str(dst), str(r), target, "1" if read else "0",
                              *rank_files(dst, r)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) for r in range(tp)]
    for k in kids:
        line = k.stdout.readline()  # type: ignore[union-attr]
        if line.strip() != "ready":
            raise SystemExit(f"a rank's child failed before loading: {line!r}")
    t0 = time.perf_counter()
    for k in kids:
        k.stdin.write("go\n")  # type: ignore[union-attr]
        k.stdin.flush()  # type: ignore[union-attr]
    ranks = [json.loads(k.stdout.readline()) for k in kids]  # type: ignore[union-attr]
    wall = time.perf_counter() - t0
    for k in kids:
        if k.wait() != 0:
            raise SystemExit(f"a rank's child exited {k.returncode}")
    nbytes = sum(r["bytes"] for r in ranks)
    return {"s": wall, "bytes": nbytes, "gbps": nbytes / wall / 1e9, "slowest_rank_s": max(r["s"] for r in ranks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--target", default="gfx950", choices=("gfx950", "gfx942"))
    ap.add_argument("--workers", type=int, default=None, help="--workers of the conversion [default: its own]")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--read", action="store_true", help="read the ranks' files instead of load_into on a GPU")
    ap.add_argument("--no-drop", action="store_true", help="keep the page cache (a smoke run: nothing is cold)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import torch

    read = args.read or not torch.cuda.is_available()
    work = args.workdir or args.src.parent
    dst, copy = work / "ctl-dst", work / "ctl-copy"
    cli = [sys.executable, "-c", "from atom_convert.cli import main; main()", "convert", str(args.src), str(dst), "--tp", str(args.tp),
           "--target", args.target] + (["--workers", str(args.workers)] if args.workers else [])
    runs: list[dict[str, Any]] = []
    src_bytes = sum(p.stat().st_size for p in args.src.glob("*.safetensors"))
    copies = []

    def cold() -> None:
        """Every timed step starts with the page cache dropped (unless --no-drop); refused, the run stops."""
        if args.no_drop:
            os.sync()
        elif not drop_caches()[0]:
            raise SystemExit("cannot drop the page cache (needs root); --no-drop runs warm")

    for i in range(args.pairs):
        shutil.rmtree(copy, ignore_errors=True)
        cold()
        t0 = time.perf_counter()
        child_copy(args.src, copy)
        copies.append(time.perf_counter() - t0)
        shutil.rmtree(copy)
        for name, flags in VARIANTS.items():
            shutil.rmtree(dst, ignore_errors=True)
            cold()
            t0 = time.perf_counter()
            subprocess.run(cli + flags, check=True, stdout=subprocess.DEVNULL, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
            conv = time.perf_counter() - t0
            load = load_all(dst, args.tp, args.target, read)
            run = {"pair": i, "variant": name, "convert_s": conv, "load": load, "total_s": conv + load["s"]}
            runs.append(run)
            print(f"pair {i} {name:12s} convert {conv:6.2f} s  load {load['s']:6.2f} s ({load['gbps']:5.2f} GB/s, "
                  f"{load['bytes'] / 1e9:.2f} GB)  total {run['total_s']:6.2f} s", flush=True)
        print(f"pair {i} copy {copies[-1]:.2f} s ({src_bytes / copies[-1] / 1e9:.2f} GB/s)", flush=True)
    shutil.rmtree(dst, ignore_errors=True)
    summary = {name: {k: sorted(r[k] if k != "load_s" else r["load"]["s"] for r in runs if r["variant"] == name)
                      for k in ("convert_s", "load_s", "total_s")} for name in VARIANTS}
    report = {"src": str(args.src), "src_bytes": src_bytes, "tp": args.tp, "target": args.target,
              "workers": args.workers, "load": "read" if read else "load_into (cuda)",
              "cold": not args.no_drop, "copies_s": copies,
              "runs": runs, "summary": summary, "cpus": os.cpu_count(), "torch": torch.__version__}
    for name, s in summary.items():
        print(f"{name:12s} convert {s['convert_s']}  load {s['load_s']}  total {s['total_s']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
