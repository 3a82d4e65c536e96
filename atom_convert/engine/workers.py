"""Workers: (group, rank) items, their memory budget, and the thread runner.

How it works:
1. A converted set is cut into items, one per (group, rank): a decoder layer's
   tensors for one rank; a layer's experts are further cut into contiguous ranges,
   one item each (`parts_per_group`), so that the cores find work inside one layer
   and the first items of a layer need not wait for all of its source to be read.
   Under MoE tensor parallel an item makes its range for every rank (`items`).
   Items are handed out in load order (group-major,
   so at tp=8 sixteen workers hold one or two layers, not sixteen), each to the
   next free worker: a forked worker process (procs.py, the default with several
   workers) or a thread of this process (`run_items`; the GIL and the shared
   address space keep threads to 4-6 busy cores, BENCHMARKS.md).
2. Before an item starts, its estimated working set is reserved from a byte
   budget (`--max-memory`); an item that does not fit waits until running ones
   finish (one item alone always runs). So resident memory stays within the
   budget whatever the number of workers.
3. Every worker writes through its own write-behind thread at the planned
   offsets (`ShardSetWriter`): the output does not depend on the number of
   workers or the order items finish in.
4. The first error in any worker sets a shared stop flag; the others stop at
   their next buffer (the writer checks it), and the error is raised in the
   caller, which removes the staging directory.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Callable, Iterable

from ..errors import BadInputError
from ..inflight import InFlight, join_in_steps
from ..layout.plan import Group, OutTensor

# Besides the chunk being produced, a worker holds at most the chunk's source pages, one
# intermediate copy (concatenation, padding or fnuz) and the chunks queued to its
# write-behind thread (_IOThread's queue depth 4): a working set of this many chunks.
CHUNKS_PER_WORKER = 3 + 4
_MIN_ITEM = 64 << 20  # per item: norms, small tensors, Python objects


def usable_cores() -> int:
    """The CPUs this process may run on (sched_getaffinity: cgroup and taskset limits apply)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def available_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes); 8 GB if it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 8 * 1000**3


def default_max_memory() -> int:
    """Half of the memory available now: the rest stays for the page cache, which holds the
    source being read and the output until the hashing threads have read it back."""
    return available_memory() // 2


def chunk_bytes(out: OutTensor) -> int:
    """The largest piece `out`'s producer holds at once."""
    return out.chunk_bytes or out.nbytes


def working_set(outputs: Iterable[OutTensor]) -> int:
    """Estimated peak bytes one worker holds while producing these outputs (one rank's share
    of a group); sizes the budget, see CHUNKS_PER_WORKER."""
    outs = list(outputs)
    largest = max((chunk_bytes(o) for o in outs), default=0)
    return CHUNKS_PER_WORKER * largest + _MIN_ITEM


@dataclass(frozen=True)
class Item:
    group: Group
    rank: int
    cost: int  # bytes reserved from the budget while it runs
    # A range [a, b) of the group's experts (its outputs with `units`), or None: all of them. The
    # item with a == 0 (or None) also produces the group's other outputs.
    part: tuple[int, int] | None = None
    # The item produces ranks rank .. rank + span - 1, one after another, on one worker (`items`
    # says when), starting at rank + first.
    span: int = 1
    first: int = 0
    # Each rank's outputs in the reverse of the group's order (ALTERNATE_OUTPUT_ORDER).
    reverse: bool = False

    @property
    def ranks(self) -> list[int]:
        return [self.rank + (self.first + j) % self.span for j in range(self.span)]

    @property
    def who(self) -> str:
        """For messages: 'rank 3', or 'ranks 0-7' for an item of several ranks."""
        return f"rank {self.rank}" if self.span == 1 else f"ranks {self.rank}-{self.rank + self.span - 1}"

    def takes(self, out: OutTensor) -> tuple[bool, tuple[int, int] | None]:
        """Whether this item produces `out`, and which range of its units."""
        if self.part is None:
            return True, None
        if out.units:
            return True, self.part
        return self.part[0] == 0, None


# Source bytes one range of a layer's experts (all ranks' items of that range) reads, at most.
# Why: the readahead (prefetch.py) reads the source in item order and an item starts once its
# own source bytes are in, so the first range of a layer waits for its bytes alone; one range
# per rank made every item of the layer wait for the whole layer (11.5 GB at DeepSeek-V3 width),
# the cores idle meanwhile (BENCHMARKS.md, issue 9, eighth round).
PART_SOURCE_BYTES = 1 << 30


