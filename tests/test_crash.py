"""Crash safety and resume, the lock, the destination checks and disk full.

A multi-shard conversion (tiny-deepseek-v3 fp8, tp=2, 200 KB shards: 48 shard files in two
sets) is killed at random points through the real CLI entry point in a child process,
then resumed; every output file must be byte-identical to an uninterrupted conversion and
the manifests equal apart from the timing field. The kill points are byte counts of shard
data written (a fault hook that tests/fault_launcher.py hands the writer sends the signal
from inside the write), so they land inside shards, at their last byte, and between a
shard's write and its seal. The children are forked from a forkserver that imported
atom_convert once (tests/crash_child.py): torch's import would otherwise dominate.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

import atom_convert
from atom_convert.errors import BadInputError, Interrupted
from atom_convert.store.staging import DestinationLock, DestPaths
from atom_convert.engine import writer as writer_mod
from atom_convert.engine.writer import ShardSetWriter, _IOThread

from cliutil import Shared, run_cli

PRESET = "tiny-deepseek-v3"
OPTS = ["--tp", "2", "--shard-size", "200KB", "--workers", "2"]  # the CLI: two worker processes
API_OPTS: dict[str, Any] = {"tp": 2, "shard_size": "200KB"}
N_SHARDS = 48  # of that conversion (the `ref` fixture checks it)
SEED = 20261201  # fixed, so that a failure can be replayed; printed with each point


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def digest(root: Path) -> dict[str, str]:
    return {k: hashlib.sha256(v).hexdigest() for k, v in tree(root).items()}


def beside(dst: Path) -> list[str]:
    """The tool's own names beside DST: staging directory, lock file, a replaced DST."""
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}."))


def assert_same_conversion(dst: Path, ref: Path) -> None:
    """Every file byte-identical, except the manifests: equal apart from conversion_seconds."""
    a, b = tree(dst), tree(ref)
    assert sorted(a) == sorted(b)
    for name in a:
        if name.endswith("atom_manifest.json"):
            ma, mb = json.loads(a[name]), json.loads(b[name])
            ma.pop("conversion_seconds", None)
            mb.pop("conversion_seconds", None)
            assert ma == mb, name
        else:
            assert a[name] == b[name], f"{name} differs from the uninterrupted conversion"


