"""DeepSeek-V3.2 (DeepseekV32ForCausalLM, deepseek_v32): every converted tensor, byte for byte,
against expectations built here from the source files and atom-layout-next.md §1.

The V3 part of every layer (and of the MTP block) is test_layout.py's independent Builder (plain
TP: source slices, fnuz by bytes, aiter's own shuffle_weight, W_K/W_V by index maps); the indexer
is added here from the spec (§1.2-§1.6), independently of atom_convert:
- wq_b: q_b_proj's per_1x128 post-load (fnuz + scale x2 on gfx942, shuffle16), replicated;
- fused wk_weights_proj.weight: rows [0, Dh) = bf16(fp32(wk) * fp32(scale[i // 128, j // 128])) on
  the e4m3fn bytes (no fnuz), rows [Dh, Dh + Ih) = weights_proj in bf16; unshuffled; replicated;
- wk_weights_proj.weight_scale: the raw checkpoint wk scale (fp32, not doubled on gfx942), zeros for
  a bf16 source (ATOM leaves it torch.empty);
- unfused (index_head_dim != 128): wk as wq_b, weights_proj bf16;
- k_norm.weight / .bias: fp32.
Fixtures: tests/v32_fixtures.py (transformers' own DeepseekV32ForCausalLM; hand-written MTP layer).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import atom_convert
import test_layout as TL
from atom_convert.errors import CheckpointError, UnsupportedError
from v32_fixtures import build_v32

FORMATS = ("bf16", "fp8")
TARGETS = ("gfx950", "gfx942")
TPS = (1, 2)
CASES = [(f, t, tp) for f in FORMATS for t in TARGETS for tp in TPS]
F32, BF16, FN = torch.float32, torch.bfloat16, torch.float8_e4m3fn
IDX = "self_attn.indexer."
FLAG = "ATOM_ENABLE_DS_INDEXER_QK_ROPE_CACHE_FUSION"


# ------------------------------------------------------------------------------------------------
# Expected tensors: test_layout's V3 builder plus the indexer, written from the spec
# ------------------------------------------------------------------------------------------------


class V32Builder(TL.Builder):
    def __init__(self, src: TL.Source, target: str, tp: int, shuffle_weight):
        super().__init__(src, target, tp, shuffle_weight)
        c = src.config
        self.Ih, self.Dh = c["index_n_heads"], c["index_head_dim"]
        self.fused = self.Dh == 128 and src.R == 64  # §1.2 conditions at the default flags

    def mla(self, sp: str, op: str) -> None:
        super().mla(sp, op)
        self.indexer(sp, op)

    def rep(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t] * self.tp

    def indexer(self, sp: str, op: str) -> None:
        s = self.s
        self.linear(sp, op, IDX + "wq_b", [IDX + "wq_b"], "rep")  # never TP-sliced (§1.2)
        wk, wp = f"{sp}{IDX}wk", f"{sp}{IDX}weights_proj"
        assert s[wp + ".weight"].dtype == BF16 and f"{wp}.weight_scale_inv" not in s  # bf16 in the release
        if self.fused:
            fp8 = s.is_fp8(wk)
            rows = s.dequant_bf16(wk) if fp8 else s[wk + ".weight"]
            assert rows.dtype == BF16 and rows.shape == (self.Dh, s.H)
            w = torch.cat([rows, s[wp + ".weight"].to(BF16)], 0)
            srcs = [wk + ".weight"] + ([wk + ".weight_scale_inv"] if fp8 else []) + [wp + ".weight"]
            self.add(f"{op}{IDX}wk_weights_proj.weight", self.rep(w), srcs)
            sc = s[wk + ".weight_scale_inv"].clone() if fp8 else torch.zeros(TL.cdiv(self.Dh, 128), TL.cdiv(s.H, 128))
            assert sc.dtype == F32
            self.add(f"{op}{IDX}wk_weights_proj.weight_scale", self.rep(sc), [wk + ".weight_scale_inv"] if fp8 else [])
        else:
            self.linear(sp, op, IDX + "wk", [IDX + "wk"], "rep")
            self.add(f"{op}{IDX}weights_proj.weight", self.rep(s[wp + ".weight"]), [wp + ".weight"])
        for p in ("k_norm.weight", "k_norm.bias"):
            self.add(f"{op}{IDX}{p}", self.rep(s[f"{sp}{IDX}{p}"].to(F32)), [f"{sp}{IDX}{p}"])


@dataclass
class Case:
    preset: str
    fmt: str
    target: str
    tp: int
    src: TL.Source
    out: Path
    exp: TL.Expected

    def dir_of(self, set_name: str) -> Path:
        return self.out if set_name == "main" else self.out / "mtp"


# ------------------------------------------------------------------------------------------------
# Fixtures
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """(conftest.one_torch_thread for every test here)"""


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("v32")


@pytest.fixture(scope="module")
def v32_src(work: Path) -> Callable[..., Path]:
    """v32_src(fmt, variant="tiny") -> a source folder, built once (fp8: 2 shards with an index)."""
    cache: dict[tuple[str, str], Path] = {}
    variants: dict[str, dict[str, Any]] = {
        "tiny": {},
        "unfused": {"index_head_dim": 192},  # != 128: ATOM builds wk and weights_proj apart (§1.2)
        "h320": {"hidden_size": 320, "num_nextn_predict_layers": 0},  # fp8 wk [128, 320]: ATOM raises (§6)
    }

    def get(fmt: str, variant: str = "tiny") -> Path:
        key = (fmt, variant)
        if key not in cache:
            cache[key] = build_v32(work / "src" / f"{variant}-{fmt}", fmt=fmt, seed=17 + len(cache),
                                   shards=2 if fmt == "fp8" else 1, overrides=variants[variant])
        return cache[key]

    return get


@pytest.fixture(scope="module")
def v32_out(work: Path, v32_src) -> Callable[..., Path]:
    cache: dict[tuple[Any, ...], Path] = {}

    def get(fmt: str, target: str, tp: int, variant: str = "tiny", **opts: Any) -> Path:
        key = (fmt, target, tp, variant, tuple(sorted(opts.items())))
        if key not in cache:
            tag = "-".join(f"{k}" for k, v in sorted(opts.items()) if v)
            dst = work / "out" / f"{variant}-{fmt}-{target}-tp{tp}{'-' + tag if tag else ''}"
            atom_convert.convert(v32_src(fmt, variant), dst, target=target, tp=tp, **opts)
            cache[key] = dst
        return cache[key]

    return get


@pytest.fixture(scope="module", params=CASES, ids=["-".join(map(str, c)) for c in CASES])
def case(request, v32_src, v32_out, aiter) -> Case:
    fmt, target, tp = request.param
    src = TL.Source(v32_src(fmt))
    exp = V32Builder(src, target, tp, aiter[1].shuffle_weight).build()
    return Case("tiny-deepseek-v32", fmt, target, tp, src, v32_out(fmt, target, tp), exp)


# ------------------------------------------------------------------------------------------------
# Byte-exact layout (every rank, main and MTP sets)
# ------------------------------------------------------------------------------------------------


def test_fixture_is_real_v32(case: Case):
    """The source holds what the release holds (§1.1): five indexer tensors per layer, MTP included;
    fp8 wq_b/wk with block scales; bf16 weights_proj; e4m3fn byte 0x80 in wq_b and wk."""
    s, n = case.src, case.src.n_layers + case.src.n_mtp
    assert case.src.config["architectures"] == ["DeepseekV32ForCausalLM"] and case.src.n_mtp == 1
    for i in range(n):
        p = f"model.layers.{i}.{IDX}"
        have = sorted(k[len(p):] for k in s.t if k.startswith(p))
        want = ["k_norm.bias", "k_norm.weight", "weights_proj.weight", "wk.weight", "wq_b.weight"]
        if case.fmt == "fp8":
            want += ["wk.weight_scale_inv", "wq_b.weight_scale_inv"]
            for m in ("wq_b", "wk"):
                assert s[f"{p}{m}.weight"].dtype == FN and bool((s[f"{p}{m}.weight"].view(torch.uint8) == 0x80).any())
        assert have == sorted(want), i
        assert s[f"{p}weights_proj.weight"].dtype == BF16


def test_every_tensor_byte_exact(case: Case):
    TL.test_every_tensor_byte_exact(case)


def test_manifest_entries_match_files(case: Case):
    TL.test_manifest_entries_match_files(case)


def test_manifest_files_sizes_and_hashes(case: Case):
    TL.test_manifest_files_sizes_and_hashes(case)


def test_every_source_tensor_accounted_for(case: Case):
    TL.test_every_source_tensor_accounted_for(case)


def test_open_converted_same_bytes_and_alias(case: Case):
    TL.test_open_converted_same_bytes_and_alias(case)


def test_mla_operands_recombine_to_kv_b(case: Case):
    TL.test_mla_operands_recombine_to_kv_b(case)


def test_indexer_rules(case: Case):
    """Read off the manifest and files (§1.5, §7.1): per layer exactly six indexer tensors; wq_b fp8 of the
    target and shuffled (bf16 unshuffled for a bf16 source); wk_weights_proj bf16 [Dh + Ih, H] unshuffled and
    its fp32 scale; k_norm fp32; all replicated, identical on every rank; the fusion flag recorded."""
    fp8 = str(TL.FP8_OF[case.target]).removeprefix("torch.")
    q = case.fmt == "fp8"
    c = case.src.config
    H, Ih, Dh = c["hidden_size"], c["index_n_heads"], c["index_head_dim"]
    want = {"wq_b.weight": ((fp8 if q else "bfloat16"), [Ih * Dh, c["q_lora_rank"]], q),
            "wk_weights_proj.weight": ("bfloat16", [Dh + Ih, H], False),
            "wk_weights_proj.weight_scale": ("float32", [TL.cdiv(Dh, 128), TL.cdiv(H, 128)], False),
            "k_norm.weight": ("float32", [Dh], False), "k_norm.bias": ("float32", [Dh], False)}
    if q:
        want["wq_b.weight_scale"] = ("float32", [TL.cdiv(Ih * Dh, 128), TL.cdiv(c["q_lora_rank"], 128)], False)
    layers = 0
    for set_name in case.exp.sets:
        d = case.dir_of(set_name)
        m = json.loads((d / TL.MANIFEST).read_text())
        assert m["layout"]["flags"][FLAG] == 1
        ranks = [TL._rank_tensors(case, set_name, r) for r in range(case.tp)]
        per_layer: dict[str, dict[str, Any]] = {}
        for name, e in m["tensors"].items():
            if f".{IDX}" in name:
                layer, leaf = name.split(f".{IDX}")
                per_layer.setdefault(layer, {})[leaf] = e
                assert e["split"] == {"kind": "replicated", "ways": 1}, name
                assert all(torch.equal(TL.u8(ranks[0][name]), TL.u8(t[name])) for t in ranks[1:]), name
        for layer, got in per_layer.items():
            assert {k: (e["dtype"], e["shape"], e["is_shuffled"]) for k, e in got.items()} == want, layer
            if set_name == "mtp":
                assert ".mtp_block" in layer
            layers += 1
        if q:  # the indexer's wk is not fp8 at run time (§7.1) and wq_b is fnuz-fixed on gfx942
            for t in ranks[0].values():
                if t.dtype == TL.FNUZ:
                    assert not bool((t.view(torch.uint8) == 0x80).any())
    assert layers == case.src.n_layers + case.src.n_mtp


def test_wk_keeps_negative_zero_and_e4m3fn_values(case: Case):
    """The fused rows are the e4m3fn checkpoint values dequantised (on gfx942 too: ATOM dequantises before
    any fnuz step, §1.3), so the fixture's -0 codes (0x80) come out as bf16 -0.0 (0x8000)."""
    if case.fmt != "fp8":
        pytest.skip("bf16 source: wk copied as is")
    got = TL._rank_tensors(case, "main", case.tp - 1)
    for i in range(case.src.n_layers):
        w = got[f"model.layers.{i}.{IDX}wk_weights_proj.weight"]
        src = case.src[f"model.layers.{i}.{IDX}wk.weight"]
        neg0 = src.view(torch.uint8) == 0x80
        assert bool(neg0.any())
        assert bool((w[:src.shape[0]].view(torch.int16)[neg0] == -0x8000).all())


