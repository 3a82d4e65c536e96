"""Every converted tensor, byte for byte, against expectations built here from the source files.

For each preset x {bf16, fp8} x {gfx950, gfx942} x tp {1, 2} the expected per-rank tensors are
built independently of atom_convert: source tensors are read with safetensors.safe_open, sliced
per rank as spec §5 says, fnuz-normalised here for gfx942 (bytes 0x80 -> 0x00, scales x2,
spec §3.0.2), shuffled with aiter's own `shuffle_weight` (spec §3.0.3), and the MLA operands are
derived from kv_b_proj with explicit index maps and quantised with ATOM's
`dynamic_per_batched_tensor_quant` (spec §4.1). The converted files are read with safe_open too,
then through `atom_convert.open_converted`, and the manifest is checked against both.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import atom_convert

from oracles import xx_blocks

PRESETS = ("tiny-deepseek-v2-lite", "tiny-deepseek-v2", "tiny-deepseek-v3", "tiny-kimi-k2")
FORMATS = ("bf16", "fp8")
TARGETS = ("gfx950", "gfx942")
TPS = (1, 2)
CASES = [(p, f, t, tp) for p in PRESETS for f in FORMATS for t in TARGETS for tp in TPS]

FN, FNUZ, BF16 = torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.bfloat16
FP8_OF = {"gfx950": FN, "gfx942": FNUZ}
FP8_MAX = {"gfx950": 448.0, "gfx942": 240.0}
# half of the smallest subnormal step: e4m3fn 2^-9, e4m3fnuz 2^-10
FP8_HALF_SUBNORMAL = {"gfx950": 2.0**-10, "gfx942": 2.0**-11}
MANIFEST = "atom_manifest.json"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


# ------------------------------------------------------------------------------------------------
# The source checkpoint, read directly
# ------------------------------------------------------------------------------------------------


class Source:
    def __init__(self, folder: Path):
        self.folder = folder
        self.config: dict[str, Any] = json.loads((folder / "config.json").read_text())
        self.t: dict[str, torch.Tensor] = {}
        files = sorted(folder.glob("*.safetensors"))
        assert files
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                for k in h.keys():
                    self.t[k] = h.get_tensor(k)
        idx = folder / "model.safetensors.index.json"
        if idx.exists():
            assert set(json.loads(idx.read_text())["weight_map"]) == set(self.t)
        c = self.config
        self.H, self.Nh, self.Q = c["hidden_size"], c["num_attention_heads"], c.get("q_lora_rank")
        self.L, self.R = c["kv_lora_rank"], c["qk_rope_head_dim"]
        self.P, self.V = c["qk_nope_head_dim"], c["v_head_dim"]
        self.Id, self.I = c["intermediate_size"], c["moe_intermediate_size"]
        self.E, self.S = c["n_routed_experts"], c.get("n_shared_experts") or 0
        self.vocab, self.n_layers = c["vocab_size"], c["num_hidden_layers"]
        self.first_dense = c["first_k_dense_replace"]
        self.n_mtp = c.get("num_nextn_predict_layers") or 0

    def __contains__(self, name: str) -> bool:
        return name in self.t

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.t[name]

    def is_fp8(self, module: str) -> bool:
        return f"{module}.weight_scale_inv" in self.t

    def dequant_bf16(self, module: str) -> torch.Tensor:
        """bf16(fp32(w) * fp32(scale[i // 128, j // 128])): the same bytes as compressed-tensors'
        FP8BlockDequantizer (test_primitives proves that), written with an explicit index map."""
        w, s = self.t[f"{module}.weight"], self.t[f"{module}.weight_scale_inv"]
        assert w.dtype == FN and s.dtype == torch.float32
        i = torch.arange(w.shape[0])[:, None] // 128
        j = torch.arange(w.shape[1])[None, :] // 128
        return (w.float() * s[i, j]).to(BF16)


_SOURCES: dict[Path, Source] = {}


def source(folder: Path) -> Source:
    if folder not in _SOURCES:
        _SOURCES[folder] = Source(folder)
    return _SOURCES[folder]


# ------------------------------------------------------------------------------------------------
# Expected per-rank tensors
# ------------------------------------------------------------------------------------------------


def runtime_per_tensor_quant(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """ATOM attention_mla.py `dynamic_per_batched_tensor_quant`, as the runtime writes it (spec §4.1 step 5)."""
    DTYPE_MAX = torch.finfo(dtype).max
    min_val, max_val = x.aminmax()
    amax = torch.maximum(min_val.abs(), max_val.abs()).clamp(min=1e-10)
    scale = DTYPE_MAX / amax
    x_scl_sat = (x * scale).clamp(min=-DTYPE_MAX, max=DTYPE_MAX)
    return x_scl_sat.to(dtype).contiguous(), scale.float().reciprocal()


@dataclass
class Exp:
    per_rank: list[torch.Tensor]
    shuffled: bool
    sources: tuple[str, ...]


@dataclass
class Expected:
    sets: dict[str, dict[str, Exp]] = field(default_factory=lambda: {"main": {}})
    aliases: dict[str, dict[str, str]] = field(default_factory=lambda: {"main": {}})
    wkvb: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # W_K name -> per-rank bf16 rows of kv_b


class Builder:
    def __init__(self, src: Source, target: str, tp: int, shuffle_weight):
        self.s, self.target, self.tp = src, target, tp
        self.fp8 = FP8_OF[target]
        self.aiter_shuffle = shuffle_weight
        self.exp = Expected()
        self.cur = "main"

    # -- primitives, written here --------------------------------------------------------------
    def fix(self, w: torch.Tensor) -> torch.Tensor:
        """Target fp8: unchanged on gfx950; bytes 0x80 -> 0x00 reinterpreted as e4m3fnuz on gfx942."""
        assert w.dtype == FN
        if self.target == "gfx950":
            return w
        b = w.contiguous().view(torch.uint8).clone()
        b[b == 0x80] = 0
        return b.view(FNUZ)

    def fix_s(self, s: torch.Tensor) -> torch.Tensor:
        assert s.dtype == torch.float32
        return s * 2 if self.target == "gfx942" else s

    def shuf(self, w: torch.Tensor) -> torch.Tensor:
        return self.aiter_shuffle(w.contiguous().clone(), layout=(16, 16)).contiguous()

    def add(self, name: str, per_rank: list[torch.Tensor], sources: list[str], shuffled: bool = False) -> None:
        d = self.exp.sets.setdefault(self.cur, {})
        assert name not in d, name
        d[name] = Exp(per_rank, shuffled, tuple(sources))

    # -- tensors -------------------------------------------------------------------------------
    def plain(self, src_name: str, out_name: str, vocab: bool = False) -> None:
        t = self.s[src_name]
        assert t.dtype in (BF16, torch.float32)
        t = t.to(BF16)  # fp32 router / correction bias are bf16 at run time (spec §2.4)
        if vocab:
            n = t.shape[0] // self.tp
            per = [t[r * n:(r + 1) * n] for r in range(self.tp)]
        else:
            per = [t] * self.tp
        self.add(out_name, per, [src_name])

    def linear(self, sp: str, op: str, out: str, parts: list[str], par: str) -> None:
        """par: 'rep' replicated, 'col' rows split by rank (each part split, then stacked), 'row' columns split."""
        mods = [sp + p for p in parts]
        fp8 = self.s.is_fp8(mods[0])
        assert all(self.s.is_fp8(m) == fp8 for m in mods)
        ws, ss = [], []
        for r in range(self.tp):
            wr, sr = [], []
            for m in mods:
                w = self.s[f"{m}.weight"]
                sc = self.s[f"{m}.weight_scale_inv"] if fp8 else None
                o, i = w.shape
                if par == "col":
                    n = o // self.tp
                    w = w[r * n:(r + 1) * n]
                    if fp8:
                        b = cdiv(n, 128)  # spec §3.2: scale rows [r·ceil(out_loc/128), ...)
                        sc = sc[r * b:(r + 1) * b]
                elif par == "row":
                    n = i // self.tp
                    w = w[:, r * n:(r + 1) * n]
                    if fp8:
                        b = cdiv(n, 128)
                        sc = sc[:, r * b:(r + 1) * b]
                wr.append(w)
                sr.append(sc)
            w = torch.cat(wr, 0)
            if fp8:
                ws.append(self.shuf(self.fix(w)))
                ss.append(self.fix_s(torch.cat(sr, 0)))
            else:
                assert w.dtype == BF16
                ws.append(w)  # bf16 linears are never shuffled (spec §3.1)
        srcs = [f"{m}.{x}" for m in mods for x in (("weight", "weight_scale_inv") if fp8 else ("weight",))]
        self.add(f"{op}{out}.weight", ws, srcs, shuffled=fp8)
        if fp8:
            self.add(f"{op}{out}.weight_scale", ss, srcs)

    def experts(self, sp: str, op: str, with_shared: bool) -> None:
        trios = [[f"{sp}mlp.experts.{e}.{p}" for p in ("gate_proj", "up_proj", "down_proj")] for e in range(self.s.E)]
        if with_shared:  # the shared expert is routed expert E (spec §2.4, §8.3)
            trios.append([f"{sp}mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")])
        fp8 = self.s.is_fp8(trios[0][0])
        il = self.s.I // self.tp
        w13s, w2s, s13s, s2s = [], [], [], []
        for r in range(self.tp):
            lo, hi = r * il, (r + 1) * il
            blo, bhi = r * cdiv(il, 128), (r + 1) * cdiv(il, 128)
            w13 = torch.stack([torch.cat([self.s[f"{g}.weight"][lo:hi], self.s[f"{u}.weight"][lo:hi]]) for g, u, _ in trios])
            w2 = torch.stack([self.s[f"{d}.weight"][:, lo:hi] for _, _, d in trios])
            if fp8:
                w13, w2 = self.fix(w13), self.fix(w2)
                s13s.append(self.fix_s(torch.stack([torch.cat([self.s[f"{g}.weight_scale_inv"][blo:bhi],
                                                               self.s[f"{u}.weight_scale_inv"][blo:bhi]])
                                                    for g, u, _ in trios])))
                s2s.append(self.fix_s(torch.stack([self.s[f"{d}.weight_scale_inv"][:, blo:bhi] for _, _, d in trios])))
            else:
                assert w13.dtype == BF16
            # bf16 experts are shuffled too, Ke = 8 (spec §3.1); the whole 3-D stack in one aiter call
            w13s.append(self.shuf(w13))
            w2s.append(self.shuf(w2))
        srcs = [f"{m}.{x}" for t in trios for m in t for x in (("weight", "weight_scale_inv") if fp8 else ("weight",))]
        base = f"{op}mlp.experts."
        self.add(base + "w13_weight", w13s, srcs, shuffled=True)
        if fp8:
            self.add(base + "w13_weight_scale", s13s, srcs)
        self.add(base + "w2_weight", w2s, srcs, shuffled=True)
        if fp8:
            self.add(base + "w2_weight_scale", s2s, srcs)

    def readback(self, module: str) -> torch.Tensor:
        """ATOM's `get_and_maybe_dequant_weights` on the processed fp8 layer (atom/model_ops/utils.py
        175-185): its forward on a bf16 identity, run here as the aiter kernels do it (semantics from
        aiter e4048607a, as ../shared/atom-oracle/aiter_shim.py writes them): the identity quantised
        per 1x128 (absmax >= 1e-10; scale = absmax * fl32(1/max); code = cvt(x * (1/scale))), then
        the blockscale GEMM over K blocks in order: acc = fma(partial, a_scale * b_scale, acc) from 0,
        rounded to bf16 at the end; the result transposed back to [N, K]."""
        w, sc = self.fix(self.s[f"{module}.weight"]), self.fix_s(self.s[f"{module}.weight_scale_inv"])
        n, k = w.shape
        kb = cdiv(k, 128)
        mx = float(torch.finfo(self.fp8).max)
        eye = torch.eye(k, dtype=BF16).float()
        g = torch.zeros(k, kb * 128)
        g[:, :k] = eye
        g = g.view(k, kb, 128)
        a_scale = (g.abs().amax(-1).clamp(min=1e-10) * torch.tensor(1.0 / mx, dtype=torch.float32)).float()
        a_q = (g * (1.0 / a_scale)[..., None]).clamp(-mx, mx).to(self.fp8).float()  # [k, kb, 128]
        wq = torch.zeros(n, kb * 128)
        wq[:, :k] = w.float()
        wq = wq.view(n, kb, 128)
        b_scale = sc.float().repeat_interleave(128, 0)[:n]  # [n, kb]
        acc = torch.zeros(k, n)
        for b in range(kb):
            part = a_q[:, b, :] @ wq[:, b, :].t()
            acc = torch.addcmul(acc, part, a_scale[:, b:b + 1] * b_scale[:, b][None, :])
        return acc.to(BF16).t().contiguous()

    def mla(self, sp: str, op: str) -> None:
        m = f"{sp}self_attn.kv_b_proj"
        s = self.s
        wkvb = self.readback(m) if s.is_fp8(m) else s[f"{m}.weight"]
        assert wkvb.dtype == BF16 and wkvb.shape == (s.Nh * (s.P + s.V), s.L)
        nr = s.Nh // self.tp
        n = torch.arange(nr)
        res: dict[str, list[torch.Tensor]] = {"W_K": [], "W_K_scale": [], "W_V": [], "W_V_scale": []}
        rows_per_rank = []
        for r in range(self.tp):
            rows = wkvb[r * nr * (s.P + s.V):(r + 1) * nr * (s.P + s.V)]
            rows_per_rank.append(rows)
            # W_K[n, l, p] = Wkvb[n(P+V) + p, l];  W_V[n, v, l] = Wkvb[n(P+V) + P + v, l]
            wk = rows[(n[:, None, None] * (s.P + s.V) + torch.arange(s.P)[None, None, :]),
                      torch.arange(s.L)[None, :, None]]
            wv = rows[(n[:, None, None] * (s.P + s.V) + s.P + torch.arange(s.V)[None, :, None]),
                      torch.arange(s.L)[None, None, :]]
            assert wk.shape == (nr, s.L, s.P) and wv.shape == (nr, s.V, s.L)
            qk, sk = runtime_per_tensor_quant(wk, self.fp8)  # per rank; gfx942: max 240, scale not doubled
            qv, sv = runtime_per_tensor_quant(wv, self.fp8)
            res["W_K"].append(qk)
            res["W_K_scale"].append(sk)
            res["W_V"].append(qv)
            res["W_V_scale"].append(sv)
        srcs = [f"{m}.weight", f"{m}.weight_scale_inv"] if s.is_fp8(m) else [f"{m}.weight"]
        for a, per in res.items():
            self.add(f"{op}self_attn.mla_attn.impl.{a}", per, srcs)
        self.exp.wkvb[f"{op}self_attn.mla_attn.impl.W_K"] = rows_per_rank

    def layer(self, i: int, sp: str, op: str) -> None:
        s = self.s
        for nm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            self.plain(sp + nm, op + nm)
        if s.Q is not None:
            self.plain(sp + "self_attn.q_a_layernorm.weight", op + "self_attn.q_a_layernorm.weight")
        self.plain(sp + "self_attn.kv_a_layernorm.weight", op + "self_attn.kv_a_layernorm.weight")
        if s.Q is not None:
            # rows Q then kv_a; scale rows ceil(Q/128) then kv_a's (spec §2.2)
            self.linear(sp, op, "self_attn.fused_qkv_a_proj", ["self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"], "rep")
            self.linear(sp, op, "self_attn.q_b_proj", ["self_attn.q_b_proj"], "col")
        else:
            self.linear(sp, op, "self_attn.q_proj", ["self_attn.q_proj"], "col")
            self.linear(sp, op, "self_attn.kv_a_proj_with_mqa", ["self_attn.kv_a_proj_with_mqa"], "rep")
        self.linear(sp, op, "self_attn.kv_b_proj", ["self_attn.kv_b_proj"], "col")
        self.linear(sp, op, "self_attn.o_proj", ["self_attn.o_proj"], "row")
        self.mla(sp, op)
        if i < s.first_dense:
            self.linear(sp, op, "mlp.gate_up_proj", ["mlp.gate_proj", "mlp.up_proj"], "col")
            self.linear(sp, op, "mlp.down_proj", ["mlp.down_proj"], "row")
            return
        assert s[sp + "mlp.gate.weight"].dtype == torch.float32  # the fixtures keep the router in fp32
        self.plain(sp + "mlp.gate.weight", op + "mlp.gate.weight")
        if sp + "mlp.gate.e_score_correction_bias" in s:
            assert s[sp + "mlp.gate.e_score_correction_bias"].dtype == torch.float32
            self.plain(sp + "mlp.gate.e_score_correction_bias", op + "mlp.gate.e_score_correction_bias")
            self.exp.aliases.setdefault(self.cur, {})[op + "mlp.experts.e_score_correction_bias"] = \
                op + "mlp.gate.e_score_correction_bias"
        self.experts(sp, op, with_shared=s.S == 1)
        if s.S > 1:  # V2: shared experts stay a separate MLP of width I·S (spec §2.4, "not fused")
            self.linear(sp, op, "mlp.shared_experts.gate_up_proj",
                        ["mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"], "col")
            self.linear(sp, op, "mlp.shared_experts.down_proj", ["mlp.shared_experts.down_proj"], "row")

    def build(self) -> Expected:
        s = self.s
        self.plain("model.embed_tokens.weight", "model.embed_tokens.weight", vocab=True)
        for i in range(s.n_layers):
            self.layer(i, f"model.layers.{i}.", f"model.layers.{i}.")
        self.plain("model.norm.weight", "model.norm.weight")
        self.plain("lm_head.weight", "lm_head.weight", vocab=True)
        if s.n_mtp:
            j = s.n_layers
            sp = f"model.layers.{j}."
            self.cur = "mtp"
            self.exp.sets["mtp"] = {}
            self.plain(sp + "embed_tokens.weight", "model.embed_tokens.weight", vocab=True)
            for nm in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
                self.plain(sp + nm, sp + nm)
            eh = sp + "eh_proj"
            if s.is_fp8(eh):  # bf16 at run time; an fp8 source is dequantised (spec §2.6)
                self.add(eh + ".weight", [s.dequant_bf16(eh)] * self.tp, [eh + ".weight", eh + ".weight_scale_inv"])
            else:
                self.add(eh + ".weight", [s[eh + ".weight"]] * self.tp, [eh + ".weight"])
            self.plain(sp + "shared_head.head.weight", sp + "shared_head.head.weight", vocab=True)
            self.layer(j, sp, sp + "mtp_block.")
        return self.exp


# ------------------------------------------------------------------------------------------------
# One parametrized case, built once per module param
# ------------------------------------------------------------------------------------------------


@dataclass
class Case:
    preset: str
    fmt: str
    target: str
    tp: int
    src: Source
    out: Path
    exp: Expected

    def dir_of(self, set_name: str) -> Path:
        return self.out if set_name == "main" else self.out / "mtp"


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors: torch's intra-op threads only add overhead (much of it on a busy 2-core
    machine). Results do not depend on it; restored after this module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=CASES, ids=["-".join(map(str, c)) for c in CASES])
def case(request, tiny_checkpoint, converted, aiter) -> Case:
    preset, fmt, target, tp = request.param
    src = source(tiny_checkpoint(preset, fmt))
    out = converted(preset, fmt, target, tp)
    exp = Builder(src, target, tp, aiter[1].shuffle_weight).build()
    return Case(preset, fmt, target, tp, src, out, exp)


def _file_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt", device="cpu") as h:
        return {k: h.get_tensor(k) for k in h.keys()}


def _rank_files(d: Path, tp: int) -> list[list[Path]]:
    """Shard files of each rank: `...rank{r}-...` names, or every shard when tp is 1."""
    files = sorted(d.glob("*.safetensors"))
    assert files
    if tp == 1:
        return [files]
    per = [[f for f in files if re.search(rf"rank{r}\D", f.name)] for r in range(tp)]
    assert sorted(f for p in per for f in p) == files, "a shard belongs to no rank or to several"
    return per


def _rank_tensors(case: Case, set_name: str, rank: int) -> dict[str, torch.Tensor]:
    d = case.dir_of(set_name)
    out: dict[str, torch.Tensor] = {}
    for f in _rank_files(d, case.tp)[rank]:
        t = _file_tensors(f)
        assert not set(t) & set(out), f"{f}: tensor names repeated across shards"
        out.update(t)
    return out


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------


def test_sets_present(case: Case):
    assert (case.out / MANIFEST).is_file()
    has_mtp = case.src.n_mtp > 0
    assert (case.out / "mtp" / MANIFEST).is_file() == has_mtp
    assert set(case.exp.sets) == ({"main", "mtp"} if has_mtp else {"main"})


def test_every_tensor_byte_exact(case: Case):
    if case.fmt == "fp8":  # the gfx942 byte fix (0x80 -> 0x00) is exercised by the fixture data
        assert any(bool((t.view(torch.uint8) == 0x80).any()) for t in case.src.t.values() if t.dtype == FN)
    for set_name, exp in case.exp.sets.items():
        for r in range(case.tp):
            got = _rank_tensors(case, set_name, r)
            assert sorted(got) == sorted(exp), f"{set_name} rank {r}: " \
                f"missing {sorted(set(exp) - set(got))[:5]}, unexpected {sorted(set(got) - set(exp))[:5]}"
            bad = []
            for name, e in exp.items():
                want, g = e.per_rank[r], got[name]
                if g.dtype != want.dtype or tuple(g.shape) != tuple(want.shape) or not torch.equal(u8(g), u8(want)):
                    bad.append(f"{name}: got {g.dtype} {list(g.shape)}, want {want.dtype} {list(want.shape)}"
                               + ("" if g.shape != want.shape or g.dtype != want.dtype else
                                  f", {int((u8(g) != u8(want)).sum())} bytes differ"))
            assert not bad, f"{set_name} rank {r}:\n" + "\n".join(bad)


def test_dtype_and_shuffle_rules(case: Case):
    """The layout rules read off the converted manifest and files, independently of the byte
    comparison: fp8 of the target only for fp8 linears, experts and W_K/W_V; every fp8 linear and
    every expert stack shuffled, bf16 linears never (spec §3.1, §3.2, §8.5); scales fp32;
    replicated tensors identical on every rank."""
    fp8 = str(FP8_OF[case.target]).removeprefix("torch.")
    q = case.fmt == "fp8"
    for set_name in case.exp.sets:
        d = case.dir_of(set_name)
        m = json.loads((d / MANIFEST).read_text())
        ranks = [_rank_tensors(case, set_name, r) for r in range(case.tp)]
        for name, e in m["tensors"].items():
            if name.endswith(("experts.w13_weight", "experts.w2_weight")):
                assert e["is_shuffled"] and e["dtype"] == (fp8 if q else "bfloat16"), name
            elif name.endswith((".W_K", ".W_V")):
                assert e["dtype"] == fp8 and not e["is_shuffled"], name
            elif name.endswith("_scale"):
                assert e["dtype"] == "float32" and not e["is_shuffled"], name
                assert q or name.endswith(("W_K_scale", "W_V_scale")), name
            elif re.search(r"proj(_with_mqa)?\.weight$", name) and not name.endswith("eh_proj.weight"):
                assert e["is_shuffled"] is q and e["dtype"] == (fp8 if q else "bfloat16"), name
            else:  # norms, router, bias, embeddings, heads, MTP eh_proj
                assert e["dtype"] == "bfloat16" and not e["is_shuffled"], name
            replicated = ("norm" in name or "fused_qkv_a_proj" in name or "kv_a_proj_with_mqa" in name
                          or ".mlp.gate." in name or "eh_proj" in name)
            if replicated and case.tp > 1:
                assert all(torch.equal(u8(ranks[0][name]), u8(t[name])) for t in ranks[1:]), name
            sharded = name.endswith(("embed_tokens.weight", "lm_head.weight", "head.weight", ".W_K", ".W_V"))
            if sharded and case.tp > 1:
                assert not torch.equal(u8(ranks[0][name]), u8(ranks[1][name])), name


def test_manifest_entries_match_files(case: Case):
    for set_name, exp in case.exp.sets.items():
        d = case.dir_of(set_name)
        m = json.loads((d / MANIFEST).read_text())
        assert m["role"] == set_name and m["target"] == case.target and m["tp_size"] == case.tp
        assert m["fp8_dtype"] == str(FP8_OF[case.target]).removeprefix("torch.")
        assert sorted(m["tensors"]) == sorted(exp)
        headers: dict[str, dict[str, Any]] = {}
        for f in d.glob("*.safetensors"):
            raw = f.read_bytes()
            n = int.from_bytes(raw[:8], "little")
            headers[f.name] = {k: v for k, v in json.loads(raw[8:8 + n]).items() if k != "__metadata__"}
        listed: dict[str, set[str]] = {f: set() for f in headers}
        for name, e in m["tensors"].items():
            x = exp[name]
            want = x.per_rank[0]
            assert e["dtype"] == str(want.dtype).removeprefix("torch."), name
            assert e["shape"] == list(want.shape), name
            assert e["is_shuffled"] is x.shuffled, name
            assert sorted(e["sources"]) == sorted(x.sources) and len(set(e["sources"])) == len(e["sources"]), name
            assert len(e["rank_files"]) == case.tp and e["file"] == e["rank_files"][0]
            per_rank = _rank_files(d, case.tp)
            for r, f in enumerate(e["rank_files"]):
                assert d / f in per_rank[r], (name, r, f)
                h = headers[f][name]
                assert h["shape"] == list(want.shape)
                st = {FN: "F8_E4M3", FNUZ: "F8_E4M3FNUZ", BF16: "BF16", torch.float32: "F32"}[want.dtype]
                assert h["dtype"] == st, (name, h["dtype"])
                listed[f].add(name)
        for f, names in listed.items():
            assert names == set(headers[f]), f"{f} holds tensors the manifest does not place there"


def test_manifest_files_sizes_and_hashes(case: Case):
    m = json.loads((case.out / MANIFEST).read_text())
    on_disk = {p.relative_to(case.out).as_posix() for p in case.out.rglob("*") if p.is_file()}
    assert set(m["files"]) == on_disk - {MANIFEST}
    for rel, meta in m["files"].items():
        p = case.out / rel
        assert p.stat().st_size == meta["bytes"], rel
        assert xx_blocks(p.read_bytes()) == meta["xxh3_blocks"], rel
    if case.src.n_mtp:
        mm = json.loads((case.out / "mtp" / MANIFEST).read_text())
        assert m["mtp"]["status"] == "converted" and m["mtp"]["path"] == "mtp"
        assert m["mtp"]["tensors"] == len(mm["tensors"])
        sub = {p.relative_to(case.out / "mtp").as_posix() for p in (case.out / "mtp").rglob("*") if p.is_file()}
        assert set(mm["files"]) == sub - {MANIFEST}
        for rel, meta in mm["files"].items():
            assert m["files"][f"mtp/{rel}"] == meta
    else:
        assert m["mtp"]["status"] == "absent"


def test_every_source_tensor_accounted_for(case: Case):
    m = json.loads((case.out / MANIFEST).read_text())
    used: set[str] = set()
    for e in m["tensors"].values():
        used.update(e["sources"])
    if case.src.n_mtp:
        for e in json.loads((case.out / "mtp" / MANIFEST).read_text())["tensors"].values():
            used.update(e["sources"])
    dropped = set(m["dropped"])
    assert used <= set(case.src.t), sorted(used - set(case.src.t))[:5]
    assert not (used & dropped)
    missing = set(case.src.t) - used - dropped
    assert not missing, sorted(missing)[:10]
    assert dropped == set()  # the fixtures hold no kv_scale / inv_freq tensors


def test_open_converted_same_bytes_and_alias(case: Case):
    for r in range(case.tp):
        with atom_convert.open_converted(case.out, rank=r) as ck:
            sets = {"main": ck}
            sub = ck.mtp()
            assert (sub is not None) == bool(case.src.n_mtp)
            if sub is not None:
                sets["mtp"] = sub
            for set_name, reader in sets.items():
                exp = case.exp.sets[set_name]
                assert sorted(reader.keys()) == sorted(exp)
                for name, e in exp.items():
                    t = reader.get(name)
                    want = e.per_rank[r]
                    assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(u8(t), u8(want)), name
                    ent = reader.entry(name)
                    assert ent["file"] == ent["rank_files"][r] and ent["is_shuffled"] is e.shuffled
                want_aliases = case.exp.aliases.get(set_name, {})
                assert reader.aliases == want_aliases
                for alias, target in want_aliases.items():
                    assert alias in reader
                    a, b = reader.get(alias), reader.get(target)
                    assert a.dtype == BF16 and torch.equal(u8(a), u8(b))
                    assert torch.equal(u8(a), u8(exp[target].per_rank[r]))
                    assert reader.entry(alias) == reader.entry(target)
                if set_name == "main" and case.preset in ("tiny-deepseek-v3", "tiny-kimi-k2"):
                    assert want_aliases  # V3/Kimi have e_score_correction_bias on every MoE layer
                if case.preset.startswith("tiny-deepseek-v2"):
                    assert not want_aliases


def test_mla_operands_recombine_to_kv_b(case: Case):
    """Dequantised W_K / W_V put back by the inverse index map give the rank's kv_b_proj rows
    within fp8 rounding, and keep each head's largest element in place."""
    s = case.src
    fmax, half_sub = FP8_MAX[case.target], FP8_HALF_SUBNORMAL[case.target]
    nr = s.Nh // case.tp
    checked = 0
    for set_name in case.exp.sets:
        for r in range(case.tp):
            got = _rank_tensors(case, set_name, r)
            for wk_name, rows_per_rank in case.exp.wkvb.items():
                if wk_name not in got:
                    continue
                base = wk_name.removesuffix("W_K")
                wkvb = rows_per_rank[r].float()
                wk, wv = got[wk_name], got[base + "W_V"]
                sk, sv = got[base + "W_K_scale"], got[base + "W_V_scale"]
                assert wk.dtype == wv.dtype == FP8_OF[case.target]
                assert sk.shape == sv.shape == () and sk.dtype == sv.dtype == torch.float32
                # one scale per tensor per rank, amax / DTYPE_MAX (not doubled on gfx942, spec §10)
                for q, sc, part in ((wk, sk, "K"), (wv, sv, "V")):
                    hp = [slice(h * (s.P + s.V), h * (s.P + s.V) + s.P) if part == "K"
                          else slice(h * (s.P + s.V) + s.P, (h + 1) * (s.P + s.V)) for h in range(nr)]
                    amax = torch.cat([wkvb[x] for x in hp]).abs().max().item()
                    assert abs(sc.item() * fmax / amax - 1) < 2**-6, (part, sc.item(), amax / fmax)
                rec = torch.full_like(wkvb, float("nan"))
                dk, dv = wk.float() * sk, wv.float() * sv
                n = torch.arange(nr)
                rec[n[:, None, None] * (s.P + s.V) + torch.arange(s.P)[None, None, :],
                    torch.arange(s.L)[None, :, None]] = dk
                rec[n[:, None, None] * (s.P + s.V) + s.P + torch.arange(s.V)[None, :, None],
                    torch.arange(s.L)[None, None, :]] = dv
                assert not rec.isnan().any(), "W_K/W_V do not cover every kv_b row"
                scale = torch.zeros_like(wkvb)
                for h in range(nr):
                    scale[h * (s.P + s.V):h * (s.P + s.V) + s.P] = sk
                    scale[h * (s.P + s.V) + s.P:(h + 1) * (s.P + s.V)] = sv
                # bf16(x·s) then RNE to 3 mantissa bits: <= 2^-4 + 2^-8 relative, plus half a subnormal step
                tol = (2**-4 + 2**-8) * wkvb.abs() + half_sub * scale * 1.001
                err = (rec - wkvb).abs()
                assert torch.all(err <= tol), f"{wk_name} rank {r}: worst excess {(err - tol).max().item()}"
                assert torch.all((rec == 0) | (torch.sign(rec) == torch.sign(wkvb)))
                for h in range(nr):
                    for blk, d3 in ((slice(h * (s.P + s.V), h * (s.P + s.V) + s.P), dk[h].T),
                                    (slice(h * (s.P + s.V) + s.P, (h + 1) * (s.P + s.V)), dv[h])):
                        src_blk = wkvb[blk]
                        assert d3.shape == src_blk.shape
                        pos = int(src_blk.abs().argmax())
                        # the head's largest source element holds the head's largest fp8 value
                        assert d3.reshape(-1)[pos].abs() == d3.abs().max()
                checked += 1
    n_layers = s.n_layers + s.n_mtp
    assert checked == n_layers * case.tp
