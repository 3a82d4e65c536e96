"""The conversion driver.

How it works:
1. Check DST against SRC before any work (staging.check_destination: no overlap, symlinks,
   what --force may replace).
2. Index the source lazily (headers only) and read config.json into a ModelSpec; detect the
   source format; the architecture's loader checks every tensor and plans every output
   (name, dtype, shape, sources) before any data is read.
3. Assign outputs to size-bounded shards per rank, in load order.
4. Take the lock beside DST (before anything is written there: a --hub-cache pull too, which
   then replaces DST under it), then open the staging directory `.DST.atom-partial/`: a new
   one, or the one an interrupted run left, whose sealed shards are kept when the source and
   options fingerprints match (staging.py).
5. Stream: (layer, rank) items run on `--workers` forked worker processes (procs.py; or
   threads) inside a memory budget (workers.py); each tensor's bytes go to their planned
   offset in their shard, so the output does not depend on the order of completion. Outputs whose shard is already
   sealed are not produced at all. Each shard is sealed (fsynced, renamed, journalled)
   as it completes.
6. Copy config/tokenizer files, write the MTP set's manifest, then the main manifest last,
   then rename the staging directory to DST.
On Ctrl-C or SIGTERM the sealed shards stay for a resume and the unsealed ones are removed;
after disk full the sealed shards stay too; any other failure removes the staging directory.
DST is never half-written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from tqdm import tqdm

from ..layout import buffers
from . import procs
from . import workers as workers_mod
from ..errors import BadInputError, Interrupted
from ..store.fingerprint import Fingerprint, options_fingerprint, source_fingerprint, source_stamps
from ..store import digest
from ..store.manifest import MANIFEST_NAME, WrittenFile, build_manifest, write_manifest
from ..layout.options import ConversionOptions, check_count, check_flag, check_path, parse_size
from .planning import MTP_DIR, SetLayout, layout_shards, make_plan, planned_shards
from ..layout.plan import ConversionPlan, OutTensor, ShardPlan
from .prefetch import Prefetcher
from ..files import libc
from ..files.reading import loads, read_regular
from ..files.safetensors import side_files
from ..files.source import SourceCheckpoint
from ..store.staging import (DestinationLock, Sealed, Staging, check_destination, check_replaceable, make_parents,
                             os_error_message, plan_digest, remove_created)
from .writer import FaultHook, ProcessShardWriter, ShardSetWriter, _IOThread

log = logging.getLogger(__name__)


RESUME_MODES = ("auto", "resume", "restart")
WORKER_MODES = ("auto", "process", "thread")


def _large_allocations_via_mmap() -> None:
    """Make glibc serve every allocation of 1 MiB or more with its own mapping.

    The producers allocate tens of MB per expert (the concatenated and the shuffled
    weight) and the writer threads free them. With glibc's default dynamic threshold,
    blocks of that size come from the heap once a few have been freed, and the heap then
    grows by about one expert per expert without being returned: 6-8 GB for one
    DeepSeek-V3 MoE layer (bench/, BENCHMARKS.md). A fixed 1 MiB threshold returns each
    block to the system when it is freed. Process-wide and harmless elsewhere: it is
    glibc's own default behaviour before its threshold adapts.
    """
    libc.set_mmap_threshold(1 << 20)  # not glibc: nothing to do


@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """torch ops on one thread each while converting: the parallelism is the workers'.

    A producer's ops are copies and reductions over one expert's piece (a few MB), too small to
    gain from torch's OpenMP pool, whose threads spin between ops and take the cores that the
    other workers, the hashing, write-behind and readahead threads need. Measured at V3 width,
    tp=8 (BENCHMARKS.md, issue 9): 16 workers each with all 16 cores' threads spun against each
    other; one worker on the 16-core device used 551 CPU-s; one worker on the 2-core box took
    36-50 s and 52-69 CPU-s with one thread, 48-53 s and 80-88 CPU-s with two. Process-wide in
    torch, hence restored afterwards.
    """
    before = torch.get_num_threads()
    if before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _item_outputs(item: workers_mod.Item, plan: ConversionPlan,
                  writer: ShardSetWriter) -> Iterator[tuple[OutTensor, int, int, tuple[int, int] | None]]:
    """What `item` produces: (output, writer slot, rank to produce for, unit range or None), rank
    after rank. The writer's slot `tp` holds the common files; a common tensor is produced once,
    by rank 0 (its split has one piece, so every rank's producer would yield the same bytes). An
    output whose shard an interrupted run sealed is not produced at all."""
    tp = plan.tp
    outputs = item.group.outputs[::-1] if item.reverse else item.group.outputs
    for rank in item.ranks:
        for out in outputs:
            slot = tp if plan.is_common(out) else rank
            takes, part = item.takes(out)
            if not takes or (slot == tp and rank != 0) or writer.is_sealed(slot, out.name):
                continue
            yield out, slot, 0 if slot == tp else rank, part


def _convert_item(item: workers_mod.Item, plan: ConversionPlan, writer: ShardSetWriter, io: _IOThread,
                  pool: buffers.BufferPool, src: SourceCheckpoint) -> None:
    """Produce and write one item, on a worker thread or in a worker process. An item of several
    ranks keeps the column views it reads for the next rank (workers.items says why)."""
    writer.use_io(io)
    log.debug("%s (%s): converting", item.group.key, item.who)
    with buffers.using(pool), (src.sharing_columns() if item.span > 1 else contextlib.nullcontext()):
        cache: dict[str, Any] = {}
        last: int | None = None
        for out, slot, rank, part in _item_outputs(item, plan, writer):
            if rank != last:  # the cache is one rank's (plan.Producer)
                cache, last = {}, rank
            chunks = out.produce(rank, cache) if part is None else out.produce(rank, cache, part=part)
            writer.write(slot, out, chunks, part)
    # Wait for this item's writes: queued buffers may be views of source pages, and the
    # worker's next item must start with none of them alive (bounded working set).
    io.drain()


@dataclass
class _SetWork:
    """One converted set as the workers see it: its layout, folder, writer slots and items."""

    layout: SetLayout
    subdir: str
    work: list[workers_mod.Item]

    @property
    def shards(self) -> list[list[ShardPlan]]:
        return self.layout.shards + [self.layout.common]  # slot tp: the common files

    @property
    def largest(self) -> int:
        """The largest item's working set (workers.working_set)."""
        return max((workers_mod.working_set(g.outputs) for g in self.layout.plan.groups), default=0)


def _worker_processes(n: int, plan: ConversionPlan, sets: dict[str, _SetWork], root: Path, src: SourceCheckpoint,
                      kept: dict[str, Sealed], stop: Any, fault: FaultHook | None, direct: bool) -> procs.WorkerProcesses:
    """Fork the conversion's worker processes (procs.py); a task is (set key, item number)."""
    keep = max(s.largest for s in sets.values())

    def start(send: procs.Send) -> dict[str, Any]:  # in each worker process, right after the fork
        src.after_fork()
        return {"send": send, "writers": {}, "io": _IOThread(stop=stop), "pool": buffers.BufferPool(keep_bytes=keep)}

    def run(task: tuple[str, int], state: dict[str, Any]) -> list[dict[str, Any]]:
        key, i = task
        job, writers, send = sets[key], state["writers"], state["send"]
        if key not in writers:
            writers[key] = ProcessShardWriter(root, job.subdir, job.shards, job.layout.plan.outputs(), kept, stop,
                                              fault, report=lambda f, a, n, lv: send(("w", f, a, n, lv)),
                                              direct=direct)
        _convert_item(job.work[i], plan, writers[key], state["io"], state["pool"], src)
        return src.values.take()  # --allow-nonfinite records, merged by the parent

    def end(state: dict[str, Any], ok: bool) -> None:
        try:
            state["io"].close() if ok else state["io"].abort()
        finally:
            for w in state["writers"].values():
                w.close()

    return procs.WorkerProcesses(n, start=start, run=run, end=end, stop=stop)


def _write_set(key: str, job: _SetWork, root: Path, plan: ConversionPlan, progress: Callable[[int], None],
               src: SourceCheckpoint, staging: Staging, kept: dict[str, Sealed], fault: FaultHook | None,
               workers: int, max_memory: int, stop: Any, pool: procs.WorkerProcesses | None,
               direct: bool) -> tuple[list[WrittenFile], dict[tuple[int, str], str]]:
    """Convert one set on `pool`'s processes, or on `workers` threads when there is no pool."""
    tp = plan.tp
    assert staging.journal is not None
    writer = ShardSetWriter(root, job.subdir, job.shards, job.layout.plan.outputs(), staging.journal, kept,
                            on_bytes=progress, stop=stop, fault=fault, direct=direct)
    progress(writer.kept_bytes)
    work = job.work
    index = {id(item): i for i, item in enumerate(work)}

    def needs(i: int) -> Iterator[str]:
        """The source tensors item i reads (prefetch.py reads them before it starts)."""
        for out, _, rank, part in _item_outputs(work[i], plan, writer):
            yield from out.sources_of_units(rank, part)

    ahead = Prefetcher(src, len(work), needs) if hasattr(os, "posix_fadvise") else None
    budget = workers_mod.Budget(max_memory, stop)

    def reached(item: workers_mod.Item) -> None:
        """The readahead may go on past the item; the item waits for its own bytes."""
        if ahead is not None:
            i = index[id(item)]
            ahead.reached(i)
            ahead.wait_read(i)

    # Threads draw output chunks from one pool of reused buffers (buffers.py; each worker process
    # has its own); the free ones it keeps stay within what the workers' working sets may hold.
    buffer_pool = buffers.BufferPool(keep_bytes=0 if pool is not None else min(max_memory, workers * job.largest))
    try:
        if pool is not None:
            def prepare(item: workers_mod.Item) -> None:  # here, before the item is handed to a process
                reached(item)
                files: set[str] = set()
                for out, slot, rank, _ in _item_outputs(item, plan, writer):
                    writer.open_shards(slot, [out.name])
                    files.update(src.info(n).file for n in out.sources_of(rank) if n in src)
                src.wait_for(sorted(files))
                log.debug("%s (%s): to a worker process", item.group.key, item.who)

            def finished(item: workers_mod.Item, records: list[dict[str, Any]]) -> None:
                src.values.merge(records)
                log.debug("%s (%s): converted", item.group.key, item.who)

            pool.run_items(job.work, lambda i: (key, i), budget=budget, prepare=prepare,
                           message=lambda m: writer.written_elsewhere(m[1], m[2], m[3], m[4]), finished=finished)
        else:
            def convert_item(item: workers_mod.Item, io: object) -> None:
                assert isinstance(io, _IOThread)
                reached(item)
                _convert_item(item, plan, writer, io, buffer_pool, src)

            def end_worker(io: object) -> None:
                if isinstance(io, _IOThread):
                    if stop.is_set():
                        io.abort()  # bounded: a stuck write cannot hold the stop
                    else:
                        io.close()

            workers_mod.run_items(job.work, convert_item, workers=workers, budget=budget, stop=stop,
                                  worker_state=lambda: _IOThread(stop=stop), end_worker=end_worker)
        files = writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        buffer_pool.clear()
        if ahead is not None:
            ahead.close()
    where = dict(writer.tensor_file)
    for (slot, name), f in writer.tensor_file.items():
        if slot == tp:  # every rank reads a common tensor from the same file
            for r in range(tp):
                where[(r, name)] = f
    return files, where


def _copy_side_files(src: Path, dst: Path, requant: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Config, generation config and tokenizer files, and the Python files their `auto_map`s load
    with trust_remote_code (safetensors_file.side_files: one that resolves outside SRC is refused,
    never read), with their sizes and hashes. Under --quantize (`requant`, the plan's record)
    config.json is written with the served `quantization_config` instead (codecs/requant.py), so that
    a runtime reading it sees what the directory holds."""
    copied = {}
    for name in side_files(src):
        p = src / name
        if name == "config.json" and requant is not None:
            cfg = loads(read_regular(p))
            cfg["quantization_config"] = requant["quantization_config"]
            (dst / name).write_text(json.dumps(cfg, indent=2) + "\n")
        else:
            shutil.copy2(p, dst / name)
        copied[name] = {"bytes": (dst / name).stat().st_size, digest.WRITTEN: digest.file_digest(dst / name)}
    return copied


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], target: str | None = None, *,
            tp: int | None = None, shard_size: int | str | None = None, mtp: bool | None = None,
            profile: str | None = None, mla_bmm: str | None = None, ep: bool | None = None,
            dp_attention: bool | None = None, shared_experts: str | None = None, mori: bool | None = None,
            quantize: str | None = None, options: ConversionOptions | None = None, force: bool = False, progress: bool = False,
            resume: str = "auto", wait: bool = False, notify: Callable[[str], None] | None = None,
            workers: int | None = 1, worker_mode: str = "auto", max_memory: int | str | None = None,
            keep_cached: bool | None = False, allow_nonfinite: bool = False, revision: str | None = None,
            hub_cache: str | None = None) -> dict[str, Any]:
    """Convert a Hugging Face DeepSeek/Kimi checkpoint into ATOM's post-load layout.

    Args:
        src: checkpoint folder (config.json plus model.safetensors or an index and shards), or a Hugging
            Face repo id `org/name[@revision]`: downloaded while converting (`hub.py`).
        dst: output folder; must not exist unless `force`. Missing parents are created (mkdir -p).
        target: "gfx950" (MI355, e4m3fn) or "gfx942" (MI300/MI325, e4m3fnuz).
        tp: ATOM's `-tp`: the number of GPUs; one set of shards per rank.
        ep: ATOM's `--enable-expert-parallel` (spec atom-parallel.md §1): whole experts per rank.
        dp_attention: ATOM's `--enable-dp-attention` (§2): attention, dense MLPs, embeddings and
            lm_head whole on every rank (stored once), routed experts split by EP or MoE-TP.
        shared_experts: "fused" (ATOM_FUSE_SHARED_EXPERT=1, default) or "separate" (=0, with
            dp_attention and mori only, spec §3.2).
        mori: whether the serving host can import `mori` (decides the shared-expert mode, §3.2-3.3).
        shard_size: upper bound per shard file (bytes, or text like "5GB").
        mtp: convert the DeepSeek-V3/R1 MTP layer into `dst/mtp/` (False drops it).
        force: replace an existing `dst`, only if it is an earlier conversion or empty.
        progress: show a tqdm bar in bytes.
        mla_bmm: "fp8" (default) or "mxfp4" (gfx950, ATOM_USE_TRITON_MXFP4_BMM=1): the format of the
            MLA operands W_K/W_V.
        quantize: re-encode while converting (atom-layout-next.md §4.4-4.5): "mxfp4" (gfx950: routed
            experts to MXFP4 with amd-quark's rounding) or "fp8" (DeepSeek fp8 block-128: the routed
            experts of an int4 source, every linear DeepSeek quantises of a bf16 one). Required for a
            compressed-tensors int4 source (ATOM has no int4 MoE); None keeps the stored format.
        resume: what to do with the partial conversion an interrupted run left beside `dst`:
            "auto" (default) resumes it when the source and options are unchanged, refuses otherwise;
            "resume" does the same and says when there is nothing to resume; "restart" discards it.
        wait: when another conversion into `dst` runs, wait for it instead of refusing.
        notify: receives one-line notes (resuming, waiting); default: this module's logger
            ("atom_convert.convert", a child of the "atom_convert" logger), at INFO.
        workers: how many (layer, rank) items are converted in parallel; None: every usable core
            (the CLI's default). The output is byte-identical for every value.
        worker_mode: "auto" (default): with more than one worker, forked worker processes where
            the platform can fork (procs.py), else threads; "process" or "thread" to choose.
        max_memory: byte budget for the workers' working sets (bytes or text like "16GB"); None:
            half of the memory available. Workers wait rather than exceed it.
        keep_cached: leave the output in the page cache, for a load that follows on this host:
            False (default) writes the large buffers' whole blocks around it (O_DIRECT: less kernel
            work, the page cache left to others; a load right after reads the disk); True writes
            every byte through it; None: True when the output fits in half of the available memory
            (`ensure_converted`'s default: the server's load comes next). The bytes are the same.
        allow_nonfinite: convert even when source values are NaN/Inf, fp8 NaN codes, scales <= 0
            or e8m0 NaN (an error by default); each such tensor is recorded in the manifest's
            `value_checks.warnings`.

    Returns:
        The manifest (also written to `dst/atom_manifest.json`); when pulled from `hub_cache`, the
        repo's manifest plus `pulled_from` (the repo id).

    Raises:
        BadInputError: bad input or options, a destination that may not be replaced, a running
            conversion into `dst`, disk full, read-only or permission errors.
        Interrupted: Ctrl-C or SIGTERM (a KeyboardInterrupt); the message says how to resume.

    Example:
        >>> import atom_convert
        >>> m = atom_convert.convert("DeepSeek-V3", "DeepSeek-V3-atom-gfx950", target="gfx950", tp=8)
    """
    t0 = time.perf_counter()
    opts = ConversionOptions.build(options, target=target, tp=tp, shard_size=shard_size, mtp=mtp, profile=profile,
                                   mla_bmm=mla_bmm, ep=ep, dp_attention=dp_attention, shared_experts=shared_experts,
                                   mori=mori, quantize=quantize)
    for name, path in (("src", src), ("dst", dst)):
        check_path(name, path)
    for name, flag in (("force", force), ("progress", progress), ("wait", wait), ("allow_nonfinite", allow_nonfinite)):
        check_flag(name, flag)
    if notify is not None and not callable(notify):
        raise BadInputError(f"notify must be a callable taking one str (or None), got {notify!r}")
    note = notify or log.info
    if resume not in RESUME_MODES:
        raise BadInputError(f"resume={resume!r}; choose one of {', '.join(RESUME_MODES)}")
    workers = workers_mod.usable_cores() if workers is None else check_count("workers", workers)
    if worker_mode not in WORKER_MODES:
        raise BadInputError(f"worker_mode={worker_mode!r}; choose one of {', '.join(WORKER_MODES)}")
    if worker_mode == "process" and not procs.available():
        raise BadInputError("worker processes need fork(), which this platform does not offer; use "
                            "--worker-mode thread (worker_mode='thread')")
    if worker_mode == "auto":
        worker_mode = "process" if procs.available() else "thread"
    if keep_cached not in (True, False, None):
        raise BadInputError(f"keep_cached must be True, False or None, got {keep_cached!r}")
    budget = workers_mod.default_max_memory() if max_memory is None else parse_size(max_memory)
    from ..hub.pull import conversion_record, pull_converted
    from ..hub.repo import open_source

    _large_allocations_via_mmap()
    # A repo id resolves to its local snapshot folder (headers by ranged requests; shards download
    # while converting, hub.py); the destination checks then compare DST with that folder.
    source = open_source(src, revision, allow_nonfinite=allow_nonfinite)
    paths = None
    try:
        paths = check_destination(source.path, dst, force)
        plan = make_plan(source, opts)
        main, mtp_layout = layout_shards(plan, opts.shard_size)
        record = conversion_record(source, opts)
        planned = planned_shards(main, mtp_layout)
        # A Hub source is content-addressed by its commit (its shards may not be downloaded yet).
        if source.hub:
            source_fp = Fingerprint("source", {"hub": f"{source.hub['repo_id']}@{source.hub['commit']}"})
        else:  # a folder: with its files' sizes and times, so a file rewritten in place is not resumed over
            fp = source_fingerprint(source.path)
            source_fp = Fingerprint("source", {**fp.parts, **{f"{n} (size, modification time)": s
                                                               for n, s in source_stamps(source.path, fp).items()}})
        header = {"source": source_fp.as_dict(),
                  "options": options_fingerprint(opts).as_dict(),
                  "plan": plan_digest(planned)}
        created: list[Path] = []
        try:
            created = make_parents(paths.parent)
            with DestinationLock(paths, wait=wait, notify=note):
                staging = Staging(paths, note)
                staging.recover_swap()
                check_replaceable(paths.dst, force)  # again: another run may have finished meanwhile
                if hub_cache is not None:  # under the lock: a pull replaces DST as a conversion does
                    pulled = pull_converted(hub_cache, record["content_key"], paths.dst)
                    if pulled is not None:
                        return {**pulled, "pulled_from": hub_cache}
                with _one_intra_op_thread():
                    return _run(plan, main, mtp_layout, source, staging, header, planned, resume, progress, t0,
                                workers, worker_mode, budget, record, keep_cached)
        except BaseException:
            if not os.path.lexists(paths.staging):
                remove_created(created)
            raise
    except OSError as e:
        msg = os_error_message(e, None, paths) if paths is not None else None
        if msg is None:
            raise
        raise BadInputError(msg[0]) from e
    finally:
        source.close()


def _run(plan: ConversionPlan, main: SetLayout, mtp_layout: SetLayout | None, source: SourceCheckpoint,
         staging: Staging, header: dict[str, Any], planned: dict[str, str], resume: str, progress: bool,
         t0: float, workers: int, worker_mode: str, budget: int, record: dict[str, Any],
         keep_cached: bool | None) -> dict[str, Any]:
    """Steps 4-6 of the module docstring, under the lock; the failure policy is here."""
    fault = FaultHook.for_run()
    try:
        kept = {s.file: s for s in staging.open(header, planned, resume)}
    except OSError:
        if staging.created:  # a new staging directory that could not be set up: nothing to keep
            staging.remove()
        raise
    tmp = staging.root
    total = sum(s.nbytes for ls in ([main] + ([mtp_layout] if mtp_layout else [])) for r in ls.shards + [ls.common]
                for s in r)
    direct = not (total <= workers_mod.available_memory() // 2 if keep_cached is None else keep_cached)
    sets = {"main": _SetWork(main, "", workers_mod.items(main.plan.groups, plan.tp, workers))}
    if mtp_layout is not None:
        sets["mtp"] = _SetWork(mtp_layout, MTP_DIR, workers_mod.items(mtp_layout.plan.groups, plan.tp, workers))
    stop: Any = threading.Event()
    pool: procs.WorkerProcesses | None = None
    bar: tqdm | None = None

    def end_pool() -> None:
        """The worker processes gone (stopped first unless they finished), before any cleanup."""
        if pool is not None and not pool.ended:
            stop.set()
            pool.close()

    try:
        if worker_mode == "process" and workers > 1:
            # Forked before this conversion starts threads of its own (procs.py, step 1), so before
            # the Hub downloads and the progress bar below; for both sets.
            stop = procs.SharedFlag()
            try:
                pool = _worker_processes(min(workers, max(len(j.work) for j in sets.values())), plan, sets, tmp,
                                         source, kept, stop, fault, direct)
            except procs.StartFailed as e:
                log.warning("%s (a thread of this process held a lock across the fork); converting on %d threads "
                            "instead", e, workers)
                stop = threading.Event()
        source.begin(_read_order(plan, source))  # a Hub source starts its downloads in this order
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="atom-convert", disable=not progress)
        # The main set first: it reads the shards in file order, so a source still downloading
        # is converted as it arrives; the MTP layer lives in the last shards.
        files, where = _write_set("main", sets["main"], tmp, plan, bar.update, source, staging, kept, fault, workers,
                                  budget, stop, pool, direct)
        copied = _copy_side_files(source.path, tmp, plan.requant)
        mtp_manifest = None
        if mtp_layout is not None:
            mfiles, mwhere = _write_set("mtp", sets["mtp"], tmp, plan, bar.update, source, staging, kept, fault,
                                        workers, budget, stop, pool, direct)
            mcopied = _copy_side_files(source.path, tmp / MTP_DIR, plan.requant)
            mtp_manifest = build_manifest(plan, mtp_layout.plan, source, mfiles, mwhere, mcopied, role="mtp")
            write_manifest(tmp / MTP_DIR / MANIFEST_NAME, mtp_manifest)
        manifest = build_manifest(plan, main.plan, source, files, where, copied, role="main",
                                  mtp_dir=tmp / MTP_DIR if mtp_manifest else None,
                                  seconds=time.perf_counter() - t0)
        manifest["conversion"] = record
        if pool is not None:
            pool.close()  # every item is done: they leave
        write_manifest(tmp / MANIFEST_NAME, manifest)  # last: its presence means complete
        staging.commit()
        return manifest
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM through the CLI's handler
        end_pool()
        staging.close()
        staging.remove_partials()
        signum = getattr(e, "signum", signal.SIGINT)
        sealed = staging.sealed
        how = "SIGTERM" if signum == signal.SIGTERM else "SIGINT (Ctrl-C)"
        if sealed:
            msg = (f"interrupted by {how}: {len(sealed)} of {len(planned)} shards are sealed in {staging.root}; run "
                   "the same command again (or add --resume) to continue from them, or --restart to start over")
        else:
            staging.remove()
            msg = f"interrupted by {how} before any shard was sealed; nothing was kept"
        raise Interrupted(signum, msg) from None
    except OSError as e:
        end_pool()
        m = os_error_message(e, staging, staging.paths)
        if m is None:
            staging.remove()
            raise
        text, keep = m
        if keep:
            staging.close()
            staging.remove_partials()
        else:
            staging.remove()
        raise BadInputError(text) from e
    except BaseException:
        end_pool()
        staging.remove()
        raise
    finally:
        end_pool()
        if bar is not None:
            bar.close()


def _read_order(plan: ConversionPlan, source: SourceCheckpoint) -> list[str]:
    """Source files in the order the conversion first reads them."""
    order: dict[str, None] = {}
    for mp in (plan.main, plan.mtp):
        for o in mp.outputs() if mp is not None else []:
            for name in o.sources:
                if name in source:
                    order.setdefault(source.info(name).file, None)
    return list(order)
