"""The producers' reusable output buffers (buffers.py): a slab is handed out again only once nothing
can see the tensor made over it (torch views, numpy views, the writer's queued piece), and a
conversion that draws every output chunk from the pool writes the same bytes as one that does not."""

from __future__ import annotations

import gc
import os
import random
import threading
from pathlib import Path
from typing import Callable

import pytest
import torch

import atom_convert
from atom_convert.layout import buffers

from test_workers import digest, sources  # noqa: F401  (the module fixture of fresh random checkpoints)


def _fill(t: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t.view(torch.uint8).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),), generator=g,
                                            dtype=torch.uint8).view(t.view(torch.uint8).shape))
    return t.clone()


def test_slab_reused_only_when_every_view_is_gone() -> None:
    pool = buffers.BufferPool(keep_bytes=64 << 20)
    a = pool.empty((512, 4096), torch.float8_e4m3fn)
    want = _fill(a, 1)
    views = [a[3:7], a.view(torch.uint8).reshape(-1)[100:].numpy(), memoryview(a.view(torch.uint8).numpy())]
    del a
    gc.collect()
    for i in range(6):  # while a view lives, every request of that size gets a fresh slab
        b = pool.empty((512, 4096), torch.float8_e4m3fn)
        _fill(b, 10 + i)
        del b
        gc.collect()
    assert pool.made >= 2
    # the kept view still reads the first tensor's bytes
    assert bytes(views[2]) == want.view(torch.uint8).numpy().tobytes()
    assert torch.equal(views[0].view(torch.uint8), want[3:7].view(torch.uint8))
    made = pool.made
    del views
    gc.collect()
    c = pool.empty((512, 4096), torch.float8_e4m3fn)
    assert pool.made == made and pool.reused >= 1  # now served from a free slab
    assert c.shape == (512, 4096) and c.dtype == torch.float8_e4m3fn and c.is_contiguous()
    assert c.data_ptr() % 16 == 0  # int64 / complex128 views of it (the shuffle's 16-byte units)


def test_live_tensors_never_share_memory() -> None:
    """Many tensors of a few sizes alive at random: no two overlap, and none changes under the others."""
    pool = buffers.BufferPool(keep_bytes=16 << 20)
    rng = random.Random(random.SystemRandom().randrange(1 << 30))
    live: list[tuple[torch.Tensor, torch.Tensor]] = []
    for step in range(200):
        if live and rng.random() < 0.45:
            live.pop(rng.randrange(len(live)))
            gc.collect() if step % 17 == 0 else None
            continue
        shape = rng.choice([(256, 4096), (1024, 1024), (3, 1 << 19), (700, 1500)])
        dtype = rng.choice([torch.uint8, torch.bfloat16, torch.float8_e4m3fn])
        t = pool.empty(shape, dtype)
        live.append((t, _fill(t, step)))
        spans = sorted((x.data_ptr(), x.data_ptr() + x.numel() * x.element_size()) for x, _ in live)
        assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:])), "two live tensors overlap"
        for x, ref in live:
            assert torch.equal(x.view(torch.uint8), ref.view(torch.uint8))
    assert pool.reused > 0


def test_free_slabs_bounded_least_recent_size_first() -> None:
    pool = buffers.BufferPool(keep_bytes=8 << 20)
    big = [pool.empty((2 << 20,), torch.uint8) for _ in range(4)]  # 4 x 2 MiB
    del big
    gc.collect()
    assert pool.free_bytes == 8 << 20
    other = [pool.empty((3 << 20,), torch.uint8) for _ in range(2)]  # a new size: fresh slabs
    del other
    gc.collect()
    assert pool.free_bytes <= 8 << 20
    made = pool.made
    again = pool.empty((3 << 20,), torch.uint8)  # the recent size stayed
    assert pool.made == made
    del again
    huge = pool.empty((16 << 20,), torch.uint8)  # larger than the whole bound: never kept
    del huge
    gc.collect()
    assert pool.free_bytes <= 8 << 20


