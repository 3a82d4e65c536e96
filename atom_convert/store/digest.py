"""File digests of a converted set: BLAKE3 over 64 KiB blocks in what this version writes; the
earlier whole-file BLAKE3 and sha256 still read.

The manifest's `files` list gives every file's size and digest, and the staging journal each
sealed shard's. Both are what verify, a resume, `ensure_converted`, the Hub pull and `upload`
check a file against. The key names the digest:

- `blake3_blocks` (format_version 4, written now): cut the file into 64 KiB blocks (the last one
  shorter, none for an empty file); a block's leaf is the 32-byte BLAKE3 hash of its bytes; the
  digest is the BLAKE3 hash, in key-derivation mode with the context string CONTEXT below, of the
  leaves laid end to end in file order. Anyone can recompute it with any BLAKE3 library (the
  tests do it with the blake3 package's one-shot calls: tests/oracles.py).
- `blake3` (format_version 3): BLAKE3 of the whole file (`b3sum FILE`).
- `sha256` (format_version 1 and 2).

Why blocks: the converter hashes every byte it writes. A whole-file digest must see the file in
order, so one thread per shard read the written bytes back from memory after the workers had
left them, and a rank's last experts were hashed after the last item (the tail). A block's leaf
depends on that block alone: whoever writes a buffer hashes the whole blocks in it at once, while
they are in that core's caches, and the shard's own thread hashes only the blocks that straddle
two buffers (BENCHMARKS.md, sixteenth round, measures both). BLAKE3 itself is the blake3 package
(the BLAKE3 team's bindings of the reference Rust crate), as since format_version 3.

What identifies a *source* (config.json, the index: manifest `source.config_sha256`, the content
key) stays sha256: those are small, and the Hub names its LFS objects by sha256.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

WRITTEN = "blake3_blocks"  # the digest this version writes into manifests and journals
# every digest a manifest or journal entry may carry, by its key, the newest first
READ = ("blake3_blocks", "blake3", "sha256")
# the digest that manifests of each format_version carry (store/manifest_checks.py)
KEY_OF_VERSION = {1: "sha256", 2: "sha256", 3: "blake3", 4: "blake3_blocks"}
BLOCK = 64 << 10
LEAF = 32  # bytes of a block's leaf
CONTEXT = "atom-convert 2026-12-04 file digest: the BLAKE3 of each 64 KiB block, in order"
CHUNK = 8 << 20


def _b3() -> Any:
    import blake3  # imported on first use: `import atom_convert` stays light

    return blake3


def leaf(block: Any) -> bytes:
    """The leaf of one block (a bytes-like object of at most BLOCK bytes)."""
    return _b3().blake3(block).digest()


def root(leaves: bytes) -> str:
    """The file's digest (hex) from its leaves laid end to end in file order."""
    return _b3().blake3(leaves, derive_key_context=CONTEXT).hexdigest()


