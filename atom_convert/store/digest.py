"""File digests of a converted set: BLAKE3 in what this version writes, sha256 still read.

The manifest's `files` list gives every file's size and digest, and the staging journal each
sealed shard's. Both are what verify, a resume, `ensure_converted`, the Hub pull and `upload`
check a file against. Since format_version 3 the digest is BLAKE3 (the `blake3` package: the
BLAKE3 team's bindings of the reference Rust crate; `b3sum FILE` prints the same hex), under the
key `blake3`; format_version 1 and 2 manifests carry `sha256`, which is still checked as it is.

Why not sha256: the converter hashes every byte it writes, and sha256 was a third of a warm
conversion's CPU on the device's 16 cores (BENCHMARKS.md, fourteenth round). One core digests a
file in the page cache at 1.5 GB/s with sha256 (SHA-NI) and 5.5 GB/s with BLAKE3 (AVX-512); the
warm conversion went from 4.4-4.6 to 5.6-6.0 GB/s of source there (fifteenth round).

What identifies a *source* (config.json, the index: manifest `source.config_sha256`, the content
key) stays sha256: those are small, and the Hub names its LFS objects by sha256.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable, Mapping

WRITTEN = "blake3"  # the digest this version writes into manifests and journals
# every digest a manifest or journal entry may carry, by its key
READ = ("blake3", "sha256")
CHUNK = 8 << 20


def _blake3() -> Any:
    import blake3  # imported on first use: `import atom_convert` stays light

    return blake3.blake3()


_NEW: dict[str, Callable[[], Any]] = {"blake3": _blake3, "sha256": hashlib.sha256}


def new(algorithm: str = WRITTEN) -> Any:
    """A hashlib-style object (`update`, `hexdigest`) of `algorithm`."""
    return _NEW[algorithm]()


def file_digest(path: str | Path, algorithm: str = WRITTEN, chunk: int = CHUNK) -> str:
    """The hex digest of a whole file, read in `chunk`-byte blocks. Where a path may lead is the
    caller's check (a manifest's file names are confined when it is read: manifest_checks.py)."""
    h = new(algorithm)
    with open(path, "rb", buffering=0) as f:
        buf = memoryview(bytearray(chunk))
        while n := f.readinto(buf):
            h.update(buf[:n])
    return h.hexdigest()


def entry_digest(meta: Mapping[str, Any]) -> tuple[str, str]:
    """(algorithm, hex) of a manifest `files` entry or a journal entry: the first of READ it has.
    KeyError when it has none (the manifest's check refuses such an entry before any reader)."""
    for algorithm in READ:
        if algorithm in meta:
            return algorithm, str(meta[algorithm])
    raise KeyError(f"none of {', '.join(READ)}")


def mismatch(path: str | Path, meta: Mapping[str, Any]) -> str | None:
    """None when the file at `path` has the digest `meta` records; else what differs, for a report
    ('blake3 0123abcd..., the manifest says 4567ef01...')."""
    algorithm, expected = entry_digest(meta)
    got = file_digest(path, algorithm)
    if got == expected:
        return None
    return f"{algorithm} {got[:16]}..., the manifest says {expected[:16]}..."
