"""Shared assertions for hostile-input and fault tests (tests/test_hostile.py and the
destination/fault corpus): a refusal must exit with its code through the real CLI
entry point, name what is wrong, leave nothing beside DST, and leave SRC byte-identical.

Usage:
    r = assert_refused(["convert", src, dst], src=src, dst=dst, expect=["config.json", "hidden_size"])

`assert_refused` snapshots SRC (every entry: type, mode, size, symlink target, sha256 of
readable files) and DST's parent folder before the run and compares them afterwards, so a
test needs no knowledge of the staging directories' names: any new entry beside DST is a leak.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from atom_convert.cli import main


def mkfifo_fed_later(path: Path, after: float = 20.0) -> None:
    """Make `path` a FIFO. Opening a FIFO to read it blocks until a writer comes: should the code
    under test wait there, a writer comes after `after` seconds and feeds it bytes that are no valid
    file, so that the test fails on its message instead of hanging the suite. (Once nothing reads
    it, the writer's non-blocking open fails and it does nothing.)"""
    os.mkfifo(path)

    def feed() -> None:
        time.sleep(after)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no reader (ENXIO), or the test's folder is gone
            return
        try:
            os.write(fd, b"not what the reader expects")
        except OSError:
            pass
        finally:
            os.close(fd)

    threading.Thread(target=feed, name=f"fifo-feeder {path.name}", daemon=True).start()


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


def run_cli(args: Sequence[Any], env: dict[str, str] | None = None) -> CliResult:
    """`atom-convert ARGS` in-process through `atom_convert.cli.main` (which maps exceptions to
    exit codes exactly as the installed script does); returns the exit code and the output."""
    out, err = io.StringIO(), io.StringIO()
    old_env = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    code: Any = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main([str(a) for a in args])
            except SystemExit as e:
                code = e.code
    finally:
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if code is None:
        code = 0
    return CliResult(int(code) if isinstance(code, int) else 1, out.getvalue(), err.getvalue())


def _entry(p: Path) -> str:
    st = os.lstat(p)
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return f"link -> {os.readlink(p)}"
    if stat.S_ISDIR(st.st_mode):
        return f"dir {mode:o}"
    if stat.S_ISREG(st.st_mode):
        try:
            with open(p, "rb") as f:
                h = hashlib.sha256()
                while b := f.read(1 << 20):
                    h.update(b)
            digest = h.hexdigest()
        except PermissionError:  # an unreadable file is compared by its metadata
            digest = f"unreadable mtime={st.st_mtime_ns}"
        return f"file {mode:o} {st.st_size} {digest}"
    return f"special {stat.S_IFMT(st.st_mode):o} {mode:o}"


def tree_digest(root: Path) -> dict[str, str]:
    """Every entry under `root` (not following symlinks) with its type, mode, size and
    content hash; `root` itself included, so a removed or replaced SRC is seen too."""
    root = Path(root)
    if not os.path.lexists(root):
        return {}
    out = {".": _entry(root)}
    if root.is_symlink() or not root.is_dir():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for n in sorted(dirnames + filenames):
            p = Path(dirpath) / n
            out[p.relative_to(root).as_posix()] = _entry(p)
    return out


def listing(folder: Path) -> set[str]:
    """Names in `folder` (hidden ones included); empty if it does not exist."""
    try:
        return set(os.listdir(folder))
    except FileNotFoundError:
        return set()


def assert_refused(args: Sequence[Any], *, src: Path | Iterable[Path] | None, dst: Path | None,
                   expect: Sequence[str], code: int = 2, env: dict[str, str] | None = None) -> CliResult:
    """Run the CLI and assert a clean refusal:
    - the exit code is `code` (2: bad input) and the output holds every string of `expect`
      (file, tensor or key, expected and actual value) and no traceback;
    - DST is as before (absent stays absent, an existing DST is byte-identical) and its parent
      holds no new entry (no staging, temporary, lock or old-DST folder left behind);
    - every SRC tree is byte-identical (content, modes, links) to what it was before.
    """
    srcs = [] if src is None else [Path(src)] if isinstance(src, (str, Path)) else [Path(s) for s in src]
    before_src = {s: tree_digest(s) for s in srcs}
    before_dst = tree_digest(dst) if dst is not None else {}
    before_parent = listing(dst.parent) if dst is not None else set()
    r = run_cli(args, env=env)
    assert r.code == code, f"exit code {r.code}, expected {code}; output:\n{r.text}"
    assert "Traceback" not in r.text and "internal error" not in r.text, r.text
    missing = [e for e in expect if e not in r.text]
    assert not missing, f"the message lacks {missing}:\n{r.text}"
    if dst is not None:
        assert tree_digest(dst) == before_dst, f"{dst} was created or changed by a refused conversion"
        new = sorted(listing(dst.parent) - before_parent)
        assert not new, f"left beside {dst}: {new}"
    for s in srcs:
        assert tree_digest(s) == before_src[s], f"SRC {s} changed"
    return r
