"""`load_into` against module trees written from the spec (tests/atom_trees.py), per the loader
contract of ../shared/spec/atom-loading.md §10 (items that need no ATOM: 1, 4-8, 10, 12, 14).

Oracles: the module trees come from the layout spec, not from a manifest; bytes are compared with
what the safetensors library itself reads from the files; the forward through the loader is judged
by `verify` against transformers' model of the source."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import atom_convert
import atom_trees as T
from atom_convert.serve.load import LoadMismatchError, LoadedRank, ManifestMismatchError, rank_view
from atom_convert.check.reference import ConvertedModel
from atom_convert.check.verify import verify
from conftest import FORMATS, PRESETS, TARGETS

CASES = [(p, f, t) for p in PRESETS for f in FORMATS for t in TARGETS]


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _file_bytes(d: Path, rank: int) -> dict[str, torch.Tensor]:
    """Every tensor of the rank, read by safetensors itself, as bytes."""
    m = json.loads((d / "atom_manifest.json").read_text())
    out = {}
    for name, e in m["tensors"].items():
        with safe_open(str(d / e["rank_files"][rank]), framework="pt", device="cpu") as h:
            out[name] = _bytes(h.get_tensor(name))
    return out


def _live(model: nn.Module, name: str) -> torch.Tensor:
    mod, _, attr = name.rpartition(".")
    m = model.get_submodule(mod)
    return m._parameters[attr] if attr in m._parameters else getattr(m, attr)


@pytest.mark.parametrize("preset,fmt,target", CASES, ids=["-".join(c) for c in CASES])
def test_spec_tree_filled_exactly(converted, preset, fmt, target):
    """Items 4-8 and 10 on every preset, format and target, both ranks of tp=2, meta-built trees."""
    d = converted(preset, fmt, target, tp=2)
    cfg = _config(d)
    T.PWALCounter.calls = 0
    for rank in range(2):
        model = T.build(cfg, tp=2, fmt=fmt, target=target, meta=True)
        spec_params = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters(remove_duplicate=False)}
        stats = atom_convert.load_into(model, d, rank=rank, target=target, parallel={"tp": 2})
        files = _file_bytes(d, rank)
        # item 4: every live Parameter filled (none left on meta), with the spec's shape and dtype (item 5)
        for n, p in model.named_parameters(remove_duplicate=False):
            assert p.device.type == "cpu", n
            assert (tuple(p.shape), p.dtype) == spec_params[n], n
        # item 5: the very bytes of the file, reinterpreted (fp8 stays fp8 of the target's kind)
        for n, raw in files.items():
            assert torch.equal(_bytes(_live(model, n)), raw), n
        fp8 = T.FP8[target]
        if fmt == "fp8":
            assert model.model.layers[0].self_attn.kv_b_proj.weight.dtype == fp8
        # item 6: is_shuffled exactly where the spec says PWAL shuffles
        for n, p in model.named_parameters(remove_duplicate=False):
            assert getattr(p, "is_shuffled", False) == T.shuffled_by_spec(n, fmt), n
        assert getattr(model.model.layers[-1].mlp.experts.w13_weight, "is_shuffled", False)
        if fmt == "fp8":
            assert model.model.layers[0].self_attn.kv_b_proj.weight.is_shuffled
        # item 7: one Parameter object under both names (the meta build had split them)
        for i, layer in enumerate(model.model.layers):
            if hasattr(layer.mlp, "gate") and "e_score_correction_bias" in layer.mlp.gate._parameters:
                assert layer.mlp.experts.e_score_correction_bias is layer.mlp.gate.e_score_correction_bias, i
        # item 8: the MLA operands on the native owner, W_K [Nr, L, P], W_V [Nr, V, L], 0-dim fp32 scales
        nr = cfg["num_attention_heads"] // 2
        for layer in model.model.layers:
            impl = layer.self_attn.mla_attn.impl
            assert tuple(impl.W_K.shape) == (nr, cfg["kv_lora_rank"], cfg["qk_nope_head_dim"])
            assert tuple(impl.W_V.shape) == (nr, cfg["v_head_dim"], cfg["kv_lora_rank"])
            assert impl.W_K_scale.dim() == 0 and impl.W_K_scale.dtype == torch.float32
            assert impl.W_V_scale.dim() == 0 and impl.W_V_scale.dtype == torch.float32
            assert not isinstance(impl.W_K, nn.Parameter)
        assert stats.bytes == sum(t.numel() for t in files.values())
        assert stats.tensors == len(files)
    # item 10: no process_weights_after_loading ran, neither a module's nor a quant_method's
    assert T.PWALCounter.calls == 0


def test_cpu_load_maps_without_copying(converted):
    """Tensors at a 16-byte aligned file offset are views of one copy-on-write mapping of their file;
    only the others are copied (their count is what `copied_bytes` reports)."""
    d = converted("tiny-deepseek-v3", "fp8", "gfx950", tp=2)
    model = T.build(_config(d), tp=2, meta=True)
    stats = atom_convert.load_into(model, d, rank=1)
    m = json.loads((d / "atom_manifest.json").read_text())
    f = d / m["tensors"]["lm_head.weight"]["rank_files"][1]
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = {k: v for k, v in json.loads(raw[8:8 + n]).items() if k != "__metadata__"}
    aligned = [k for k, v in header.items() if (8 + n + v["data_offsets"][0]) % 16 == 0]
    unaligned = [k for k in header if k not in aligned]
    assert aligned and unaligned
    ptrs = {_live(model, k).untyped_storage().data_ptr() for k in aligned}
    assert len(ptrs) == 1  # one mapping
    assert all(_live(model, k).untyped_storage().data_ptr() not in ptrs for k in unaligned)
    assert stats.copied_bytes == sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
                                     if k in unaligned)
    t = _live(model, aligned[-1])
    t.data.reshape(-1).view(torch.uint8)[0] ^= 0xFF  # copy-on-write: the file is untouched
    assert f.read_bytes() == raw


def test_mtp_drafter(converted):
    """Item 14: the drafter's own set into its own tree; MLA operands on mtp_block's owner."""
    d = converted("tiny-deepseek-v3", "fp8", "gfx942", tp=2)
    cfg = _config(d)
    n = cfg["num_hidden_layers"]
    drafter = T.build_mtp(cfg, tp=2, target="gfx942")
    atom_convert.load_into(drafter, d / "mtp", rank=0, target="gfx942")
    files = _file_bytes(d / "mtp", 0)
    for name, raw in files.items():
        assert torch.equal(_bytes(_live(drafter, name)), raw), name
    blk = drafter.model.layers.get_submodule(str(n)).mtp_block
    assert blk.self_attn.mla_attn.impl.W_K.dtype == torch.float8_e4m3fnuz
    assert blk.mlp.experts.e_score_correction_bias is blk.mlp.gate.e_score_correction_bias
    assert blk.self_attn.kv_b_proj.weight.is_shuffled


def test_existing_parameters_are_replaced_and_marked(converted):
    """A model built with real (random) CPU Parameters: every one ends up holding the file's bytes."""
    d = converted("tiny-kimi-k2", "fp8", "gfx950", tp=1)
    model = T.build(_config(d), tp=1, meta=False)
    atom_convert.load_into(model, d, rank=0)
    for name, raw in _file_bytes(d, 0).items():
        assert torch.equal(_bytes(_live(model, name)), raw), name


