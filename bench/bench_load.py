#!/usr/bin/env python3
"""Serving-startup benchmark: time until one rank's tensors sit in GPU parameters (issue 11).

One run of this script, on a machine with a CUDA GPU:
1. generates (or reuses) the synthetic fp8 checkpoint of bench_convert.py at DeepSeek-V3 width
   (2 layers: one dense, one MoE with 256 routed + 1 shared expert; real vocabulary) and converts it
   for `--target` at `--tp` (default gfx942, tp 8: the fnuz step is then part of the baseline (c));
2. measures the machine's ceilings in the same run: the disk's read rate for the rank's files (cold
   page cache; a single sequential reader and 8 parallel readers, the better one counts) and pinned
   host-to-device bandwidth (1 GiB, best of 3);
3. times, cold (page cache dropped) and then warm (same files just read), each from an empty GPU:
   (a) `atom_convert.load_into` from the converted files into a module tree on meta;
   (b) safetensors `safe_open(f, device="cuda")`, every tensor of the rank's files;
   (c) the original checkpoint through bench/atom_standin.py (ATOM's path: name mapping, the rank's
       slices, expert stacking, fnuz and shuffle on the GPU);
   (d) instanttensor's `safe_open(files, device=...)`, when it imports;
   and, warm, (a) over a sweep of reader threads and chunk sizes;
4. checks (a)'s bytes against safetensors' CPU read of every tensor, counts (c)'s tensors that are
   byte-equal to (a)'s, and runs `verify --through-loader` on the GPU for a tiny converted checkpoint;
5. writes a JSON report (`--out`, default bench/results/<stamp>-load.json) and prints a summary.

Page cache: "cold" writes 3 to /proc/sys/vm/drop_caches after a sync; where that is refused it
calls posix_fadvise(DONTNEED) on every file read; the report says which worked, and the cold disk
read measured right after says whether the cache really was empty.

Examples:
    python bench/bench_load.py                    # full width, tp 8, gfx942 (~32 GB of disk)
    python bench/bench_load.py --smoke            # 8 experts, vocab 16384: checks the script
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

GB = 1e9


def drop_cache(files: list[Path]) -> str:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        how = "drop_caches"
    except OSError as e:
        how = f"fadvise (drop_caches refused: {e.strerror})"
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return how


def read_files(files: list[Path], threads: int, chunk: int = 64 << 20) -> float:
    """Seconds to read every byte of `files` into host memory (no GPU), `threads` readers."""
    jobs = [(p, off) for p in files for off in range(0, p.stat().st_size, chunk)]
    it, lock = iter(jobs), threading.Lock()

    def work() -> None:
        buf = bytearray(chunk)
        fds: dict[Path, int] = {}
        while True:
            with lock:
                j = next(it, None)
            if j is None:
                break
            p, off = j
            fd = fds.setdefault(p, os.open(p, os.O_RDONLY))
            os.preadv(fd, [buf], off)
        for fd in fds.values():
            os.close(fd)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def memcpy_to_pinned(files: list[Path], threads: int, chunk: int = 64 << 20) -> float:
    """Seconds to memcpy every byte of `files` (mapped, in the page cache) into pinned 64 MB buffers
    on `threads` threads: the host-side ceiling of a pinned pipeline."""
    import mmap

    import numpy as np

    maps = {p: np.frombuffer(mmap.mmap(os.open(p, os.O_RDONLY), 0, access=mmap.ACCESS_READ), dtype=np.uint8)
            for p in files}
    jobs = [(p, off) for p in files for off in range(0, p.stat().st_size, chunk)]
    it, lock = iter(jobs), threading.Lock()
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True).numpy() for _ in range(threads)]

    def work(w: int) -> None:
        while True:
            with lock:
                j = next(it, None)
            if j is None:
                break
            p, off = j
            src = maps[p][off:off + chunk]
            np.copyto(bufs[w][:src.size], src)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work, args=(w,)) for w in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def pinned_h2d(dev: torch.device, nbytes: int = 1 << 30) -> float:
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        d.copy_(h, non_blocking=True)
        torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t0)
    del h, d
    return nbytes / best / GB


def timed(dev: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize(dev)
    return time.perf_counter() - t0, out


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def rank_files(dst: Path, rank: int) -> list[Path]:
    m = json.loads((dst / "atom_manifest.json").read_text())
    return sorted({dst / e["rank_files"][rank] for e in m["tensors"].values()})


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


FIRST_CALL = """
import json, sys, time
sys.path.insert(0, {repo!r})
import torch
import atom_convert
from atom_convert.serve.load import module_tree, rank_view
from atom_convert.serve.transfer import prepare_pool
dev = torch.device("cuda", torch.cuda.current_device())
torch.empty(1, device=dev)  # the CUDA context, as a server has it before it loads
t0 = time.perf_counter()
if {prepare!r}:
    prepare_pool()
