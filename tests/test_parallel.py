"""Expert parallel, DP-attention and common files (spec atom-parallel.md), rank by rank.

The oracles are independent of atom_convert's parallel code:
- bf16 / fp8 sources: test_layout's `Builder`, which builds every tensor from the source files
  with safetensors, explicit slicing and aiter's own `shuffle_weight`, at tp 1 (whole tensors)
  and at the mode's tp (the plain-TP pieces). The expected rank r is then written here from the
  spec: under TP+EP the non-expert tensors are the plain-TP pieces of rank r (§1.1 "the non-MoE
  modules never see EP"); under DP-attention they are the whole tp 1 tensors, W_K/W_V included
  (§2.2); routed experts under EP are the tp 1 experts picked by id, rank r holding ids
  [r·E/ep, (r+1)·E/ep) and the shared expert in the last slot (§1.2, §1.3); without EP under
  DP-attention they are the plain-TP experts at tp = dp (§2.2).
- Quark MXFP4 sources: the tp 1 and tp 2 conversions, which test_mxfp4 checks against aiter and
  Quark, compared by expert id (an expert's bytes do not depend on its slot, §1.3).
Expert ids, slot maps and expert_map are computed here from the spec, not read from the manifest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors import safe_open

import atom_convert
from atom_convert.cli import main
from atom_convert.errors import BadInputError, UnsupportedError
from atom_convert.check.inspect import describe
from atom_convert.store.manifest import MANIFEST_NAME, Manifest
from atom_convert.check.verify import verify

from test_layout import Builder, source

BF16 = torch.bfloat16

# mode -> convert() keywords
MODES: dict[str, dict[str, Any]] = {
    "tp2-ep": dict(tp=2, ep=True),
    "tp4-ep": dict(tp=4, ep=True),
    "dpa2": dict(tp=2, dp_attention=True),
    "dpa4": dict(tp=4, dp_attention=True),
    "dpa2-ep": dict(tp=2, dp_attention=True, ep=True),
    "dpa4-ep": dict(tp=4, dp_attention=True, ep=True),
    "dpa2-ep-separate": dict(tp=2, dp_attention=True, ep=True, mori=True, shared_experts="separate"),
    "dpa8-ep": dict(tp=8, dp_attention=True, ep=True),
}
V3, KIMI, V2L = "tiny-deepseek-v3", "tiny-kimi-k2", "tiny-deepseek-v2-lite"
# fp8 needs 128-aligned rank pieces (spec §3.2): the tiny presets' o_proj (256 columns) and experts
# (I = 256) split 2 ways at most, so fp8 tp 4 runs only under DP-attention + EP; bf16 covers tp 4.
CASES = [
    (V3, "fp8", "tp2-ep"), (V3, "fp8", "dpa2"), (V3, "fp8", "dpa2-ep"), (V3, "fp8", "dpa4-ep"),
    (V3, "fp8", "dpa2-ep-separate"),
    (KIMI, "fp8", "tp2-ep"), (KIMI, "bf16", "tp4-ep"), (KIMI, "fp8", "dpa2"), (KIMI, "fp8", "dpa4-ep"),
    (V2L, "fp8", "tp2-ep"), (V2L, "fp8", "dpa2"), (V2L, "fp8", "dpa4-ep"),
    (V3, "bf16", "dpa4"), (V3, "bf16", "tp4-ep"),
    (KIMI, "bf16", "tp2-ep"), (KIMI, "bf16", "dpa4"),
    (V2L, "bf16", "tp4-ep"), (V2L, "bf16", "dpa4"), (V2L, "bf16", "dpa2-ep"),
]
VERIFIED = {(V3, "bf16", "tp4-ep"), (KIMI, "fp8", "dpa2"), (V2L, "bf16", "dpa4"), (V3, "fp8", "dpa2-ep-separate")}


def cid(c: tuple[Any, ...]) -> str:
    return "-".join(map(str, c))


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def par_converted(session_dir: Path, tiny_checkpoint: Callable[..., Path]) -> Callable[..., tuple[Path, Path]]:
    """par_converted(preset, fmt, mode) -> (source, converted dir), once per session."""
    cache: dict[tuple[str, str, str], tuple[Path, Path]] = {}

    def get(preset: str, fmt: str, mode: str) -> tuple[Path, Path]:
        key = (preset, fmt, mode)
        if key not in cache:
            src = tiny_checkpoint(preset, fmt)
            dst = session_dir / "parallel" / cid(key)
            atom_convert.convert(src, dst, "gfx950", **MODES[mode])
            cache[key] = (src, dst)
        return cache[key]

    return get


_BUILT: dict[tuple[Path, int], Any] = {}


def built(src: Path, tp: int, aiter: Any) -> Any:
    if (src, tp) not in _BUILT:
        _BUILT[(src, tp)] = Builder(source(src), "gfx950", tp, aiter[1].shuffle_weight).build()
    return _BUILT[(src, tp)]


def spec_slots(E: int, ep: int, rank: int, fused: bool) -> list[int]:
    """spec §1.2: rank r holds routed ids [r·E/ep, (r+1)·E/ep), then the shared expert (id E)."""
    per = E // ep
    return list(range(rank * per, (rank + 1) * per)) + ([E] if fused else [])


def spec_expert_map(E: int, ep: int, rank: int, fused: bool) -> list[int]:
    """spec §1.4 A: [32r+k] = k, [E] = shared slot, [E+1] = -1 sentinel, every other entry -1."""
    per = E // ep
    m = [-1] * E
    for k in range(per):
        m[rank * per + k] = k
    return m + ([per, -1] if fused else [])


def _expected(preset: str, mode: str, src: Path, aiter: Any, rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """Expected tensors of rank `rank`, per set (main / mtp), written from the spec."""
    kw = MODES[mode]
    tp, ep, dpa = kw["tp"], kw.get("ep", False), kw.get("dp_attention", False)
    separate = kw.get("shared_experts") == "separate"
    s = source(src)
    one = built(src, 1, aiter)
    full = built(src, tp, aiter) if (not dpa or not ep) else None
    fused = s.S == 1 and not separate
    out: dict[str, dict[str, torch.Tensor]] = {}
    for set_name, tensors in one.sets.items():
        exp: dict[str, torch.Tensor] = {}
        for name, e in tensors.items():
            if ".mlp.experts.w" in name:
                if ep:
                    ids = spec_slots(s.E, tp, rank, fused)
                    whole = e.per_rank[0]  # tp 1: E routed + the shared expert as slot E when fused
                    exp[name] = whole[ids] if whole.dim() == 3 else whole
                else:
                    exp[name] = full.sets[set_name][name].per_rank[rank]
            elif dpa:
                exp[name] = e.per_rank[0]
            else:
                exp[name] = full.sets[set_name][name].per_rank[rank]
        if separate:  # ATOM_FUSE_SHARED_EXPERT=0: the shared expert is a whole replicated MLP (spec §1.5)
            b = Builder(s, "gfx950", 1, aiter[1].shuffle_weight)
            b.cur = set_name
            for name in [n for n in tensors if n.endswith("mlp.gate.weight")]:
                op = name.removesuffix("mlp.gate.weight")
                sp = op.replace("mtp_block.", "")
                b.linear(sp, op, "mlp.shared_experts.gate_up_proj",
                         ["mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"], "col")
                b.linear(sp, op, "mlp.shared_experts.down_proj", ["mlp.shared_experts.down_proj"], "row")
            exp.update({n: x.per_rank[0] for n, x in b.exp.sets.get(set_name, {}).items()})
        out[set_name] = exp
    return out


@pytest.mark.parametrize("preset,fmt,mode", CASES, ids=[cid(c) for c in CASES])
def test_every_rank_equals_its_part(par_converted: Callable[..., tuple[Path, Path]], aiter: Any,
                                    preset: str, fmt: str, mode: str) -> None:
    src, dst = par_converted(preset, fmt, mode)
    kw = MODES[mode]
    tp, ep, dpa = kw["tp"], kw.get("ep", False), kw.get("dp_attention", False)
    s = source(src)
    fused = s.S == 1 and kw.get("shared_experts") != "separate"
    for rank in range(tp):
        want = _expected(preset, mode, src, aiter, rank)
        with atom_convert.open_converted(dst, rank=rank) as ck:
            sets = {"main": ck}
            if ck.mtp() is not None:
                sets["mtp"] = ck.mtp()
            assert set(sets) == set(want)
            for set_name, reader in sets.items():
                assert sorted(reader.keys()) == sorted(want[set_name]), set_name
                for name, w in want[set_name].items():
                    got = reader.get(name)
                    assert got.dtype == w.dtype and got.shape == w.shape, (rank, name, got.shape, w.shape)
                    assert torch.equal(u8(got), u8(w)), (rank, name)
            lay = ck.layout
            if ep and s.E:
                assert lay.slots == spec_slots(s.E, tp, rank, fused)
                assert lay.expert_map == spec_expert_map(s.E, tp, rank, fused)
                assert tuple(lay.routed) == (rank * s.E // tp, (rank + 1) * s.E // tp)
            else:
                assert lay.expert_map is None
            assert lay.attn_tp_rank == (0 if dpa else rank)


@pytest.mark.parametrize("preset,fmt,mode", CASES, ids=[cid(c) for c in CASES])
def test_common_files_and_manifest(par_converted: Callable[..., tuple[Path, Path]], preset: str, fmt: str,
                                   mode: str) -> None:
    """§3.1: a tensor identical on every rank is stored once, in a common file every rank maps;
    each rank file holds exactly that rank's own tensors; the manifest's parallel block."""
    src, dst = par_converted(preset, fmt, mode)
    kw = MODES[mode]
    tp, ep, dpa = kw["tp"], kw.get("ep", False), kw.get("dp_attention", False)
    s = source(src)
    for root in [dst] + ([dst / "mtp"] if (dst / "mtp").is_dir() else []):
        raw = json.loads((root / MANIFEST_NAME).read_text())
        assert raw["format_version"] == 5 and raw["tp_size"] == tp
        p = raw["parallel"]
        assert (p["tp"], p["dp"], p["ep"], p["dp_attention"]) == (tp, tp if dpa else 1, tp if ep else 1, dpa)
        assert (p["attn_tp"], p["moe_tp"]) == (1 if dpa else tp, 1 if ep else tp)
        separate = kw.get("shared_experts") == "separate"
        fused = s.S == 1 and not separate
        mode_name = "NONE" if not fused else "LOCAL_REPLICA" if (ep and dpa and kw.get("mori")) else "LEGACY_AITER"
        assert p["shared_expert_mode"] == mode_name
        m = Manifest.read(root)
        files_of: dict[str, set[str]] = {}
        for name, e in m.tensors.items():
            tp_split = any(name.endswith(x) for x in (".W_K", ".W_V", ".W_K_scale", ".W_V_scale", "embed_tokens.weight",
                                                      "lm_head.weight", "head.weight")) or any(
                f"{x}." in name for x in ("q_b_proj", "q_proj", "kv_b_proj", "o_proj", "gate_up_proj", "down_proj"))
            whole_everywhere = ".mlp.experts.w" not in name and (dpa or not tp_split)
            assert (e.placement == "common") == whole_everywhere, (name, e.placement)
            if e.placement == "common":
                assert len(set(e.rank_files)) == 1 and "-common-" in e.rank_files[0]
            else:
                assert len(set(e.rank_files)) == tp and all(f"-rank{r}-" in f for r, f in enumerate(e.rank_files))
            for f in set(e.rank_files):
                files_of.setdefault(f, set()).add(name)
        on_disk = {p.name for p in root.glob("*.safetensors")}
        assert on_disk == set(files_of)
        for f, names in files_of.items():
            with safe_open(str(root / f), "pt") as h:
                assert set(h.keys()) == names, f


@pytest.mark.parametrize("preset,fmt,mode", sorted(VERIFIED), ids=[cid(c) for c in sorted(VERIFIED)])
def test_verify_passes(par_converted: Callable[..., tuple[Path, Path]], preset: str, fmt: str, mode: str) -> None:
    src, dst = par_converted(preset, fmt, mode)
    r = verify(dst, src, tokens=8)
    assert r.ok, r.failures
    assert r.check.values_checked > 0 and len(r.rows) == 3 * source(src).n_layers + 2


# ------------------------------------------------------------------------------------------------
# MXFP4 (Quark) sources
# ------------------------------------------------------------------------------------------------

MX_CASES = [(V3, "tp2-ep"), (V3, "dpa2-ep"), (KIMI, "dpa2"), (KIMI, "tp2-ep")]
MX_MODES = {**MODES, "dpa2-ep": dict(tp=2, dp_attention=True, ep=True, mori=True)}  # LOCAL_REPLICA: MXFP4 only


@pytest.mark.parametrize("preset,mode", MX_CASES, ids=[cid(c) for c in MX_CASES])
def test_mxfp4_ranks_equal_tp1_by_expert_id(quark_checkpoint: Callable[..., Path], session_dir: Path,
                                            preset: str, mode: str) -> None:
    src = quark_checkpoint(preset, "template")
    root = session_dir / "parallel-mx"
    ref = {}
    for tp in (1, 2):
        ref[tp] = root / f"{preset}-plain-tp{tp}"
        if not ref[tp].exists():
            atom_convert.convert(src, ref[tp], "gfx950", tp=tp)
    dst = root / cid((preset, mode))
    kw = MX_MODES[mode]
    atom_convert.convert(src, dst, "gfx950", **kw)
    tp, ep, dpa = kw["tp"], kw.get("ep", False), kw.get("dp_attention", False)
    E = json.loads((src / "config.json").read_text())["n_routed_experts"]
    with atom_convert.open_converted(ref[1]) as one:
        for rank in range(tp):
            with atom_convert.open_converted(dst, rank) as ck, atom_convert.open_converted(ref[2], rank) as two:
                assert sorted(ck.keys()) == sorted(one.keys())
                for name in ck.keys():
                    got = ck.get(name)
                    if ".mlp.experts.w" in name and ep:
                        whole = one.get(name)
                        if got.dim() == 3:
                            ids = spec_slots(E, tp, rank, whole.shape[0] == E + 1)
                            want = whole[ids]
                        else:  # the 2-D e8m0 scale: one expert's contiguous row block per slot (§1.3)
                            w = one.get(name.removesuffix("_scale"))
                            n_slots = ck.get(name.removesuffix("_scale")).shape[0]
                            rows = whole.shape[0] // w.shape[0]
                            ids = spec_slots(E, tp, rank, w.shape[0] == E + 1)
                            assert len(ids) == n_slots
                            want = torch.cat([whole[i * rows:(i + 1) * rows] for i in ids])
                    elif ".mlp.experts.w" in name or not dpa:
                        want = two.get(name)
                    else:
                        want = one.get(name)
                    assert got.shape == want.shape and torch.equal(u8(got), u8(want)), (rank, name)
    r = verify(dst, src, tokens=8) if mode == "dpa2-ep" else None
    assert r is None or r.ok, r.failures if r else None


# ------------------------------------------------------------------------------------------------
# Refusals, and the manifest API
# ------------------------------------------------------------------------------------------------


def test_refusals(tiny_checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    v3 = tiny_checkpoint(V3, "fp8")
    kimi = tiny_checkpoint(KIMI, "fp8")
    with pytest.raises(UnsupportedError, match=r"n_routed_experts=12 is not divisible by the expert-parallel size 8"):
        atom_convert.convert(kimi, tmp_path / "a", tp=8, dp_attention=True, ep=True)
    with pytest.raises(UnsupportedError, match=r"n_routed_experts=8 .* size 3 .*E % ep == 0"):
        atom_convert.convert(v3, tmp_path / "b", tp=3, dp_attention=True, ep=True)
    with pytest.raises(BadInputError, match="--ep needs --tp 2 or more"):
        atom_convert.convert(v3, tmp_path / "c", tp=1, ep=True)
    with pytest.raises(UnsupportedError, match="--shared-experts separate .* only honours it with --dp-attention"):
        atom_convert.convert(v3, tmp_path / "d", tp=2, ep=True, shared_experts="separate")
    with pytest.raises(UnsupportedError, match="LOCAL_REPLICA.*NotImplementedError.*fp8-block.*--shared-experts separate"):
        atom_convert.convert(v3, tmp_path / "e", tp=2, dp_attention=True, ep=True, mori=True)
    with pytest.raises(BadInputError, match="--mori only changes the layout under --dp-attention"):
        atom_convert.convert(v3, tmp_path / "f", tp=2, ep=True, mori=True)
    assert not any(tmp_path.iterdir())  # nothing half-written
    with pytest.raises(SystemExit) as ex:
        main(["convert", str(kimi), str(tmp_path / "g"), "--tp", "8", "--dp-attention", "--ep"])
    assert ex.value.code == 2 and "E % ep == 0" in capsys.readouterr().err


def test_manifest_differences_and_v1(par_converted: Callable[..., tuple[Path, Path]], converted: Callable[..., Path],
                                     tmp_path: Path) -> None:
    _, dst = par_converted(V3, "bf16", "tp4-ep")
    m = Manifest.read(dst)
    right = dict(target="gfx950", tp=4, ep=4, dp=1, dp_attention=False, moe_tp=1, attn_tp=4,
                 shared_expert_mode="LEGACY_AITER", flags={"ATOM_FUSE_SHARED_EXPERT": 1})
    assert m.differences(rank=2, expert_map=spec_expert_map(8, 4, 2, True), slots=[4, 5, 8], **right) == []
    wrong = m.differences(rank=2, tp=8, dp_attention=True, expert_map=spec_expert_map(8, 4, 1, True),
                          flags={"ATOM_FUSE_SHARED_EXPERT": 0}, tpp=4)
    assert len(wrong) == 5
    assert any(w.startswith("tp: the manifest says 4, declared 8") for w in wrong)
    assert any("dp_attention" in w for w in wrong) and any(w.startswith("rank 2 expert_map") for w in wrong)
    assert any("flag ATOM_FUSE_SHARED_EXPERT" in w for w in wrong) and any(w.startswith("tpp:") for w in wrong)
    assert m.differences(expert_map=[0]) == ["expert_map: needs a rank in [0, 4), got None"]

    # A version 1 directory (plain TP) still opens, and reads back the split records version 2 writes.
    plain = converted(V3, "fp8", "gfx950", 2)
    v1 = tmp_path / "v1"
    import shutil

    shutil.copytree(plain, v1)
    raw = json.loads((v1 / MANIFEST_NAME).read_text())
    for root in (v1, v1 / "mtp"):
        r = json.loads((root / MANIFEST_NAME).read_text())
        new = Manifest.read(plain if root == v1 else plain / "mtp")
        r["format_version"] = 1
        for meta in r["files"].values():  # version 1 and 2 list sha256 digests (store/digest.py)
            meta["sha256"] = "0" * 64
            del meta["xxh3_blocks"]
        r.pop("parallel")
        for e in r["tensors"].values():
            del e["placement"], e["split"]
        (root / MANIFEST_NAME).write_text(json.dumps(r))
        old = Manifest.read(root)
        assert old.format_version == 1
        assert {n: e.split for n, e in old.tensors.items()} == {n: e.split for n, e in new.tensors.items()}
        assert old.parallel == new.parallel
    with atom_convert.open_converted(v1, rank=1) as ck, atom_convert.open_converted(plain, rank=1) as ref:
        for name in list(raw["tensors"])[:20]:
            assert torch.equal(u8(ck.get(name)), u8(ref.get(name)))


def test_inspect_bytes_per_rank_at_tp8(par_converted: Callable[..., tuple[Path, Path]]) -> None:
    """At 8 GPUs (DP-attention + EP; tiny heads cannot be split 8 ways) every rank reads exactly
    the bytes it needs: its own file and the common ones, counted once. Computed here from the
    safetensors headers on disk, and compared with `inspect`."""
    _, dst = par_converted(V3, "fp8", "dpa8-ep")
    info = describe(dst)
    per = info["bytes per rank"]
    for r in range(8):
        need = read = 0
        for root in (dst, dst / "mtp"):
            raw = json.loads((root / MANIFEST_NAME).read_text())
            files = {e["rank_files"][r] for e in raw["tensors"].values()}
            for f in files:
                with safe_open(str(root / f), "pt") as h:
                    read += sum(u8(h.get_tensor(k)).numel() for k in h.keys())
            need += sum(_entry_bytes(e) for e in raw["tensors"].values())
        assert read == need and per[f"rank {r}"]["read/need"] == 1.0
        assert per[f"rank {r}"]["reads"] == read and per[f"rank {r}"]["needs"] == need
    assert info["parallel"]["mode"] == "DP-attention + EP 8"
    assert info["parallel"]["expert slots per rank"]["rank 3"] == "3-3 + shared"


def _entry_bytes(e: dict[str, Any]) -> int:
    n = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "uint8": 1}[e["dtype"]]
    for d in e["shape"]:
        n *= d
    return n


# ------------------------------------------------------------------------------------------------
# --profile vllm-plugin (atom-layout-plugin.md)
# ------------------------------------------------------------------------------------------------


def plugin_name(native: str) -> str:
    """atom-layout-plugin.md §1.1-§1.2 at HEAD: one `model.` prefix, W_K/W_V directly on `mla_attn`."""
    return "model." + native.replace(".self_attn.mla_attn.impl.", ".self_attn.mla_attn.")


def test_vllm_plugin_profile(par_converted: Callable[..., tuple[Path, Path]], tmp_path: Path) -> None:
    """The same bytes, files, splits and parallel block as the native conversion; every name,
    alias (both sides) and per-layer shared-expert record renamed; verify passes on it."""
    src, native = par_converted(V3, "fp8", "tp2-ep")
    dst = tmp_path / "plugin"
    atom_convert.convert(src, dst, "gfx950", tp=2, ep=True, profile="vllm-plugin")
    for a_root, b_root in ((native, dst), (native / "mtp", dst / "mtp")):
        a = json.loads((a_root / MANIFEST_NAME).read_text())
        b = json.loads((b_root / MANIFEST_NAME).read_text())
        assert b["layout"]["profile"] == "vllm-plugin" and a["layout"]["profile"] == "atom"
        assert list(b["tensors"]) == [plugin_name(n) for n in a["tensors"]]
        for n, e in a["tensors"].items():
            assert b["tensors"][plugin_name(n)] == e, n
        assert b["aliases"] == {plugin_name(k): plugin_name(v) for k, v in a["aliases"].items()}
        assert b["model"]["moe_layers"] == {plugin_name(k): v for k, v in a["model"]["moe_layers"].items()}
        assert b["parallel"] == a["parallel"]
    assert "model.model.layers.1.self_attn.mla_attn.W_K" in json.loads((dst / MANIFEST_NAME).read_text())["tensors"]
    assert json.loads((dst / MANIFEST_NAME).read_text())["aliases"] == {
        f"model.model.layers.{i}.mlp.experts.e_score_correction_bias": f"model.model.layers.{i}.mlp.gate.e_score_correction_bias"
        for i in (1, 2)}
    for rank in range(2):
        with atom_convert.open_converted(native, rank) as x, atom_convert.open_converted(dst, rank) as y:
            for n in x.keys():
                assert torch.equal(u8(x.get(n)), u8(y.get(plugin_name(n)))), n
            for n in x.aliases:
                assert torch.equal(u8(x.get(n)), u8(y.get(plugin_name(n))))
    r = verify(dst, src, tokens=8)
    assert r.ok, r.failures
    with pytest.raises(UnsupportedError, match="forces enable_dp_attention off"):
        atom_convert.convert(src, tmp_path / "no", tp=2, dp_attention=True, profile="vllm-plugin")
