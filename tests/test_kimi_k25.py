"""Kimi-K2.5 (KimiK25ForConditionalGeneration, kimi_k25): every converted tensor, byte for byte, against
expectations built here from the source files and atom-layout-next.md §3.

The text model is Kimi-K2's under the `language_model.` prefix that the checkpoint and ATOM's parameter names
share (§3.2, §3.3), so the expectations are test_layout.py's independent Builder (bf16 / DeepSeek fp8: source
slices, fnuz by bytes, aiter's own shuffle_weight, W_K/W_V by index maps) and test_mxfp4.py's (Quark MXFP4:
aiter's shuffle_weight / e8m0_shuffle of the source slices), run with the prefixed names. Added here from the
spec, independently of atom_convert:
- --profile atom: no vision_tower.* / mm_projector.* tensor is written; each is in the manifest's `dropped`
  with ATOM's reason (skip_weight_prefixes, §3.4);
- --profile vllm-plugin (atom-layout-plugin.md §1): every text name gains `model.` (`model.language_model.
  model.…`), W_K/W_V sit on `…self_attn.mla_attn`; the vision tower and projector are carried with their
  checkpoint bytes in bf16, whole and identical on every rank, under the plugin's module paths: ATOM's
  plugin mapper `mm_projector.proj.0 -> mm_projector.linear_1`, `.proj.2 -> .linear_2`
  (atom/plugin/vllm/models/kimi_k25.py 194-203), then `model.`.
Every parallel mode: byte-equal, per rank, to a Kimi-K2 conversion of the same text tensors (the twin: the
prefix stripped, the vision tensors dropped, the text_config as config.json), which test_layout / test_mxfp4
/ test_parallel hold against the spec.
Fixtures: tests/k25_fixtures.py (transformers' own Kimi_K25ForConditionalGeneration, renamed to the real
checkpoint names; Quark 0.13 for MXFP4).
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
import test_mxfp4 as TM
from atom_convert.errors import CheckpointError, ConfigError, UnsupportedError
from k25_fixtures import PREFIX, build_k25

from cliutil import run_cli

F32, BF16, FN = torch.float32, torch.bfloat16, torch.float8_e4m3fn
VISION = ("vision_tower.", "mm_projector.")
PROFILES = ("atom", "vllm-plugin")
CASES = [(f, t, tp, p) for f in ("bf16", "fp8") for t in ("gfx950", "gfx942") for tp in (1, 2) for p in PROFILES]
MX_CASES = [(tp, p) for tp in (1, 2) for p in PROFILES]


def plugin_vision_name(name: str) -> str:
    """ATOM's plugin WeightsMapper for the projector, then the wrapper's `model.`."""
    for a, b in (("mm_projector.proj.0.", "mm_projector.linear_1."), ("mm_projector.proj.2.", "mm_projector.linear_2.")):
        if name.startswith(a):
            name = b + name[len(a):]
    return "model." + name


def plugin_name(native: str) -> str:
    return "model." + native.replace(".mla_attn.impl.", ".mla_attn.")


# ------------------------------------------------------------------------------------------------
# The source, read directly (the text model's dims from text_config)
# ------------------------------------------------------------------------------------------------


class K25Source(TL.Source):
    def __init__(self, folder: Path):  # noqa: D107 - TL.Source with the text_config's dims
        self.folder = folder
        self.top: dict[str, Any] = json.loads((folder / "config.json").read_text())
        self.config = self.top["text_config"]
        self.t: dict[str, torch.Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt", device="cpu") as h:
                self.t.update({k: h.get_tensor(k) for k in h.keys()})
        c = self.config
        self.H, self.Nh, self.Q = c["hidden_size"], c["num_attention_heads"], c.get("q_lora_rank")
        self.L, self.R, self.P, self.V = c["kv_lora_rank"], c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
        self.Id, self.I = c["intermediate_size"], c["moe_intermediate_size"]
        self.E, self.S = c["n_routed_experts"], c.get("n_shared_experts") or 0
        self.vocab, self.n_layers = c["vocab_size"], c["num_hidden_layers"]
        self.first_dense = c["first_k_dense_replace"]
        self.n_mtp = 0

    def vision(self) -> list[str]:
        return sorted(n for n in self.t if n.startswith(VISION))


class K25Builder(TL.Builder):
    """test_layout's Builder over `language_model.`-prefixed names (§3.3)."""

    def build(self) -> TL.Expected:
        s, P = self.s, PREFIX
        self.plain(f"{P}model.embed_tokens.weight", f"{P}model.embed_tokens.weight", vocab=True)
        for i in range(s.n_layers):
            self.layer(i, f"{P}model.layers.{i}.", f"{P}model.layers.{i}.")
        self.plain(f"{P}model.norm.weight", f"{P}model.norm.weight")
        self.plain(f"{P}lm_head.weight", f"{P}lm_head.weight", vocab=True)
        return self.exp


def with_profile(exp: TL.Expected, src: K25Source, profile: str, tp: int) -> TL.Expected:
    """The expectation under `profile`: vllm-plugin renames (plugin spec §1) and carries the vision tensors."""
    if profile == "atom":
        return exp
    out = TL.Expected()
    out.sets["main"] = {plugin_name(k): v for k, v in exp.sets["main"].items()}
    out.aliases["main"] = {plugin_name(a): plugin_name(t) for a, t in exp.aliases.get("main", {}).items()}
    out.wkvb = {plugin_name(k): v for k, v in exp.wkvb.items()}
    for n in src.vision():
        assert src[n].dtype == BF16  # AMD's exports and the tf save keep them bf16
        out.sets["main"][plugin_vision_name(n)] = TL.Exp([src[n]] * tp, False, (n,))
    return out


@dataclass
class Case:
    preset: str
    fmt: str
    target: str
    tp: int
    src: K25Source
    out: Path
    exp: TL.Expected
    profile: str = "atom"

    def dir_of(self, set_name: str) -> Path:
        return self.out


# ------------------------------------------------------------------------------------------------
# Fixtures
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """(conftest.one_torch_thread for every test here)"""


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("k25")


