#!/usr/bin/env python3
"""Conversion benchmark: `atom-convert` against a plain copy of the same files.

One run of this script:
1. generates (or, with --reuse, reuses) a synthetic checkpoint at full width:
   fp8 at DeepSeek-V3 width (configs/deepseek-v3.json with num_hidden_layers=2:
   layer 0 dense, layer 1 MoE with 256 routed + 1 shared expert of 2048x7168,
   no MTP layer, the real 129280-token vocabulary; --family v32: DeepSeek-V3.2,
   with the indexer), or with --format mxfp4 a Quark MXFP4 export at Kimi-K2
   width (384 experts; --family k25: as AMD's Kimi-K2.5-MXFP4 lays it out, the
   text model under language_model. with every MLP linear in MXFP4, plus a
   one-block real-width bf16 vision tower and projector, atom-layout-next.md §3);
2. for every configuration (each --target x each --workers value, at --tp),
   times --pairs pairs of (a) a plain copy of the source files into a new folder
   (read + write + fsync per file) and (b) a conversion (`atom_convert.convert`
   with that target, tp and workers, --ep and --profile where given, default
   shard size; the process then ends as the installed command does,
   atom_convert.cli.quick_exit) into a new folder, alternating which runs
   first, after one untimed copy (--no-settle: none).
   Each run is a fresh subprocess. With --cache
   cold (the default) the page cache is dropped before every run (echo 3 >
   /proc/sys/vm/drop_caches; where that is refused, posix_fadvise DONTNEED on
   every source file, and the output says so); with --cache warm the source is
   read once before every run instead;
3. reports per configuration the median of the per-pair ratios convert/copy,
   source GB/s of both, bytes written, and the peak RSS: the child's VmHWM (its
   threads included) and the sampled peak of its whole process tree; --warm-runs N
   adds N conversions per configuration with a warm page cache (source GB/s);
4. writes bench/results/<stamp>-<mode>.json: machine, atom_convert's version and
   a sha256 of its sources (checked again after every run), every run's wall
   seconds, RSS, CPU seconds and the CPU other processes used meanwhile (the
   machine may be shared), and the summaries. Outputs are deleted after each
   run; the source at the end (--keep-source keeps it for --reuse).

The aims (BENCHMARKS.md, issue 9): with all cores, conversion within 1.2x of the
copy on a 16-core machine and 1.5x on 2 cores; >= 3 GB/s of source with a warm
cache; peak RSS <= workers x one item's working set + 1 GB.

Examples:
    python bench/bench_convert.py --tp 8 --workers 1,all --target gfx950,gfx942   # the issue-9 table
    python bench/bench_convert.py --smoke          # under a minute, checks the script
    python bench/bench_convert.py --format mxfp4 --tp 4 --workers all
    python bench/bench_convert.py --family k25 --format mxfp4 --tp 8 --ep --workers all
    python bench/bench_convert.py --reuse --keep-source --pairs 3

Only the standard library is imported at the top level, so that the copy child
process pays no torch import; atom_convert is imported where it is needed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"
DEFAULT_WORKDIR = Path("/tmp/atom-convert-bench")
DISK_FACTOR = 2.3  # free space needed: source + one output (each run's output is deleted) + headroom
GENERATE_ONLY_DISK_FACTOR = 1.1  # --generate-only writes the source alone
SOURCE_SHARD_BYTES = 4 * 1000**3  # DeepSeek-V3's own shards are ~4.3 GB
MARKER = ".bench-source.json"  # written after a complete generation; --reuse checks it

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


# ------------------------------------------------------------------------------------------------
# Child processes (one per timed run)
# ------------------------------------------------------------------------------------------------


def _proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS/VmHWM/RssAnon/RssFile/RssShmem of a process, in bytes (empty if it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(rest.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass
    return out


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def child_copy(src: Path, dst: Path) -> dict[str, Any]:
    """Copy every file of SRC into a new DST: read + write + fsync per file, then fsync DST."""
    dst.mkdir(parents=True)
    n = 0
    for p in sorted(src.iterdir()):
        if p.is_file() and p.name != MARKER:
            q = dst / p.name
            shutil.copyfile(p, q)
            _fsync_path(q)
            n += 1
    _fsync_path(dst)
    return {"files": n}


def layout_options(opts: dict[str, Any], accepted: Any) -> dict[str, Any]:
    """The --ep / --profile keywords of a configuration, only where they are set (so that a package
    from before them still runs the default ones); one this package lacks ends the run."""
    kw = {k: opts[k] for k in ("ep", "profile") if opts.get(k)}
    missing = [k for k in kw if k not in accepted]
    if missing:
        sys.exit(f"bench_convert: this atom_convert has no {', '.join(missing)}= option; leave out --{missing[0]}")
    return kw


def child_convert(src: Path, dst: Path, opts: dict[str, Any]) -> dict[str, Any]:
    import atom_convert

    import inspect

    # The bench also measures package states from before --workers (one worker, no budget).
    workers_api = "workers" in inspect.signature(atom_convert.convert).parameters
    if not workers_api and opts["workers"] != 1:
        sys.exit("bench_convert: this atom_convert has no workers= option; use --workers 1")
    kw = {"workers": opts["workers"]} if workers_api else {}
    if opts.get("worker_mode", "auto") != "auto":
        kw["worker_mode"] = opts["worker_mode"]
    kw.update(layout_options(opts, inspect.signature(atom_convert.convert).parameters))
    apply_variant(opts.get("patch", {}))  # a --variant: its options set first
    t0 = time.perf_counter()
    manifest = atom_convert.convert(src, dst, target=opts["target"], tp=opts["tp"], progress=False, **kw)
    _fsync_path(dst)
    info = {"files": len(manifest.get("files", {})), "tensors": len(manifest.get("tensors", {})),
            "manifest_conversion_seconds": manifest.get("conversion_seconds"),
            # the call alone: op_seconds also counts importing torch
            "convert_call_seconds": time.perf_counter() - t0}
    return info


# Switches that were module constants and are now keyword options of the objects that use them
# (issue 27): a --variant may name either form, and each works on this package and on older ones.
OPTION_OF_CONSTANT = {
    "atom_convert.engine.prefetch.GATE": "atom_convert.engine.prefetch.Prefetcher.gate",
    "atom_convert.engine.prefetch.POPULATE": "atom_convert.engine.prefetch.Prefetcher.populate",
    "atom_convert.engine.prefetch.STEP": "atom_convert.engine.prefetch.Prefetcher.step",
    "atom_convert.engine.prefetch.GATE_TIMEOUT_S": "atom_convert.engine.prefetch.Prefetcher.gate_timeout_s",
    "atom_convert.engine.writer.HASH_FROM_MAP": "atom_convert.engine.writer.ShardSetWriter.hash_from_map",
    "atom_convert.engine.writer._HASH_READ": "atom_convert.engine.writer.ShardSetWriter.hash_read",
}
CONSTANT_OF_OPTION = {v: k for k, v in OPTION_OF_CONSTANT.items()}


def _class_option(target: str) -> tuple[type, str] | None:
    """(class, keyword) for MODULE.CLASS.KEYWORD where CLASS's constructor takes KEYWORD, else None."""
    import importlib
    import inspect

    head, _, option = target.rpartition(".")
    mod, _, name = head.rpartition(".")
    try:
        cls = getattr(importlib.import_module(mod), name, None)
    except ImportError:
        return None
    if not isinstance(cls, type) or option not in inspect.signature(cls.__init__).parameters:
        return None
    return cls, option