# ------------------------------------------------------------------------------------------------
# Every parallel mode: the V3 part equals a DeepSeek-V3 conversion of the same tensors
# ------------------------------------------------------------------------------------------------


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _rewrite(src: Path, dst: Path, *, drop: Callable[[str], bool] = lambda n: False,
             add: dict[str, torch.Tensor] | None = None, cfg: dict[str, Any] | None = None,
             cfg_drop: tuple[str, ...] = ()) -> Path:
    """A copy of `src` in one file, without the tensors `drop` names, with `add`, config patched."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    t = {k: v for k, v in _tensors(src).items() if not drop(k)}
    t.update(add or {})
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    c = json.loads((src / "config.json").read_text())
    c.update(cfg or {})
    for k in cfg_drop:
        c.pop(k, None)
    (dst / "config.json").write_text(json.dumps(c, indent=2))
    return dst


V3_TWIN = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
MODES = [("fp8", "gfx950", 1, {}), ("fp8", "gfx942", 2, {}), ("fp8", "gfx950", 2, {"ep": True}),
         ("fp8", "gfx950", 2, {"dp_attention": True}), ("fp8", "gfx942", 2, {"ep": True, "dp_attention": True}),
         ("bf16", "gfx950", 2, {"ep": True}), ("bf16", "gfx942", 2, {"dp_attention": True})]


@pytest.mark.parametrize("fmt,target,tp,opts", MODES, ids=["-".join([m[0], m[1], f"tp{m[2]}", *m[3]]) for m in MODES])
def test_parallel_modes_match_v3_plus_replicated_indexer(fmt, target, tp, opts, work, v32_src, v32_out, aiter):
    """Under EP and DP-attention the non-indexer tensors are exactly DeepSeek-V3's (§1.5): byte-equal, per
    rank, to a V3 conversion of the same checkpoint without its indexer; the indexer tensors are the tp-1
    expectation on every rank, in the common files wherever the layout has them (atom-parallel.md §3.1)."""
    src = v32_src(fmt)
    out = v32_out(fmt, target, tp, **opts)
    twin_src = work / "twin" / f"{fmt}"
    if not twin_src.exists():
        _rewrite(src, twin_src, drop=lambda n: f".{IDX}" in n, cfg=V3_TWIN, cfg_drop=("index_n_heads",
                 "index_head_dim", "index_topk"))
    twin = work / "twin-out" / out.name
    if not twin.exists():
        atom_convert.convert(twin_src, twin, target=target, tp=tp, **opts)
    exp = V32Builder(TL.Source(src), target, 1, aiter[1].shuffle_weight).build()
    m = json.loads((out / TL.MANIFEST).read_text())
    mt = json.loads((twin / TL.MANIFEST).read_text())
    assert m["parallel"] == mt["parallel"]
    assert m["layout"]["flags"] == dict(mt["layout"]["flags"], **{FLAG: 1})
    for r in range(tp):
        with atom_convert.open_converted(out, rank=r) as ck, atom_convert.open_converted(twin, rank=r) as tw:
            for mine, theirs, set_name in ((ck, tw, "main"), (ck.mtp(), tw.mtp(), "mtp")):
                names = set(mine.keys())
                idx = {n for n in names if f".{IDX}" in n}
                assert names - idx == set(theirs.keys())
                assert idx == set(exp.sets[set_name]) - set(theirs.keys())
                for n in names - idx:
                    a, b = mine.get(n), theirs.get(n)
                    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(TL.u8(a), TL.u8(b)), (r, n)
                    ea, eb = mine.entry(n), theirs.entry(n)
                    assert (ea["split"], ea["placement"], ea["is_shuffled"]) == \
                        (eb["split"], eb["placement"], eb["is_shuffled"]), n
                for n in idx:
                    t, want = mine.get(n), exp.sets[set_name][n].per_rank[0]
                    assert t.dtype == want.dtype and torch.equal(TL.u8(t), TL.u8(want)), (r, n)
                    e = mine.entry(n)
                    assert e["split"]["kind"] == "replicated"
                    assert e["placement"] == ("common" if m["parallel"]["common_files"] else "per_rank"), n


# ------------------------------------------------------------------------------------------------
# Unfused indexer (index_head_dim != 128): wk fp8 like wq_b, weights_proj bf16
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target,tp", [("gfx950", 1), ("gfx942", 2)])
def test_unfused_indexer_byte_exact(target, tp, v32_src, v32_out, aiter):
    src = TL.Source(v32_src("fp8", "unfused"))
    c = Case("unfused", "fp8", target, tp, src, v32_out("fp8", target, tp, "unfused"),
             V32Builder(src, target, tp, aiter[1].shuffle_weight).build())
    names = set(c.exp.sets["main"])
    assert f"model.layers.0.{IDX}wk.weight" in names and f"model.layers.0.{IDX}weights_proj.weight" in names
    assert not any("wk_weights_proj" in n for n in names)
    TL.test_every_tensor_byte_exact(c)
    TL.test_manifest_entries_match_files(c)


# ------------------------------------------------------------------------------------------------
# Refusals (atom-layout-next.md §6) and the recorded flag
# ------------------------------------------------------------------------------------------------


def test_fp8_wk_not_whole_blocks_refused(v32_src, work):
    with pytest.raises(UnsupportedError, match=r"indexer\.wk.*multiples of 128.*modules_to_not_convert"):
        atom_convert.convert(v32_src("fp8", "h320"), work / "refused-h320", target="gfx950")
    # the same dims in bf16 convert (ATOM copies a bf16 wk as is)
    atom_convert.convert(v32_src("bf16", "h320"), work / "ok-h320-bf16", target="gfx950")


def test_layer_without_indexer_refused(v32_src, work):
    bad = _rewrite(v32_src("bf16"), work / "bad" / "no-indexer-1", drop=lambda n: n.startswith(f"model.layers.1.{IDX}"))
    with pytest.raises(UnsupportedError, match=r"layer\(s\) 1 hold no self_attn\.indexer\.\* tensor.*every layer"):
        atom_convert.convert(bad, work / "refused-no-indexer", target="gfx950")


@pytest.mark.parametrize("missing", ["k_norm.bias", "weights_proj.weight", "wk.weight_scale_inv", "wq_b.weight"])
def test_missing_indexer_tensor_refused(missing, v32_src, work):
    name = f"model.layers.0.{IDX}{missing}"
    bad = _rewrite(v32_src("fp8"), work / "bad" / f"missing-{missing}", drop=lambda n: n == name)
    with pytest.raises(CheckpointError, match=rf"missing tensor {name.replace('.', '[.]')}"):
        atom_convert.convert(bad, work / f"refused-{missing}", target="gfx950")


def test_missing_mtp_indexer_refused_unless_no_mtp(v32_src, work):
    name = f"model.layers.2.{IDX}k_norm.weight"
    bad = _rewrite(v32_src("bf16"), work / "bad" / "mtp-no-knorm", drop=lambda n: n == name)
    with pytest.raises(CheckpointError, match=rf"missing tensor {name.replace('.', '[.]')}"):
        atom_convert.convert(bad, work / "refused-mtp-knorm", target="gfx950")
    atom_convert.convert(bad, work / "ok-no-mtp", target="gfx950", mtp=False)


def test_quantized_weights_proj_refused(v32_src, work):
    p = f"model.layers.0.{IDX}weights_proj"
    bad = _rewrite(v32_src("fp8"), work / "bad" / "wp-scale", add={p + ".weight_scale_inv": torch.ones(1, 2)})
    with pytest.raises(CheckpointError, match=r"weights_proj unquantized"):
        atom_convert.convert(bad, work / "refused-wp", target="gfx950")


def test_v3_config_with_index_topk_refused(v32_src, work):
    bad = _rewrite(v32_src("bf16"), work / "bad" / "v3-index", cfg=V3_TWIN)
    with pytest.raises(UnsupportedError, match=r"index_topk is set but the architecture is DeepseekV3ForCausalLM"):
        atom_convert.convert(bad, work / "refused-v3-index", target="gfx950")


def test_v32_without_index_keys_refused(v32_src, work):
    bad = _rewrite(v32_src("bf16"), work / "bad" / "no-index-keys", cfg_drop=("index_topk",))
    with pytest.raises(CheckpointError, match=r"missing required key 'index_topk'"):
        atom_convert.convert(bad, work / "refused-no-keys", target="gfx950")


def test_other_formats_refused(v32_src, work):
    from atom_convert.synth import quark_mxfp4_config

    bad = _rewrite(v32_src("bf16"), work / "bad" / "quark", cfg={"quantization_config": quark_mxfp4_config(["lm_head"])})
    with pytest.raises(UnsupportedError, match=r"DeepSeek-V3\.2 from its bf16 or DeepSeek fp8 block release only"):
        atom_convert.convert(bad, work / "refused-quark", target="gfx950")


def test_runtime_with_unfused_flag_refused(v32_out, monkeypatch):
    """A runtime with ATOM_ENABLE_DS_INDEXER_QK_ROPE_CACHE_FUSION=0 builds wk and weights_proj apart (§1.8):
    the recorded flag makes the manifest check refuse it (§6); unset counts as ATOM's default 1."""
    from atom_convert.runtime.common import live_flags
    from atom_convert.store.manifest import Manifest

    m = Manifest.read(v32_out("fp8", "gfx950", 1))
    monkeypatch.delenv(FLAG, raising=False)
    assert m.differences(flags=live_flags(m.flags)) == []
    monkeypatch.setenv(FLAG, "0")
    assert m.differences(flags=live_flags(m.flags)) == [f"flag {FLAG}: the manifest says 1, declared 0"]


