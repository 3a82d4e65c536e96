"""Nothing the tool did not write is changed, deleted or followed through a symlink.

The lock file beside DST (and a cache entry's lock), the journal and its temporary, the cache
record's temporary, the staging directory's contents on a resume or --restart, the name a
replaced DST is moved to, and the --hub-cache pull (under the destination lock): each is
planted with a symlink or a foreign file, and the tool must refuse (bad input, exit 2, naming
the file and what to do) and leave what it found as it was.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

import atom_convert
from atom_convert.errors import BadInputError
from atom_convert.hub import pull as pull_mod
from atom_convert.store.fingerprint import Fingerprint
from atom_convert.store.staging import (JOURNAL_NAME, DestinationLock, DestPaths, FileLock, Journal, Sealed,
                                        Staging)

from cliutil import run_cli

PRESET = "tiny-deepseek-v3"
SHARD = "model-00001-of-00002.safetensors"
PLANNED = {SHARD: "p1", "model-00002-of-00002.safetensors": "p2"}
HEADER = {"source": Fingerprint("source", {"config.json": "a"}).as_dict(),
          "options": Fingerprint("options", {"tp": "1"}).as_dict(), "plan": "d"}


@pytest.fixture
def src(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint(PRESET, "fp8")


def victim(tmp_path: Path) -> Path:
    v = tmp_path / "elsewhere" / "precious.txt"
    v.parent.mkdir()
    v.write_text("not atom-convert's")
    return v


def staging_of(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.atom-partial"


def files_under(root: Path) -> dict[str, bytes | str]:
    """Every entry (a symlink as its target, never followed) and its bytes."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = p.relative_to(root).as_posix()
            out[rel] = ("-> " + os.readlink(p)) if p.is_symlink() else (p.read_bytes() if p.is_file() else "dir")
    return out


# ------------------------------------------------------------------------------------------------
# the lock file
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
def test_lock_never_writes_through_a_symlink(src: Path, tmp_path: Path, dangling: bool) -> None:
    """A symlink at `.DST.atom-lock` (planted in a shared folder, say): refused, its target untouched
    (the old FileLock truncated the target and wrote the lock record into it)."""
    dst = tmp_path / "dst"
    target = tmp_path / "elsewhere" / "missing" if dangling else victim(tmp_path)
    target.parent.mkdir(exist_ok=True)
    lock = tmp_path / ".dst.atom-lock"
    lock.symlink_to(target)
    with pytest.raises(BadInputError) as ei:
        atom_convert.convert(src, dst)
    msg = str(ei.value)
    assert str(lock) in msg and "symbolic link" in msg and str(target) in msg and "run again" in msg, msg
    assert lock.is_symlink() and os.readlink(lock) == str(target)
    if dangling:
        assert not os.path.lexists(target)
    else:
        assert target.read_text() == "not atom-convert's"
    assert not dst.exists() and not staging_of(dst).exists()


def test_lock_refuses_a_foreign_file_and_a_hard_link(tmp_path: Path) -> None:
    """A regular file there that is not a lock record of atom-convert is refused, not truncated;
    so is a hard link (writing it would change the other name's file)."""
    paths = DestPaths(tmp_path / "dst")
    paths.lock.write_text("my notes, not a lock")
    with pytest.raises(BadInputError, match="not an atom-convert lock") as ei:
        DestinationLock(paths).acquire()
    assert str(paths.lock) in str(ei.value)
    assert paths.lock.read_text() == "my notes, not a lock"
    paths.lock.unlink()
    v = victim(tmp_path)
    v.write_text("")  # empty, as a just-created lock file is: only the hard link gives it away
    os.link(v, paths.lock)
    with pytest.raises(BadInputError, match="hard links"):
        DestinationLock(paths).acquire()
    assert v.read_text() == "" and paths.lock.exists()


NESTED = "[" * 100_000 + "]" * 100_000  # deeper than Python's JSON parser recurses


def test_lock_refuses_content_nested_too_deeply(tmp_path: Path) -> None:
    """A lock file holding JSON nested deeper than the parser goes is a foreign file like any other
    (once an internal error: the RecursionError escaped)."""
    paths = DestPaths(tmp_path / "dst")
    paths.lock.write_text(NESTED)
    with pytest.raises(BadInputError, match="not an atom-convert lock") as ei:
        DestinationLock(paths).acquire()
    assert str(paths.lock) in str(ei.value)
    assert paths.lock.read_text() == NESTED