def _module_constant(target: str) -> tuple[Any, str] | None:
    """(module, name) for MODULE.NAME where the module has NAME, else None."""
    import importlib

    mod, _, name = target.rpartition(".")
    try:
        m = importlib.import_module(mod)
    except ImportError:
        return None
    return (m, name) if hasattr(m, name) else None


def apply_variant(patch: dict[str, Any]) -> None:
    """Set a --variant's values in this process, the conversion's, before it converts.

    MODULE.CLASS.KEYWORD: every CLASS the conversion makes gets KEYWORD=VALUE (CLASS is replaced,
    wherever a loaded atom_convert module holds it, by a subclass that passes it; a keyword the
    caller passes itself still wins). MODULE.NAME: a module constant, set (packages from before
    issue 27, whose switches were constants). A target in OPTION_OF_CONSTANT in either form is
    taken in whichever form this package has."""
    import sys as _sys

    options: dict[type, dict[str, Any]] = {}
    for target, value in patch.items():
        forms = [target] + [x for x in (OPTION_OF_CONSTANT.get(target), CONSTANT_OF_OPTION.get(target)) if x]
        for form in forms:
            co = _class_option(form)
            if co is not None:
                options.setdefault(co[0], {})[co[1]] = value
                break
            mc = _module_constant(form)
            if mc is not None:
                setattr(mc[0], mc[1], value)
                break
        else:
            sys.exit(f"bench_convert: --variant target {target!r} is neither a keyword of an atom_convert class "
                     f"nor a module constant in this package")
    for cls, kw in options.items():
        def init(self: Any, *a: Any, _kw: dict[str, Any] = kw, _init: Any = cls.__init__, **k: Any) -> None:
            _init(self, *a, **{**_kw, **k})

        sub = type(cls.__name__, (cls,), {"__init__": init, "__module__": cls.__module__,
                                           "__qualname__": cls.__qualname__})
        for name, mod in list(_sys.modules.items()):
            if mod is not None and (name == "atom_convert" or name.startswith("atom_convert.")):
                for attr, val in list(vars(mod).items()):
                    if val is cls:
                        setattr(mod, attr, sub)


def child_bound(src: Path, opts: dict[str, Any]) -> dict[str, Any]:
    """The memory aim of issue 9: peak RSS <= workers x one item's working set + 1 GB, with the
    working set as workers.py estimates it (the largest (layer, rank) item of the plan). Its own
    child, untimed, once per configuration: the plan is not part of what a user waits for."""
    import inspect

    import atom_convert
    from atom_convert.engine.planning import make_plan
    from atom_convert.files.source import SourceCheckpoint

    if "workers" not in inspect.signature(atom_convert.convert).parameters:
        return {}  # a package state from before --workers: no bound
    from atom_convert.engine import workers

    plan = make_plan(SourceCheckpoint(src), target=opts["target"], tp=opts["tp"],
                     **layout_options(opts, inspect.signature(atom_convert.convert).parameters))
    groups = plan.main.groups + (plan.mtp.groups if plan.mtp else [])
    item = max(i.cost for i in workers.items(groups, plan.tp))
    return {"largest_item_working_set_bytes": item, "rss_bound_bytes": opts["workers"] * item + 1000**3}


def child_generate(cfg_json: Path, dst: Path, seed: int) -> dict[str, Any]:
    from atom_convert.synth import build_random

    cfg = json.loads(cfg_json.read_text())
    fmt = cfg.pop("_bench_format", "fp8")
    build_random(cfg, dst, fmt=fmt, seed=seed, shard_bytes=SOURCE_SHARD_BYTES)
    os.sync()
    return {}


def run_child(kind: str, src: Path, dst: Path, report: Path, seed: int = 0, opts: dict[str, Any] | None = None) -> None:
    t0 = time.perf_counter()
    if kind == "generate":
        info = child_generate(src, dst, seed)
    elif kind == "bound":
        info = child_bound(src, opts or {})
    else:
        info = child_copy(src, dst) if kind == "copy" else child_convert(src, dst, opts or {})
    info["op_seconds"] = time.perf_counter() - t0
    info["status_at_exit"] = _proc_status()
    report.write_text(json.dumps(info))


# ------------------------------------------------------------------------------------------------
# Parent: machine, cache, source, timed runs
# ------------------------------------------------------------------------------------------------