# ------------------------------------------------------------------------------------------------
# --profile vllm-plugin: ATOM inside vLLM (atom/plugin/vllm at ffdf3bb5d)
# ------------------------------------------------------------------------------------------------
# What the plugin holds, read from ATOM's code (independently of atom_convert's profile table):
# - vLLM's root is ATOMMoEForCausalLM (register.py 27), whose `model` is ATOM's DeepseekV3ForCausalLM for
#   V3.2 (model_wrapper.py 147, 503-510): one `model.` before every native name;
# - the attention's `mla_attn` is AttentionForVllmSparseMLA (attention/layer.py 70-77), ATOM's MLAAttention
#   itself (`impl` returns self, layer_mla.py 320-322): W_K/W_V/their scales on `...self_attn.mla_attn`;
# - the indexer is the native Indexer at `self_attn.indexer` (deepseek_v2.py 2607-2629): the same tensors,
#   dtypes, shapes and bytes. The plugin's extra excludes (`*.indexer.weights_proj`,
#   `*.indexer.wk_weights_proj`, deepseek_v2.py 3426-3432) name modules built with quant_config=None anyway
#   and leave `indexer.wk` (the fusion test, 321-347) alone: still fused, bf16, with the vestigial scale;
# - the MTP drafter is ATOM's DeepSeekMTP (model_wrapper.py 150), the native drafter's tree, under `model.`.
PLUGIN_CASES = [("fp8", "gfx950", 1), ("fp8", "gfx942", 2), ("bf16", "gfx950", 2)]


