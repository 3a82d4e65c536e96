"""AMD Quark MXFP4 sources, end to end: real Quark 0.13 exports of tiny DeepSeek-V3 and Kimi-K2
(tests/quark_fixtures.py), converted for gfx950 at tp 1 and 2 with --mla-bmm fp8 and mxfp4.

The expectations are built here, independently of atom_convert:
- source tensors are read with safetensors and sliced per rank as spec §3.3.1/§3.3.2/§5 say
  (rows for column-parallel, *bytes* for row-parallel o_proj/down_proj, fused_qkv_a = [q_a; kv_a],
  gate_up = [gate_r; up_r], MoE w13 = [gate_r | pad | up_r | pad] with the intermediate padded
  to 256, zero-filled);
- bytes are shuffled with aiter's own `shuffle_weight(x, layout=(16, 16))`, scales with aiter's
  `e8m0_shuffle` (wheel files, tests/oracles.py); aiter leaves the scale padding uninitialised,
  so it is compared on real positions only and the converter's padding must be zero;
- values are Quark's own dequantisation (`Pack_fp4.unpack` x 2^(scale-127) per 32);
- MXFP4 W_K/W_V (spec §4.2, §10.1) are checked bit for bit against a brute-force restatement of
  aiter HEAD's rounding written here (nearest of the 16 e2m1 codes, ties to the even code,
  saturation at 6, sign kept on zero), and that rounding against Quark's quantiser.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

import atom_convert
from atom_convert.check.decode import decode_weight, unpad_moe
from atom_convert.errors import BadInputError, CheckpointError, UnsupportedError
from atom_convert.layout.arch.deepseek import mla_operands
from atom_convert.layout.codecs.mxfp4 import dynamic_mxfp4_quant
from atom_convert.store.reader import open_converted
from atom_convert.check.verify import verify

from cliutil import run_cli

import quark_fixtures as qf

PRESETS = ("tiny-deepseek-v3", "tiny-kimi-k2")
STYLES = qf.STYLES
TPS = (1, 2)
BMMS = ("fp8", "mxfp4")
SOURCES = [(p, s) for p in PRESETS for s in STYLES]
CASES = [(p, s, tp, b) for p, s in SOURCES for tp in TPS for b in BMMS]
MLA_CASES = [(p, s, tp) for p, s in SOURCES for tp in TPS]
ST = "model.safetensors"
FP4X2, E8M0 = "float4_e2m1fn_x2", "float8_e8m0fnu"
MLA = "self_attn.mla_attn.impl"


def cid(c: tuple[Any, ...]) -> str:
    return "-".join(str(x) for x in c)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------------
# What each Quark style quantizes (docs/test-fixtures.md §3) and which layers ATOM fuses (spec §2.4)
# ------------------------------------------------------------------------------------------------


def style_formats(preset: str, style: str) -> dict[str, str]:
    """Format of each group of linears: attention, dense MLP, routed experts, shared expert."""
    if style == "all":
        return {"attn": "mxfp4", "dense": "mxfp4", "experts": "mxfp4", "shared": "mxfp4"}
    if preset == "tiny-kimi-k2":  # kimi_k2 template: only the routed experts
        return {"attn": "bf16", "dense": "bf16", "experts": "mxfp4", "shared": "bf16"}
    return {"attn": "bf16", "dense": "mxfp4", "experts": "mxfp4", "shared": "mxfp4"}  # deepseek_v3 template


# runtime module, source parts, tensor-parallel split
ATTN = (("self_attn.fused_qkv_a_proj", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"), "rep"),
        ("self_attn.q_b_proj", ("self_attn.q_b_proj",), "col"),
        ("self_attn.kv_b_proj", ("self_attn.kv_b_proj",), "col"),
        ("self_attn.o_proj", ("self_attn.o_proj",), "row"))
DENSE = (("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"), "col"),
         ("mlp.down_proj", ("mlp.down_proj",), "row"))
SHARED = (("mlp.shared_experts.gate_up_proj", ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"), "col"),
          ("mlp.shared_experts.down_proj", ("mlp.shared_experts.down_proj",), "row"))


class Src:
    """A Quark export read with safetensors only."""

    def __init__(self, path: Path):
        self.path = path
        self.config: dict[str, Any] = json.loads((path / "config.json").read_text())
        self.t: dict[str, torch.Tensor] = load_file(str(path / ST))
        c = self.config
        self.H, self.Nh = c["hidden_size"], c["num_attention_heads"]
        self.L, self.Q = c["kv_lora_rank"], c["q_lora_rank"]
        self.P, self.R, self.V = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        self.I, self.E, self.S = c["moe_intermediate_size"], c["n_routed_experts"], c["n_shared_experts"]
        self.n_layers, self.first_dense = c["num_hidden_layers"], c["first_k_dense_replace"]

    def is_mx(self, module: str) -> bool:
        return self.t[f"{module}.weight"].dtype == torch.uint8

    def value(self, module: str) -> torch.Tensor:
        """Quark's dequantisation of a whole source weight (or the bf16 weight in fp32)."""
        w = self.t[f"{module}.weight"]
        if w.dtype == torch.uint8:
            return qf.quark_dequantize(w, self.t[f"{module}.weight_scale"])
        return w.float()


_SRC: dict[Path, Src] = {}


def src_of(path: Path) -> Src:
    if path not in _SRC:
        _SRC[path] = Src(path)
    return _SRC[path]


@dataclass
class Lin:
    """Expected per-rank runtime linear or expert stack, before any shuffle."""

    name: str  # runtime weight name
    fmt: str  # "mxfp4" or "bf16"
    w: torch.Tensor  # mxfp4: packed bytes [.., N, K/2] (MoE: padded, zero-filled); bf16: the weight
    s: torch.Tensor | None  # mxfp4: e8m0 bytes [N, K/32] (MoE: the 2-D [E*N_pad, K/32] stack)
    value: torch.Tensor  # Quark's dequantised values of the rank's source slice (MoE: unpadded)
    moe: str | None = None  # "w13" / "w2"


def _rank_slice(t: torch.Tensor, par: str, tp: int, rank: int) -> torch.Tensor:
    if tp == 1 or par == "rep":
        return t
    dim = 0 if par == "col" else 1  # row-parallel: bytes (MXFP4) / columns (bf16) and scale columns
    n = t.shape[dim] // tp
    return t.narrow(dim, rank * n, n)