def machine_info(workdir: Path) -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "nproc_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_bytes": mem,
        "cpu_model": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "workdir": str(workdir),
    }
    try:
        import safetensors
        import torch

        import atom_convert

        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                    safetensors=safetensors.__version__, atom_convert=atom_convert.__version__)
    except Exception as e:  # noqa: BLE001  informational only
        info["import_error"] = repr(e)
    return info


def cpu_times() -> tuple[float, float]:
    """(user, busy) CPU seconds used so far by everything on the machine (/proc/stat):
    user = user+nice (user space only), busy = user+nice+system+irq+softirq+steal."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0, 0.0
    hz = os.sysconf("SC_CLK_TCK")
    return (v[0] + v[1]) / hz, (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / hz


def wait_quiet(max_wait: float, threshold: float = 0.25, window: float = 3.0) -> dict[str, Any]:
    """Wait (up to max_wait s) until user-space processes use < threshold cores over a window
    (kernel threads are left out: writeback of the previous run's deletion is not another job).
    The machine may be shared; what other load remained is recorded, not hidden."""
    t0 = time.perf_counter()
    while True:
        u0 = cpu_times()[0]
        time.sleep(window)
        load = (cpu_times()[0] - u0) / window
        waited = time.perf_counter() - t0
        if load < threshold or waited >= max_wait:
            return {"waited_seconds": round(waited, 1), "cores_busy_before": round(load, 2), "quiet": load < threshold}


def package_fingerprint() -> dict[str, Any]:
    """sha256 over atom_convert's source files (path + content), so that a result names the exact
    code it measured; compared again after every timed run to catch edits made during the run."""
    import hashlib

    h = hashlib.sha256()
    files = sorted(p for p in (REPO / "atom_convert").rglob("*") if p.is_file() and p.suffix in (".py", ".json", ".typed"))
    newest = 0.0
    for p in files:
        h.update(p.relative_to(REPO).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
        newest = max(newest, p.stat().st_mtime)
    version = "unknown"
    try:
        for line in (REPO / "atom_convert" / "__init__.py").read_text().splitlines():
            if line.startswith("__version__"):
                version = line.split("=", 1)[1].strip().strip("\"'")
    except OSError:
        pass
    return {"version": version, "sources_sha256": h.hexdigest(), "files": len(files),
            "newest_mtime": _dt.datetime.fromtimestamp(newest).astimezone().isoformat(timespec="seconds")}


def drop_caches(fallback: list[Path] | None = None) -> tuple[bool, str]:
    """os.sync() then 3 > /proc/sys/vm/drop_caches; where that is refused, posix_fadvise
    DONTNEED on every file under the `fallback` folders (drops their clean pages only, which
    after the sync is all of them). Returns (dropped, note)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True, "page cache dropped (sync; echo 3 > /proc/sys/vm/drop_caches) before every timed run"
    except OSError as e:
        if fallback is None or not hasattr(os, "posix_fadvise"):
            return False, (f"cannot drop the page cache ({e.strerror or e}); every timed run starts warm: the source "
                           f"files are read once right before it, for copy and convert alike")
        for folder in fallback:
            for p in sorted(folder.rglob("*")) if folder.exists() else []:
                if p.is_file():
                    fd = os.open(p, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
        return True, (f"drop_caches refused ({e.strerror or e}): sync, then posix_fadvise(DONTNEED) on every source "
                      f"file before every timed run")


def _pss(pid: int) -> int:
    """Proportional set size of a process (bytes; 0 if it is gone): its private pages plus its
    share of the pages it shares. Summed over a process tree it counts the pages that forked
    worker processes share with their parent (torch's libraries, the plan) once, where the sum of
    their RSS counts them once per process."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def tree_rss(pid: int, pss: bool = True) -> tuple[int, int]:
    """Summed VmRSS and summed Pss of pid and all its descendants (bytes); Pss 0 unless `pss`
    (it walks every process's page tables, VmRSS reads counters)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                continue
    total, pss_sum, todo = 0, 0, [pid]
    while todo:
        p = todo.pop()
        total += _proc_status(p).get("VmRSS", 0)
        pss_sum += _pss(p) if pss else 0
        todo.extend(kids.get(p, []))
    return total, pss_sum


def prewarm(src: Path) -> None:
    for p in sorted(src.iterdir()):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    pass


def tree_bytes(path: Path) -> tuple[int, int]:
    """(bytes, files) of every regular file under path."""
    total = files = 0
    for root, _, names in os.walk(path):
        for n in names:
            p = os.path.join(root, n)
            if os.path.isfile(p) and not os.path.islink(p):
                total += os.path.getsize(p)
                files += 1
    return total, files


def safetensors_bytes(path: Path) -> int:
    """Tensor bytes of the *.safetensors files in path, from their headers' data_offsets (headers excluded)."""
    total = 0
    for p in sorted(path.glob("*.safetensors")):
        with open(p, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


# DeepSeek-V3.2: V3's config plus the indexer's keys (atom-layout-next.md §1.1), the fp8 release's values
V32_KEYS = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "index_head_dim": 128,
            "index_n_heads": 64, "index_topk": 2048}


def bench_config(layers: int, experts: int, vocab: int, fmt: str = "fp8", family: str = "v3") -> dict[str, Any]:
    """fp8: DeepSeek-V3 width (family "v32": DeepSeek-V3.2, V3 plus the indexer of every layer);
    mxfp4: Kimi-K2 width (64 heads), routed experts in MXFP4 as Quark's kimi_k2 template exports
    them (Kimi-K2-Thinking-MXFP4); family "k25" (mxfp4 only): the same text model as Kimi-K2.5
    (KimiK25ForConditionalGeneration, atom-layout-next.md §3: `language_model.` names, the text config
    in `text_config`, the quantization_config at the top level) as amd/Kimi-K2.5-MXFP4 quantises it
    (every MLP linear MXFP4: layer 0's dense MLP, routed and shared experts; §3.5), with a real-width
    vision tower of one block and the projector, bf16 (synth.kimi_k25_config; only --profile
    vllm-plugin carries them)."""
    from atom_convert.synth import kimi_k25_config, load_preset

    if family in ("v32", "k25") and fmt != {"v32": "fp8", "k25": "mxfp4"}[family]:
        raise SystemExit(f"bench_convert: --family {family} is the "
                         + ("fp8 release (--format fp8)" if family == "v32" else
                            "Quark MXFP4 export (--format mxfp4)"))
    cfg = load_preset("deepseek-v3" if fmt == "fp8" else "kimi-k2")
    cfg.update(num_hidden_layers=layers, first_k_dense_replace=1, num_nextn_predict_layers=0,
               n_routed_experts=experts, vocab_size=vocab)
    if family == "v32":
        cfg.update(V32_KEYS)
    if fmt != "fp8":
        cfg.pop("quantization_config", None)
    if family == "k25":
        cfg = kimi_k25_config(cfg)
    cfg["_bench_format"] = fmt
    return cfg


def expected_source_bytes(cfg: dict[str, Any]) -> int:
    """Tensor bytes of the source build_random writes (headers and json files excluded)."""
    from atom_convert.layout.model import ModelSpec
    from atom_convert.synth import mxfp4_in_export, scale_grid, source_inventory

    fmt = cfg.get("_bench_format", "fp8")
    cfg = {k: v for k, v in cfg.items() if k != "_bench_format"}
    prefix = ModelSpec.from_config(cfg).text_prefix
    total = 0
    for name, shape, kind in source_inventory(cfg):
        n = 1
        for d in shape:
            n *= d
        if kind == "linear" and fmt == "mxfp4":
            total += n // 2 + n // 32 if mxfp4_in_export(name, prefix) else 2 * n
        elif kind == "linear":
            g = scale_grid(shape)
            total += n + 4 * g[0] * g[1]
        elif kind in ("router", "bias"):
            total += 4 * n
        else:
            total += 2 * n
    return total


def source_dir_name(layers: int, experts: int, vocab: int, seed: int, fmt: str = "fp8", family: str = "v3") -> str:
    model = (("dsv32" if family == "v32" else "dsv3") if fmt == "fp8" else
             f"kimi-k25-{fmt}" if family == "k25" else f"kimi-{fmt}")
    return f"src-{model}-L{layers}-E{experts}-V{vocab}-s{seed}"


def check_disk(workdir: Path, need_total: int, already: int, factor: float = DISK_FACTOR) -> int:
    free = shutil.disk_usage(workdir).free
    if free + already < need_total:
        sys.exit(
            f"bench_convert: not enough free disk in {workdir}: {free / 1e9:.1f} GB free"
            + (f" (+ {already / 1e9:.1f} GB already used by the reused source)" if already else "")
            + f", but the benchmark needs {factor}x the source size = {need_total / 1e9:.1f} GB "
            + ("(source + one output at a time + headroom)" if factor == DISK_FACTOR else
               "(--generate-only: the source + headroom)")
            + ". Free some space or pass --workdir on a larger disk."
        )
    return free


def prepare_source(args: argparse.Namespace, workdir: Path) -> tuple[Path, dict[str, Any]]:
    cfg = bench_config(args.layers, args.experts, args.vocab, args.format, args.family)
    src = workdir / source_dir_name(args.layers, args.experts, args.vocab, args.seed, args.format, args.family)
    est = expected_source_bytes(cfg)
    factor = GENERATE_ONLY_DISK_FACTOR if args.generate_only else DISK_FACTOR
    marker = src / MARKER
    if args.reuse and marker.is_file():
        meta = json.loads(marker.read_text())
        have, _ = tree_bytes(src)
        if meta.get("config") == cfg and safetensors_bytes(src) == est:
            check_disk(workdir, int(factor * have), have, factor)
            print(f"[bench] reusing source {src} ({have / 1e9:.2f} GB)", flush=True)
            return src, {"generated": False, "generate_seconds": meta.get("generate_seconds")}
        print(f"[bench] {src} does not match the requested config; regenerating", flush=True)
    if src.exists():
        shutil.rmtree(src)
    check_disk(workdir, int(factor * est), 0, factor)
    print(f"[bench] generating {src} (~{est / 1e9:.2f} GB, {args.format}, seed {args.seed}) ...", flush=True)
    # In a subprocess: the generator's memory must not inflate the timed children or the page cache.
    cfg_json = workdir / ".bench-config.json"
    cfg_json.write_text(json.dumps(cfg))
    report = workdir / ".report-generate.json"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--seed", str(args.seed),
                    "--child", "generate", str(cfg_json), str(src), str(report)], check=True)
    dt = time.perf_counter() - t0
    cfg_json.unlink()
    report.unlink()
    got = safetensors_bytes(src)
    if got != est:  # expected_source_bytes is what the disk check and the reuse check rely on
        sys.exit(f"bench_convert: the generated source {src} holds {got} tensor bytes, expected_source_bytes "
                 f"says {est}: one of them is wrong (fix it before timing anything)")
    marker.write_text(json.dumps({"config": cfg, "generate_seconds": dt}))
    print(f"[bench] generated in {dt:.1f} s ({got} tensor bytes, as expected_source_bytes says)", flush=True)
    return src, {"generated": True, "generate_seconds": dt}


_BOUNDS: dict[str, dict[str, Any]] = {}


def memory_bound(src: Path, workdir: Path, opts: dict[str, Any]) -> dict[str, Any]:
    """child_bound's answer for a configuration, computed once, in its own untimed child."""
    key = json.dumps([str(src), opts.get("target"), opts.get("tp"), opts.get("workers"), opts.get("ep"),
                      opts.get("profile")])
    if key not in _BOUNDS:
        report = workdir / ".report-bound.json"
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", "bound", str(src), "-",
                        str(report), "--child-opts", json.dumps(opts)], check=True)
        _BOUNDS[key] = {k: v for k, v in json.loads(report.read_text()).items()
                        if k in ("largest_item_working_set_bytes", "rss_bound_bytes")}
        report.unlink()
    return _BOUNDS[key]


