"""Where a conversion writes, who may write there, and what survives a crash.

How it works:
1. `check_destination(SRC, DST, force)` runs before any work: DST must not be SRC, lie inside
   SRC or contain SRC (compared after resolving symlinks); a symlink DST to a directory means
   its target, a dangling one is refused; an existing DST needs `force`, and `force` replaces
   only an earlier conversion (a directory with atom_manifest.json) or an empty directory.
2. `DestinationLock` (a `FileLock`, lock.py): `fcntl.flock` on `.DST.atom-lock` beside DST, which the
   kernel releases when its holder dies, so a crashed run never blocks the next one. The file
   names the holder (pid, host, since when) for the refusal message; it is removed on release.
3. `Staging`: everything is written under `.DST.atom-partial/` beside DST, a stable name so
   that the next run finds it. Its journal (`.atom-journal.jsonl`, fsynced) starts with the
   source and options fingerprints and the plan digest, then gets one line per sealed shard
   (file, size, digest (store/digest.py), the sha256 of its planned header). A rerun with the same
   fingerprints keeps the sealed shards whose size and digest still match and redoes the
   rest; one with other fingerprints is refused, naming what changed.
4. `Staging.commit` writes nothing itself: it removes the journal, then renames the staging
   directory to DST (an old DST is first moved to `.DST.atom-old` and put back if the
   second rename fails, removed once it succeeded; a crash between the two renames is
   repaired by the next run, which puts the old DST back).
Only the tool's own files are ever removed: the staging directory (recognised by its name
and its journal), the lock file, `.atom-old`, and an old DST that --force may replace. Inside
the staging directory, only files it can tell are its own (`_owned`): with a readable journal,
the names it writes there (shards and their `.partial`, manifests, side files, the journal);
with an unreadable one, only the journal and the shards it records. Anything else there (a
foreign file, a symlink, another directory) makes the resume or --restart refuse, naming it.
Nothing is written through a symlink: the lock file, the journal and the other files the tool
writes beside DST or in a cache directory are created without following one (`replace_file`,
lock.open_nofollow), and a symlink or foreign file at their names is refused (`ForeignPathError`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import BadInputError, DestinationExistsError, NotResumableError
from ..files.reading import loads
from ..files.safetensors import is_side_name
from .fingerprint import Fingerprint
# FileLock: also imported from here (engine/cache.py)
from .lock import FileLock, ForeignPathError, Notify, kind_of, open_nofollow, refuse_foreign
from . import digest
from .manifest import MANIFEST_NAME, VERIFY_NAME

STAGING_SUFFIX = ".atom-partial"
LOCK_SUFFIX = ".atom-lock"
OLD_SUFFIX = ".atom-old"
JOURNAL_NAME = ".atom-journal.jsonl"
PARTIAL_SUFFIX = ".partial"  # a shard being written; never trusted, removed by the next run
TMP_SUFFIX = ".tmp"  # replace_file's (and write_manifest's) temporary name
JOURNAL_VERSION = 1
SET_DIRS = ("mtp",)  # the folders the tool makes in a staging directory (engine/planning.MTP_DIR)
_SHARD_NAME = re.compile(r"model(?:-common|-rank\d+)?-\d{5}-of-\d{5}\.safetensors")  # layout/plan.assign_shards


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (POSIX needs the directory fsynced)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _found(st: os.stat_result, path: Path) -> str:
    """What is at `path` (lstat `st`), in words, for a refusal."""
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link (to {os.readlink(path)})"
    return kind_of(st.st_mode) if not stat.S_ISREG(st.st_mode) else "a regular file"


def check_replace_target(path: Path, expected: str) -> Path:
    """Refuse (ForeignPathError) a symlink or non-regular file at `path` or at its temporary name,
    as `replace_file` would; returns the temporary name. Called before long work too, so that the
    refusal comes before it, not after."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    for p in (path, tmp):
        st = _lstat(p)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise refuse_foreign(p, _found(st, p), expected)
    return tmp


