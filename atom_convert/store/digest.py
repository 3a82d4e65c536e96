"""File digests of a converted set: XXH3-128 over 64 KiB blocks in what this version writes; the
earlier BLAKE3 over blocks, whole-file BLAKE3 and sha256 still read.

The manifest's `files` list gives every file's size and digest, and the staging journal each
sealed shard's. Both are what verify, a resume, `ensure_converted`, the Hub pull and `upload`
check a file against. The key names the digest:

- `xxh3_blocks` (format_version 5, written now): cut the file into 64 KiB blocks (the last one
  shorter, none for an empty file); a block's leaf is the 16-byte XXH3-128 of its bytes (the
  canonical, big-endian form: `xxhsum -H2` prints it in hex); the digest is the XXH3-128, in hex,
  of the leaves laid end to end in file order. Anyone can recompute it with any XXH3 library (the
  tests do it with the xxhash package's one-shot calls: tests/oracles.py).
- `blake3_blocks` (format_version 4): the same blocks, each leaf the 32-byte BLAKE3 hash, the
  digest the BLAKE3 hash of the leaves in key-derivation mode with the context string
  BLAKE3_CONTEXT below.
- `blake3` (format_version 3): BLAKE3 of the whole file (`b3sum FILE`).
- `sha256` (format_version 1 and 2).

Why blocks: the converter hashes every byte it writes. A whole-file digest must see the file in
order, so one thread per shard read the written bytes back from memory after the workers had
left them, and a rank's last experts were hashed after the last item (the tail). A block's leaf
depends on that block alone: whoever writes a buffer hashes the whole blocks in it at once, while
they are in that core's caches, and the shard's own thread hashes only the blocks that straddle
two buffers (BENCHMARKS.md, sixteenth round, measures both).

Why XXH3: the digest guards against damage (a disk, a copy, a download cut short, a file edited by
hand), not against someone who could also rewrite the manifest beside it, so it need not be a
cryptographic hash; SGLang's pre-sharded checkpoints use XXH3-128 for the same purpose
(docs/field-notes.md). One core takes the XXH3-128 of 64 KiB blocks at about 16 GB/s and their
BLAKE3 at about 4.3 (AVX-512, the 2-core box), and with BLAKE3 the digest was half of a warm
conversion's user time there (BENCHMARKS.md, twenty-seventh round). XXH3 is the xxhash package
(bindings of the reference C library); BLAKE3 the blake3 package, imported only to read sets of
format_version 3 and 4.

What identifies a *source* (config.json, the index: manifest `source.config_sha256`, the content
key) stays sha256: those are small, and the Hub names its LFS objects by sha256.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

WRITTEN = "xxh3_blocks"  # the digest this version writes into manifests and journals
# every digest a manifest or journal entry may carry, by its key, the newest first
READ = ("xxh3_blocks", "blake3_blocks", "blake3", "sha256")
# the digest that manifests of each format_version carry (store/manifest_checks.py)
KEY_OF_VERSION = {1: "sha256", 2: "sha256", 3: "blake3", 4: "blake3_blocks", 5: "xxh3_blocks"}
# how many hex digits each digest has (a manifest's check refuses any other)
HEX_DIGITS = {"xxh3_blocks": 32, "blake3_blocks": 64, "blake3": 64, "sha256": 64}
BLOCK = 64 << 10
BLAKE3_CONTEXT = "atom-convert 2026-12-04 file digest: the BLAKE3 of each 64 KiB block, in order"
CHUNK = 8 << 20


def _b3() -> Any:
    import blake3  # imported on first use: `import atom_convert` stays light

    return blake3


def _xxh() -> Any:
    import xxhash

    return xxhash


@dataclass(frozen=True)
class Blocks:
    """A digest over 64 KiB blocks: how a block's leaf and the file's digest are taken."""

    key: str
    leaf_size: int  # bytes of a block's leaf
    leaf_of: Callable[[], Callable[[Any], bytes]]  # -> the leaf function (its library imported on first use)
    root: Callable[[bytes], str]  # the leaves laid end to end in file order -> the file's digest (hex)

    def leaf(self, block: Any) -> bytes:
        """The leaf of one block (a bytes-like object of at most BLOCK bytes)."""
        return self.leaf_of()(block)


def _blake3_leaf(block: Any) -> bytes:
    return _b3().blake3(block).digest()


XXH3 = Blocks("xxh3_blocks", 16, lambda: _xxh().xxh3_128_digest, lambda leaves: _xxh().xxh3_128_hexdigest(leaves))
BLAKE3 = Blocks("blake3_blocks", 32, lambda: _blake3_leaf,
                lambda leaves: _b3().blake3(leaves, derive_key_context=BLAKE3_CONTEXT).hexdigest())
SCHEMES = {b.key: b for b in (XXH3, BLAKE3)}
SCHEME = SCHEMES[WRITTEN]  # the blocks the writers hash (engine/writer.py)


def leaves_within(data: Any, offset: int, scheme: Blocks = SCHEME) -> tuple[int, bytes]:
    """(first block, leaves) of the whole BLOCK-sized blocks of a file that lie inside `data`,
    which is written at byte `offset` of that file: what a writer hashes while the bytes are in
    its cache. The blocks a buffer only partly covers (and a file's short last block) are left to
    the file's own thread (Leaves.hash_blocks)."""
    mv = memoryview(data).cast("B")
    first = -(-offset // BLOCK)
    at = first * BLOCK - offset
    leaf = scheme.leaf_of()
    out = bytearray()
    while at + BLOCK <= len(mv):
        out += leaf(mv[at:at + BLOCK])
        at += BLOCK
    return first, bytes(out)


class Leaves:
    """The leaves of one file of `size` bytes as they arrive, from any thread and in any order."""

    def __init__(self, size: int, scheme: Blocks = SCHEME):
        self.size = size
        self.scheme = scheme
        self.count = -(-size // BLOCK)
        self._leaves = bytearray(self.count * scheme.leaf_size)
        self._have = bytearray(self.count)
        self._lock = threading.Lock()

    def put(self, first: int, leaves: bytes) -> None:
        size = self.scheme.leaf_size
        n = len(leaves) // size
        if len(leaves) % size or not 0 <= first <= first + n <= self.count:
            raise ValueError(f"leaves of blocks {first}..{first + len(leaves) / size} of a file of {self.count}")
        with self._lock:
            self._leaves[first * size:(first + n) * size] = leaves
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
            self.put(i, self.scheme.leaf(read(*self.block_span(i))))

    def hexdigest(self) -> str:
        with self._lock:
            if self._have.count(0):
                raise ValueError(f"{self._have.count(0)} of {self.count} blocks have no leaf yet")
            return self.scheme.root(bytes(self._leaves))


class _BlocksHasher:
    """A block digest of bytes fed in order (`update`, `hexdigest`), as hashlib's objects go."""

    def __init__(self, scheme: Blocks) -> None:
        self.scheme = scheme
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
            self._leaves += self.scheme.leaf(self._part)
            self._part = bytearray()
        whole = len(mv) // BLOCK * BLOCK
        if whole:
            self._leaves += leaves_within(mv[:whole], 0, self.scheme)[1]
        self._part += mv[whole:]

    def hexdigest(self) -> str:
        return self.scheme.root(bytes(self._leaves) + (self.scheme.leaf(self._part) if self._part else b""))


def _blake3() -> Any:
    return _b3().blake3()


_NEW: dict[str, Callable[[], Any]] = {"xxh3_blocks": lambda: _BlocksHasher(XXH3),
                                      "blake3_blocks": lambda: _BlocksHasher(BLAKE3),
                                      "blake3": _blake3, "sha256": hashlib.sha256}


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
    ('xxh3_blocks 0123abcd..., the manifest says 4567ef01...')."""
    algorithm, expected = entry_digest(meta)
    got = file_digest(path, algorithm)
    if got == expected:
        return None
    return f"{algorithm} {got[:16]}..., the manifest says {expected[:16]}..."