def plugin_name(native: str) -> str:
    return "model." + native.replace(".mla_attn.impl.", ".mla_attn.")


def plugin_expected(exp: TL.Expected) -> TL.Expected:
    """A native expectation (V32Builder, GlmBuilder) under the plugin's names: same tensors, same bytes."""
    out = TL.Expected()
    out.sets = {s: {plugin_name(k): v for k, v in t.items()} for s, t in exp.sets.items()}
    out.aliases = {s: {plugin_name(a): plugin_name(t) for a, t in al.items()} for s, al in exp.aliases.items()}
    out.wkvb = {plugin_name(k): v for k, v in exp.wkvb.items()}
    return out


@pytest.fixture(scope="module", params=PLUGIN_CASES, ids=["-".join(map(str, c)) for c in PLUGIN_CASES])
def plugin_case(request, v32_src, v32_out, aiter) -> Case:
    fmt, target, tp = request.param
    src = TL.Source(v32_src(fmt))
    exp = plugin_expected(V32Builder(src, target, tp, aiter[1].shuffle_weight).build())
    return Case("tiny-deepseek-v32", fmt, target, tp, src, v32_out(fmt, target, tp, profile="vllm-plugin"), exp)


def test_plugin_every_tensor_byte_exact(plugin_case: Case):
    TL.test_every_tensor_byte_exact(plugin_case)
    TL.test_manifest_entries_match_files(plugin_case)
    TL.test_every_source_tensor_accounted_for(plugin_case)