def replace_file(path: Path, data: bytes, expected: str) -> None:
    """Write `path` whole and atomically (`path.tmp`, fsynced, renamed over it), never through a
    symlink: the temporary file is created exclusively without following one, and a symlink or
    non-regular file at `path` or at `path.tmp` is refused (ForeignPathError), left as it is. A
    regular file at `path.tmp` is the leftover of an interrupted write (the tool's own name) and is
    replaced. `expected`: what `path` is, for the refusal."""
    tmp = check_replace_target(path, expected)
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


@dataclass(frozen=True)
class DestPaths:
    """DST (absolute, a symlink replaced by its target) and the tool's own names beside it."""

    dst: Path

    @property
    def parent(self) -> Path:
        return self.dst.parent

    def _beside(self, suffix: str) -> Path:
        return self.parent / f".{self.dst.name}{suffix}"

    @property
    def staging(self) -> Path:
        return self._beside(STAGING_SUFFIX)

    @property
    def lock(self) -> Path:
        return self._beside(LOCK_SUFFIX)

    @property
    def old(self) -> Path:
        return self._beside(OLD_SUFFIX)


def _is_conversion_or_empty(d: Path) -> bool:
    return (d / MANIFEST_NAME).is_file() or not any(d.iterdir())


def foreign_in_output(d: Path) -> list[str]:
    """What an existing output directory `d` holds that atom-convert did not write (never followed
    through a symlink): anything but shards, manifests, side files, the `mtp/` set and the verify
    result the README puts there. Replacing `d` would delete it, so a replacement is refused."""
    return _owned(d, lambda rel: own_name(rel) or rel == VERIFY_NAME).foreign


def refuse_foreign_output(d: Path, foreign: list[str], what: str) -> BadInputError:
    shown = ", ".join(foreign[:5]) + (f", ... ({len(foreign)} entries)" if len(foreign) > 5 else "")
    return BadInputError(f"{what} {d} is an atom-convert output, but it also holds what atom-convert did not write: "
                         f"{shown}; replacing it would delete that. Move it out of {d} (or remove {d} yourself if "
                         f"it is expendable), then run again")


def check_replaceable(dst: Path, force: bool) -> None:
    """Refuse an existing DST unless `force` and it is an earlier conversion or empty."""
    if not os.path.lexists(dst):
        return
    if not dst.is_dir():
        raise BadInputError(f"destination {dst} exists and is not a directory; choose another DST, "
                            "or remove it yourself if it is expendable")
    if not force:
        raise DestinationExistsError(
            f"destination {dst} already exists; pass --force (force=True) to replace it (only an earlier "
            f"atom-convert output, a directory with {MANIFEST_NAME}, or an empty directory is replaced)")
    if (dst / MANIFEST_NAME).is_file():
        foreign = foreign_in_output(dst)
        if foreign:
            raise refuse_foreign_output(dst, foreign, "destination")
    if not _is_conversion_or_empty(dst):
        names = sorted(p.name for p in dst.iterdir())
        shown = ", ".join(names[:5]) + (f", ... ({len(names)} entries)" if len(names) > 5 else "")
        raise BadInputError(
            f"destination {dst} is not an atom-convert output: it has no {MANIFEST_NAME} and holds {shown}; "
            "--force replaces only an earlier conversion or an empty directory. Choose another DST, or "
            "remove it yourself if its contents are expendable")


