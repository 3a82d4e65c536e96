"""The block digests (store/digest.py: `xxh3_blocks`, written now, and `blake3_blocks`, read) against
their definitions computed with the xxhash and blake3 packages' one-shot calls (tests/oracles.py),
and the pieces the writers use: leaves taken from buffers at any offset, leaves arriving in any
order, the streaming hasher, the older keys."""

from __future__ import annotations

import hashlib
import os
import random
import threading
from pathlib import Path

import blake3
import pytest
import xxhash

from atom_convert.store import digest
from oracles import b3_blocks, xx_blocks

B = digest.BLOCK
# key -> (the definition, from the library's one-shot calls; the leaf of one block, likewise)
SCHEMES = {"xxh3_blocks": (xx_blocks, lambda b: xxhash.xxh3_128(b).digest()),
           "blake3_blocks": (b3_blocks, lambda b: blake3.blake3(b).digest())}


@pytest.mark.parametrize("key", SCHEMES)
@pytest.mark.parametrize("size", [0, 1, B - 1, B, B + 1, 3 * B, 3 * B + 17, 5 * B - 1])
def test_file_digest_is_the_definition(tmp_path: Path, size: int, key: str) -> None:
    data = os.urandom(size)
    p = tmp_path / "f"
    p.write_bytes(data)
    want = SCHEMES[key][0](data)
    assert digest.file_digest(p, key) == want
    assert digest.file_digest(p, key, chunk=B // 3 + 5) == want  # reads that cut blocks anywhere
    if key == digest.WRITTEN:
        assert digest.file_digest(p) == want


def test_xxh3_blocks_differs_from_a_plain_xxh3_of_the_file() -> None:
    data = os.urandom(2 * B + 9)
    assert xx_blocks(data) != xxhash.xxh3_128(data).hexdigest()
    assert xx_blocks(data[:B]) == xxhash.xxh3_128(xxhash.xxh3_128(data[:B]).digest()).hexdigest()


def test_blocks_digest_differs_from_a_plain_blake3_of_the_leaves_or_the_file() -> None:
    data = os.urandom(2 * B + 9)
    leaves = b"".join(blake3.blake3(data[i:i + B]).digest() for i in range(0, len(data), B))
    got = b3_blocks(data)
    assert got != blake3.blake3(leaves).hexdigest() and got != blake3.blake3(data).hexdigest()


@pytest.mark.parametrize("key", SCHEMES)
def test_streaming_hasher_any_cuts(key: str) -> None:
    rng = random.Random(7)
    data = os.urandom(4 * B + 1234)
    want = SCHEMES[key][0](data)
    for _ in range(20):
        h = digest.new(key)
        at = 0
        while at < len(data):
            n = rng.choice([1, 17, B - 1, B, B + 3, rng.randrange(1, 3 * B)])
            h.update(data[at:at + n])
            at += n
        assert h.hexdigest() == want


@pytest.mark.parametrize("offset,n", [(0, 0), (0, B), (0, B - 1), (1, B), (1, 2 * B), (B - 1, B + 2),
                                      (B, 3 * B), (5, 4 * B - 5), (3 * B + 7, 2 * B)])
@pytest.mark.parametrize("key", SCHEMES)
def test_leaves_within_are_the_whole_blocks(offset: int, n: int, key: str) -> None:
    data = os.urandom(offset + n + B)
    first, leaves = digest.leaves_within(memoryview(data)[offset:offset + n], offset, digest.SCHEMES[key])
    whole = [i for i in range(len(data) // B + 1) if i * B >= offset and (i + 1) * B <= offset + n]
    assert first == (whole[0] if whole else -(-offset // B))
    assert leaves == b"".join(SCHEMES[key][1](data[i * B:(i + 1) * B]) for i in whole)


def test_leaves_from_pieces_in_any_order_from_threads() -> None:
    """A file written as random pieces, in a shuffled order, by several threads: the writers' leaves
    plus the blocks no writer covered whole give the definition's digest."""
    rng = random.Random(3)
    size = 9 * B + 333
    data = os.urandom(size)
    cuts = sorted({0, size, *rng.sample(range(1, size), 14)})
    pieces = list(zip(cuts, cuts[1:]))
    rng.shuffle(pieces)
    leaves = digest.Leaves(size)
    sent: list[int] = []

    def write(ps: list[tuple[int, int]]) -> None:
        for a, b in ps:
            first, lv = digest.leaves_within(memoryview(data)[a:b], a)
            if lv:
                leaves.put(first, lv)
                sent.extend(range(first, first + len(lv) // digest.SCHEME.leaf_size))

    ts = [threading.Thread(target=write, args=(pieces[i::3],)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    missing = leaves.missing(0, leaves.count)
    assert sorted(missing + sent) == list(range(leaves.count)) and leaves.count - 1 in missing  # the short last
    with pytest.raises(ValueError, match="have no leaf"):
        leaves.hexdigest()
    leaves.hash_blocks(missing, lambda s, e: data[s:e])
    assert leaves.hexdigest() == xx_blocks(data)


@pytest.mark.parametrize("key", SCHEMES)
def test_leaves_refuse_blocks_outside_the_file(key: str) -> None:
    scheme = digest.SCHEMES[key]
    leaves = digest.Leaves(2 * B, scheme)
    leaves.put(1, bytes(scheme.leaf_size))
    with pytest.raises(ValueError):
        leaves.put(2, bytes(scheme.leaf_size))
    with pytest.raises(ValueError):
        leaves.put(0, bytes(scheme.leaf_size - 1))
    with pytest.raises(ValueError):
        leaves.put(0, bytes(3 * scheme.leaf_size))


@pytest.mark.parametrize("key", SCHEMES)
def test_empty_file_has_no_leaves(key: str) -> None:
    leaves = digest.Leaves(0, digest.SCHEMES[key])
    assert leaves.count == 0 and leaves.hexdigest() == SCHEMES[key][0](b"")


def test_entry_digest_reads_every_key_newest_first(tmp_path: Path) -> None:
    data = os.urandom(B + 5)
    p = tmp_path / "f"
    p.write_bytes(data)
    whole = {"sha256": hashlib.sha256(data).hexdigest(), "blake3": blake3.blake3(data).hexdigest(),
             "blake3_blocks": b3_blocks(data), "xxh3_blocks": xx_blocks(data)}
    for key, hexd in whole.items():
        assert digest.entry_digest({"bytes": 1, key: hexd}) == (key, hexd)
        assert digest.mismatch(p, {"bytes": 1, key: hexd}) is None
        assert digest.mismatch(p, {"bytes": 1, key: "0" * 64}).startswith(f"{key} {hexd[:16]}")
    assert digest.entry_digest({**whole})[0] == "xxh3_blocks"
    assert digest.entry_digest({k: v for k, v in whole.items() if k != "xxh3_blocks"})[0] == "blake3_blocks"
    with pytest.raises(KeyError):
        digest.entry_digest({"bytes": 1})
    assert digest.KEY_OF_VERSION[5] == digest.WRITTEN == "xxh3_blocks"
    assert digest.KEY_OF_VERSION[4] == "blake3_blocks"
