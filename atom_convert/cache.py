"""`ensure_converted`: the converted directory for a source and options, converted at most once.

How it works:
1. Fingerprints, without reading tensor data: the source's (config.json, the index, every
   safetensors file's size and header, the side files) and the options' (target, tp, shard size,
   MTP, MLA operand format, profile, tool version, ATOM revision and manifest format). A serving
   start must not pay a re-hash of 700 GB.
2. The directory is `CACHE/<source name>-<target>-tp<N>-<options digest>`; beside it
   `<name>.cache.json` records both fingerprints. It is current when its manifest is there, every
   file the manifest lists has its recorded size (stat only) and the record matches. A current
   directory is returned at once, without a lock.
3. Otherwise the caller takes an exclusive `flock` on `.<name>.lock` in CACHE and checks again: a
   caller that waited while another converted finds the finished directory and returns it (a
   finished directory is never rebuilt by a waiter). The kernel releases the lock of a process
   that dies, so the next caller takes over; leftovers of the dead conversion (staging directories
   beside DST) are removed first, under the lock, where nobody else can be writing them.
4. Under the lock, `fetch` (when given) may place a converted directory from elsewhere (a Hub repo
   of converted shards); else the source is converted into DST, replacing a stale one. The record
   is written last, so a crash between the two leaves a directory that is simply converted again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import struct
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from .convert import DEFAULT_SHARD_SIZE, convert, parse_size
from .errors import BadInputError
from .manifest import ATOM_REVISION, FORMAT_VERSION, MANIFEST_NAME

RECORD_SUFFIX = ".cache.json"
LOCK_SUFFIX = ".lock"

# Side files whose bytes are part of the source fingerprint (they are copied into DST).
_SIDE_SUFFIXES = (".json", ".model", ".jinja", ".tiktoken", ".py", ".txt")

Fetch = Callable[[Path, dict[str, Any]], bool]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _header_part(path: Path) -> str:
    """'size:sha256(length + JSON header)' of a safetensors file: names, dtypes, shapes, offsets."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) == 8:
            (n,) = struct.unpack("<Q", head)
            if n <= size - 8:
                head += f.read(n)
    return f"{size}:{_sha(head)}"


def source_fingerprint(src: Path) -> dict[str, str]:
    """One part per file that shapes the output; reads headers and small files, never tensor data."""
    if not src.is_dir():
        raise BadInputError(f"{src}: not a directory; give the checkpoint folder (config.json and safetensors files)")
    parts = {}
    for p in sorted(src.iterdir()):
        if not p.is_file():
            continue
        if p.name.endswith(".safetensors"):
            parts[p.name] = _header_part(p)
        elif p.name.endswith(_SIDE_SUFFIXES) and p.stat().st_size < 64 << 20:
            parts[p.name] = _sha(p.read_bytes())
    if "config.json" not in parts:
        raise BadInputError(f"{src}: no config.json; this is not a Hugging Face checkpoint folder")
    return parts


def options_fingerprint(*, target: str, tp: int, shard_size: int, mtp: bool, mla_bmm: str, profile: str) -> dict[str, str]:
    from . import __version__

    return {"target": target, "tp": str(tp), "shard_size": str(shard_size), "mtp": str(bool(mtp)),
            "mla_bmm": mla_bmm, "profile": profile, "tool_version": __version__,
            "layout": f"atom-{ATOM_REVISION}/manifest-v{FORMAT_VERSION}"}


def _digest(parts: dict[str, str]) -> str:
    return _sha(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode())


def _complete(dst: Path) -> bool:
    """The manifest is there and every file it lists has its recorded size (stat only)."""
    try:
        m = json.loads((dst / MANIFEST_NAME).read_text())
        return all((dst / rel).stat().st_size == meta["bytes"] for rel, meta in m["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _current(dst: Path, record: Path, want: dict[str, Any]) -> bool:
    try:
        have = json.loads(record.read_text())
    except (OSError, ValueError):
        return False
    return (have.get("source_digest"), have.get("options_digest")) == (want["source_digest"], want["options_digest"]) \
        and _complete(dst)


@contextmanager
def _locked(lock: Path, timeout: float | None) -> Iterator[None]:
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (fcntl.LOCK_NB if deadline is not None else 0))
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:  # type: ignore[operator]
                    holder = os.pread(fd, 512, 0).decode(errors="replace") or "unknown"
                    raise BadInputError(f"{lock}: another process has been converting for over {timeout:g} s "
                                        f"(holder: {holder}); wait longer (timeout=None) or remove the cache entry") from None
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock; the kernel does the same for a process that dies


def _remove_leftovers(dst: Path) -> None:
    """Staging directories of a conversion into `dst` that died (only ever called under the lock)."""
    for p in dst.parent.glob(f".{dst.name}.*"):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)


