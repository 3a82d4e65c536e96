"""The GLM-5 family (GlmMoeDsaForCausalLM, glm_moe_dsa): every converted tensor, byte for byte, against
expectations built here from the source files and atom-layout-next.md §2.

Expectations: test_layout's independent V3 Builder (source slices, fnuz by bytes, aiter's own
shuffle_weight, W_K/W_V by index maps) plus the indexer of test_deepseek_v32's V32Builder (written
from §1.2-§1.6), with what §2.2 says GLM changes, written here:
- model.embed_tokens.weight (main model and MTP drafter): the whole [vocab, H] table on every rank
  (ATOM's ReplicatedEmbedding); lm_head and the drafter's shared_head.head stay vocab-parallel;
- IndexShare (GLM-5.2): no indexer tensor at all on a layer that indexer_types marks "shared"; the
  MTP block always has its indexer;
- the three indexer/embedding flags recorded, a runtime with another value refused (§6).
Also: every parallel mode against a DeepSeek-V3 twin conversion, the refusals of §2.2/§6, the runtime's
`_wk_loaded` state, `--dry-run` at full width against §2.3's tables, and a GLM-5.2-MXFP4-style Quark
export (MoE only) against test_mxfp4's independent expert builder.
Fixtures: tests/glm_fixtures.py (transformers' own GlmMoeDsaForCausalLM; hand-written MTP layer; Quark
0.13 for the MXFP4 export).
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import atom_convert
import test_layout as TL
from atom_convert.errors import BadInputError, CheckpointError, ConfigError, UnsupportedError
from glm_fixtures import build_glm, glm_config
from test_deepseek_v32 import IDX, Case, V32Builder, _rewrite, plugin_expected, plugin_name

FORMATS = ("bf16", "fp8")
TARGETS = ("gfx950", "gfx942")
TPS = (1, 2)
VARIANTS = ("glm5", "glm52")
CASES = [(v, f, t, tp) for v in VARIANTS for f in FORMATS for t in TARGETS for tp in TPS]
F32, BF16 = torch.float32, torch.bfloat16
FLAGS = {"ATOM_ENABLE_DS_INDEXER_QK_ROPE_CACHE_FUSION": 1, "ATOM_ENABLE_GLM_FUSED_INDEXER": 1,
         "ATOM_REPLICATE_VOCAB_EMBED": 1}
EMBED = "model.embed_tokens.weight"


# ------------------------------------------------------------------------------------------------
# Expected tensors: V3 + V3.2 indexer builders, with GLM's two differences (§2.2)
# ------------------------------------------------------------------------------------------------


class GlmBuilder(V32Builder):
    def __init__(self, src: TL.Source, target: str, tp: int, shuffle_weight):
        super().__init__(src, target, tp, shuffle_weight)
        self.types = src.config.get("indexer_types")

    def plain(self, src_name: str, out_name: str, vocab: bool = False) -> None:
        # ReplicatedEmbedding: the whole table on every rank, main model and drafter (§2.2, §2.3)
        super().plain(src_name, out_name, vocab=vocab and out_name != EMBED)

    def indexer(self, sp: str, op: str) -> None:
        i = int(re.search(r"layers\.(\d+)\.", sp).group(1))
        if self.types is not None and i < len(self.types) and self.types[i] == "shared":
            return  # IndexShare: no Indexer, no parameters
        super().indexer(sp, op)


# ------------------------------------------------------------------------------------------------
# Fixtures
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """(conftest.one_torch_thread for every test here)"""


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("glm")


@pytest.fixture(scope="module")
def glm_src(work: Path) -> Callable[..., Path]:
    """glm_src(variant, fmt) -> a source folder, built once (fp8: 2 shards with an index)."""
    cache: dict[tuple[str, str], Path] = {}

    def get(variant: str, fmt: str) -> Path:
        key = (variant, fmt)
        if key not in cache:
            cache[key] = build_glm(work / "src" / f"{variant}-{fmt}", variant=variant, fmt=fmt, seed=31 + len(cache),
                                   shards=2 if fmt == "fp8" else 1)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def glm_out(work: Path, glm_src) -> Callable[..., Path]:
    cache: dict[tuple[Any, ...], Path] = {}

    def get(variant: str, fmt: str, target: str, tp: int, **opts: Any) -> Path:
        key = (variant, fmt, target, tp, tuple(sorted(opts.items())))
        if key not in cache:
            tag = "-".join(f"{k}" for k, v in sorted(opts.items()) if v)
            dst = work / "out" / f"{variant}-{fmt}-{target}-tp{tp}{'-' + tag if tag else ''}"
            atom_convert.convert(glm_src(variant, fmt), dst, target=target, tp=tp, **opts)
            cache[key] = dst
        return cache[key]

    return get


@pytest.fixture(scope="module", params=CASES, ids=["-".join(map(str, c)) for c in CASES])
def case(request, glm_src, glm_out, aiter) -> Case:
    variant, fmt, target, tp = request.param
    src = TL.Source(glm_src(variant, fmt))
    exp = GlmBuilder(src, target, tp, aiter[1].shuffle_weight).build()
    return Case(f"tiny-{variant}", fmt, target, tp, src, glm_out(variant, fmt, target, tp), exp)


def _full_layers(src: TL.Source) -> list[int]:
    types = src.config["indexer_types"]
    return [i for i in range(src.n_layers) if types[i] == "full"] + list(range(src.n_layers, src.n_layers + src.n_mtp))


# ------------------------------------------------------------------------------------------------
# Byte-exact layout (every rank, main and MTP sets)
# ------------------------------------------------------------------------------------------------


def test_fixture_is_real_glm(case: Case):
    """The source holds what the releases hold (§2.1, §5.3): GLM's dims; the five indexer tensors on each
    "full" layer and the MTP layer, none on a "shared" one; config.json states indexer_types; the fp8
    exclude list names indexers_proj per layer, a name no tensor has."""
    s, c = case.src, case.src.config
    assert c["architectures"] == ["GlmMoeDsaForCausalLM"] and c["model_type"] == "glm_moe_dsa" and s.n_mtp == 1
    assert (s.P, s.R, s.V) == (192, 64, 256) and c["tie_word_embeddings"] is False
    assert len(c["indexer_types"]) == s.n_layers
    if case.preset == "tiny-glm52":
        assert c["index_topk_freq"] > 1 and "shared" in c["indexer_types"]
    else:
        assert set(c["indexer_types"]) == {"full"} and "index_topk_freq" not in c
    full = _full_layers(s)
    for i in range(s.n_layers + s.n_mtp):
        p = f"model.layers.{i}.{IDX}"
        have = sorted(k[len(p):] for k in s.t if k.startswith(p))
        want = ["k_norm.bias", "k_norm.weight", "weights_proj.weight", "wk.weight", "wq_b.weight"]
        if case.fmt == "fp8":
            want += ["wk.weight_scale_inv", "wq_b.weight_scale_inv"]
        assert have == (sorted(want) if i in full else []), i
    assert not any("indexers_proj" in k for k in s.t)
    if case.fmt == "fp8":
        excl = c["quantization_config"]["modules_to_not_convert"]
        assert {"lm_head", "model.embed_tokens", "model.layers.0.self_attn.indexers_proj"} <= set(excl)


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


def test_embedding_replicated_lm_head_sharded(case: Case):
    """Read off the manifest (§2.2, §2.3, §7.2): the embedding (main and MTP) is the whole [vocab, H] bf16
    table, replicated, the same bytes on every rank; lm_head and the drafter's head are vocab/tp rows."""
    s = case.src
    for set_name in case.exp.sets:
        m = json.loads((case.dir_of(set_name) / TL.MANIFEST).read_text())
        e = m["tensors"][EMBED]
        assert (e["dtype"], e["shape"], e["split"]) == ("bfloat16", [s.vocab, s.H], {"kind": "replicated", "ways": 1})
        head = "lm_head.weight" if set_name == "main" else f"model.layers.{s.n_layers}.shared_head.head.weight"
        h = m["tensors"][head]
        assert h["shape"] == [s.vocab // case.tp, s.H]
        assert h["split"]["kind"] == ("replicated" if case.tp == 1 else "dim")
        whole = s[EMBED if set_name == "main" else f"model.layers.{s.n_layers}.embed_tokens.weight"]
        for r in range(case.tp):
            assert torch.equal(TL.u8(TL._rank_tensors(case, set_name, r)[EMBED]), TL.u8(whole))


def test_indexer_rules(case: Case):
    """Per indexer-bearing layer (indexer_types "full", and the MTP block) exactly six replicated indexer
    tensors, none on a "shared" layer; the three flags recorded (§6)."""
    s = case.src
    full = _full_layers(s)
    for set_name in case.exp.sets:
        m = json.loads((case.dir_of(set_name) / TL.MANIFEST).read_text())
        for k, v in FLAGS.items():
            assert m["layout"]["flags"][k] == v
        per_layer: dict[int, set[str]] = {}
        for name, e in m["tensors"].items():
            if f".{IDX}" in name:
                i = int(re.match(r"model\.layers\.(\d+)\.", name).group(1))
                per_layer.setdefault(i, set()).add(name.split(f".{IDX}")[1])
                assert e["split"] == {"kind": "replicated", "ways": 1}, name
        want = {i for i in full if (i >= s.n_layers) == (set_name == "mtp")}
        assert set(per_layer) == want
        six = {"wq_b.weight", "wk_weights_proj.weight", "wk_weights_proj.weight_scale", "k_norm.weight", "k_norm.bias"}
        for i, leaves in per_layer.items():
            assert leaves == (six | ({"wq_b.weight_scale"} if case.fmt == "fp8" else set())), i


# ------------------------------------------------------------------------------------------------
# Every parallel mode: the V3 part equals a DeepSeek-V3 conversion of the same tensors
# ------------------------------------------------------------------------------------------------


V3_TWIN = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
GLM_KEYS = ("index_n_heads", "index_head_dim", "index_topk", "indexer_types", "index_topk_freq",
            "index_skip_topk_offset", "index_share_for_mtp_iteration", "indexer_rope_interleave")
MODES = [("glm5", "fp8", "gfx950", 2, {"ep": True}), ("glm52", "fp8", "gfx942", 2, {"dp_attention": True}),
         ("glm52", "fp8", "gfx950", 2, {"ep": True, "dp_attention": True}), ("glm5", "bf16", "gfx942", 2, {"ep": True}),
         ("glm52", "bf16", "gfx950", 2, {"dp_attention": True}),
         ("glm5", "fp8", "gfx942", 2, {"ep": True, "dp_attention": True})]


@pytest.mark.parametrize("variant,fmt,target,tp,opts", MODES,
                         ids=["-".join([m[0], m[1], m[2], f"tp{m[3]}", *m[4]]) for m in MODES])
def test_parallel_modes(variant, fmt, target, tp, opts, work, glm_src, glm_out, aiter):
    """Under EP and DP-attention (atom-parallel.md) every tensor but the indexer's and the embeddings is
    byte-equal, per rank, to a DeepSeek-V3 conversion of the same checkpoint without its indexer; the
    indexer tensors and the embeddings are the tp-1 expectation on every rank (replicated), in the common
    files wherever the layout has them (atom-parallel.md §3.1)."""
    src = glm_src(variant, fmt)
    out = glm_out(variant, fmt, target, tp, **opts)
    twin_src = work / "twin" / f"{variant}-{fmt}"
    if not twin_src.exists():
        _rewrite(src, twin_src, drop=lambda n: f".{IDX}" in n, cfg=V3_TWIN, cfg_drop=GLM_KEYS)
    twin = work / "twin-out" / out.name
    if not twin.exists():
        atom_convert.convert(twin_src, twin, target=target, tp=tp, **opts)
    exp = GlmBuilder(TL.Source(src), target, 1, aiter[1].shuffle_weight).build()
    m = json.loads((out / TL.MANIFEST).read_text())
    mt = json.loads((twin / TL.MANIFEST).read_text())
    assert m["parallel"] == mt["parallel"]
    assert m["layout"]["flags"] == dict(mt["layout"]["flags"], **FLAGS)
    for r in range(tp):
        with atom_convert.open_converted(out, rank=r) as ck, atom_convert.open_converted(twin, rank=r) as tw:
            for mine, theirs, set_name in ((ck, tw, "main"), (ck.mtp(), tw.mtp(), "mtp")):
                names = set(mine.keys())
                rep = {n for n in names if f".{IDX}" in n} | {EMBED}
                assert names - rep == set(theirs.keys()) - {EMBED}
                for n in names - rep:
                    a, b = mine.get(n), theirs.get(n)
                    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(TL.u8(a), TL.u8(b)), (r, n)
                    ea, eb = mine.entry(n), theirs.entry(n)
                    assert (ea["split"], ea["placement"], ea["is_shuffled"]) == \
                        (eb["split"], eb["placement"], eb["is_shuffled"]), n
                assert rep == {n for n in exp.sets[set_name] if f".{IDX}" in n} | {EMBED}
                for n in rep:
                    t, want = mine.get(n), exp.sets[set_name][n].per_rank[0]
                    assert t.dtype == want.dtype and torch.equal(TL.u8(t), TL.u8(want)), (r, n)
                    e = mine.entry(n)
                    assert e["split"]["kind"] == "replicated"
                    assert e["placement"] == ("common" if m["parallel"]["common_files"] else "per_rank"), n


# ------------------------------------------------------------------------------------------------
# Refusals (atom-layout-next.md §2.2, §6) and the recorded flags
# ------------------------------------------------------------------------------------------------


def test_index_topk_freq_without_indexer_types_refused(glm_src, work):
    bad = _rewrite(glm_src("glm52", "bf16"), work / "bad" / "freq-no-types", cfg_drop=("indexer_types",))
    with pytest.raises(UnsupportedError, match=r"IndexShare \(index_topk_freq 2\) without indexer_types.*one layer "
                                               r"off.*indexer_types"):
        atom_convert.convert(bad, work / "refused-freq", target="gfx950")


def test_index_topk_pattern_without_indexer_types_refused(glm_src, work):
    bad = _rewrite(glm_src("glm5", "bf16"), work / "bad" / "pattern", cfg={"index_topk_pattern": "FS"},
                   cfg_drop=("indexer_types",))
    with pytest.raises(UnsupportedError, match=r"IndexShare \(index_topk_pattern\) without indexer_types"):
        atom_convert.convert(bad, work / "refused-pattern", target="gfx950")


def test_glm5_without_indexer_types_converts(glm_src, glm_out, work):
    """No IndexShare key and no indexer_types (a GLM-5 config written without tf): every layer has an
    indexer, as ATOM builds it; the same bytes as with the explicit all-"full" list."""
    src = _rewrite(glm_src("glm5", "fp8"), work / "ok" / "no-types", cfg_drop=("indexer_types",))
    out = work / "ok-no-types"
    atom_convert.convert(src, out, target="gfx942", tp=2)
    ref = glm_out("glm5", "fp8", "gfx942", 2)
    for r in range(2):
        with atom_convert.open_converted(out, rank=r) as a, atom_convert.open_converted(ref, rank=r) as b:
            assert sorted(a.keys()) == sorted(b.keys())
            assert all(torch.equal(TL.u8(a.get(n)), TL.u8(b.get(n))) for n in a.keys())


@pytest.mark.parametrize("types,match", [
    (["full", "shared", "full"], r"indexer_types has 3 entries but num_hidden_layers is 4"),
    (["full", "Shared", "full", "shared"], r"indexer_types must be a list of \"full\" or \"shared\""),
    (["shared", "full", "full", "shared"], r"indexer_types\[0\] is \"shared\""),
])
def test_bad_indexer_types_refused(types, match, glm_src, work):
    tag = "-".join(t[0] for t in types)
    bad = _rewrite(glm_src("glm52", "bf16"), work / "bad" / f"types-{tag}", cfg={"indexer_types": types})
    with pytest.raises(ConfigError, match=match):
        atom_convert.convert(bad, work / "refused-types", target="gfx950")


def test_full_layer_without_indexer_refused(glm_src, work):
    """indexer_types says "full" where the checkpoint has no indexer (GLM-5.2's shared layer 1)."""
    bad = _rewrite(glm_src("glm52", "bf16"), work / "bad" / "all-full", cfg={"indexer_types": ["full"] * 4})
    with pytest.raises(UnsupportedError, match=r"layer\(s\) 1, 3 hold no self_attn\.indexer\.\* tensor.*\"full\".*"
                                               r"fix indexer_types"):
        atom_convert.convert(bad, work / "refused-all-full", target="gfx950")


def test_shared_layer_with_indexer_refused(glm_src, work):
    """indexer_types says "shared" where the checkpoint has indexer tensors: ATOM would not load them."""
    bad = _rewrite(glm_src("glm5", "bf16"), work / "bad" / "stray", cfg={"indexer_types": ["full", "shared"]})
    with pytest.raises(UnsupportedError, match=r"layer\(s\) 1 hold self_attn\.indexer\.\* tensors.*\"shared\""):
        atom_convert.convert(bad, work / "refused-stray", target="gfx950")


@pytest.mark.parametrize("missing", ["k_norm.bias", "wk.weight_scale_inv", "weights_proj.weight"])
def test_missing_indexer_tensor_refused(missing, glm_src, work):
    name = f"model.layers.2.{IDX}{missing}"  # GLM-5.2's second full layer
    bad = _rewrite(glm_src("glm52", "fp8"), work / "bad" / f"missing-{missing}", drop=lambda n: n == name)
    with pytest.raises(CheckpointError, match=rf"missing tensor {name.replace('.', '[.]')}"):
        atom_convert.convert(bad, work / f"refused-{missing}", target="gfx950")


def test_missing_mtp_indexer_refused_unless_no_mtp(glm_src, work):
    name = f"model.layers.4.{IDX}wq_b.weight"  # GLM-5.2's MTP layer (after a shared layer 3)
    bad = _rewrite(glm_src("glm52", "bf16"), work / "bad" / "mtp-no-wqb", drop=lambda n: n == name)
    with pytest.raises(CheckpointError, match=rf"missing tensor {name.replace('.', '[.]')}"):
        atom_convert.convert(bad, work / "refused-mtp-wqb", target="gfx950")
    atom_convert.convert(bad, work / "ok-no-mtp", target="gfx950", mtp=False)


# --profile vllm-plugin (test_deepseek_v32's finding, from atom/plugin/vllm at ffdf3bb5d): the plugin builds
# this same GlmMoeDsaForCausalLM (model_wrapper.py 149) and DeepSeekMTP (150) under the wrapper's `model`;
# GLM has no default excludes, and the `indexers_proj` mapping is applied to target and drafter alike
# (472-481). So the expectation is GlmBuilder's under plugin_name: the replicated embedding, IndexShare's
# indexer-less layers and the fused bf16 indexer all as native.
GLM_PLUGIN_CASES = [("glm5", "fp8", "gfx942", 2), ("glm52", "fp8", "gfx950", 1), ("glm52", "bf16", "gfx942", 2)]


@pytest.fixture(scope="module", params=GLM_PLUGIN_CASES, ids=["-".join(map(str, c)) for c in GLM_PLUGIN_CASES])
def plugin_case(request, glm_src, glm_out, aiter) -> Case:
    variant, fmt, target, tp = request.param
    src = TL.Source(glm_src(variant, fmt))
    exp = plugin_expected(GlmBuilder(src, target, tp, aiter[1].shuffle_weight).build())
    return Case(f"tiny-{variant}", fmt, target, tp, src, glm_out(variant, fmt, target, tp, profile="vllm-plugin"), exp)


def test_plugin_every_tensor_byte_exact(plugin_case: Case):
    TL.test_every_tensor_byte_exact(plugin_case)
    TL.test_manifest_entries_match_files(plugin_case)
    TL.test_every_source_tensor_accounted_for(plugin_case)


def test_plugin_open_converted_and_mla_operands(plugin_case: Case):
    TL.test_open_converted_same_bytes_and_alias(plugin_case)
    TL.test_mla_operands_recombine_to_kv_b(plugin_case)


def test_plugin_names_embedding_and_indexer_layers(plugin_case: Case):
    """Spelled out under the plugin's paths: `model.model.embed_tokens.weight` whole and identical on every
    rank (main and drafter), `model.lm_head.weight` and the drafter's head vocab-parallel; the indexer only on
    the "full" layers and the MTP block; the three flags recorded; DP-attention off."""
    c, s = plugin_case, plugin_case.src
    emb = "model." + EMBED
    full = _full_layers(s)
    for set_name in c.exp.sets:
        m = json.loads((c.dir_of(set_name) / TL.MANIFEST).read_text())
        assert m["layout"]["profile"] == "vllm-plugin" and m["parallel"]["dp_attention"] is False
        assert all(m["layout"]["flags"][k] == v for k, v in FLAGS.items())
        e = m["tensors"][emb]
        assert (e["shape"], e["split"]) == ([s.vocab, s.H], {"kind": "replicated", "ways": 1})
        head = ("model.lm_head.weight" if set_name == "main"
                else f"model.model.layers.{s.n_layers}.shared_head.head.weight")
        assert m["tensors"][head]["shape"] == [s.vocab // c.tp, s.H]
        whole = s[EMBED if set_name == "main" else f"model.layers.{s.n_layers}.embed_tokens.weight"]
        for r in range(c.tp):
            assert torch.equal(TL.u8(TL._rank_tensors(c, set_name, r)[emb]), TL.u8(whole))
        have = {int(re.match(r"model\.model\.layers\.(\d+)\.", n).group(1)) for n in m["tensors"] if f".{IDX}" in n}
        assert have == {i for i in full if (i >= s.n_layers) == (set_name == "mtp")}
        assert not any(".impl." in n or ".mla_attn.indexer." in n for n in m["tensors"])
        assert m["model"]["indexer_layers"] == full


def test_plugin_mxfp4_equals_native_renamed(glm_mx, work):
    """GLM-5.2-MXFP4 (Quark, MoE only) under the plugin: the native conversion's tensors (held against the
    independent builders in test_mxfp4_moe_only_byte_exact), each under plugin_name, same bytes and entries."""
    nat, plg = work / "out" / "glm52-mxfp4-tp2-native-vs-plugin", work / "out" / "glm52-mxfp4-tp2-plugin"
    atom_convert.convert(glm_mx, nat, target="gfx950", tp=2)
    atom_convert.convert(glm_mx, plg, target="gfx950", tp=2, profile="vllm-plugin")
    for r in range(2):
        with atom_convert.open_converted(nat, rank=r) as a, atom_convert.open_converted(plg, rank=r) as b:
            for x, y in ((a, b), (a.mtp(), b.mtp())):
                assert sorted(y.keys()) == sorted(plugin_name(n) for n in x.keys())
                for n in x.keys():
                    assert torch.equal(TL.u8(x.get(n)), TL.u8(y.get(plugin_name(n)))), (r, n)
                    ea, eb = x.entry(n), y.entry(plugin_name(n))
                    assert {k: v for k, v in ea.items() if k not in ("file", "rank_files")} == \
                        {k: v for k, v in eb.items() if k not in ("file", "rank_files")}, n
                assert y.aliases == {plugin_name(k): plugin_name(v) for k, v in x.aliases.items()}


def test_plugin_verify_source_passes(glm_src, glm_out):
    from atom_convert.check.verify import verify

    r = verify(glm_out("glm52", "fp8", "gfx942", 2, profile="vllm-plugin"), glm_src("glm52", "fp8"))
    assert r.ok, r.failures


def test_tied_embeddings_refused(glm_src, work):
    bad = _rewrite(glm_src("glm5", "bf16"), work / "bad" / "tied", cfg={"tie_word_embeddings": True})
    with pytest.raises(UnsupportedError, match=r"tie_word_embeddings=true"):
        atom_convert.convert(bad, work / "refused-tied", target="gfx950")


def test_mxfp4_attention_refused(glm_src, work):
    """A Quark export whose attention (and so the indexer) is MXFP4: ATOM builds the indexer unfused then."""
    from atom_convert.synth import quark_mxfp4_config

    bad = _rewrite(glm_src("glm5", "bf16"), work / "bad" / "quark-all", cfg={"quantization_config":
                   quark_mxfp4_config(["lm_head"])})
    with pytest.raises(UnsupportedError, match=r"self_attn\.q_a_proj is mxfp4 in the Quark config.*MoE only"):
        atom_convert.convert(bad, work / "refused-quark-all", target="gfx950")


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_runtime_with_other_flag_refused(flag, glm_out, monkeypatch):
    """A runtime with one of the three flags at 0 builds another layout (§1.8, §2.2): the recorded flag
    makes the manifest check refuse it (§6); unset counts as ATOM's default 1."""
    from atom_convert.runtime.common import live_flags
    from atom_convert.store.manifest import Manifest

    m = Manifest.read(glm_out("glm52", "fp8", "gfx950", 1))
    for k in FLAGS:
        monkeypatch.delenv(k, raising=False)
    assert m.differences(flags=live_flags(m.flags)) == []
    monkeypatch.setenv(flag, "0")
    assert m.differences(flags=live_flags(m.flags)) == [f"flag {flag}: the manifest says 1, declared 0"]


# ------------------------------------------------------------------------------------------------
# The runtime side: ATOM's loader state on the fused indexer module
# ------------------------------------------------------------------------------------------------


class IndexerWkWeightsProjLinear(nn.Module):
    """A stand-in with the name and the flag of ATOM's module (deepseek_v2.py 1980-2067): its weight_loader
    sets `_wk_loaded` when wk is in, its process_weights_after_loading returns early while it is False."""

    def __init__(self, weight: nn.Parameter, scale: nn.Parameter):
        super().__init__()
        self._wk_pending_weight = None
        self._wk_pending_scale = None
        self._wk_loaded = False
        self.weight, self.weight_scale = weight, scale


def test_restore_marks_wk_loaded(glm_out):
    """runtime/common.restore sets ATOM's `_wk_loaded` on every fused indexer it filled, as ATOM's own
    weight_loader leaves it (ATOM's oracle, runtime.sh, holds this on ATOM's real classes)."""
    from atom_convert.runtime.common import restore
    from atom_convert.serve.load import module_tree, rank_view

    path = glm_out("glm52", "fp8", "gfx950", 1)
    view = rank_view(path, 0)
    model = module_tree(view)
    swapped = []
    for name, mod in list(model.named_modules()):
        if name.endswith("indexer.wk_weights_proj"):
            parent, leaf = name.rsplit(".", 1)
            new = IndexerWkWeightsProjLinear(mod.weight, mod.weight_scale)
            setattr(model.get_submodule(parent), leaf, new)
            swapped.append(new)
    assert len(swapped) == 2  # GLM-5.2 fixture: full layers 0 and 2
    restore(model, path, rank=0, device=torch.device("cpu"), parallel={"tp": 1})
    assert all(m._wk_loaded is True and m._wk_pending_weight is None for m in swapped)
    assert all(m.weight.device.type == "cpu" for m in swapped)


# ------------------------------------------------------------------------------------------------
# --dry-run at full width reproduces the §2.3 per-rank inventory
# ------------------------------------------------------------------------------------------------


GLM5_FULL: dict[str, Any] = dict(
    glm_config("glm5"), hidden_size=6144, num_hidden_layers=5, num_attention_heads=64, num_key_value_heads=64,
    q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, qk_head_dim=256, v_head_dim=256,
    index_n_heads=32, index_head_dim=128, index_topk=2048, first_k_dense_replace=3, n_routed_experts=256,
    n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=2048, intermediate_size=12288, n_group=1,
    topk_group=1, vocab_size=154880, max_position_embeddings=202752, pad_token_id=154820,
    indexer_types=["full"] * 5)  # 3 dense + 2 MoE layers (of 78) and the MTP layer 5


def header_only_glm(cfg: dict[str, Any], out: Path) -> Path:
    """A GLM-5-FP8 checkpoint whose one shard declares every tensor and holds no data (a sparse file):
    the inventory of atom_convert.synth.source_inventory (the indexer of every layer with one included)."""
    from atom_convert.layout.codecs.fp8_block import scale_grid
    from atom_convert.layout.model import ModelSpec
    from atom_convert.synth import source_inventory

    s = ModelSpec.from_config(cfg)
    entries: list[tuple[str, str, tuple[int, ...]]] = []

    def linear(name: str, shape: tuple[int, ...]) -> None:
        entries.extend([(name, "F8_E4M3", shape), (name.removesuffix(".weight") + ".weight_scale_inv", "F32",
                                                   scale_grid(shape))])

    for name, shape, kind in source_inventory(cfg):
        if kind == "linear" and not name.endswith("eh_proj.weight"):
            linear(name, shape)
        else:
            entries.append((name, "F32" if kind in ("router", "bias") else "BF16", shape))
    size = {"F8_E4M3": 1, "F32": 4, "BF16": 2}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, dt, shape in entries:
        n = size[dt]
        for d in shape:
            n *= d
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + off)
    excluded = ["lm_head", "model.embed_tokens"] + [f"model.layers.{i}.self_attn.indexers_proj"
                                                    for i in range(s.n_layers + s.n_mtp)]
    q = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
         "modules_to_not_convert": excluded}
    (out / "config.json").write_text(json.dumps(dict(cfg, quantization_config=q)))
    return out


