#!/usr/bin/env python3
"""A server's start on one host (issue 25): N rank processes at once call `ensure_converted` on one
shared cache folder (one converts, the others wait), then each `load_into`s its rank onto its GPU.

One run of this script:
1. generates (or reuses) the fp8 DeepSeek-V3-width source of bench_convert.py (2 layers; --experts
   routed experts, the real vocabulary);
2. measures the host's aggregate ceilings in the same run: the disk's cold read of every rank's
   files (16 threads), a page-cache memcpy of them into pinned buffers (16 threads), pinned
   host-to-device per GPU;
3. starts --ranks processes (spawned) that wait at one barrier, then each calls
   `ensure_converted(SRC, CACHE, tp=..., ep=..., profile=...)`, counting the conversions it ran
   itself (the cache module's `convert`, wrapped in the child); the run checks that exactly one
   process converted and that all returned the same directory;
4. then, cold (page cache dropped) and warm, all ranks wait at a barrier and `load_into` their rank
   onto GPU `rank % device_count` (with one GPU, all ranks share it: the host's memory, page cache
   and disk are what is shared, as on a real server, plus one copy engine); per rank its bytes and
   seconds, and the server's figure: all bytes over the first start to the last end;
5. writes a JSON report (--out) and prints a summary.

    python bench/multi_rank.py --workdir /tmp/mr --ranks 8 --tp 8
    python bench/multi_rank.py --workdir /tmp/mr --ranks 4 --tp 4 --ep --profile vllm-plugin
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

GB = 1e9


def _child(rank: int, args: dict[str, Any], barrier: Any, queue: Any) -> None:
    import torch

    import atom_convert
    import atom_convert.engine.cache as cache_mod
    from atom_convert.serve.load import module_tree, rank_view

    converted = [0]
    real_convert = cache_mod.convert

    def counting(*a: Any, **k: Any) -> Any:
        converted[0] += 1
        return real_convert(*a, **k)

    cache_mod.convert = counting
    ngpu = torch.cuda.device_count()
    dev = torch.device("cuda", rank % ngpu) if ngpu else torch.device("cpu")
    if ngpu:
        torch.cuda.set_device(dev)
        torch.empty(1, device=dev)  # the CUDA context, as a server has it
    out: dict[str, Any] = {"rank": rank, "device": str(dev)}
    barrier.wait()
    t0 = time.time()
    entry = atom_convert.ensure_converted(args["src"], args["cache"], target=args["target"], tp=args["tp"],
                                          ep=args["ep"], profile=args["profile"])
    out.update(ensure_start=t0, ensure_end=time.time(), converted=converted[0], entry=str(entry))
    view = rank_view(entry, rank)
    for state in ("cold", "warm"):
        barrier.wait()  # the parent drops the page cache between these two
        barrier.wait()
        tree = module_tree(view)
        t = time.time()
        st = atom_convert.load_into(tree, entry, rank=rank, device=dev, target=args["target"],
                                    profile=args["profile"])
        if ngpu:
            torch.cuda.synchronize(dev)
        out[state] = {"start": t, "end": time.time(), "bytes": st.bytes, "load_into_s": st.seconds}
        del tree
        if ngpu:
            torch.cuda.empty_cache()
    queue.put(out)
    queue.close()
    queue.join_thread()  # the report is in the pipe; end as the installed command does (no exit-time joins)
    os._exit(0)


def main() -> int:
    import multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/atom-multi-rank"))
    ap.add_argument("--ranks", type=int, default=None, help="rank processes (default and at most: --tp)")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--ep", action="store_true")
    ap.add_argument("--profile", default="atom", choices=("atom", "vllm-plugin"))
    ap.add_argument("--target", default="gfx942", choices=("gfx942", "gfx950"))
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    a.ranks = a.ranks or a.tp
    if not 1 <= a.ranks <= a.tp:
        ap.error(f"--ranks {a.ranks}: a tp={a.tp} conversion has ranks 0..{a.tp - 1}")

    import torch

    from bench_convert import bench_config
    from bench_load import drop_cache, memcpy_to_pinned, pinned_h2d, read_files

    from atom_convert.synth import build_random

    a.workdir.mkdir(parents=True, exist_ok=True)
    src = a.workdir / f"src-E{a.experts}-V{a.vocab}"
    cache = a.workdir / f"cache-{a.profile}-tp{a.tp}{'-ep' if a.ep else ''}"
    cfg = bench_config(2, a.experts, a.vocab, "fp8")
    cfg.pop("_bench_format", None)
    t = time.perf_counter()
    if not (src / "model.safetensors.index.json").exists():
        build_random(cfg, src, fmt="fp8", seed=0, shard_bytes=4 * 1000**3)
    rep: dict[str, Any] = {"setup": {"ranks": a.ranks, "tp": a.tp, "ep": a.ep, "profile": a.profile,
                                     "target": a.target, "experts": a.experts, "generate_s": round(time.perf_counter() - t, 1),
                                     "gpus": torch.cuda.device_count(), "cpus": os.cpu_count()}}
    src_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    rep["setup"]["source_bytes"] = src_bytes
    print("setup", rep["setup"], flush=True)

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(a.ranks + 1)
    queue = ctx.Queue()
    args = {"src": str(src), "cache": str(cache), "target": a.target, "tp": a.tp, "ep": a.ep, "profile": a.profile}
    procs = [ctx.Process(target=_child, args=(r, args, barrier, queue)) for r in range(a.ranks)]
    for p in procs:
        p.start()
    drop_cache(sorted(src.glob("*.safetensors")))
    t_conv = time.time()
    barrier.wait()  # all ranks call ensure_converted together
    barrier.wait()  # all returned from ensure_converted
    conv_s = time.time() - t_conv
    entries = sorted(cache.glob("*/atom_manifest.json"))
    files = [p for e in entries for p in sorted(e.parent.rglob("*.safetensors"))]
    rank_bytes = sum(p.stat().st_size for p in files)
    # the host's ceilings, measured between the conversion and the loads (no rank is working now)
    ceil: dict[str, Any] = {"cache_drop": drop_cache(files)}
    ceil["disk_read_cold_16threads_gb_s"] = round(rank_bytes / read_files(files, 16) / GB, 2)
    drop_cache(files)
    ceil["disk_read_cold_8threads_gb_s"] = round(rank_bytes / read_files(files, 8) / GB, 2)
    if torch.cuda.is_available():  # (pinned memory needs a GPU; on a CPU box the load rates stand alone)
        ceil["memcpy_to_pinned_16threads_gb_s"] = round(rank_bytes / memcpy_to_pinned(files, 16) / GB, 2)
        ceil["pinned_h2d_gpu0_gb_s"] = round(pinned_h2d(torch.device("cuda", 0)), 2)
    rep["ceilings"] = ceil
    print("ceilings", ceil, flush=True)
    drop_cache(files)
    barrier.wait()  # cold loads start (each child's second wait of its cold round)
    barrier.wait()  # all cold loads done
    # warm: every rank's files in the page cache (a cold load reads with O_DIRECT, which leaves the
    # cache as it was, so the cold round does not warm it)
    rep["warm_fill_s"] = round(read_files(files, 16), 2)
    barrier.wait()  # warm loads start
    outs = [queue.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
    outs.sort(key=lambda o: o["rank"])
    rep["ranks"] = outs
    rep["conversion"] = {"wall_s": round(conv_s, 2), "conversions_run": sum(o["converted"] for o in outs),
                         "same_entry": len({o["entry"] for o in outs}) == 1,
                         "exactly_once": sum(o["converted"] for o in outs) == 1 and len({o["entry"] for o in outs}) == 1,
                         "source_gb_s": round(src_bytes / conv_s / GB, 2)}
    for state in ("cold", "warm"):
        start = min(o[state]["start"] for o in outs)
        end = max(o[state]["end"] for o in outs)
        nb = sum(o[state]["bytes"] for o in outs)
        rep[state] = {"server_s": round(end - start, 3), "server_gb_s": round(nb / (end - start) / GB, 2),
                      "bytes": nb, "per_rank_gb_s": [round(o[state]["bytes"] / (o[state]["end"] - o[state]["start"]) / GB, 2)
                                                     for o in outs]}
    rep["aims"] = {"warm_vs_memcpy": round(rep["warm"]["server_gb_s"] / ceil["memcpy_to_pinned_16threads_gb_s"], 3)
                   if "memcpy_to_pinned_16threads_gb_s" in ceil else None,
                   "cold_vs_disk": round(rep["cold"]["server_gb_s"] / max(ceil["disk_read_cold_16threads_gb_s"],
                                                                          ceil["disk_read_cold_8threads_gb_s"]), 3)}
    print(json.dumps({k: rep[k] for k in ("conversion", "cold", "warm", "aims")}, indent=1), flush=True)
    out = a.out or REPO / "bench" / "results" / f"{time.strftime('%Y%m%d-%H%M%S')}-multi-rank.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1, default=str))
    return 0 if rep["conversion"]["exactly_once"] else 1


if __name__ == "__main__":
    sys.exit(main())