def check_destination(src: str | os.PathLike[str], dst: str | os.PathLike[str], force: bool) -> DestPaths:
    """The path checks made before any work (module docstring, step 1); returns DST's paths."""
    d = Path(os.path.abspath(dst))
    if d.is_symlink():
        target = os.readlink(d)
        if not d.exists():
            raise BadInputError(
                f"destination {d} is a symbolic link to {target}, which does not exist; create the directory "
                f"it points to (mkdir -p {d.resolve()}) to convert into it, or remove the link")
        d = d.resolve()
    if d.name in ("", ".", ".."):
        raise BadInputError(f"destination {dst} does not name a directory; give a path such as ./model-atom")
    rs, rd = Path(src).resolve(), d.resolve()
    if rd == rs:
        raise BadInputError(f"destination {dst} is the source checkpoint itself ({rs}); choose a DST outside SRC "
                            "(converting in place would destroy the source)")
    if rs in rd.parents:
        raise BadInputError(f"destination {dst} ({rd}) is inside the source checkpoint {rs}; choose a DST outside "
                            "SRC")
    if rd in rs.parents:
        raise BadInputError(f"destination {dst} ({rd}) contains the source checkpoint {rs}; replacing it would "
                            "delete the source. Choose a DST that neither contains nor lies inside SRC")
    for p in [d.parent, *d.parent.parents]:
        if os.path.lexists(p):
            if not p.is_dir():
                raise BadInputError(f"cannot create destination {d}: {p} exists and is not a directory")
            break
    check_replaceable(d, force)
    return DestPaths(d)


def make_parents(path: Path) -> list[Path]:
    """mkdir -p; returns the directories created (outermost first), to remove them if nothing is kept."""
    created: list[Path] = []
    for p in reversed([path, *path.parents]):
        if not os.path.lexists(p):
            try:
                os.mkdir(p)
            except FileExistsError:
                continue
            created.append(p)
    return created


def remove_created(created: list[Path]) -> None:
    """rmdir (never rmtree) the directories `make_parents` created, innermost first, if they are empty."""
    for p in reversed(created):
        try:
            os.rmdir(p)
        except OSError:
            return


# ------------------------------------------------------------------------------------------------
# one conversion per DST
# ------------------------------------------------------------------------------------------------


class DestinationLock(FileLock):
    """The lock of one DST (`.DST.atom-lock`): one conversion into DST at a time; `wait` queues."""

    def __init__(self, paths: DestPaths, *, wait: bool = False, notify: Notify = print):
        self.dst = paths.dst
        super().__init__(
            paths.lock, wait=wait, notify=notify,
            busy=lambda who: (f"another atom-convert is writing {paths.dst} ({who}; lock {paths.lock}); wait for it "
                              "to finish, pass --wait (wait=True) to queue behind it, or choose another DST"),
            waiting=lambda who: f"waiting for the conversion into {paths.dst} ({who}) to finish (--wait)")


# ------------------------------------------------------------------------------------------------
# the staging directory and its journal
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sealed:
    """A shard that is complete on disk: relative path (posix, from the staging root), size, its
    digest (`algorithm`, hex: store/digest.py), and the sha256 of its planned header (names, dtypes,
    shapes, offsets)."""

    file: str
    nbytes: int
    digest: str
    plan: str
    algorithm: str = digest.WRITTEN

    def as_json(self) -> str:
        return json.dumps({"sealed": self.file, "bytes": self.nbytes, self.algorithm: self.digest, "plan": self.plan})


class Journal:
    """Append-only, fsynced record of sealed shards; `record` is safe to call from several threads."""

    def __init__(self, path: Path, header: dict[str, Any], kept: list[Sealed]):
        self.path = path
        self.sealed: list[Sealed] = list(kept)
        self._lock = threading.Lock()
        text = json.dumps(header) + "\n" + "".join(s.as_json() + "\n" for s in kept)
        replace_file(path, text.encode(), "atom-convert's journal (a regular file)")
        # Appended to through the file just renamed there, never through a symlink.
        self._fh = os.fdopen(open_nofollow(path, os.O_WRONLY | os.O_APPEND,
                                           expected="atom-convert's journal (a regular file)"), "a")

    def record(self, s: Sealed) -> None:
        with self._lock:
            self._fh.write(s.as_json() + "\n")
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self.sealed.append(s)

    def close(self) -> None:
        with self._lock:
            if not self._fh.closed:
                self._fh.close()


