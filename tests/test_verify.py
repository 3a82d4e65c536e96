"""`atom-convert verify`: passes on every good conversion, and fails, naming the tensor,
on each deliberate corruption (written consistently: the manifest's hashes are
updated, so only the value checks can catch it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from atom_convert.store.digest import file_digest
from atom_convert.store.manifest import MANIFEST_NAME
from atom_convert.layout.codecs.shuffle import shuffle16
from atom_convert.files.source import read_safetensors_header
from atom_convert.check.verify import verify

from conftest import FORMATS, PRESETS, TARGETS
from oracles import b3_blocks


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("target", TARGETS)
def test_verify_passes(converted, tiny_checkpoint, preset, fmt, target):
    r = verify(converted(preset, fmt, target), tiny_checkpoint(preset, fmt), tokens=8)
    assert r.ok, r.failures
    kinds = {row["kind"] for row in r.rows}
    assert {"attn", "attn_prefill", "layer", "logits"} <= kinds
    assert r.check.values_checked > 20


@pytest.mark.parametrize("preset,fmt,target", [("tiny-deepseek-v3", "fp8", "gfx942"), ("tiny-deepseek-v2", "bf16", "gfx950")])
def test_verify_passes_tp2(converted, tiny_checkpoint, preset, fmt, target):
    r = verify(converted(preset, fmt, target, tp=2), tiny_checkpoint(preset, fmt), tokens=8)
    assert r.ok, r.failures


def _rewritten_source(tiny_checkpoint, preset: str, fmt: str, dst: Path, change) -> Path:
    """A copy of a session source at `dst` whose tensors are `change(name, tensor)` where that gives one."""
    shutil.copytree(tiny_checkpoint(preset, fmt), dst)
    for f in sorted(dst.glob("*.safetensors")):
        tensors = load_file(str(f))
        for k, t in tensors.items():
            new = change(k, t)
            if new is not None:
                tensors[k] = new
        save_file(tensors, str(f), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_passes_with_norms_stored_wider_than_bf16(tiny_checkpoint, tmp_path, fmt, dtype):
    """A source whose RMSNorm weights are stored in fp32 or fp16 (as some fine-tunes save them): the
    conversion holds them in bf16, as the runtime's bf16 parameters do after their copy_ (round to
    nearest even), and verify's reference rounds them the same way, so the forward comparison passes.
    (With the reference on the unrounded values, layer 0 and the logits were off by rel_l2 0.002-0.004.)"""
    import atom_convert

    gen = torch.Generator().manual_seed(11)
    wide: dict[str, torch.Tensor] = {}

    def widen(k: str, t: torch.Tensor) -> torch.Tensor | None:
        if not k.endswith("norm.weight"):
            return None
        wide[k] = (t.float() + 1e-3 * torch.randn(t.shape, generator=gen)).to(dtype)  # values bf16 cannot hold
        return wide[k]

    src = _rewritten_source(tiny_checkpoint, "tiny-deepseek-v3", fmt, tmp_path / "src", widen)
    assert any(not torch.equal(t.to(torch.bfloat16).to(dtype), t) for t in wide.values())
    dst = tmp_path / "conv"
    atom_convert.convert(src, dst, target="gfx950")
    m = json.loads((dst / MANIFEST_NAME).read_text())
    for k, t in wide.items():
        if k in m["tensors"]:
            got = load_file(str(dst / m["tensors"][k]["file"]))[k]
            assert got.dtype == torch.bfloat16 and torch.equal(got, t.to(torch.bfloat16)), k
    r = verify(dst, src, tokens=8)
    assert r.ok, r.failures


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_verify_passes_with_a_bf16_model_stored_wider(tiny_checkpoint, tmp_path, dtype):
    """An unquantized checkpoint saved whole in fp32 or fp16: every tensor converts to bf16 (the experts
    stacked and shuffled from the rounded values), and verify's per-tensor check rounds the source the
    same way for every tensor, the stacked experts included (they were compared unrounded before)."""
    import atom_convert

    gen = torch.Generator().manual_seed(12)
    src = _rewritten_source(tiny_checkpoint, "tiny-deepseek-v3", "bf16", tmp_path / "src",
                            lambda k, t: (t.float() * (1 + 1e-3 * torch.randn(t.shape, generator=gen))).to(dtype))
    dst = tmp_path / "conv"
    atom_convert.convert(src, dst, target="gfx942")
    r = verify(dst, src, tokens=8)
    assert r.ok, r.failures
    assert r.check.values_checked > 20


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_block_scales_stored_in_bf16_or_fp16(tiny_checkpoint, tmp_path, dtype):
    """fp8 block scales stored in bf16 or fp16 are read, and convert byte for byte as the same values
    stored in fp32 do: the upcast is exact, as ATOM's fp32 scale parameters take them (under ATOM's own
    loader such a source holds the same bytes as the fp32 one, VERIFICATION.md). verify then passes."""
    import atom_convert
    from safetensors import safe_open

    outs = []
    for label, cast in (("narrow", lambda t: t.to(dtype)), ("wide", lambda t: t.to(dtype).float())):
        src = _rewritten_source(tiny_checkpoint, "tiny-deepseek-v3", "fp8", tmp_path / label,
                                lambda k, t, cast=cast: cast(t) if k.endswith("weight_scale_inv") else None)
        atom_convert.convert(src, tmp_path / f"{label}-out", target="gfx942")
        outs.append(tmp_path / f"{label}-out")
    files = sorted(p.relative_to(outs[0]) for p in outs[0].rglob("*.safetensors"))
    assert files and files == sorted(p.relative_to(outs[1]) for p in outs[1].rglob("*.safetensors"))
    for rel in files:
        with safe_open(str(outs[0] / rel), "pt") as a, safe_open(str(outs[1] / rel), "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys())
            for k in a.keys():
                x, y = a.get_tensor(k), b.get_tensor(k)
                assert x.dtype == y.dtype and torch.equal(_bytes(x), _bytes(y)), (rel, k)
    r = verify(outs[0], tmp_path / "narrow", tokens=8)
    assert r.ok, r.failures


# -- corruptions ---------------------------------------------------------------------------------


def _copy(converted, preset, fmt, target, tmp_path: Path) -> Path:
    dst = tmp_path / "conv"
    shutil.copytree(converted(preset, fmt, target), dst)
    return dst


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _rewrite(dst: Path, name: str, fn) -> None:
    """Replace tensor `name` by fn(tensor) in its shard and update the manifest's hashes."""
    m = json.loads((dst / MANIFEST_NAME).read_text())
    f = m["tensors"][name]["file"]
    tensors = load_file(str(dst / f))
    new = fn(tensors[name].clone())
    assert new.dtype == tensors[name].dtype and new.shape == tensors[name].shape
    assert not torch.equal(_bytes(new), _bytes(tensors[name])), "the corruption must change the bytes"
    tensors[name] = new
    save_file(tensors, str(dst / f), metadata={"format": "pt"})
    m["files"][f] = {"bytes": (dst / f).stat().st_size, "xxh3_blocks": file_digest(dst / f)}
    (dst / MANIFEST_NAME).write_text(json.dumps(m))