def leaves_within(data: Any, offset: int) -> tuple[int, bytes]:
    """(first block, leaves) of the whole BLOCK-sized blocks of a file that lie inside `data`,
    which is written at byte `offset` of that file: what a writer hashes while the bytes are in
    its cache. The blocks a buffer only partly covers (and a file's short last block) are left to
    the file's own thread (Leaves.hash_blocks)."""
    mv = memoryview(data).cast("B")
    first = -(-offset // BLOCK)
    at = first * BLOCK - offset
    b3 = _b3().blake3
    out = bytearray()
    while at + BLOCK <= len(mv):
        out += b3(mv[at:at + BLOCK]).digest()
        at += BLOCK
    return first, bytes(out)


class Leaves:
    """The leaves of one file of `size` bytes as they arrive, from any thread and in any order."""

    def __init__(self, size: int):
        self.size = size
        self.count = -(-size // BLOCK)
        self._leaves = bytearray(self.count * LEAF)
        self._have = bytearray(self.count)
        self._lock = threading.Lock()

    def put(self, first: int, leaves: bytes) -> None:
        n = len(leaves) // LEAF
        if len(leaves) % LEAF or not 0 <= first <= first + n <= self.count:
            raise ValueError(f"leaves of blocks {first}..{first + len(leaves) / LEAF} of a file of {self.count}")
        with self._lock:
            self._leaves[first * LEAF:(first + n) * LEAF] = leaves
            self._have[first:first + n] = b"\1" * n

    def missing(self, lo: int, hi: int) -> list[int]:
        """The blocks in [lo, hi) whose leaf has not arrived."""
        with self._lock:
            return [i for i in range(lo, hi) if not self._have[i]]

    def block_span(self, i: int) -> tuple[int, int]:
        """Bytes [start, end) of block i."""
        return i * BLOCK, min((i + 1) * BLOCK, self.size)

    def hash_blocks(self, blocks: list[int], read: Callable[[int, int], Any]) -> None:
        """Take the leaves of `blocks` from their bytes, `read(start, end)` -> a bytes-like object."""
        for i in blocks:
            self.put(i, leaf(read(*self.block_span(i))))

    def hexdigest(self) -> str:
        with self._lock:
            if self._have.count(0):
                raise ValueError(f"{self._have.count(0)} of {self.count} blocks have no leaf yet")
            return root(bytes(self._leaves))


class _BlocksHasher:
    """`blake3_blocks` of bytes fed in order (`update`, `hexdigest`), as hashlib's objects go."""

    def __init__(self) -> None:
        self._leaves = bytearray()
        self._part = bytearray()  # the bytes of the block not yet whole

    def update(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        if self._part:
            take = min(BLOCK - len(self._part), len(mv))
            self._part += mv[:take]
            mv = mv[take:]
            if len(self._part) < BLOCK:
                return
            self._leaves += leaf(self._part)
            self._part = bytearray()
        whole = len(mv) // BLOCK * BLOCK
        if whole:
            self._leaves += leaves_within(mv[:whole], 0)[1]
        self._part += mv[whole:]

    def hexdigest(self) -> str:
        return root(bytes(self._leaves) + (leaf(self._part) if self._part else b""))


def _blake3() -> Any:
    return _b3().blake3()


_NEW: dict[str, Callable[[], Any]] = {"blake3_blocks": _BlocksHasher, "blake3": _blake3, "sha256": hashlib.sha256}


def new(algorithm: str = WRITTEN) -> Any:
    """A hashlib-style object (`update`, `hexdigest`) of `algorithm`."""
    return _NEW[algorithm]()


def file_digests(path: str | Path, algorithms: tuple[str, ...], chunk: int = CHUNK) -> dict[str, str]:
    """The hex digests of a whole file by each of `algorithms`, in one read of `chunk`-byte blocks.
    Where a path may lead is the caller's check (a manifest's file names are confined when it is
    read: manifest_checks.py)."""
    hs = {a: new(a) for a in algorithms}
    with open(path, "rb", buffering=0) as f:
        buf = memoryview(bytearray(chunk))
        while n := f.readinto(buf):
            for h in hs.values():
                h.update(buf[:n])
    return {a: h.hexdigest() for a, h in hs.items()}


def file_digest(path: str | Path, algorithm: str = WRITTEN, chunk: int = CHUNK) -> str:
    """The hex digest of a whole file (file_digests)."""
    return file_digests(path, (algorithm,), chunk)[algorithm]


def entry_digest(meta: Mapping[str, Any]) -> tuple[str, str]:
    """(algorithm, hex) of a manifest `files` entry or a journal entry: the first of READ it has.
    KeyError when it has none (the manifest's check refuses such an entry before any reader)."""
    for algorithm in READ:
        if algorithm in meta:
            return algorithm, str(meta[algorithm])
    raise KeyError(f"none of {', '.join(READ)}")


def mismatch(path: str | Path, meta: Mapping[str, Any]) -> str | None:
    """None when the file at `path` has the digest `meta` records; else what differs, for a report
    ('blake3_blocks 0123abcd..., the manifest says 4567ef01...')."""
    algorithm, expected = entry_digest(meta)
    got = file_digest(path, algorithm)
    if got == expected:
        return None
    return f"{algorithm} {got[:16]}..., the manifest says {expected[:16]}..."