def test_journal_lines_nested_too_deeply(tmp_path: Path) -> None:
    """A journal entry nested too deeply is a garbled line (its shard is redone); a header nested
    too deeply makes the journal unreadable, as garbage does: refused with what to do."""
    paths = DestPaths(tmp_path / "dst")
    st = Staging(paths, notify=lambda m: None)
    st.open(HEADER, PLANNED, "auto")
    st.close()
    journal = paths.staging / JOURNAL_NAME
    with open(journal, "a") as f:
        f.write(NESTED + "\n")
    assert Staging(paths, notify=lambda m: None).open(HEADER, PLANNED, "auto") == []
    journal.write_text(NESTED + "\n")
    with pytest.raises(BadInputError) as ei:
        Staging(paths, notify=lambda m: None).open(HEADER, PLANNED, "auto")
    msg = str(ei.value)
    assert JOURNAL_NAME in msg and "nested too deeply" in msg and "--restart" in msg, msg


def test_lock_takes_over_a_dead_holders_file_and_releases_only_its_own(tmp_path: Path) -> None:
    paths = DestPaths(tmp_path / "dst")
    for left in ('{"pid": 999999999, "host": "gone", "since": "2020-01-01T00:00:00Z"}', ""):
        paths.lock.write_text(left)  # a holder that died (the kernel dropped its flock), or just created
        with DestinationLock(paths):
            assert json.loads(paths.lock.read_text())["pid"] == os.getpid()
        assert not paths.lock.exists()
    # Released after the path was replaced by someone else's file: that file stays.
    lock = FileLock(tmp_path / "x.lock")
    lock.acquire()
    other = tmp_path / "other"
    other.write_text("someone else's")
    os.replace(other, lock.path)
    lock.release()
    assert lock.path.read_text() == "someone else's"


# ------------------------------------------------------------------------------------------------
# journal, cache record
# ------------------------------------------------------------------------------------------------


def test_journal_temporary_never_written_through_a_symlink(tmp_path: Path) -> None:
    """The journal is written through `.atom-journal.jsonl.tmp`: a symlink there (planted in a
    staging directory after its cleanup) is refused, its target untouched (the old Journal opened
    it with open(..., "w"): truncated and overwrote the target, then renamed the link over the
    journal). The journal itself is then appended to without following a symlink either."""
    root = tmp_path / ".dst.atom-partial"
    root.mkdir()
    v = victim(tmp_path)
    (root / (JOURNAL_NAME + ".tmp")).symlink_to(v)
    with pytest.raises(BadInputError) as ei:
        Journal(root / JOURNAL_NAME, {"journal": 1}, [])
    assert "symbolic link" in str(ei.value) and JOURNAL_NAME + ".tmp" in str(ei.value)
    assert v.read_text() == "not atom-convert's" and (root / (JOURNAL_NAME + ".tmp")).is_symlink()
    os.unlink(root / (JOURNAL_NAME + ".tmp"))
    (root / JOURNAL_NAME).symlink_to(v)
    with pytest.raises(BadInputError, match="symbolic link"):
        Journal(root / JOURNAL_NAME, {"journal": 1}, [])
    assert v.read_text() == "not atom-convert's"


def test_cache_record_never_written_through_a_symlink(src: Path, tmp_path: Path) -> None:
    """ensure_converted writes its record through `<entry>.cache.json.tmp`: a symlink planted there
    in a shared cache folder is refused, its target untouched (it was overwritten with the record)."""
    from atom_convert.engine.cache import cache_path, ensure_converted

    cache_dir = tmp_path / "cache"
    entry, _ = cache_path(src, cache_dir)
    cache_dir.mkdir()
    v = victim(tmp_path)
    tmp = entry.with_name(entry.name + ".cache.json.tmp")
    tmp.symlink_to(v)
    with pytest.raises(BadInputError) as ei:
        ensure_converted(src, cache_dir, workers=1)
    assert str(tmp) in str(ei.value) and "symbolic link" in str(ei.value)
    assert v.read_text() == "not atom-convert's" and tmp.is_symlink()
    # refused before the conversion, not after minutes of it
    assert not entry.exists() and not staging_of(entry).exists()


def test_shard_and_manifest_temporaries_never_written_through_a_symlink(tmp_path: Path) -> None:
    """A shard's `.partial` and the manifest's `.tmp` are created in the staging directory; a
    symlink planted at either name is refused (its target untouched), and a regular leftover of an
    interrupted run is replaced."""
    from atom_convert.engine.writer import ShardFile
    from atom_convert.store.manifest import write_manifest

    root = tmp_path / ".dst.atom-partial"
    root.mkdir()
    v = victim(tmp_path)
    (root / (SHARD + ".partial")).symlink_to(v)
    with pytest.raises(BadInputError) as ei:
        ShardFile(root, SHARD, None, b"", {}, 0, None)  # type: ignore[arg-type]
    assert "symbolic link" in str(ei.value) and SHARD + ".partial" in str(ei.value)
    assert v.read_text() == "not atom-convert's" and (root / (SHARD + ".partial")).is_symlink()
    (root / "atom_manifest.json.tmp").symlink_to(v)
    with pytest.raises(BadInputError, match="symbolic link"):
        write_manifest(root / "atom_manifest.json", {"x": 1})
    assert v.read_text() == "not atom-convert's" and not (root / "atom_manifest.json").exists()
    os.unlink(root / "atom_manifest.json.tmp")
    (root / "atom_manifest.json.tmp").write_text("half")
    write_manifest(root / "atom_manifest.json", {"x": 1})
    assert json.loads((root / "atom_manifest.json").read_text()) == {"x": 1}
    assert not (root / "atom_manifest.json.tmp").exists()


