"""Conversion on several workers (issue 9): the output does not depend on the number of workers, the
shard size's split or the order in which work finishes; the memory budget and the number of
workers bound what is alive; one worker's error stops the others and leaves nothing behind.

The sources: tiny transformers-built checkpoints (bf16, fp8) for tp 1 and 2, and random
full-structure checkpoints (`synth.build_random`, fresh random bytes per seed) of a small
width with 16 heads for tp 8 (the tiny presets have 4 heads) and for the Quark MXFP4 format.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import multiprocessing
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

import atom_convert
from atom_convert.engine import procs
from atom_convert.engine import workers as wk
from atom_convert.engine.planning import make_plan
from atom_convert.errors import AtomConvertError
from atom_convert.files.source import SourceCheckpoint
from atom_convert.synth import build_random, load_preset
from atom_convert.engine.writer import ShardSetWriter

from cliutil import Shared, run_cli

from oracles import xx_blocks
from test_memory import trace_conversion

PRESET = "tiny-deepseek-v3"


def wide_config() -> dict[str, Any]:
    """tiny-deepseek-v3 reshaped so that tp=8 splits every fp8 128-block and MXFP4 group evenly:
    16 heads (2 per rank), hidden 256 (MXFP4 MoE needs a multiple of 256), intermediates 1024."""
    cfg = load_preset(PRESET)
    cfg.update(hidden_size=256, num_attention_heads=16, num_key_value_heads=16, intermediate_size=1024,
               moe_intermediate_size=1024, num_hidden_layers=2)
    cfg.pop("quantization_config", None)
    return cfg


@pytest.fixture(scope="module")
def sources(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[tuple[str, int], Path] = {}
    root = tmp_path_factory.mktemp("parallel-src")

    def get(fmt: str, tp: int) -> Path:
        if tp <= 2 and fmt in ("bf16", "fp8"):
            return tiny_checkpoint(PRESET, fmt)
        key = (fmt, 8)
        if key not in cache:
            seed = random.SystemRandom().randrange(1 << 30)  # fresh bytes on every run
            cache[key] = build_random(wide_config(), root / fmt, fmt=fmt, seed=seed, shard_bytes=2 << 20)
        return cache[key]

    return get


def digest(root: Path) -> dict[str, str]:
    """sha256 of every file; the manifest without its timing."""
    out = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        raw = p.read_bytes()
        if p.name == "atom_manifest.json":
            m = json.loads(raw)
            m.pop("conversion_seconds", None)
            raw = json.dumps(m, sort_keys=True).encode()
        out[p.relative_to(root).as_posix()] = hashlib.sha256(raw).hexdigest()
    return out


CASES = [(fmt, tp) for fmt in ("fp8", "bf16", "mxfp4") for tp in (1, 2, 8)]


@pytest.mark.parametrize("fmt,tp", CASES, ids=[f"{f}-tp{t}" for f, t in CASES])
def test_output_identical_for_any_number_of_workers(sources: Callable[..., Path], tmp_path: Path,
                                                    fmt: str, tp: int) -> None:
    """workers 1, 2 and 4 (processes) and 3 (threads), at the default shard size and at one that
    gives several shards per rank: every file and the manifest (timing aside) identical."""
    src = sources(fmt, tp)
    target = "gfx942" if fmt == "fp8" and tp == 2 else "gfx950"  # fnuz on one case; mxfp4 is gfx950-only
    for shard in ("5GB", "150KB"):
        ref = None
        for workers, mode in ((1, "auto"), (2, "process"), (4, "process"), (3, "thread")):
            dst = tmp_path / f"{shard}-w{workers}"
            atom_convert.convert(src, dst, target=target, tp=tp, workers=workers, worker_mode=mode, shard_size=shard)
            got = digest(dst)
            if ref is None:
                ref = got
                shards = [f for f in got if f.endswith(".safetensors") and not f.startswith("mtp/")]
                assert len(shards) >= tp * (2 if shard == "150KB" else 1), shards
            else:
                assert got == ref, f"workers={workers} ({mode}), shard size {shard}: output differs from workers=1"


def test_large_uncut_items_go_first_and_change_no_byte(sources: Callable[..., Path], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With several workers, the items that cannot be cut and write at least FIRST_ITEM_BYTES are handed
    out first, largest first (lm_head at tp 1 no longer ends the conversion alone); every item still comes
    once, the rest keep load order, and the output is the same as with one worker in load order."""
    src = sources("fp8", 1)
    plan = make_plan(SourceCheckpoint(src), target="gfx950", tp=1)
    size = {g.key: sum(o.nbytes for o in g.outputs) for g in plan.main.groups}
    uncut = sorted(size[g.key] for g in plan.main.groups if not any(o.units for o in g.outputs))
    assert len(uncut) >= 3, size
    monkeypatch.setattr(wk, "FIRST_ITEM_BYTES", 1 << 62)  # none qualifies: load order
    loaded = [(i.group.key, i.part) for i in wk.items(plan.main.groups, 1, workers=2)]
    monkeypatch.setattr(wk, "FIRST_ITEM_BYTES", uncut[-2])  # the two largest uncut groups qualify
    order = [(i.group.key, i.part) for i in wk.items(plan.main.groups, 1, workers=2)]
    assert [(i.group.key, i.part) for i in wk.items(plan.main.groups, 1, workers=1)][0] == loaded[0]  # one worker: as loaded
    assert sorted(order, key=str) == sorted(loaded, key=str)  # the same items, each once
    moved = [k for k, _ in order[:2]]
    assert [size[k] for k in moved] == uncut[:-3:-1] and order[:2] != loaded[:2]
    assert order[2:] == [x for x in loaded if x[0] not in moved]
    ref = tmp_path / "w1"
    atom_convert.convert(src, ref, target="gfx950", tp=1, workers=1)
    for workers, mode in ((2, "process"), (3, "thread")):
        dst = tmp_path / f"w{workers}"
        atom_convert.convert(src, dst, target="gfx950", tp=1, workers=workers, worker_mode=mode)
        assert digest(dst) == digest(ref), f"workers={workers} ({mode})"