def _journal_lines(path: Path) -> list[str]:
    """The journal's lines, read without following a symlink (one there is no journal of ours)."""
    fd = open_nofollow(path, os.O_RDONLY, expected="atom-convert's journal (a regular file)")
    with os.fdopen(fd, "rb") as f:
        return f.read().decode("utf-8", errors="replace").split("\n")


def _entries_of(lines: list[str]) -> list[Sealed]:
    entries = []
    for line in lines:
        try:
            d = loads(line)
            algorithm, hexdigest = digest.entry_digest(d)
            entries.append(Sealed(str(d["sealed"]), int(d["bytes"]), hexdigest, str(d["plan"]), algorithm))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return entries


def _read_journal(path: Path) -> tuple[dict[str, Any], list[Sealed]]:
    """(header, sealed entries). A torn or garbled line is skipped: its shard is simply redone."""
    lines = _journal_lines(path)
    try:
        header = loads(lines[0])
        if not isinstance(header, dict) or header.get("journal") != JOURNAL_VERSION:
            raise ValueError(f"journal version {header.get('journal') if isinstance(header, dict) else header!r}")
    except ValueError as e:
        raise ValueError(f"its journal {path.name} is unreadable ({e})") from None
    return header, _entries_of(lines[1:])


def _is_regular(path: Path) -> bool:
    st = _lstat(path)
    return st is not None and stat.S_ISREG(st.st_mode)


def own_name(rel: str) -> bool:
    """Whether `rel` (posix, from the staging root) is a name the tool writes in a staging directory:
    a shard or its `.partial`, a manifest (or its temporary), a side file (top level or in a set's
    folder), the journal (or its temporary)."""
    *dirs, name = rel.split("/")
    if dirs and (len(dirs) > 1 or dirs[0] not in SET_DIRS):
        return False
    if name.endswith(PARTIAL_SUFFIX):
        return _SHARD_NAME.fullmatch(name[:-len(PARTIAL_SUFFIX)]) is not None
    return (_SHARD_NAME.fullmatch(name) is not None or name in (MANIFEST_NAME, MANIFEST_NAME + TMP_SUFFIX)
            or is_side_name(name) or (not dirs and name in (JOURNAL_NAME, JOURNAL_NAME + TMP_SUFFIX)))


@dataclass
class _Contents:
    """A staging directory's contents: the files and folders the tool can tell are its own, and
    the rest (`foreign`: what it did not write, a symlink, anything not a regular file)."""

    files: list[str] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)


def _owned(root: Path, ours: Callable[[str], bool]) -> _Contents:
    """Walk `root` without following a symlink; `ours(rel)` tells the tool's own regular files."""
    c = _Contents()
    todo = [("", root)]
    while todo:
        prefix, d = todo.pop()
        with os.scandir(d) as it:
            for e in sorted(it, key=lambda e: e.name):
                rel = prefix + e.name
                if e.is_symlink():
                    c.foreign.append(f"{rel} (a symbolic link to {os.readlink(e.path)})")
                elif e.is_dir(follow_symlinks=False):
                    if rel in SET_DIRS:
                        c.dirs.append(rel)
                        todo.append((rel + "/", Path(e.path)))
                    else:
                        c.foreign.append(rel + "/")
                elif not e.is_file(follow_symlinks=False):
                    c.foreign.append(f"{rel} ({kind_of(e.stat(follow_symlinks=False).st_mode)})")
                elif ours(rel):
                    c.files.append(rel)
                else:
                    c.foreign.append(rel)
    return c


