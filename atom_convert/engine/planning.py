"""Planning a conversion without writing: the plan of `src` for an options value (`make_plan`), its
shards per rank (`layout_shards`), their names (`planned_shards`, part of the journal's header) and the
dry-run summary (`plan_summary`: `atom-convert convert --dry-run`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..files.source import SourceCheckpoint
from ..layout import arch as loaders
from ..layout import codecs as quant
from ..layout.codecs.requant import RequantFormat, served_format
from ..layout.model import ModelSpec
from ..layout.options import ConversionOptions
from ..layout.plan import COMMON, ConversionPlan, ModelPlan, ShardPlan, apply_profile, assign_shards
from ..layout.profile import get_profile
from .writer import header_digest

MTP_DIR = "mtp"


@dataclass
class SetLayout:
    """One converted set (main or MTP): its plan and each rank's shards."""

    plan: ModelPlan
    shards: list[list[ShardPlan]]  # per rank: the rank's own files
    common: list[ShardPlan]  # files every rank maps (tensors identical on every rank, spec atom-parallel.md §3.1)


def make_plan(src: SourceCheckpoint, options: ConversionOptions | None = None, **kw: Any) -> ConversionPlan:
    """The conversion plan of `src` for `options` (or the same fields as keywords)."""
    opts = ConversionOptions.build(options, **kw)
    spec = ModelSpec.from_config(src.config, where=str(src.path / "config.json"))
    where = str(src.path / "config.json")
    fmt = served_format(quant.detect_format(src.config, where=where), opts.quantize, opts.target, where)
    loader = loaders.get_loader(spec)
    prof = get_profile(opts.profile)
    plan = loader.plan(src, spec, fmt, target=opts.target, tp=opts.tp, profile=prof, mtp=opts.mtp,
                       mla_bmm=opts.mla_bmm, parallel=opts.parallel())
    apply_profile(plan, prof)  # the one renaming step: loaders plan with ATOM-native names
    if isinstance(fmt, RequantFormat):
        plan.requant = fmt.record()
    return plan


def _set_layout(plan: ConversionPlan, mplan: ModelPlan, shard_size: int) -> SetLayout:
    outs = mplan.outputs()
    common = [o for o in outs if plan.is_common(o)]
    own = [o for o in outs if not plan.is_common(o)]
    shards = [assign_shards(own, r, plan.tp, shard_size) if own else [] for r in range(plan.tp)]
    return SetLayout(mplan, shards, assign_shards(common, COMMON, plan.tp, shard_size) if common else [])


def layout_shards(plan: ConversionPlan, shard_size: int) -> tuple[SetLayout, SetLayout | None]:
    main = _set_layout(plan, plan.main, shard_size)
    mtp = _set_layout(plan, plan.mtp, shard_size) if plan.mtp is not None else None
    return main, mtp


def planned_shards(main: SetLayout, mtp: SetLayout | None) -> dict[str, str]:
    """Every shard's path relative to DST -> the digest of its header (what the journal checks)."""
    planned = {}
    for lay, prefix in ((main, ""), (mtp, f"{MTP_DIR}/")):
        if lay is None:
            continue
        by_name = {o.name: o for o in lay.plan.outputs()}
        for shards in lay.shards + [lay.common]:
            for sp in shards:
                planned[prefix + sp.file] = header_digest(sp, by_name)
    return planned


def plan_summary(src: str | os.PathLike[str] | SourceCheckpoint, target: str | None = None, *,
                 options: ConversionOptions | None = None, revision: str | None = None, **kw: Any) -> dict[str, Any]:
    """The dry-run plan: every output tensor with dtype, shape, bytes and file per rank (a common
    tensor appears once, as rank "common"), and the parallel block; reads no tensor data (for a Hub
    repo: its configs, index and shard headers only). `src` may be an open SourceCheckpoint (its
    header index is then reused, and it stays open). `options` (or its fields as keywords)."""
    opts = ConversionOptions.build(options, target=target, **kw)
    from ..hub.repo import open_source

    source = src if isinstance(src, SourceCheckpoint) else open_source(src, revision)
    try:
        plan = make_plan(source, opts)
    finally:
        if source is not src:
            source.close()
    main, mtp_layout = layout_shards(plan, opts.shard_size)
    sets = []
    for role, lay in (("main", main), ("mtp", mtp_layout)):
        if lay is None:
            continue
        rows = []
        pre = f"{MTP_DIR}/" if role == "mtp" else ""
        for rank, shards in [*enumerate(lay.shards), ("common", lay.common)]:
            file_of = {n: s.file for s in shards for n in s.names}
            for o in lay.plan.outputs():
                if o.name in file_of:
                    rows.append({"rank": rank, "name": o.name,
                                 "dtype": o.runtime_dtype or str(o.dtype).removeprefix("torch."),
                                 "shape": list(o.shape), "bytes": o.nbytes, "file": pre + file_of[o.name],
                                 "split": o.split.as_dict()})
        sets.append({"role": role, "tensors": rows,
                     "shards": [{"file": s.file, "rank": "common" if s.rank == COMMON else s.rank,
                                 "tensors": len(s.names), "bytes": s.nbytes}
                                for r in lay.shards + [lay.common] for s in r]})
    return {"architecture": plan.spec.architecture, "model_type": plan.spec.model_type,
            "source_format": plan.source_format, **({"quantize": opts.quantize} if opts.quantize else {}),
            "target": opts.target, "tp": opts.tp, "profile": plan.profile.name,
            "parallel": plan.parallel_layout().as_dict(), "sets": sets,
            "dropped": plan.dropped, "total_bytes": sum(s["bytes"] for st in sets for s in st["shards"])}