@pytest.fixture(scope="module")
def k25_src(work: Path) -> Callable[..., Path]:
    """k25_src(fmt) -> a source folder ("bf16", "fp8": 2 shards with an index, "mxfp4": Quark), built once."""
    cache: dict[str, Path] = {}

    def get(fmt: str) -> Path:
        if fmt not in cache:
            # int4: the bf16 fixture's values (seed 3) with its routed experts packed by compressed-tensors
            cache[fmt] = build_k25(work / "src" / fmt, fmt=fmt, seed={"bf16": 3, "fp8": 5, "mxfp4": 7, "int4": 3}[fmt],
                                   shards=2 if fmt == "fp8" else 1)
        return cache[fmt]

    return get


@pytest.fixture(scope="module")
def k25_out(work: Path, k25_src) -> Callable[..., Path]:
    cache: dict[tuple[Any, ...], Path] = {}

    def get(fmt: str, target: str, tp: int, **opts: Any) -> Path:
        key = (fmt, target, tp, tuple(sorted(opts.items())))
        if key not in cache:
            tag = "-".join(f"{k}={v}" for k, v in sorted(opts.items()))
            dst = work / "out" / f"{fmt}-{target}-tp{tp}{'-' + tag if tag else ''}"
            atom_convert.convert(k25_src(fmt), dst, target=target, tp=tp, **opts)
            cache[key] = dst
        return cache[key]

    return get


@pytest.fixture(scope="module", params=CASES, ids=["-".join(map(str, c)) for c in CASES])
def case(request, k25_src, k25_out, aiter) -> Case:
    fmt, target, tp, profile = request.param
    src = K25Source(k25_src(fmt))
    exp = with_profile(K25Builder(src, target, tp, aiter[1].shuffle_weight).build(), src, profile, tp)
    return Case("tiny-kimi-k25", fmt, target, tp, src, k25_out(fmt, target, tp, profile=profile), exp, profile)


# ------------------------------------------------------------------------------------------------
# bf16 and DeepSeek fp8: byte-exact layout, both profiles, tp 1 and 2, gfx950 and gfx942
# ------------------------------------------------------------------------------------------------