@dataclass
class Staging:
    """The staging directory of one DST (module docstring, steps 3 and 4)."""

    paths: DestPaths
    notify: Notify = print
    journal: Journal | None = field(default=None, init=False)
    created: bool = field(default=False, init=False)  # the staging directory is this run's

    @property
    def root(self) -> Path:
        return self.paths.staging

    @property
    def sealed(self) -> list[Sealed]:
        return list(self.journal.sealed) if self.journal else []

    def _is_ours(self) -> bool:
        r = self.root
        return r.is_dir() and not r.is_symlink() and (
            _is_regular(r / JOURNAL_NAME) or _is_conversion_or_empty(r))

    def _contents(self) -> tuple[_Contents, str]:
        """What of the staging directory is the tool's own (module docstring), and, when its
        journal cannot be read, why (then only the journal and the shards it records are)."""
        r, journal = self.root, self.root / JOURNAL_NAME
        if not os.path.lexists(journal):  # empty, or finished (its manifest) but not yet renamed
            return _owned(r, own_name), ""
        why, lines = "", []
        try:
            lines = _journal_lines(journal)
            _read_journal(journal)
        except (ValueError, OSError) as e:
            why = str(e)
        if not why:
            return _owned(r, own_name), ""
        recorded = {e.file for e in _entries_of(lines)}

        def ours(rel: str) -> bool:
            base = rel[:-len(PARTIAL_SUFFIX)] if rel.endswith(PARTIAL_SUFFIX) else rel
            return rel in (JOURNAL_NAME, JOURNAL_NAME + TMP_SUFFIX) or (base in recorded and own_name(rel))

        return _owned(r, ours), why

    def _refuse_foreign(self, c: _Contents, why: str, doing: str) -> None:
        if not c.foreign:
            return
        r = self.root
        shown = ", ".join(c.foreign[:8]) + (f", ... ({len(c.foreign)} in all)" if len(c.foreign) > 8 else "")
        because = (f"; its journal {JOURNAL_NAME} is unreadable ({why}), so only the journal and the shards it "
                   "records are known to be atom-convert's" if why else "")
        raise ForeignPathError(
            f"{doing} the partial conversion in {r}: it holds what atom-convert did not write: {shown}"
            f"{because}. atom-convert removes only its own files: move those elsewhere, or remove {r} by hand "
            "if its contents are expendable, then run again")

    def _clear(self, doing: str) -> None:
        """Remove the staging directory, all of it the tool's own (else refused, nothing removed)."""
        c, why = self._contents()
        self._refuse_foreign(c, why, doing)
        self._delete(c)

    def _delete(self, c: _Contents) -> None:
        r = self.root
        for rel in c.files:
            try:
                os.unlink(r / rel)
            except FileNotFoundError:
                pass
        for rel in sorted(c.dirs, reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(r / rel)
        with contextlib.suppress(OSError):
            os.rmdir(r)

    def recover_swap(self) -> None:
        """Repair a crash between the two renames of `commit` (run under the lock)."""
        old, dst = self.paths.old, self.paths.dst
        if not os.path.lexists(old):
            return
        if not (old.is_dir() and not old.is_symlink() and _is_conversion_or_empty(old)):
            raise BadInputError(f"{old} is in the way and is not an atom-convert output; move it elsewhere")
        if os.path.lexists(dst):
            shutil.rmtree(old)  # the replacement finished; this is the replaced conversion
        else:
            os.rename(old, dst)
            self.notify(f"put back {dst}: an earlier --force replacement of it was interrupted")

    def open(self, header: dict[str, Any], planned: dict[str, str], mode: str) -> list[Sealed]:
        """Create the staging directory, or resume the one a previous run left.

        header: {"source": Fingerprint dict, "options": Fingerprint dict, "plan": digest}.
        planned: every shard's relative path -> its header digest.
        mode: "auto" (resume when possible, saying so), "resume" (the same, and say when there is
        nothing to resume), "restart" (discard what a previous run left).
        Returns the sealed shards kept.
        """
        r = self.root
        kept: list[Sealed] = []
        if os.path.lexists(r):
            if not self._is_ours():
                raise BadInputError(f"{r} is in the way and was not written by atom-convert (no {JOURNAL_NAME}); "
                                    "move it elsewhere and run again")
            if mode == "restart":
                self._clear("--restart cannot remove")
                self.notify(f"--restart: removing the partial conversion in {r}")
            elif not _is_regular(r / JOURNAL_NAME):
                # empty, or finished but not yet renamed when it crashed: nothing to resume
                self._clear("cannot remove")
            else:
                kept = self._resumable(header, planned)
        elif mode == "resume":
            self.notify(f"--resume: no partial conversion of {self.paths.dst} found ({r}); starting from the beginning")
        if not r.exists():
            self.created = True
            os.mkdir(r)  # a plain mkdir's permissions (umask), which DST keeps after the rename
        full = {**header, "journal": JOURNAL_VERSION, "dst": str(self.paths.dst), "pid": os.getpid(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.journal = Journal(r / JOURNAL_NAME, full, kept)
        return kept

    def _resumable(self, header: dict[str, Any], planned: dict[str, str]) -> list[Sealed]:
        r = self.root
        hint = "pass --restart (resume='restart') to discard it and start over"
        try:
            old, entries = _read_journal(r / JOURNAL_NAME)
            old_src = Fingerprint.from_dict(old.get("source"))
            old_opt = Fingerprint.from_dict(old.get("options"))
        except ValueError as e:
            raise NotResumableError(f"cannot resume the partial conversion in {r}: {e}; {hint}") from None
        why = []
        src_changed = old_src.changed(Fingerprint.from_dict(header["source"]))
        if src_changed:
            why.append("the source changed (" + ", ".join(src_changed) + ")")
        new_opt = Fingerprint.from_dict(header["options"])
        for k in old_opt.changed(new_opt):
            why.append(f"option {k} was {old_opt.parts.get(k)!r}, now {new_opt.parts.get(k)!r}")
        if not why and old.get("plan") != header["plan"]:
            why.append("the plan differs (staged by a different atom-convert build)")
        if why:
            raise NotResumableError(
                f"{r} holds a partial conversion into {self.paths.dst} that this run cannot resume: "
                + "; ".join(why) + f". Rerun with the original source and options to resume it, or {hint}")
        contents = _owned(r, own_name)
        self._refuse_foreign(contents, "", "cannot resume")  # before anything is removed
        latest = {e.file: e for e in entries}
        kept = []
        for e in latest.values():
            p = r / e.file
            if not (planned.get(e.file) == e.plan and e.file in contents.files and p.stat().st_size == e.nbytes):
                continue
            # a shard sealed by an earlier version is checked by its own digest, and the manifest
            # takes this version's: both from one read
            got = digest.file_digests(p, tuple(dict.fromkeys((e.algorithm, digest.WRITTEN))))
            if got[e.algorithm] == e.digest:
                kept.append(Sealed(e.file, e.nbytes, got[digest.WRITTEN], e.plan))
        keep = {e.file for e in kept} | {JOURNAL_NAME}
        for rel in contents.files:  # unsealed, unrecorded or damaged: redone
            if rel not in keep:
                os.unlink(r / rel)
        kept.sort(key=lambda e: e.file)
        self.notify(f"resuming the partial conversion in {r}: keeping {len(kept)} of {len(planned)} shards "
                    f"({sum(e.nbytes for e in kept)} bytes) already sealed, converting the rest")
        return kept

    def remove_partials(self) -> None:
        """Remove every shard still being written (never the sealed ones, nor what is not the tool's)."""
        if self.root.is_dir() and not self.root.is_symlink():
            for rel in _owned(self.root, own_name).files:
                if rel.endswith(PARTIAL_SUFFIX):
                    try:
                        os.unlink(self.root / rel)
                    except FileNotFoundError:
                        pass

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()

    def remove(self) -> None:
        """Remove the staging directory (the tool's own) entirely; what the tool did not write there
        (`_owned`) is left, and the directory with it."""
        self.close()
        if self.root.is_dir() and not self.root.is_symlink():
            try:
                c = _owned(self.root, own_name)
                self._delete(c)
            except OSError:
                return
            if c.foreign:
                self.notify(f"left {self.root}: it holds what atom-convert did not write ({', '.join(c.foreign[:8])}); "
                            "remove it by hand once you have checked them")

    def commit(self) -> None:
        """Rename the finished staging directory to DST (module docstring, step 4). Ctrl-C and
        SIGTERM wait until it is done: between the journal's removal and the rename, an interrupt
        would leave finished shards that no journal lists. One that arrived meanwhile is noted,
        not raised: the conversion is complete."""
        with _signals_held() as held:
            self._commit()
        if held:
            self.notify(f"{_SIGNAL_NAMES.get(held[0], held[0])} arrived while {self.paths.dst} was being renamed into "
                        "place; the conversion had finished, so it is complete")

    def _commit(self) -> None:
        dst, old = self.paths.dst, self.paths.old
        # What appeared at DST or its swap name since the checks under the lock is not replaced
        # nor removed (checked before the journal goes).
        st = _lstat(dst)
        if st is not None:
            if not (stat.S_ISDIR(st.st_mode) and _is_conversion_or_empty(dst)):
                raise refuse_foreign(dst, _found(st, dst) if not stat.S_ISDIR(st.st_mode) else
                                     "a directory that is not an atom-convert output",
                                     "an earlier atom-convert output or an empty directory, to be replaced")
            st = _lstat(old)
            if st is not None:
                raise refuse_foreign(old, _found(st, old), "nothing there (the name atom-convert moves a replaced "
                                                           f"{dst.name} to)")
        self.close()
        os.unlink(self.root / JOURNAL_NAME)
        fsync_dir(self.root)
        if os.path.lexists(dst):
            os.rename(dst, old)
            try:
                os.rename(self.root, dst)
            except BaseException:
                os.rename(old, dst)  # put the previous DST back before reporting the failure
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(self.root, dst)
        fsync_dir(dst.parent)


_SIGNAL_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}


@contextlib.contextmanager
def _signals_held() -> Iterator[list[int]]:
    """SIGINT and SIGTERM recorded, not acted on, inside the block (on the main thread, where
    Python runs signal handlers; elsewhere this changes nothing). Only handlers that are Python
    functions are replaced (Ctrl-C's KeyboardInterrupt, the CLI's SIGTERM handler); an ignored
    or default signal stays as it is."""
    held: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            if callable(signal.getsignal(sig)):
                previous[sig] = signal.signal(sig, lambda signum, frame: held.append(signum))
    try:
        yield held
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def plan_digest(planned: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(planned, sort_keys=True).encode()).hexdigest()


def _is_written_by_us(path: Path, paths: DestPaths) -> bool:
    """A path the conversion writes: in the staging directory, the lock, DST, or a parent it creates."""
    p = Path(os.path.abspath(path))
    return (p in (paths.lock, paths.old, paths.dst, paths.staging) or paths.staging in p.parents
            or p in paths.dst.parents)


def os_error_message(e: OSError, staging: Staging | None, paths: DestPaths) -> tuple[str, bool] | None:
    """(message, keep sealed shards) for the OS errors a user can fix while writing, or None for the
    others (an error reading the source is not a destination problem)."""
    if e.filename is not None and not _is_written_by_us(Path(os.fsdecode(e.filename)), paths):
        return None
    where = e.filename or (staging.root if staging else "the destination")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        sealed = staging.sealed if staging else []
        if sealed:
            return (f"no space left on the device while writing {where} ({e.strerror}). The {len(sealed)} shard(s) "
                    f"already sealed ({sum(s.nbytes for s in sealed)} bytes) are kept in {staging.root}: free space "
                    "and run the same command again to resume, or pass --restart to start over; delete "
                    f"{staging.root} to give their space back", True)
        return (f"no space left on the device while writing {where} ({e.strerror}); free space or choose a DST on "
                "another filesystem. Nothing was kept", False)
    if e.errno == errno.EROFS:
        return (f"cannot write {where}: read-only file system; choose a DST on a writable filesystem. "
                "Nothing was kept", False)
    if e.errno in (errno.EACCES, errno.EPERM):
        return (f"cannot write {where}: permission denied ({e.strerror}); choose a DST in a directory you may "
                "write to, or fix its permissions. Nothing was kept", False)
    return None