view = rank_view({dst!r}, {rank})
tree = module_tree(view)
time.sleep({build_s!r})
out = {{}}
for k in ("first", "second"):
    tree = module_tree(view)
    torch.cuda.synchronize()
    t = time.perf_counter()
    st = atom_convert.load_into(tree, {dst!r}, rank={rank}, device=dev, target={target!r})
    torch.cuda.synchronize()
    out[k + "_gb_s"] = round(st.bytes / (time.perf_counter() - t) / 1e9, 2)
    del tree
    torch.cuda.empty_cache()
print(json.dumps(out))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/atom-load-bench"))
    ap.add_argument("--target", default="gfx942", choices=("gfx942", "gfx950"))
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--smoke", action="store_true", help="8 experts, vocab 16384")
    ap.add_argument("--sweep", default="pread:8:32,pread:16:64,mmap:8:32,mmap:16:32,mmap:16:64,register:8:32,"
                    "register:16:64,register:16:128", help="warm (a) runs, reader:threads:chunk_MB")
    ap.add_argument("--cold-readers", default="pread,mmap,register", help="cold (a) runs, one per reader")
    ap.add_argument("--only", default="a,b,c,d,e", help="methods to time cold and warm (a, b, c, d, e)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-first-call", action="store_true", help="skip the first-call children")
    args = ap.parse_args(argv)

    import atom_convert
    from atom_convert.serve.load import module_tree, rank_view
    from atom_convert.synth import build_random
    from bench_convert import bench_config

    dev = torch.device("cuda", torch.cuda.current_device())
    experts = args.experts or (8 if args.smoke else 256)
    vocab = args.vocab or (16384 if args.smoke else 129280)
    cfg = bench_config(2, experts, vocab, "fp8")
    cfg.pop("_bench_format", None)
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = args.workdir / f"src-E{experts}-V{vocab}"
    dst = args.workdir / f"conv-E{experts}-V{vocab}-{args.target}-tp{args.tp}"
    report: dict[str, Any] = {
        "when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "gpu": torch.cuda.get_device_name(dev),
                    "torch": torch.__version__, "python": platform.python_version()},
        "setup": {"experts": experts, "vocab": vocab, "target": args.target, "tp": args.tp, "rank": args.rank},
    }
    out_path = args.out or REPO / "bench" / "results" / f"{_dt.datetime.now():%Y%m%d-%H%M%S}-load.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every phase, so that a run cut short still leaves its numbers
        out_path.write_text(json.dumps(report, indent=1, default=str))

    t0 = time.perf_counter()
    if not (src / "model.safetensors.index.json").exists():
        build_random(cfg, src, fmt="fp8", seed=0, shard_bytes=4 * 1000**3)
    report["setup"]["generate_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    if not (dst / "atom_manifest.json").exists():
        atom_convert.convert(src, dst, target=args.target, tp=args.tp)
    report["setup"]["convert_s"] = round(time.perf_counter() - t0, 1)
    files = rank_files(dst, args.rank)
    src_files = sorted(src.glob("*.safetensors"))
    rank_bytes = sum(p.stat().st_size for p in files)
    report["setup"]["rank_file_bytes"] = rank_bytes
    print(f"rank {args.rank}: {len(files)} files, {rank_bytes / GB:.2f} GB; setup {report['setup']}", flush=True)

    torch.empty(1, device=dev)  # CUDA context outside every timing
    ceil: dict[str, Any] = {"pinned_h2d_gb_s": round(pinned_h2d(dev), 2)}
    ceil["cache_drop"] = drop_cache(files)
    ceil["disk_read_cold_1thread_gb_s"] = round(rank_bytes / read_files(files, 1) / GB, 2)
    drop_cache(files)
    ceil["disk_read_cold_8threads_gb_s"] = round(rank_bytes / read_files(files, 8) / GB, 2)
    ceil["disk_read_cold_gb_s"] = max(ceil["disk_read_cold_1thread_gb_s"], ceil["disk_read_cold_8threads_gb_s"])
    ceil["page_cache_read_warm_8threads_gb_s"] = round(rank_bytes / read_files(files, 8) / GB, 2)
    ceil["page_cache_memcpy_to_pinned_16threads_gb_s"] = round(rank_bytes / memcpy_to_pinned(files, 16) / GB, 2)
    report["ceilings"] = ceil
    save()
    print("ceilings", ceil, flush=True)

    # The first load_into of a fresh process (a server loads once per process), warm, each in its own
    # child: pinned pool pinned inside the call, or by prepare_pool while the model is built (what the
    # runtime hooks do; the build here is module_tree plus `build_s` of waiting, a stand-in for
    # ATOM's model construction, which takes seconds at full width).
    first: dict[str, Any] = {}
    read_files(files, 8)
    for build_s in ([] if args.no_first_call else [None, 0.0, 1.0, 2.0]):
        code = FIRST_CALL.format(repo=str(REPO), dst=str(dst), rank=args.rank, target=args.target,
                                 prepare=build_s is not None, build_s=build_s or 0.0)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        key = "no_prepare" if build_s is None else f"prepare_pool_build_{build_s:g}s"
        try:
            first[key] = json.loads(r.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            first[key] = {"error": r.stderr[-1500:]}
        print("first call", key, first[key], flush=True)
    report["first_call_fresh_process"] = first
    save()
    from atom_convert.serve.transfer import prepare_pool
    pool = prepare_pool()  # as the runtime hooks do before the model is built
    if pool is not None:
        pool.join()

    view = rank_view(dst, args.rank)
    inner_seconds: list[float] = []  # load_into's own seconds (LoadStats), run by run

    def run_a(threads: int | None = None, chunk: int | None = None, reader: str | None = None) -> dict[str, torch.Tensor]:
        tree = module_tree(view)  # the model build, outside load_into (ATOM builds its model first)
        st = atom_convert.load_into(tree, dst, rank=args.rank, device=dev, target=args.target, threads=threads,
                                    chunk_bytes=chunk, reader=reader)
        inner_seconds.append(st.seconds)
        out = {}
        for n in view.tensors:
            mod, _, attr = n.rpartition(".")
            m = tree.get_submodule(mod)
            out[n] = m._parameters[attr] if attr in m._parameters else getattr(m, attr)
        return out

    def run_b() -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        out = {}
        for p in files:
            with safe_open(str(p), framework="pt", device=str(dev)) as h:
                for k in h.keys():
                    out[k] = h.get_tensor(k)
        return out

    def run_c() -> dict[str, torch.Tensor]:
        from atom_standin import load_rank

        return load_rank(src, args.rank, args.tp, args.target, dev)[0]

    methods: dict[str, Callable[[], dict[str, torch.Tensor]]] = {"a_load_into": run_a, "b_safetensors_cuda": run_b,
                                                                  "c_atom_standin": run_c}
    try:
        import instanttensor

        def run_d() -> dict[str, torch.Tensor]:
            out = {}
            with instanttensor.safe_open([str(p) for p in files], framework="pt", device=dev.index) as f:
                for k, t in f.tensors():
                    out[k] = t
            return out

        def run_d2() -> dict[str, torch.Tensor]:
            out = {}
            with instanttensor.safe_open([str(p) for p in files], framework="pt", device=dev.index,
                                         backend=instanttensor.BackendPolicy.BUFFERED) as f:
                for k, t in f.tensors():
                    out[k] = t
            return out

        methods["d_instanttensor"] = run_d
        methods["d_instanttensor_buffered"] = run_d2
        report["instanttensor"] = getattr(instanttensor, "__version__", "imported")
    except Exception as e:  # not installed, or its binary does not fit this torch
        report["instanttensor"] = f"not run: {type(e).__name__}: {e}"
    try:
        import fastsafetensors

        def run_e() -> dict[str, torch.Tensor]:
            out = {}
            with fastsafetensors.fastsafe_open([str(p) for p in files], framework="pt", device=str(dev),
                                               nogds=True) as f:
                for k in f.keys():
                    out[k] = f.get_tensor(k)
            return out

        methods["e_fastsafetensors_nogds"] = run_e
        report["fastsafetensors"] = getattr(fastsafetensors, "__version__", "imported")
    except Exception as e:
        report["fastsafetensors"] = f"not run: {type(e).__name__}: {e}"

    runs: dict[str, Any] = {}
    kept: dict[str, dict[str, torch.Tensor]] = {}
    only = set(args.only.split(","))
    methods = {k: v for k, v in methods.items() if k[0] in only}
    for name, fn in methods.items():
        for state in ("cold", "warm"):
            read = src_files if name.startswith("c_") else files
            if state == "cold":
                how = drop_cache(read)
            else:  # in the page cache whatever the cold run did (an O_DIRECT read leaves it as it was)
                read_files(read, 8)
                how = "filled"
            try:
                sec, out = timed(dev, fn)
            except Exception as e:
                runs[f"{name}/{state}"] = {"error": f"{type(e).__name__}: {e}"}
                print(name, state, "ERROR", e, flush=True)
                continue
            nb = tensor_bytes(out)
            runs[f"{name}/{state}"] = {"seconds": round(sec, 4), "bytes": nb, "gb_s": round(nb / sec / GB, 2),
                                       "cache": how}
            if name.startswith("a_"):
                runs[f"{name}/{state}"]["load_into_seconds"] = round(inner_seconds[-1], 4)
                runs[f"{name}/{state}"]["load_into_gb_s"] = round(nb / inner_seconds[-1] / GB, 2)
            print(f"{name:22s} {state}: {sec:7.3f} s  {nb / sec / GB:6.2f} GB/s", flush=True)
            report["runs"] = runs
            save()
            if state == "warm" and name in ("a_load_into", "c_atom_standin"):
                kept[name] = out
            del out
    for rd in [r for r in args.cold_readers.split(",") if r]:
        how = drop_cache(files)
        try:
            sec, out = timed(dev, lambda: run_a(reader=rd))
        except Exception as e:
            runs[f"a_load_into/cold/{rd}"] = {"error": f"{type(e).__name__}: {e}"}
            print("a cold", rd, "ERROR", e, flush=True)
            continue
        nb = tensor_bytes(out)
        del out
        runs[f"a_load_into/cold/{rd}"] = {"seconds": round(sec, 4), "gb_s": round(nb / sec / GB, 2), "cache": how,
                                          "load_into_gb_s": round(nb / inner_seconds[-1] / GB, 2)}
        print(f"a cold reader={rd}: {nb / sec / GB:6.2f} GB/s (load_into alone {nb / inner_seconds[-1] / GB:6.2f})", flush=True)
        save()
    read_files(files, 8)  # warm again
    for spec in [x for x in args.sweep.split(",") if x]:
        rd, th, mb = spec.split(":")
        best = float("inf")
        inner_seconds.clear()
        wrong: list[str] = []
        try:
            for rep in range(3):
                sec, out = timed(dev, lambda: run_a(int(th), int(mb) << 20, rd))
                best = min(best, sec)
                nb = tensor_bytes(out)
                if rep == 0 and "a_load_into" in kept:  # every reader's bytes against the checked default run
                    ref = kept["a_load_into"]
                    wrong = [k for k in ref if not torch.equal(as_bytes(out[k]), as_bytes(ref[k]))]
                del out
        except Exception as e:
            runs[f"a_load_into/warm/{spec}"] = {"error": f"{type(e).__name__}: {e}"}
            print("a warm", spec, "ERROR", e, flush=True)
            continue
        inner = min(inner_seconds)
        runs[f"a_load_into/warm/{spec}"] = {"seconds": round(best, 4), "gb_s": round(nb / best / GB, 2),
                                            "load_into_seconds": round(inner, 4), "load_into_gb_s": round(nb / inner / GB, 2),
                                            "tensors_differing_from_default_run": wrong}
        print(f"a warm {rd} threads={th} chunk={mb}MB (best of 3): {nb / best / GB:6.2f} GB/s "
              f"(load_into alone {nb / inner / GB:6.2f})", flush=True)
        save()
    report["runs"] = runs

    # correctness: (a) against safetensors' own CPU read; (c) against (a)
    from safetensors import safe_open

    a = kept.get("a_load_into", {})
    bad = []
    for p in files:
        with safe_open(str(p), framework="pt", device="cpu") as h:
            for k in h.keys():
                if k not in a or not torch.equal(as_bytes(a[k]).cpu(), as_bytes(h.get_tensor(k))):
                    bad.append(k)
    c = kept.get("c_atom_standin", {})
    same = [k for k in a if k in c and c[k].shape == a[k].shape and c[k].dtype == a[k].dtype
            and torch.equal(as_bytes(c[k]), as_bytes(a[k]))]
    report["checks"] = {"a_tensors": len(a), "a_bytes_wrong": bad, "c_tensors": len(c), "c_equal_to_a": len(same),
                        "c_differs_from_a": sorted(set(a) - set(same))}
    print("checks", {k: (v if not isinstance(v, list) else v[:20]) for k, v in report["checks"].items()}, flush=True)
    save()

    # verify through the loader on the GPU (tiny checkpoint, tp 2)
    from atom_convert.synth import build_tiny
    from atom_convert.check.verify import verify

    tiny = args.workdir / "tiny"
    if not (tiny / "src" / "config.json").exists():
        build_tiny("tiny-deepseek-v3", tiny / "src", fmt="fp8", seed=5, shards=2)
    if not (tiny / "out" / "atom_manifest.json").exists():
        atom_convert.convert(tiny / "src", tiny / "out", target=args.target, tp=2)
    r = verify(tiny / "out", tiny / "src", device="cuda", through_loader=True, tokens=8)
    report["verify_tiny_cuda_through_loader"] = {"ok": r.ok, "failures": r.failures, "rows": r.rows}
    print("verify tiny (cuda, through loader):", "OK" if r.ok else r.failures, flush=True)

    save()
    print("wrote", out_path)
    return 0 if not bad and r.ok else 1


if __name__ == "__main__":
    sys.exit(main())