def test_requires_grad_of_the_live_parameters_kept(converted):
    """A replaced Parameter keeps the live one's requires_grad, as ATOM's loader does (it copies into the
    live object; vLLM's vision tower keeps requires_grad=True on its nn.Conv2d weights): float ones
    marked True stay True, the rest stay False, and the bytes are the file's."""
    d = converted("tiny-deepseek-v3", "fp8", "gfx950", tp=1)
    model = T.build(_config(d), tp=1, meta=True)
    aliased = {n for pair in rank_view(d, 0).aliases.items() for n in pair}  # one object under two names
    floats = [n for n, p in model.named_parameters() if p.dtype == torch.bfloat16 and n not in aliased]
    marked = set(floats[::2])
    assert marked and len(marked) < len(floats)
    for n, p in model.named_parameters():
        p.requires_grad_(n in marked)
    atom_convert.load_into(model, d, rank=0)
    live = dict(model.named_parameters())
    assert {n for n, p in live.items() if p.requires_grad and n not in aliased} == marked
    for name, raw in _file_bytes(d, 0).items():
        assert torch.equal(_bytes(_live(model, name)), raw), name


def test_every_mismatch_reported_at_once(converted):
    """Item 4: a missing live parameter, an unexpected manifest tensor and a wrong dtype, one error."""
    d = converted("tiny-deepseek-v3", "fp8", "gfx950", tp=2)
    model = T.build(_config(d), tp=2, meta=True)
    layer = model.model.layers[0]
    del layer.self_attn.o_proj._parameters["weight_scale"]  # manifest tensor with no live place
    layer.self_attn.register_parameter("extra", nn.Parameter(torch.empty(3, device="meta"), requires_grad=False))
    layer.mlp.down_proj._parameters["weight"] = nn.Parameter(
        torch.empty(layer.mlp.down_proj.weight.shape, dtype=torch.bfloat16, device="meta"), requires_grad=False)
    with pytest.raises(LoadMismatchError) as ei:
        atom_convert.load_into(model, d, rank=0)
    msg = str(ei.value)
    assert "3 problem(s)" in msg
    assert "unexpected: model.layers.0.self_attn.o_proj.weight_scale" in msg
    assert "missing: live Parameter model.layers.0.self_attn.extra" in msg
    assert "wrong shape or dtype: model.layers.0.mlp.down_proj.weight" in msg and "torch.bfloat16" in msg
    assert ei.value.exit_code == 2


