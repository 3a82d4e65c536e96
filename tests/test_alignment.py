"""Converted shards start their tensors 64-byte aligned wherever safetensors' no-gaps rule allows
(engine/shard_header.py `data_order`), and no tensor's bytes changed.

safetensors' own loader refuses a gap between tensors (`test_safetensors_refuses_gaps`), so the only
padding is the header's (spaces, so that the data starts at a multiple of 64), and the order of the data
does the rest: every tensor whose size is a multiple of 64 comes first, each at a multiple of 64; the
others follow, those whose size is a multiple of 16 first (each at a multiple of 16, which is what a CPU
`load_into` needs to map instead of copy: serve/transfer.py CPU_VIEW_ALIGN). What is left off 64 is a
rank's few odd-sized scales (the 4-byte W_K/W_V scales, a (17, 56) fp32 block-scale grid).

Bytes unchanged: every shard, re-packed back to back in its header's (the plan's) order with the old
8-byte header padding, has the sha256 the code before this change wrote (`BEFORE`, from
tests/layout_digests.json as recorded before it was re-recorded for this change).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import atom_convert
import atom_trees as T
import layout_digests as LD
from atom_convert.files.safetensors import read_header
from atom_convert.serve.transfer import CPU_VIEW_ALIGN

ALIGN = 64
# sha256 of the shards as the code before 64-byte alignment wrote them (tests/layout_digests.json at
# that time), for the versions below (the fixtures' bytes depend on them, as layout_digests.py says)
BEFORE_VERSIONS = {"amd-quark": "0.13", "safetensors": "0.8.0", "torch": "2.13.0+cpu", "transformers": "5.25.0"}
BEFORE = {
    ("v3-fp8", "gfx950", "tp2"): {
        "model-rank0-00001-of-00001.safetensors": "e93a5a1ca3500c812d37b14b1927839f1ba16e267b01aa6443da823df949bf6f",
        "model-rank1-00001-of-00001.safetensors": "1f3585665878b7840adad93275b6a92b8b037cb1193bc05a7c977dd0d92d5687",
        "mtp/model-rank0-00001-of-00001.safetensors": "8fd853cb42117cf6b02d5f5a7589b151dea642ce6aef4c43d54c12fc9f9039af",
        "mtp/model-rank1-00001-of-00001.safetensors": "f01ee7d545d0d98889fd6ec838f733349e864f337dcea2dd913b009d410dbfc1",
    },
    ("v2-lite-bf16", "gfx942", "tp1"): {
        "model-00001-of-00001.safetensors": "2a1a9f265b44dd46fc6590ef02b10f55047f8be6820dc260a327733c1c353582",
    },
    ("kimi-fp8", "gfx942", "tp2-ep"): {
        "model-common-00001-of-00001.safetensors": "64c159a0260513b5e5903d436e9274199236e4992ef4a87ac1e131240c5454f9",
        "model-rank0-00001-of-00001.safetensors": "98eeb7ef451bb0d9b2cdd1fe3ebd30b36b72dbe976551ca33b340da61cbbe0ff",
        "model-rank1-00001-of-00001.safetensors": "a3871c09b6e06a4eec9602b73c887021f9c7c440cf84876848fde58ea27a6bb8",
    },
}


def _header(path: Path) -> tuple[dict, int]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), 8 + n


def repacked_before(path: Path) -> bytes:
    """The file as the code before this change wrote it: its tensors back to back in the header's order,
    the compact JSON header padded with spaces to a multiple of 8."""
    raw = path.read_bytes()
    header, start = _header(path)
    out: dict = {}
    data, off = [], 0
    for name, e in header.items():
        if name == "__metadata__":
            out[name] = e
            continue
        b, end = e["data_offsets"]
        out[name] = {"dtype": e["dtype"], "shape": e["shape"], "data_offsets": [off, off + end - b]}
        data.append(raw[start + b:start + end])
        off += end - b
    js = json.dumps(out, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js + b"".join(data)


def check_aligned(path: Path) -> dict[str, int]:
    """The alignment rules of `data_order` on one file; returns name -> absolute offset."""
    header, start = _header(path)
    assert start % ALIGN == 0, f"{path.name}: data starts at {start}"
    spans = sorted((e["data_offsets"][0], e["data_offsets"][1], n) for n, e in header.items() if n != "__metadata__")
    seen_odd = False
    for b, e, n in spans:
        size = e - b
        if size % ALIGN:
            seen_odd = True
        else:
            assert not seen_odd, f"{path.name}: {n} ({size} bytes, a multiple of 64) lies after an odd-sized tensor"
        if size % ALIGN == 0:
            assert (start + b) % ALIGN == 0, f"{path.name}: {n} ({size} bytes) at {start + b}"
        if size % CPU_VIEW_ALIGN == 0:
            assert (start + b) % CPU_VIEW_ALIGN == 0, f"{path.name}: {n} ({size} bytes) at {start + b}"
    return {n: start + b for b, _, n in spans}


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], Path]:
    work = tmp_path_factory.mktemp("aligned")
    srcs: dict[str, Path] = {}
    out = {}
    for src, target, mode in BEFORE:
        if src not in srcs:
            srcs[src] = LD.build_source(src, work / "src" / src)
        dst = work / "out" / f"{src}-{target}-{mode}"
        atom_convert.convert(srcs[src], dst, target=target, **LD.MODES[mode])
        out[(src, target, mode)] = dst
    return out


def test_safetensors_refuses_gaps(tmp_path: Path) -> None:
    """Why the alignment is had by ordering, not by gaps: safetensors' loader refuses a gap."""
    header = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
              "b": {"dtype": "F32", "shape": [1], "data_offsets": [64, 68]}}
    js = json.dumps(header).encode()
    js += b" " * (-(8 + len(js)) % ALIGN)
    p = tmp_path / "gap.safetensors"
    p.write_bytes(struct.pack("<Q", len(js)) + js + bytes(68))
    with pytest.raises(Exception, match="invalid offset"):
        load_file(str(p))


