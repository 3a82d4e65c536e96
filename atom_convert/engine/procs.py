"""Worker processes: a conversion's items converted in forked processes.

Why: on the 16-core device machine, the plan's MoE producers on 16 threads of one process kept
3.5-4 cores busy (1.6 GB/s of output), the same producers in 16 forked processes 12.6 cores
(8.7 GB/s; `bench/moe_scaling.py`, BENCHMARKS.md "Issue 9, fifth round"). Threads share one
interpreter lock and one address space, whose page faults, madvise/munmap calls and TLB
shootdowns they serialise on; processes share neither.

How it works:
1. `WorkerProcesses` forks its processes once per conversion, before the conversion starts any
   thread of its own (Hub downloads, readahead, hashing): a fork copies only the calling thread,
   and a lock another thread held at that moment (a library's at-fork handler may take it) would
   stay locked in the child for ever. Each process gets the plan, the source index and the item
   lists through the fork: only item numbers and small messages are pickled. It reports "ready";
   a process that does not within START_TIMEOUT_S (such a lock, held by a thread of the caller)
   makes the start fail (`StartFailed`: the caller converts on threads instead).
2. `run_items` hands out one set's items in order, one at a time to each idle process, after
   reserving the item's working set from the budget (workers.Budget) and calling `prepare(item)`:
   the shard files the item writes exist (a worker process opens them by name and never creates
   a file), and the source files it reads are downloaded (a Hub source).
3. A worker process runs the item and writes at the planned offsets through its own descriptors;
   it reports each buffer written as a message, which the parent hands to `message` (the shard's
   hashing thread follows the written prefix; the progress bar), then "done" with a result, which
   goes to `finished`.
4. The first error (pickled as it was raised, with its traceback) stops the others: a flag in
   shared memory they check at every buffer (a `SharedFlag`, the `stop` of the writer and the
   budget), then SIGKILL after a bounded wait. The processes ignore SIGINT and SIGTERM (the
   parent handles Ctrl-C and stops them), and the kernel kills a worker whose parent dies
   (PR_SET_PDEATHSIG), so a SIGKILLed conversion leaves no writer behind; a worker that dies
   (the OOM killer) is an error naming its exit status.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
import traceback
import warnings
from typing import Any, Callable

from ..errors import AtomConvertError
from ..files import libc
from .workers import Budget, Item, first_error

STOP_WAIT_S = 10.0  # after a stop, how long running workers may take to notice before they are killed
START_TIMEOUT_S = 60.0  # from the fork to "ready"
# Niceness the worker processes add to their own. Why: the shards' hashing threads run in the
# converting process and can only hash what the workers have written; with every core busy in a
# worker, they fell behind and hashed most of the output after the last item (the device machine,
# DeepSeek-V3.2 width, 16 workers: last item at 2.44 s, shards sealed at 3.63-3.82 s). At a lower
# priority the workers yield the cores the hashing threads need as the bytes come (BENCHMARKS.md,
# fourteenth round).
WORKER_NICE = 5
_POLL_S = 0.2
_SIGNALS = {signal.SIGINT, signal.SIGTERM}

Send = Callable[[tuple[Any, ...]], None]


def available() -> bool:
    """Whether worker processes can be forked here (POSIX with the fork start method)."""
    return hasattr(os, "fork") and "fork" in multiprocessing.get_all_start_methods()


class SharedFlag:
    """A stop flag in shared memory that forked processes see: `is_set` is one byte read, no lock
    (a process killed while holding a lock cannot wedge the others). Quacks as the
    `threading.Event` that the writer, the budget and the write-behind threads check."""

    def __init__(self) -> None:
        self._v = multiprocessing.get_context("fork").RawValue(ctypes.c_bool, False)

    def is_set(self) -> bool:
        return bool(self._v.value)

    def set(self) -> None:
        self._v.value = True


class StartFailed(AtomConvertError):
    """The worker processes did not all report ready (they are killed; nothing was converted)."""


class WorkerDied(AtomConvertError):
    """A worker process ended without reporting (killed by a signal, the OOM killer)."""


def _portable(e: BaseException) -> bytes:
    """The exception pickled as raised; one that does not survive a round trip becomes an
    AtomConvertError with its type and message."""
    try:
        data = pickle.dumps(e)
        pickle.loads(data)
        return data
    except Exception:  # noqa: BLE001
        return pickle.dumps(AtomConvertError(f"{type(e).__name__}: {e}"))


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to SIGKILL this process when the parent dies (Linux; elsewhere the closed
    pipe ends it at its next message)."""
    libc.set_parent_death_signal(int(signal.SIGKILL))
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _child(conn: Any, inherited: list[Any], start: Callable[[Send], Any], run: Callable[[Any, Any], Any],
           end: Callable[[Any, bool], None], stop: SharedFlag, parent: int, mask: Any, nice: int) -> None:
    for c in inherited:  # the parent's ends of the pipes: not this process's to hold
        c.close()
    _die_with_parent(parent)
    if nice:
        try:
            os.nice(nice)  # WORKER_NICE
        except OSError:
            pass
    for s in _SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    lock = threading.Lock()

    def send(msg: tuple[Any, ...]) -> None:
        with lock:  # the write-behind thread reports writes while this thread reports items
            conn.send(msg)

    def report(e: BaseException) -> None:
        stop.set()  # the others stop at their next buffer, without waiting for the parent to hear of it
        try:
            send(("error", _portable(e), traceback.format_exc()))
        except (OSError, EOFError):
            pass

    state, ok = None, False
    try:
        state = start(send)
        send(("ready",))
        while True:
            try:
                task = conn.recv()
            except EOFError:  # the parent is gone
                break
            if task is None:
                ok = True
                break
            send(("done", run(task, state)))
    except BaseException as e:  # noqa: BLE001  reported to the parent, which raises it
        report(e)
    finally:
        try:
            if state is not None:
                end(state, ok)
        except BaseException as e:  # noqa: BLE001
            if ok:
                ok = False
                report(e)
        conn.close()
    os._exit(0 if ok else 1)  # no atexit handlers or finalizers of the parent's objects