def test_plugin_open_converted_and_mla_operands(plugin_case: Case):
    TL.test_open_converted_same_bytes_and_alias(plugin_case)
    TL.test_mla_operands_recombine_to_kv_b(plugin_case)


def test_plugin_indexer_names(plugin_case: Case, v32_out):
    """The plugin's module paths, spelled out: per layer (and the drafter's mtp_block) the six (bf16: five)
    indexer tensors under `model.model.layers.{i}.self_attn.indexer.`, W_K/W_V on `mla_attn` itself, no
    `.impl.` and no `mla_attn.indexer` name (the plugin's MLA layer keeps no indexer alias); the flags
    and indexer layers as native; DP-attention off."""
    c = plugin_case
    n = c.src.n_layers
    leaves = {"wq_b.weight", "wk_weights_proj.weight", "wk_weights_proj.weight_scale", "k_norm.weight", "k_norm.bias"}
    if c.fmt == "fp8":
        leaves.add("wq_b.weight_scale")
    native = json.loads((v32_out(c.fmt, c.target, c.tp) / TL.MANIFEST).read_text())
    for set_name, layers, block in (("main", range(n), ""), ("mtp", [n], "mtp_block.")):
        m = json.loads((c.dir_of(set_name) / TL.MANIFEST).read_text())
        assert m["layout"]["profile"] == "vllm-plugin" and m["layout"]["flags"][FLAG] == 1
        assert m["parallel"]["dp_attention"] is False
        names = set(m["tensors"])
        for i in layers:
            base = f"model.model.layers.{i}.{block}self_attn."
            assert {x[len(base + "indexer."):] for x in names if x.startswith(base + "indexer.")} == leaves, i
            assert {base + f"mla_attn.{w}" for w in ("W_K", "W_K_scale", "W_V", "W_V_scale")} <= names, i
        assert all(x.startswith("model.model.") or x == "model.lm_head.weight" for x in names)
        assert not any(".impl." in x or ".mla_attn.indexer." in x for x in names)
        assert m["model"]["indexer_layers"] == list(range(n + 1))
        if set_name == "main":
            assert m["layout"]["flags"] == native["layout"]["flags"]
            assert m["model"] == {k: ({plugin_name(a): b for a, b in v.items()} if k == "moe_layers" else v)
                                  for k, v in native["model"].items()}


