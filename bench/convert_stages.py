"""Which stage limits a warm conversion: the same conversion with one stage switched off at a time.

Each run is a fresh subprocess converting SRC (read into the page cache first) into a new folder
under --out (default /dev/shm), with all stages on ("full") or one of them replaced by a no-op:
- "hash-pread": not a no-op: the hashing threads read the blocks they hash (those no writer sent a
  leaf for) back with preadv instead of through a mapping (ShardSetWriter's hash_from_map=False);
- "no-hash": the shards' digest (no writer takes a block's leaf, the hashing threads read nothing,
  the manifest's digests are void);
- "no-checks": the source value checks (files/values.py: NaN/Inf, fp8 NaN codes, scales);
- "no-write": the shards' pwrite (only each buffer's last byte is written, so the files have their
  size but are sparse; hashing then reads holes).
- "no-gc": Python's cyclic garbage collector off for the whole conversion (gc.disable() before it,
  inherited by the forked workers): what the collector's passes cost.
- "recycled": not a no-op: the full conversion, but right before it the child writes as many bytes as
  the source holds into a scratch file in the output's file system and deletes it. On a VM whose
  guest hands freed memory back to the host (virtio-balloon free page reporting, after about 2 s),
  the next write into new pages waits while the host provides each page again, and the conversion's
  output then pays for that; here its pages come from memory freed a moment ago, as on a host
  without a hypervisor (BENCHMARKS.md, twenty-second round).
What a switched-off stage saves is what it costs on the critical path; the runs' CPU seconds say
what it costs in all. The outputs are diagnostics only and are removed after each run.

Usage: python bench/convert_stages.py SRC [--target gfx950] [--tp 8] [--workers N] [--runs 2]
       [--stages full,hash-pread,no-hash,no-checks,no-write,no-gc] [--variant NAME:MODULE.CLASS.OPTION=VALUE]
       [--out /dev/shm] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STAGES = ("full", "hash-pread", "no-hash", "no-checks", "no-write", "no-gc", "recycled")


def writer_block() -> int:
    from atom_convert.store import digest

    return digest.BLOCK


class _NoLeaves:
    """Stands in for the writer's block leaves (store/digest.py Leaves): takes none, needs none."""

    def __init__(self, size: int) -> None:
        self.size, self.count = size, -(-size // writer_block())

    def put(self, first: int, leaves: bytes) -> None:
        pass

    def missing(self, lo: int, hi: int) -> list[int]:
        return []

    def hexdigest(self) -> str:
        return "0" * 64


def _switch_off(stage: str, variants: dict[str, dict[str, Any]]) -> None:
    from atom_convert.engine import writer
    from atom_convert.files import values

    if stage in variants:
        sys.path.insert(0, str(REPO / "bench"))
        from bench_convert import apply_variant

        apply_variant(variants[stage])
    elif stage == "no-hash":
        class _Digest:  # the writer's `digest` module: no leaves taken, none needed
            BLOCK = writer.digest.BLOCK
            Leaves = _NoLeaves

            @staticmethod
            def leaves_within(data: Any, offset: int) -> None:
                return None
        writer.digest = _Digest  # type: ignore[assignment]
    elif stage == "no-gc":
        import gc

        gc.disable()
    elif stage == "hash-pread":
        sys.path.insert(0, str(REPO / "bench"))
        from bench_convert import apply_variant

        apply_variant({"atom_convert.engine.writer.ShardSetWriter.hash_from_map": False})
    elif stage == "no-checks":
        for name in ("check", "scales", "e8m0"):
            setattr(values.ValueGuard, name, lambda self, *a, **k: None)
    elif stage == "no-write":
        def last_byte_only(fd: int, data: Any, offset: int) -> int:
            mv = memoryview(data).cast("B")  # the file grows as if written (the hashing threads map it)
            os.pwrite(fd, mv[-1:], offset + len(mv) - 1) if len(mv) else None
            return len(mv)
        writer._pwrite = last_byte_only  # type: ignore[assignment]
    elif stage not in ("full", "recycled"):
        raise SystemExit(f"convert_stages: unknown stage {stage!r}; one of {', '.join(STAGES)}")


def recycle(folder: Path, nbytes: int, threads: int) -> None:
    """Write `nbytes` into a new scratch file in `folder` (`threads` writers, 8 MB at a time), then
    delete it: its pages go back to the guest's free memory, where the next writes find them."""
    from concurrent.futures import ThreadPoolExecutor

    path = folder / f".convert-stages-recycle-{os.getpid()}"
    step = 8 << 20
    buf = memoryview(b"\x5a" * step)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        def fill(k: int) -> None:
            for off in range(k * step, nbytes, threads * step):
                os.pwrite(fd, buf[:min(step, nbytes - off)], off)
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(fill, range(threads)))
    finally:
        os.close(fd)
        path.unlink()