def timed_run(kind: str, src: Path, dst: Path, workdir: Path, cold: bool, quiet_wait: float,
              opts: dict[str, Any] | None = None, sampler: str = "pss") -> dict[str, Any]:
    """One run in a fresh subprocess: wall time, the child's VmHWM, a sampled RSS breakdown and
    the sampled peak of its process tree."""
    if dst.exists():
        shutil.rmtree(dst)
    report = workdir / f".report-{kind}.json"
    report.unlink(missing_ok=True)
    if cold:
        drop_caches([src])
    else:
        prewarm(src)
    quiet = wait_quiet(quiet_wait) if quiet_wait > 0 else {}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, str(src), str(dst), str(report),
           "--child-opts", json.dumps(opts or {})]
    user0, busy0 = cpu_times()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    peak = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0, "tree": 0, "tree_pss": 0}
    samples, sampling = 0, 0.0
    while True:
        # sampler "off": no sampling while the child runs (its VmHWM at exit is still recorded)
        pid, status, ru = os.wait4(proc.pid, 0 if sampler == "off" else os.WNOHANG)
        if pid:
            break
        s0 = time.perf_counter()
        st = _proc_status(proc.pid)
        st["tree"], st["tree_pss"] = tree_rss(proc.pid, pss=sampler == "pss")
        for k in peak:
            peak[k] = max(peak[k], st.get(k, 0))
        took = time.perf_counter() - s0
        samples, sampling = samples + 1, sampling + took
        # Every 50 ms, but the sampler stays under a tenth of one core: reading smaps_rollup walks
        # the page tables of every process of the tree, which took 26 ms per sample of a 3-process
        # tree on the 2-core box, and more with 17 processes mapping the source from the page cache.
        time.sleep(max(0.05, 9 * took))
    wall = time.perf_counter() - t0
    user1, busy1 = cpu_times()
    busy, user = busy1 - busy0, user1 - user0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        shutil.rmtree(dst, ignore_errors=True)
        sys.exit(f"bench_convert: the {kind} run failed (exit {proc.returncode}); command: {' '.join(cmd)}")
    child = json.loads(report.read_text())
    report.unlink()
    if kind == "convert":
        child.update(memory_bound(src, workdir, opts or {}))
    out_bytes, out_files = tree_bytes(dst)
    return {
        "kind": kind,
        "wall_seconds": wall,
        "op_seconds": child["op_seconds"],
        # The child's own VmHWM read from /proc/self/status as it exits. wait4's ru_maxrss is kept
        # for reference only: Linux carries the pre-exec (forked parent's) high-water mark into it.
        "peak_rss_bytes": child["status_at_exit"]["VmHWM"],
        "wait4_ru_maxrss_bytes": ru.ru_maxrss * 1024,
        "sampler": {"mode": sampler, "samples": samples, "seconds": sampling},
        "sampled_peak": {"rss_anon_bytes": peak["RssAnon"], "rss_file_bytes": peak["RssFile"],
                         "vm_rss_bytes": peak["VmRSS"], "process_tree_rss_bytes": peak["tree"],
                         "process_tree_pss_bytes": peak["tree_pss"]},
        "opts": opts or {},
        "user_seconds": ru.ru_utime,
        "sys_seconds": ru.ru_stime,
        # Machine-wide CPU time during the run minus the child's own. other_user: user-space time of
        # other processes (another job on a shared machine; this parent's sampling is ~0.1 s);
        # other_cpu also counts kernel threads, which include the writeback and reclaim done for the run.
        "other_user_cpu_seconds": round(max(0.0, user - ru.ru_utime), 1),
        "other_cpu_seconds": round(max(0.0, busy - ru.ru_utime - ru.ru_stime), 1),
        "quiet_wait": quiet,
        "output_bytes": out_bytes,
        "output_files": out_files,
        "child": {k: v for k, v in child.items() if k not in ("op_seconds",)},
    }


