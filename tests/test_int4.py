"""compressed-tensors int4 `pack-quantized` sources (Kimi-K2-Thinking) and `--quantize mxfp4|fp8`
(atom-layout-next.md §4).

Oracles: compressed-tensors' own decompression for the source codec; amd-quark's own OCP MXFP4
quantiser for the MXFP4 re-encoding (byte-equal codes and e8m0 scales); for fp8 block an independent
block-by-block reference of DeepSeek's rule (int4_fixtures.fp8_block_reference) and
compressed-tensors' FP8 block dequantiser. A --quantize conversion must be byte-identical to the
ordinary conversion of the same model exported as a Quark-MXFP4 / DeepSeek-fp8 checkpoint by those
oracles (int4_fixtures.served_*): the existing MXFP4 / fp8 paths then vouch for the layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import atom_convert
from atom_convert.check.verify import verify
from atom_convert.engine.planning import plan_summary
from atom_convert.errors import BadInputError, UnsupportedError
from atom_convert.layout.codecs import detect_format
from atom_convert.layout.codecs.fp8_block import block_dequant
from atom_convert.layout.codecs.int4_pack import int4_dequant, pack_int4, unpack_int4
from atom_convert.layout.codecs.requant import fp8_block_quant, quark_mxfp4_quant, served_quantization_config
from atom_convert.layout.options import ConversionOptions
from atom_convert.store.fingerprint import options_fingerprint

from int4_fixtures import (build_int4, ct_decompress, exact_values, fp8_block_reference, served_fp8,
                           served_mxfp4)
from quark_fixtures import quark_mxfp4_quantize


@pytest.fixture(scope="module")
def srcs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """int4 at hidden 256 (MXFP4 MoE needs H % 256 == 0; int64 weight_shape as ct 0.20 writes it) and
    at hidden 320 (partial 128-column fp8 blocks; int32 weight_shape as Kimi's files), with their bf16
    originals."""
    root = tmp_path_factory.mktemp("int4")
    a = build_int4(root / "k256", hidden=256, seed=3)
    b = build_int4(root / "k320", hidden=320, seed=4, shape_dtype=torch.int32)
    return {"int4": a, "int4_320": b, "bf16": a.parent / "k256-bf16", "bf16_320": b.parent / "k320-bf16",
            "root": root}


def _served(src: Path, quantize: str) -> dict:
    return served_quantization_config(detect_format(json.loads((src / "config.json").read_text())), quantize)


def _tensors(d: Path) -> dict[str, bytes]:
    out = {}
    for f in sorted(d.rglob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                raw = t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
                out[f"{f.relative_to(d)}:{k}"] = (str(t.dtype), tuple(t.shape), raw)
    return out


def _same_files(a: Path, b: Path) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb)
    bad = [k for k in ta if ta[k] != tb[k]]
    assert not bad, f"{len(bad)} of {len(ta)} tensors differ, e.g. {bad[:3]}"


# ------------------------------------------------------------------------------------------------
# The source codec
# ------------------------------------------------------------------------------------------------


def test_int4_codec_matches_compressed_tensors(srcs) -> None:
    from safetensors.torch import load_file

    for key in ("int4", "int4_320"):
        t = load_file(str(srcs[key] / "model.safetensors"))
        bases = sorted({k.removesuffix(".weight_packed") for k in t if k.endswith(".weight_packed")})
        assert len(bases) == 2 * 12 * 3  # two MoE layers, 12 experts, gate/up/down
        for b in bases:
            p, s, sh = t[b + ".weight_packed"], t[b + ".weight_scale"], t[b + ".weight_shape"]
            ours = int4_dequant(p, s)
            # ct computes in the scale's dtype: bf16(q*s); with an fp32 scale it is the exact q*s.
            assert torch.equal(ours.to(torch.bfloat16), ct_decompress(p, s, sh))
            assert torch.equal(ours, ct_decompress(p, s.float(), sh))
            assert torch.equal(pack_int4(unpack_int4(p)), p)
        q = torch.cat([unpack_int4(t[b + ".weight_packed"]).flatten() for b in bases])
        assert int(q.min()) == -8 and int(q.max()) == 7  # minmax amax/7.5: the format's -8 occurs


def test_int4_format_detected_and_refused_without_quantize(srcs, tmp_path) -> None:
    fmt = detect_format(json.loads((srcs["int4"] / "config.json").read_text()))
    assert fmt.name == "ct-int4-pack"
    assert fmt.codec_for("model.layers.1.mlp.experts.3.down_proj").name == "int4-pack"
    for m in ("model.layers.1.mlp.shared_experts.gate_proj", "model.layers.1.self_attn.q_a_proj",
              "model.layers.0.mlp.gate_proj", "lm_head"):
        assert fmt.codec_for(m).name == "bf16", m
    with pytest.raises(UnsupportedError, match="no int4 MoE.*--quantize mxfp4.*--quantize fp8"):
        atom_convert.convert(srcs["int4"], tmp_path / "x", target="gfx950")
    with pytest.raises(UnsupportedError, match="gfx950 only"):
        ConversionOptions(target="gfx942", quantize="mxfp4")
    with pytest.raises(BadInputError, match="--quantize must be"):
        ConversionOptions(quantize="int8")
    # an fp8 source is already served: --quantize refused
    fp8 = served_fp8(srcs["int4_320"], tmp_path / "f8", _served(srcs["int4_320"], "fp8"), experts_only=True)
    with pytest.raises(UnsupportedError, match="already in a format ATOM serves"):
        plan_summary(fp8, "gfx950", quantize="fp8")
    assert not (tmp_path / "x").exists()


def test_int4_bad_weight_shape_value_refused(srcs, tmp_path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(srcs["int4"], bad)
    t = load_file(str(bad / "model.safetensors"))
    t["model.layers.2.mlp.experts.5.up_proj.weight_shape"] = torch.tensor([256, 128])
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(BadInputError, match=r"experts\.5\.up_proj\.weight_shape holds \[256, 128\], expected"):
        atom_convert.convert(bad, tmp_path / "o", target="gfx950", quantize="mxfp4")


_E = "model.layers.1.mlp.experts.3.gate_proj"


def _weights(g):
    return lambda c: g(c["quantization_config"]["config_groups"]["group_0"]["weights"])


# (case, tensor edit or None, config edit or None, what the message must name)
INT4_DAMAGE = [
    ("packed-as-float", lambda t: t.__setitem__(_E + ".weight_packed", t[_E + ".weight_packed"].float()), None,
     [_E + ".weight_packed", "float32"]),
    ("packed-short-rows", lambda t: t.__setitem__(_E + ".weight_packed", t[_E + ".weight_packed"][:-1]), None,
     [_E + ".weight_packed", "shape"]),
    ("scale-short", lambda t: t.__setitem__(_E + ".weight_scale", t[_E + ".weight_scale"][:, :-1]), None,
     [_E + ".weight_scale", "shape"]),
    ("scale-nan", lambda t: t[_E + ".weight_scale"].fill_(float("nan")), None, [_E + ".weight_scale", "NaN"]),
    ("scale-zero", lambda t: t[_E + ".weight_scale"].zero_(), None, [_E + ".weight_scale", "zero or negative"]),
    ("scale-missing", lambda t: t.pop(_E + ".weight_scale"), None, [_E + ".weight_scale", "missing"]),
    ("bits-8", None, _weights(lambda w: w.__setitem__("num_bits", 8)), ["num_bits", "8"]),
    ("group-64", None, _weights(lambda w: w.__setitem__("group_size", 64)), ["group_size is 64", "expected 32"]),
    ("asymmetric", None, _weights(lambda w: w.__setitem__("symmetric", False)), ["symmetric"]),
    ("activations-quantized", None,
     lambda c: c["quantization_config"]["config_groups"]["group_0"].__setitem__(
         "input_activations", {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}),
     ["input_activations", "W4A16"]),
]


@pytest.mark.parametrize("case, edit_t, edit_c, words", INT4_DAMAGE, ids=[c[0] for c in INT4_DAMAGE])
def test_damaged_int4_source_refused(srcs, tmp_path, case, edit_t, edit_c, words) -> None:
    """A damaged int4 source (packed weights, scales, the quantization_config's weight scheme) is refused
    with exit 2 by `convert --quantize mxfp4`, naming the tensor or key, and nothing is left behind."""
    import shutil

    from safetensors.torch import load_file, save_file

    from cliutil import leftovers
    from hostile_util import run_cli

    bad = tmp_path / "bad"
    shutil.copytree(srcs["int4"], bad)
    if edit_t is not None:
        t = load_file(str(bad / "model.safetensors"))
        edit_t(t)
        save_file({k: v.contiguous() for k, v in t.items()}, str(bad / "model.safetensors"), metadata={"format": "pt"})
    if edit_c is not None:
        c = json.loads((bad / "config.json").read_text())
        edit_c(c)
        (bad / "config.json").write_text(json.dumps(c))
    out = tmp_path / "out"
    r = run_cli(["convert", str(bad), str(out), "--target", "gfx950", "--tp", "2", "--quantize", "mxfp4"])
    assert r.code == 2, r.text
    assert "Traceback" not in r.text and all(w in r.text for w in words), r.text
    assert not out.exists() and not leftovers(out)


# ------------------------------------------------------------------------------------------------
# The quantisers against their oracles
# ------------------------------------------------------------------------------------------------


def test_mxfp4_quantiser_is_quarks_bytes(srcs) -> None:
    vals = exact_values(srcs["int4"])
    bf16 = exact_values(srcs["bf16"])
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -0.1, 0.0, -0.0, 6.5, -5.0, 3.0, 0.5] * 2)
    cases = [vals["model.layers.1.mlp.experts.0.gate_proj.weight"], vals["model.layers.2.mlp.experts.7.down_proj.weight"],
             bf16["model.layers.1.mlp.experts.4.up_proj.weight"].float(), ties[None] * 2.0**-3,
             torch.zeros(2, 64), torch.randn(64, 256) * 1e-30,
             # fp32 values one ulp off the midpoints (a second rounding would tie them), wide exponent range
             torch.tensor([4.0, 0.25 + 2**-25, 0.25 - 2**-26, 0.75 + 2**-24, 0.75 - 2**-25, 0.5 + 2**-24, 1 - 2**-24,
                           1.25 + 2**-22, 1.75 - 2**-22, 2**-30] + [0.1] * 22)[None] * torch.tensor([[1.0], [-1.0]]),
             torch.rand(64, 256) * torch.exp2(torch.randint(-20, 20, (64, 256)).float())]
    for x in cases:
        packed, scale, _ = quark_mxfp4_quantize(x.float())
        ours_p, ours_s = quark_mxfp4_quant(x)
        assert torch.equal(ours_s, scale), "e8m0 scales differ from amd-quark's"
        assert torch.equal(ours_p, packed), "e2m1 codes differ from amd-quark's"


def test_fp8_quantiser_is_deepseeks_rule(srcs) -> None:
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    vals = exact_values(srcs["int4_320"])
    for name in ("model.layers.1.mlp.experts.2.gate_proj.weight", "model.layers.2.mlp.experts.9.down_proj.weight"):
        w = vals[name]  # [256, 320] (partial column block of 64) and [320, 256] (partial row block)
        q, s = fp8_block_quant(w)
        rq, rs = fp8_block_reference(w)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
        deq = block_dequant(q, s)
        args = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[128, 128], symmetric=True)
        n, k = w.shape
        if n % 128 == 0 and k % 128 == 0:
            assert torch.equal(dequantize(q, s, args=args, dtype=torch.float32), deq)
        else:  # ct's block dequantiser takes whole blocks: compare the whole-block part
            nn, kk = n // 128 * 128, k // 128 * 128
            got = dequantize(q[:nn, :kk], s[:nn // 128, :kk // 128], args=args, dtype=torch.float32)
            assert torch.equal(got, deq[:nn, :kk])
        rel = ((deq - w).abs() / w.abs().clamp(min=1e-30))[w.abs() >= s.repeat_interleave(128, 0)[:n].repeat_interleave(
            128, 1)[:, :k] * 2.0**-6]
        assert float(rel.max()) <= 2.0**-4  # spec §4.5


# ------------------------------------------------------------------------------------------------
# Conversions: byte-identical to the ordinary conversion of the oracle-made checkpoint
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp,ep", [(1, False), (2, False), (2, True)])
def test_quantize_mxfp4_equals_quark_export(srcs, tp, ep) -> None:
    root = srcs["root"]
    ref = root / "served-mxfp4"
    if not ref.exists():
        served_mxfp4(srcs["int4"], ref, _served(srcs["int4"], "mxfp4"))
    ours = root / f"q-mx-{tp}-{ep}"
    m = atom_convert.convert(srcs["int4"], ours, target="gfx950", tp=tp, ep=ep, quantize="mxfp4", force=True)
    plain = atom_convert.convert(ref, root / f"p-mx-{tp}-{ep}", target="gfx950", tp=tp, ep=ep, force=True)
    _same_files(ours, root / f"p-mx-{tp}-{ep}")
    assert m["tensors"].keys() == plain["tensors"].keys()
    assert all(e["dtype"] == plain["tensors"][n]["dtype"] for n, e in m["tensors"].items())
    assert set(m["model"]["moe_layers"].values()) == {"separate_shared_experts"}  # bf16 shared, MXFP4 routed
    rq = m["requantization"]
    assert (rq["from"], rq["to"], rq["modules"]) == ("ct-int4-pack", "mxfp4", "routed experts")
    assert "half to even" in rq["rounding"] and "exact fp32" in rq["input"]
    assert m["conversion"]["options"]["quantize"] == "mxfp4" and "--quantize mxfp4" in m["conversion"]["command"]
    # config.json says what the directory holds: Quark MXFP4 for the routed experts, the rest excluded
    cfg = json.loads((ours / "config.json").read_text())
    assert cfg["quantization_config"] == json.loads((ref / "config.json").read_text())["quantization_config"]
    fmt = detect_format(cfg)
    assert fmt.name == "quark-mxfp4"
    assert fmt.codec_for("model.layers.1.mlp.experts.0.gate_proj").name == "mxfp4"
    for mod in ("model.layers.1.mlp.shared_experts.up_proj", "model.layers.2.self_attn.kv_b_proj",
                "model.layers.0.mlp.down_proj", "lm_head"):
        assert fmt.codec_for(mod).name == "bf16", mod
    r = verify(ours, srcs["int4"], layers=[1])
    assert r.ok, r.failures
    req = [row for row in r.rows if row["kind"] == "requant"]
    assert len(req) == 2 * 2 * tp and all(0.5 < row["bound_ratio"] <= 1.0 for row in req)
    # spec §4.4: at most 1.6 int4 steps (reached: the bound is tight), about 10% relative RMS
    assert all(row["int4_steps"] <= 1.6 + 1e-6 and 0.05 < row["rel_l2"] < 0.15 for row in req)
    # attention and the dense layer are untouched by the re-encoding: still checked exactly
    assert all(row["kind"] != "info" for row in r.rows if " attention " in row["what"])


@pytest.mark.parametrize("target,tp", [("gfx942", 1), ("gfx942", 2), ("gfx950", 2)])
def test_quantize_fp8_equals_deepseek_rule(srcs, target, tp) -> None:
    root = srcs["root"]
    ref = root / "served-fp8"
    if not ref.exists():
        served_fp8(srcs["int4_320"], ref, _served(srcs["int4_320"], "fp8"), experts_only=True)
    ours = root / f"q-f8-{target}-{tp}"
    m = atom_convert.convert(srcs["int4_320"], ours, target=target, tp=tp, quantize="fp8", force=True)
    atom_convert.convert(ref, root / f"p-f8-{target}-{tp}", target=target, tp=tp, force=True)
    _same_files(ours, root / f"p-f8-{target}-{tp}")
    assert m["requantization"]["to"] == "fp8-block" and "amax / 448" in m["requantization"]["rounding"]
    cfg = json.loads((ours / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "fp8" and cfg["weight_block_size"] == [128, 128]
    assert cfg["ignore"][:4] == ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                 r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
    fmt = detect_format(json.loads((ours / "config.json").read_text()))
    assert fmt.codec_for("model.layers.2.mlp.experts.11.up_proj").name == "fp8-block"
    assert fmt.codec_for("model.layers.2.mlp.shared_experts.up_proj").name == "bf16"
    r = verify(ours, srcs["int4_320"], layers=[0, 2])
    assert r.ok, r.failures
    req = [row for row in r.rows if row["kind"] == "requant"]
    assert req and all(row["bound_ratio"] <= 1.0 and row["int4_steps"] <= 0.5 for row in req)


def test_bf16_source_quantize_fp8_every_linear(srcs) -> None:
    """bf16 -> fp8: every linear DeepSeek's fp8 release quantises (shared expert fused again, as in
    DeepSeek's fp8 checkpoints), equal to converting the DeepSeek-rule fp8 export; config.json is
    DeepSeek's fp8 quantization_config."""
    root = srcs["root"]
    ref = served_fp8(srcs["bf16_320"], root / "served-bf16-fp8", _served(srcs["bf16_320"], "fp8"), experts_only=False)
    m = atom_convert.convert(srcs["bf16_320"], root / "q-bf16-f8", target="gfx942", tp=2, quantize="fp8", force=True)
    atom_convert.convert(ref, root / "p-bf16-f8", target="gfx942", tp=2, force=True)
    _same_files(root / "q-bf16-f8", root / "p-bf16-f8")
    assert set(m["model"]["moe_layers"].values()) == {"fused_shared_expert"}
    assert m["tensors"]["model.layers.1.self_attn.q_b_proj.weight"]["dtype"] == "float8_e4m3fnuz"
    assert json.loads((root / "q-bf16-f8" / "config.json").read_text())["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    r = verify(root / "q-bf16-f8", srcs["bf16_320"], layers=[1])
    assert r.ok, r.failures
    assert all(row["kind"] in ("requant", "info") for row in r.rows)


def test_bf16_source_quantize_mxfp4_experts(srcs) -> None:
    root = srcs["root"]
    ref = served_mxfp4(srcs["bf16"], root / "served-bf16-mx", _served(srcs["bf16"], "mxfp4"))
    atom_convert.convert(srcs["bf16"], root / "q-bf16-mx", target="gfx950", tp=2, quantize="mxfp4", force=True)
    atom_convert.convert(ref, root / "p-bf16-mx", target="gfx950", tp=2, force=True)
    _same_files(root / "q-bf16-mx", root / "p-bf16-mx")
    r = verify(root / "q-bf16-mx", srcs["bf16"], layers=[2])
    assert r.ok, r.failures


def test_verify_fails_above_the_bound(srcs, tmp_path) -> None:
    """A re-encoded tensor off by more than the spec's bound fails verify, naming it."""
    import shutil

    from atom_convert.check.verify import check_requant

    root = srcs["root"]
    src = root / "q-mx-1-False"
    if not src.exists():
        atom_convert.convert(srcs["int4"], src, target="gfx950", quantize="mxfp4")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    m = json.loads((bad / "atom_manifest.json").read_text())
    name = "model.layers.2.mlp.experts.w2_weight_scale"
    f = bad / m["tensors"][name]["file"]
    from safetensors.torch import load_file, save_file

    t = load_file(str(f))
    t[name] = t[name] + (t[name] > 0).to(torch.uint8)  # every scale doubled: codes now twice off
    save_file(t, str(f), metadata={"format": "pt"})
    rows = check_requant(bad, srcs["int4"])
    failed = [row["what"] for row in rows if not row["ok"]]
    assert failed == [f"bad/rank0 model.layers.2.mlp.experts.w2_weight (ct-int4-pack -> mxfp4)"]


def test_options_fingerprint_and_dry_run(srcs) -> None:
    a, b, c = (ConversionOptions(target="gfx950", tp=2, quantize=q) for q in (None, "mxfp4", "fp8"))
    digests = {options_fingerprint(o).digest for o in (a, b, c)}
    assert len(digests) == 3
    assert "quantize" not in a.layout() and "quantize" not in a.fingerprint_parts()  # old keys unchanged
    plan = plan_summary(srcs["int4"], "gfx950", tp=2, quantize="mxfp4")
    assert plan["source_format"] == "ct-int4-pack" and plan["quantize"] == "mxfp4"
    t = {r["name"]: r for r in plan["sets"][0]["tensors"] if r["rank"] == 0}
    assert t["model.layers.1.mlp.experts.w13_weight"]["dtype"] == "float4_e2m1fn_x2"
    assert t["model.layers.1.mlp.shared_experts.gate_up_proj.weight"]["dtype"] == "bfloat16"


def test_full_width_dry_run(tmp_path) -> None:
    """Kimi-K2-Thinking at full width (one dense and two MoE layers, header only): the per-rank shapes of
    --quantize fp8 at gfx942 tp 8 and --quantize mxfp4 at gfx950 tp 4 --ep (atom-layout-next.md §4.5, §4.4)."""
    from int4_fixtures import header_only_int4

    src = header_only_int4(tmp_path / "kimi", layers=3)
    p = plan_summary(src, "gfx942", tp=8, quantize="fp8")
    t = {r["name"]: r for r in p["sets"][0]["tensors"] if r["rank"] == 0}
    e = "model.layers.1.mlp.experts."
    assert (t[e + "w13_weight"]["dtype"], t[e + "w13_weight"]["shape"]) == ("float8_e4m3fnuz", [384, 512, 7168])
    assert t[e + "w13_weight_scale"]["shape"] == [384, 4, 56] and t[e + "w2_weight_scale"]["shape"] == [384, 56, 2]
    assert t["model.layers.1.mlp.shared_experts.gate_up_proj.weight"]["shape"] == [512, 7168]
    p = plan_summary(src, "gfx950", tp=4, ep=True, quantize="mxfp4")
    t = {r["name"]: r for r in p["sets"][0]["tensors"] if r["rank"] == 0}
    assert (t[e + "w13_weight"]["dtype"], t[e + "w13_weight"]["shape"]) == ("float4_e2m1fn_x2", [96, 4096, 3584])
    assert t[e + "w13_weight_scale"]["shape"] == [96 * 4096, 224] and t[e + "w2_weight"]["shape"] == [96, 7168, 1024]
    with pytest.raises(UnsupportedError, match="no int4 MoE"):
        plan_summary(src, "gfx950", tp=4)


def test_cli_quantize(srcs, tmp_path, capsys) -> None:
    from cliutil import leftovers, run_cli

    dst = tmp_path / "out"
    code, out, err = run_cli(["convert", srcs["int4"], dst, "--target", "gfx950"], capsys)
    assert code == 2 and "no int4 MoE" in err and "--quantize mxfp4" in err and not dst.exists()
    code, out, err = run_cli(["convert", srcs["int4"], dst, "--target", "gfx942", "--quantize", "mxfp4"], capsys)
    assert code == 2 and "gfx950 only" in err
    code, out, err = run_cli(["convert", srcs["int4"], dst, "--target", "gfx942", "--tp", "2", "--quantize", "fp8",
                              "--workers", "2"], capsys)
    assert code == 0, err
    assert "re-encoded (routed experts): ct-int4-pack -> fp8-block" in out
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    assert not leftovers(dst)
    code, out, err = run_cli(["verify", dst, "--source", srcs["int4"], "--layers", "1"], capsys)
    assert code == 0, out + err
    assert "max err / bound" in out