def expected_linear(src: Src, prefix: str, out: str, parts: tuple[str, ...], par: str, tp: int, rank: int) -> Lin:
    mods = [prefix + p for p in parts]
    fmts = {src.is_mx(m) for m in mods}
    assert len(fmts) == 1, f"{mods}: mixed formats in the source"
    mx = fmts.pop()
    ws = [_rank_slice(src.t[f"{m}.weight"], par, tp, rank) for m in mods]
    if not mx:
        w = torch.cat(ws, 0)
        return Lin(f"{prefix}{out}.weight", "bf16", w, None, w.float())
    ss = [_rank_slice(src.t[f"{m}.weight_scale"], par, tp, rank) for m in mods]
    w, s = torch.cat(ws, 0), torch.cat(ss, 0)
    value = torch.cat([qf.quark_dequantize(a, b) for a, b in zip(ws, ss)], 0)
    return Lin(f"{prefix}{out}.weight", "mxfp4", w, s, value)


def expected_experts(src: Src, prefix: str, fused: bool, tp: int, rank: int) -> list[Lin]:
    """Spec §3.3.2: every rank holds all experts (the shared one as slot E when fused), sliced
    on the intermediate dim, padded to I_pad = ceil(I_loc/256)*256 per half, zero-filled."""
    il = src.I // tp
    ip = cdiv(il, 256) * 256
    H = src.H
    mods = [f"{prefix}mlp.experts.{e}." for e in range(src.E)] + ([f"{prefix}mlp.shared_experts."] if fused else [])
    n = len(mods)
    w13 = torch.zeros(n, 2 * ip, H // 2, dtype=torch.uint8)
    s13 = torch.zeros(n, 2 * ip, H // 32, dtype=torch.uint8)
    w2 = torch.zeros(n, H, ip // 2, dtype=torch.uint8)
    s2 = torch.zeros(n, H, ip // 32, dtype=torch.uint8)
    # the rank's unpadded slices, for the values: [gate_r; up_r] and down_r per expert
    u13 = torch.zeros(n, 2 * il, H // 2, dtype=torch.uint8)
    t13 = torch.zeros(n, 2 * il, H // 32, dtype=torch.uint8)
    for e, m in enumerate(mods):
        for half, part in enumerate(("gate_proj", "up_proj")):
            assert src.is_mx(m + part)
            w = _rank_slice(src.t[f"{m}{part}.weight"], "col", tp, rank)
            s = _rank_slice(src.t[f"{m}{part}.weight_scale"], "col", tp, rank)
            assert w.shape == (il, H // 2) and s.shape == (il, H // 32)
            w13[e, half * ip:half * ip + il] = w
            s13[e, half * ip:half * ip + il] = s
            u13[e, half * il:(half + 1) * il] = w
            t13[e, half * il:(half + 1) * il] = s
        w = _rank_slice(src.t[f"{m}down_proj.weight"], "row", tp, rank)
        s = _rank_slice(src.t[f"{m}down_proj.weight_scale"], "row", tp, rank)
        assert w.shape == (H, il // 2) and s.shape == (H, il // 32)
        w2[e, :, :il // 2] = w
        s2[e, :, :il // 32] = s
    v13 = qf.quark_dequantize(u13, t13)
    v2 = qf.quark_dequantize(w2[..., :il // 2].contiguous(), s2[..., :il // 32].contiguous())
    base = f"{prefix}mlp.experts."
    return [Lin(base + "w13_weight", "mxfp4", w13, s13.reshape(n * 2 * ip, H // 32), v13, "w13"),
            Lin(base + "w2_weight", "mxfp4", w2, s2.reshape(n * H, ip // 32), v2, "w2")]


@dataclass
class Expected:
    linears: list[Lin]  # every runtime linear weight and expert stack
    plain: dict[str, tuple[str, tuple[int, ...]]]  # other tensors: name -> (source name, per-rank shape)
    moe_layers: dict[str, str]


_EXP: dict[tuple[Path, int, int], Expected] = {}


def expected(src_path: Path, preset: str, style: str, tp: int, rank: int) -> Expected:
    key = (src_path, tp, rank)
    if key in _EXP:
        return _EXP[key]
    src = src_of(src_path)
    f = style_formats(preset, style)
    fused = f["shared"] == f["experts"]
    lins: list[Lin] = []
    plain: dict[str, tuple[str, tuple[int, ...]]] = {}
    moe_layers = {}
    V = src.config["vocab_size"]
    plain["model.embed_tokens.weight"] = ("model.embed_tokens.weight", (V // tp, src.H))
    plain["lm_head.weight"] = ("lm_head.weight", (V // tp, src.H))
    plain["model.norm.weight"] = ("model.norm.weight", (src.H,))
    for i in range(src.n_layers):
        p = f"model.layers.{i}."
        for n, length in (("input_layernorm", src.H), ("post_attention_layernorm", src.H),
                          ("self_attn.q_a_layernorm", src.Q), ("self_attn.kv_a_layernorm", src.L)):
            plain[f"{p}{n}.weight"] = (f"{p}{n}.weight", (length,))
        for out, parts, par in ATTN:
            lins.append(expected_linear(src, p, out, parts, par, tp, rank))
            assert lins[-1].fmt == f["attn"], lins[-1].name
        if i < src.first_dense:
            for out, parts, par in DENSE:
                lins.append(expected_linear(src, p, out, parts, par, tp, rank))
                assert lins[-1].fmt == f["dense"], lins[-1].name
            continue
        plain[f"{p}mlp.gate.weight"] = (f"{p}mlp.gate.weight", (src.E, src.H))
        plain[f"{p}mlp.gate.e_score_correction_bias"] = (f"{p}mlp.gate.e_score_correction_bias", (src.E,))
        lins += expected_experts(src, p, fused, tp, rank)
        if fused:
            moe_layers[p.rstrip(".")] = "fused_shared_expert"
        else:
            for out, parts, par in SHARED:
                lins.append(expected_linear(src, p, out, parts, par, tp, rank))
                assert lins[-1].fmt == f["shared"], lins[-1].name
            moe_layers[p.rstrip(".")] = "separate_shared_experts"
    _EXP[key] = e = Expected(lins, plain, moe_layers)
    return e


def mla_names(src: Src) -> list[str]:
    return [f"model.layers.{i}.{MLA}.{a}" for i in range(src.n_layers)
            for a in ("W_K", "W_K_scale", "W_V", "W_V_scale")]


# ------------------------------------------------------------------------------------------------
# aiter's layouts as permutations (so that they can be undone with aiter's own functions)
# ------------------------------------------------------------------------------------------------


_PERM: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}


def aiter_perm(kind: str, fn: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """P with fn(x).flatten()[j] == x.flatten()[P[j]] for a byte permutation `fn` of uint8 [shape],
    found by running `fn` on the bytes of each element's flat index."""
    key = (kind, tuple(shape))
    if key not in _PERM:
        n = math.prod(shape)
        assert n < 1 << 24
        idx = torch.arange(n)
        perm = torch.zeros(n, dtype=torch.long)
        for d in range(3):
            digit = ((idx >> (8 * d)) & 0xFF).to(torch.uint8).reshape(shape)
            perm |= fn(digit).reshape(-1).long() << (8 * d)
        assert torch.equal(perm.sort().values, idx)
        _PERM[key] = perm
    return _PERM[key]


def unshuffle_weight(got: torch.Tensor, shf: Any) -> torch.Tensor:
    perm = aiter_perm("w", lambda t: shf.shuffle_weight(t, layout=(16, 16)), tuple(got.shape))
    out = torch.empty(got.numel(), dtype=got.dtype)
    out[perm] = got.reshape(-1)
    return out.reshape(got.shape)


def scale_layout(fp4: Any, m: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm, real) for aiter's e8m0_shuffle of an [m, n] scale: perm over the padded shape
    (computed on a padded input, so aiter allocates no uninitialised memory), real = the
    shuffled positions that hold a real (not padding) element."""
    sm, sn = cdiv(m, 256) * 256, cdiv(n, 8) * 8
    perm = aiter_perm("s", fp4.e8m0_shuffle, (sm, sn))
    real = ((perm // sn) < m) & ((perm % sn) < n)
    return perm, real.reshape(sm, sn)


def check_scale_bytes(name: str, got: torch.Tensor, exp: torch.Tensor, fp4: Any) -> None:
    m, n = exp.shape
    sm, sn = cdiv(m, 256) * 256, cdiv(n, 8) * 8
    assert tuple(got.shape) == (sm, sn), name
    ref = fp4.e8m0_shuffle(exp.clone())  # aiter: the padding is torch.empty
    assert tuple(ref.shape) == (sm, sn)
    _, real = scale_layout(fp4, m, n)
    assert int(real.sum()) == m * n
    bad = int((got[real] != ref[real]).sum())
    assert bad == 0, f"{name}: {bad} scale bytes differ from aiter"
    assert not got[~real].any(), f"{name}: the e8m0 padding is not zero"


def unshuffle_scale(got: torch.Tensor, m: int, n: int, fp4: Any) -> torch.Tensor:
    perm, _ = scale_layout(fp4, m, n)
    out = torch.empty(got.numel(), dtype=got.dtype)
    out[perm] = got.reshape(-1)
    return out.reshape(got.shape)[:m, :n]


# ------------------------------------------------------------------------------------------------
# Brute-force restatement of aiter HEAD's dynamic_mxfp4_quant (spec §3.0.6, §10.1)
# ------------------------------------------------------------------------------------------------

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
CODE_VALUE = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float64)  # code -> value
CODES = torch.arange(16)


def brute_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 32 along the last dim: the block amax, rounded up to the next power of two when its
    significand is >= 1.75 (what +0x200000 on the fp32 bits does), e = floor(log2) - 2 (an all-zero
    block: -127; 127 where the rounded amax overflows fp32), clamped to [-127, 127]; each x / 2^e
    goes to the nearest of the 16 e2m1 codes whose sign bit is x's sign bit (so zero keeps its
    sign: -0 is code 8), ties to the even code, which also saturates at 6.
    Returns (packed uint8 [..., K/2], low nibble first; e8m0 uint8 [..., K/32])."""
    *lead, k = x.shape
    xb = x.double().reshape(*lead, k // 32, 32)
    amax = xb.abs().amax(-1)
    mant, ex = torch.frexp(amax)  # amax = mant * 2^ex, mant in [0.5, 1)
    log2_up = ex.double() - 1 + (mant >= 0.875).double()  # floor(log2) of the rounded-up amax
    e = log2_up - 2
    # the kernel rounds in fp32: a rounded-up amax of 2^128 is inf there, log2 inf, e clamped to 127
    e = torch.where(log2_up >= 128, torch.full_like(e, 127.0), e)
    e = torch.where(amax == 0, torch.full_like(e, -127.0), e).clamp(-127, 127)
    q = xb / torch.exp2(e)[..., None]
    d = (q[..., None] - CODE_VALUE).abs()
    d = torch.where((CODES >= 8) != torch.signbit(xb)[..., None], torch.full_like(d, math.inf), d)
    nearest = d == d.amin(-1, keepdim=True)
    even = nearest & (CODES % 2 == 0)
    code = torch.where(even.any(-1), even.to(torch.uint8).argmax(-1), nearest.to(torch.uint8).argmax(-1))
    code = code.reshape(*lead, k).to(torch.uint8)
    return code[..., 0::2] | (code[..., 1::2] << 4), (e + 127).to(torch.uint8)


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0x0F, packed >> 4], -1).flatten(-2)


TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def with_ties(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bf16 at mixed magnitudes; in about half of the 32-blocks along the last dim the
    block scale is pinned (amax 6 * 2^e, or 6.5 * 2^e which saturates, or 7 * 2^e which rounds
    the scale up) and the block holds exact ties +-t * 2^e' for every e2m1 midpoint t, tiny
    values (+-0.1 2^e', -0.0) that round to (signed) zero, and random fill."""
    *lead, k = shape
    mag = torch.exp2(torch.randint(-10, 5, (*lead, k // 32, 1), generator=gen).float())
    x = torch.randn(*lead, k // 32, 32, generator=gen) * mag
    flat = x.reshape(-1, 32)
    for b in range(0, flat.shape[0], 2):
        e = int(torch.randint(-12, 4, (1,), generator=gen))
        top = (6.0, 6.5, 7.0)[int(torch.randint(0, 3, (1,), generator=gen))]
        es = e + (1 if top == 7.0 else 0)  # the block's e8m0 exponent
        sign = 1.0 if torch.rand(1, generator=gen) < 0.5 else -1.0
        ties = [t for t in TIES if t * 2**es <= top * 2**e]
        vals = [sign * top * 2**e] + [s * t * 2**es for t in ties for s in (1, -1)]
        vals += [-0.1 * 2**es, 0.1 * 2**es, -0.2 * 2**es, -0.0, 0.0]
        fill = (torch.rand(32 - len(vals), generator=gen) * 2 - 1) * 2**e * top
        row = torch.cat([torch.tensor(vals), fill])
        flat[b] = row[torch.randperm(32, generator=gen)]
    return x.reshape(shape).to(torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# Fixtures
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mx_converted(tmp_path_factory: pytest.TempPathFactory,
                 quark_checkpoint: Callable[..., Path]) -> Callable[..., tuple[Path, Path]]:
    """mx_converted(preset, style, tp, bmm) -> (source, converted dir), once per module."""
    root = tmp_path_factory.mktemp("mxfp4-out")
    cache: dict[tuple[str, str, int, str], tuple[Path, Path]] = {}

    def get(preset: str, style: str, tp: int, bmm: str) -> tuple[Path, Path]:
        key = (preset, style, tp, bmm)
        if key not in cache:
            src = quark_checkpoint(preset, style)
            dst = root / cid(key)
            atom_convert.convert(src, dst, "gfx950", tp=tp, mla_bmm=bmm)
            cache[key] = (src, dst)
        return cache[key]

    return get


# ------------------------------------------------------------------------------------------------
# The Quark exports themselves, and how atom-convert reads their config
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset,style", SOURCES, ids=[cid(c) for c in SOURCES])
def test_quark_export_shape(quark_checkpoint: Callable[..., Path], preset: str, style: str) -> None:
    """The fixture is what docs/test-fixtures.md §3 describes: uint8 packed weights [N, K/2] with
    uint8 e8m0 scales [N, K/32] exactly for the modules the style quantizes, bf16 elsewhere."""
    path = quark_checkpoint(preset, style)
    src = src_of(path)
    cfg = src.config
    assert cfg["model_type"] == ("kimi_k2" if preset == "tiny-kimi-k2" else "deepseek_v3")
    assert cfg["hidden_size"] == 256 and cfg["num_nextn_predict_layers"] == 0
    q = cfg["quantization_config"]
    assert q["quant_method"] == "quark" and q["export"]["weight_format"] == "real_quantized"
    w = q["global_quant_config"]["weight"]
    got = (w["dtype"], w["qscheme"], w["group_size"], w["scale_format"], w["is_dynamic"])
    assert got == ("fp4", "per_group", 32, "e8m0", False)
    assert "lm_head" in q["exclude"]
    f = style_formats(preset, style)
    n_mx = 0
    for name, t in src.t.items():
        if name.endswith(".weight_scale"):
            assert name.removesuffix("_scale") in src.t, name
            continue
        if not name.endswith(".weight") or name.removesuffix(".weight") + ".weight_scale" not in src.t:
            assert t.dtype != torch.uint8, name
            continue
        n_mx += 1
        s = src.t[name.removesuffix(".weight") + ".weight_scale"]
        assert t.dtype == s.dtype == torch.uint8 and s.shape[1] * 16 == t.shape[1] and s.shape[0] == t.shape[0], name
    expected_mx = 0
    for i in range(src.n_layers):
        p = f"model.layers.{i}."
        attn = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
        groups = [("attn", [p + "self_attn." + m for m in attn])]
        if i < src.first_dense:
            groups.append(("dense", [p + "mlp." + m for m in ("gate_proj", "up_proj", "down_proj")]))
        else:
            groups.append(("experts", [f"{p}mlp.experts.{e}.{m}" for e in range(src.E)
                                       for m in ("gate_proj", "up_proj", "down_proj")]))
            groups.append(("shared", [p + "mlp.shared_experts." + m for m in ("gate_proj", "up_proj", "down_proj")]))
        for g, mods in groups:
            for m in mods:
                assert src.is_mx(m) == (f[g] == "mxfp4"), m
                expected_mx += f[g] == "mxfp4"
    assert n_mx == expected_mx > 0


@pytest.mark.parametrize("preset,style", SOURCES, ids=[cid(c) for c in SOURCES])
def test_inspect_layer_formats(quark_checkpoint: Callable[..., Path], capsys: pytest.CaptureFixture[str],
                               preset: str, style: str) -> None:
    src = quark_checkpoint(preset, style)
    code, out, err = run_cli(["inspect", src, "--json"], capsys)
    assert code == 0, err
    info = json.loads(out)
    assert info["quant_format"] == "quark-mxfp4"
    assert info["model_type"] == ("kimi_k2" if preset == "tiny-kimi-k2" else "deepseek_v3")
    f = style_formats(preset, style)
    want = {"model.layers.0": f"self_attn: {f['attn']}; mlp: {f['dense']}"}
    for i in (1, 2):
        want[f"model.layers.{i}"] = (f"self_attn: {f['attn']}; mlp.experts: {f['experts']}; "
                                     f"mlp.shared_experts: {f['shared']}")
    assert info["layer formats"] == want


@pytest.mark.parametrize("preset,style", SOURCES, ids=[cid(c) for c in SOURCES])
def test_dry_run_lists_mxfp4_runtime_dtypes(quark_checkpoint: Callable[..., Path], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str], preset: str, style: str) -> None:
    """`convert --dry-run --json` plans every tensor with the dtype the runtime views it as
    (spec §10): MXFP4 weights float4_e2m1fn_x2, linear scales float8_e8m0fnu (padded shape),
    MoE scales uint8 (2-D), MXFP4 W_K/W_V packed with uint8 scales; and writes nothing."""
    src_path = quark_checkpoint(preset, style)
    tp = 2
    dst = tmp_path / "dst"
    code, out, err = run_cli(["convert", src_path, dst, "--dry-run", "--json", "--tp", tp, "--mla-bmm", "mxfp4"],
                             capsys)
    assert code == 0, err
    assert not dst.exists() and list(tmp_path.iterdir()) == []
    plan = json.loads(out)
    assert plan["source_format"] == "quark-mxfp4" and plan["tp"] == tp
    (main_set,) = plan["sets"]
    src = src_of(src_path)
    for rank in range(tp):
        rows = {r["name"]: (r["dtype"], r["shape"]) for r in main_set["tensors"] if r["rank"] == rank}
        exp = expected(src_path, preset, style, tp, rank)
        want: dict[str, tuple[str, list[int]]] = {}
        for lin in exp.linears:
            if lin.fmt == "bf16":
                want[lin.name] = ("bfloat16", list(lin.w.shape))
            elif lin.moe:
                want[lin.name] = (FP4X2, list(lin.w.shape))
                want[lin.name + "_scale"] = ("uint8", list(lin.s.shape))
            else:
                m, n = lin.s.shape
                want[lin.name] = (FP4X2, list(lin.w.shape))
                want[lin.name.removesuffix(".weight") + ".weight_scale"] = (E8M0, [cdiv(m, 256) * 256, cdiv(n, 8) * 8])
        for name, (_, shape) in exp.plain.items():
            want[name] = ("bfloat16", list(shape))
        nr = src.Nh // tp
        for i in range(src.n_layers):
            a = f"model.layers.{i}.{MLA}."
            # ATOM holds the MLA operands' packed e2m1 as uint8 (atom/model_ops/utils.py 191-194)
            want[a + "W_K"] = ("uint8", [nr, src.L, src.P // 2])
            want[a + "W_K_scale"] = ("uint8", [nr, src.L, src.P // 32])
            want[a + "W_V"] = ("uint8", [nr, src.V, src.L // 2])
            want[a + "W_V_scale"] = ("uint8", [nr, src.V, src.L // 32])
        assert rows == want
        n_fp4 = sum(1 for d, _ in rows.values() if d == FP4X2)
        assert n_fp4 > 0


# ------------------------------------------------------------------------------------------------
# Converted MXFP4 tensors: bytes, scales, values
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset,style,tp,bmm", CASES, ids=[cid(c) for c in CASES])
def test_mxfp4_bytes_equal_aiter_shuffle(mx_converted: Callable[..., tuple[Path, Path]], aiter: Any,
                                         preset: str, style: str, tp: int, bmm: str) -> None:
    """Every MXFP4 linear and expert stack: weight bytes == aiter shuffle_weight(expected slice,
    (16,16)); scale == aiter e8m0_shuffle(expected scale) on real positions, zero padding;
    manifest says shuffled, fp4x2 / e8m0 (linear) / uint8 (MoE), and the padding."""
    fp4, shf = aiter
    src_path, dst = mx_converted(preset, style, tp, bmm)
    n_checked = 0
    for rank in range(tp):
        exp = expected(src_path, preset, style, tp, rank)
        with open_converted(dst, rank) as ck:
            for lin in exp.linears:
                if lin.fmt != "mxfp4":
                    continue
                got = ck.get(lin.name)
                e = ck.entry(lin.name)
                assert got.dtype == torch.uint8 and e["is_shuffled"] and e["runtime_dtype"] == FP4X2, lin.name
                assert tuple(got.shape) == tuple(lin.w.shape), lin.name
                ref = shf.shuffle_weight(lin.w.clone(), layout=(16, 16))
                bad = int((got != ref).sum())
                assert bad == 0, f"{lin.name} rank {rank}: {bad} bytes differ from aiter"
                sname = lin.name + "_scale" if lin.moe else lin.name.removesuffix(".weight") + ".weight_scale"
                gs = ck.get(sname)
                se = ck.entry(sname)
                assert gs.dtype == torch.uint8 and not se["is_shuffled"], sname
                assert se["layout"]["e8m0_shuffled"] is True
                if lin.moe:
                    il = src_of(src_path).I // tp
                    assert se["runtime_dtype"] == "uint8"
                    assert e["layout"]["intermediate"] == se["layout"]["intermediate"] == il
                    assert e["layout"]["intermediate_padded"] == cdiv(il, 256) * 256
                    assert tuple(gs.shape) == tuple(lin.s.shape)  # E*N and K/32 are aligned: no padding
                else:
                    assert se["runtime_dtype"] == E8M0
                    assert se["layout"]["unpadded_shape"] == list(lin.s.shape)
                check_scale_bytes(f"{sname} rank {rank}", gs, lin.s, fp4)
                n_checked += 1
    f = style_formats(preset, style)
    # 4 attention linears in each of 3 layers, 2 in the dense MLP, w13/w2 in each of 2 MoE layers
    per_rank = 3 * 4 * (f["attn"] == "mxfp4") + 2 * (f["dense"] == "mxfp4") + 2 * 2
    assert n_checked == tp * per_rank


@pytest.mark.parametrize("preset,style,tp,bmm", CASES, ids=[cid(c) for c in CASES])
def test_mxfp4_values_equal_quark_dequant(mx_converted: Callable[..., tuple[Path, Path]], aiter: Any,
                                          preset: str, style: str, tp: int, bmm: str) -> None:
    """Every converted MXFP4 tensor decodes to Quark's own dequantisation of its source slice
    (`expected` computes it with Quark's unpacker), through atom_convert.check.decode.decode_weight
    (+ unpad_moe), which verify uses; the MoE padding decodes to exact zeros. Independently, the
    shuffles undone with permutations derived from aiter's own functions give back the source
    slice's bytes and scales (so Quark's dequantisation of them is the expected value too)."""
    fp4, shf = aiter
    src_path, dst = mx_converted(preset, style, tp, bmm)
    il = src_of(src_path).I // tp
    ip = cdiv(il, 256) * 256
    for rank in range(tp):
        exp = expected(src_path, preset, style, tp, rank)
        with open_converted(dst, rank) as ck:
            for lin in exp.linears:
                if lin.fmt != "mxfp4":
                    continue
                dec = decode_weight(ck, lin.name)
                if lin.moe == "w13":
                    assert not dec[:, il:ip].any() and not dec[:, ip + il:].any(), lin.name
                elif lin.moe == "w2":
                    assert not dec[..., il:].any(), lin.name
                if lin.moe:
                    dec = unpad_moe(dec, ck.entry(lin.name), lin.moe)
                assert torch.equal(dec, lin.value), f"{lin.name} rank {rank}: decode_weight != Quark dequant"
                sname = lin.name + "_scale" if lin.moe else lin.name.removesuffix(".weight") + ".weight_scale"
                m, n = lin.s.shape
                assert torch.equal(unshuffle_weight(ck.get(lin.name), shf), lin.w), lin.name
                assert torch.equal(unshuffle_scale(ck.get(sname), m, n, fp4), lin.s), sname


@pytest.mark.parametrize("preset,style,tp,bmm", CASES, ids=[cid(c) for c in CASES])
def test_bf16_layers_and_tensor_set(mx_converted: Callable[..., tuple[Path, Path]], preset: str, style: str,
                                    tp: int, bmm: str) -> None:
    """Layers the Quark config leaves unquantized stay bf16, unshuffled, without scales, with the
    source's exact values (template: attention; Kimi template: dense MLP and the shared expert,
    kept unfused as mlp.shared_experts.gate_up_proj/down_proj); the deepseek_v3 template and the
    "all" style fuse the MXFP4 shared expert as slot E. The converted tensor set is exactly the
    expected one."""
    src_path, dst = mx_converted(preset, style, tp, bmm)
    src = src_of(src_path)
    f = style_formats(preset, style)
    manifest = json.loads((dst / "atom_manifest.json").read_text())
    assert manifest["source"]["quant_format"] == "quark-mxfp4"
    assert manifest["layout"]["flags"]["ATOM_USE_TRITON_MXFP4_BMM"] == int(bmm == "mxfp4")
    fused = f["shared"] == f["experts"]
    n_slots = src.E + (1 if fused else 0)
    for rank in range(tp):
        exp = expected(src_path, preset, style, tp, rank)
        assert manifest["model"]["moe_layers"] == exp.moe_layers
        assert set(exp.moe_layers.values()) == {"fused_shared_expert" if fused else "separate_shared_experts"}
        want = set(exp.plain) | set(mla_names(src))
        with open_converted(dst, rank) as ck:
            for lin in exp.linears:
                want.add(lin.name)
                if lin.fmt == "mxfp4":
                    want.add(lin.name + "_scale" if lin.moe else lin.name.removesuffix(".weight") + ".weight_scale")
                    if lin.moe:
                        assert ck.get(lin.name).shape[0] == n_slots
                    continue
                got = ck.get(lin.name)
                e = ck.entry(lin.name)
                assert got.dtype == torch.bfloat16 and not e["is_shuffled"] and "runtime_dtype" not in e, lin.name
                assert torch.equal(got, lin.w), f"{lin.name} rank {rank}: bf16 bytes differ from the source slice"
                assert lin.name.removesuffix(".weight") + ".weight_scale" not in ck
            for name, (sname, shape) in exp.plain.items():
                got = ck.get(name)
                assert got.dtype == torch.bfloat16 and tuple(got.shape) == shape, name
                t = src.t[sname]
                if shape != tuple(t.shape):
                    t = t.narrow(0, rank * shape[0], shape[0])
                assert torch.equal(got, t.to(torch.bfloat16)), name
            assert set(ck.keys()) == want
        if f["shared"] == "bf16":
            sh = [lin for lin in exp.linears if ".shared_experts." in lin.name]
            assert sorted({lin.name.split(".mlp.")[1] for lin in sh}) == ["shared_experts.down_proj.weight",
                                                                           "shared_experts.gate_up_proj.weight"]
            assert all(tuple(lin.w.shape) in ((2 * src.I // tp, src.H), (src.H, src.I // tp)) for lin in sh)
        else:
            assert not any(".shared_experts." in n for n in manifest["tensors"])


# ------------------------------------------------------------------------------------------------
# MXFP4 MLA operands (--mla-bmm mxfp4, spec §4.2, §10.1)
# ------------------------------------------------------------------------------------------------


def test_brute_force_rounding_on_explicit_ties() -> None:
    """The restatement and the package both give the codes written out by hand: every e2m1
    midpoint goes to the even code, 6.5 saturates to 6, small negatives and -0 are code 8."""
    vals = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0,
            -0.1, -0.0, 0.0, 0.1, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -6.0, 5.5, -5.5, 2.25, -2.75, 0.2, -0.2]
    codes = [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14,
             8, 8, 0, 0, 1, 2, 3, 4, 5, 6, 15, 7, 15, 4, 13, 0, 8]
    sat = [6.5, -6.5, 6.25, 0.25, -0.25, 5.0, -5.0, 3.0] + [0.0] * 24  # amax 6.5: e = 0, q = 6.5 -> 6
    sat_codes = [7, 15, 7, 0, 8, 6, 14, 5] + [0] * 24
    x = torch.tensor([vals, sat]) * torch.tensor([[2.0**-3], [2.0**5]])
    x = torch.cat([x, torch.zeros(1, 32), -torch.zeros(1, 32)]).to(torch.bfloat16)
    want = torch.tensor([codes, sat_codes, [0] * 32, [8] * 32], dtype=torch.uint8)
    want_scale = torch.tensor([[127 - 3], [127 + 5], [0], [0]], dtype=torch.uint8)
    for fn in (brute_mxfp4, dynamic_mxfp4_quant):
        p, s = fn(x)
        assert torch.equal(nibbles(p), want), fn.__name__
        assert torch.equal(s, want_scale), fn.__name__
    # the amax is rounded up to the next power of two when its significand is >= 1.75
    # (and the fp32 edges: a subnormal amax gives -127; an amax >= 1.75 * 2^127 overflows to inf: 127)
    for amax, e in ((7.0, 1), (6.9, 0), (1.75, -1), (1.74, -2), (3.5, 0), (3.49, -1), (1e-39, -127),
                    (2.0**-126, -127), (2e38, 125), (3.3e38, 127)):
        xs = torch.zeros(1, 32)
        xs[0, 3] = amax
        for fn in (brute_mxfp4, dynamic_mxfp4_quant):
            assert int(fn(xs)[1]) == 127 + e, (fn.__name__, amax)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dynamic_mxfp4_quant_random_with_ties(seed: int) -> None:
    """atom_convert's dynamic_mxfp4_quant and mla_operands(bmm="mxfp4") equal the brute force bit
    for bit on random bf16 data with injected exact ties, saturation and signed zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = with_ties((64, 256), gen)
    p, s = dynamic_mxfp4_quant(x)
    bp, bs = brute_mxfp4(x)
    assert torch.equal(s, bs) and torch.equal(p, bp), f"{int((p != bp).sum())} bytes differ"
    c = nibbles(p)
    assert int((c == 8).sum()) > 0 and int((c == 15).sum()) > 0  # -0 and -6 (incl. saturated -6.5) occur
    # the MLA operands: W_K along P (transposed), W_V along L, from a kv_b [Nr(P+V), L]
    nr, P, V, L = 3, 64, 96, 128
    wk = with_ties((nr, L, P), gen)
    wv = with_ties((nr, V, L), gen)
    x3 = torch.empty(nr, P + V, L, dtype=torch.bfloat16)
    x3[:, :P, :] = wk.transpose(1, 2)
    x3[:, P:, :] = wv
    ops = mla_operands(x3.reshape(nr * (P + V), L), nr, P, V, L, torch.float8_e4m3fn, bmm="mxfp4")
    for attr, t in (("W_K", wk), ("W_V", wv)):
        bp, bs = brute_mxfp4(t)
        assert ops[attr].dtype == ops[f"{attr}_scale"].dtype == torch.uint8
        assert ops[attr].is_contiguous() and ops[f"{attr}_scale"].is_contiguous()
        assert torch.equal(ops[attr], bp), attr
        assert torch.equal(ops[f"{attr}_scale"], bs), attr


@pytest.mark.parametrize("seed", [0, 1])
def test_quark_quantizer_differs_only_in_signed_zero(seed: int) -> None:
    """Quark's OCP MXFP4 quantizer gives the same scale bytes and the same decoded values as
    aiter HEAD's rounding; the packed codes differ only where aiter keeps -0 (code 8) and Quark
    writes +0 (code 0), and on random data that happens (spec §10.1)."""
    gen = torch.Generator().manual_seed(100 + seed)
    for x in (with_ties((128, 256), gen), (torch.randn(128, 256, generator=gen) * 0.05).to(torch.bfloat16)):
        p, s = brute_mxfp4(x)
        assert torch.equal(p, dynamic_mxfp4_quant(x)[0])
        qp, qs, qdq = qf.quark_mxfp4_quantize(x)
        assert torch.equal(qs, s)
        vals = qf.quark_dequantize(p, s)
        assert torch.equal(vals, qf.quark_dequantize(qp, qs))
        assert torch.equal(vals, qdq.float())
        a, b = nibbles(p), nibbles(qp)
        diff = a != b
        assert bool(((a[diff] == 8) & (b[diff] == 0)).all())
        assert int(diff.sum()) > 0
        assert int(((a == 8) & (b == 0)).sum()) == int(diff.sum())


@pytest.mark.parametrize("preset,style,tp", MLA_CASES, ids=[cid(c) for c in MLA_CASES])
def test_mla_mxfp4_operands_bit_exact(mx_converted: Callable[..., tuple[Path, Path]], preset: str, style: str,
                                      tp: int) -> None:
    """W_K [Nr, L, P/2] / W_V [Nr, V, L/2] uint8 with plain row-major e8m0 scales [Nr, L, P/32] /
    [Nr, V, L/32] (not shuffled), equal to the brute force applied to W_K/W_V taken (with explicit
    index maps) from the rank's heads of the dequantised kv_b (bf16 as the runtime computes it)."""
    src_path, dst = mx_converted(preset, style, tp, "mxfp4")
    src = src_of(src_path)
    nr, P, V, L = src.Nh // tp, src.P, src.V, src.L
    for i in range(src.n_layers):
        kv = f"model.layers.{i}.self_attn.kv_b_proj"
        assert src.is_mx(kv) == (style_formats(preset, style)["attn"] == "mxfp4")
        kvb = src.value(kv).to(torch.bfloat16)  # MXFP4 values are exact in bf16
        assert torch.equal(kvb.float(), src.value(kv))
        for rank in range(tp):
            heads = torch.arange(rank * nr, (rank + 1) * nr)[:, None]
            k_rows = heads * (P + V) + torch.arange(P)[None, :]  # [Nr, P]
            v_rows = heads * (P + V) + P + torch.arange(V)[None, :]  # [Nr, V]
            wk = kvb[k_rows].transpose(1, 2)  # W_K[n, l, p] = kv_b[n(P+V)+p, l]
            wv = kvb[v_rows]  # W_V[n, v, l] = kv_b[n(P+V)+P+v, l]
            with open_converted(dst, rank) as ck:
                for attr, t, shape in (("W_K", wk, (nr, L, P)), ("W_V", wv, (nr, V, L))):
                    name = f"model.layers.{i}.{MLA}.{attr}"
                    bp, bs = brute_mxfp4(t.contiguous())
                    got, gs = ck.get(name), ck.get(name + "_scale")
                    assert tuple(got.shape) == (*shape[:2], shape[2] // 2) and got.dtype == torch.uint8
                    assert tuple(gs.shape) == (*shape[:2], shape[2] // 32) and gs.dtype == torch.uint8
                    e, se = ck.entry(name), ck.entry(name + "_scale")
                    assert not e["is_shuffled"] and not se["is_shuffled"]
                    assert "e8m0_shuffled" not in se.get("layout", {})
                    assert e["runtime_dtype"] == "uint8"  # as ATOM holds them (utils.py 191-194)
                    assert "half to even" in e["layout"]["rounding"] and "-0" in e["layout"]["rounding"]
                    assert torch.equal(gs, bs), f"{name} rank {rank}: scale"
                    assert torch.equal(got, bp), f"{name} rank {rank}: {int((got != bp).sum())} bytes differ"
                    # Quark's quantizer: same scales and values, +0 where aiter keeps -0
                    qp, qs, _ = qf.quark_mxfp4_quantize(t.reshape(-1, shape[2]))
                    assert torch.equal(qs, gs.reshape(qs.shape))
                    flat = got.reshape(qp.shape)
                    assert torch.equal(qf.quark_dequantize(qp, qs), qf.quark_dequantize(flat, qs))
                    a, b = nibbles(flat), nibbles(qp)
                    assert bool(((a[a != b] == 8) & (b[a != b] == 0)).all()), name


# ------------------------------------------------------------------------------------------------
# verify, refusals
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset,style,tp,bmm", CASES, ids=[cid(c) for c in CASES])
def test_verify_passes(mx_converted: Callable[..., tuple[Path, Path]], preset: str, style: str, tp: int,
                       bmm: str) -> None:
    src_path, dst = mx_converted(preset, style, tp, bmm)
    r = verify(dst, src_path, tokens=8)
    assert r.ok, r.failures
    assert r.check.values_checked > 0 and r.rows
    assert any(row["kind"] == ("attn_mxfp4" if bmm == "mxfp4" else "attn") for row in r.rows)


def _assert_nothing_left(dst: Path) -> None:
    assert not dst.exists()
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")]


@pytest.mark.parametrize("preset", PRESETS)
def test_gfx942_refused(quark_checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                        preset: str) -> None:
    src = quark_checkpoint(preset, "template")
    dst = tmp_path / "dst"
    with pytest.raises(UnsupportedError, match="gfx942"):
        atom_convert.convert(src, dst, "gfx942")
    _assert_nothing_left(dst)
    code, out, err = run_cli(["convert", src, dst, "--target", "gfx942"], capsys)
    assert code == 2
    assert "MXFP4" in err and "gfx950" in err and "gfx942" in err
    _assert_nothing_left(dst)


def test_mla_bmm_mxfp4_on_gfx942_refused(quark_checkpoint: Callable[..., Path], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    src = quark_checkpoint("tiny-deepseek-v3", "all")
    dst = tmp_path / "dst"
    with pytest.raises(UnsupportedError, match="--mla-bmm mxfp4"):
        atom_convert.convert(src, dst, "gfx942", mla_bmm="mxfp4")
    _assert_nothing_left(dst)
    code, out, err = run_cli(["convert", src, dst, "--target", "gfx942", "--mla-bmm", "mxfp4"], capsys)
    assert code == 2 and "--mla-bmm mxfp4" in err and "gfx942" in err
    _assert_nothing_left(dst)


# ------------------------------------------------------------------------------------------------
# Bad input: exit 2, a message naming file/tensor with expected and actual values, no DST
# ------------------------------------------------------------------------------------------------


def private_copy(quark_checkpoint: Callable[..., Path], tmp_path: Path, preset: str, style: str) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(quark_checkpoint(preset, style), dst)
    return dst


def edit_tensors(src: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    t = {k: v.clone() for k, v in load_file(str(src / ST)).items()}
    edit(t)
    save_file(t, str(src / ST), metadata={"format": "pt"})


def edit_config(src: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    c = json.loads((src / "config.json").read_text())
    edit(c)
    (src / "config.json").write_text(json.dumps(c, indent=2))


def refused(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], exc: type[BadInputError],
            *needles: str) -> str:
    dst = tmp_path / "dst"
    with pytest.raises(exc) as ei:
        atom_convert.convert(src, dst, "gfx950", tp=2)
    _assert_nothing_left(dst)
    code, out, err = run_cli(["convert", src, dst, "--tp", "2"], capsys)
    assert code == 2, err
    _assert_nothing_left(dst)
    for n in needles:
        assert n in str(ei.value), f"{n!r} not in: {ei.value}"
        assert n in err, f"{n!r} not in: {err}"
    return err


def test_bad_packed_width(quark_checkpoint: Callable[..., Path], tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    """A packed weight stored with K columns (unpacked codes) instead of K/2 bytes."""
    src = private_copy(quark_checkpoint, tmp_path, "tiny-deepseek-v3", "all")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"

    def edit(t: dict[str, torch.Tensor]) -> None:
        assert list(t[name].shape) == [256, 128]
        t[name] = torch.zeros(256, 256, dtype=torch.uint8)

    edit_tensors(src, edit)
    refused(src, tmp_path, capsys, CheckpointError, ST, name, "[256, 256]", "[256, 128]")


def test_bad_scale_width(quark_checkpoint: Callable[..., Path], tmp_path: Path,
                         capsys: pytest.CaptureFixture[str]) -> None:
    """An e8m0 scale with 16 columns where K/32 = 8 (a group of 16)."""
    src = private_copy(quark_checkpoint, tmp_path, "tiny-kimi-k2", "all")
    name = "model.layers.0.self_attn.o_proj.weight_scale"

    def edit(t: dict[str, torch.Tensor]) -> None:
        assert list(t[name].shape) == [256, 8]
        t[name] = torch.full((256, 16), 127, dtype=torch.uint8)

    edit_tensors(src, edit)
    refused(src, tmp_path, capsys, CheckpointError, ST, name, "[256, 16]", "[256, 8]")


def test_excluded_layer_stored_quantized(quark_checkpoint: Callable[..., Path], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The template excludes attention, but q_b_proj is stored as MXFP4 (uint8 + scale)."""
    src = private_copy(quark_checkpoint, tmp_path, "tiny-deepseek-v3", "template")
    module = "model.layers.1.self_attn.q_b_proj"
    assert module in json.loads((src / "config.json").read_text())["quantization_config"]["exclude"]

    def edit(t: dict[str, torch.Tensor]) -> None:
        w = t[f"{module}.weight"]
        assert w.dtype == torch.bfloat16
        p, s, _ = qf.quark_mxfp4_quantize(w)
        t[f"{module}.weight"], t[f"{module}.weight_scale"] = p, s

    edit_tensors(src, edit)
    refused(src, tmp_path, capsys, CheckpointError, ST, f"{module}.weight", "torch.uint8", "expected bfloat16",
            "[512, 64]", "[512, 128]")


@pytest.mark.parametrize("key,value,shown", [("dtype", "int4", "weight dtype 'int4'"),
                                             ("group_size", 16, "group_size 16")])
def test_unsupported_quark_spec(quark_checkpoint: Callable[..., Path], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str], key: str, value: Any, shown: str) -> None:
    src = private_copy(quark_checkpoint, tmp_path, "tiny-kimi-k2", "all")
    edit_config(src, lambda c: c["quantization_config"]["global_quant_config"]["weight"].__setitem__(key, value))
    err = refused(src, tmp_path, capsys, UnsupportedError, "config.json", "global_quant_config", shown)
    assert "fp4" in err and "group_size 32" in err  # what is supported
    assert "model.layers.0." in err  # the first module that resolves to it


def test_q_a_mxfp4_but_kv_b_excluded(quark_checkpoint: Callable[..., Path], tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """ATOM builds q_b/kv_b as MXFP4 when fused_qkv_a_proj is static Quark MXFP4 (spec §2.2): a
    kv_b_proj kept in bf16 (excluded) cannot be loaded."""
    src = private_copy(quark_checkpoint, tmp_path, "tiny-deepseek-v3", "all")
    module = "model.layers.1.self_attn.kv_b_proj"

    def edit(t: dict[str, torch.Tensor]) -> None:
        value = qf.quark_dequantize(t[f"{module}.weight"], t.pop(f"{module}.weight_scale"))
        t[f"{module}.weight"] = value.to(torch.bfloat16)

    edit_tensors(src, edit)
    edit_config(src, lambda c: c["quantization_config"]["exclude"].append(module))
    refused(src, tmp_path, capsys, UnsupportedError, "model.layers.1.self_attn", "q_a_proj is MXFP4",
            "kv_b_proj is bf16")