def _fails_naming(dst: Path, src: Path, name: str) -> None:
    r = verify(dst, src, tokens=8)
    assert not r.ok
    assert r.check.problems, "the per-tensor check must catch it"
    assert any(name in p for p in r.check.problems), r.check.problems


def test_flipped_byte_in_any_file(converted, tiny_checkpoint, tmp_path):
    """One byte flipped inside each file in turn: the file is named without --source; with it, the
    tensor whose bytes hold the flipped byte is named."""
    base = converted("tiny-deepseek-v3", "fp8", "gfx950")
    src = tiny_checkpoint("tiny-deepseek-v3", "fp8")
    m = json.loads((base / MANIFEST_NAME).read_text())
    shards = [f for f in m["files"] if f.endswith(".safetensors")]
    assert len(shards) >= 2  # main and mtp/
    for f in shards:
        dst = tmp_path / f"flip-{f.replace('/', '_')}"
        shutil.copytree(base, dst)
        header, start = read_safetensors_header(dst / f)
        # the largest tensor of the file, a byte in the middle of its data
        name, meta = max(((n, v) for n, v in header.items() if n != "__metadata__"),
                         key=lambda kv: kv[1]["data_offsets"][1] - kv[1]["data_offsets"][0])
        off = start + (meta["data_offsets"][0] + meta["data_offsets"][1]) // 2
        raw = bytearray((dst / f).read_bytes())
        raw[off] ^= 0x5A
        (dst / f).write_bytes(bytes(raw))
        r = verify(dst, None)
        assert not r.ok and any(Path(f).name in p and "xxh3_blocks" in p for p in r.failures), r.failures
        r = verify(dst, src, tokens=4)
        assert any(name in p for p in r.check.problems), (f, name, r.check.problems)


