#!/usr/bin/env python3
"""Two or more versions of the package, one warm conversion each in turn, round after round.

For an A/B of a change on one machine in one run: each conversion runs in a fresh Python process
whose `sys.path` starts with that version's root (a checkout, or `git archive REV atom_convert |
tar -x -C DIR`), with torch and the engine imported before the clock (torch's import alone takes
seconds). Reported per conversion: the call's seconds, GB/s of source, and the user and system CPU
of the process and its worker processes (rusage), and the machine's free memory and page cache just
before it (`memory_gb`); at the end, each version's best and median.

    python bench/ab_packages.py SRC --version old=/tmp/old --version new=. [--set new4=.:atom_convert.engine.workers.ITEMS_PER_WORKER=4]
        [--tp 8] [--target gfx950] [--workers 16] [--rounds 4] [--dst /dev/shm/ab] [--json out.json]

`--set LABEL=ROOT:MODULE.NAME=VALUE[,...]`: a version with module constants set (VALUE is JSON) before
it converts; an item without the `atom_convert.` prefix is a conversion option instead (`shard_size=500MB`:
a field of ConversionOptions, the value as the option takes it). The output folder is removed before each
conversion and at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

CHILD = r"""
import glob, json, os, resource, sys, time
root, src, dst, opts, sets = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), json.loads(sys.argv[5])
opts.update(sets.pop("options", {}))
sys.path.insert(0, root)
import importlib
import torch  # noqa: F401  (before the clock)
import atom_convert
import atom_convert.engine.convert  # noqa: F401
for target, value in sets.items():
    mod, _, name = target.rpartition(".")
    m = importlib.import_module(mod)
    if not hasattr(m, name):
        sys.exit(f"ab_packages: {root}: {mod} has no {name}")
    setattr(m, name, value)
if not os.path.realpath(atom_convert.__file__).startswith(os.path.realpath(root) + os.sep):
    sys.exit(f"ab_packages: atom_convert came from {atom_convert.__file__}, not from {root}")
s0 = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.perf_counter()
atom_convert.convert(src, dst, **opts)
t = time.perf_counter() - t0
s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
files = glob.glob(os.path.join(dst, "**", "*.safetensors"), recursive=True)
print(json.dumps({"seconds": t, "user": s.ru_utime - s0.ru_utime + c.ru_utime,
                  "sys": s.ru_stime - s0.ru_stime + c.ru_stime, "out_bytes": sum(map(os.path.getsize, files)),
                  "out_files": len(files)}))
"""


def parse_version(text: str, with_sets: bool) -> tuple[str, Path, dict[str, Any]]:
    label, eq, rest = text.partition("=")
    if not eq or not label or not rest:
        sys.exit(f"ab_packages: {text!r}: expected LABEL=ROOT" + (":MODULE.NAME=VALUE[,...]" if with_sets else ""))
    root, sets = rest, {}
    if with_sets:
        root, _, spec = rest.partition(":")
        for item in filter(None, spec.split(",")):
            target, _, value = item.partition("=")
            if not value or not (target.startswith("atom_convert.") or target.isidentifier()):
                sys.exit(f"ab_packages: --set {text!r}: {item!r} is neither atom_convert.MODULE.NAME=VALUE nor "
                         f"OPTION=VALUE")
            if target.startswith("atom_convert."):
                sets[target] = json.loads(value)
            else:  # a conversion option: JSON where it parses (numbers, true), else the text (500MB)
                try:
                    parsed = json.loads(value)
                except json.JSONDecodeError:
                    parsed = value
                sets.setdefault("options", {})[target] = parsed
    path = Path(root).resolve()
    if not (path / "atom_convert" / "__init__.py").is_file():
        sys.exit(f"ab_packages: {root}: no atom_convert package there")
    return label, path, sets


def memory_gb() -> dict[str, float]:
    """The machine's free memory and page cache now (/proc/meminfo, GB; empty where there is none). A
    box whose hypervisor hands out fresh memory page by page converts into tmpfs at a rate that
    follows this state (BENCHMARKS.md, thirty-second round), so each run records it."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    kb = {k: int(v.split()[0]) for k, _, v in (ln.partition(":") for ln in lines) if v.strip()}
    return {"mem_free_gb": kb.get("MemFree", 0) * 1024 / 1e9, "cached_gb": kb.get("Cached", 0) * 1024 / 1e9}


def source_bytes(src: Path) -> int:
    return sum(p.stat().st_size for p in src.glob("*.safetensors"))


def one(root: Path, src: Path, dst: Path, opts: dict[str, Any], sets: dict[str, Any]) -> dict[str, Any]:
    shutil.rmtree(dst, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    extra = os.environ.get("PYTHONPATH")  # e.g. the hashing wheels' folder, after the version's root
    if extra:
        env["PYTHONPATH"] = extra
    r = subprocess.run([sys.executable, "-c", CHILD, str(root), str(src), str(dst), json.dumps(opts), json.dumps(sets)],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"ab_packages: {root}: the conversion failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("--version", action="append", default=[], metavar="LABEL=ROOT")
    ap.add_argument("--set", action="append", default=[], metavar="LABEL=ROOT:MODULE.NAME=VALUE[,...]")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--target", default="gfx950")
    ap.add_argument("--workers", type=int, default=None, help="default: every usable core")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dst", type=Path, default=Path("/dev/shm/ab-packages"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    versions = [parse_version(v, False) for v in a.version] + [parse_version(v, True) for v in a.set]
    if len(versions) < 2:
        ap.error("give at least two versions (--version or --set)")
    if len({v[0] for v in versions}) != len(versions):
        ap.error("two versions have the same label")
    if a.dst.exists() or a.dst.is_symlink():
        ap.error(f"--dst {a.dst} exists; give a folder this run may create and remove")
    src = a.src.resolve()
    gb = source_bytes(src) / 1e9
    opts = {"target": a.target, "tp": a.tp, "workers": a.workers}
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in versions}
    try:
        for r in range(1, a.rounds + 1):
            for label, root, sets in versions:
                mem = memory_gb()
                rec = {**one(root, src, a.dst, opts, sets), **mem}
                runs[label].append(rec)
                t = rec["seconds"]
                free = f", {mem['mem_free_gb']:.1f} GB free before" if mem else ""
                print(f"[ab] {label:<10} round {r}: {t:.2f} s, {gb / t:.2f} GB/s of source, CPU user "
                      f"{rec['user']:.1f} s sys {rec['sys']:.1f} s, cores busy {(rec['user'] + rec['sys']) / t:.1f}"
                      f"{free}", flush=True)
    finally:
        shutil.rmtree(a.dst, ignore_errors=True)
    for label, recs in runs.items():
        ts = [x["seconds"] for x in recs]
        print(f"{label:<10} best {min(ts):.2f} s ({gb / min(ts):.2f} GB/s), median {statistics.median(ts):.2f} s")
    if a.json:
        a.json.write_text(json.dumps({"source_gb": gb, "options": opts, "runs": runs,
                                      "versions": {lb: {"root": str(rt), "set": st} for lb, rt, st in versions}},
                                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