# §2.3's tables (GLM-5-FP8, gfx950, tp 8), rank 0: name -> (dtype, shape); `L` a layer prefix.
SPEC_TP8 = {
    EMBED: ("bfloat16", [154880, 6144]),
    "lm_head.weight": ("bfloat16", [19360, 6144]),
    "L.self_attn.fused_qkv_a_proj.weight": ("float8_e4m3fn", [2624, 6144]),
    "L.self_attn.fused_qkv_a_proj.weight_scale": ("float32", [21, 48]),
    "L.self_attn.q_b_proj.weight": ("float8_e4m3fn", [2048, 2048]),
    "L.self_attn.q_b_proj.weight_scale": ("float32", [16, 16]),
    "L.self_attn.kv_b_proj.weight": ("float8_e4m3fn", [3584, 512]),
    "L.self_attn.kv_b_proj.weight_scale": ("float32", [28, 4]),
    "L.self_attn.o_proj.weight": ("float8_e4m3fn", [6144, 2048]),
    "L.self_attn.o_proj.weight_scale": ("float32", [48, 16]),
    "L.self_attn.mla_attn.impl.W_K": ("float8_e4m3fn", [8, 512, 192]),
    "L.self_attn.mla_attn.impl.W_V": ("float8_e4m3fn", [8, 256, 512]),
    "L.self_attn.indexer.wq_b.weight": ("float8_e4m3fn", [4096, 2048]),
    "L.self_attn.indexer.wq_b.weight_scale": ("float32", [32, 16]),
    "L.self_attn.indexer.wk_weights_proj.weight": ("bfloat16", [160, 6144]),
    "L.self_attn.indexer.wk_weights_proj.weight_scale": ("float32", [1, 48]),
    "L.self_attn.indexer.k_norm.weight": ("float32", [128]),
    "L.self_attn.indexer.k_norm.bias": ("float32", [128]),
}
SPEC_TP8_DENSE = {
    "L.mlp.gate_up_proj.weight": ("float8_e4m3fn", [3072, 6144]),
    "L.mlp.gate_up_proj.weight_scale": ("float32", [24, 48]),
    "L.mlp.down_proj.weight": ("float8_e4m3fn", [6144, 1536]),
    "L.mlp.down_proj.weight_scale": ("float32", [48, 12]),
}
SPEC_TP8_MOE = {
    "L.mlp.gate.weight": ("bfloat16", [256, 6144]), "L.mlp.gate.e_score_correction_bias": ("bfloat16", [256]),
    "L.mlp.experts.w13_weight": ("float8_e4m3fn", [257, 512, 6144]),
    "L.mlp.experts.w13_weight_scale": ("float32", [257, 4, 48]),
    "L.mlp.experts.w2_weight": ("float8_e4m3fn", [257, 6144, 256]),
    "L.mlp.experts.w2_weight_scale": ("float32", [257, 48, 2]),
}
INDEXER_LAYER_BYTES = 10_357_952  # §2.3, per indexer layer