def _mapping_flags(address: int) -> str:
    """The permissions column of /proc/self/maps for the mapping holding `address` ("rw-p": private)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return perms
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
@pytest.mark.parametrize("private", [True, False])
def test_slabs_private_by_default(private: bool) -> None:
    """The pool's slabs are private anonymous memory by default (the kernel may back them with huge
    pages); private=False gives shared anonymous memory, which shows the check tells the two apart."""
    pool = buffers.BufferPool(keep_bytes=64 << 20) if private else buffers.BufferPool(64 << 20, private=False)
    t = pool.empty((4 << 20,), torch.uint8)
    t.fill_(7)
    assert _mapping_flags(t.data_ptr())[3] == ("p" if private else "s")
    assert int(t[12345]) == 7


def test_slab_freed_on_another_thread() -> None:
    """The writer's thread drops the last view: the slab comes back all the same."""
    pool = buffers.BufferPool(keep_bytes=16 << 20)
    t = pool.empty((1 << 21,), torch.uint8)
    box = [t.numpy()]
    del t
    th = threading.Thread(target=box.clear)
    th.start()
    th.join()
    gc.collect()
    made = pool.made
    pool.empty((1 << 21,), torch.uint8)
    assert pool.made == made


def test_module_empty_uses_the_threads_pool_only() -> None:
    pool = buffers.BufferPool(keep_bytes=16 << 20)
    with buffers.using(pool):
        x = buffers.empty((2 << 20,), torch.uint8)
        small = buffers.empty((16,), torch.uint8)  # below MIN_BYTES: torch's allocator
        seen = []
        th = threading.Thread(target=lambda: seen.append(buffers.empty((2 << 20,), torch.uint8)))
        th.start()
        th.join()
        z = buffers.zeros((1 << 20,), torch.int8)
    assert pool.made == 2 and int(z.abs().max()) == 0
    assert small.numel() == 16 and seen[0].numel() == 2 << 20 and x.numel() == 2 << 20
    with buffers.using(pool):
        pass
    buffers.empty((2 << 20,), torch.uint8)  # outside `using`: torch.empty again
    assert pool.made == 2


@pytest.mark.parametrize("fmt,target,tp", [("fp8", "gfx942", 8), ("fp8", "gfx950", 2), ("bf16", "gfx950", 2),
                                           ("mxfp4", "gfx950", 8)])
def test_conversion_from_the_pool_writes_the_same_bytes(sources: Callable[..., Path],  # noqa: F811
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         fmt: str, target: str, tp: int) -> None:
    """Every output chunk drawn from the pool (MIN_BYTES 0, so the tiny checkpoints use it too), with
    several worker threads whose writer threads free the slabs while the producers take them, and
    with worker processes (a pool each; the counts below are the threads' run's)."""
    src = sources(fmt, tp)
    plain = tmp_path / "plain"
    monkeypatch.setattr(buffers, "using", lambda pool: buffers.contextlib.nullcontext())
    atom_convert.convert(src, plain, target=target, tp=tp, workers=1)
    monkeypatch.undo()
    stats: list[buffers.BufferPool] = []
    real_init = buffers.BufferPool.__init__

    def init(self: buffers.BufferPool, keep_bytes: int) -> None:
        real_init(self, keep_bytes)
        stats.append(self)

    monkeypatch.setattr(buffers.BufferPool, "__init__", init)
    monkeypatch.setattr(buffers, "MIN_BYTES", 0)
    pooled = tmp_path / "pooled"
    atom_convert.convert(src, pooled, target=target, tp=tp, workers=3, worker_mode="thread")
    assert digest(pooled) == digest(plain)
    assert sum(p.reused for p in stats) > 0 and sum(p.made for p in stats) > 0
    in_processes = tmp_path / "pooled-processes"
    atom_convert.convert(src, in_processes, target=target, tp=tp, workers=3, worker_mode="process")
    assert digest(in_processes) == digest(plain)