def cache_path(src: str | os.PathLike[str], cache_dir: str | os.PathLike[str], *, target: str = "gfx950", tp: int = 1,
               shard_size: int | str = DEFAULT_SHARD_SIZE, mtp: bool = True, mla_bmm: str = "fp8",
               profile: str = "atom") -> tuple[Path, dict[str, Any]]:
    """The directory `ensure_converted` uses for these arguments, and the record it expects there."""
    src = Path(src)
    opts = options_fingerprint(target=target, tp=tp, shard_size=parse_size(shard_size), mtp=mtp, mla_bmm=mla_bmm,
                               profile=profile)
    srcfp = source_fingerprint(src)
    name = f"{src.resolve().name}-{target}-tp{tp}-{_digest(opts)[:12]}"
    want = {"source": str(src.resolve()), "source_digest": _digest(srcfp), "options_digest": _digest(opts),
            "options": opts, "source_parts": srcfp}
    return Path(cache_dir) / name, want


def _hub_fetch(src: str | os.PathLike[str], repo: str, **options: Any) -> Fetch:
    """The `fetch` step for a Hub cache: pull `repo` into DST when its content key (hub.py: the
    source's identity without tensor data, and the options that decide the bytes) is this one's."""
    from .hub import conversion_options, conversion_record, open_source, pull_converted

    def fetch(dst: Path, _want: dict[str, Any]) -> bool:
        source = open_source(src)
        try:
            key = conversion_record(source, conversion_options(**options))["content_key"]
        finally:
            source.close()
        return pull_converted(repo, key, dst) is not None

    return fetch


def ensure_converted(src: str | os.PathLike[str], cache_dir: str | os.PathLike[str], *, target: str = "gfx950",
                     tp: int = 1, shard_size: int | str = DEFAULT_SHARD_SIZE, mtp: bool = True, mla_bmm: str = "fp8",
                     profile: str = "atom", fetch: Fetch | None = None, timeout: float | None = None,
                     progress: bool = False, hub_cache: str | None = None) -> Path:
    """The converted directory for `src` and these options inside `cache_dir`, converting only when it
    is missing or stale. Safe to call from every rank of a server at once: one converts, the others
    wait and return the same path.

    Args:
        src: the Hugging Face checkpoint folder.
        cache_dir: where converted directories are kept (created if missing).
        target, tp, shard_size, mtp, mla_bmm, profile: as for `convert`.
        fetch: optional `fetch(dst, record) -> bool`, called under the lock before converting; it may
            place a complete converted directory at `dst` for `record` (source and options
            fingerprints) and return True, or return False to let the source be converted.
        timeout: seconds to wait for another process's conversion (None: as long as it takes).
        hub_cache: a Hub repo of converted shards (`org/name[@revision]`, see `atom-convert upload`):
            when its content key matches this source and these options, it is downloaded and
            checked instead of converting (the `fetch` step; hub.pull_converted).
        progress: a progress bar while converting.

    Example:
        >>> dst = atom_convert.ensure_converted("DeepSeek-V3", "/cache/atom", target="gfx950", tp=8)
        >>> atom_convert.load_into(model, dst, rank=rank, device=f"cuda:{rank}")
    """
    dst, want = cache_path(src, cache_dir, target=target, tp=tp, shard_size=shard_size, mtp=mtp, mla_bmm=mla_bmm,
                           profile=profile)
    record = dst.with_name(dst.name + RECORD_SUFFIX)
    if _current(dst, record, want):
        return dst
    if hub_cache is not None and fetch is None:
        fetch = _hub_fetch(src, hub_cache, target=target, tp=tp, mtp=mtp, mla_bmm=mla_bmm, profile=profile)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dst.with_name(f".{dst.name}{LOCK_SUFFIX}"), timeout):
        if _current(dst, record, want):  # converted by the caller we waited for
            return dst
        _remove_leftovers(dst)
        record.unlink(missing_ok=True)
        if not (fetch is not None and fetch(dst, want) and _complete(dst)):
            convert(src, dst, target, tp=tp, shard_size=shard_size, mtp=mtp, force=True, progress=progress,
                    profile=profile, mla_bmm=mla_bmm)
        tmp = record.with_name(record.name + ".tmp")
        tmp.write_text(json.dumps(want, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, record)  # last: the directory counts as current from here on
    return dst
