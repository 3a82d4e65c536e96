"""`ensure_converted`: the converted directory for a source and options, converted at most once.

How it works:
1. Fingerprints, without reading tensor data (fingerprint.py, the same ones a resumed
   conversion checks): the source's (config.json, the index, every safetensors file's size and
   header, the side files and remote-code files copied into DST) and the options' (everything
   that changes the bytes: target, tp, shard size, MTP, MLA operand format, profile, the
   parallel mode, tool version, layout revision). A serving start must not pay a re-hash of 700 GB.
2. The directory is `CACHE/<source name>-<target>-tp<N>-<options digest>`; beside it
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

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

from .convert import DEFAULT_SHARD_SIZE, convert, parse_size
from .errors import BadInputError, NotResumableError
from .fingerprint import Fingerprint, options_fingerprint, source_fingerprint
from .manifest import MANIFEST_NAME
from .staging import FileLock

log = logging.getLogger("atom_convert")

RECORD_SUFFIX = ".cache.json"
LOCK_SUFFIX = ".lock"

Fetch = Callable[[Path, dict[str, Any]], bool]


def _complete(dst: Path) -> bool:
    """The manifest is there and every file it lists has its recorded size (stat only)."""
    try:
        m = json.loads((dst / MANIFEST_NAME).read_text())
        return all((dst / rel).stat().st_size == meta["bytes"] for rel, meta in m["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _stale_because(record: Path, want: dict[str, Any]) -> list[str]:
    """Why the recorded entry is not the one wanted (empty: the record matches)."""
    try:
        have = json.loads(record.read_text())
        src = Fingerprint("source", have["source_parts"])
        opts = Fingerprint("options", have["options"])
    except FileNotFoundError:
        return ["not converted yet"]
    except (OSError, ValueError, KeyError, TypeError):
        return [f"its record {record.name} is unreadable"]
    why = [f"source {p} changed" for p in src.changed(Fingerprint("source", want["source_parts"]))]
    why += [f"option {p} differs" for p in opts.changed(Fingerprint("options", want["options"]))]
    return why


def _current(dst: Path, record: Path, want: dict[str, Any]) -> bool:
    return not _stale_because(record, want) and _complete(dst)


def cache_path(src: str | os.PathLike[str], cache_dir: str | os.PathLike[str], *, target: str = "gfx950", tp: int = 1,
               shard_size: int | str = DEFAULT_SHARD_SIZE, mtp: bool = True, mla_bmm: str = "fp8",
               profile: str = "atom", ep: bool = False, dp_attention: bool = False, shared_experts: str = "fused",
               mori: bool = False) -> tuple[Path, dict[str, Any]]:
    """The directory `ensure_converted` uses for these arguments, and the record it expects there:
    {"source": path, "source_digest", "source_parts", "options_digest", "options"} (the parts of
    the two fingerprints, fingerprint.py)."""
    src = Path(src)
    if not src.is_dir():
        raise BadInputError(f"{src}: not a directory; give the checkpoint folder (config.json and safetensors files)")
    if not (src / "config.json").is_file():
        raise BadInputError(f"{src}: no config.json; this is not a Hugging Face checkpoint folder")
    opts = options_fingerprint(target=target, tp=tp, shard_size=parse_size(shard_size), mtp=mtp, mla_bmm=mla_bmm,
                               profile=profile, ep=ep, dp_attention=dp_attention, shared_experts=shared_experts,
                               mori=mori)
    srcfp = source_fingerprint(src)
    name = f"{src.resolve().name}-{target}-tp{tp}-{opts.digest[:12]}"
    want = {"source": str(src.resolve()), "source_digest": srcfp.digest, "options_digest": opts.digest,
            "options": dict(opts.parts), "source_parts": dict(srcfp.parts)}
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
                     profile: str = "atom", ep: bool = False, dp_attention: bool = False,
                     shared_experts: str = "fused", mori: bool = False, fetch: Fetch | None = None,
                     timeout: float | None = None, progress: bool = False, hub_cache: str | None = None,
                     workers: int | None = None, max_memory: int | str | None = None) -> Path:
    """The converted directory for `src` and these options inside `cache_dir`, converting only when it
    is missing or stale. Safe to call from every rank of a server at once: one converts, the others
    wait and return the same path.

    Args:
        src: the Hugging Face checkpoint folder.
        cache_dir: where converted directories are kept (created if missing).
        target, tp, shard_size, mtp, mla_bmm, profile, ep, dp_attention, shared_experts, mori: as for
            `convert`; each is part of the cache key, so a server started with other parallel
            settings gets its own directory.
        fetch: optional `fetch(dst, record) -> bool`, called under the lock before converting; it may
            place a complete converted directory at `dst` for `record` (source and options
            fingerprints) and return True, or return False to let the source be converted.
        timeout: seconds to wait for another process's conversion (None: as long as it takes).
        hub_cache: a Hub repo of converted shards (`org/name[@revision]`, see `atom-convert upload`):
            when its content key matches this source and these options, it is downloaded and
            checked instead of converting (the `fetch` step; hub.pull_converted).
        progress: a progress bar while converting.
        workers, max_memory: as for `convert`; None (the default here): every usable core, half of
            the available memory (a serving start waits for this conversion, so it uses the host).

    Example:
        >>> dst = atom_convert.ensure_converted("DeepSeek-V3", "/cache/atom", target="gfx950", tp=8)
        >>> atom_convert.load_into(model, dst, rank=rank, device=f"cuda:{rank}")
    """
    layout = dict(target=target, tp=tp, mtp=mtp, mla_bmm=mla_bmm, profile=profile, ep=ep, dp_attention=dp_attention,
                  shared_experts=shared_experts, mori=mori)
    dst, want = cache_path(src, cache_dir, shard_size=shard_size, **layout)  # type: ignore[arg-type]
    record = dst.with_name(dst.name + RECORD_SUFFIX)
    if _current(dst, record, want):
        return dst
    if hub_cache is not None and fetch is None:
        fetch = _hub_fetch(src, hub_cache, **layout)
    dst.parent.mkdir(parents=True, exist_ok=True)
    lock = dst.with_name(f".{dst.name}{LOCK_SUFFIX}")
    with FileLock(lock, wait=True if timeout is None else timeout, notify=log.info,
                  busy=lambda who: (f"{lock}: another process is converting this cache entry ({who}); wait longer "
                                    "(timeout=None) or remove the cache entry"),
                  waiting=lambda who: f"waiting for the conversion into {dst} ({who})"):
        why = _stale_because(record, want)
        if not why and _complete(dst):  # converted by the caller we waited for
            return dst
        log.info("atom-convert cache: building %s (%s)", dst,
                 "; ".join(why) if why else "its files are incomplete")
        record.unlink(missing_ok=True)
        if not (fetch is not None and fetch(dst, want) and _complete(dst)):
            opts: dict[str, Any] = dict(layout, shard_size=shard_size, force=True, progress=progress,
                                        workers=workers, max_memory=max_memory)
            target_ = opts.pop("target")
            try:  # a dead converter's sealed shards are resumed (cache docstring, step 3)
                convert(src, dst, target_, resume="auto", notify=log.info, **opts)
            except NotResumableError as e:
                log.info("atom-convert cache: %s; starting over", e)
                convert(src, dst, target_, resume="restart", notify=log.info, **opts)
        tmp = record.with_name(record.name + ".tmp")
        tmp.write_text(json.dumps(want, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, record)  # last: the directory counts as current from here on
    return dst