@pytest.mark.parametrize("from_map", [True, False], ids=["mapped", "read-back"])
def test_manifest_digest_is_each_files_own(sources: Callable[..., Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch, from_map: bool) -> None:
    """The writers send the leaves of the whole blocks they wrote, and the hashing threads hash the
    others through a mapping of the file (or read back), one block at a time (a window of an odd
    size under one block): every shard's digest in the manifest is xxh3_blocks' definition
    (tests/oracles.py) over the file as written, for workers in processes and in threads."""
    from atom_convert.engine import writer

    convert_mod = importlib.import_module("atom_convert.engine.convert")  # the package attribute is the function

    class Hashing(writer.ShardSetWriter):  # the driver's writer, made with the hashing options
        def __init__(self, *a: Any, **kw: Any):
            super().__init__(*a, **kw, hash_from_map=from_map, hash_read=12345)
            made.append(self)

    made: list[writer.ShardSetWriter] = []
    monkeypatch.setattr(convert_mod, "ShardSetWriter", Hashing)
    src = sources("fp8", 8)
    for workers, mode in ((2, "process"), (3, "thread")):
        dst = tmp_path / f"w{workers}"
        m = atom_convert.convert(src, dst, target="gfx942", tp=8, workers=workers, worker_mode=mode,
                                 shard_size="150KB")
        shards = {k: v for k, v in m["files"].items() if k.endswith(".safetensors")}
        assert len(shards) > 8
        for rel, meta in shards.items():
            assert meta["xxh3_blocks"] == xx_blocks((dst / rel).read_bytes()), (workers, rel)
    shards = [sh for w in made for sh in w._open.values()]
    assert shards and all(sh.hash_from_map is from_map and sh.hash_read == 12345 for sh in shards)


@pytest.mark.parametrize("mode,workers", [("process", 2), ("thread", 2)])
def test_writers_send_the_leaves_of_whole_blocks(sources: Callable[..., Path], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch, mode: str, workers: int) -> None:
    """Whoever writes a buffer takes the leaves of the whole 64 KiB blocks in it (in a worker process
    they travel to the converting process with the range written), so the shards' hashing threads
    hash only the blocks that straddle two buffers: counted here in the converting process, where
    every leaf ends up, most of the blocks arrive from the writers, yet not all (the thread's part
    is exercised too), and the digests are the definition's."""
    from atom_convert.store import digest as digest_mod

    put, by_thread = digest_mod.Leaves.put, digest_mod.Leaves.hash_blocks
    counts = {"put": 0, "thread": 0}
    lock = threading.Lock()

    def counting_put(self: Any, first: int, leaves: bytes) -> None:
        with lock:
            counts["put"] += len(leaves) // self.scheme.leaf_size
        put(self, first, leaves)

    def counting_hash(self: Any, blocks: list[int], read: Any) -> None:
        with lock:
            counts["thread"] += len(blocks)
        by_thread(self, blocks, read)

    monkeypatch.setattr(digest_mod.Leaves, "put", counting_put)
    monkeypatch.setattr(digest_mod.Leaves, "hash_blocks", counting_hash)
    dst = tmp_path / "out"
    m = atom_convert.convert(sources("fp8", 8), dst, target="gfx950", tp=1, workers=workers, worker_mode=mode)
    shards = {k: v for k, v in m["files"].items() if k.endswith(".safetensors")}
    total = sum(-(-v["bytes"] // digest_mod.BLOCK) for v in shards.values())
    sent = counts["put"] - counts["thread"]
    assert counts["put"] == total, counts
    assert total // 2 < sent < total, (sent, counts, total)
    for rel, meta in shards.items():
        assert meta["xxh3_blocks"] == xx_blocks((dst / rel).read_bytes()), rel


@pytest.mark.parametrize("par", [{"ep": True}, {"dp_attention": True, "ep": True}], ids=["ep", "dpa-ep"])
def test_output_identical_for_any_number_of_workers_parallel_modes(sources: Callable[..., Path], tmp_path: Path,
                                                                   par: dict[str, bool]) -> None:
    """Expert parallel and DP-attention (tensors stored once in files every rank shares): the same."""
    src = sources("fp8", 8)
    ref = tmp_path / "w1"
    atom_convert.convert(src, ref, tp=8, workers=1, **par)
    dst = tmp_path / "w4"
    atom_convert.convert(src, dst, tp=8, workers=4, **par)
    assert digest(dst) == digest(ref)


def test_output_identical_for_any_order_of_completion(sources: Callable[..., Path], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Items handed out in a shuffled order, each layer's experts cut into 3 uneven ranges (items
    of their own), and every buffer delayed at random: same bytes."""
    src = sources("fp8", 8)
    ref = tmp_path / "ref"
    atom_convert.convert(src, ref, tp=8, workers=1, shard_size="150KB")
    rng = random.Random(random.SystemRandom().randrange(1 << 30))
    real_items, real_write = wk.items, ShardSetWriter._write

    def shuffled(groups: Any, tp: int, workers: int = 1, parts: int | None = None) -> list[wk.Item]:
        work = real_items(groups, tp, parts=3)
        assert any(i.part is not None and i.part[0] > 0 for i in work)  # the experts really are cut
        rng.shuffle(work)
        return work

    def slow_write(sh: Any, piece: Any) -> None:
        time.sleep(rng.random() * 0.002)
        real_write(sh, piece)

    monkeypatch.setattr(wk, "items", shuffled)
    monkeypatch.setattr(ShardSetWriter, "_write", staticmethod(slow_write))
    for run in range(2):
        dst = tmp_path / f"shuffled-{run}"
        atom_convert.convert(src, dst, tp=8, workers=4, shard_size="150KB")
        assert digest(dst) == digest(ref)


# ------------------------------------------------------------------------------------------------
# memory: alive source tensors bounded by the workers, and by the budget
# ------------------------------------------------------------------------------------------------


def _max_layers_alive(trace: Any) -> int:
    return max(len(r.layers) for r in trace.reads)


def test_alive_layers_bounded_by_workers(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """3 worker threads: at every source read, source tensors of at most 3 decoder layers are alive,
    and at most 3 layers' bytes; each worker holds one (layer, rank) item at a time. (The reads are
    traced in this process: threads; worker processes below.)"""
    src = tiny_checkpoint(PRESET, "fp8")
    trace = trace_conversion(src, tmp_path / "dst", workers=3, worker_mode="thread")
    per_layer = trace.layer_bytes()
    largest = max(b for lay, b in per_layer.items() if lay is not None)
    assert _max_layers_alive(trace) <= 3
    assert trace.peak() <= 3 * largest
    # and the parallelism is real: several layers were in flight at some point
    assert _max_layers_alive(trace) >= 2, "3 workers never held two layers at once"


def test_budget_bounds_the_working_set(tiny_checkpoint: Callable[..., Path], tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget that fits one item: 4 workers then hold one layer at a time, and the reserved
    bytes never pass the budget."""
    src = tiny_checkpoint(PRESET, "fp8")
    budgets: list[wk.Budget] = []
    real = wk.Budget

    def recorded(limit: int, stop: threading.Event) -> wk.Budget:
        b = real(limit, stop)
        budgets.append(b)
        return b

    monkeypatch.setattr(wk, "Budget", recorded)
    plan_items = []
    real_items = wk.items

    def seen(groups: Any, tp: int, workers: int = 1, parts: int | None = None) -> list[wk.Item]:
        work = real_items(groups, tp, workers, parts)
        plan_items.extend(work)
        return work

    monkeypatch.setattr(wk, "items", seen)
    # the largest item's cost: learnt from a first conversion at an unlimited budget
    atom_convert.convert(src, tmp_path / "probe", workers=1)
    one = max(i.cost for i in plan_items)
    budgets.clear()
    trace = trace_conversion(src, tmp_path / "dst", workers=4, max_memory=one, worker_mode="thread")
    assert _max_layers_alive(trace) <= 1
    assert budgets and all(b.peak <= one for b in budgets), [b.peak for b in budgets]


def _in_flight(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the items handed to worker processes and not yet reported done, and their working
    sets (at most at once, and in all)."""
    from atom_convert.engine import procs

    seen = {"now": 0, "max": 0, "items": 0, "cost": 0, "max_cost": 0}
    real = procs.WorkerProcesses.run_items

    def run_items(pool: procs.WorkerProcesses, work: Any, task: Any, *, prepare: Any, finished: Any,
                  **kw: Any) -> None:
        def counted_prepare(item: wk.Item) -> None:
            prepare(item)
            seen["now"] += 1
            seen["items"] += 1
            seen["cost"] += item.cost
            seen["max"] = max(seen["max"], seen["now"])
            seen["max_cost"] = max(seen["max_cost"], seen["cost"])

        def counted_finished(item: wk.Item, result: Any) -> None:
            seen["now"] -= 1
            seen["cost"] -= item.cost
            finished(item, result)

        real(pool, work, task, prepare=counted_prepare, finished=counted_finished, **kw)

    monkeypatch.setattr(procs.WorkerProcesses, "run_items", run_items)
    return seen


def test_worker_processes_hold_one_item_each_within_the_budget(sources: Callable[..., Path], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker processes: at most one item per process in flight, and with a budget that fits the
    largest item, the working sets in flight never more than it (the budget is the parent's: it
    reserves before it hands an item out, and releases when the item is reported done)."""
    src = sources("fp8", 8)
    budgets: list[wk.Budget] = []
    real = wk.Budget

    def recorded(limit: int, stop: Any) -> wk.Budget:
        b = real(limit, stop)
        budgets.append(b)
        return b

    monkeypatch.setattr(wk, "Budget", recorded)
    seen = _in_flight(monkeypatch)
    ref = tmp_path / "ref"
    atom_convert.convert(src, ref, tp=8, workers=1)
    atom_convert.convert(src, tmp_path / "w3", tp=8, workers=3, worker_mode="process")
    assert seen["items"] > 3 and 2 <= seen["max"] <= 3, seen
    one = max(wk.working_set(g.outputs) for g in make_plan(SourceCheckpoint(src), tp=8).main.groups)
    budgets.clear()
    seen.update(now=0, max=0, items=0, cost=0, max_cost=0)
    atom_convert.convert(src, tmp_path / "one", tp=8, workers=3, worker_mode="process", max_memory=one)
    assert seen["items"] > 3 and seen["max_cost"] <= one, (seen, one)
    assert budgets and all(b.peak <= one for b in budgets), [b.peak for b in budgets]
    assert digest(tmp_path / "w3") == digest(ref) == digest(tmp_path / "one")


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_every_ranks_column_slice_of_an_expert_comes_from_one_mapping(sources: Callable[..., Path], tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """Under MoE-TP a rank's slice of down_proj is a column slice, which maps every page of the
    tensor. One item makes every rank's slice of its experts, and each down_proj is viewed once and
    its pages released once (not mapped and released once per rank); the output is the one that
    one-rank items give."""
    import collections
    from atom_convert.files import source as source_mod

    src = sources(fmt, 8)
    views: collections.Counter[str] = collections.Counter()
    drops: collections.Counter[tuple[int, int]] = collections.Counter()
    named: dict[tuple[int, int], str] = {}  # (mapping, first byte) -> the tensor viewed there
    real_view, real_drop = SourceCheckpoint._view, source_mod._MappedFile.drop

    def view(self: SourceCheckpoint, info: Any, lo: int = 0, hi: Any = None) -> Any:
        views[info.name] += 1
        named[(id(self._mapping(info.file)), info.begin + lo)] = info.name
        return real_view(self, info, lo, hi)

    def drop(self: Any, lo: int, hi: int) -> None:
        drops[(id(self), lo)] += 1
        real_drop(self, lo, hi)

    monkeypatch.setattr(SourceCheckpoint, "_view", view)
    monkeypatch.setattr(source_mod._MappedFile, "drop", drop)
    atom_convert.convert(src, tmp_path / "shared", target="gfx950", tp=8, workers=2, worker_mode="thread")
    down = {n: c for n, c in views.items() if ".mlp.experts." in n and "down_proj.weight" in n}
    assert down and set(down.values()) == {1}, sorted(down.items())[:4]
    released = collections.Counter({named[k]: c for k, c in drops.items() if named.get(k) in down})
    assert released == collections.Counter(down)  # released once each, after the last rank's slice
    # the same bytes as items of one rank each (each maps every down_proj once per rank)
    monkeypatch.setattr(wk, "shares_experts", lambda group: False)
    views.clear()
    atom_convert.convert(src, tmp_path / "apart", target="gfx950", tp=8, workers=2, worker_mode="thread")
    assert {views[n] for n in down} == {8}
    assert digest(tmp_path / "apart") == digest(tmp_path / "shared")


@pytest.mark.parametrize("ep", [False, True])
def test_alternate_output_order_flips_the_odd_passes_and_changes_no_byte(sources: Callable[..., Path], tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         ep: bool) -> None:
    """ALTERNATE_OUTPUT_ORDER: the items of every second pass over the ranks make each rank's outputs
    in reverse order (so two items at one rank write different tensors); the files are the same."""
    from atom_convert.engine import convert as convert_mod

    src = sources("fp8", 8)
    seen: list[tuple[Any, ...]] = []
    real = convert_mod._item_outputs

    def record(item: wk.Item, plan: Any, writer: Any) -> Any:
        outs = list(real(item, plan, writer))
        seen.append(((item.group.key, item.part), item.ranks[0], item.reverse, [(o.name, r) for o, _, r, _ in outs]))
        return iter(outs)

    monkeypatch.setattr(convert_mod, "_item_outputs", record)
    opts = dict(target="gfx950", tp=8, ep=ep, workers=3, worker_mode="thread", shard_size="256KB")
    atom_convert.convert(src, tmp_path / "plain", **opts)
    assert seen and not any(rev for _, _, rev, _ in seen)
    plain = {(part, first): outs for part, first, _, outs in seen}
    seen.clear()
    monkeypatch.setattr(wk, "ALTERNATE_OUTPUT_ORDER", True)
    atom_convert.convert(src, tmp_path / "alt", **opts)
    flipped = [(part, first, outs) for part, first, rev, outs in seen if rev]
    assert flipped and len(flipped) < len(seen)
    for part, first, outs in flipped:  # the same outputs, each rank's in reverse order
        ranks = list(dict.fromkeys(r for _, r in outs))
        assert outs == [x for r in ranks for x in reversed([y for y in plain[(part, first)] if y[1] == r])]
    # a pass over the ranks: tp ranges of one item each (MoE-TP), or one range of tp items (EP)
    cut = [(key, part, rev) for (key, part), _, rev, _ in seen if part is not None]
    parts = {key: sorted({p for k, p, _ in cut if k == key}) for key, _, _ in cut}
    passes = [parts[key].index(part) // (1 if ep else 8) for key, part, _ in cut]
    assert max(passes) >= 1, parts
    assert [rev for _, _, rev in cut] == [p % 2 == 1 for p in passes]
    assert digest(tmp_path / "alt") == digest(tmp_path / "plain")


def test_working_set_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    """An expert stack's estimate is one expert's bytes times CHUNKS_PER_WORKER, not the stack."""
    import torch

    from atom_convert.layout.plan import Group, OutTensor

    def noop(rank: int, cache: dict[str, Any]) -> Any:
        return iter(())

    stack = OutTensor("w13", torch.uint8, (257, 4096, 7168), (), noop, chunk_bytes=4096 * 7168)
    small = OutTensor("norm", torch.bfloat16, (7168,), (), noop)
    cost = wk.working_set([stack, small])
    assert cost == wk.CHUNKS_PER_WORKER * 4096 * 7168 + wk._MIN_ITEM
    assert [i.rank for i in wk.items([Group("g", [stack, small])], 3)] == [0, 1, 2]
    # ranges per layer: enough for the workers, and about PART_SOURCE_BYTES of source per range
    monkeypatch.setattr(wk, "ITEMS_PER_WORKER", 2)
    assert wk.parts_per_group(1, 8) == 1 and wk.parts_per_group(16, 8) == 4 and wk.parts_per_group(3, 2) == 3
    assert wk.parts_per_group(16, 8, span=8) == 32  # an item per range: 2 per worker
    assert wk.parts_per_group(1, 8, wk.PART_SOURCE_BYTES) == 8  # 8 ranks' slices of the same experts
    assert wk.parts_per_group(2, 1, 5 * wk.PART_SOURCE_BYTES + 1) == 6
    # cut into ranges: range-major, each range for every rank before the next (workers.items)
    stack.units = 257
    one = [i.part for i in wk.items([Group("g", [stack, small])], 1, workers=1)]  # 7.6 GB of experts, tp=1
    assert len(one) == -(-stack.nbytes // wk.PART_SOURCE_BYTES) == 8
    assert one[0][0] == 0 and one[-1][1] == 257 and all(a[1] == b[0] for a, b in zip(one, one[1:]))
    # every rank reads slices of the same experts: one item per range makes it for every rank, range k
    # starting at rank k (the items running at once write to different shards)
    cut = wk.items([Group("g", [stack, small])], 3, parts=2)
    assert [(i.part, i.ranks) for i in cut] == [((0, 128), [0, 1, 2]), ((128, 257), [1, 2, 0])]
    assert [i.who for i in cut] == ["ranks 0-2", "ranks 0-2"]
    # as many items per layer for the workers as with one rank per item: 2 per worker
    little = OutTensor("w2", torch.uint8, (256, 7168, 256), (), noop, units=256)  # 470 MB per rank
    assert len(wk.items([Group("g", [little, small])], 8, workers=16)) == 2 * 16
    # EP: each rank reads its own experts, one item per (range, rank)
    stack.rank_sources = [("a",), ("b",), ("c",)]
    cut = wk.items([Group("g", [stack, small])], 3, parts=2)
    assert [(i.part, i.ranks) for i in cut] == [((0, 128), [0]), ((0, 128), [1]), ((0, 128), [2]),
                                                      ((128, 257), [0]), ((128, 257), [1]), ((128, 257), [2])]


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------


class Boom(RuntimeError):
    pass


def _nothing_left(dst: Path) -> None:
    assert not dst.exists(), f"{dst} was created by a failed conversion"
    left = [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")]
    assert left == [], f"temporary directories left beside {dst}: {left}"


@pytest.mark.parametrize("mode", ["process", "thread"])
@pytest.mark.parametrize("workers", [2, 4])
def test_error_in_one_worker_stops_the_others(sources: Callable[..., Path], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch, workers: int, mode: str) -> None:
    """Every tensor write is slowed to 20 ms; the 12th raises. The others stop at their next
    write (at most one more call per other worker), the error reaches the caller, nothing is left.
    The counts live in shared memory: worker processes inherit the patch and count there too."""
    src = sources("fp8", 8)
    real = ShardSetWriter.write
    lock = multiprocessing.Lock()
    n, failed, after, completed_after = Shared(), Shared(), Shared(), Shared()

    def write(self: ShardSetWriter, rank: int, out: Any, chunks: Any, part: Any = None) -> None:
        with lock:
            k = n.add()
            if failed.value:
                after.add()
            if k == 12:
                failed.set(1)
        if k == 12:
            raise Boom("worker failed")
        time.sleep(0.02)
        real(self, rank, out, chunks, part)
        with lock:
            if failed.value:
                completed_after.add()

    monkeypatch.setattr(ShardSetWriter, "write", write)
    dst = tmp_path / "dst"
    with pytest.raises(Boom):
        atom_convert.convert(src, dst, tp=8, workers=workers, worker_mode=mode)
    assert failed.value == 1
    assert after.value <= workers - 1, (after.value, n.value)
    # a write already past its start when the error came may finish; none after it starts
    assert completed_after.value <= workers - 1, (completed_after.value, n.value)
    _nothing_left(dst)


def test_a_killed_worker_process_is_an_error_naming_it(sources: Callable[..., Path], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker process killed mid-item (as the OOM killer does): the conversion fails naming the
    process and its exit status, the other processes are stopped, nothing is left."""
    src = sources("fp8", 8)
    parent = os.getpid()
    real = ShardSetWriter.write
    calls = Shared()

    def write(self: ShardSetWriter, rank: int, out: Any, chunks: Any, part: Any = None) -> None:
        if os.getpid() != parent and calls.add() == 7:
            os.kill(os.getpid(), signal.SIGKILL)
        real(self, rank, out, chunks, part)

    monkeypatch.setattr(ShardSetWriter, "write", write)
    dst = tmp_path / "dst"
    with pytest.raises(procs.WorkerDied, match=r"worker process \d+ ended with exit status -9 while converting "
                                                r"[\w.]+ \(rank \d\); if the system killed it for memory"):
        atom_convert.convert(src, dst, tp=8, workers=3, worker_mode="process")
    _nothing_left(dst)
    assert multiprocessing.active_children() == []


def test_worker_processes_that_do_not_start_fall_back_to_threads(sources: Callable[..., Path], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A worker process stuck before "ready" (a lock that another thread held across the fork): it
    is killed after the start timeout, the conversion runs on threads, says so, same bytes."""
    src = sources("fp8", 8)
    ref = tmp_path / "ref"
    atom_convert.convert(src, ref, tp=8, workers=1)
    monkeypatch.setattr(procs, "START_TIMEOUT_S", 1.0)
    monkeypatch.setattr(SourceCheckpoint, "after_fork", lambda self: time.sleep(60))
    dst = tmp_path / "dst"
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="atom_convert"):
        atom_convert.convert(src, dst, tp=8, workers=2, worker_mode="process")
    assert time.monotonic() - t0 < 30
    assert "did not start within 1 s" in caplog.text and "converting on 2 threads instead" in caplog.text
    assert digest(dst) == digest(ref)
    assert multiprocessing.active_children() == []


def test_errors_cross_the_process_boundary_as_raised() -> None:
    """A worker process's error reaches the caller with its type, message and attributes."""
    import errno
    import pickle

    from atom_convert.errors import CheckpointError, ConfigError

    for e in (CheckpointError(["a.safetensors: truncated", "b.safetensors: missing"], hint="Re-download."),
              ConfigError("config.json: hidden_size is a string"), Boom("plain")):
        back = pickle.loads(procs._portable(e))
        assert type(back) is type(e) and str(back) == str(e) and back.__dict__ == e.__dict__
    full = OSError(errno.ENOSPC, "No space left on device", "/x/model.safetensors.partial")
    back = pickle.loads(procs._portable(full))
    assert (back.errno, back.strerror, back.filename) == (full.errno, full.strerror, full.filename)

    class Local(Exception):  # not importable by name: cannot be pickled
        pass

    back = pickle.loads(procs._portable(Local("odd")))
    assert type(back) is AtomConvertError and str(back) == "Local: odd"


def test_cli_workers_and_max_memory(tiny_checkpoint: Callable[..., Path], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    src = tiny_checkpoint(PRESET, "fp8")
    code, out, err = run_cli(["convert", src, tmp_path / "a", "--tp", "2", "--workers", "3", "--max-memory", "2GB"], capsys)
    assert code == 0, out + err
    ref = tmp_path / "b"
    atom_convert.convert(src, ref, tp=2, workers=1)
    assert digest(tmp_path / "a") == digest(ref)
    code, out, err = run_cli(["convert", src, tmp_path / "c", "--workers", "0"], capsys)
    assert code == 2 and "--workers" in err, out + err
    code, out, err = run_cli(["convert", src, tmp_path / "d", "--max-memory", "lots"], capsys)
    assert code == 2 and "cannot read size" in err, out + err
    _nothing_left(tmp_path / "d")


def test_inflight_counts_the_threads_at_work_until_they_leave() -> None:
    """The count that replaces Thread.is_alive after Ctrl-C (inflight.py): threads inside are
    waited for, the wait is bounded, and a thread beginning after the stop is refused."""
    import threading
    import time

    from atom_convert.inflight import InFlight

    pool, go = InFlight(), threading.Event()

    def work() -> None:
        if pool.enter():
            try:
                go.wait(10)
            finally:
                pool.leave()

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    end = time.monotonic() + 5
    while pool._inside < 3 and time.monotonic() < end:
        time.sleep(0.01)
    t0 = time.monotonic()
    assert pool.stop_and_wait(0.3) == 3  # all still inside: the wait ends at its bound
    assert 0.25 < time.monotonic() - t0 < 5
    assert not pool.enter()  # begins after the stop: refused
    go.set()
    assert pool.stop_and_wait(10) == 0
    for t in threads:
        t.join()