def test_tree_for_another_tp_refused(converted):
    d = converted("tiny-deepseek-v3", "bf16", "gfx950", tp=2)
    model = T.build(_config(d), tp=1, fmt="bf16", meta=True)
    with pytest.raises(LoadMismatchError, match="wrong shape or dtype: model.embed_tokens.weight"):
        atom_convert.load_into(model, d, rank=0)


@pytest.mark.parametrize("declared,field", [
    ({"target": "gfx942"}, "target: the manifest says 'gfx950', declared 'gfx942'"),
    ({"parallel": {"tp": 4}}, "tp: the manifest says 2, declared 4"),
    ({"parallel": {"ep": 2}}, "ep: the manifest says 1, declared 2"),
    ({"atom_revision": "0123456789"}, "atom_revision: the manifest says 'ffdf3bb5d', declared '0123456789'"),
])
def test_manifest_mismatch_refused(converted, declared, field):
    """Item 1: each differing field named; nothing is loaded."""
    d = converted("tiny-deepseek-v3", "fp8", "gfx950", tp=2)
    model = T.build(_config(d), tp=2, meta=True)
    with pytest.raises(ManifestMismatchError) as ei:
        atom_convert.load_into(model, d, rank=0, **declared)
    assert field in str(ei.value)
    assert model.model.embed_tokens.weight.device.type == "meta"


def test_flag_mismatches_all_named(converted):
    d = converted("tiny-deepseek-v3", "fp8", "gfx950", tp=2)
    flags = dict(rank_view(d, 0).flags)
    atom_convert.load_into(T.build(_config(d), tp=2), d, rank=0, flags=flags)  # the recorded flags pass
    flags["ATOM_FUSE_SHARED_EXPERT"] = 0
    flags["ATOM_FP8_BLOCKSCALE_WEIGHT_PRESHUFFLE"] = 0
    with pytest.raises(ManifestMismatchError) as ei:
        atom_convert.load_into(T.build(_config(d), tp=2), d, rank=0, flags=flags, target="gfx942")
    msg = str(ei.value)
    assert "3 difference(s)" in msg
    assert "flag ATOM_FUSE_SHARED_EXPERT: the manifest says 1, declared 0" in msg
    assert "flag ATOM_FP8_BLOCKSCALE_WEIGHT_PRESHUFFLE" in msg and "target" in msg


def test_truncated_shard_named(converted, tmp_path):
    src = converted("tiny-deepseek-v2-lite", "bf16", "gfx950")
    d = tmp_path / "c"
    shutil.copytree(src, d)
    f = sorted(d.glob("*.safetensors"))[0]
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 100)
    with pytest.raises(atom_convert.BadInputError, match=f"{f.name}.*truncated"):
        atom_convert.load_into(T.build(_config(d), fmt="bf16"), d, rank=0)


def test_reference_forward_through_the_loader(converted, tiny_checkpoint):
    """The reference forward over spec trees filled by load_into equals the one over the files, and
    verify through the loader passes against transformers' model of the source."""
    d = converted("tiny-deepseek-v2", "fp8", "gfx942", tp=2)
    cfg = _config(d)
    ranks = []
    for r in range(2):
        model = T.build(cfg, tp=2, fmt="fp8", target="gfx942")
        atom_convert.load_into(model, d, rank=r)
        ranks.append(LoadedRank(model, d, r))
    ids = torch.randint(0, cfg["vocab_size"], (6,), generator=torch.Generator().manual_seed(3))
    assert torch.equal(ConvertedModel(d, ranks=ranks).forward(ids), ConvertedModel(d).forward(ids))
    r = verify(d, tiny_checkpoint("tiny-deepseek-v2", "fp8"), tokens=6, through_loader=True)
    assert r.ok, r.failures


@pytest.mark.parametrize("total,chunk,threads", [(2 << 30, 32 << 20, 16), (100 << 20, 32 << 20, 16),
                                                 (3 << 30, 16 << 20, 8), (1 << 20, 32 << 20, 16)])