def test_plugin_dp_attention_refused(v32_src, work):
    with pytest.raises(UnsupportedError, match="forces enable_dp_attention off"):
        atom_convert.convert(v32_src("bf16"), work / "refused-plugin-dpa", target="gfx950", tp=2,
                             dp_attention=True, profile="vllm-plugin")


def test_other_plugin_profile_refused(v32_src, work, monkeypatch):
    """A profile other than the two modelled (e.g. an SGLang-style plugin, which replaces the MLA post-load
    step) is refused with the reason, naming the profiles that work."""
    from atom_convert.layout import profile as P

    monkeypatch.setitem(P.PROFILES, "sglang-plugin", P.NamingProfile("sglang-plugin", "test", "model.", "mla_attn"))
    with pytest.raises(UnsupportedError, match=r"--profile sglang-plugin.*native server and its vLLM plugin only.*"
                                               r"--profile atom or --profile vllm-plugin"):
        atom_convert.convert(v32_src("bf16"), work / "refused-sglang", target="gfx950", profile="sglang-plugin")


@pytest.mark.parametrize("fmt,target,tp", [("fp8", "gfx942", 2)])
def test_plugin_verify_source_passes(fmt, target, tp, v32_src, v32_out):
    from atom_convert.check.verify import verify

    r = verify(v32_out(fmt, target, tp, profile="vllm-plugin"), v32_src(fmt))
    assert r.ok, r.failures


