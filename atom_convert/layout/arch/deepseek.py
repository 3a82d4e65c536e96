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

from ...errors import BadInputError, CheckpointError, ConfigError, UnsupportedError
from ..model import ModelSpec
from ..parallel import REPLICATED, Parallel, Split
from ..plan import ConversionPlan, Group, ModelPlan, OutTensor
from ..postload import LINEAR, MOE, TensorSpec
from ..profile import NATIVE_MLA_OWNER, NamingProfile
from ..codecs.base import LinearCodec, LinearData, SourceFormat
from ..codecs.bf16 import FLOAT_DTYPES, Bf16Linear
from ...files.dtypes import FP8_DTYPE_BY_TARGET
from ..codecs.fp8_block import identity_readback
from ..codecs.mxfp4 import MXFP4_BLOCK, dynamic_mxfp4_quant
from ..codecs.per_tensor import per_tensor_quant
from ...files.source import SourceCheckpoint
from .base import ArchLoader

BF16 = torch.bfloat16

# ATOM's layout flags and their defaults at the layout's ATOM revision (atom/utils/envs.py; spec
# §6.2). A conversion records the values it assumed (the defaults, but ATOM_USE_TRITON_MXFP4_BMM
# under --mla-bmm mxfp4) so that a runtime with other flags refuses the files (spec §8.10); a
# runtime's unset flag counts with its default here (runtime/common.live_flags).
ATOM_FLAG_DEFAULTS: dict[str, int] = {
    "ATOM_FP8_BLOCKSCALE_WEIGHT_PRESHUFFLE": 1,
    "ATOM_FP8_BLOCKSCALE_USE_E8M0_SCALE": 0,
    "ATOM_USE_TRITON_GEMM": 0,
    "ATOM_USE_FP4_NON_SHUFFLE_TRITON_GEMM": 0,
    "ATOM_USE_TRITON_MXFP4_BMM": 0,
    "ATOM_MOE_GU_ITLV": 0,
    "ATOM_FUSE_SHARED_EXPERT": 1,
}
# The manifest's flags: the ATOM_* values plus the config's MoE backend. Expert parallel and the
# tensor-parallel size are facts of the manifest's `parallel` record, stated once there.
LAYOUT_FLAGS: dict[str, Any] = {**ATOM_FLAG_DEFAULTS, "moe_backend": "standard"}

# The rounding of the MXFP4 MLA operands (spec §10.1): pinned per layout revision.
MXFP4_ROUNDING = "aiter e4048607a triton dynamic_mxfp4_quant: e8m0 from amax rounded up, e2m1 half to even, -0 kept"

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

EH_PROJ = LinearRule("eh_proj", ("eh_proj",), Par.REPLICATED, lambda s: ((s.H, 2 * s.H),))

# MTP extras beside the decoder block (spec §2.6).
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
    mla_bmm: str = "fp8"
    par: Parallel = Parallel()  # `tp` above is its attn_tp: the aiter TP group of everything but routed experts

    def split(self, kind: str, dim: int = 0) -> Split:
        """A non-expert tensor cut in `tp` pieces (replicated when tp is 1)."""
        return Split(kind, self.tp, dim) if self.tp > 1 else REPLICATED

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


_CHUNK_BYTES = 64 << 20