def test_ramp_sizes(total, chunk, threads):
    """Cutting `total` bytes with transfer._ramp_size: whole pages, at most `chunk`, the smallest chunks
    at both ends, growing from the start and shrinking towards the end, the full chunk in between
    when the load is long enough, every byte cut once."""
    from atom_convert.serve import transfer

    sizes, done = [], 0
    while done < total:
        n = min(transfer._ramp_size(done, total, chunk, threads), total - done)
        sizes.append(n)
        done += n
    assert sum(sizes) == total
    assert all(n % transfer.PAGE == 0 and 0 < n <= chunk for n in sizes[:-1])
    top = sizes.index(max(sizes))
    assert sizes[:top + 1] == sorted(sizes[:top + 1]) and sizes[top:] == sorted(sizes[top:], reverse=True)
    assert sizes[0] == min(chunk, transfer.RAMP_MIN_BYTES, total)
    if total >= 64 * chunk:
        assert max(sizes) == chunk and sizes.count(chunk) * chunk > total // 2
        assert sizes[-1] <= transfer.RAMP_MIN_BYTES


class _FakeCuda:
    """Stand-ins for the CUDA stream/event calls of transfer.place_cuda, so that its chunking (pieces
    of many tensors per chunk, tensors spanning chunks, several files and threads) runs on a CPU."""

    class Stream:
        cuda_stream = 0

        def __init__(self, *a):
            pass

        def synchronize(self):
            pass

    class Event:
        def record(self, stream):
            pass

        def synchronize(self):
            pass

    @staticmethod
    def device(d):
        import contextlib

        return contextlib.nullcontext()

    stream = device


class _HostRuntime:
    """Stand-in for serve/runtime_calls.RuntimeCalls on a CPU: a copy is a memmove between the two
    addresses (so pointer arithmetic errors show as wrong bytes), events are counted."""

    def __init__(self):
        self.made = self.freed = self.copies = 0

    def copy_to_device(self, dst, src, n, stream):
        import ctypes

        assert n > 0 and stream == 0
        ctypes.memmove(dst, src, n)
        self.copies += 1

    def new_event(self, blocking=False):
        self.made += 1
        return self.made

    def record(self, event, stream):
        assert 0 < event <= self.made

    def wait(self, event):
        assert 0 < event <= self.made

    def free_event(self, event):
        self.freed += 1


@pytest.mark.parametrize("threads,chunk,reader,cold,depth,submit", [
    (1, 4096, "pread", False, 2, "torch"), (3, 5000, "pread", False, 2, "torch"), (4, 1 << 20, "pread", False, 2, "torch"),
    (3, 8192, "mmap", False, 2, "torch"), (3, 8192, "pread", True, 2, "torch"), (2, 1 << 20, "pread", True, 2, "torch"),
    (3, 5000, "pread", False, 1, "torch"), (2, 4096, "pread", False, 5, "torch"),
    (3, 5000, "pread", False, 2, "runtime"), (2, 4096, "pread", False, 3, "runtime"), (3, 8192, "mmap", False, 2, "runtime"),
    (2, 8192, "pread", True, 2, "runtime"), (3, 1 << 16, "pread", False, 2, "torch"), (2, 1 << 16, "pread", True, 2, "runtime")])