@pytest.mark.parametrize("fmt,target,tp", [("fp8", "gfx942", 2), ("bf16", "gfx950", 1)])
def test_verify_source_passes(fmt, target, tp, v32_src, v32_out):
    """verify --source on a V3.2 conversion: the bf16 wk_weights_proj is compared as bf16 (before, its
    vestigial fp32 scale was applied to it and verify stopped with an internal error)."""
    from atom_convert.check.verify import verify

    r = verify(v32_out(fmt, target, tp), v32_src(fmt))
    assert r.ok, r.failures


# §1.5's tables (DeepSeek-V3.2 fp8 release, gfx950, tp 8), rank 0: name -> (dtype, shape); `L.` a layer prefix.
V32_SPEC_TP8 = {
    "model.embed_tokens.weight": ("bfloat16", [16160, 7168]), "lm_head.weight": ("bfloat16", [16160, 7168]),
    "L.self_attn.fused_qkv_a_proj.weight": ("float8_e4m3fn", [2112, 7168]),
    "L.self_attn.fused_qkv_a_proj.weight_scale": ("float32", [17, 56]),
    "L.self_attn.q_b_proj.weight": ("float8_e4m3fn", [3072, 1536]),
    "L.self_attn.q_b_proj.weight_scale": ("float32", [24, 12]),
    "L.self_attn.kv_b_proj.weight": ("float8_e4m3fn", [4096, 512]),
    "L.self_attn.kv_b_proj.weight_scale": ("float32", [32, 4]),
    "L.self_attn.o_proj.weight": ("float8_e4m3fn", [7168, 2048]),
    "L.self_attn.o_proj.weight_scale": ("float32", [56, 16]),
    "L.self_attn.mla_attn.impl.W_K": ("float8_e4m3fn", [16, 512, 128]),
    "L.self_attn.mla_attn.impl.W_V": ("float8_e4m3fn", [16, 128, 512]),
    f"L.{IDX}wq_b.weight": ("float8_e4m3fn", [8192, 1536]), f"L.{IDX}wq_b.weight_scale": ("float32", [64, 12]),
    f"L.{IDX}wk_weights_proj.weight": ("bfloat16", [192, 7168]),
    f"L.{IDX}wk_weights_proj.weight_scale": ("float32", [1, 56]),
    f"L.{IDX}k_norm.weight": ("float32", [128]), f"L.{IDX}k_norm.bias": ("float32", [128]),
}
V32_SPEC_TP8_DENSE = {
    "L.mlp.gate_up_proj.weight": ("float8_e4m3fn", [4608, 7168]), "L.mlp.gate_up_proj.weight_scale": ("float32", [36, 56]),
    "L.mlp.down_proj.weight": ("float8_e4m3fn", [7168, 2304]), "L.mlp.down_proj.weight_scale": ("float32", [56, 18]),
}
V32_SPEC_TP8_MOE = {
    "L.mlp.experts.w13_weight": ("float8_e4m3fn", [257, 512, 7168]),
    "L.mlp.experts.w13_weight_scale": ("float32", [257, 4, 56]),
    "L.mlp.experts.w2_weight": ("float8_e4m3fn", [257, 7168, 256]),
    "L.mlp.experts.w2_weight_scale": ("float32", [257, 56, 2]),
}
V32_INDEXER_LAYER_BYTES = 15_339_744  # §1.5, per layer


