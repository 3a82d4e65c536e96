"""`ensure_converted`: the converted directory for a source and options, converted at most once.

How it works:
1. Fingerprints, without reading tensor data (fingerprint.py, the same ones a resumed
   conversion checks): the source's (config.json, the index, every safetensors file's size and
   header, the side files and remote-code files copied into DST; for a Hub repo id, the commit
   its revision names, and offline with no way to resolve it, the entry converted earlier) and
   the options' (everything
   that changes the bytes: target, tp, shard size, MTP, MLA operand format, profile, the
   parallel mode, tool version, layout revision). A serving start must not pay a re-hash of 700 GB.
2. The directory is `CACHE/<source name>-<target>-tp<N>-<digest of the options and of where the
   source is>` (a Hub repo's name is `org--name`); beside it
   `<name>.cache.json` records both fingerprints. It is current when its manifest is there, every
   file the manifest lists has its recorded size (stat only) and the record matches. A current
   directory is returned at once, without a lock.
3. Otherwise the caller takes the cache entry's lock (`.<name>.lock`, a `staging.FileLock`) and
   checks again: a caller that waited while another converted finds the finished directory and
   returns it (a finished directory is never rebuilt by a waiter). The kernel releases the lock of
   a process that dies, so the next caller takes over, and its conversion resumes from the shards
   the dead one sealed (staging.py) when they were staged from the same source and options;
   otherwise they are discarded and it starts over.
4. Under the lock, `fetch` (when given) may place a converted directory from elsewhere (a Hub repo
   of converted shards); else the source is converted into DST, replacing a stale one. The record
   is written last, so a crash between the two leaves a directory that is simply converted again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..layout.options import ConversionOptions, check_count, check_flag, check_path
from .convert import convert
from ..errors import BadInputError, HubOfflineError, NotResumableError
from ..files.reading import loads, read_regular
from ..store.fingerprint import Fingerprint, options_fingerprint, source_fingerprint, source_stamps
from ..hub.repo import RepoSpec, open_source, parse_repo_spec
from ..store.manifest import MANIFEST_NAME, read_manifest
from ..store.staging import (DestinationLock, DestPaths, FileLock, check_replace_target, foreign_in_output,
                             refuse_foreign_output, replace_file)

log = logging.getLogger("atom_convert")

RECORD_SUFFIX = ".cache.json"
RECORD_EXPECTED = "atom-convert's cache record (a regular file)"
LOCK_SUFFIX = ".lock"

Fetch = Callable[[Path, dict[str, Any]], bool]


def _complete(dst: Path) -> bool:
    """The manifest is there and readable by this atom-convert (store/manifest.read_manifest: its
    format, its keys, every file it names inside DST), and every file it lists has its recorded
    size (stat only). A manifest refused as bad input makes the entry stale, not the call fail."""
    try:
        m = read_manifest(dst)
        return all((dst / rel).stat().st_size == meta["bytes"] for rel, meta in m["files"].items())
    except (OSError, BadInputError):
        return False


def _check_own(cache_dir: Path, dst: Path, record: Path, lock: Path) -> None:
    """Refuse a cache whose entry ensure_converted could not rebuild in place: it only ever writes
    inside `cache_dir`, so the entry, its record and its lock must be its own, not symlinks (a
    rebuild would write where they lead), and the entry a directory; `cache_dir` a directory."""
    if os.path.lexists(cache_dir) and not cache_dir.is_dir():
        raise BadInputError(f"cache_dir {cache_dir}: exists and is not a directory; give a directory for the "
                            "converted entries (it is created if missing)")
    for p in (dst, record, lock):
        if p.is_symlink():
            raise BadInputError(f"cache_dir {cache_dir}: the cache entry {p.name} is a symbolic link (to "
                                f"{os.readlink(p)}); ensure_converted reads and writes only inside cache_dir: "
                                f"remove the link (the entry is then converted again)")
    if os.path.lexists(dst) and not dst.is_dir():
        raise BadInputError(f"cache_dir {cache_dir}: the cache entry {dst.name} exists and is not a directory; "
                            "remove it (the entry is then converted again)")


def _clear_unreplaceable(dst: Path) -> None:
    """A stale entry that `convert(force=True)` would not replace (its manifest deleted, or no
    regular file) is removed first: it is this cache's own directory (`_check_own`), but only when
    everything in it is what atom-convert writes (a file put there by hand is refused, not deleted)."""
    m = dst / MANIFEST_NAME
    if dst.is_dir() and not (m.is_file() and not m.is_symlink()) and any(dst.iterdir()):
        foreign = foreign_in_output(dst)
        if foreign:
            raise refuse_foreign_output(dst, foreign, "the cache entry")
        log.info("atom-convert cache: %s has no usable %s; removing it before converting again", dst, MANIFEST_NAME)
        shutil.rmtree(dst)


def _stale_because(record: Path, want: dict[str, Any]) -> list[str]:
    """Why the recorded entry is not the one wanted (empty: the record matches)."""
    try:
        have = loads(read_regular(record))
        src = Fingerprint.from_dict({"kind": "source", "parts": have["source_parts"]})
        opts = Fingerprint.from_dict({"kind": "options", "parts": have["options"]})
        stamps = have.get("source_stamps")
        if "source_stamps" in want and not isinstance(stamps, dict):
            raise ValueError("no source_stamps")
    except FileNotFoundError:
        return ["not converted yet"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [f"its record {record.name} is unreadable"]
    why = [f"source {p} changed" for p in src.changed(Fingerprint("source", want["source_parts"]))]
    why += [f"option {p} differs" for p in opts.changed(Fingerprint("options", want["options"]))]
    if not why and "source_stamps" in want:  # rewritten in place: same headers, other bytes maybe
        why += [f"source {n} was modified since it was converted (its size or modification time changed)"
                for n in sorted(set(want["source_stamps"]) | set(stamps or {}))
                if want["source_stamps"].get(n) != (stamps or {}).get(n)]
    return why


def _current(dst: Path, record: Path, want: dict[str, Any]) -> bool:
    return not _stale_because(record, want) and _complete(dst)


@dataclass(frozen=True)
class _Source:
    """Where a source is (a folder, or a Hub repo) and the name its entry's directory starts with;
    found without reading anything (`_locate`). `spec`: the repo, for a Hub source."""

    location: str
    name: str
    spec: RepoSpec | None


def _locate(src: str | os.PathLike[str]) -> _Source:
    path = Path(src)
    spec = None if path.is_dir() else parse_repo_spec(src)
    if spec is not None:
        return _Source(spec.repo_id, spec.repo_id.replace("/", "--"), spec)
    if not path.is_dir():
        raise BadInputError(f"{src}: not a directory nor a Hub repo id (org/name[@revision]); give the checkpoint "
                            "folder (config.json and safetensors files) or a repo id")
    if not (path / "config.json").is_file():
        raise BadInputError(f"{src}: no config.json; this is not a Hugging Face checkpoint folder")
    return _Source(str(path.resolve()), path.resolve().name, None)


def _fingerprint(src: str | os.PathLike[str], where: _Source) -> tuple[Fingerprint, str]:
    """The source's fingerprint, and what `convert` is given for it.

    A Hub repo is content-addressed by its commit (as a resumed conversion from it is): its revision
    is resolved here (configs and headers only; offline, from the local Hugging Face cache, else
    HubOfflineError), and that commit is converted, so that the entry holds what its record says
    even if the branch moves meanwhile."""
    if where.spec is None:
        return source_fingerprint(Path(src)), where.location
    opened = open_source(str(src))
    try:
        commit = (opened.hub or {})["commit"]
    finally:
        opened.close()
    pinned = f"{where.spec.repo_id}@{commit}"
    return Fingerprint("source", {"hub": pinned}), pinned


def _entry(cache_dir: str | os.PathLike[str], where: _Source, options: ConversionOptions) -> Path:
    """The entry's directory: the source's name, target and tp, and a digest of the options'
    fingerprint and of where the source is (two folders or repos of the same name get two entries)."""
    key = hashlib.sha256(f"{options_fingerprint(options).digest}\0{where.location}".encode()).hexdigest()[:12]
    return Path(cache_dir) / f"{where.name}-{options.target}-tp{options.tp}-{key}"


def cache_path(src: str | os.PathLike[str], cache_dir: str | os.PathLike[str], *,
               options: ConversionOptions | None = None, **kw: Any) -> tuple[Path, dict[str, Any]]:
    """The directory `ensure_converted` uses for `options` (or its fields as keywords), and the
    record it expects there: {"source": where it is, "convert_from", "source_digest",
    "source_parts", "options_digest", "options"} (the parts of the two fingerprints, fingerprint.py)."""
    opts = ConversionOptions.build(options, **kw)
    where = _locate(src)
    ofp = options_fingerprint(opts)
    fp, convert_from = _fingerprint(src, where)
    want = {"source": where.location, "convert_from": convert_from, "source_digest": fp.digest,
            "source_parts": dict(fp.parts), "options_digest": ofp.digest, "options": dict(ofp.parts)}
    if where.spec is None:  # a folder: its files' sizes and times too (a Hub source is pinned to a commit)
        want["source_stamps"] = source_stamps(src, fp)
    return _entry(cache_dir, where, opts), want


def _offline_entry(src: str | os.PathLike[str], cache_dir: str | os.PathLike[str], error: HubOfflineError,
                   options: ConversionOptions) -> Path:
    """Offline, with a revision the local Hugging Face cache cannot resolve (its files deleted after
    the conversion, say): the entry converted earlier from that repo with these options, if complete."""
    where = _locate(src)
    dst = _entry(cache_dir, where, options)
    record = dst.with_name(dst.name + RECORD_SUFFIX)
    _check_own(Path(cache_dir), dst, record, dst.with_name(f".{dst.name}{LOCK_SUFFIX}"))
    try:
        have = loads(read_regular(record))
        same = (have["source"] == where.location
                and not Fingerprint("options", have["options"]).changed(options_fingerprint(options)))
        converted = have["source_parts"]["hub"]
    except (OSError, ValueError, KeyError, TypeError):
        same, converted = False, None
    if not (same and _complete(dst)):
        raise error
    log.warning("atom-convert cache: %s cannot be resolved offline (%s); using %s, converted from %s",
                src, error, dst, converted)
    return dst


def _hub_fetch(src: str | os.PathLike[str], repo: str, options: ConversionOptions) -> Fetch:
    """The `fetch` step for a Hub cache: pull `repo` into DST when its content key (hub.py: the
    source's identity without tensor data, and the options that decide the bytes) is this one's."""
    from ..hub.pull import conversion_record, pull_converted

    def fetch(dst: Path, _want: dict[str, Any]) -> bool:
        source = open_source(src)
        try:
            key = conversion_record(source, options)["content_key"]
        finally:
            source.close()
        # the destination's own lock too: an `atom-convert convert` into this entry waits, as for a conversion
        with DestinationLock(DestPaths(Path(os.path.abspath(dst))), wait=True, notify=log.info):
            return pull_converted(repo, key, dst) is not None

    return fetch


def ensure_converted(src: str | os.PathLike[str], cache_dir: str | os.PathLike[str], *, target: str | None = None,
                     tp: int | None = None, shard_size: int | str | None = None, mtp: bool | None = None,
                     mla_bmm: str | None = None, profile: str | None = None, ep: bool | None = None,
                     dp_attention: bool | None = None, shared_experts: str | None = None, mori: bool | None = None,
                     options: ConversionOptions | None = None, fetch: Fetch | None = None,
                     timeout: float | None = None, progress: bool = False, hub_cache: str | None = None,
                     workers: int | None = None, worker_mode: str = "auto",
                     max_memory: int | str | None = None, keep_cached: bool | None = None) -> Path:
    """The converted directory for `src` and these options inside `cache_dir`, converting only when it
    is missing or stale. Safe to call from every rank of a server at once: one converts, the others
    wait and return the same path.

    Args:
        src: the Hugging Face checkpoint folder, or a Hub repo id `org/name[@revision]` (its revision
            resolved to a commit at each call; that commit is what the entry holds, and a new commit
            converts the entry again; offline, the local Hugging Face cache answers).
        cache_dir: where converted directories are kept (created if missing).
        options (or its fields target, tp, shard_size, mtp, mla_bmm, profile, ep, dp_attention,
            shared_experts, mori as keywords): as for `convert`; every field is part of the cache key,
            so a server started with other parallel settings gets its own directory.
        fetch: optional `fetch(dst, record) -> bool`, called under the lock before converting; it may
            place a complete converted directory at `dst` for `record` (source and options
            fingerprints) and return True, or return False to let the source be converted.
        timeout: seconds to wait for another process's conversion (None: as long as it takes).
        hub_cache: a Hub repo of converted shards (`org/name[@revision]`, see `atom-convert upload`):
            when its content key matches this source and these options, it is downloaded and
            checked instead of converting (the `fetch` step; hub.pull_converted).
        progress: a progress bar while converting.
        workers, worker_mode, max_memory: as for `convert`; None (the default here): every usable
            core, half of the available memory (a serving start waits for this conversion, so it uses
            the host). The worker processes are forked from the caller and touch no GPU.
        keep_cached: as for `convert`; None (the default here): the output stays in the page cache
            when it fits in half of the available memory, so the load that follows reads memory, not
            the disk.

    Example:
        >>> dst = atom_convert.ensure_converted("DeepSeek-V3", "/cache/atom", target="gfx950", tp=8)
        >>> atom_convert.load_into(model, dst, rank=rank, device=f"cuda:{rank}")
    """
    opts = ConversionOptions.build(options, target=target, tp=tp, shard_size=shard_size, mtp=mtp, mla_bmm=mla_bmm,
                                   profile=profile, ep=ep, dp_attention=dp_attention, shared_experts=shared_experts,
                                   mori=mori)
    check_path("src", src)
    cache_dir = check_path("cache_dir", cache_dir)
    check_flag("progress", progress)
    if workers is not None:
        check_count("workers", workers)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout >= 0):
        raise BadInputError(f"timeout must be a number of seconds >= 0 (or None: as long as it takes), got {timeout!r}")
    try:
        dst, want = cache_path(src, cache_dir, options=opts)
    except HubOfflineError as e:
        return _offline_entry(src, cache_dir, e, opts)
    record = dst.with_name(dst.name + RECORD_SUFFIX)
    lock = dst.with_name(f".{dst.name}{LOCK_SUFFIX}")
    _check_own(cache_dir, dst, record, lock)
    if _current(dst, record, want):
        return dst
    src = want["convert_from"]  # a Hub repo: pinned to the commit the key was taken from
    if hub_cache is not None and fetch is None:
        fetch = _hub_fetch(src, hub_cache, opts)
    if Path(src).is_dir():  # before anything is created: never a folder inside the source
        rs, rc = Path(src).resolve(), Path(os.path.abspath(cache_dir)).resolve()
        if rc == rs or rs in rc.parents:
            raise BadInputError(f"cache_dir {cache_dir} ({rc}) lies inside the source checkpoint {rs}; give a "
                                "cache_dir outside SRC")
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise BadInputError(f"cache_dir {cache_dir}: cannot be created (a part of the path is a file); give a "
                            "directory for the converted entries") from None
    with FileLock(lock, wait=True if timeout is None else timeout, notify=log.info,
                  busy=lambda who: (f"{lock}: another process is converting this cache entry ({who}); wait longer "
                                    "(timeout=None) or remove the cache entry"),
                  waiting=lambda who: f"waiting for the conversion into {dst} ({who})"):
        why = _stale_because(record, want)
        if not why and _complete(dst):  # converted by the caller we waited for
            return dst
        log.info("atom-convert cache: building %s (%s)", dst,
                 "; ".join(why) if why else "its files are incomplete")
        _check_own(cache_dir, dst, record, lock)  # again, under the lock
        check_replace_target(record, RECORD_EXPECTED)  # before the conversion, not after it
        record.unlink(missing_ok=True)
        _clear_unreplaceable(dst)
        if not (fetch is not None and fetch(dst, want) and _complete(dst)):
            run: dict[str, Any] = dict(options=opts, force=True, progress=progress, workers=workers,
                                       worker_mode=worker_mode, max_memory=max_memory, keep_cached=keep_cached,
                                       notify=log.info)
            try:  # a dead converter's sealed shards are resumed (cache docstring, step 3)
                convert(src, dst, resume="auto", **run)
            except NotResumableError as e:
                log.info("atom-convert cache: %s; starting over", e)
                convert(src, dst, resume="restart", **run)
        # last: the directory counts as current from here on (never written through a symlink)
        replace_file(record, (json.dumps(want, indent=1, sort_keys=True) + "\n").encode(), RECORD_EXPECTED)
    return dst