def test_chunked_pipeline_places_every_byte(converted, monkeypatch, threads, chunk, reader, cold, depth, submit):
    """The GPU path's chunk arithmetic, run on a CPU with the CUDA calls stubbed: every tensor byte-equal
    to safetensors' read, including tensors cut across chunk borders (chunk sizes not aligned). Cold:
    page-aligned buffers and the files dropped from the page cache, so chunks come by O_DIRECT. Depth:
    pinned buffers per thread (ATOM_CONVERT_LOAD_DEPTH); each thread's buffers are distinct ones.
    Submit "runtime": the copies are enqueued as raw addresses (serve/runtime_calls.py), here memmoves.
    The ramp is on (ATOM_CONVERT_LOAD_RAMP=1) and its smallest chunk one page, so chunks above it grow
    and shrink at the ends."""
    import mmap
    import os

    from atom_convert.serve import transfer
    from atom_convert.serve.transfer import FileRead, TensorSlot, read_header

    d = converted("tiny-deepseek-v3", "fp8", "gfx950", tp=2)
    monkeypatch.setattr(transfer.torch, "cuda", _FakeCuda)
    monkeypatch.setattr(transfer, "RAMP", True)
    monkeypatch.setattr(transfer, "RAMP_MIN_BYTES", 4096)
    if cold:
        monkeypatch.setattr(transfer, "_pinned_buffer",
                            lambda index, size: torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8))
        for f in d.glob("*.safetensors"):
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        seen: list[str] = []
        real_read = transfer._read_chunk
        monkeypatch.setattr(transfer, "_read_chunk", lambda *a: seen.append(real_read(*a)) or seen[-1])
    else:
        monkeypatch.setattr(transfer, "_pinned_buffer", lambda index, size: handed.append(
            (threading.get_ident(), index)) or torch.empty(size, dtype=torch.uint8))
    handed: list[tuple[int, int]] = []
    monkeypatch.setenv("ATOM_CONVERT_LOAD_DEPTH", str(depth))
    monkeypatch.setenv("ATOM_CONVERT_LOAD_SUBMIT", submit)
    host_rt = _HostRuntime()
    monkeypatch.setattr(transfer.runtime_calls, "calls", lambda: host_rt)
    view = rank_view(d, 1)
    slots = {n: TensorSlot(n, r.dtype, r.shape) for n, r in view.tensors.items()}
    by_file: dict[str, list] = {}
    for n, r in view.tensors.items():
        by_file.setdefault(r.file, []).append(slots[n])
    reads = [FileRead(d / f, read_header(d / f), ss) for f, ss in by_file.items()]
    transfer._place_cuda(reads, torch.device("cpu"), threads=threads, chunk_bytes=chunk, reader=reader)
    if cold and transfer._open_direct(d / "atom_manifest.json") is not None and transfer._mincore() is not None:
        assert "direct" in seen, seen
    if handed:  # thread w's k-th chunk goes through buffer w * depth + k % depth: no buffer is two threads'
        owner: dict[int, int] = {}
        for thread, index in handed:
            assert owner.setdefault(index, thread) == thread and 0 <= index < threads * depth, handed
        per_thread = {t: {i for u, i in handed if u == t} for t, _ in handed}
        assert all(len(b) == min(depth, sum(u == t for u, _ in handed)) for t, b in per_thread.items()), handed
    files = _file_bytes(d, 1)
    for n, s in slots.items():
        assert torch.equal(_bytes(s.tensor), files[n]), n
    if submit == "runtime":  # every copy went through the runtime calls, every event was given back
        assert host_rt.copies >= len(slots) and host_rt.made == host_rt.freed == depth * min(threads, host_rt.copies)
    else:
        assert host_rt.copies == host_rt.made == 0