def _rows_in_chunks(ctx: _Ctx, name: str, lo: int, hi: int) -> Iterator[torch.Tensor]:
    """Rows [lo, hi) in pieces of at most 64 MB: an embedding is 1.85 GB (V3), and one view of it
    all would keep all of it resident. A bf16 source piece is yielded as the view itself (the
    writer copies it into the file; its pages leave the resident set when the write is done and
    the view goes, source.py): no torch copy for the 3.7 GB of V3's embedding and lm_head."""
    info = ctx.src.info(name)
    row = max(1, info.nbytes // max(1, info.shape[0]))
    step = max(1, _CHUNK_BYTES // row)
    for a in range(lo, hi, step):
        chunk = ctx.src.get_rows(name, a, min(hi, a + step)).to(BF16)
        yield chunk
        del chunk


def _whole(ctx: _Ctx, name: str, rank: int, cache: dict[str, Any]) -> Iterator[torch.Tensor]:
    shape = ctx.src.info(name).shape
    if len(shape) < 2:
        yield ctx.src.get(name).to(BF16, copy=True)
        return
    yield from _rows_in_chunks(ctx, name, 0, shape[0])


def _vocab_rows(ctx: _Ctx, name: str, rank: int, cache: dict[str, Any]) -> Iterator[torch.Tensor]:
    n = ctx.src.info(name).shape[0] // ctx.tp
    yield from _rows_in_chunks(ctx, name, rank * n, (rank + 1) * n)


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
        return [OutTensor(out_name, BF16, local, (src_name,), partial(_vocab_rows, ctx, src_name), split=ctx.split("dim"),
                          chunk_bytes=_CHUNK_BYTES)]
    return [OutTensor(out_name, BF16, shape, (src_name,), partial(_whole, ctx, src_name),
                      chunk_bytes=_CHUNK_BYTES if len(shape) > 1 else 0)]


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
            f"into one parameter of one format. Quantize all parts or none (check the exclude/ignore list)."
        )
    for part, (o, i) in zip(rule.parts, dims):
        if rule.par is Par.COLUMN and o % tp:
            raise UnsupportedError(f"{src_prefix + part}: {o} output rows are not divisible by tp={tp}")
        if rule.par is Par.ROW and i % tp:
            raise UnsupportedError(f"{src_prefix + part}: {i} input columns are not divisible by tp={tp}")
    rows = [_local_rows(rule.par, o, tp) for o, _ in dims]
    cols = dims[0][1] // tp if rule.par is Par.ROW else dims[0][1]
    LINEAR[codecs[0].name].check(src_prefix + rule.out, rows, cols, rule.par is Par.COLUMN and tp > 1,
                                 rule.par is Par.ROW and tp > 1, tp, [src_prefix + p for p in rule.parts])


def _read_linear(ctx: _Ctx, rule: LinearRule, src_prefix: str, codecs: list[LinearCodec], rank: int) -> LinearData:
    """The rank's slice of every part, concatenated in row order, as stored in the source."""
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
    s = (torch.cat(ss, 0) if len(ss) > 1 else ss[0]) if ss else None
    return LinearData(w, s)


def _linear_weight(ctx: _Ctx, rule: LinearRule, src_prefix: str, out_name: str, codecs: list[LinearCodec],
                   rank: int, cache: dict[str, Any]) -> Iterator[torch.Tensor]:
    d = _read_linear(ctx, rule, src_prefix, codecs, rank)
    w, s = LINEAR[codecs[0].name].apply(d.weight, d.scale, ctx.target)
    if s is not None:
        cache[out_name + "_scale"] = s.clone()
    yield w


def _linear_scale(ctx: _Ctx, rule: LinearRule, src_prefix: str, codecs: list[LinearCodec], rank: int,
                  cache: dict[str, Any], key: str) -> Iterator[torch.Tensor]:
    s = cache.pop(key, None)
    if s is None:
        d = _read_linear(ctx, rule, src_prefix, codecs, rank)
        s = LINEAR[codecs[0].name].apply(d.weight, d.scale, ctx.target)[1]
    yield s


def _plan_linear(ctx: _Ctx, rule: LinearRule, src_prefix: str, out_prefix: str,
                 codecs: list[LinearCodec] | None = None) -> list[OutTensor]:
    codecs = codecs or [ctx.fmt.codec_for(src_prefix + p) for p in rule.parts]
    _check_linear(ctx, rule, src_prefix, codecs)
    tp, dims = ctx.tp, rule.dims(ctx.spec)
    rows = [_local_rows(rule.par, o, tp) for o, _ in dims]
    cols = dims[0][1] // tp if rule.par is Par.ROW else dims[0][1]
    sources = tuple(n for p, c in zip(rule.parts, codecs) for n in c.source_names(src_prefix + p))
    wname = f"{out_prefix}{rule.out}.weight"
    wspec, sspec = LINEAR[codecs[0].name].plan(rows, cols, ctx.target)
    split = REPLICATED if rule.par is Par.REPLICATED else ctx.split("dim", 0 if rule.par is Par.COLUMN else 1)
    outs = [_out(wname, wspec, sources, partial(_linear_weight, ctx, rule, src_prefix, wname, codecs), split)]
    if sspec is not None:
        sname = f"{out_prefix}{rule.out}.weight_scale"
        outs.append(_out(sname, sspec, sources, partial(_linear_scale, ctx, rule, src_prefix, codecs, key=wname + "_scale"),
                         split))
    return outs


def _out(name: str, spec: TensorSpec, sources: tuple[str, ...], produce: Any, split: Split = REPLICATED,
         rank_sources: list[tuple[str, ...]] | None = None) -> OutTensor:
    return OutTensor(name, spec.dtype, spec.shape, sources, produce, is_shuffled=spec.shuffled,
                     runtime_dtype=spec.runtime_dtype, meta=dict(spec.meta), split=split, rank_sources=rank_sources)


# --------------------------------------------------------------------------------------------
# Hook 1: routed experts stacked into w13/w2, the single shared expert as slot E (spec §2.4, §3.2)
# --------------------------------------------------------------------------------------------


def _expert_modules(ctx: _Ctx, src_prefix: str, fused_shared: bool) -> list[tuple[str, str, str]]:
    mods = [tuple(f"{src_prefix}mlp.experts.{e}.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
            for e in range(ctx.spec.E)]
    if fused_shared:
        mods.append(tuple(f"{src_prefix}mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")))
    return mods  # type: ignore[return-value]


def _read_expert(ctx: _Ctx, codec: LinearCodec, module: str, axis: int, rank: int) -> LinearData:
    """The rank's cut of one expert: I split over the MoE-TP ranks (none under EP, spec
    atom-parallel.md §1.1; flattened over every GPU under DP-attention, §2.2)."""
    mtp = ctx.par.moe_tp
    il = ctx.spec.I // mtp
    defer = MOE[codec.name].scans_values(ctx.target)  # the post-load finds bad values itself (postload.py)
    if mtp == 1:
        return codec.read(ctx.src, module, defer_check=defer)
    piece = rank % mtp
    return codec.read(ctx.src, module, axis, piece * il, (piece + 1) * il, defer_check=defer)


def _rank_modules(mods: list[tuple[str, str, str]], slots: list[list[int]], rank: int) -> list[tuple[str, str, str]]:
    return [mods[e] for e in slots[rank]]


def _experts(ctx: _Ctx, mods: list[tuple[str, str, str]], codec: LinearCodec, which: str, rank: int,
             cache: dict[str, Any], key: str, slots: list[list[int]] | None = None,
             part: tuple[int, int] | None = None) -> Iterator[torch.Tensor]:
    """Yields one expert at a time ([1, 2N, K] for w13, [1, H, N] for w2) and stacks the
    scales for the `_scale` output. `slots[rank]`: the indices into `mods` the rank holds;
    `part`: only the rank's local experts [a, b) (plan.OutTensor.units)."""
    post = MOE[codec.name]
    scales = []
    local = mods if slots is None else _rank_modules(mods, slots, rank)
    for gate, up, down in (local if part is None else local[part[0]:part[1]]):
        if which == "w13":
            w, s = post.w13(_read_expert(ctx, codec, gate, 0, rank), _read_expert(ctx, codec, up, 0, rank), ctx.target)
        else:
            w, s = post.w2(_read_expert(ctx, codec, down, 1, rank), ctx.target)
        if s is not None:
            scales.append(s)
        yield w.unsqueeze(0)
        del w  # the expert's source views are gone: their pages leave the resident set (source.py)
    if scales:
        cache[key] = scales


def _expert_scales(ctx: _Ctx, mods: list[tuple[str, str, str]], codec: LinearCodec, which: str, rank: int,
                   cache: dict[str, Any], key: str, stacked: bool,
                   slots: list[list[int]] | None = None, part: tuple[int, int] | None = None) -> Iterator[torch.Tensor]:
    scales = cache.pop(key, None)  # the same item produced the weight of the same experts just before
    if scales is None:  # the weight was not produced first: compute the scales again
        scales = []
        for chunk in _experts(ctx, mods, codec, which, rank, cache, key, slots, part):
            del chunk
        scales = cache.pop(key)
    # fp8: [E, rows, cols] stacked; MXFP4: the 2-D [E*N, K/32] tensor, one expert's rows after another.
    yield torch.stack(scales) if stacked else torch.cat(scales, 0)


def _unit_sources(mods: list[tuple[str, str, str]], codec: LinearCodec, slots: list[list[int]] | None, rank: int,
                  unit: int) -> tuple[str, ...]:
    """The source tensors of the rank's local expert `unit` (its gate, up and down projections)."""
    trio = mods[unit] if slots is None else mods[slots[rank][unit]]
    return tuple(x for m in trio for x in codec.source_names(m))


def _plan_experts(ctx: _Ctx, src_prefix: str, out_prefix: str, fused_shared: bool) -> list[OutTensor]:
    s, tp = ctx.spec, ctx.par.moe_tp
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
        raise UnsupportedError(f"{src_prefix}mlp.experts: moe_intermediate_size {s.I} is not divisible by the "
                               f"MoE tensor-parallel size {tp}")
    il = s.I // tp
    post = MOE[codec.name]
    post.check(f"{src_prefix}mlp.experts", il, s.H, tp)
    sources = tuple(x for trio in mods for m in trio for x in codec.source_names(m))
    slots: list[list[int]] | None = None
    rank_sources = None
    if ctx.par.ep:  # whole experts in contiguous blocks, the shared one in the last slot (spec atom-parallel.md §1.2)
        slots = [r.slots for r in ctx.par.rank_layouts(s.E, s.S, fused_shared)]
        rank_sources = [tuple(x for e in sl for m in mods[e] for x in codec.source_names(m)) for sl in slots]
    n_local = len(mods) if slots is None else len(slots[0])
    base = f"{out_prefix}mlp.experts."
    specs = post.plan(n_local, il, s.H, ctx.target)
    split = Split("experts", tp)
    outs = []
    for which in ("w13", "w2"):
        key = f"{base}{which}_scale"
        w = _out(f"{base}{which}_weight", specs[f"{which}_weight"], sources,
                 partial(_experts, ctx, mods, codec, which, key=key, slots=slots), split, rank_sources)
        w.chunk_bytes = w.nbytes // max(1, w.shape[0])  # one expert at a time
        w.units = n_local
        w.unit_sources = partial(_unit_sources, mods, codec, slots)
        outs.append(w)
        sspec = specs.get(f"{which}_weight_scale")
        if sspec is not None:
            outs.append(_out(f"{base}{which}_weight_scale", sspec, sources,
                             partial(_expert_scales, ctx, mods, codec, which, key=key, stacked=len(sspec.shape) == 3,
                                     slots=slots), split, rank_sources))
            outs[-1].units = n_local
            outs[-1].unit_sources = w.unit_sources
    return outs


# --------------------------------------------------------------------------------------------
# Hook 2: MLA batched-GEMM operands from the processed kv_b_proj (spec §4.1)
# --------------------------------------------------------------------------------------------


def kv_b_bf16(codec: LinearCodec, data: LinearData, target_fp8: torch.dtype) -> torch.Tensor:
    """What `get_and_maybe_dequant_weights(kv_b_proj)` returns (spec §4.1 step 1, §6.4): the bf16
    weight itself; for a DeepSeek fp8 one, the processed layer's blockscale GEMM against an
    identity (`identity_readback`: the kernel's epilogue, not a plain bf16(value x scale), which
    differs in rare ulps); an MXFP4 value is exact in bf16."""
    if codec.name == "fp8-block":
        assert data.scale is not None
        return identity_readback(data.weight, data.scale, target_fp8)
    return codec.dequant(data).to(BF16)


def mla_operands(wkvb: torch.Tensor, nr: int, P: int, V: int, L: int, fp8: torch.dtype,
                 bmm: str = "fp8") -> dict[str, torch.Tensor]:
    """W_K and W_V from the rank's kv_b [Nr(P+V), L] in bf16.

    bmm "fp8" (default, spec §4.1): W_K [Nr, L, P], W_V [Nr, V, L] in fp8, one fp32 scalar scale each.
    bmm "mxfp4" (ATOM_USE_TRITON_MXFP4_BMM=1, spec §4.2): W_K [Nr, L, P/2] quantised along P,
    W_V [Nr, V, L/2] along L, uint8 packed e2m1 with plain row-major e8m0 scales (not shuffled).
    """
    x = wkvb.view(nr, P + V, L)
    wk = x[:, :P, :].transpose(1, 2)  # W_K[n, l, p] = Wkvb[n(P+V)+p, l]
    wv = x[:, P:, :]  # W_V[n, v, l] = Wkvb[n(P+V)+P+v, l]
    if bmm == "mxfp4":
        qk, sk = dynamic_mxfp4_quant(wk.contiguous())
        qv, sv = dynamic_mxfp4_quant(wv.contiguous())
        return {"W_K": qk, "W_K_scale": sk, "W_V": qv, "W_V_scale": sv}
    qk, sk = per_tensor_quant(wk, fp8)
    qv, sv = per_tensor_quant(wv, fp8)
    return {"W_K": qk, "W_K_scale": sk, "W_V": qv, "W_V_scale": sv}


def _mla(ctx: _Ctx, src_prefix: str, codecs: list[LinearCodec], attr: str, rank: int,
         cache: dict[str, Any]) -> Iterator[torch.Tensor]:
    key = f"{src_prefix}mla"
    if key not in cache:
        d = _read_linear(ctx, KV_B, src_prefix, codecs, rank)
        s = ctx.spec
        cache[key] = mla_operands(kv_b_bf16(codecs[0], d, ctx.fp8), s.Nh // ctx.tp, s.P, s.V, s.L, ctx.fp8, ctx.mla_bmm)
    yield cache[key].pop(attr)
    if not cache[key]:
        del cache[key]


def _plan_mla(ctx: _Ctx, src_prefix: str, out_prefix: str) -> list[OutTensor]:
    s = ctx.spec
    nr = s.Nh // ctx.tp
    codecs = [ctx.fmt.codec_for(src_prefix + p) for p in KV_B.parts]
    sources = tuple(codecs[0].source_names(src_prefix + KV_B.parts[0]))
    attn = f"{out_prefix}self_attn"
    if ctx.mla_bmm == "mxfp4":
        if s.P % MXFP4_BLOCK or s.L % MXFP4_BLOCK:
            raise UnsupportedError(f"--mla-bmm mxfp4 needs qk_nope_head_dim ({s.P}) and kv_lora_rank ({s.L}) to be "
                                   f"multiples of 32 (spec §4.2)")
        # ATOM holds the packed e2m1 pairs as uint8 here, not as float4_e2m1fn_x2 (b_dynamic_mxfp4_quant,
        # atom/model_ops/utils.py 191-194, over aiter's dynamic_mxfp4_quant)
        specs = {"W_K": TensorSpec(torch.uint8, (nr, s.L, s.P // 2), runtime_dtype="uint8"),
                 "W_K_scale": TensorSpec(torch.uint8, (nr, s.L, s.P // MXFP4_BLOCK), runtime_dtype="uint8"),
                 "W_V": TensorSpec(torch.uint8, (nr, s.V, s.L // 2), runtime_dtype="uint8"),
                 "W_V_scale": TensorSpec(torch.uint8, (nr, s.V, s.L // MXFP4_BLOCK), runtime_dtype="uint8")}
        rounding = {"rounding": MXFP4_ROUNDING}
        specs = {k: TensorSpec(v.dtype, v.shape, runtime_dtype=v.runtime_dtype, meta=rounding) for k, v in specs.items()}
    else:
        specs = {"W_K": TensorSpec(ctx.fp8, (nr, s.L, s.P)), "W_K_scale": TensorSpec(torch.float32, ()),
                 "W_V": TensorSpec(ctx.fp8, (nr, s.V, s.L)), "W_V_scale": TensorSpec(torch.float32, ())}
    # Per rank, from the rank's kv_b heads; one piece (identical on every rank) under DP-attention (spec
    # atom-parallel.md §2.2: the per-tensor scale is then taken over all heads).
    return [_out(f"{attn}.{NATIVE_MLA_OWNER}.{a}", spec, sources, partial(_mla, ctx, src_prefix, codecs, a), ctx.split("heads"))
            for a, spec in specs.items()]


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
            outs += _plain(ctx, src_prefix + name, out_prefix + name, (length,))
    if s.Q is not None and ctx.fmt.codec_for(src_prefix + "self_attn.q_a_proj").name == "mxfp4":
        # HEAD keeps a static-MXFP4 fused_qkv_a_proj's quant config for q_b_proj and kv_b_proj too
        # (spec §2.2); a bf16 one of them would be loaded into an MXFP4 parameter.
        for part in ("self_attn.q_b_proj", "self_attn.kv_b_proj"):
            if ctx.fmt.codec_for(src_prefix + part).name != "mxfp4":
                raise UnsupportedError(
                    f"{src_prefix}self_attn: q_a_proj is MXFP4 but {part.split('.')[-1]} is "
                    f"{ctx.fmt.codec_for(src_prefix + part).name} in the Quark config; ATOM then builds "
                    f"q_b_proj and kv_b_proj as MXFP4 (spec §2.2) and cannot load this layer"
                )
    for rule in ATTENTION:
        if rule.when(s):
            outs += _plan_linear(ctx, rule, src_prefix, out_prefix)
    outs += _plan_mla(ctx, src_prefix, out_prefix)
    if not s.is_moe_layer(i):
        for rule in DENSE_MLP:
            outs += _plan_linear(ctx, rule, src_prefix, out_prefix)
        return outs
    gate = f"{src_prefix}mlp.gate.weight"
    outs += _plain(ctx, gate, f"{out_prefix}mlp.gate.weight", (s.E, s.H))
    if s.has_correction_bias:
        bias = f"{out_prefix}mlp.gate.e_score_correction_bias"
        outs += _plain(ctx, f"{src_prefix}mlp.gate.e_score_correction_bias", bias, (s.E,))
        # One Parameter under two names at run time (spec §2.4, §10).
        plan.aliases[f"{out_prefix}mlp.experts.e_score_correction_bias"] = bias
    fused = False
    if s.S == 1:
        # HEAD fuses when shared and routed experts resolve to the same quant spec (spec §2.4).
        shared_codec = ctx.fmt.codec_for(f"{src_prefix}mlp.shared_experts.gate_proj")
        routed_codec = ctx.fmt.codec_for(f"{src_prefix}mlp.experts.0.gate_proj")
        # ATOM_FUSE_SHARED_EXPERT=0 turns fusion off under DP-attention with mori (spec atom-parallel.md §3.2).
        fused = shared_codec.name == routed_codec.name and ctx.par.fusion_allowed
        if fused and ctx.par.all2all and routed_codec.name != "mxfp4":
            # LOCAL_REPLICA: wired for the MXFP4 MoE method only (spec atom-parallel.md §1.2, §3.3).
            raise UnsupportedError(
                f"{src_prefix}mlp.experts: --dp-attention --ep with mori importable (--mori) and the shared expert "
                f"fused makes ATOM build its LOCAL_REPLICA layout, which raises NotImplementedError for a "
                f"{routed_codec.name} MoE (moe.py:2908-2914, spec atom-parallel.md §3.3). Add --shared-experts "
                f"separate (serve with ATOM_FUSE_SHARED_EXPERT=0), or drop --mori if mori is not installed there"
            )
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
    outs += _plain(ctx, f"{src}embed_tokens.weight", "model.embed_tokens.weight",
                   (s.vocab, s.H), vocab=True, optional=True)
    for name in MTP_VECTORS:
        outs += _plain(ctx, src + name, src + name, (s.H,))
    # eh_proj: a replicated linear (HEAD). It is bf16 unless the index has a key ending in
    # `eh_proj.weight_scale` (spec §2.6): a DeepSeek fp8 one (`weight_scale_inv`) never does, so
    # ATOM holds it in bf16 and an fp8 source is dequantised; a Quark MXFP4 one stays MXFP4.
    eh = f"{src}eh_proj"
    codec = ctx.fmt.codec_for(eh)
    if codec.name == "fp8-block" and f"{eh}.weight_scale_inv" in ctx.src:
        ctx.problems.extend(codec.check(ctx.src, eh, s.H, 2 * s.H))
        ctx.consumed.update(codec.source_names(eh))
        outs.append(OutTensor(f"{eh}.weight", BF16, (s.H, 2 * s.H), tuple(codec.source_names(eh)),
                              partial(_dequant_whole, ctx, codec, eh)))
    else:
        if codec.name == "fp8-block":  # stored in bf16 although the config would quantize it
            codec = Bf16Linear()
        outs += _plan_linear(ctx, EH_PROJ, src, src, [codec])
    outs += _plain(ctx, f"{src}shared_head.head.weight", f"{src}shared_head.head.weight",
                   (s.vocab, s.H), vocab=True, optional=True)
    plan.groups.append(Group(f"mtp.{j}.extras", outs))
    plan.groups.append(Group(f"mtp.{j}.block", _plan_layer(ctx, j, src, f"{src}mtp_block.", plan)))
    return plan


def _dequant_whole(ctx: _Ctx, codec: LinearCodec, module: str, rank: int, cache: dict[str, Any]) -> Iterator[torch.Tensor]:
    yield codec.dequant(codec.read(ctx.src, module)).to(BF16)


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


def _first_absent(have: set[int]) -> int:
    i = 0
    while i in have:
        i += 1
    return i


def _check_counts(src: SourceCheckpoint, spec: ModelSpec) -> None:
    """num_hidden_layers and n_routed_experts against what the files hold, before any
    per-tensor check: a wrong count is one line naming the key, not one line per missing
    tensor (and a count like 1e9 is refused at once instead of being iterated)."""
    where = src.path / "config.json"
    layers, experts = set(), set()
    for name in src.names():
        if m := _LAYER_RE.match(name):
            layers.add(int(m.group(1)))
        if m := _EXPERT_RE.match(name):
            experts.add(int(m.group(1)))
    have = {i for i in layers if i < spec.n_layers}
    if len(have) < spec.n_layers:
        first = _first_absent(have)
        raise ConfigError(f"{where}: num_hidden_layers is {spec.n_layers}, but the checkpoint holds no tensor of "
                          f"layer {first} ({spec.n_layers - len(have)} of the {spec.n_layers} layers have none: "
                          f"model.layers.{first}.* is absent)",
                          hint="Fix num_hidden_layers, or download the shards that hold the missing layers.")
    have_e = {e for e in experts if e < spec.E}
    if spec.E and len(have_e) < spec.E and spec.E > max(experts, default=-1) + 1:
        raise ConfigError(f"{where}: n_routed_experts is {spec.E}, but the checkpoint holds experts "
                          f"{'0..' + str(max(experts)) if experts else 'none'} (no mlp.experts.{_first_absent(have_e)}.* "
                          f"tensor in any layer)",
                          hint="Fix n_routed_experts, or download the shards that hold the missing experts.")


class DeepseekLoader(ArchLoader):
    """DeepseekV2ForCausalLM (V2, V2-Lite) and DeepseekV3ForCausalLM (V3, R1, Kimi-K2):
    ATOM builds all of them as its DeepseekV2ForCausalLM (spec §0)."""

    keys = (
        ("DeepseekV2ForCausalLM", "deepseek_v2"),
        ("DeepseekV3ForCausalLM", "deepseek_v3"),
        ("DeepseekV3ForCausalLM", "kimi_k2"),  # Kimi-K2: a DeepSeek-V3 config under its own model_type
    )

    def plan(self, src: SourceCheckpoint, spec: ModelSpec, fmt: SourceFormat, *, target: str, tp: int,
             profile: NamingProfile, mtp: bool, mla_bmm: str = "fp8", parallel: Parallel | None = None) -> ConversionPlan:
        if tp < 1:
            raise BadInputError(f"tp must be >= 1, got {tp}")
        _check_counts(src, spec)
        par = parallel or Parallel(tp=tp)
        if par.tp != tp:
            raise BadInputError(f"internal: tp={tp} but the parallel layout says tp={par.tp}")
        par.validate()
        par.check_experts(spec.E, str(src.path / "config.json"))
        if mla_bmm not in ("fp8", "mxfp4"):
            raise BadInputError(f"--mla-bmm must be fp8 or mxfp4, got {mla_bmm!r}")
        if mla_bmm == "mxfp4" and target != "gfx950":
            raise UnsupportedError(
                f"--mla-bmm mxfp4 (ATOM_USE_TRITON_MXFP4_BMM=1) is gfx950-only in ATOM (spec §4.2); target is {target}"
            )
        if fmt.name == "quark-mxfp4" and target != "gfx950":
            raise UnsupportedError(
                f"MXFP4 checkpoints convert for gfx950 only: on {target} ATOM runs MXFP4 MoE through its triton "
                f"path with transposed views and a different scale layout (spec §3.3.2, §6), which atom-convert "
                f"does not produce"
            )
        if spec.n_mtp > 1:
            raise UnsupportedError(f"num_nextn_predict_layers={spec.n_mtp}: only one MTP layer is supported (DeepSeek-V3/R1 have 1)")
        ctx = _Ctx(src, spec, fmt, target, par.attn_tp, profile, problems=[], consumed=set(), mla_bmm=mla_bmm, par=par)
        main = ModelPlan(groups=[])
        main.groups.append(Group("embed", _plain(ctx, "model.embed_tokens.weight", ("model.embed_tokens.weight"),
                                                 (spec.vocab, spec.H), vocab=True)))
        for i in range(spec.n_layers):
            p = f"model.layers.{i}."
            main.groups.append(Group(f"layer.{i}", _plan_layer(ctx, i, p, p, main)))
        main.groups.append(Group("final", _plain(ctx, "model.norm.weight", ("model.norm.weight"), (spec.H,))
                                 + _plain(ctx, "lm_head.weight", ("lm_head.weight"),
                                          (spec.vocab, spec.H), vocab=True)))
        mtp_layers = range(spec.n_layers, spec.n_layers + spec.n_mtp)
        mtp_plan = None
        mtp_status = "absent"
        if spec.n_mtp:
            # Some redistributions of V3/R1 strip the MTP layer but keep num_nextn_predict_layers.
            present = any(n.startswith(f"model.layers.{spec.n_layers}.") for n in src.names())
            mtp_status = "not in the checkpoint" if not present else "converted" if mtp else "dropped by --no-mtp"
            if mtp and present:
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
                              mtp=mtp_plan, mtp_status=mtp_status, dropped=dropped,
                              layout_flags=dict(LAYOUT_FLAGS, ATOM_USE_TRITON_MXFP4_BMM=int(mla_bmm == "mxfp4"),
                                                ATOM_FUSE_SHARED_EXPERT=int(par.shared_experts == "fused")),
                              parallel=par)