@pytest.mark.parametrize("version,key", [(2, "sha256"), (3, "blake3"), (4, "blake3_blocks")])
def test_older_formats_digests_still_checked(converted, tmp_path, version, key):
    """A directory written before format_version 5 lists the digests of its version (sha256 before
    version 3, whole-file BLAKE3 in version 3, BLAKE3 over 64 KiB blocks in version 4): verify checks
    them as such (hashlib's, the blake3 package's, and the blocks' definition with it: tests/oracles.py,
    computed here), passes when they match and names the file and the digest when one does not."""
    import hashlib

    import blake3

    whole = {"sha256": lambda b: hashlib.sha256(b).hexdigest(), "blake3": lambda b: blake3.blake3(b).hexdigest(),
             "blake3_blocks": b3_blocks}[key]
    dst = tmp_path / f"v{version}"
    shutil.copytree(converted("tiny-deepseek-v3", "fp8", "gfx950"), dst)
    manifests = sorted(dst.rglob(MANIFEST_NAME), key=lambda p: -len(p.parts))  # mtp/ before the main one
    for mp in manifests:
        m = json.loads(mp.read_text())
        m["format_version"] = version
        for rel, meta in m["files"].items():
            del meta["xxh3_blocks"]
            meta["bytes"] = (mp.parent / rel).stat().st_size  # mtp/'s manifest, rewritten first
            meta[key] = whole((mp.parent / rel).read_bytes())
        mp.write_text(json.dumps(m))
    r = verify(dst, None)
    assert r.ok, r.failures
    shard = sorted(dst.glob("*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x21
    shard.write_bytes(bytes(raw))
    r = verify(dst, None)
    assert not r.ok and any(shard.name in p and f"{key} " in p for p in r.failures), r.failures


def test_w_k_heads_permuted(converted, tiny_checkpoint, tmp_path):
    dst = _copy(converted, "tiny-deepseek-v3", "fp8", "gfx950", tmp_path)
    name = "model.layers.1.self_attn.mla_attn.impl.W_K"
    _rewrite(dst, name, lambda t: t[torch.tensor([1, 0, 3, 2])].contiguous())
    _fails_naming(dst, tiny_checkpoint("tiny-deepseek-v3", "fp8"), name)


def test_shuffle_applied_twice(converted, tiny_checkpoint, tmp_path):
    dst = _copy(converted, "tiny-kimi-k2", "fp8", "gfx950", tmp_path)
    name = "model.layers.2.mlp.experts.w13_weight"
    _rewrite(dst, name, shuffle16)
    _fails_naming(dst, tiny_checkpoint("tiny-kimi-k2", "fp8"), name)


def test_shuffle_applied_twice_linear(converted, tiny_checkpoint, tmp_path):
    dst = _copy(converted, "tiny-deepseek-v2", "fp8", "gfx942", tmp_path)
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    _rewrite(dst, name, shuffle16)
    _fails_naming(dst, tiny_checkpoint("tiny-deepseek-v2", "fp8"), name)


def test_fnuz_scales_doubled_twice(converted, tiny_checkpoint, tmp_path):
    dst = _copy(converted, "tiny-deepseek-v3", "fp8", "gfx942", tmp_path)
    _rewrite(dst, "model.layers.0.self_attn.fused_qkv_a_proj.weight_scale", lambda s: s * 2)
    _fails_naming(dst, tiny_checkpoint("tiny-deepseek-v3", "fp8"), "model.layers.0.self_attn.fused_qkv_a_proj.weight")


def test_fnuz_expert_scales_doubled_twice(converted, tiny_checkpoint, tmp_path):
    dst = _copy(converted, "tiny-deepseek-v3", "fp8", "gfx942", tmp_path)
    _rewrite(dst, "model.layers.1.mlp.experts.w2_weight_scale", lambda s: s * 2)
    _fails_naming(dst, tiny_checkpoint("tiny-deepseek-v3", "fp8"), "model.layers.1.mlp.experts.w2_weight")


@pytest.mark.parametrize("fmt", FORMATS)
def test_gate_up_swapped_in_w13(converted, tiny_checkpoint, tmp_path, fmt):
    dst = _copy(converted, "tiny-deepseek-v3", fmt, "gfx950", tmp_path)
    name = "model.layers.2.mlp.experts.w13_weight"

    def swap(t: torch.Tensor) -> torch.Tensor:
        from atom_convert.layout.codecs.shuffle import unshuffle16

        plain = unshuffle16(t)
        g, u = plain.chunk(2, 1)
        return shuffle16(torch.cat([u, g], 1))

    _rewrite(dst, name, swap)
    _fails_naming(dst, tiny_checkpoint("tiny-deepseek-v3", fmt), name)
    # the forward check sees it too: the MoE layer's output no longer matches transformers
    r = verify(dst, tiny_checkpoint("tiny-deepseek-v3", fmt), tokens=8)
    assert any(row["what"] == "layer 2 output" and not row["ok"] for row in r.rows)