def test_dry_run_full_width_matches_spec_tp8(tmp_path):
    from atom_convert.engine.planning import plan_summary
    from atom_convert.layout.options import ConversionOptions

    src = header_only_glm(GLM5_FULL, tmp_path / "glm5-fp8")
    plan = plan_summary(src, options=ConversionOptions(target="gfx950", tp=8))
    rows: dict[str, dict[str, tuple[str, list[int], int]]] = {}
    for st in plan["sets"]:
        for t in st["tensors"]:
            if t["rank"] == 0:
                rows.setdefault(st["role"], {})[t["name"]] = (t["dtype"], list(t["shape"]), t["bytes"])
    main, mtp = rows["main"], rows["mtp"]
    for i in range(5):
        want = dict(SPEC_TP8, **(SPEC_TP8_DENSE if i < 3 else SPEC_TP8_MOE))
        for k, v in want.items():
            if k.startswith("L."):
                name = f"model.layers.{i}.{k[2:]}"
            elif i:
                continue
            else:
                name = k
            assert main[name][:2] == v, name
        idx = sum(b for n, (_, _, b) in main.items() if n.startswith(f"model.layers.{i}.{IDX}"))
        assert idx == INDEXER_LAYER_BYTES
    assert main[EMBED][2] == 1_903_165_440  # on every rank
    p = "model.layers.5.mtp_block."
    for k, v in dict(SPEC_TP8, **SPEC_TP8_MOE).items():
        if k.startswith("L."):
            assert mtp[p + k[2:]][:2] == v, k
    assert mtp[EMBED][:2] == ("bfloat16", [154880, 6144])  # the drafter's embedding replicated too
    assert mtp["model.layers.5.eh_proj.weight"][:2] == ("bfloat16", [6144, 12288])
    assert mtp["model.layers.5.shared_head.head.weight"][:2] == ("bfloat16", [19360, 6144])