def staged_state(dst: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """(journal entries, files) of DST's staging directory (empty when there is none)."""
    st = dst.parent / f".{dst.name}.atom-partial"
    if not st.exists():
        return [], []
    files = sorted(p.relative_to(st).as_posix() for p in st.rglob("*") if p.is_file())
    lines = (st / ".atom-journal.jsonl").read_text().splitlines() if (st / ".atom-journal.jsonl").exists() else []
    entries = []
    for line in lines[1:]:
        try:
            entries.append(json.loads(line))
        except ValueError:
            pass  # a torn last line after SIGKILL
    return entries, files


_CTX: Any = None


def forkserver() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(["atom_convert.cli", "atom_convert.engine.convert", "crash_child"])  # torch with it
    return _CTX


def child_cli(args: list[Any], tmp: Path, fault: str | None = None, timeout: float = 120) -> tuple[int, str]:
    """The CLI in a forked child, `fault` ('N:SIGNAME') installed; (exit code, or -signal when killed; stderr)."""
    import crash_child

    err = tmp / f"stderr-{time.monotonic_ns()}"
    p = forkserver().Process(target=crash_child.run_cli, args=([str(a) for a in args], str(err), fault))
    p.start()
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join()
        pytest.fail(f"atom-convert {args} did not end within {timeout} s")
    return p.exitcode, err.read_text() if err.exists() else ""


@pytest.fixture(scope="module")
def src(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint(PRESET, "fp8")


@pytest.fixture(scope="module")
def ref(src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted conversion."""
    out = tmp_path_factory.mktemp("ref") / "ref"
    atom_convert.convert(src, out, **API_OPTS)
    assert len(list(out.rglob("*.safetensors"))) == N_SHARDS
    return out


@pytest.fixture(scope="module")
def shard_bytes(ref: Path) -> int:
    return sum(p.stat().st_size for p in ref.rglob("*.safetensors"))


def count_writes(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the tensors produced and written (the driver calls write() only for unsealed shards)."""
    n = {"tensors": 0}
    real = ShardSetWriter.write

    def write(self: ShardSetWriter, rank: int, out: Any, chunks: Any, part: Any = None) -> None:
        n["tensors"] += 1
        real(self, rank, out, chunks, part)

    monkeypatch.setattr(ShardSetWriter, "write", write)
    return n


def tensors_in(ref: Path, files: set[str]) -> int:
    """How many (rank, tensor) pairs the shards `files` (paths relative to DST) hold."""
    n = 0
    for root, prefix in ((ref, ""), (ref / "mtp", "mtp/")):
        m = json.loads((root / "atom_manifest.json").read_text())
        n += sum(1 for e in m["tensors"].values() for f in e["rank_files"] if prefix + f in files)
    return n


def resume_and_check(src: Path, dst: Path, ref: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """Resume in-process; check the result and that sealed shards were neither re-produced nor rewritten.
    Returns the number of shards kept."""
    entries, files = staged_state(dst)
    sealed_before = {e["sealed"]: (dst.parent / f".{dst.name}.atom-partial" / e["sealed"]).stat().st_ino
                     for e in entries}
    notes: list[str] = []
    n = count_writes(monkeypatch)
    atom_convert.convert(src, dst, notify=notes.append, **API_OPTS)
    monkeypatch.undo()
    assert_same_conversion(dst, ref)
    assert beside(dst) == [], beside(dst)
    total = tensors_in(ref, {p.relative_to(ref).as_posix() for p in ref.rglob("*.safetensors")})
    assert n["tensors"] == total - tensors_in(ref, set(sealed_before)), "sealed shards were produced again"
    for f, ino in sealed_before.items():
        assert (dst / f).stat().st_ino == ino, f"{f} was sealed before the resume but rewritten"
    if files:
        assert any(f"keeping {len(sealed_before)} of {N_SHARDS} shards" in x for x in notes), notes
    return len(sealed_before)


def check_stopped_state(dst: Path) -> None:
    """After a graceful stop: no DST, no shard being written, every staged shard in the journal."""
    assert not dst.exists()
    entries, files = staged_state(dst)
    assert not [f for f in files if f.endswith(".partial")], files
    assert sorted(e["sealed"] for e in entries) == sorted(f for f in files if f.endswith(".safetensors"))
    assert beside(dst) == ([f".{dst.name}.atom-partial"] if entries else [])


# ------------------------------------------------------------------------------------------------
# SIGKILL, SIGTERM, SIGINT at random points, then resume
# ------------------------------------------------------------------------------------------------


def test_sigkill_at_random_points_then_resume(src: Path, ref: Path, shard_bytes: int, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(SEED)
    points = sorted(rng.randrange(1, shard_bytes) for _ in range(10))
    kept = []
    for i, at in enumerate(points):
        dst = tmp_path / f"dst{i}"
        code, err = child_cli(["convert", src, dst, *OPTS], tmp_path, f"{at}:SIGKILL")
        assert code == -signal.SIGKILL, f"kill at byte {at}: exit {code}\n{err}"
        assert not dst.exists()
        entries, files = staged_state(dst)
        assert files, f"kill at byte {at}: nothing staged"
        kept.append(resume_and_check(src, dst, ref, monkeypatch))
    # Not monotonic in the kill point: a shard fully written may still wait for its hash and seal.
    assert sum(kept) > 0, f"points {points}: no resume kept a sealed shard"


def test_sigterm_at_random_points_then_resume(src: Path, ref: Path, shard_bytes: int, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(SEED + 1)
    points = sorted(rng.randrange(1, shard_bytes) for _ in range(10))
    for i, at in enumerate(points):
        dst = tmp_path / f"dst{i}"
        code, err = child_cli(["convert", src, dst, *OPTS], tmp_path, f"{at}:SIGTERM")
        assert code == 143, f"SIGTERM at byte {at}: exit {code}\n{err}"
        assert "interrupted by SIGTERM" in err, err
        check_stopped_state(dst)
        entries, _ = staged_state(dst)
        if entries:
            assert f"{len(entries)} of {N_SHARDS} shards are sealed" in err and "run the same command again" in err, err
        else:
            assert "nothing was kept" in err, err
        if i % 3 == 0:  # a plain rerun through the CLI says that it resumes
            code, out, err = run_cli(["convert", src, dst, *OPTS], capsys)
            assert code == 0, err
            if entries:
                assert "resuming the partial conversion" in err and f"keeping {len(entries)} of {N_SHARDS}" in err
            assert_same_conversion(dst, ref)
            assert beside(dst) == []
        else:
            resume_and_check(src, dst, ref, monkeypatch)


def test_sigterm_through_the_installed_command(src: Path, ref: Path, shard_bytes: int, tmp_path: Path) -> None:
    """The installed `atom-convert` script in a fresh interpreter (not a forked child; the fault
    through tests/fault_launcher.py): SIGTERM exits 143, then the script itself --resume completes."""
    exe = Path(sys.executable).with_name("atom-convert")
    dst = tmp_path / "dst"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(atom_convert.__file__).parent.parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    # The installed script's own code, run as __main__ in a fresh interpreter with the fault installed.
    launcher = Path(__file__).with_name("fault_launcher.py")
    r = subprocess.run([sys.executable, str(launcher), "--fault", f"{shard_bytes // 2}:SIGTERM", "--script", str(exe),
                        "--", "convert", str(src), str(dst), *OPTS], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 143, r.stderr
    check_stopped_state(dst)
    r = subprocess.run([str(exe), "convert", str(src), str(dst), *OPTS, "--resume"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "resuming the partial conversion" in r.stderr
    assert_same_conversion(dst, ref)


def test_faults_reach_the_writer_only_from_its_caller(src: Path, ref: Path, shard_bytes: int, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """No environment variable injects a fault (the writer and the readahead read none); a hook
    installed for the conversion driver (tests/fault_launcher.py) sees every shard byte, written
    by worker processes or by threads, and changes no output byte."""
    import inspect

    import fault_launcher
    from atom_convert.engine import prefetch

    monkeypatch.setenv("ATOM_CONVERT_TEST_SIGNAL_AT_BYTE", "1:SIGCONT")  # the variable the writer once read
    assert writer_mod.FaultHook.for_run() is None
    for mod in (writer_mod, prefetch):
        code = inspect.getsource(mod)
        assert "os.environ" not in code and "getenv" not in code, mod.__name__
    for mode in ("process", "thread"):
        hook = fault_launcher.SignalAtByte(shard_bytes + 1, signal.SIGKILL)  # past the last byte: never fires
        with fault_launcher.installed(hook):
            atom_convert.convert(src, tmp_path / mode, workers=2, worker_mode=mode, **API_OPTS)
        assert hook.done == shard_bytes, mode
        assert_same_conversion(tmp_path / mode, ref)
    assert sys.modules["atom_convert.engine.convert"].FaultHook is writer_mod.FaultHook  # put back


def test_ctrl_c_at_random_points_never_hangs(src: Path, ref: Path, shard_bytes: int, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(SEED + 2)
    for i in range(6):
        dst = tmp_path / f"dst{i}"
        if i < 3:  # from inside a write
            at = rng.randrange(1, shard_bytes)
            code, err = child_cli(["convert", src, dst, *OPTS], tmp_path, f"{at}:SIGINT", timeout=60)
        else:  # from outside, at a random time, as a terminal does
            import crash_child

            errf = tmp_path / f"err{i}"
            p = forkserver().Process(target=crash_child.run_cli,
                                     args=(["convert", str(src), str(dst), *OPTS], str(errf)))
            p.start()
            time.sleep(rng.uniform(0.3, 1.5))  # after the child's start-up (a fork of the preloaded server)
            try:
                os.kill(p.pid, signal.SIGINT)
            except ProcessLookupError:  # it finished (and its forkserver reaped it) before the signal
                pass
            p.join(60)
            assert not p.is_alive(), "Ctrl-C did not stop the conversion within 60 s"
            code, err = p.exitcode, errf.read_text()
        assert code in (0, 130), f"exit {code}\n{err}"
        if code == 0:
            assert_same_conversion(dst, ref)
            continue
        assert "interrupted" in err, err
        check_stopped_state(dst)
        resume_and_check(src, dst, ref, monkeypatch)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_during_the_final_rename_waits_for_it(src: Path, ref: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch, sig: int) -> None:
    """Ctrl-C (or SIGTERM through the CLI's handler) between the journal's removal and the
    staging directory's rename: the rename still happens, and the conversion is complete
    (interrupted there, finished shards were left with no journal to list them)."""
    from atom_convert.store import staging as staging_mod

    real_fsync_dir = staging_mod.fsync_dir
    sent: list[int] = []

    def fsync_dir(path: Path) -> None:
        if not sent and path.name.endswith(".atom-partial") and not (path / staging_mod.JOURNAL_NAME).exists():
            sent.append(sig)
            os.kill(os.getpid(), sig)  # handled at the next bytecode: inside the commit
        real_fsync_dir(path)

    def on_term(signum: int, frame: Any) -> None:  # as the CLI's handler does (cli._signals_interrupt)
        raise Interrupted(signum)

    monkeypatch.setattr(staging_mod, "fsync_dir", fsync_dir)
    previous = signal.signal(signal.SIGTERM, on_term)
    notes: list[str] = []
    try:
        dst = tmp_path / "dst"
        atom_convert.convert(src, dst, tp=2, shard_size="200KB", workers=2, notify=notes.append)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert sent == [sig]
    assert_same_conversion(dst, ref)
    assert beside(dst) == [], beside(dst)
    assert any("arrived while" in n and "complete" in n for n in notes), notes


@pytest.mark.parametrize("launched", [False, True], ids=["before-the-thread-runs", "after"])
@pytest.mark.parametrize("kind", ["hash", "worker"])
def test_ctrl_c_inside_a_thread_start_stops_cleanly(src: Path, ref: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch, kind: str, launched: bool) -> None:
    """Ctrl-C (or SIGTERM through the CLI's handler) can land inside Thread.start(): before the
    thread runs, or after it runs but before start() returns. The conversion then stops as from
    anywhere else, resumable, instead of an internal error from joining a thread that never
    started (seen once in the random SIGTERM test: "cannot join thread before it is started")."""
    real_start = threading.Thread.start
    prefix = {"hash": "atom-convert-hash-", "worker": "atom-convert-worker-"}[kind]
    seen: list[str] = []

    def start(t: threading.Thread) -> None:
        if t.name.startswith(prefix):
            seen.append(t.name)
            if len(seen) == 3:  # some shards or workers are running by then
                if launched:
                    real_start(t)
                raise KeyboardInterrupt
        real_start(t)

    monkeypatch.setattr(threading.Thread, "start", start)
    dst = tmp_path / "dst"
    with pytest.raises(KeyboardInterrupt):
        # threads for the workers, so that both kinds are started in this process
        atom_convert.convert(src, dst, tp=2, shard_size="200KB", workers=4, worker_mode="thread")
    monkeypatch.undo()
    assert len(seen) >= 3, seen
    check_stopped_state(dst)
    resume_and_check(src, dst, ref, monkeypatch)


@pytest.mark.parametrize("workers,to", [(1, "process"), (1, "thread"), (2, "process")],
                         ids=["thread", "thread-signal-to-another-thread", "processes"])
def test_ctrl_c_with_a_stuck_write_does_not_hang(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 workers: int, to: str) -> None:
    """A write that never returns (a dead network filesystem), on a write-behind thread or in a
    worker process: Ctrl-C still ends the conversion within the bounded waits (the writer's abort
    timeout; a stuck worker process is killed after the stop wait), only sealed shards stay, and
    no worker process is left. The kernel may hand the process's SIGINT to any thread: sent to
    another thread, it only flags the main thread, which must not sleep in an untimed wait (before
    the fix the main thread slept in join() until the stuck write returned). Not with processes:
    there the stuck write of this fake is the main thread's own (a shard's first bytes), which only
    a signal to that thread interrupts."""
    from atom_convert.engine import procs

    ctx = multiprocessing.get_context("fork")
    stuck, release = ctx.Event(), ctx.Event()  # set in whichever process writes
    done = threading.Event()
    real = writer_mod._ShardIO.pwrite

    def pwrite(sh: Any, data: Any, offset: int) -> None:
        if sh.rel.endswith("00003-of-00009.safetensors"):
            stuck.set()
            release.wait(3600)  # for ever, unless the conversion failed to stop (below)
        real(sh, data, offset)

    monkeypatch.setattr(writer_mod._ShardIO, "pwrite", pwrite)
    monkeypatch.setattr(_IOThread.abort, "__defaults__", (0.5,))
    monkeypatch.setattr(procs, "STOP_WAIT_S", 1.0)

    def interrupt() -> None:  # Ctrl-C as the terminal sends it: to the process, or as handed to a thread
        stuck.wait(60)
        time.sleep(0.2)
        if to == "process":
            os.kill(os.getpid(), signal.SIGINT)
        else:
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        if not done.wait(45):  # still converting past the bound: let the write go, so the test fails, not hangs
            release.set()

    threading.Thread(target=interrupt, daemon=True).start()
    dst = tmp_path / "dst"
    t0 = time.monotonic()
    try:
        with pytest.raises(Interrupted) as ei:
            atom_convert.convert(src, dst, **API_OPTS, workers=workers,
                                 worker_mode="process" if workers > 1 else "auto")
        took = time.monotonic() - t0
    finally:
        done.set()
    assert took < 30
    assert stuck.is_set() and ei.value.exit_code == 130
    check_stopped_state(dst)
    assert multiprocessing.active_children() == []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _children_of(pid: int) -> set[int]:
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.add(int(d))
            except (OSError, ValueError, IndexError):
                continue
    return out


def test_sigkill_leaves_no_worker_process_and_no_lock(src: Path, ref: Path, shard_bytes: int, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL of the converter half-way: its worker processes die with it (PR_SET_PDEATHSIG), so no
    writer outlives it, and none keeps DST's lock (the resume may start at once)."""
    import crash_child

    dst = tmp_path / "dst"
    err = tmp_path / "stderr"
    p = forkserver().Process(target=crash_child.run_cli,
                             args=([str(a) for a in ["convert", src, dst, *OPTS]], str(err),
                                   f"{shard_bytes // 2}:SIGKILL"))
    p.start()
    workers: set[int] = set()
    deadline = time.monotonic() + 120
    while p.is_alive() and time.monotonic() < deadline:
        workers |= _children_of(p.pid)
        time.sleep(0.005)
    p.join(5)
    assert p.exitcode == -signal.SIGKILL, err.read_text() if err.exists() else ""
    assert workers, "no worker process was seen"
    end = time.monotonic() + 5
    while any(_alive(w) for w in workers) and time.monotonic() < end:
        time.sleep(0.01)
    assert not [w for w in workers if _alive(w)], "worker processes outlived the killed converter"
    with DestinationLock(DestPaths(dst)):  # free: no worker kept the lock's file open
        pass
    resume_and_check(src, dst, ref, monkeypatch)


def test_a_forked_worker_does_not_keep_the_destination_lock(tmp_path: Path) -> None:
    """A process forked while a conversion holds DST's lock (a worker process) closes its copy of
    the lock's descriptor: a converter killed while such a process still runs leaves DST unlocked."""
    dst = tmp_path / "dst"
    r, w = os.pipe()
    holder = os.fork()
    if holder == 0:  # the converter: takes the lock, forks a worker, waits to be killed
        try:
            os.close(r)
            lock = DestinationLock(DestPaths(dst))
            lock.acquire()
            worker = os.fork()
            if worker == 0:
                time.sleep(30)
                os._exit(0)
            os.write(w, str(worker).encode())
            time.sleep(60)
        finally:
            os._exit(1)
    os.close(w)
    worker = int(os.read(r, 64) or b"0")
    os.close(r)
    try:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
        assert worker and _alive(worker)
        with DestinationLock(DestPaths(dst)):  # not refused while the worker lives
            pass
    finally:
        if worker:
            os.kill(worker, signal.SIGKILL)


# ------------------------------------------------------------------------------------------------
# what a resume refuses, and what it redoes
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def interrupted(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """DST of a conversion interrupted (KeyboardInterrupt in-process) after 40 tensors were written."""
    calls = {"n": 0}
    real = ShardSetWriter.write

    def write(self: ShardSetWriter, rank: int, out: Any, chunks: Any, part: Any = None) -> None:
        calls["n"] += 1
        if calls["n"] > 40:
            raise KeyboardInterrupt
        real(self, rank, out, chunks, part)

    with monkeypatch.context() as m:
        m.setattr(ShardSetWriter, "write", write)
        dst = tmp_path / "dst"
        with pytest.raises(Interrupted):
            atom_convert.convert(src, dst, **API_OPTS)
    entries, _ = staged_state(dst)
    assert len(entries) >= 3
    return dst


def test_resume_refuses_changed_options_and_restart_starts_over(src: Path, ref: Path, interrupted: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    dst = interrupted
    before = digest(dst.parent / f".{dst.name}.atom-partial")
    code, _, err = run_cli(["convert", src, dst, "--tp", "1", "--shard-size", "200KB", "--target", "gfx942"], capsys)
    assert code == 2
    assert "option tp was '2', now '1'" in err and "option target was 'gfx950', now 'gfx942'" in err, err
    assert "--restart" in err and f".{dst.name}.atom-partial" in err
    code, _, err = run_cli(["convert", src, dst, "--tp", "2", "--shard-size", "100KB", "--resume"], capsys)
    assert code == 2 and "option shard_size was '200000', now '100000'" in err, err
    assert digest(dst.parent / f".{dst.name}.atom-partial") == before, "a refused resume changed the staging"
    code, _, err = run_cli(["convert", src, dst, *OPTS, "--resume", "--restart"], capsys)
    assert code == 2 and "exclude each other" in err
    code, _, err = run_cli(["convert", src, dst, *OPTS, "--restart"], capsys)
    assert code == 0, err
    assert "--restart: removing the partial conversion" in err
    assert_same_conversion(dst, ref)
    assert beside(dst) == []


def test_resume_refuses_a_changed_source(src: Path, interrupted: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The staged conversion is of `src`; converting a copy with an edited config into the same DST is refused."""
    other = tmp_path / "other"
    shutil.copytree(src, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = cfg["rms_norm_eps"] * 2
    (other / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(["convert", other, interrupted, *OPTS], capsys)
    assert code == 2 and "the source changed (config.json)" in err and "--restart" in err, err


def test_resume_redoes_damaged_and_unrecorded_shards(src: Path, ref: Path, interrupted: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A sealed shard whose bytes changed, one missing, a torn journal line and a stray
    `.partial`: the resume keeps only what still matches, and ends identical."""
    st = interrupted.parent / f".{interrupted.name}.atom-partial"
    entries, _ = staged_state(interrupted)
    first, second = st / entries[0]["sealed"], st / entries[1]["sealed"]
    raw = bytearray(first.read_bytes())
    raw[-1] ^= 0xFF
    first.write_bytes(bytes(raw))
    second.unlink()
    with open(st / ".atom-journal.jsonl", "a") as f:
        f.write('{"sealed": "model-rank0-00009-of-00')
    (st / "model-rank1-00014-of-00015.safetensors.partial").write_bytes(os.urandom(100))
    notes: list[str] = []
    atom_convert.convert(src, interrupted, notify=notes.append, **API_OPTS)
    assert any(f"keeping {len(entries) - 2} of {N_SHARDS} shards" in n for n in notes), notes
    assert_same_conversion(interrupted, ref)


# ------------------------------------------------------------------------------------------------
# disk full, read-only, permissions
# ------------------------------------------------------------------------------------------------


def fault_injecting_writer(monkeypatch: pytest.MonkeyPatch, budget: int, err: int) -> None:
    """The writer's pwrite accepts `budget` more bytes in all, then fails as a full disk (or a
    read-only or forbidden file) does: an OSError without a file name, as os.pwrite raises it."""
    written = Shared()  # over every worker process (the CLI converts on every core)
    real = writer_mod._pwrite

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        if written.add(len(data)) > budget:
            raise OSError(err, os.strerror(err))
        return real(fd, data, offset)

    monkeypatch.setattr(writer_mod, "_pwrite", pwrite)


def test_disk_full_from_a_fault_injecting_writer(src: Path, ref: Path, shard_bytes: int, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    dst = tmp_path / "dst"
    fault_injecting_writer(monkeypatch, shard_bytes // 3, errno.ENOSPC)
    code, _, err = run_cli(["convert", src, dst, *OPTS], capsys)
    assert code == 2, err
    assert "no space left on the device while writing" in err and ".safetensors.partial" in err
    assert "are kept in" in err and "free space and run the same command again" in err and "--restart" in err
    check_stopped_state(dst)
    assert staged_state(dst)[0], "the shards sealed before the disk filled were not kept"
    monkeypatch.undo()
    resume_and_check(src, dst, ref, monkeypatch)


@pytest.mark.parametrize("err", ["EROFS", "EACCES", "EPERM"])
def test_read_only_and_permission_errors_leave_nothing(err: str, src: Path, shard_bytes: int, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    dst = tmp_path / "dst"
    fault_injecting_writer(monkeypatch, shard_bytes // 3, getattr(errno, err))
    code, _, out = run_cli(["convert", src, dst, *OPTS], capsys)
    assert code == 2, out
    assert ".safetensors.partial" in out and "Nothing was kept" in out
    assert ("read-only" in out) if err == "EROFS" else ("permission denied" in out)
    assert not dst.exists() and beside(dst) == []


@pytest.fixture
def tmpfs(tmp_path: Path) -> Callable[[str], Path]:
    """tmpfs("size=2m") -> a freshly mounted tmpfs (skipped where mounting is not permitted)."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        mnt = tmp_path / f"mnt{len(mounted)}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}): needs root or CAP_SYS_ADMIN")
        mounted.append(mnt)
        return mnt

    yield mount
    for m in mounted:
        subprocess.run(["umount", "-l", str(m)], check=False)


def test_disk_full_on_a_small_tmpfs_then_resume(src: Path, ref: Path, shard_bytes: int, tmpfs: Callable[[str], Path],
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    mnt = tmpfs(f"size={shard_bytes // 2}")
    dst = mnt / "out" / "dst"
    code, _, err = run_cli(["convert", src, dst, *OPTS], capsys)
    assert code == 2, err
    assert "no space left on the device" in err and str(mnt) in err
    check_stopped_state(dst)
    assert staged_state(dst)[0]
    subprocess.run(["mount", "-o", f"remount,size={shard_bytes * 3}", str(mnt)], check=True)
    resume_and_check(src, dst, ref, monkeypatch)


def test_read_only_filesystem(src: Path, tmpfs: Callable[[str], Path], capsys: pytest.CaptureFixture[str]) -> None:
    mnt = tmpfs("ro,size=1m")
    dst = mnt / "dst"
    code, _, err = run_cli(["convert", src, dst, *OPTS], capsys)
    assert code == 2, err
    assert "read-only file system" in err and str(mnt) in err
    assert list(mnt.iterdir()) == []


# ------------------------------------------------------------------------------------------------
# one conversion per DST
# ------------------------------------------------------------------------------------------------


def test_a_second_conversion_is_refused_while_one_runs(src: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "dst"
    with DestinationLock(DestPaths(dst)):
        code, _, err = run_cli(["convert", src, dst, *OPTS], capsys)
    assert code == 2
    assert "another atom-convert is writing" in err and f"pid {os.getpid()}" in err and "--wait" in err, err
    assert not dst.exists() and beside(dst) == []


def test_wait_queues_behind_the_running_conversion(src: Path, ref: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    lock = DestinationLock(DestPaths(dst))
    lock.acquire()
    import crash_child

    errf = tmp_path / "err"
    p = forkserver().Process(target=crash_child.run_cli, args=(["convert", str(src), str(dst), *OPTS, "--wait"],
                                                               str(errf)))
    p.start()
    try:
        deadline = time.monotonic() + 120
        while "waiting for the conversion" not in (errf.read_text() if errf.exists() else ""):
            assert p.is_alive() and time.monotonic() < deadline, errf.read_text() if errf.exists() else ""
            time.sleep(0.05)
        assert f"pid {os.getpid()}" in errf.read_text()
        assert not dst.exists()
    finally:
        lock.release()
    p.join(120)
    assert p.exitcode == 0, errf.read_text()
    assert_same_conversion(dst, ref)
    assert beside(dst) == []


def test_two_conversions_into_one_dst_at_once(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """Two different sources race for one DST: exactly one wins; DST is that one's complete conversion."""
    import crash_child

    dst = tmp_path / "dst"
    sources = [tiny_checkpoint(PRESET, "fp8"), tiny_checkpoint(PRESET, "bf16")]
    procs = []
    for i, s in enumerate(sources):
        p = forkserver().Process(target=crash_child.run_cli,
                                 args=(["convert", str(s), str(dst), *OPTS], str(tmp_path / f"err{i}")))
        procs.append(p)
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    codes = [p.exitcode for p in procs]
    errs = [(tmp_path / f"err{i}").read_text() for i in range(2)]
    assert sorted(codes) == [0, 2], (codes, errs)
    loser = errs[codes.index(2)]
    assert "another atom-convert is writing" in loser or "already exists" in loser, loser
    winner = sources[codes.index(0)]
    m = json.loads((dst / "atom_manifest.json").read_text())
    assert m["source"]["path"] == str(winner.resolve())
    code = subprocess.run([sys.executable, "-c", "import sys; from atom_convert.cli import main; main(sys.argv[1:])",
                           "verify", str(dst)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(atom_convert.__file__).parent.parent)})
    assert code.returncode == 0, code.stdout + code.stderr
    assert beside(dst) == []


# ------------------------------------------------------------------------------------------------
# destination checks: never lose the source
# ------------------------------------------------------------------------------------------------


def _layouts(base: Path, src: Path) -> dict[str, tuple[Path, Path, str]]:
    """name -> (SRC as given, DST as given, what the message must say)."""
    link_to_src = base / "link-to-src"
    link_to_src.symlink_to(src)
    link_to_parent = base / "link-to-parent"
    link_to_parent.symlink_to(src.parent)
    src_link = base / "src-via-link"
    src_link.symlink_to(src)
    return {
        "dst-is-src": (src, src, "is the source checkpoint itself"),
        "dst-is-src-spelled-differently": (src, src / ".." / src.name, "is the source checkpoint itself"),
        "dst-symlink-to-src": (src, link_to_src, "is the source checkpoint itself"),
        "src-symlink-dst-real": (src_link, src, "is the source checkpoint itself"),
        "dst-inside-src": (src, src / "converted", "is inside the source checkpoint"),
        "dst-inside-src-via-symlink": (src, link_to_src / "converted", "is inside the source checkpoint"),
        "dst-contains-src": (src, src.parent, "contains the source checkpoint"),
        "dst-symlink-contains-src": (src, link_to_parent, "contains the source checkpoint"),
    }


@pytest.mark.parametrize("layout", ["dst-is-src", "dst-is-src-spelled-differently", "dst-symlink-to-src",
                                    "src-symlink-dst-real", "dst-inside-src", "dst-inside-src-via-symlink",
                                    "dst-contains-src", "dst-symlink-contains-src"])
@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_source_is_never_touched(layout: str, force: bool, src: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "home"
    mine = home / "ckpt"
    shutil.copytree(src, mine)
    # the parent DST of "contains" holds an earlier conversion's manifest, so --force would accept it by itself
    (home / "atom_manifest.json").write_text("{}")
    s, d, why = _layouts(tmp_path, mine)[layout]
    before = digest(tmp_path)
    code, _, err = run_cli(["convert", s, d, *OPTS, *(["--force"] if force else [])], capsys)
    assert code == 2, err
    assert why in err and "choose a dst" in err.lower(), err
    assert digest(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["home", "link-to-src", "link-to-parent", "src-via-link"])


def test_dangling_dst_symlink_is_refused_before_any_work(src: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "dst"
    dst.symlink_to(tmp_path / "nowhere" / "out")
    code, _, err = run_cli(["convert", src, dst, *OPTS], capsys)
    assert code == 2
    assert f"{dst} is a symbolic link to {tmp_path / 'nowhere' / 'out'}, which does not exist" in err
    assert "mkdir -p" in err and "remove the link" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"] and dst.is_symlink()


def test_dst_symlink_to_a_directory_converts_into_its_target(src: Path, ref: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "big" / "out"
    target.mkdir(parents=True)
    dst = tmp_path / "dst"
    dst.symlink_to(target)
    code, _, err = run_cli(["convert", src, dst, *OPTS, "--force"], capsys)
    assert code == 0, err
    assert dst.is_symlink() and os.readlink(dst) == str(target)
    assert_same_conversion(target, ref)
    assert beside(target) == [] and beside(dst) == []


def test_missing_parents_are_created_with_plain_mkdir_permissions(src: Path, ref: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    old = os.umask(0o027)
    try:
        dst = tmp_path / "a" / "b" / "dst"
        code, _, err = run_cli(["convert", src, dst, *OPTS], capsys)
        assert code == 0, err
        for d in (tmp_path / "a", tmp_path / "a" / "b", dst, dst / "mtp"):
            assert d.stat().st_mode & 0o777 == 0o750, (d, oct(d.stat().st_mode))
        for f in (dst / "atom_manifest.json", dst / "model-rank0-00001-of-00015.safetensors"):
            assert f.stat().st_mode & 0o777 == 0o640, (f, oct(f.stat().st_mode))
        assert_same_conversion(dst, ref)
        assert beside(dst) == []
    finally:
        os.umask(old)


def test_bad_input_after_creating_parents_removes_them(tiny_checkpoint: Callable[..., Path], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    class Boom(RuntimeError):
        pass

    def write(self: ShardSetWriter, rank: int, out: Any, chunks: Any, part: Any = None) -> None:
        raise Boom("x")

    monkeypatch.setattr(ShardSetWriter, "write", write)
    with pytest.raises(Boom):
        atom_convert.convert(tiny_checkpoint(PRESET, "fp8"), tmp_path / "a" / "b" / "dst")
    assert list(tmp_path.iterdir()) == []


def test_a_foreign_directory_with_the_staging_name_is_never_deleted(src: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "dst"
    foreign = tmp_path / ".dst.atom-partial"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    for extra in ([], ["--restart"]):
        code, _, err = run_cli(["convert", src, dst, *OPTS, *extra], capsys)
        assert code == 2 and "was not written by atom-convert" in err, err
        assert (foreign / "notes.txt").read_text() == "mine" and not dst.exists()


def test_interrupted_replacement_is_repaired(src: Path, ref: Path, converted: Callable[..., Path], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash between the two renames of --force (DST moved aside, the new one not yet in place):
    the next run puts the old DST back first."""
    dst = tmp_path / "dst"
    shutil.copytree(converted(PRESET, "fp8", "gfx942"), tmp_path / ".dst.atom-old")
    before = digest(tmp_path / ".dst.atom-old")
    notes: list[str] = []
    with pytest.raises(BadInputError, match="already exists"):
        atom_convert.convert(src, dst, notify=notes.append, **API_OPTS)
    assert any("put back" in n for n in notes)
    assert digest(dst) == before and beside(dst) == []
    atom_convert.convert(src, dst, force=True, **API_OPTS)
    assert_same_conversion(dst, ref)
    assert beside(dst) == []