def test_fixture_is_real_k25(case: Case):
    """The source holds the real checkpoint's names (§3.1, §5.4): language_model.model.layers.{i} (not
    transformers' `blocks`), language_model.lm_head (untied), vision_tower.patch_embed.proj,
    mm_projector.{pre_norm,proj.0,proj.2}; config: kimi_k25 on top, text_config kimi_k2, vt_* vision names,
    no quantization_config inside text_config."""
    t, c = case.src.t, case.src.top
    assert c["model_type"] == "kimi_k25" and c["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert c["text_config"]["model_type"] == "kimi_k2" and "vt_hidden_size" in c["vision_config"]
    assert "quantization_config" not in c["text_config"]
    assert ("quantization_config" in c) == (case.fmt == "fp8")
    assert not any(".blocks." in n for n in t if n.startswith(PREFIX))
    assert f"{PREFIX}lm_head.weight" in t and f"{PREFIX}model.layers.1.mlp.experts.7.down_proj.weight" in t
    assert {"vision_tower.patch_embed.proj.weight", "mm_projector.pre_norm.weight", "mm_projector.proj.0.weight",
            "mm_projector.proj.2.weight", "vision_tower.encoder.blocks.0.wqkv.weight"} <= set(t)
    assert all(n.startswith((PREFIX, *VISION)) for n in t)


def test_every_tensor_byte_exact(case: Case):
    TL.test_every_tensor_byte_exact(case)


def test_manifest_entries_match_files(case: Case):
    TL.test_manifest_entries_match_files(case)


def test_manifest_files_sizes_and_hashes(case: Case):
    TL.test_manifest_files_sizes_and_hashes(case)


def test_open_converted_same_bytes_and_alias(case: Case):
    TL.test_open_converted_same_bytes_and_alias(case)


def test_mla_operands_recombine_to_kv_b(case: Case):
    TL.test_mla_operands_recombine_to_kv_b(case)


def test_vision_dropped_or_carried(case: Case):
    """Native: every vision/projector tensor dropped with ATOM's reason, none written. vllm-plugin: each one
    carried, recorded with its checkpoint name, replicated (common files where the layout has them)."""
    m = json.loads((case.out / TL.MANIFEST).read_text())
    used = {s for e in m["tensors"].values() for s in e["sources"]}
    vision = case.src.vision()
    assert used | set(m["dropped"]) == set(case.src.t) and not used & set(m["dropped"])
    assert m["source"]["model_type"] == "kimi_k25" and m["layout"]["profile"] == case.profile
    if case.profile == "atom":
        assert sorted(m["dropped"]) == vision
        assert all("skip_weight_prefixes" in why and "--profile vllm-plugin" in why for why in m["dropped"].values())
        assert not any(n.startswith(VISION) or ".vision_tower." in n or "mm_projector" in n for n in m["tensors"])
        assert all(n.startswith(PREFIX) for n in m["tensors"])
    else:
        assert m["dropped"] == {}
        for n in vision:
            e = m["tensors"][plugin_vision_name(n)]
            assert e["sources"] == [n] and e["layout"]["checkpoint_name"] == n and e["dtype"] == "bfloat16"
            assert e["split"] == {"kind": "replicated", "ways": 1} and not e["is_shuffled"]
        assert all(n.startswith(("model.language_model.", "model.vision_tower.", "model.mm_projector."))
                   for n in m["tensors"])
    # the config.json ATOM reads keeps kimi_k25 (so ATOM picks its wrapper, §3.3)
    cfg = json.loads((case.out / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k25" and cfg["architectures"] == ["KimiK25ForConditionalGeneration"]


# ------------------------------------------------------------------------------------------------
# Quark MXFP4 (amd/Kimi-K2.5-MXFP4's recipe): byte-exact against aiter's shuffles of the source slices
# ------------------------------------------------------------------------------------------------


class K25MxSrc(TM.Src):
    def __init__(self, path: Path):  # noqa: D107 - test_mxfp4.Src with the text_config's dims
        self.path = path
        top = json.loads((path / "config.json").read_text())
        self.config = top["text_config"]
        from safetensors.torch import load_file

        self.t = load_file(str(path / TM.ST))
        c = self.config
        self.H, self.Nh = c["hidden_size"], c["num_attention_heads"]
        self.L, self.Q = c["kv_lora_rank"], c["q_lora_rank"]
        self.P, self.R, self.V = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        self.I, self.E, self.S = c["moe_intermediate_size"], c["n_routed_experts"], c["n_shared_experts"]
        self.n_layers, self.first_dense = c["num_hidden_layers"], c["first_k_dense_replace"]


def mx_expected(src_path: Path, tp: int, aiter: Any) -> tuple[dict[str, list[torch.Tensor]], list[list[TM.Lin]]]:
    """Every tensor of every rank except the MXFP4 ones (bf16 attention, norms, router, vocab, W_K/W_V:
    test_layout's Builder), and per rank the MXFP4 linears and expert stacks (test_mxfp4's expectations):
    layer 0's dense MLP and the fused routed + shared experts MXFP4 (§3.5)."""
    s = K25Source(src_path)
    mx = K25MxSrc(src_path)
    b = K25Builder(s, "gfx950", tp, aiter[1].shuffle_weight)
    P = PREFIX
    b.plain(f"{P}model.embed_tokens.weight", f"{P}model.embed_tokens.weight", vocab=True)
    lins: list[list[TM.Lin]] = [[] for _ in range(tp)]
    for i in range(s.n_layers):
        p = f"{P}model.layers.{i}."
        for nm in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_a_layernorm.weight",
                   "self_attn.kv_a_layernorm.weight"):
            b.plain(p + nm, p + nm)
        b.linear(p, p, "self_attn.fused_qkv_a_proj", ["self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"], "rep")
        b.linear(p, p, "self_attn.q_b_proj", ["self_attn.q_b_proj"], "col")
        b.linear(p, p, "self_attn.kv_b_proj", ["self_attn.kv_b_proj"], "col")
        b.linear(p, p, "self_attn.o_proj", ["self_attn.o_proj"], "row")
        b.mla(p, p)
        for r in range(tp):
            if i < s.first_dense:
                lins[r] += [TM.expected_linear(mx, p, out, parts, par, tp, r) for out, parts, par in TM.DENSE]
            else:
                lins[r] += TM.expected_experts(mx, p, True, tp, r)
        if i >= s.first_dense:
            b.plain(p + "mlp.gate.weight", p + "mlp.gate.weight")
            b.plain(p + "mlp.gate.e_score_correction_bias", p + "mlp.gate.e_score_correction_bias")
    b.plain(f"{P}model.norm.weight", f"{P}model.norm.weight")
    b.plain(f"{P}lm_head.weight", f"{P}lm_head.weight", vocab=True)
    assert all(lin.fmt == "mxfp4" for r in lins for lin in r)
    return {k: v.per_rank for k, v in b.exp.sets["main"].items()}, lins


@pytest.mark.parametrize("tp,profile", MX_CASES, ids=[f"tp{tp}-{p}" for tp, p in MX_CASES])
def test_mxfp4_every_tensor_byte_exact(tp, profile, k25_src, k25_out, aiter):
    fp4, shf = aiter
    src_path = k25_src("mxfp4")
    out = k25_out("mxfp4", "gfx950", tp, profile=profile)
    src = K25Source(src_path)
    plain, lins = mx_expected(src_path, tp, aiter)
    name = plugin_name if profile == "vllm-plugin" else (lambda n: n)
    m = json.loads((out / TL.MANIFEST).read_text())
    assert m["source"]["quant_format"] == "quark-mxfp4"
    assert m["model"]["moe_layers"] == {name(f"{PREFIX}model.layers.1"): "fused_shared_expert"}
    for r in range(tp):
        with atom_convert.open_converted(out, rank=r) as ck:
            want = {name(k) for k in plain}
            for k, per in plain.items():
                got, e = ck.get(name(k)), per[r]
                assert got.dtype == e.dtype and got.shape == e.shape and torch.equal(TL.u8(got), TL.u8(e)), (r, k)
            for lin in lins[r]:
                n = name(lin.name)
                sname = n + "_scale" if lin.moe else n.removesuffix(".weight") + ".weight_scale"
                want |= {n, sname}
                got = ck.get(n)
                assert got.dtype == torch.uint8 and ck.entry(n)["is_shuffled"] and ck.entry(n)["runtime_dtype"] == TM.FP4X2
                assert torch.equal(got, shf.shuffle_weight(lin.w.clone(), layout=(16, 16))), (r, n)
                TM.check_scale_bytes(f"{sname} rank {r}", ck.get(sname), lin.s, fp4)
            if profile == "vllm-plugin":
                for v in src.vision():
                    want.add(plugin_vision_name(v))
                    assert torch.equal(ck.get(plugin_vision_name(v)), src[v]), v
            assert set(ck.keys()) == want


def test_mxfp4_exclude_entries_are_full_names(k25_src):
    """The fixture's exclude list is written as AMD's exports write it (§3.5): full language_model.model.…
    module names (no globs), and atom-convert resolves attention and the router to bf16 from it."""
    from atom_convert.layout.codecs import detect_format

    cfg = json.loads((k25_src("mxfp4") / "config.json").read_text())
    ex = cfg["quantization_config"]["exclude"]
    assert f"{PREFIX}model.layers.0.self_attn.q_a_proj" in ex and f"{PREFIX}lm_head" in ex
    assert not any("*" in p for p in ex)
    fmt = detect_format(cfg)
    assert fmt.codec_for(f"{PREFIX}model.layers.1.self_attn.kv_b_proj").name == "bf16"
    assert fmt.codec_for(f"{PREFIX}model.layers.0.mlp.gate_proj").name == "mxfp4"
    assert fmt.codec_for(f"{PREFIX}model.layers.1.mlp.shared_experts.down_proj").name == "mxfp4"


# ------------------------------------------------------------------------------------------------
# Every parallel mode: equal to a Kimi-K2 conversion of the same text tensors (the twin)
# ------------------------------------------------------------------------------------------------


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def kimi_k2_twin(src: Path, dst: Path) -> Path:
    """The same text model as a Kimi-K2 checkpoint: prefix stripped, vision tensors left out, the
    text_config (with the top-level quantization_config, its exclude names stripped of the prefix)."""
    if dst.exists():
        return dst
    dst.mkdir(parents=True)
    t = {k[len(PREFIX):]: v for k, v in _tensors(src).items() if k.startswith(PREFIX)}
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    top = json.loads((src / "config.json").read_text())
    cfg = dict(top["text_config"])
    if "quantization_config" in top:
        q = json.loads(json.dumps(top["quantization_config"]))
        if "exclude" in q:
            q["exclude"] = [e[len(PREFIX):] for e in q["exclude"] if e.startswith(PREFIX)]
        cfg["quantization_config"] = q
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


MODES = [("bf16", "gfx950", 2, {"ep": True}), ("bf16", "gfx942", 2, {"dp_attention": True}),
         ("bf16", "gfx950", 2, {"dp_attention": True, "ep": True}), ("fp8", "gfx942", 2, {"ep": True}),
         ("fp8", "gfx950", 2, {"dp_attention": True}), ("mxfp4", "gfx950", 1, {}), ("mxfp4", "gfx950", 2, {}),
         ("mxfp4", "gfx950", 2, {"ep": True}), ("mxfp4", "gfx950", 2, {"dp_attention": True}),
         ("mxfp4", "gfx950", 2, {"dp_attention": True, "ep": True}), ("bf16", "gfx950", 2, {"profile": "vllm-plugin",
                                                                                         "ep": True}),
         ("mxfp4", "gfx950", 2, {"profile": "vllm-plugin", "ep": True}),
         ("fp8", "gfx950", 2, {"dp_attention": True, "ep": True})]


@pytest.mark.parametrize("fmt,target,tp,opts", MODES,
                         ids=["-".join([m[0], m[1], f"tp{m[2]}", *(f"{k}={v}" for k, v in m[3].items())]) for m in MODES])
def test_parallel_modes_match_kimi_k2_twin(fmt, target, tp, opts, work, k25_src, k25_out):
    """Under TP, EP, DP-attention and DP-attention + EP, every rank's text tensors are byte-equal to a Kimi-K2
    conversion of the same tensors, under `language_model.` (§3.3), with the same manifest records (parallel
    block, flags, split, placement, shuffle, MoE layout); a vllm-plugin output holds the twin's plugin names
    under `model.language_model.` plus the carried vision tensors."""
    src = k25_src(fmt)
    out = k25_out(fmt, target, tp, **opts)
    twin_src = kimi_k2_twin(src, work / "twin" / fmt)
    twin = work / "twin-out" / out.name
    if not twin.exists():
        atom_convert.convert(twin_src, twin, target=target, tp=tp, **opts)
    plugin = opts.get("profile") == "vllm-plugin"
    pre = "model.language_model." if plugin else PREFIX

    def mine_of(n: str) -> str:
        return pre + (n[len("model."):] if plugin else n)

    m = json.loads((out / TL.MANIFEST).read_text())
    mt = json.loads((twin / TL.MANIFEST).read_text())
    assert m["parallel"] == mt["parallel"] and m["layout"]["flags"] == mt["layout"]["flags"]
    assert m["model"]["moe_layers"] == {mine_of(k): v for k, v in mt["model"]["moe_layers"].items()}
    assert m["aliases"] == {mine_of(a): mine_of(t) for a, t in mt["aliases"].items()}
    src_t = K25Source(src)
    for r in range(tp):
        with atom_convert.open_converted(out, rank=r) as ck, atom_convert.open_converted(twin, rank=r) as tw:
            vision = {plugin_vision_name(v) for v in src_t.vision()} if plugin else set()
            assert set(ck.keys()) == {mine_of(n) for n in tw.keys()} | vision
            for n in tw.keys():
                a, b = ck.get(mine_of(n)), tw.get(n)
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(TL.u8(a), TL.u8(b)), (r, n)
                ea, eb = ck.entry(mine_of(n)), tw.entry(n)
                assert (ea["split"], ea["placement"], ea["is_shuffled"], ea.get("runtime_dtype")) == \
                    (eb["split"], eb["placement"], eb["is_shuffled"], eb.get("runtime_dtype")), n
                assert ea["sources"] == [PREFIX + x for x in eb["sources"]], n
            for v in vision:
                e = ck.entry(v)
                assert e["placement"] == ("common" if m["parallel"]["common_files"] else "per_rank")
                assert torch.equal(ck.get(v), src_t[e["sources"][0]])


# ------------------------------------------------------------------------------------------------
# verify, inspect, load_into, dry-run
# ------------------------------------------------------------------------------------------------


VERIFY = [("bf16", "gfx950", 1, {}), ("bf16", "gfx942", 2, {"profile": "vllm-plugin"}),
          ("fp8", "gfx942", 2, {"ep": True}), ("mxfp4", "gfx950", 2, {"dp_attention": True}),
          ("mxfp4", "gfx950", 2, {"profile": "vllm-plugin"})]


@pytest.mark.parametrize("fmt,target,tp,opts", VERIFY,
                         ids=["-".join([v[0], v[1], f"tp{v[2]}", *(f"{k}={x}" for k, x in v[3].items())]) for v in VERIFY])
def test_verify_source_passes(fmt, target, tp, opts, k25_src, k25_out):
    """verify --source: every converted tensor (the carried vision tensors included) decoded and compared with
    its source; transformers' DeepseekV3 decoder layers (the language model transformers' Kimi_K25 builds from
    the text_config) against the converted-layout forward, per layer and end to end."""
    from atom_convert.check.verify import verify

    out = k25_out(fmt, target, tp, **opts)
    r = verify(out, k25_src(fmt))
    assert r.ok, r.failures
    m = json.loads((out / TL.MANIFEST).read_text())
    assert r.check.tensors_checked == tp * len(m["tensors"])
    if opts.get("profile") == "vllm-plugin":  # the carried vision tensors are compared too, on every rank
        native = verify(k25_out(fmt, target, tp, **dict(opts, profile="atom")), k25_src(fmt))
        assert r.check.values_checked - native.check.values_checked == tp * len(K25Source(k25_src(fmt)).vision())
    assert {row["what"] for row in r.rows} >= {"layer 0 output", "layer 1 output", "final logits (kv_b prefill path)"}


def test_verify_through_loader(k25_src, k25_out):
    from atom_convert.check.verify import verify

    r = verify(k25_out("bf16", "gfx950", 2, profile="vllm-plugin"), k25_src("bf16"), through_loader=True)
    assert r.ok, r.failures


def test_reference_forward_equals_transformers_kimi_k25(k25_src, k25_out):
    """transformers' own Kimi_K25ForConditionalGeneration (built from the fixture's tensors under its own names)
    computes the same text logits as the converted-layout forward of the tp-2 conversion (kv_b prefill path)."""
    import transformers

    from atom_convert.check.reference import ConvertedModel, compare
    from k25_fixtures import RENAMES, TEXT, TF_KEYS, TF_VISION

    cfg = transformers.Kimi_K25Config(text_config={k: TEXT[k] for k in TF_KEYS}, vision_config=dict(TF_VISION),
                                      projection_hidden_size=64, tie_word_embeddings=False)
    model = transformers.Kimi_K25ForConditionalGeneration._from_config(cfg, dtype=F32).eval()
    src = K25Source(k25_src("bf16"))
    inv = {b: a for a, b in RENAMES}
    tf_names = {next((inv[b] + k[len(b):] for b in inv if k.startswith(b)), k): v for k, v in src.t.items()}
    # the checkpoint's names -> the model's (transformers' reversible kimi_k25 conversion, applied by from_pretrained)
    d = Path(k25_src("bf16")).parent / "tf-names"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir()
    save_file({k: v.contiguous() for k, v in tf_names.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(d)
    model = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(str(d), dtype=F32).eval()
    ids = torch.randint(0, TEXT["vocab_size"], (12,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids[None]).logits[0]
        got = ConvertedModel(k25_out("bf16", "gfx950", 2)).forward(ids)
    c = compare(got, ref, logits=True)
    assert c["rel_l2"] < 1e-3 and c["top1"] == 1.0, c


def test_inspect_source_and_converted(k25_src, k25_out, capsys):
    from atom_convert.check.inspect import describe

    s = describe(k25_src("mxfp4"))
    assert s["architecture"] == "KimiK25ForConditionalGeneration" and s["quant_format"] == "quark-mxfp4"
    assert s["layers"] == {"decoder": 2, "dense": 1, "moe": 1, "mtp": 0, "present in files": 2}
    assert s["layer formats"] == {f"{PREFIX}model.layers.0": "self_attn: bf16; mlp: mxfp4",
                                  f"{PREFIX}model.layers.1": "self_attn: bf16; mlp.experts: mxfp4; "
                                                             "mlp.shared_experts: mxfp4"}
    assert s["outside the text model"]["prefixes"] == ["mm_projector.", "vision_tower."]
    c = describe(k25_out("mxfp4", "gfx950", 2))
    assert c["model_type"] == "kimi_k25" and c["dropped source tensors"] == len(K25Source(k25_src("mxfp4")).vision())
    assert len(c["dropped because"]) == 1
    code, out, err = run_cli(["inspect", str(k25_out("bf16", "gfx950", 1))], capsys)
    assert code == 0 and "skip_weight_prefixes" in out


class _ShardedLinear(torch.nn.Module):
    """A vLLM-style column-parallel linear: its Parameter holds rank r's rows and loads the whole
    checkpoint tensor through its own `weight_loader` (how vLLM's ViT layers load under TP)."""

    def __init__(self, full: tuple[int, ...], rank: int, tp: int):
        super().__init__()
        self.rank, self.tp = rank, tp
        self.weight = torch.nn.Parameter(torch.empty(full[0] // tp, *full[1:], dtype=BF16), requires_grad=False)
        self.weight.weight_loader = self.load  # type: ignore[attr-defined]

    def load(self, param: torch.nn.Parameter, w: torch.Tensor) -> None:
        n = w.shape[0] // self.tp
        param.data.copy_(w[self.rank * n:(self.rank + 1) * n])


def test_load_into_plugin_tree_with_sharded_vision(k25_src, k25_out):
    """load_into a vllm-plugin module tree: text tensors by name; a carried vision tensor whose live Parameter
    is cut per rank (vLLM's TP ViT) through that Parameter's weight_loader, the others copied whole."""
    from atom_convert.serve.load import load_into, module_tree, rank_view

    out = k25_out("bf16", "gfx950", 2, profile="vllm-plugin")
    src = K25Source(k25_src("bf16"))
    name = "model.vision_tower.encoder.blocks.0.wqkv"
    for r in range(2):
        tree = module_tree(rank_view(out, r))
        parent = tree.get_submodule(name.rsplit(".", 1)[0])
        full = tuple(src["vision_tower.encoder.blocks.0.wqkv.weight"].shape)
        parent.register_module("wqkv", _ShardedLinear(full, r, 2))
        parent.wqkv.register_parameter("bias", torch.nn.Parameter(torch.empty(full[0], dtype=BF16, device="meta")))
        load_into(tree, out, rank=r, profile="vllm-plugin")
        w = tree.get_submodule(name).weight
        n = full[0] // 2
        assert torch.equal(w, src["vision_tower.encoder.blocks.0.wqkv.weight"][r * n:(r + 1) * n])
        assert torch.equal(tree.get_submodule(name).bias, src["vision_tower.encoder.blocks.0.wqkv.bias"])
        assert torch.equal(tree.get_submodule("model.mm_projector.linear_1").weight, src["mm_projector.proj.0.weight"])
        assert torch.equal(tree.get_submodule("model.language_model.lm_head").weight,
                           src[f"{PREFIX}lm_head.weight"][r * 256:(r + 1) * 256])


class _VllmParameter(torch.nn.Parameter):
    """Like vLLM's ModelWeightParameter: a Parameter subclass with its own attributes and weight_loader."""


def test_load_into_plugin_tree_keeps_the_live_vision_parameters(k25_src, k25_out):
    """At tp 1 a carried vision tensor whose live Parameter has a weight_loader goes through it, as ATOM's
    plugin loader does: the live object stays (class, attributes, requires_grad); one without a loader
    is replaced by a Parameter that keeps the live requires_grad (vLLM's nn.Conv2d patch_embed)."""
    from atom_convert.serve.load import load_into, module_tree, rank_view

    out = k25_out("bf16", "gfx950", 1, profile="vllm-plugin")
    src = K25Source(k25_src("bf16"))
    tree = module_tree(rank_view(out, 0))
    wqkv = tree.get_submodule("model.vision_tower.encoder.blocks.0.wqkv")
    full = src["vision_tower.encoder.blocks.0.wqkv.weight"]
    live = _VllmParameter(torch.empty(full.shape, dtype=BF16), requires_grad=False)
    live._input_dim, live._output_dim, live.tp_rank = 1, 0, 0  # type: ignore[attr-defined]
    live.weight_loader = lambda p, w: p.data.copy_(w)  # type: ignore[attr-defined]
    wqkv.register_parameter("weight", live)
    proj = tree.get_submodule("model.vision_tower.patch_embed.proj")
    proj.register_parameter("weight", torch.nn.Parameter(torch.empty(proj.weight.shape, dtype=BF16, device="meta")))
    load_into(tree, out, rank=0, profile="vllm-plugin")
    assert wqkv._parameters["weight"] is live and type(live) is _VllmParameter
    assert (live._input_dim, live._output_dim, live.tp_rank) == (1, 0, 0) and not live.requires_grad
    assert torch.equal(live, full)
    assert proj.weight.requires_grad and torch.equal(proj.weight, src["vision_tower.patch_embed.proj.weight"])


def test_dry_run_names(k25_src, tmp_path, capsys):
    code, out, err = run_cli(["convert", str(k25_src("mxfp4")), str(tmp_path / "x"), "--dry-run", "--json", "--tp", "2",
                              "--profile", "vllm-plugin"], capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["architecture"] == "KimiK25ForConditionalGeneration" and plan["model_type"] == "kimi_k25"
    names = {t["name"] for s in plan["sets"] for t in s["tensors"]}
    assert "model.language_model.model.layers.1.mlp.experts.w13_weight" in names
    assert "model.language_model.model.layers.0.self_attn.mla_attn.W_K" in names
    assert "model.mm_projector.linear_2.weight" in names and plan["dropped"] == {}


# ------------------------------------------------------------------------------------------------
# Refusals
# ------------------------------------------------------------------------------------------------


def _rewrite(src: Path, dst: Path, *, drop: Callable[[str], bool] = lambda n: False,
             rename: Callable[[str], str] = lambda n: n, cfg: Callable[[dict[str, Any]], None] | None = None) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    t = {rename(k): v for k, v in _tensors(src).items() if not drop(k)}
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    c = json.loads((src / "config.json").read_text())
    if cfg is not None:
        cfg(c)
    (dst / "config.json").write_text(json.dumps(c, indent=2))
    return dst


def test_plugin_without_vision_refused_native_fine(k25_src, work):
    bad = _rewrite(k25_src("bf16"), work / "bad" / "no-vision", drop=lambda n: n.startswith("vision_tower."))
    with pytest.raises(CheckpointError, match=r"no vision_tower\.\* tensor.*--profile vllm-plugin"):
        atom_convert.convert(bad, work / "refused-no-vision", target="gfx950", profile="vllm-plugin")
    atom_convert.convert(bad, work / "ok-no-vision", target="gfx950")  # native needs none (§3.3)


def test_plugin_missing_projector_refused(k25_src, work, capsys):
    bad = _rewrite(k25_src("bf16"), work / "bad" / "no-proj2", drop=lambda n: n.startswith("mm_projector.proj.2."))
    with pytest.raises(CheckpointError, match=r"missing tensor mm_projector\.proj\.2\.weight.*linear"):
        atom_convert.convert(bad, work / "refused-no-proj2", target="gfx950", profile="vllm-plugin")
    code, out, err = run_cli(["convert", str(bad), str(work / "refused-cli"), "--profile", "vllm-plugin"], capsys)
    assert code == 2 and "mm_projector.proj.2.weight" in err


def test_plugin_without_vision_config_refused(k25_src, work):
    bad = _rewrite(k25_src("bf16"), work / "bad" / "no-vcfg", cfg=lambda c: c.pop("vision_config"))
    with pytest.raises(UnsupportedError, match=r"no vision_config.*--profile atom"):
        atom_convert.convert(bad, work / "refused-no-vcfg", target="gfx950", profile="vllm-plugin")


def test_quantized_vision_refused_under_plugin(k25_src, work):
    bad = _rewrite(k25_src("bf16"), work / "bad" / "u8-vision",
                   rename=lambda n: n, drop=lambda n: n == "vision_tower.encoder.blocks.0.wo.weight")
    t = _tensors(bad)
    t["vision_tower.encoder.blocks.0.wo.weight"] = torch.zeros(64, 32, dtype=torch.uint8) + 3
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"vision_tower\.encoder\.blocks\.0\.wo\.weight has dtype torch\.uint8"):
        atom_convert.convert(bad, work / "refused-u8", target="gfx950", profile="vllm-plugin")


def _two_block_tower(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor], dict[str, Any]], None]) -> Path:
    """`src` with its vision tower's block 0 repeated as block 1 (vt_num_hidden_layers 2), then `edit`ed."""
    t = _tensors(src)
    p0 = "vision_tower.encoder.blocks.0."
    t.update({"vision_tower.encoder.blocks.1." + k[len(p0):]: v.clone() for k, v in t.items() if k.startswith(p0)})
    c = json.loads((src / "config.json").read_text())
    c["vision_config"]["vt_num_hidden_layers"] = 2
    edit(t, c)
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(c, indent=2))
    return dst


TOWER_CASES = [
    ("whole", lambda t, c: None, None),
    ("block-1-lacks-a-bias", lambda t, c: t.pop("vision_tower.encoder.blocks.1.wo.bias"),
     r"vision_tower\.encoder\.blocks\.1 lacks wo\.bias"),
    ("block-0-lacks-a-weight", lambda t, c: t.pop("vision_tower.encoder.blocks.0.mlp.fc1.weight"),
     r"vision_tower\.encoder\.blocks\.0 lacks mlp\.fc1\.weight"),
    ("block-1-misshapen", lambda t, c: t.__setitem__("vision_tower.encoder.blocks.1.wqkv.weight",
                                                      torch.randn(96, 64).bfloat16()),
     r"blocks\.1\.wqkv\.weight has shape \[96, 64\] torch\.bfloat16, expected \[192, 64\] torch\.bfloat16 as in block 0"),
    ("block-1-extra-tensor", lambda t, c: t.__setitem__("vision_tower.encoder.blocks.1.extra.weight",
                                                         torch.randn(4).bfloat16()),
     r"blocks\.1\.extra\.weight: block 0 has no extra\.weight"),
    ("config-says-more-blocks", lambda t, c: c["vision_config"].__setitem__("vt_num_hidden_layers", 4),
     r"holds encoder blocks 0\.\.1, but config\.json vision_config says 4 layer\(s\) \(expected blocks 0\.\.3; "
     r"missing 2\.\.3\)"),
    ("config-says-fewer-blocks", lambda t, c: c["vision_config"].__setitem__("vt_num_hidden_layers", 1),
     r"beyond it 1\)"),
    ("no-final-norm", lambda t, c: t.pop("vision_tower.encoder.final_layernorm.bias"),
     r"missing tensor vision_tower\.encoder\.final_layernorm\.bias"),
    ("projector-output-not-hidden", lambda t, c: t.__setitem__("mm_projector.proj.2.weight", torch.randn(128, 256).bfloat16()),
     r"mm_projector\.proj\.2\.weight has shape \[128, 256\], expected \[256, K\]"),
    ("projector-widths-disagree", lambda t, c: t.__setitem__("mm_projector.proj.0.weight", torch.randn(200, 256).bfloat16()),
     r"mm_projector\.proj\.0\.weight has shape \[200, 256\], expected 2-D with 256 rows"),
    ("projector-weights-not-matrices", lambda t, c: t.update({"mm_projector.proj.2.weight": torch.randn(256).bfloat16(),
                                                              "mm_projector.proj.0.weight": torch.tensor(1.0).bfloat16()}),
     r"(?s)proj\.2\.weight has shape \[256\], expected \[256, K\].*proj\.0\.weight has shape \[\], expected a 2-D"),
]


@pytest.mark.parametrize("case, edit, message", TOWER_CASES, ids=[c[0] for c in TOWER_CASES])
def test_plugin_vision_tower_checked_whole(k25_src, work, case, edit, message):
    """Under --profile vllm-plugin the carried tower must be whole, refused before converting rather than at
    the server's load: blocks 0..N-1 as vision_config says, each with MoonViT's twelve tensors and block 0's
    shapes, the final norm and patch embedding, and a projector whose output is the text hidden size. A whole
    two-block tower converts; `--profile atom` drops the tower and never looks."""
    src = _two_block_tower(k25_src("bf16"), work / "bad" / f"tower-{case}", edit)
    dst = work / f"tower-{case}"
    if message is None:
        atom_convert.convert(src, dst, target="gfx950", profile="vllm-plugin", force=True)
        return
    with pytest.raises(CheckpointError, match=message):
        atom_convert.convert(src, dst, target="gfx950", profile="vllm-plugin")
    assert not dst.exists()
    atom_convert.convert(src, work / f"tower-{case}-native", target="gfx950", force=True)


def test_mxfp4_on_gfx942_refused(k25_src, work, capsys):
    with pytest.raises(UnsupportedError, match=r"MXFP4 checkpoints convert for gfx950 only"):
        atom_convert.convert(k25_src("mxfp4"), work / "refused-942", target="gfx942")
    code, out, err = run_cli(["convert", str(k25_src("mxfp4")), str(work / "refused-942-cli"), "--target", "gfx942"],
                             capsys)
    assert code == 2 and "gfx950 only" in err


def test_transformers_save_names_refused(work):
    """An un-renamed transformers save (`language_model.model.blocks.{i}`, §5.4) is refused, naming the fix."""
    src = build_k25(work / "src" / "tf-names", fmt="bf16", seed=11, keep_tf_names=True)
    with pytest.raises(CheckpointError, match=r"(?s)language_model\.model\.blocks\.0\..*named `blocks`.*Rename"):
        atom_convert.convert(src, work / "refused-tf-names", target="gfx950")


def test_config_without_text_config_refused(k25_src, work):
    bad = _rewrite(k25_src("bf16"), work / "bad" / "no-text", cfg=lambda c: c.pop("text_config"))
    with pytest.raises(ConfigError, match=r"text_config is (null|absent|missing|None).*language model"):
        atom_convert.convert(bad, work / "refused-no-text", target="gfx950")


def test_mtp_in_text_config_refused(k25_src, work):
    bad = _rewrite(k25_src("bf16"), work / "bad" / "mtp",
                   cfg=lambda c: c["text_config"].__setitem__("num_nextn_predict_layers", 1))
    with pytest.raises(UnsupportedError, match=r"Kimi-K2\.5 has no MTP layer"):
        atom_convert.convert(bad, work / "refused-mtp", target="gfx950")


def test_unknown_prefix_tensor_refused(k25_src, work):
    bad = _rewrite(k25_src("bf16"), work / "bad" / "tf-proj",
                   rename=lambda n: "model." + n if n.startswith("mm_projector.pre_norm.") else n)
    with pytest.raises(CheckpointError, match=r"unmapped tensor model\.mm_projector\.pre_norm\.weight"):
        atom_convert.convert(bad, work / "refused-tf-proj", target="gfx950")



@pytest.mark.parametrize("quantize,target,tp,opts", [("mxfp4", "gfx950", 2, {}), ("fp8", "gfx942", 2, {}),
                                                     ("mxfp4", "gfx950", 2, {"ep": True}),
                                                     ("fp8", "gfx950", 1, {"profile": "vllm-plugin"})])
def test_int4_release_requantised(quantize, target, tp, opts, k25_src, k25_out, work):
    """The official Kimi-K2.5 release is compressed-tensors int4 (spec §3.1, §4): with --quantize its routed
    experts are re-encoded (verify --source holds them within the rounding's bound against the exact int4
    values), and every other tensor is byte-equal to the conversion of the same model's bf16 release (the
    shared experts stay bf16 and apart, as for Kimi-K2-Thinking, so the stacks and shared_experts differ)."""
    from atom_convert.check.verify import verify

    src = k25_src("int4")
    dst = work / "out" / f"int4-{quantize}-{target}-tp{tp}-{'-'.join(opts)}"
    with pytest.raises(UnsupportedError, match="--quantize"):
        atom_convert.convert(src, work / "out" / "int4-refused", target=target, tp=tp, **opts)
    atom_convert.convert(src, dst, target=target, tp=tp, quantize=quantize, **opts)
    m = json.loads((dst / TL.MANIFEST).read_text())
    assert m["requantization"]["to"] == {"mxfp4": "mxfp4", "fp8": "fp8-block"}[quantize], m["requantization"]
    r = verify(dst, src)
    assert r.ok, r.failures
    ref = k25_out("bf16", target, tp, **opts)
    same = 0
    for rank in range(tp):
        with atom_convert.open_converted(dst, rank=rank) as a, atom_convert.open_converted(ref, rank=rank) as b:
            names = set(a.manifest["tensors"]) & set(b.manifest["tensors"])
            for n in sorted(names):
                if ".mlp.experts." in n or "shared_experts" in n:
                    continue
                assert torch.equal(a.get(n).reshape(-1).view(torch.uint8), b.get(n).reshape(-1).view(torch.uint8)), (rank, n)
                same += 1
    assert same > 20 * tp


# §3.3's table (Kimi-K2.5, fp8-block case, native ATOM, gfx950, tp 8), rank 0: name -> (dtype, shape), under
# `language_model.`; `L.` a decoder layer's prefix. The attention and expert shapes are Kimi-K2's (64 heads, 8 a
# rank; 384 routed experts and the fused shared one; layout spec §2.8), the embedding vocabulary-parallel.
K25_SPEC_TP8 = {
    "model.embed_tokens.weight": ("bfloat16", [20480, 7168]), "lm_head.weight": ("bfloat16", [20480, 7168]),
    "model.norm.weight": ("bfloat16", [7168]),
    "L.self_attn.fused_qkv_a_proj.weight": ("float8_e4m3fn", [2112, 7168]),
    "L.self_attn.fused_qkv_a_proj.weight_scale": ("float32", [17, 56]),
    "L.self_attn.q_b_proj.weight": ("float8_e4m3fn", [1536, 1536]),
    "L.self_attn.q_b_proj.weight_scale": ("float32", [12, 12]),
    "L.self_attn.kv_b_proj.weight": ("float8_e4m3fn", [2048, 512]),
    "L.self_attn.kv_b_proj.weight_scale": ("float32", [16, 4]),
    "L.self_attn.o_proj.weight": ("float8_e4m3fn", [7168, 1024]),
    "L.self_attn.o_proj.weight_scale": ("float32", [56, 8]),
    "L.self_attn.mla_attn.impl.W_K": ("float8_e4m3fn", [8, 512, 128]),
    "L.self_attn.mla_attn.impl.W_V": ("float8_e4m3fn", [8, 128, 512]),
}
K25_SPEC_TP8_DENSE = {
    "L.mlp.gate_up_proj.weight": ("float8_e4m3fn", [4608, 7168]), "L.mlp.gate_up_proj.weight_scale": ("float32", [36, 56]),
    "L.mlp.down_proj.weight": ("float8_e4m3fn", [7168, 2304]), "L.mlp.down_proj.weight_scale": ("float32", [56, 18]),
}
K25_SPEC_TP8_MOE = {
    # the router and its bias are bf16 at run time (atom-layout.md §2.4 and §8, item 9)
    "L.mlp.gate.weight": ("bfloat16", [384, 7168]), "L.mlp.gate.e_score_correction_bias": ("bfloat16", [384]),
    "L.mlp.experts.w13_weight": ("float8_e4m3fn", [385, 512, 7168]),
    "L.mlp.experts.w13_weight_scale": ("float32", [385, 4, 56]),
    "L.mlp.experts.w2_weight": ("float8_e4m3fn", [385, 7168, 256]),
    "L.mlp.experts.w2_weight_scale": ("float32", [385, 56, 2]),
}


def test_dry_run_full_width_matches_spec_tp8(tmp_path):
    """--dry-run on a header-only Kimi-K2.5 checkpoint at full width (Kimi-K2's text model, 1 dense + 2 MoE
    layers of 61, under `language_model.`, with the vision tower and projector; quantization_config at the top
    level, §3.1) plans §3.3's rank-0 inventory at tp 8, holds no vision or projector tensor natively, and
    carries every one of them, bf16 and whole, under --profile vllm-plugin (§3.4)."""
    from atom_convert.engine.planning import plan_summary
    from atom_convert.layout.options import ConversionOptions
    from atom_convert.synth import kimi_k25_config, load_preset, source_inventory
    from test_glm5 import header_only_glm

    text = dict(load_preset("kimi-k2"), num_hidden_layers=3)
    text.pop("quantization_config", None)
    cfg = kimi_k25_config(text)
    src = header_only_glm(cfg, tmp_path / "k25-fp8")
    vision = {n: list(shape) for n, shape, _ in source_inventory(cfg) if not n.startswith(PREFIX)}
    assert vision and all(n.startswith(("vision_tower.", "mm_projector.")) for n in vision)

    def rank0(profile: str) -> dict[str, tuple[str, list[int]]]:
        plan = plan_summary(src, options=ConversionOptions(target="gfx950", tp=8, profile=profile))
        return {t["name"]: (t["dtype"], list(t["shape"]))
                for st in plan["sets"] if st["role"] == "main" for t in st["tensors"] if t["rank"] == 0}

    rows = rank0("atom")
    expected: dict[str, tuple[str, list[int]]] = {}
    for i in range(3):
        for k, v in dict(K25_SPEC_TP8, **(K25_SPEC_TP8_DENSE if i < 1 else K25_SPEC_TP8_MOE)).items():
            if k.startswith("L."):
                expected[f"{PREFIX}model.layers.{i}.{k[2:]}"] = v
            elif i == 0:
                expected[PREFIX + k] = v
    for name, v in expected.items():
        assert rows.get(name) == v, (name, rows.get(name))
    assert all(n.startswith(PREFIX) for n in rows), sorted(n for n in rows if not n.startswith(PREFIX))
    assert not any(n.startswith(("vision_tower.", "mm_projector.")) for n in rows)
    plugin = rank0("vllm-plugin")
    carried = {n: v for n, v in plugin.items() if not n.startswith(("language_model.", "model.language_model."))}
    assert carried and all(dt == "bfloat16" for dt, _ in carried.values()), carried
    assert sorted(shape for _, shape in carried.values()) == sorted(vision.values())