class WorkerProcesses:
    """`n` forked worker processes for one conversion (module docstring).

    In each process: `start(send)` makes its state (`send` passes a message to the parent's
    `message`), `run(task, state)` converts one item (`task` as `run_items` sends it) and returns
    what `finished` receives, `end(state, ok)` ends it (after the last item, or an error). The
    caller ends the processes with `close` (stop first after an error: they are killed if they do
    not leave in time).
    """

    def __init__(self, n: int, *, start: Callable[[Send], Any], run: Callable[[Any, Any], Any],
                 end: Callable[[Any, bool], None], stop: SharedFlag, start_timeout: float | None = None,
                 nice: int = WORKER_NICE):
        ctx = multiprocessing.get_context("fork")
        self.stop = stop
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.live: set[int] = set()
        self.idle: list[int] = []
        self._ended = False
        parent = os.getpid()
        # Signals blocked across the forks: a Ctrl-C arriving then must not run the parent's Python
        # handler in a child; each child ignores them, then restores the mask.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        try:
            with warnings.catch_warnings():
                # Python 3.12+ warns of fork() in a process with threads: see step 1 of the docstring.
                warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
                for i in range(n):
                    here, there = ctx.Pipe(duplex=True)
                    args = (there, self.conns + [here], start, run, end, stop, parent, mask, nice)
                    p = ctx.Process(target=_child, args=args, name=f"atom-convert-worker-{i}", daemon=True)
                    p.start()
                    there.close()
                    self.procs.append(p)
                    self.conns.append(here)
                    self.live.add(i)
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            self.close()
            raise
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        try:
            self._wait_ready(START_TIMEOUT_S if start_timeout is None else start_timeout)
        except BaseException:
            self.stop.set()
            self.close(wait=0.0)  # nothing was handed out: no write to wait for
            raise

    def _wait_ready(self, timeout: float) -> None:
        waiting = set(range(len(self.procs)))
        deadline = time.monotonic() + timeout
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StartFailed(f"{len(waiting)} of {len(self.procs)} worker processes did not start within "
                                  f"{timeout:g} s")
            for c in multiprocessing.connection.wait([self.conns[w] for w in waiting], min(left, _POLL_S)):
                w = self.conns.index(c)
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    raise StartFailed(f"worker process {self.procs[w].pid} ended while starting") from None
                if msg[0] == "error":
                    raise pickle.loads(msg[1])
                waiting.discard(w)
                self.idle.append(w)

    @property
    def ended(self) -> bool:
        return self._ended

    def run_items(self, work: list[Item], task: Callable[[int], Any], *, budget: Budget,
                  prepare: Callable[[Item], None], message: Callable[[tuple[Any, ...]], None],
                  finished: Callable[[Item, Any], None]) -> None:
        """Convert `work` (item i is sent to a process as `task(i)`); the first error is raised
        here once every running item has stopped (or its process has been killed after STOP_WAIT_S)."""
        if self._ended:
            raise AtomConvertError("internal: the worker processes have ended")
        running: dict[int, Item] = {}
        errors: list[BaseException] = []
        nxt = 0
        stopped_at: float | None = None
        stop = self.stop

        def fail(w: int, e: BaseException) -> None:
            item = running.pop(w, None)
            if item is not None:
                budget.release(item.cost)
            errors.append(e)
            stop.set()

        def gone(w: int) -> None:
            self.live.discard(w)
            if w in self.idle:
                self.idle.remove(w)
            self.procs[w].join(1.0)
            if w in running or not stop.is_set():
                where = (f" while converting {running[w].group.key} ({running[w].who})" if w in running
                         else " between items")
                fail(w, WorkerDied(f"worker process {self.procs[w].pid} ended with exit status "
                                   f"{self.procs[w].exitcode}{where}; if the system killed it for memory, pass fewer "
                                   f"--workers or a smaller --max-memory"))

        def drain(w: int) -> None:
            conn = self.conns[w]
            try:
                while conn.poll():
                    msg = conn.recv()
                    if msg[0] == "done":
                        item = running.pop(w)
                        budget.release(item.cost)
                        self.idle.append(w)
                        finished(item, msg[1])
                    elif msg[0] == "error":
                        e = pickle.loads(msg[1])
                        if hasattr(e, "add_note"):
                            e.add_note(f"in worker process {self.procs[w].pid}:\n{msg[2]}")
                        fail(w, e)
                    else:
                        message(msg)
            except (EOFError, OSError):
                gone(w)

        try:
            while True:
                while not stop.is_set() and self.idle and nxt < len(work) and budget.try_acquire(work[nxt].cost):
                    item = work[nxt]
                    try:
                        prepare(item)
                    except BaseException:
                        budget.release(item.cost)
                        raise
                    w = self.idle.pop()
                    running[w] = item
                    self.conns[w].send(task(nxt))
                    nxt += 1
                if not running and (nxt >= len(work) or stop.is_set()):
                    break
                if stop.is_set():
                    stopped_at = stopped_at or time.monotonic()
                    if time.monotonic() - stopped_at > STOP_WAIT_S:
                        break  # a process stuck in a write: killed when the pool ends
                for c in multiprocessing.connection.wait([self.conns[w] for w in self.live], _POLL_S):
                    drain(self.conns.index(c))
                if not self.live and (running or nxt < len(work)):
                    break
        except BaseException:  # Ctrl-C or SIGTERM (the CLI's handler), or prepare's error: stop them all
            stop.set()
            raise
        if errors:
            raise first_error(errors)
        if running or nxt < len(work):
            raise WorkerDied(f"the worker processes ended with {len(work) - nxt + len(running)} items left")

    def close(self, wait: float | None = None) -> None:
        """Tell every process to leave (after its current item, or at once when stopped), wait at
        most `wait` s (default STOP_WAIT_S) in all, then kill what is left."""
        if self._ended:
            return
        self._ended = True
        for c in self.conns:
            try:
                c.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + (STOP_WAIT_S if wait is None else wait)
        for p in self.procs:
            while p.is_alive() and time.monotonic() < deadline:
                p.join(_POLL_S)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(1.0)
        for c in self.conns:
            c.close()