# Items per worker in one layer of experts, at least: fewer leave the last items of a layer (and, in
# a 2-layer checkpoint, of the conversion) on some cores while the others idle; more cost each item's
# setup and its wait for the readahead. On the device, 4 against 2 and 8 (BENCHMARKS.md, thirtieth round).
ITEMS_PER_WORKER = 4


def parts_per_group(workers: int, tp: int, unit_bytes: int = 0, span: int = 1) -> int:
    """How many ranges one layer's experts are cut into: enough that `workers` threads find
    work inside one layer (a 2-layer checkpoint has only one MoE layer), and that one range of
    every rank reads at most about PART_SOURCE_BYTES of source. There are tp / span items per
    range (DeepSeek-V3 at tp=8 under EP: 8 (layer, rank) items per layer before any cut).
    `unit_bytes`: one rank's bytes of the group's expert outputs; every rank reads a slice of the
    same experts (MoE-TP) or its own experts (EP): tp times that is the layer's expert source,
    near enough (fp8 and MXFP4 stay as stored)."""
    by_workers = -(-ITEMS_PER_WORKER * workers * span // tp) if workers > 1 else 1
    by_bytes = -(-tp * unit_bytes // PART_SOURCE_BYTES)
    return max(1, by_workers, by_bytes)


def shares_experts(group: Group) -> bool:
    """Whether every rank reads slices of the same experts (MoE tensor parallel, or a plan with
    one rank), not experts of its own (EP, `OutTensor.rank_sources`)."""
    stacked = [o for o in group.outputs if o.units]
    return bool(stacked) and all(o.rank_sources is None for o in stacked)


# Items of the odd passes over the ranks make each rank's outputs in reverse order, so that the two
# items at one rank at once (16 workers, tp 8) write different tensors, which a smaller shard size puts
# in different files (a file takes one write at a time). Off: on the 2-core box it changed nothing, with
# 256 MB shards or without (BENCHMARKS.md, thirty-second round); on 16 cores it is not yet measured.
ALTERNATE_OUTPUT_ORDER = False


# An item that cannot be cut (a group without experts) and writes at least this many bytes is handed
# out first, the largest first. Why: in load order lm_head came last; at tp 1 (1.85 GB at DeepSeek-V3
# width) it then kept one worker busy alone at the end while the other cores idled (BENCHMARKS.md,
# eighteenth round). At tp 8 a rank's share of the embedding or lm_head (231 MB at that width) stays
# under this size, and those items keep their place.
FIRST_ITEM_BYTES = 256 << 20


def items(groups: list[Group], tp: int, workers: int = 1, parts: int | None = None) -> list[Item]:
    """Every (group, rank), group-major: the order the files are laid out in; a group with
    experts is cut into `parts_per_group` ranges of contiguous experts, handed out range-major
    (range 0 of every rank, then range 1, ...). Why range-major: the ranks working at once then
    read the same experts under MoE tensor parallel (one range's source pages in the page cache,
    not the layer's, read in the order the readahead brings them), and each rank's shard fills
    from its start, so its hashing thread follows the conversion instead of hashing most of the
    layer after the last range.

    Where every rank reads slices of the same experts (`shares_experts`), one item makes a range
    for every rank (span tp): a rank's slice of a down_proj is a column slice, which touches every
    page of the expert's down_proj, and one worker that makes every rank's slice while the pages
    stay mapped (source.SourceCheckpoint.sharing_columns) faults them in once, not once per rank
    on tp workers (BENCHMARKS.md, thirtieth round). Under EP each rank reads its own experts:
    one item per (range, rank).

    With several workers, uncut items of FIRST_ITEM_BYTES or more come first, the largest first.
    `parts`: that many ranges per group instead (tests)."""
    out = []
    for g in groups:
        cost = working_set(g.outputs)
        units = max((o.units for o in g.outputs), default=0)
        span = tp if units and shares_experts(g) else 1
        if not units:
            n = 1
        else:
            n = min(parts or parts_per_group(workers, tp, sum(o.nbytes for o in g.outputs if o.units), span), units)
        if n == 1 and span == 1:
            out.extend(Item(g, r, cost) for r in range(tp))
            continue
        for k in range(n):
            part = (k * units // n, (k + 1) * units // n)
            # Range k starts at its k-th rank: the items running at once then write to different
            # ranks' shards, not all to rank 0's and then all to rank 1's (writers of one file take turns).
            flip = ALTERNATE_OUTPUT_ORDER and (k * (tp // span) // tp) % 2 == 1
            out.extend(Item(g, r, cost, part, span, k % span, flip) for r in range(0, tp, span))
    if workers > 1:
        size = {id(g): sum(o.nbytes for o in g.outputs) for g in groups}
        first = [i.part is None and size[id(i.group)] >= FIRST_ITEM_BYTES for i in out]
        out = (sorted((i for i, f in zip(out, first) if f), key=lambda i: -size[id(i.group)])  # stable
               + [i for i, f in zip(out, first) if not f])
    return out


class Budget:
    """A byte budget shared by the workers; `acquire` blocks until the item fits, or the stop
    event is set (then it returns False). An item larger than the whole budget runs alone."""

    def __init__(self, limit: int, stop: threading.Event):
        if limit <= 0:
            raise BadInputError(f"--max-memory must be positive, got {limit} bytes")
        self.limit = limit
        self.used = 0
        self.running = 0
        self.peak = 0  # largest reservation held at once (for tests and benches)
        self._stop = stop
        self._cond = threading.Condition()

    def acquire(self, n: int) -> bool:
        with self._cond:
            while not self._stop.is_set() and self.running and self.used + n > self.limit:
                self._cond.wait(0.1)
            if self._stop.is_set():
                return False
            self.used += n
            self.running += 1
            self.peak = max(self.peak, self.used)
            return True

    def try_acquire(self, n: int) -> bool:
        """`acquire` without the wait: False when the item does not fit now."""
        with self._cond:
            if self.running and self.used + n > self.limit:
                return False
            self.used += n
            self.running += 1
            self.peak = max(self.peak, self.used)
            return True

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self.running -= 1
            self._cond.notify_all()


def run_items(work: list[Item], do: Callable[[Item, object], None], *, workers: int, budget: Budget,
              stop: threading.Event, worker_state: Callable[[], object] = lambda: None,
              end_worker: Callable[[object], None] = lambda s: None) -> None:
    """Run `do(item, state)` for every item on `workers` threads; the first error stops all and
    is raised here. `worker_state()` makes a worker's state (its write-behind thread) on the
    worker's own thread; `end_worker(state)` ends it, also after an error."""
    if workers < 1:
        raise BadInputError(f"--workers must be >= 1, got {workers}")
    queue = iter(work)
    take = threading.Lock()
    errors: list[BaseException] = []
    inflight = InFlight()

    def worker() -> None:
        if not inflight.enter():
            return
        state = None
        try:
            state = worker_state()
            while not stop.is_set():
                with take:
                    item = next(queue, None)
                if item is None:
                    return
                if not budget.acquire(item.cost):
                    return
                try:
                    do(item, state)
                finally:
                    budget.release(item.cost)
        except BaseException as e:  # noqa: BLE001  re-raised in the caller
            with take:
                errors.append(e)
            stop.set()
        finally:
            try:
                end_worker(state)
            except BaseException as e:  # noqa: BLE001
                with take:
                    errors.append(e)
                stop.set()
            inflight.leave()

    threads = [threading.Thread(target=worker, name=f"atom-convert-worker-{i}", daemon=True)
               for i in range(min(workers, max(1, len(work))))]
    try:
        for t in threads:
            t.start()
        join_in_steps(threads)
    except BaseException:  # Ctrl-C reaches the main thread only: stop the workers, then leave
        stop.set()
        # Bounded: a worker whose write is stuck for ever (a dead network filesystem) must not
        # hold Ctrl-C; the threads are daemons and the writer's abort removes what they left.
        # Counted by the workers themselves, not joined (inflight.py says why).
        inflight.stop_and_wait(10.0)
        raise
    if errors:
        raise first_error(errors)


def first_error(errors: list[BaseException]) -> BaseException:
    """The error to raise after a stop: the first real one, not a worker's `Cancelled` (it only
    says that the worker stopped because another one failed or the run was interrupted)."""
    from .writer import Cancelled

    real = [e for e in errors if not isinstance(e, Cancelled)]
    return (real or errors)[0]