def test_dry_run_full_width_matches_spec_tp8(tmp_path):
    """--dry-run on a header-only DeepSeek-V3.2 fp8 checkpoint at full width (3 dense + 2 MoE layers of
    61, and the MTP layer) plans §1.5's per-rank inventory at tp 8: V3's tensors, plus the replicated
    indexer of 15,339,744 bytes a layer."""
    from atom_convert.engine.planning import plan_summary
    from atom_convert.layout.options import ConversionOptions
    from atom_convert.synth import load_preset
    from test_glm5 import header_only_glm

    cfg = dict(load_preset("deepseek-v3"), architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
               num_hidden_layers=5, first_k_dense_replace=3, index_head_dim=128, index_n_heads=64, index_topk=2048)
    cfg.pop("quantization_config", None)
    src = header_only_glm(cfg, tmp_path / "v32-fp8")
    plan = plan_summary(src, options=ConversionOptions(target="gfx950", tp=8))
    rows = {t["name"]: (t["dtype"], list(t["shape"]), t["bytes"])
            for st in plan["sets"] if st["role"] == "main" for t in st["tensors"] if t["rank"] == 0}
    for i in range(5):
        for k, v in dict(V32_SPEC_TP8, **(V32_SPEC_TP8_DENSE if i < 3 else V32_SPEC_TP8_MOE)).items():
            if not k.startswith("L.") and i:
                continue
            name = f"model.layers.{i}.{k[2:]}" if k.startswith("L.") else k
            assert rows[name][:2] == v, (name, rows.get(name))
        idx = sum(b for n, (_, _, b) in rows.items() if n.startswith(f"model.layers.{i}.{IDX}"))
        assert idx == V32_INDEXER_LAYER_BYTES, i


def test_synth_random_v32_source_converts(tmp_path):
    """atom_convert.synth writes a V3.2 checkpoint's indexer too (bench_convert.py --family v32 builds its
    full-width source with it): every layer's five indexer tensors, wq_b and wk fp8, and it converts."""
    from atom_convert.synth import build_random, load_preset

    cfg = dict(load_preset("tiny-deepseek-v3"), architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
               hidden_size=256, q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=64, index_head_dim=128,
               index_n_heads=4, index_topk=8, num_nextn_predict_layers=0)
    src = build_random(cfg, tmp_path / "src", fmt="fp8", seed=3)
    atom_convert.convert(src, tmp_path / "out", target="gfx942", tp=2)
    with atom_convert.open_converted(tmp_path / "out", rank=1) as ck:
        names = set(ck.manifest["tensors"])
    for i in range(cfg["num_hidden_layers"]):
        for t in ("wq_b.weight", "wk_weights_proj.weight", "k_norm.weight", "k_norm.bias"):
            assert f"model.layers.{i}.{IDX}{t}" in names, (i, t)