def test_converted_files_are_aligned_and_load(cases) -> None:
    odd = 0
    for dst in cases.values():
        files = sorted(dst.rglob("*.safetensors"))
        assert files
        for f in files:
            offsets = check_aligned(f)
            read_header(f)  # the project's own validator accepts it (back to back, no gaps)
            raw = f.read_bytes()
            header, _ = _header(f)
            loaded = load_file(str(f))
            assert sorted(loaded) == sorted(offsets)
            with safe_open(str(f), framework="pt") as h:
                assert sorted(h.keys()) == sorted(offsets)
                for n, at in offsets.items():
                    t = h.get_tensor(n)
                    assert torch.equal(t.reshape(-1).view(torch.uint8), loaded[n].reshape(-1).view(torch.uint8)), n
                    size = header[n]["data_offsets"][1] - header[n]["data_offsets"][0]
                    assert bytes(t.reshape(-1).view(torch.uint8).numpy()) == raw[at:at + size], n
                    odd += size % ALIGN != 0
    assert odd, "no odd-sized tensor in the fixtures: the ordering is not exercised"


def test_tensor_bytes_unchanged(cases) -> None:
    if LD.versions() != BEFORE_VERSIONS:
        pytest.skip(f"BEFORE was recorded with {BEFORE_VERSIONS}, this environment has {LD.versions()}")
    for key, dst in cases.items():
        got = {str(f.relative_to(dst)): hashlib.sha256(repacked_before(f)).hexdigest()
               for f in sorted(dst.rglob("*.safetensors"))}
        assert got == BEFORE[key], key


def _unaligned_bytes(raw: bytes) -> int:
    """Bytes of the tensors a CPU load_into copies (file offset not a multiple of CPU_VIEW_ALIGN)."""
    (n,) = struct.unpack("<Q", raw[:8])
    h = json.loads(raw[8:8 + n])
    return sum(e - b for k, (b, e) in ((k, v["data_offsets"]) for k, v in h.items() if k != "__metadata__")
               if (8 + n + b) % CPU_VIEW_ALIGN)


def test_cpu_load_copies_only_odd_sized_tensors(cases, tmp_path: Path) -> None:
    """load_into on the CPU maps every tensor whose size is a multiple of 16, and copies less than
    the back-to-back layout before this change made it copy."""
    d = cases[("v3-fp8", "gfx950", "tp2")]
    cfg = json.loads((d / "config.json").read_text())
    m = json.loads((d / "atom_manifest.json").read_text())
    for rank in range(2):
        model = T.build(cfg, tp=2, meta=True)
        stats = atom_convert.load_into(model, d, rank=rank)
        f = d / m["tensors"]["lm_head.weight"]["rank_files"][rank]
        header, start = _header(f)
        copied = {n: e["data_offsets"][1] - e["data_offsets"][0] for n, e in header.items()
                  if n != "__metadata__" and (start + e["data_offsets"][0]) % CPU_VIEW_ALIGN}
        assert all(size % CPU_VIEW_ALIGN for size in copied.values()), copied
        assert stats.copied_bytes == sum(copied.values()) == _unaligned_bytes(f.read_bytes())
        before = _unaligned_bytes(repacked_before(f))
        assert stats.copied_bytes < before, (rank, stats.copied_bytes, before)


def test_full_width_rank_is_aligned(tmp_path: Path) -> None:
    """DeepSeek-V3 fp8 at full width, tp 8 (a header-only source, planned, never converted): all but a
    few KB of a rank's 3.4 GB start at a multiple of 64, all but its 4-byte scales at one of 16."""
    from atom_convert.engine.planning import layout_shards, make_plan
    from atom_convert.engine.shard_header import shard_layout
    from atom_convert.files.source import SourceCheckpoint
    from atom_convert.layout.options import ConversionOptions
    from test_parallel_full_width import header_only

    src = SourceCheckpoint(header_only("deepseek-v3.json", tmp_path / "v3", "fp8"))
    try:
        opts = ConversionOptions.build(None, tp=8)
        main, mtp = layout_shards(make_plan(src, opts), opts.shard_size)
    finally:
        src.close()
    for lay in (main, mtp):
        by = {o.name: o for o in lay.plan.outputs()}
        for sp in [*lay.shards[0], *lay.common]:
            header, offsets, size = shard_layout(sp, by)
            total = sum(by[n].nbytes for n in sp.names)
            assert len(header) % ALIGN == 0 and size == len(header) + total
            off64 = sum(by[n].nbytes for n in sp.names if offsets[n] % ALIGN)
            off16 = [n for n in sp.names if offsets[n] % CPU_VIEW_ALIGN]
            assert all(by[n].nbytes % ALIGN for n in sp.names if offsets[n] % ALIGN), sp.file
            assert all(by[n].nbytes % CPU_VIEW_ALIGN for n in off16), sp.file
            assert off64 <= 8192 and off64 < total * 1e-5, (sp.file, off64, total)