# ------------------------------------------------------------------------------------------------
# what a resume or --restart removes
# ------------------------------------------------------------------------------------------------


def test_restart_refuses_foreign_files_beside_a_garbage_journal(src: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """--restart with an unreadable journal: only the journal and the shards it records are known
    to be the tool's; a foreign file (and an unrecorded shard name) there makes it refuse, naming
    the directory and the files, and nothing is removed (the old --restart removed it all)."""
    dst = tmp_path / "dst"
    st = staging_of(dst)
    st.mkdir()
    (st / JOURNAL_NAME).write_text("this is not a journal\n")
    (st / "notes.txt").write_text("mine")
    (st / SHARD).write_bytes(b"unrecorded")
    before = files_under(st)
    code, _, err = run_cli(["convert", src, dst, "--restart"], capsys)
    assert code == 2, err
    assert str(st) in err and "notes.txt" in err and SHARD in err and "unreadable" in err and "by hand" in err, err
    assert files_under(st) == before and not dst.exists()


def test_restart_removes_what_a_garbage_journal_still_records(tmp_path: Path) -> None:
    paths = DestPaths(tmp_path / "dst")
    paths.staging.mkdir()
    sealed = Sealed(SHARD, 3, "0" * 64, "p1")
    (paths.staging / JOURNAL_NAME).write_text("garbled header\n" + sealed.as_json() + "\n")
    (paths.staging / SHARD).write_bytes(b"abc")
    (paths.staging / (SHARD + ".partial")).write_bytes(b"ab")
    notes: list[str] = []
    assert Staging(paths, notify=notes.append).open(HEADER, PLANNED, "restart") == []
    assert sorted(files_under(paths.staging)) == [JOURNAL_NAME]
    assert any("--restart: removing" in n for n in notes)


@pytest.mark.parametrize("mode", ["auto", "restart"])
def test_resume_and_restart_refuse_foreign_files_and_symlinks(tmp_path: Path, mode: str) -> None:
    """A readable journal: the tool's own names go (shards, `.partial`, side files), but a foreign
    file, a symlink or another folder in the staging directory is refused, nothing removed."""
    paths = DestPaths(tmp_path / "dst")
    st = Staging(paths, notify=lambda m: None)
    st.open(HEADER, PLANNED, "auto")
    st.close()
    v = victim(tmp_path)
    (paths.staging / "notes.txt").write_text("mine")
    (paths.staging / "model-00002-of-00002.safetensors").symlink_to(v)
    (paths.staging / "mtp").symlink_to(v.parent)
    (paths.staging / SHARD).write_bytes(b"unsealed: the tool's own")
    before = files_under(paths.staging)
    with pytest.raises(BadInputError) as ei:
        Staging(paths, notify=lambda m: None).open(HEADER, PLANNED, mode)
    msg = str(ei.value)
    assert str(paths.staging) in msg and "notes.txt" in msg and "symbolic link" in msg and "mtp" in msg, msg
    assert files_under(paths.staging) == before and v.read_text() == "not atom-convert's"
    for p in ("notes.txt", "model-00002-of-00002.safetensors", "mtp"):
        os.unlink(paths.staging / p)
    (paths.staging / "config.json").write_text("{}")  # a side file copied before the crash
    assert Staging(paths, notify=lambda m: None).open(HEADER, PLANNED, mode) == []
    assert sorted(files_under(paths.staging)) == [JOURNAL_NAME]


def test_force_replaces_an_earlier_conversion_only_without_files_of_someone_else(
        src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--force replaces an earlier conversion, but not one that also holds a file atom-convert did not
    write (it would be deleted): refused naming it, everything kept. The verify result the README has
    users save into DST is the tool's."""
    dst = tmp_path / "dst"
    atom_convert.convert(src, dst)
    (dst / "atom_verify.json").write_text("{}")
    (dst / "notes.md").write_text("mine")
    before = files_under(dst)
    code, _, err = run_cli(["convert", src, dst, "--force"], capsys)
    assert code == 2 and "notes.md" in err and "did not write" in err and "atom_verify.json" not in err, err
    assert files_under(dst) == before and not staging_of(dst).exists()
    (dst / "notes.md").unlink()
    code, _, err = run_cli(["convert", src, dst, "--force"], capsys)
    assert code == 0, err


def test_commit_never_replaces_what_appeared_at_dst(tmp_path: Path) -> None:
    """Something not an atom-convert output appeared at DST during the conversion: the commit
    refuses (it was moved aside and deleted with the replaced DST)."""
    paths = DestPaths(tmp_path / "dst")
    st = Staging(paths, notify=lambda m: None)
    st.open(HEADER, PLANNED, "auto")
    paths.dst.mkdir()
    (paths.dst / "notes.txt").write_text("mine")
    with pytest.raises(BadInputError, match="not an atom-convert output"):
        st.commit()
    assert (paths.dst / "notes.txt").read_text() == "mine" and (paths.staging / JOURNAL_NAME).is_file()


# ------------------------------------------------------------------------------------------------
# --hub-cache under the destination lock
# ------------------------------------------------------------------------------------------------


HOLDER = """
import fcntl, json, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, json.dumps({"pid": os.getpid(), "host": "test", "since": "now"}).encode())
print("held", flush=True)
time.sleep(float(sys.argv[2]))
os.unlink(sys.argv[1])
with open(sys.argv[3], "w") as f:
    f.write(repr(time.time()))
os.close(fd)
"""


def _hold(lock: Path, seconds: float, released: Path) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), str(seconds), str(released)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def _fake_pull(monkeypatch: pytest.MonkeyPatch, lock: Path) -> list[dict[str, Any]]:
    """pull_converted replaced: records when it ran and whether DST's lock was held then (a second
    flock of it from this process must fail while convert() holds it), then places DST."""
    calls: list[dict[str, Any]] = []

    def pull(repo: str, key: str, dst: Any) -> dict[str, Any]:
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = False
        except BlockingIOError:
            held = True
        finally:
            os.close(fd)
        calls.append({"at": time.time(), "held": held})
        Path(dst).mkdir(parents=True, exist_ok=True)
        (Path(dst) / "atom_manifest.json").write_text("{}")
        return {"pulled": True}

    monkeypatch.setattr(pull_mod, "pull_converted", pull)
    return calls


def test_hub_cache_pull_refused_while_another_process_holds_the_lock(src: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    dst = tmp_path / "dst"
    lock = tmp_path / ".dst.atom-lock"
    calls = _fake_pull(monkeypatch, lock)
    holder = _hold(lock, 30, tmp_path / "released")
    try:
        with pytest.raises(BadInputError, match="another atom-convert is writing"):
            atom_convert.convert(src, dst, hub_cache="org/converted")
        assert calls == [] and not dst.exists(), "the pull ran without the destination lock"
    finally:
        holder.kill()
        holder.wait()


def test_hub_cache_pull_waits_for_the_lock_and_runs_under_it(src: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    dst = tmp_path / "dst"
    lock = tmp_path / ".dst.atom-lock"
    released = tmp_path / "released"
    calls = _fake_pull(monkeypatch, lock)
    holder = _hold(lock, 1.5, released)
    try:
        m = atom_convert.convert(src, dst, hub_cache="org/converted", wait=True, notify=lambda m: None)
    finally:
        holder.wait()
    assert m["pulled_from"] == "org/converted"
    assert len(calls) == 1 and calls[0]["held"], calls
    assert calls[0]["at"] >= float(released.read_text()), "the pull ran before the other holder released DST"
    assert not lock.exists()


def test_ensure_converted_hub_pull_runs_under_the_destination_lock(src: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """ensure_converted's --hub-cache pull writes the cache entry as a conversion does, so it holds
    the entry's destination lock (an `atom-convert convert` into it waits), not only the cache lock."""
    from atom_convert.engine.cache import cache_path, ensure_converted

    cache_dir = tmp_path / "cache"
    entry, _ = cache_path(src, cache_dir)
    lock = entry.parent / f".{entry.name}.atom-lock"
    seen: list[bool] = []

    def pull(repo: str, key: str, dst: Any) -> None:
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            seen.append(False)
        except BlockingIOError:
            seen.append(True)
        finally:
            os.close(fd)
        return None  # the repo holds another conversion: convert instead

    monkeypatch.setattr(pull_mod, "pull_converted", pull)
    out = ensure_converted(src, cache_dir, workers=1, hub_cache="org/converted")
    assert seen == [True], "the pull ran without the entry's destination lock"
    assert (out / "atom_manifest.json").is_file() and not lock.exists()