def child(src: Path, dst: Path, stage: str, opts: dict[str, Any], variants: dict[str, dict[str, Any]],
          recycled_variants: bool = False) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    import atom_convert

    _switch_off(stage, variants)
    recycled = stage == "recycled" or (stage in variants and recycled_variants)
    if recycled:
        recycle(dst.parent, source_bytes(src), opts["workers"])
    ru0 = resource.getrusage(resource.RUSAGE_SELF)  # the CPU counted from here: the convert call's
    t0 = time.perf_counter()
    manifest = atom_convert.convert(src, dst, progress=False, **opts)
    wall = time.perf_counter() - t0
    digests = [next(v for k, v in f.items() if k != "bytes") for name, f in manifest.get("files", {}).items()
               if name.endswith(".safetensors")]
    ru_s, ru_c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"stage": stage, "recycled": recycled, "convert_seconds": wall, "files": len(digests),
            "digests_void": bool(digests) and all(d == "0" * 64 for d in digests),
            "user_seconds": ru_s.ru_utime - ru0.ru_utime + ru_c.ru_utime,
            "sys_seconds": ru_s.ru_stime - ru0.ru_stime + ru_c.ru_stime}


def source_bytes(src: Path) -> int:
    return sum(p.stat().st_size for p in src.iterdir() if p.suffix == ".safetensors")


def prewarm(src: Path) -> None:
    for p in sorted(src.iterdir()):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("--target", default="gfx950")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--workers", type=int, default=None, help="default: every usable core")
    ap.add_argument("--runs", type=int, default=2, help="runs per stage, interleaved (default 2)")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--out", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:MODULE.CLASS.OPTION=VALUE[,...]",
                    help="an extra stage: the full conversion with these options (bench_convert's --variant)")
    ap.add_argument("--recycled-variants", action="store_true",
                    help="each --variant's run recycles the output's memory first, as the recycled stage does")
    ap.add_argument("--child", nargs=2, metavar=("DST", "STAGE"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "bench"))
    from bench_convert import parse_variant

    variants = dict(parse_variant(v) for v in a.variant)
    workers = a.workers or len(os.sched_getaffinity(0))
    opts = {"target": a.target, "tp": a.tp, "workers": workers}
    if a.child:
        res = child(a.src, Path(a.child[0]), a.child[1], opts, variants, a.recycled_variants)
        print("RESULT " + json.dumps(res), flush=True)
        os._exit(0)  # as the installed command ends (no interpreter teardown)
    stages = [s for s in a.stages.split(",") if s] + [v for v in variants if v not in a.stages.split(",")]
    for s in stages:
        if s not in STAGES and s not in variants:
            ap.error(f"unknown stage {s!r}; one of {', '.join(STAGES)}")
    n = source_bytes(a.src)
    a.out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    for r in range(a.runs):
        for s in stages:
            dst = a.out / f"convert-stages-{os.getpid()}-{s}-{r}"
            prewarm(a.src)
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, __file__, str(a.src), "--target", a.target, "--tp", str(a.tp),
                                "--workers", str(workers), "--child", str(dst), s]
                               + [x for v in a.variant for x in ("--variant", v)]
                               + (["--recycled-variants"] if a.recycled_variants else []),
                               capture_output=True, text=True)
            wall = time.perf_counter() - t0
            shutil.rmtree(dst, ignore_errors=True)
            lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode != 0 or not lines:
                sys.stderr.write(p.stdout + p.stderr)
                raise SystemExit(f"convert_stages: the {s} run failed (exit {p.returncode})")
            res = json.loads(lines[-1][7:]) | {"process_seconds": wall, "run": r}
            results.append(res)
            print(f"[stages] {s:10s} run {r}: convert {res['convert_seconds']:.2f} s = "
                  f"{n / res['convert_seconds'] / 1e9:.2f} GB/s of source; CPU user {res['user_seconds']:.1f} s, "
                  f"sys {res['sys_seconds']:.1f} s, cores busy "
                  f"{(res['user_seconds'] + res['sys_seconds']) / res['convert_seconds']:.1f}",
                  flush=True)
    summary = {}
    for s in stages:
        best = min(x["convert_seconds"] for x in results if x["stage"] == s)
        summary[s] = {"best_seconds": round(best, 3), "best_gb_per_s": round(n / best / 1e9, 2)}
        print(f"{s:10s} best {best:.2f} s, {n / best / 1e9:.2f} GB/s")
    if a.json:
        a.json.write_text(json.dumps({"source_bytes": n, "options": opts, "cores": len(os.sched_getaffinity(0)),
                                      "runs": results, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
