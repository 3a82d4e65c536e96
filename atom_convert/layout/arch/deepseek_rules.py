"""DeepSeek's declarative tables and the planning of one table row or plain tensor.

Per decoder layer, which source modules feed which runtime module and how tensor parallelism
splits them (spec §2, §5); `_Ctx`, what every producer needs; and the helpers that check a
source tensor and build its `OutTensor` (a plain float tensor, or a `LinearRule` through its
codec's post-load steps). The code hooks (deepseek_experts, deepseek_mla) and the layer and
model assembly (deepseek) build on these.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import Any, Callable, Iterator

import torch

from ...errors import UnsupportedError
from ..model import ModelSpec
from ..parallel import REPLICATED, Parallel, Split
from ..plan import OutTensor
from ..postload import LINEAR, TensorSpec
from ..profile import NamingProfile
from ..codecs.base import LinearCodec, LinearData, SourceFormat
from ..codecs.bf16 import FLOAT_DTYPES
from ...files.dtypes import FP8_DTYPE_BY_TARGET
from ...files.source import SourceCheckpoint

BF16 = torch.bfloat16


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
    # A family's extra attention modules, planned after the MLA operands of every decoder layer and
    # MTP block: attn_extras(ctx, src_prefix, out_prefix) (DeepSeek-V3.2's indexer, deepseek_v32.py).
    attn_extras: Callable[["_Ctx", str, str], list[OutTensor]] | None = None
    # The embeddings (main and MTP drafter) whole on every rank, not vocab-parallel (GLM, atom-layout-next.md §2.2).
    embed_replicated: bool = False

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