@pytest.mark.parametrize("to", ["caller", "other"], ids=["signal-to-the-caller", "signal-to-another-thread"])
def test_ctrl_c_during_the_copy_waits_for_the_threads_before_closing_the_files(converted, monkeypatch, to):
    """Ctrl-C lands on the caller while a copy thread is inside a read: the caller stops the threads,
    waits for the chunk in hand, and only then closes the files (a closed descriptor's number goes to
    the next file opened, so a late read could copy another file's bytes into a parameter). The
    KeyboardInterrupt reaches the caller, no thread outlives the call and no read failed. The kernel
    may hand the signal to another thread: the caller still notices it within its join steps.
    Reads are counted from the moment the caller stops the pool, not from the signal's sending: how
    soon the caller's handler runs after the signal is up to the scheduler (on a busy machine the
    other thread copies many chunks meanwhile, as it should)."""
    import os
    import signal
    import threading
    import time

    from atom_convert.serve import transfer
    from atom_convert.serve.transfer import FileRead, TensorSlot, read_header

    d = converted("tiny-deepseek-v3", "fp8", "gfx950", tp=2)
    monkeypatch.setattr(transfer.torch, "cuda", _FakeCuda)
    monkeypatch.setattr(transfer, "_pinned_buffer", lambda index, size: torch.empty(size, dtype=torch.uint8))
    old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    view = rank_view(d, 0)
    by_file: dict[str, list] = {}
    for n, r in view.tensors.items():
        by_file.setdefault(r.file, []).append(TensorSlot(n, r.dtype, r.shape))
    reads = [FileRead(d / f, read_header(d / f), ss) for f, ss in by_file.items()]

    real_preadv = os.preadv
    inside, release, stopped = threading.Event(), threading.Event(), threading.Event()
    failed: list[BaseException] = []
    late: list[int] = []

    class StopSeen(transfer.InFlight):
        def stop_and_wait(self, timeout: float) -> int:
            stopped.set()  # before the flag: a read counted late here may be a thread's chunk in hand
            return super().stop_and_wait(timeout)

    def preadv(fd, bufs, off, *flags):
        if stopped.is_set():
            late.append(off)
        if not inside.is_set():  # the first read waits inside until Ctrl-C has landed
            inside.set()
            release.wait(30)
        try:
            return real_preadv(fd, bufs, off, *flags)
        except BaseException as e:
            failed.append(e)
            raise

    stopped_in_time: list[bool] = []

    def ctrl_c():
        inside.wait(30)
        signal.pthread_kill(threading.main_thread().ident if to == "caller" else threading.get_ident(), signal.SIGINT)
        stopped_in_time.append(stopped.wait(30))  # the caller stops the pool while the read is in progress
        release.set()

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(transfer, "InFlight", StopSeen)
    helper = threading.Thread(target=ctrl_c)
    helper.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            # one thread when the signal goes elsewhere: no second thread could finish the work meanwhile
            transfer._place_cuda(reads, torch.device("cpu"), threads=2 if to == "caller" else 1, chunk_bytes=4096,
                                 reader="pread")
        # a thread that has left its work may take a moment to be gone from threading's table
        end = time.monotonic() + 2
        while (alive := [t.name for t in threading.enumerate() if t.name.startswith("atom-convert-load-")]) \
                and time.monotonic() < end:
            time.sleep(0.01)
    finally:
        release.set()
        helper.join()
        for t in threading.enumerate():
            if t.name.startswith("atom-convert-load-"):
                t.join(30)
        signal.signal(signal.SIGINT, old_handler)
    assert stopped_in_time == [True], "the caller did not stop the pool within 30 s of Ctrl-C"
    assert alive == [], f"copy threads still running after the interrupt: {alive}"
    assert failed == [], f"a read failed after the files were closed under it: {failed}"
    assert len(late) <= 2, f"{len(late)} reads started after the pool was stopped (2 threads: at most their chunk in hand)"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_ctrl_c_on_the_gpu_then_a_full_load_is_exact(tmp_path, monkeypatch):
    """The real GPU path (streams, events, pinned buffers): Ctrl-C lands mid-load; no copy thread
    outlives the call; the next load, which reuses the same pinned buffers, is byte-exact."""
    import os
    import signal
    import threading
    import time

    from safetensors.torch import save_file

    from atom_convert.serve import transfer
    from atom_convert.serve.transfer import FileRead, TensorSlot, read_header

    g = torch.Generator().manual_seed(11)
    tensors = {f"t{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
               for i, n in enumerate((48 << 20, 5 << 20, (17 << 20) + 3, 31 << 20))}
    f = tmp_path / "x.safetensors"
    save_file(tensors, f)

    def reads():
        slots = [TensorSlot(n, torch.uint8, tuple(t.shape)) for n, t in tensors.items()]
        return [FileRead(f, read_header(f), slots)], slots

    real_preadv, count = os.preadv, [0]

    def slow_preadv(fd, bufs, off, *flags):  # ~100 reads of 1 MB at 4 ms each: the load lasts long enough
        count[0] += 1
        if count[0] == 8:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(0.004)
        return real_preadv(fd, bufs, off, *flags)

    old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(os, "preadv", slow_preadv)
    try:
        r, _ = reads()
        with pytest.raises(KeyboardInterrupt):
            transfer.place_cuda(r, torch.device("cuda"), threads=4, chunk_bytes=1 << 20, reader="pread")
        alive = [t.name for t in threading.enumerate() if t.name.startswith("atom-convert-load-")]
    finally:
        signal.signal(signal.SIGINT, old_handler)
    assert alive == [], alive
    assert count[0] < 60, f"{count[0]} reads: the threads did not stop after the interrupt"
    monkeypatch.setattr(os, "preadv", real_preadv)
    r, slots = reads()
    transfer.place_cuda(r, torch.device("cuda"), threads=4, chunk_bytes=1 << 20, reader="pread")
    torch.cuda.synchronize()
    for s in slots:
        assert s.tensor.device.type == "cuda" and torch.equal(s.tensor.cpu(), tensors[s.name]), s.name


def _page_buffer(n: int):
    """A page-aligned writable buffer of n bytes (an anonymous mapping), as pinned buffers are."""
    import mmap

    mm = mmap.mmap(-1, n)
    return mm, memoryview(mm)


@pytest.mark.parametrize("cached", ["none", "all", "head"])
@pytest.mark.parametrize("n", [3 * 4096, 3 * 4096 - 5])
def test_read_chunk_direct_reads_what_the_cache_lacks(tmp_path, cached, n):
    """The pread reader's chunk read: a chunk the page cache holds whole (mincore) is copied from
    it, any other read with O_DIRECT (a chunk ending mid-page at the end of the file included) and
    the direct read leaves the cache as it was; the bytes equal the file's whichever way they came,
    and the buffered read alone gives the same bytes."""
    import os

    from atom_convert.serve import transfer

    data = os.urandom(5 * 4096 + 123)
    f = tmp_path / "x.bin"
    f.write_bytes(data)
    off = 4096 if n % 4096 == 0 else len(data) - n - (len(data) - n) % 4096  # the second ends at the end of the file
    n = min(n, len(data) - off)
    fd = os.open(f, os.O_RDONLY)
    dfd = transfer._open_direct(f)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if cached == "all":
            os.pread(fd, len(data), 0)
        elif cached == "head":
            os.pread(fd, 4096, off)
        state = transfer.Residency(fd, len(data)).cached(off, n)
        if state is not None and transfer._mincore() is not None:
            assert state is (cached == "all")
        mm, mv = _page_buffer(4 * 4096)
        how = transfer._read_chunk(fd, dfd, mv, off, n, f, state)
        assert bytes(mv[:n]) == data[off:off + n]
        if dfd is not None and state is not None:
            assert how == ("buffered" if cached == "all" else "direct")
            assert transfer.Residency(fd, len(data)).cached(off, n) is (cached == "all"), \
                "the direct read filled the page cache"
        mm2, mv2 = _page_buffer(4 * 4096)
        assert transfer._read_chunk(fd, None, mv2, off, n, f) == "buffered"
        assert bytes(mv2[:n]) == data[off:off + n]
    finally:
        os.close(fd)
        if dfd is not None:
            os.close(dfd)