def test_quantized_weights_proj_refused(glm_src, work):
    p = f"model.layers.0.{IDX}weights_proj"
    bad = _rewrite(glm_src("glm5", "fp8"), work / "bad" / "wp-scale", add={p + ".weight_scale_inv": torch.ones(1, 2)})
    with pytest.raises(CheckpointError, match=r"weights_proj unquantized"):
        atom_convert.convert(bad, work / "refused-wp", target="gfx950")


def test_no_stray_bad_input(glm_src, work):
    """A GLM-5.2 config whose indexer_types is not a list is a ConfigError (exit 2), not an internal error."""
    bad = _rewrite(glm_src("glm52", "bf16"), work / "bad" / "types-str", cfg={"indexer_types": "FSFS"})
    with pytest.raises(BadInputError, match=r"indexer_types must be a list"):
        atom_convert.convert(bad, work / "refused-types-str", target="gfx950")


# ------------------------------------------------------------------------------------------------
# GLM-5.2-MXFP4 (AMD Quark, MoE only incl. the shared expert): gfx950
# ------------------------------------------------------------------------------------------------


class GlmMxBuilder(GlmBuilder):
    """GlmBuilder for everything Quark left bf16 (attention and so the indexer, routers, dense MLP, the
    MTP layer); the MXFP4 expert stacks are built by test_mxfp4's independent expected_experts."""

    def experts(self, sp: str, op: str, with_shared: bool) -> None:
        if self.s[f"{sp}mlp.experts.0.gate_proj.weight"].dtype == torch.uint8:
            self.mx.append((sp, op, with_shared))
            return
        super().experts(sp, op, with_shared)

    def build(self) -> TL.Expected:
        self.mx: list[tuple[str, str, bool]] = []
        return super().build()


