"""DeepSeek's expert hook: routed experts stacked into w13/w2, the single shared expert as
slot E (spec §2.4, §3.2), cut per rank by MoE-TP or expert parallel (spec atom-parallel.md)."""

from __future__ import annotations

from functools import partial
from typing import Any, Iterator

import torch

from ...errors import UnsupportedError
from ..parallel import Split
from ..plan import OutTensor
from ..postload import MOE
from ..codecs.base import LinearCodec, LinearData
from .deepseek_rules import _Ctx, _out


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
        if hasattr(codec, "scratch_bytes"):  # --quantize: the exact fp32 values and quantiser temporaries
            w.chunk_bytes = max(w.chunk_bytes, codec.scratch_bytes(il, s.H))
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