def test_read_chunk_falls_back_when_direct_reads_fail_and_names_a_truncated_file(tmp_path, monkeypatch):
    import os

    from atom_convert.errors import BadInputError
    from atom_convert.serve import transfer

    data = os.urandom(4 * 4096)
    f = tmp_path / "x.bin"
    f.write_bytes(data)
    fd = os.open(f, os.O_RDONLY)
    real = os.preadv

    def refuse_direct(fd_, bufs, off, *flags):
        if fd_ == 999:
            raise OSError(22, "Invalid argument")
        return real(fd_, bufs, off)

    monkeypatch.setattr(os, "preadv", refuse_direct)
    try:
        mm, mv = _page_buffer(4 * 4096)
        assert transfer._read_chunk(fd, 999, mv, 0, 4 * 4096, f, False) == "buffered"
        assert bytes(mv) == data
        monkeypatch.setattr(os, "preadv", real)
        for dfd, cached in ((transfer._open_direct(f), False), (None, None)):
            with pytest.raises(BadInputError, match="truncated"):
                transfer._read_chunk(fd, dfd, mv, 4096, 4 * 4096, f, cached)
    finally:
        os.close(fd)


@pytest.mark.parametrize("var,value,says", [
    ("ATOM_CONVERT_LOAD_DEPTH", "0", "ATOM_CONVERT_LOAD_DEPTH='0': expected a whole number of at least 1"),
    ("ATOM_CONVERT_LOAD_THREADS", "many", "ATOM_CONVERT_LOAD_THREADS='many': expected a whole number of at least 1"),
    ("ATOM_CONVERT_LOAD_CHUNK", "-4096", "ATOM_CONVERT_LOAD_CHUNK='-4096': expected a whole number of at least 1"),
    ("ATOM_CONVERT_LOAD_SUBMIT", "cuda", r"load submit 'cuda' is not one of torch, runtime \(ATOM_CONVERT_LOAD_SUBMIT\)"),
    ("ATOM_CONVERT_LOAD_READER", "read", r"load reader 'read' is not one of pread, mmap, register \(ATOM_CONVERT_LOAD_READER\)"),
    ("ATOM_CONVERT_LOAD_PIN", "hugetlb", r"ATOM_CONVERT_LOAD_PIN='hugetlb' is not one of thp, torch")])
def test_a_bad_load_setting_is_named(converted, monkeypatch, var, value, says):
    """A load setting from the environment that is not a whole number >= 1 (or not one of its choices) is a
    BadInputError naming the variable and its value, before any file is opened or buffer pinned."""
    from atom_convert.errors import BadInputError
    from atom_convert.serve import transfer
    from atom_convert.serve.transfer import FileRead, TensorSlot, read_header

    d = converted("tiny-deepseek-v3", "fp8", "gfx950", tp=2)
    monkeypatch.setattr(transfer.torch, "cuda", _FakeCuda)
    monkeypatch.setattr(transfer, "_pinned_buffer", lambda index, size: pytest.fail("a buffer was asked for"))
    monkeypatch.setenv(var, value)
    if var == "ATOM_CONVERT_LOAD_PIN":  # read when the module is imported
        monkeypatch.setattr(transfer, "PIN", value)
    view = rank_view(d, 0)
    name, r = next(iter(view.tensors.items()))
    reads = [FileRead(d / r.file, read_header(d / r.file), [TensorSlot(name, r.dtype, r.shape)])]
    monkeypatch.setattr(transfer.os, "open", lambda *a, **k: pytest.fail("a file was opened"))  # by the load itself
    with pytest.raises(BadInputError, match=says):
        transfer._place_cuda(reads, torch.device("cpu"), threads=None, chunk_bytes=None)


class _FakeCudart:
    """Stand-in for torch.cuda.cudart(): cudaHostRegister records its arguments and returns `code`."""

    def __init__(self, code: int):
        self.code, self.calls = code, []

    def cudaHostRegister(self, ptr, n, flags):  # noqa: N802  (the runtime's name)
        self.calls.append((ptr, n, flags))
        return self.code