@pytest.fixture(scope="module")
def glm_mx(work: Path) -> Path:
    from glm_fixtures import build_glm_quark

    return build_glm_quark(work / "src" / "glm52-mxfp4", variant="glm52", seed=7)


@pytest.mark.parametrize("tp,opts", [(1, {}), (2, {}), (2, {"ep": True}), (2, {"dp_attention": True})],
                         ids=["tp1", "tp2", "tp2-ep", "tp2-dpa"])
def test_mxfp4_moe_only_byte_exact(tp, opts, glm_mx, work, aiter):
    """Every rank: the MXFP4 expert stacks (shared expert fused as slot E) are aiter's shuffle of the rank's
    Quark bytes with e8m0_shuffled scales (test_mxfp4's builder, spec §3.3.2); every other tensor is the bf16
    GLM expectation (replicated embedding, bf16 fused indexer on the full layers, the bf16 MTP layer)."""
    import test_mxfp4 as MX

    fp4, shf = aiter
    out = work / "out" / f"glm52-mxfp4-tp{tp}-{'-'.join(opts)}"
    atom_convert.convert(glm_mx, out, target="gfx950", tp=tp, **opts)
    src = TL.Source(glm_mx)
    ep, dpa = opts.get("ep", False), opts.get("dp_attention", False)
    attn_tp = 1 if dpa else tp
    b = GlmMxBuilder(src, "gfx950", attn_tp, shf.shuffle_weight)
    exp = b.build()
    assert [sp for sp, _, _ in b.mx] == [f"model.layers.{i}." for i in range(1, src.n_layers)]
    m = json.loads((out / TL.MANIFEST).read_text())
    assert m["source"]["quant_format"] == "quark-mxfp4"
    assert set(m["model"]["moe_layers"].values()) == {"fused_shared_expert"}
    msrc = MX.src_of(glm_mx)
    for r in range(tp):
        with atom_convert.open_converted(out, rank=r) as ck:
            for set_name, reader in (("main", ck), ("mtp", ck.mtp())):
                want = exp.sets[set_name]
                names = set(reader.keys())
                stacks = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
                mx_names = ({f"{op}mlp.experts.{k}" for _, op, _ in b.mx for k in stacks}
                            if set_name == "main" else set())
                assert names == set(want) | mx_names
                for n, e in want.items():
                    if (ep or dpa) and ".mlp.experts." in n:
                        continue  # experts follow the world, not attention's tp (atom-parallel.md §1-§2)
                    t, w = reader.get(n), e.per_rank[0 if dpa else r]
                    assert t.dtype == w.dtype and t.shape == w.shape and torch.equal(TL.u8(t), TL.u8(w)), (r, n)
            if ep:
                continue
            for sp, op, fused in b.mx:
                for lin in MX.expected_experts(msrc, sp, fused, tp, r):  # TP-split over the world under DPA too
                    got = ck.get(lin.name)
                    assert torch.equal(got, shf.shuffle_weight(lin.w.clone(), layout=(16, 16))), (r, lin.name)
                    MX.check_scale_bytes(f"{lin.name} rank {r}", ck.get(lin.name + "_scale"), lin.s, fp4)