def fmt_gb(b: float) -> str:
    return f"{b / 1e9:.2f} GB"


def tree_text(peak: dict[str, Any], sampler: str) -> str:
    """The sampled tree figures, or what was not sampled (--sampler)."""
    rss = fmt_gb(peak["process_tree_rss_bytes"]) if sampler != "off" else "not sampled"
    pss = fmt_gb(peak["process_tree_pss_bytes"]) if sampler == "pss" else "not sampled"
    return f"tree RSS {rss}, tree PSS {pss}"


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """'no-gate:atom_convert.engine.prefetch.Prefetcher.gate=false,atom_convert.engine.prefetch.Prefetcher.step=8388608'
    -> (name, {target: value}); a target is checked in the conversion's process (apply_variant)."""
    name, _, rest = text.partition(":")
    patch = {}
    for item in filter(None, rest.split(",")):
        target, _, value = item.partition("=")
        if not target.startswith("atom_convert.") or "." not in target:
            sys.exit(f"bench_convert: --variant {text!r}: {target!r} is not an atom_convert class option "
                     f"or module constant")
        patch[target] = json.loads(value)
    return name, patch


def parse_workers(text: str) -> list[int]:
    """'1,all' -> [1, usable cores]."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    out = []
    for w in text.split(","):
        w = w.strip()
        n = cores if w == "all" else int(w)
        if n not in out:
            out.append(n)
    return out


def summarize(runs: list[dict[str, Any]], src_bytes: int, workers: int) -> dict[str, Any]:
    """Per configuration: median of the per-pair ratios, GB/s, bytes written, peak RSS."""
    pairs: dict[int, dict[str, dict[str, Any]]] = {}
    for x in runs:
        if x.get("pair") is not None:
            pairs.setdefault(x["pair"], {})[x["kind"]] = x
    ratios = [p["convert"]["wall_seconds"] / p["copy"]["wall_seconds"] for p in pairs.values()
              if "convert" in p and "copy" in p]
    conv = [x for x in runs if x["kind"] == "convert" and x.get("pair") is not None]
    copy = [x for x in runs if x["kind"] == "copy"]
    warm = [x for x in runs if x["kind"] == "convert" and x.get("pair") is None]
    allc = [x for x in runs if x["kind"] == "convert"]
    med = statistics.median
    out: dict[str, Any] = {
        "workers": workers,
        "pairs": len(ratios),
        "ratio_per_pair": ratios,
        "ratio_median_of_pairs": med(ratios) if ratios else None,
        "copy_seconds": [x["wall_seconds"] for x in copy],
        "convert_seconds": [x["wall_seconds"] for x in conv],
        "copy_source_GBps": src_bytes / med([x["wall_seconds"] for x in copy]) / 1e9 if copy else None,
        "convert_source_GBps": src_bytes / med([x["wall_seconds"] for x in conv]) / 1e9 if conv else None,
        "convert_in_process_source_GBps": src_bytes / med([x["op_seconds"] for x in conv]) / 1e9 if conv else None,
        "convert_call_source_GBps": (src_bytes / med([x["child"]["convert_call_seconds"] for x in conv]) / 1e9
                                     if conv and "convert_call_seconds" in conv[0]["child"] else None),
        "output_bytes": allc[0]["output_bytes"] if allc else None,
        "peak_rss_bytes": max(x["peak_rss_bytes"] for x in allc) if allc else None,
        "peak_process_tree_rss_bytes": max(x["sampled_peak"]["process_tree_rss_bytes"] for x in allc) if allc else None,
        "rss_bound_bytes": allc[0]["child"].get("rss_bound_bytes") if allc else None,
        "peak_process_tree_pss_bytes": max(x["sampled_peak"]["process_tree_pss_bytes"] for x in allc) if allc else None,
        # The converter's own VmHWM and its process tree's sampled Pss (worker processes share their
        # parent's pages: their summed RSS counts those pages once per process, Pss once in all).
        "rss_within_bound": all(max(x["peak_rss_bytes"], x["sampled_peak"]["process_tree_pss_bytes"])
                                <= x["child"]["rss_bound_bytes"] for x in allc)
                            if allc and "rss_bound_bytes" in allc[0]["child"] else None,
        "convert_cpu_seconds": [round(x["user_seconds"] + x["sys_seconds"], 1) for x in allc],
    }
    if warm:
        out["warm_convert_seconds"] = [x["wall_seconds"] for x in warm]
        out["warm_convert_source_GBps"] = src_bytes / med([x["wall_seconds"] for x in warm]) / 1e9
        out["warm_convert_in_process_source_GBps"] = src_bytes / med([x["op_seconds"] for x in warm]) / 1e9
        if "convert_call_seconds" in warm[0]["child"]:
            out["warm_convert_call_source_GBps"] = (src_bytes / med([x["child"]["convert_call_seconds"] for x in warm])
                                                    / 1e9)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2, choices=(2, 3), help="decoder layers (layer 0 dense, the rest MoE)")
    ap.add_argument("--format", choices=("fp8", "mxfp4"), default="fp8",
                    help="fp8: DeepSeek-V3-width DeepSeek fp8 source (default); mxfp4: Kimi-K2-width Quark MXFP4 "
                         "export (routed experts MXFP4, 384 experts by default)")
    ap.add_argument("--family", choices=("v3", "v32", "k25"), default="v3",
                    help="fp8 source: DeepSeek-V3 (default) or DeepSeek-V3.2 (v32: V3 plus the sparse-attention "
                         "indexer); mxfp4 source: Kimi-K2 (default) or Kimi-K2.5 (k25: AMD's Kimi-K2.5-MXFP4 "
                         "layout: the same text model under language_model., every MLP linear MXFP4, plus a "
                         "bf16 vision tower)")
    ap.add_argument("--experts", type=int, default=None, help="routed experts per MoE layer (default 256; --smoke 8)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 129280; --smoke 16384)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the conversions (default 1)")
    ap.add_argument("--ep", action="store_true", help="convert for expert parallelism (convert's ep=True)")
    ap.add_argument("--profile", choices=("atom", "vllm-plugin"), default=None,
                    help="convert's naming profile (default: convert's own, atom); vllm-plugin carries a "
                         "Kimi-K2.5 vision tower")
    ap.add_argument("--target", default="gfx950", help="comma-separated targets, e.g. gfx950,gfx942 (default gfx950)")
    ap.add_argument("--workers", default="1", help="comma-separated worker counts, 'all' = usable cores, e.g. 1,all "
                                                   "(default 1)")
    ap.add_argument("--worker-mode", default="auto",
                    help="comma-separated: auto, process, thread (convert's worker_mode; default auto)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:MODULE.CLASS.OPTION=VALUE[,...]",
                    help="a configuration with keyword options of the conversion's objects set in its process "
                         "(VALUE is JSON), e.g. no-gate:atom_convert.engine.prefetch.Prefetcher.gate=false or "
                         "readback:atom_convert.engine.writer.ShardSetWriter.hash_from_map=false; MODULE.NAME sets a "
                         "module constant (older packages; their switch names map to the options, "
                         "OPTION_OF_CONSTANT); repeatable; 'NAME:' alone is the code as it is. Default: one "
                         "variant, as it is")
    ap.add_argument("--no-settle", dest="settle", action="store_false",
                    help="cold: skip the untimed copy run before the timed ones")
    ap.add_argument("--pairs", "--repeat", dest="pairs", type=int, default=None,
                    help="cold (copy, convert) pairs per configuration (default 2; --smoke 1)")
    ap.add_argument("--cache", choices=("cold", "warm"), default="cold",
                    help="cold: drop the page cache before every timed run (default); warm: read the source first")
    ap.add_argument("--warm-runs", type=int, default=0,
                    help="extra conversions per configuration with a warm page cache (source GB/s)")
    ap.add_argument("--workdir", type=Path, default=None, help=f"scratch folder (default {DEFAULT_WORKDIR}[-smoke])")
    ap.add_argument("--reuse", action="store_true", help="reuse a complete source from an earlier run in --workdir")
    ap.add_argument("--keep-source", action="store_true", help="keep the generated source (for a later --reuse)")
    ap.add_argument("--generate-only", action="store_true",
                    help="generate (or --reuse) the source, print its path and stop (implies --keep-source)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny run (hidden 7168, 8 experts, vocab 16384), < 1 minute")
    ap.add_argument("--quiet-wait", type=float, default=None,
                    help="before each timed run, wait up to this many seconds for other processes to go idle "
                         "(default 120; --smoke 0); the CPU other processes used during each run is recorded either way")
    ap.add_argument("--sampler", choices=("pss", "rss", "off"), default="pss",
                    help="while a timed child runs, sample its process tree's RSS and PSS (pss, the default), "
                         "its RSS alone (rss: no page-table walks), or nothing (off: only the child's VmHWM "
                         "at exit). For warm-cache speed figures, which the sampling can slow")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="where the timed runs write their outputs (default: --workdir), e.g. /dev/shm with "
                         "--cache warm, so that a warm source read from its disk's page cache is not held back "
                         "by the disk's writes (a source on tmpfs is a poor stand-in for a warm page cache: its "
                         "mapped reads cost more CPU)")
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--child", nargs=4, metavar=("KIND", "SRC", "DST", "REPORT"), help=argparse.SUPPRESS)
    ap.add_argument("--child-opts", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        kind, src, dst, report = args.child
        run_child(kind, Path(src), Path(dst), Path(report), args.seed, json.loads(args.child_opts))
        if kind == "convert":
            # End as the installed `atom-convert` command does (its quick exit skips the interpreter's
            # teardown, 0.7-0.9 s after a conversion on the 2-core box), where this package has it.
            try:
                from atom_convert.cli import quick_exit
            except ImportError:
                return 0
            quick_exit(0)
        return 0

    mode = "smoke" if args.smoke else "full"
    args.experts = args.experts or (8 if args.smoke else 256 if args.format == "fp8" else 384)
    args.vocab = args.vocab or (16384 if args.smoke else 129280 if args.format == "fp8" else 163840)
    args.pairs = args.pairs or (1 if args.smoke else 2)
    if args.quiet_wait is None:
        args.quiet_wait = 0.0 if args.smoke else 120.0
    targets = [t.strip() for t in args.target.split(",")]
    worker_counts = parse_workers(args.workers)
    workdir = (args.workdir or Path(f"{DEFAULT_WORKDIR}{'-smoke' if args.smoke else ''}")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)

    dropped, cache_note = drop_caches([workdir])
    cold = args.cache == "cold" and dropped
    if args.cache == "warm":
        cache_note = "warm: the source is read once right before every timed run, copy and convert alike"
    print(f"[bench] {cache_note}", flush=True)
    package = package_fingerprint()
    print(f"[bench] atom_convert {package['version']}, sources sha256 {package['sources_sha256'][:16]}", flush=True)
    machine = machine_info(workdir)
    src, gen = prepare_source(args, workdir)
    if args.generate_only:
        print(src, flush=True)
        return 0
    src_bytes, src_files = tree_bytes(src)
    src_bytes -= (src / MARKER).stat().st_size
    src_files -= 1
    out_dir = args.out_dir or workdir
    if args.out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(out_dir).free
        if free < 1.1 * src_bytes:
            sys.exit(f"bench_convert: --out-dir {out_dir}: {free / 1e9:.1f} GB free, but one output needs about "
                     f"{1.1 * src_bytes / 1e9:.1f} GB (1.1x the source); free some space or pick another folder")

    vision = json.loads((src / "config.json").read_text()).get("vision_config")  # --family k25
    runs: list[dict[str, Any]] = []
    configs: list[dict[str, Any]] = []
    variants = [parse_variant(v) for v in args.variant] or [("", {})]

    def one(kind: str, opts: dict[str, Any], warm_run: bool, pair: int | None, label: str) -> dict[str, Any]:
        dst = out_dir / f"out-{kind}"
        res = timed_run(kind, src, dst, workdir, cold and not warm_run, args.quiet_wait, opts, args.sampler)
        res.update(pair=pair, config=label, warm=warm_run or not cold)
        res["package_sources_sha256"] = package_fingerprint()["sources_sha256"]
        if res["package_sources_sha256"] != package["sources_sha256"]:
            print("[bench] WARNING: atom_convert's sources changed during this run; the runs do not all "
                  "measure the same code (see package_sources_sha256 per run in the JSON)", flush=True)
        runs.append(res)
        print(f"[bench] {label:28s} {'warm' if res['warm'] else 'cold'} {kind:7s}: {res['wall_seconds']:7.1f} s wall "
              f"({res['op_seconds']:.1f} s in-process, {src_bytes / res['wall_seconds'] / 1e9:.2f} GB/s of source), "
              f"peak RSS {fmt_gb(res['peak_rss_bytes'])} ({tree_text(res['sampled_peak'], args.sampler)}), "
              f"output {fmt_gb(res['output_bytes'])}, CPU {res['user_seconds'] + res['sys_seconds']:.0f} s "
              f"(others' user CPU {res['other_user_cpu_seconds']:.0f} s; memory sampler "
              f"{res['sampler']['seconds']:.1f} s in {res['sampler']['samples']} samples)", flush=True)
        shutil.rmtree(dst)
        os.sync()
        return res

    if cold and args.settle:
        # The first cold run after a large delete (the previous bench's output) ran slower on the 2-core
        # box's disk: 37-39 s for a copy that then took 28-30 s (BENCHMARKS.md, issue 9, seventh round),
        # which flattered the first pair's ratio. One untimed copy first takes that cost.
        dst = workdir / "out-settle"
        res = timed_run("copy", src, dst, workdir, True, 0, {})
        print(f"[bench] settling run, not counted: copy {res['wall_seconds']:.1f} s", flush=True)
        shutil.rmtree(dst, ignore_errors=True)
        os.sync()

    k = 0
    for target in targets:
        for workers, wmode, (vname, patch) in [(w, m, v) for w in worker_counts for m in args.worker_mode.split(",")
                                               for v in variants]:
            if workers == 1 and wmode != args.worker_mode.split(",")[0]:
                continue  # one worker runs on the calling thread whatever the mode
            label = (f"{target} tp={args.tp}" + (" ep" if args.ep else "")
                     + (f" {args.profile}" if args.profile else "") + f" workers={workers}"
                     + (f" {wmode}" if wmode != "auto" else "") + (f" {vname}" if vname else ""))
            opts = {"target": target, "tp": args.tp, "workers": workers, "worker_mode": wmode, "patch": patch,
                    "ep": args.ep, "profile": args.profile}
            mine: list[dict[str, Any]] = []
            for p in range(args.pairs):
                order = ("copy", "convert") if k % 2 == 0 else ("convert", "copy")
                k += 1
                for kind in order:
                    mine.append(one(kind, opts, False, p, label))
            for _ in range(args.warm_runs):
                mine.append(one("convert", opts, True, None, label))
            summary = summarize(mine, src_bytes, workers)
            summary.update(target=target, tp=args.tp, ep=args.ep, profile=args.profile, label=label,
                           worker_mode=wmode, variant=vname, patch=patch)
            configs.append(summary)

    result = {
        "benchmark": ("atom-convert vs plain copy (fp8 DeepSeek-V3 width, synthetic)" if args.format == "fp8" else
                      "atom-convert vs plain copy (Quark MXFP4 Kimi-K2.5 layout, Kimi-K2 width, synthetic)"
                      if args.family == "k25" else "atom-convert vs plain copy (Quark MXFP4 Kimi-K2 width, synthetic)"),
        "mode": mode,
        "timestamp": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": [Path(sys.executable).name, *sys.argv],
        "machine": machine,
        "package": package,
        "package_changed_during_run": any(x["package_sources_sha256"] != package["sources_sha256"] for x in runs),
        "page_cache": {"cold": cold, "note": cache_note},
        "output_dir": str(out_dir),
        "source": {"path": str(src), "bytes": src_bytes, "files": src_files, "family": args.family,
                   "layers": args.layers, "experts": args.experts, "shared_experts": 1,
                   "vocab": args.vocab, "hidden": 7168, "heads": 128 if args.format == "fp8" else 64,
                   "first_k_dense_replace": 1, "mtp_layers": 0,
                   "format": ("fp8 e4m3fn, fp32 weight_scale_inv per 128x128 block" if args.format == "fp8" else
                              "Quark MXFP4 routed experts (uint8 e2m1 + e8m0 per 32), other linears bf16"
                              if args.family != "k25" else
                              "Quark MXFP4 (uint8 e2m1 + e8m0 per 32) dense MLP, routed and shared experts; "
                              "attention, routers, lm_head, vision tower and projector bf16"),
                   **({"vision": {k: v for k, v in vision.items() if k.startswith("vt_") or k == "mm_hidden_size"}}
                      if vision else {}),
                   "seed": args.seed, "shard_bytes": SOURCE_SHARD_BYTES, **gen},
        "timing": "wall seconds of a fresh subprocess, start to exit (convert includes importing torch); "
                  "op_seconds: inside the child (a convert child's includes importing torch); "
                  "child.convert_call_seconds: the convert call alone; ratio: per (copy, convert) pair, median over pairs",
        "runs": runs,
        "configs": configs,
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.results_dir / (f"{stamp}-{mode}-{args.format}" + (f"-{args.family}" if args.family != "v3" else "")
                              + f"-tp{args.tp}{'-ep' if args.ep else ''}"
                              + (f"-{args.profile}" if args.profile else "") + ".json")
    out.write_text(json.dumps(result, indent=2) + "\n")

    print()
    print(f"machine : {machine['cpu_model']}, {machine['nproc_usable']} usable CPUs, {fmt_gb(machine['ram_bytes'])} RAM")
    print(f"cache   : {cache_note}")
    print(f"source  : {fmt_gb(src_bytes)} in {src_files} files ({args.format}"
          + (f" {args.family}" if args.family != "v3" else "") + f", {args.layers} layers, "
          f"{args.experts} experts, vocab {args.vocab})")
    for c in configs:
        line = f"{c['label']:30s}"
        if c["ratio_median_of_pairs"] is not None:
            line += (f" ratio {c['ratio_median_of_pairs']:.2f}x (pairs {', '.join(f'{r:.2f}' for r in c['ratio_per_pair'])})"
                     f", copy {c['copy_source_GBps']:.2f} GB/s, convert {c['convert_source_GBps']:.2f} GB/s")
            if c.get("convert_call_source_GBps"):
                line += f" (the convert call alone {c['convert_call_source_GBps']:.2f} GB/s)"
        if c.get("warm_convert_source_GBps"):
            line += f", warm convert {c['warm_convert_source_GBps']:.2f} GB/s"
        line += (f", peak RSS {fmt_gb(c['peak_rss_bytes'])} ("
                 + tree_text({"process_tree_rss_bytes": c["peak_process_tree_rss_bytes"],
                              "process_tree_pss_bytes": c["peak_process_tree_pss_bytes"]}, args.sampler))
        if c["rss_bound_bytes"]:
            line += (f", bound workers x item + 1 GB = {fmt_gb(c['rss_bound_bytes'])}: "
                     f"{'within' if c['rss_within_bound'] else 'EXCEEDED'}")
        line += f"), wrote {fmt_gb(c['output_bytes'])}"
        print(line)
    noisy = [x for x in runs if x["other_user_cpu_seconds"] > 0.1 * x["wall_seconds"]]
    if noisy:
        print(f"warning : other processes used > 0.1 core (user CPU) during {len(noisy)} of {len(runs)} runs "
              f"(other_user_cpu_seconds in the JSON); the machine was not quiet")
    print(f"result  : {out}")

    if not args.keep_source:
        shutil.rmtree(src)
        print(f"[bench] removed the source {src} (pass --keep-source to keep it for --reuse)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