def _fresh_pool(monkeypatch: pytest.MonkeyPatch, pin: str, cudart: object) -> list[tuple]:
    """transfer's pool emptied for the test, PIN set, cudart replaced; returns the list in which each
    torch.empty(..., pin_memory=True) call's size is recorded (made as ordinary memory here)."""
    from atom_convert.serve import transfer

    monkeypatch.setattr(transfer, "_pools", {})
    monkeypatch.setattr(transfer, "_mapped", [])
    monkeypatch.setattr(transfer, "PIN", pin)
    monkeypatch.setattr(transfer.torch.cuda, "cudart", lambda: cudart)
    pinned: list[tuple] = []
    real_empty = torch.empty

    def empty(*a, **k):
        if k.pop("pin_memory", False):
            pinned.append(a)
        return real_empty(*a, **k)

    monkeypatch.setattr(transfer.torch, "empty", empty)
    return pinned


def test_pool_buffers_are_anonymous_memory_registered_as_page_locked(monkeypatch: pytest.MonkeyPatch) -> None:
    """PIN "thp" (the default): a buffer is page-aligned anonymous memory of the chunk's size, registered
    at its own address for every context (cudaHostRegisterPortable), written and read through the tensor;
    the pool keeps it (asked again: the same buffer, no second registration); another index is another
    buffer; nothing is pinned by torch."""
    from atom_convert.serve import transfer

    rt = _FakeCudart(0)
    pinned = _fresh_pool(monkeypatch, "thp", rt)
    chunk = 3 << 20
    buf = transfer._pinned_buffer(5, chunk)
    assert buf.dtype == torch.uint8 and buf.numel() == chunk and buf.data_ptr() % transfer.PAGE == 0
    assert rt.calls == [(buf.data_ptr(), chunk, transfer.HOST_REGISTER_PORTABLE)]
    fill = torch.randint(0, 256, (chunk,), dtype=torch.uint8)
    buf.copy_(fill)
    assert torch.equal(buf, fill)
    assert transfer._pinned_buffer(5, chunk) is buf and len(rt.calls) == 1
    other = transfer._pinned_buffer(6, chunk)
    assert other.data_ptr() != buf.data_ptr() and rt.calls[1] == (other.data_ptr(), chunk, 1)
    assert len(transfer._mapped) == 2 and pinned == []
    # not inherited by a process forked later (MADV_DONTFORK): mapped here, absent in the child
    assert _mapped_at(buf.data_ptr())
    pid = os.fork()
    if pid == 0:
        os._exit(1 if _mapped_at(buf.data_ptr()) else 0)
    assert os.waitpid(pid, 0)[1] == 0, "the child inherited the pool's mapping"


def _mapped_at(addr: int) -> bool:
    """Whether this process has a mapping that holds `addr` (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


@pytest.mark.parametrize("pin, cudart", [("thp", _FakeCudart(2)), ("thp", object()), ("torch", _FakeCudart(0))],
                         ids=["register-refused", "no-register-call", "pin-torch"])
def test_pool_buffers_pinned_by_torch_when_not_registered(monkeypatch: pytest.MonkeyPatch, pin: str,
                                                          cudart: object) -> None:
    """A buffer the runtime refuses to register (an error code, or a runtime without the call), or PIN
    "torch": torch's pinned allocator makes it, and no registered mapping is kept."""
    from atom_convert.serve import transfer

    pinned = _fresh_pool(monkeypatch, pin, cudart)
    buf = transfer._pinned_buffer(0, 1 << 20)
    assert buf.numel() == 1 << 20 and pinned == [(1 << 20,)]
    assert transfer._mapped == []
    if pin == "torch":
        assert cudart.calls == []  # type: ignore[attr-defined]


def test_the_pool_is_registered_by_default_and_torch_pinned_on_request() -> None:
    """ATOM_CONVERT_LOAD_PIN unset: "thp"; set to torch: "torch" (read when the module is imported)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ATOM_CONVERT_LOAD_PIN"}
    code = "from atom_convert.serve import transfer; print(transfer.PIN)"
    for value, want in ((None, "thp"), ("torch", "torch")):
        run_env = env if value is None else {**env, "ATOM_CONVERT_LOAD_PIN": value}
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want, out


def test_an_unknown_pin_way_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from atom_convert.errors import BadInputError
    from atom_convert.serve import transfer

    _fresh_pool(monkeypatch, "hugetlb", _FakeCudart(0))
    with pytest.raises(BadInputError, match=r"ATOM_CONVERT_LOAD_PIN='hugetlb' is not one of thp, torch"):
        transfer._pinned_buffer(0, 1 << 20)