@pytest.mark.parametrize("variant,fmt,target,tp,opts", [
    ("glm52", "fp8", "gfx942", 2, {}), ("glm5", "fp8", "gfx950", 2, {"dp_attention": True, "ep": True}),
    ("glm52", "bf16", "gfx950", 2, {"ep": True})])
def test_verify_source_passes(variant, fmt, target, tp, opts, glm_src, glm_out):
    """verify --source on a GLM conversion: every tensor decoded and compared with its source (the
    fused wk_weights_proj is bf16, its vestigial scale not applied), and the reference forward."""
    from atom_convert.check.verify import verify

    r = verify(glm_out(variant, fmt, target, tp, **opts), glm_src(variant, fmt))
    assert r.ok, r.failures


def test_manifest_records_the_indexer_layers(glm_src, glm_out):
    """The manifest names the layers that carry an indexer (spec §6): GLM-5.2's "full" layers and the
    MTP layer; every layer for GLM-5."""
    for variant in VARIANTS:
        src = glm_src(variant, "bf16")
        cfg = json.loads((src / "config.json").read_text())
        n, mtp = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers", 0)
        types = cfg.get("indexer_types")
        want = [i for i in range(n) if types is None or types[i] != "shared"] + list(range(n, n + mtp))
        m = json.loads((glm_out(variant, "bf16", "gfx950", 1) / "atom_manifest.json").read_text())
        assert m["model"]["indexer_layers"] == want, (variant, m["model"])
        if variant == "glm52":
            assert "shared" in types and len(want) < n + mtp  # IndexShare: some layers carry none
