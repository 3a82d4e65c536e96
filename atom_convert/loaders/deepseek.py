"""DeepSeek V2/V2-Lite/V3/R1 and Kimi-K2 -> ATOM's post-load layout.

How it works:
1. Declarative tables below say, per decoder layer, which source modules feed
   which runtime module and how tensor parallelism splits them (spec §2, §5).
2. `DeepseekLoader.plan` checks every source tensor against config.json (name,
   dtype, shape, scale grid), then builds one `Group` of `OutTensor`s per layer.
3. Each `OutTensor` carries a producer that reads only its rank's slice of the
   sources when the writer asks for it, applies the post-load steps in ATOM's
   order (fnuz on gfx942, then shuffle16, spec §3.2), and yields the bytes.
4. Two code hooks cover what is not a table row: the expert stack (with the
   shared expert as slot E) and the MLA operands W_K/W_V (spec §4.1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import Any, Callable, Iterator

import torch

from ..errors import BadInputError, CheckpointError, UnsupportedError
from ..model import ModelSpec
from ..plan import ConversionPlan, Group, ModelPlan, OutTensor
from ..profile import NamingProfile
from ..quant.base import LinearCodec, LinearData, SourceFormat
from ..quant.bf16 import FLOAT_DTYPES, Bf16Linear
from ..quant.fnuz import target_scale, to_target_fp8
from ..quant.formats import FP8_BLOCK, FP8_DTYPE_BY_TARGET
from ..quant.fp8_block import Fp8BlockLinear, block_dequant, cdiv
from ..quant.per_tensor import per_tensor_quant
from ..quant.shuffle import shuffle16, shuffle_requirements_met
from ..source import SourceCheckpoint
from .base import ArchLoader

BF16 = torch.bfloat16

# The layout flag values this loader produces (spec §6.2 defaults); recorded in
# the manifest so that a runtime with other flags refuses the files (spec §8.10).
LAYOUT_FLAGS: dict[str, Any] = {
    "ATOM_FP8_BLOCKSCALE_WEIGHT_PRESHUFFLE": 1,
    "ATOM_FP8_BLOCKSCALE_USE_E8M0_SCALE": 0,
    "ATOM_USE_TRITON_GEMM": 0,
    "ATOM_USE_FP4_NON_SHUFFLE_TRITON_GEMM": 0,
    "ATOM_USE_TRITON_MXFP4_BMM": 0,
    "ATOM_MOE_GU_ITLV": 0,
    "ATOM_FUSE_SHARED_EXPERT": 1,
    "moe_backend": "standard",
    "enable_expert_parallel": False,
}

# Source names dropped by ATOM's name rewriting (spec §1.2 rule 3).
DROP_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r".*kv_scale$"), "kv-cache scale: ATOM never loads one; MLA uses k-scale 1.0 (spec §1.2 rule 3)"),
    (re.compile(r".*inv_freq.*"), "rotary inv_freq: rebuilt by the runtime (spec §1.2 rule 3)"),
)


class Par(Enum):
    """How tensor parallelism splits a linear (spec §5)."""

    REPLICATED = "replicated"  # every rank holds all of it
    COLUMN = "column"  # output rows split; with several parts, each part split then concatenated
    ROW = "row"  # input columns split


Dims = Callable[[ModelSpec], tuple[tuple[int, int], ...]]


@dataclass(frozen=True)
class LinearRule:
    out: str  # runtime module path under the layer prefix
    parts: tuple[str, ...]  # source module paths under the layer prefix, in row order
    par: Par
    dims: Dims  # full (out_features, in_features) of each part
    when: Callable[[ModelSpec], bool] = lambda s: True


def _q_lora(s: ModelSpec) -> bool:
    return s.Q is not None


def _no_q_lora(s: ModelSpec) -> bool:
    return s.Q is None


# spec §2.2 (variant A: q_lora_rank set; variant B: V2-Lite)
ATTENTION: tuple[LinearRule, ...] = (
    LinearRule("self_attn.fused_qkv_a_proj", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"), Par.REPLICATED,
               lambda s: ((s.Q, s.H), (s.L + s.R, s.H)), _q_lora),
    LinearRule("self_attn.q_b_proj", ("self_attn.q_b_proj",), Par.COLUMN, lambda s: ((s.Nh * (s.P + s.R), s.Q),), _q_lora),
    LinearRule("self_attn.q_proj", ("self_attn.q_proj",), Par.COLUMN, lambda s: ((s.Nh * (s.P + s.R), s.H),), _no_q_lora),
    LinearRule("self_attn.kv_a_proj_with_mqa", ("self_attn.kv_a_proj_with_mqa",), Par.REPLICATED,
               lambda s: ((s.L + s.R, s.H),), _no_q_lora),
    LinearRule("self_attn.kv_b_proj", ("self_attn.kv_b_proj",), Par.COLUMN, lambda s: ((s.Nh * (s.P + s.V), s.L),)),
    LinearRule("self_attn.o_proj", ("self_attn.o_proj",), Par.ROW, lambda s: ((s.H, s.Nh * s.V),)),
)
KV_B = ATTENTION[4]

# spec §2.3: gate first, then up.
DENSE_MLP: tuple[LinearRule, ...] = (
    LinearRule("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"), Par.COLUMN, lambda s: ((s.Id, s.H), (s.Id, s.H))),
    LinearRule("mlp.down_proj", ("mlp.down_proj",), Par.ROW, lambda s: ((s.H, s.Id),)),
)

# spec §2.4 "when not fused": one MLP of width I*S.
SHARED_MLP: tuple[LinearRule, ...] = (
    LinearRule("mlp.shared_experts.gate_up_proj", ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
               Par.COLUMN, lambda s: ((s.I * s.S, s.H), (s.I * s.S, s.H))),
    LinearRule("mlp.shared_experts.down_proj", ("mlp.shared_experts.down_proj",), Par.ROW, lambda s: ((s.H, s.I * s.S),)),
)

# Replicated 1-D tensors per layer: (name, length).
NORMS: tuple[tuple[str, Callable[[ModelSpec], int | None]], ...] = (
    ("input_layernorm.weight", lambda s: s.H),
    ("post_attention_layernorm.weight", lambda s: s.H),
    ("self_attn.q_a_layernorm.weight", lambda s: s.Q),
    ("self_attn.kv_a_layernorm.weight", lambda s: s.L),
)

# MTP extras beside the decoder block (spec §2.6): name -> (kind, optional).
MTP_VECTORS = ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")


@dataclass
class _Ctx:
    """What every producer needs; one per conversion."""

    src: SourceCheckpoint
    spec: ModelSpec
    fmt: SourceFormat
    target: str
    tp: int
    profile: NamingProfile
    problems: list[str]
    consumed: set[str]

    @property
    def fp8(self) -> torch.dtype:
        return FP8_DTYPE_BY_TARGET[self.target]


# --------------------------------------------------------------------------------------------
# Planning helpers: checks first (collecting every problem), then OutTensors.
# --------------------------------------------------------------------------------------------


def _check_float(ctx: _Ctx, name: str, shape: tuple[int, ...], optional: bool = False) -> bool:
    """A plain float tensor (norm, embedding, router...). Returns whether it is present."""
    if name not in ctx.src:
        if not optional:
            ctx.problems.append(f"missing tensor {name} (expected a bf16 tensor of shape {list(shape)})")
        return False
    info = ctx.src.info(name)
    if info.dtype not in FLOAT_DTYPES:
        ctx.problems.append(f"{info.file}: tensor {name} has dtype {info.dtype}, expected bfloat16 (or float32)")
    if info.shape != shape:
        ctx.problems.append(f"{info.file}: tensor {name} has shape {list(info.shape)}, expected {list(shape)}")
    ctx.consumed.add(name)
    return True


def _whole(ctx: _Ctx, name: str, rank: int, cache: dict[str, Any]) -> Iterator[torch.Tensor]:
    yield ctx.src.get(name).to(BF16)


def _vocab_rows(ctx: _Ctx, name: str, rank: int, cache: dict[str, Any]) -> Iterator[torch.Tensor]:
    n = ctx.src.info(name).shape[0] // ctx.tp
    yield ctx.src.get_rows(name, rank * n, (rank + 1) * n).to(BF16)


def _plain(ctx: _Ctx, src_name: str, out_name: str, shape: tuple[int, ...], vocab: bool = False,
           optional: bool = False) -> list[OutTensor]:
    if not _check_float(ctx, src_name, shape, optional):
        return []
    if vocab:
        if shape[0] % ctx.tp:
            raise UnsupportedError(
                f"{src_name}: vocab size {shape[0]} is not divisible by tp={ctx.tp}; ATOM splits the vocabulary "
                f"evenly without padding (spec §2.1)"
            )
        local = (shape[0] // ctx.tp, *shape[1:])
        return [OutTensor(out_name, BF16, local, (src_name,), partial(_vocab_rows, ctx, src_name))]
    return [OutTensor(out_name, BF16, shape, (src_name,), partial(_whole, ctx, src_name))]


def _local_rows(par: Par, rows: int, tp: int) -> int:
    return rows // tp if par is Par.COLUMN else rows


def _check_linear(ctx: _Ctx, rule: LinearRule, src_prefix: str, codecs: list[LinearCodec]) -> None:
    """Shape/dtype of every part, and whether ATOM can split and fuse it at this tp."""
    s, tp = ctx.spec, ctx.tp
    dims = rule.dims(s)
    for part, (o, i), codec in zip(rule.parts, dims, codecs):
        module = src_prefix + part
        ctx.problems.extend(codec.check(ctx.src, module, o, i))
        ctx.consumed.update(codec.source_names(module))
    if len({c.name for c in codecs}) > 1:
        kinds = ", ".join(f"{src_prefix + p}: {c.name}" for p, c in zip(rule.parts, codecs))
        raise UnsupportedError(
            f"{src_prefix + rule.out}: its parts are stored in different formats ({kinds}); ATOM fuses them "
            f"into one parameter of one format. Quantize all parts or none (check the ignore list)."
        )
    quantized = codecs[0].quantized
    for part, (o, i) in zip(rule.parts, dims):
        module = src_prefix + part
        if rule.par is Par.COLUMN and o % tp:
            raise UnsupportedError(f"{module}: {o} output rows are not divisible by tp={tp}")
        if rule.par is Par.ROW and i % tp:
            raise UnsupportedError(f"{module}: {i} input columns are not divisible by tp={tp}")
        if quantized and tp > 1:
            if rule.par is Par.COLUMN and (o // tp) % FP8_BLOCK:
                raise UnsupportedError(
                    f"{module}: a rank's {o // tp} rows (of {o}, tp={tp}) do not start on a 128-row fp8 scale block "
                    f"boundary; ATOM slices scale rows by rank and would misplace them (spec §3.2). Use a tp "
                    f"that keeps rows per rank a multiple of 128."
                )
            if rule.par is Par.ROW and (i // tp) % FP8_BLOCK:
                raise UnsupportedError(
                    f"{module}: a rank's {i // tp} input columns (of {i}, tp={tp}) are not a multiple of the "
                    f"128-column fp8 scale block (spec §3.2). Use a smaller tp."
                )
    if quantized and len(rule.parts) > 1:
        for part, (o, _) in zip(rule.parts[:-1], dims[:-1]):
            if _local_rows(rule.par, o, tp) % FP8_BLOCK:
                what = "q_lora_rank" if part.endswith("q_a_proj") else "intermediate size per rank"
                raise UnsupportedError(
                    f"{src_prefix + rule.out}: cannot fuse fp8 {src_prefix + part} ({what} "
                    f"{_local_rows(rule.par, o, tp)}) with the next part: it is not a multiple of 128, so the next "
                    f"part's rows would start inside a 128x128 scale block (spec §2.2). ATOM cannot load this "
                    f"checkpoint fused."
                )
    if quantized:
        rows = sum(_local_rows(rule.par, o, tp) for o, _ in dims)
        cols = dims[0][1] // tp if rule.par is Par.ROW else dims[0][1]
        if not shuffle_requirements_met((rows, cols)):
            raise UnsupportedError(
                f"{src_prefix + rule.out}: per-rank fp8 weight [{rows}, {cols}] cannot take ATOM's 16x16 shuffle "
                f"(needs rows % 16 == 0 and columns % 32 == 0, spec §3.0.3)"
            )


def _read_linear(ctx: _Ctx, rule: LinearRule, src_prefix: str, codecs: list[LinearCodec], rank: int) -> LinearData:
    """The rank's slice of every part, concatenated in row order, in the target's fp8
    (fnuz-normalised on gfx942), not yet shuffled."""
    tp = ctx.tp
    ws, ss = [], []
    for part, (o, i), codec in zip(rule.parts, rule.dims(ctx.spec), codecs):
        module = src_prefix + part
        if rule.par is Par.COLUMN and tp > 1:
            d = codec.read(ctx.src, module, 0, rank * o // tp, (rank + 1) * o // tp)
        elif rule.par is Par.ROW and tp > 1:
            d = codec.read(ctx.src, module, 1, rank * i // tp, (rank + 1) * i // tp)
        else:
            d = codec.read(ctx.src, module)
        ws.append(d.weight)
        if d.scale is not None:
            ss.append(d.scale)
    w = torch.cat(ws, 0) if len(ws) > 1 else ws[0]
    if not ss:
        return LinearData(w)
    s = torch.cat(ss, 0) if len(ss) > 1 else ss[0]
    w, s = to_target_fp8(w, s, ctx.target)
    return LinearData(w, s)


def _linear_weight(ctx: _Ctx, rule: LinearRule, src_prefix: str, out_name: str, codecs: list[LinearCodec],
                   rank: int, cache: dict[str, Any]) -> Iterator[torch.Tensor]:
    d = _read_linear(ctx, rule, src_prefix, codecs, rank)
    if d.scale is None:
        yield d.weight
        return
    cache[out_name + "_scale"] = d.scale
    # Every per_1x128 linear is shuffled: the PRESHUFFLE flag defaults to 1, and
    # fused_qkv_a_proj is shuffled regardless (spec §3.2 step 2).
    yield shuffle16(d.weight)


def _linear_scale(ctx: _Ctx, rule: LinearRule, src_prefix: str, codecs: list[LinearCodec], rank: int,
                  cache: dict[str, Any], key: str) -> Iterator[torch.Tensor]:
    s = cache.pop(key, None)
    if s is None:
        s = _read_linear(ctx, rule, src_prefix, codecs, rank).scale
    yield s


def _plan_linear(ctx: _Ctx, rule: LinearRule, src_prefix: str, out_prefix: str) -> list[OutTensor]:
    codecs = [ctx.fmt.codec_for(src_prefix + p) for p in rule.parts]
    _check_linear(ctx, rule, src_prefix, codecs)
    tp, dims = ctx.tp, rule.dims(ctx.spec)
    rows = sum(_local_rows(rule.par, o, tp) for o, _ in dims)
    cols = dims[0][1] // tp if rule.par is Par.ROW else dims[0][1]
    sources = tuple(n for p, c in zip(rule.parts, codecs) for n in c.source_names(src_prefix + p))
    wname = ctx.profile.tensor(f"{out_prefix}{rule.out}.weight")
    if not codecs[0].quantized:
        return [OutTensor(wname, BF16, (rows, cols), sources,
                          partial(_linear_weight, ctx, rule, src_prefix, wname, codecs))]
    srows = sum(cdiv(_local_rows(rule.par, o, tp), FP8_BLOCK) for o, _ in dims)
    sname = ctx.profile.tensor(f"{out_prefix}{rule.out}.weight_scale")
    return [
        OutTensor(wname, ctx.fp8, (rows, cols), sources, partial(_linear_weight, ctx, rule, src_prefix, wname, codecs),
                  is_shuffled=True),
        OutTensor(sname, torch.float32, (srows, cdiv(cols, FP8_BLOCK)), sources,
                  partial(_linear_scale, ctx, rule, src_prefix, codecs, key=wname + "_scale")),
    ]


# --------------------------------------------------------------------------------------------
# Hook 1: routed experts stacked into w13/w2, the single shared expert as slot E (spec §2.4, §3.2)
# --------------------------------------------------------------------------------------------


def _expert_modules(ctx: _Ctx, src_prefix: str, fused_shared: bool) -> list[tuple[str, str, str]]:
    mods = [tuple(f"{src_prefix}mlp.experts.{e}.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
            for e in range(ctx.spec.E)]
    if fused_shared:
        mods.append(tuple(f"{src_prefix}mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")))
    return mods  # type: ignore[return-value]


def _experts(ctx: _Ctx, mods: list[tuple[str, str, str]], codec: LinearCodec, which: str, rank: int,
             cache: dict[str, Any], key: str) -> Iterator[torch.Tensor]:
    """Yields one expert at a time: [1, 2*I_loc, H] for w13, [1, H, I_loc] for w2."""
    il = ctx.spec.I // ctx.tp
    lo, hi = rank * il, (rank + 1) * il
    scales = []
    for gate, up, down in mods:
        if which == "w13":
            g = codec.read(ctx.src, gate, 0, lo, hi) if ctx.tp > 1 else codec.read(ctx.src, gate)
            u = codec.read(ctx.src, up, 0, lo, hi) if ctx.tp > 1 else codec.read(ctx.src, up)
            w = torch.cat([g.weight, u.weight], 0)
            s = None if g.scale is None else torch.cat([g.scale, u.scale], 0)  # type: ignore[list-item]
        else:
            d = codec.read(ctx.src, down, 1, lo, hi) if ctx.tp > 1 else codec.read(ctx.src, down)
            w, s = d.weight, d.scale
        if s is not None:
            w, s = to_target_fp8(w, s, ctx.target)
            scales.append(s.clone())  # a copy: a view would keep this expert's file pages mapped
        # bf16 experts are shuffled too (Ke = 8), unlike bf16 linears (spec §3.1).
        yield shuffle16(w).unsqueeze(0)
        ctx.src.release()  # unmap what this expert touched: RSS stays at one expert
    if scales:
        cache[key] = torch.stack(scales)


def _expert_scales(ctx: _Ctx, mods: list[tuple[str, str, str]], codec: LinearCodec, which: str, rank: int,
                   cache: dict[str, Any], key: str) -> Iterator[torch.Tensor]:
    s = cache.pop(key, None)
    if s is None:  # the weight was not produced first: read the scales alone
        s = torch.stack([target_scale(sc, ctx.target) for sc in _raw_expert_scales(ctx, mods, which, rank)])
    yield s


def _raw_expert_scales(ctx: _Ctx, mods: list[tuple[str, str, str]], which: str, rank: int) -> Iterator[torch.Tensor]:
    il = ctx.spec.I // ctx.tp
    b0, b1 = rank * il // FP8_BLOCK, cdiv((rank + 1) * il, FP8_BLOCK)
    for gate, up, down in mods:
        if which == "w13":
            yield torch.cat([ctx.src.get_rows(f"{m}.weight_scale_inv", b0, b1) for m in (gate, up)], 0)
        else:
            yield ctx.src.get_cols(f"{down}.weight_scale_inv", b0, b1)


def _plan_experts(ctx: _Ctx, src_prefix: str, out_prefix: str, fused_shared: bool) -> list[OutTensor]:
    s, tp = ctx.spec, ctx.tp
    mods = _expert_modules(ctx, src_prefix, fused_shared)
    codecs = {ctx.fmt.codec_for(m).name: ctx.fmt.codec_for(m) for trio in mods for m in trio}
    if len(codecs) > 1:
        raise UnsupportedError(
            f"{src_prefix}mlp.experts: experts are stored in different formats ({', '.join(codecs)}); ATOM stacks "
            f"them into one tensor of one format"
        )
    codec = next(iter(codecs.values()))
    for gate, up, down in mods:
        for m, (o, i) in ((gate, (s.I, s.H)), (up, (s.I, s.H)), (down, (s.H, s.I))):
            ctx.problems.extend(codec.check(ctx.src, m, o, i))
            ctx.consumed.update(codec.source_names(m))
    if s.I % tp:
        raise UnsupportedError(f"{src_prefix}mlp.experts: moe_intermediate_size {s.I} is not divisible by tp={tp}")
    il = s.I // tp
    if codec.quantized and il % FP8_BLOCK:
        raise UnsupportedError(
            f"{src_prefix}mlp.experts: fp8 MoE needs the per-rank intermediate size to be a multiple of 128 "
            f"(ATOM asserts it, spec §3.2); got {il} = {s.I}/tp{tp}"
        )
    if not (shuffle_requirements_met((2 * il, s.H)) and shuffle_requirements_met((s.H, il))):
        raise UnsupportedError(
            f"{src_prefix}mlp.experts: per-rank expert weights [{2 * il}, {s.H}] and [{s.H}, {il}] cannot take "
            f"ATOM's 16x16 shuffle (rows % 16, columns % 32, spec §3.0.3)"
        )
    n = len(mods)
    sources = tuple(x for trio in mods for m in trio for x in codec.source_names(m))
    dt = ctx.fp8 if codec.quantized else BF16
    base = ctx.profile.tensor(f"{out_prefix}mlp.experts.")
    outs = [
        OutTensor(base + "w13_weight", dt, (n, 2 * il, s.H), sources,
                  partial(_experts, ctx, mods, codec, "w13", key=base + "w13_scale"), is_shuffled=True),
    ]
    if codec.quantized:
        outs.append(OutTensor(base + "w13_weight_scale", torch.float32, (n, 2 * cdiv(il, FP8_BLOCK), cdiv(s.H, FP8_BLOCK)),
                              sources, partial(_expert_scales, ctx, mods, codec, "w13", key=base + "w13_scale")))
    outs.append(OutTensor(base + "w2_weight", dt, (n, s.H, il), sources,
                          partial(_experts, ctx, mods, codec, "w2", key=base + "w2_scale"), is_shuffled=True))
    if codec.quantized:
        outs.append(OutTensor(base + "w2_weight_scale", torch.float32, (n, cdiv(s.H, FP8_BLOCK), cdiv(il, FP8_BLOCK)),
                              sources, partial(_expert_scales, ctx, mods, codec, "w2", key=base + "w2_scale")))
    return outs


# --------------------------------------------------------------------------------------------
# Hook 2: MLA batched-GEMM operands from the processed kv_b_proj (spec §4.1)
# --------------------------------------------------------------------------------------------


def kv_b_bf16(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """What `get_and_maybe_dequant_weights(kv_b_proj)` returns: the bf16 weight itself, or
    bf16(fp8 value x block scale), rounded to nearest even (spec §4.1 step 1, §6.4)."""
    if scale is None:
        return w.to(BF16)
    return block_dequant(w, scale).to(BF16)


def mla_operands(wkvb: torch.Tensor, nr: int, P: int, V: int, L: int, fp8: torch.dtype) -> dict[str, torch.Tensor]:
    """W_K [Nr, L, P] and W_V [Nr, V, L] in fp8, each with one fp32 scalar scale (spec §4.1 steps 2-5)."""
    x = wkvb.view(nr, P + V, L)
    wk = x[:, :P, :].transpose(1, 2)  # W_K[n, l, p] = Wkvb[n(P+V)+p, l]
    wv = x[:, P:, :]  # W_V[n, v, l] = Wkvb[n(P+V)+P+v, l]
    qk, sk = per_tensor_quant(wk, fp8)
    qv, sv = per_tensor_quant(wv, fp8)
    return {"W_K": qk, "W_K_scale": sk, "W_V": qv, "W_V_scale": sv}


def _mla(ctx: _Ctx, src_prefix: str, codecs: list[LinearCodec], attr: str, rank: int,
         cache: dict[str, Any]) -> Iterator[torch.Tensor]:
    key = f"{src_prefix}mla"
    if key not in cache:
        d = _read_linear(ctx, KV_B, src_prefix, codecs, rank)
        s = ctx.spec
        cache[key] = mla_operands(kv_b_bf16(d.weight, d.scale), s.Nh // ctx.tp, s.P, s.V, s.L, ctx.fp8)
    yield cache[key].pop(attr)
    if not cache[key]:
        del cache[key]


def _plan_mla(ctx: _Ctx, src_prefix: str, out_prefix: str) -> list[OutTensor]:
    s = ctx.spec
    nr = s.Nh // ctx.tp
    codecs = [ctx.fmt.codec_for(src_prefix + p) for p in KV_B.parts]
    sources = tuple(codecs[0].source_names(src_prefix + KV_B.parts[0]))
    attn = f"{out_prefix}self_attn"
    shapes = {"W_K": ((nr, s.L, s.P), ctx.fp8), "W_K_scale": ((), torch.float32),
              "W_V": ((nr, s.V, s.L), ctx.fp8), "W_V_scale": ((), torch.float32)}
    return [OutTensor(ctx.profile.mla(attn, a), dt, shape, sources, partial(_mla, ctx, src_prefix, codecs, a))
            for a, (shape, dt) in shapes.items()]


# --------------------------------------------------------------------------------------------
# Layers and the whole model
# --------------------------------------------------------------------------------------------


def _plan_layer(ctx: _Ctx, i: int, src_prefix: str, out_prefix: str, plan: ModelPlan) -> list[OutTensor]:
    s = ctx.spec
    if s.Nh % ctx.tp:
        raise UnsupportedError(f"num_attention_heads {s.Nh} is not divisible by tp={ctx.tp} (ATOM asserts it, spec §4.3)")
    outs: list[OutTensor] = []
    for name, n in NORMS:
        length = n(s)
        if length is not None:
            outs += _plain(ctx, src_prefix + name, ctx.profile.tensor(out_prefix + name), (length,))
    for rule in ATTENTION:
        if rule.when(s):
            outs += _plan_linear(ctx, rule, src_prefix, out_prefix)
    outs += _plan_mla(ctx, src_prefix, out_prefix)
    if not s.is_moe_layer(i):
        for rule in DENSE_MLP:
            outs += _plan_linear(ctx, rule, src_prefix, out_prefix)
        return outs
    gate = f"{src_prefix}mlp.gate.weight"
    outs += _plain(ctx, gate, ctx.profile.tensor(f"{out_prefix}mlp.gate.weight"), (s.E, s.H))
    if s.has_correction_bias:
        bias = ctx.profile.tensor(f"{out_prefix}mlp.gate.e_score_correction_bias")
        outs += _plain(ctx, f"{src_prefix}mlp.gate.e_score_correction_bias", bias, (s.E,))
        # One Parameter under two names at run time (spec §2.4, §10).
        plan.aliases[ctx.profile.tensor(f"{out_prefix}mlp.experts.e_score_correction_bias")] = bias
    fused = False
    if s.S == 1:
        # HEAD fuses when shared and routed experts resolve to the same quant spec (spec §2.4).
        shared_codec = ctx.fmt.codec_for(f"{src_prefix}mlp.shared_experts.gate_proj")
        routed_codec = ctx.fmt.codec_for(f"{src_prefix}mlp.experts.0.gate_proj")
        fused = shared_codec.name == routed_codec.name
    outs += _plan_experts(ctx, src_prefix, out_prefix, fused)
    layer_key = out_prefix.rstrip(".")
    if fused:
        plan.moe_layers[layer_key] = "fused_shared_expert"  # slot E of w13/w2
    elif s.S:
        for rule in SHARED_MLP:
            outs += _plan_linear(ctx, rule, src_prefix, out_prefix)
        plan.moe_layers[layer_key] = "separate_shared_experts"  # mlp.shared_experts.{gate_up,down}_proj
    else:
        plan.moe_layers[layer_key] = "no_shared_experts"
    return outs


def _plan_mtp(ctx: _Ctx, j: int) -> ModelPlan:
    """The drafter's tensors (spec §2.6): decoder block under `mtp_block`, extras keep layer j's name."""
    s = ctx.spec
    src = f"model.layers.{j}."
    plan = ModelPlan(groups=[])
    outs: list[OutTensor] = []
    outs += _plain(ctx, f"{src}embed_tokens.weight", ctx.profile.tensor("model.embed_tokens.weight"),
                   (s.vocab, s.H), vocab=True, optional=True)
    for name in MTP_VECTORS:
        outs += _plain(ctx, src + name, ctx.profile.tensor(src + name), (s.H,))
    # eh_proj is bf16 at run time (HEAD excludes it unless the index has `eh_proj.weight_scale`,
    # which a DeepSeek fp8 checkpoint never has, spec §2.6); an fp8 source is dequantised.
    eh = f"{src}eh_proj"
    codec: LinearCodec = Fp8BlockLinear() if f"{eh}.weight_scale_inv" in ctx.src else Bf16Linear()
    ctx.problems.extend(codec.check(ctx.src, eh, s.H, 2 * s.H))
    ctx.consumed.update(codec.source_names(eh))
    outs.append(OutTensor(ctx.profile.tensor(f"{eh}.weight"), BF16, (s.H, 2 * s.H), tuple(codec.source_names(eh)),
                          partial(_dequant_whole, ctx, codec, eh)))
    outs += _plain(ctx, f"{src}shared_head.head.weight", ctx.profile.tensor(f"{src}shared_head.head.weight"),
                   (s.vocab, s.H), vocab=True, optional=True)
    plan.groups.append(Group(f"mtp.{j}.extras", outs))
    plan.groups.append(Group(f"mtp.{j}.block", _plan_layer(ctx, j, src, f"{src}mtp_block.", plan)))
    return plan


def _dequant_whole(ctx: _Ctx, codec: LinearCodec, module: str, rank: int, cache: dict[str, Any]) -> Iterator[torch.Tensor]:
    yield codec.dequant(codec.read(ctx.src, module)).to(BF16)


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekLoader(ArchLoader):
    """DeepseekV2ForCausalLM (V2, V2-Lite) and DeepseekV3ForCausalLM (V3, R1, Kimi-K2):
    ATOM builds all of them as its DeepseekV2ForCausalLM (spec §0)."""

    keys = (
        ("DeepseekV2ForCausalLM", "deepseek_v2"),
        ("DeepseekV3ForCausalLM", "deepseek_v3"),
        ("DeepseekV3ForCausalLM", "kimi_k2"),  # Kimi-K2: a DeepSeek-V3 config under its own model_type
    )

    def plan(self, src: SourceCheckpoint, spec: ModelSpec, fmt: SourceFormat, *, target: str, tp: int,
             profile: NamingProfile, mtp: bool) -> ConversionPlan:
        if tp < 1:
            raise BadInputError(f"tp must be >= 1, got {tp}")
        if spec.n_mtp > 1:
            raise UnsupportedError(f"num_nextn_predict_layers={spec.n_mtp}: only one MTP layer is supported (DeepSeek-V3/R1 have 1)")
        ctx = _Ctx(src, spec, fmt, target, tp, profile, problems=[], consumed=set())
        main = ModelPlan(groups=[])
        main.groups.append(Group("embed", _plain(ctx, "model.embed_tokens.weight", profile.tensor("model.embed_tokens.weight"),
                                                 (spec.vocab, spec.H), vocab=True)))
        for i in range(spec.n_layers):
            p = f"model.layers.{i}."
            main.groups.append(Group(f"layer.{i}", _plan_layer(ctx, i, p, p, main)))
        main.groups.append(Group("final", _plain(ctx, "model.norm.weight", profile.tensor("model.norm.weight"), (spec.H,))
                                 + _plain(ctx, "lm_head.weight", profile.tensor("lm_head.weight"),
                                          (spec.vocab, spec.H), vocab=True)))
        mtp_layers = range(spec.n_layers, spec.n_layers + spec.n_mtp)
        mtp_plan = None
        if mtp and spec.n_mtp:
            mtp_plan = _plan_mtp(ctx, spec.n_layers)
        dropped: dict[str, str] = {}
        for name in src.names():
            if name in ctx.consumed:
                continue
            m = _LAYER_RE.match(name)
            if m and int(m.group(1)) in mtp_layers and not mtp:
                dropped[name] = "MTP layer, dropped by --no-mtp (spec §2.6)"
                continue
            for pat, why in DROP_RULES:
                if pat.fullmatch(name):
                    dropped[name] = why
                    break
            else:
                info = src.info(name)
                ctx.problems.append(
                    f"{info.file}: unmapped tensor {name} ({info.dtype}, {list(info.shape)}): no rule for it in a "
                    f"{spec.architecture} ({spec.model_type}) checkpoint with {spec.n_layers} layers and "
                    f"{spec.n_mtp} MTP layer(s); remove it or check config.json"
                )
        if ctx.problems:
            raise CheckpointError(ctx.problems, hint="The source does not match its config.json; fix or re-download it.")
        return ConversionPlan(spec=spec, source_format=fmt.name, target=target, tp=tp, profile=profile, main=main,
                              mtp=mtp_plan, dropped=dropped, layout_flags=dict(LAYOUT_FLAGS, tp_size=tp))
