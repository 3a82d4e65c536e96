"""The conversion driver.

How it works:
1. Index the source lazily (headers only) and read config.json into a ModelSpec.
2. Detect the source format; the architecture's loader checks every tensor and
   plans every output (name, dtype, shape, sources) before any data is read.
3. Assign outputs to size-bounded shards per rank, in load order.
4. Stream: one group (a decoder layer) at a time, every rank's outputs are
   produced and appended to that rank's open shard. Nothing else is held.
5. Copy config/tokenizer files, write the MTP set's manifest, then the main
   manifest last, then rename the temporary directory to DST.
Any failure removes the temporary directory; DST is never half-written.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from tqdm import tqdm

from . import loaders, quant
from .errors import BadInputError, DestinationExistsError, UnsupportedError
from .manifest import MANIFEST_NAME, build_manifest, sha256_file, write_manifest
from .model import ModelSpec
from .parallel import Parallel
from .plan import COMMON, ConversionPlan, ModelPlan, ShardPlan, assign_shards
from .profile import get_profile
from .quant.formats import TARGETS
from .source import SourceCheckpoint
from .writer import ShardSetWriter, WrittenFile

log = logging.getLogger(__name__)

DEFAULT_SHARD_SIZE = 5 * 1000**3
MTP_DIR = "mtp"

# Files copied from SRC beside the shards (whatever of them exists).
COPY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
              "chat_template.jinja", "tiktoken.model")
COPY_SUFFIXES = (".tiktoken",)


@dataclass
class SetLayout:
    """One converted set (main or MTP): its plan and each rank's shards."""

    plan: ModelPlan
    shards: list[list[ShardPlan]]  # per rank: the rank's own files
    common: list[ShardPlan]  # files every rank maps (tensors identical on every rank, spec atom-parallel.md §3.1)


def _large_allocations_via_mmap() -> None:
    """Make glibc serve every allocation of 1 MiB or more with its own mapping.

    The producers allocate tens of MB per expert (the concatenated and the shuffled
    weight) and the writer threads free them. With glibc's default dynamic threshold,
    blocks of that size come from the heap once a few have been freed, and the heap then
    grows by about one expert per expert without being returned: 6-8 GB for one
    DeepSeek-V3 MoE layer (bench/, BENCHMARKS.md). A fixed 1 MiB threshold returns each
    block to the system when it is freed. Process-wide and harmless elsewhere: it is
    glibc's own default behaviour before its threshold adapts.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def parse_size(text: str | int) -> int:
    """'5GB' -> 5_000_000_000, '500MiB' -> 524288000, 1000 -> 1000."""
    if isinstance(text, int):
        return text
    t = text.strip().upper().replace(" ", "")
    units = {"KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4,
             "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4, "K": 1000, "M": 1000**2, "G": 1000**3, "B": 1}
    for u, m in units.items():
        if t.endswith(u):
            try:
                return int(float(t[: -len(u)]) * m)
            except ValueError:
                break
    try:
        return int(t)
    except ValueError:
        raise BadInputError(f"cannot read size {text!r}; write e.g. 5GB, 500MB or 2GiB") from None


def make_plan(src: SourceCheckpoint, *, target: str = "gfx950", tp: int = 1, mtp: bool = True,
              profile: str = "atom", mla_bmm: str = "fp8", ep: bool = False, dp_attention: bool = False,
              shared_experts: str = "fused", mori: bool = False) -> ConversionPlan:
    if target not in TARGETS:
        raise BadInputError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    spec = ModelSpec.from_config(src.config, where=str(src.path / "config.json"))
    fmt = quant.detect_format(src.config, where=str(src.path / "config.json"))
    loader = loaders.get_loader(spec)
    prof = get_profile(profile)
    if dp_attention and not prof.dp_attention:
        raise UnsupportedError(
            f"--profile {prof.name} with --dp-attention: ATOM inside vLLM forces enable_dp_attention off "
            f"(atom-layout-plugin.md §4); convert with --profile atom, or without --dp-attention"
        )
    par = Parallel(tp=tp, ep=ep, dp_attention=dp_attention, shared_experts=shared_experts, mori=mori)
    plan = loader.plan(src, spec, fmt, target=target, tp=tp, profile=prof, mtp=mtp, mla_bmm=mla_bmm, parallel=par)
    prof.apply(plan)  # the one renaming step: loaders plan with ATOM-native names
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


def _write_set(layout: SetLayout, directory: Path, plan: ConversionPlan, progress: Callable[[int], None],
               src: SourceCheckpoint) -> tuple[list[WrittenFile], dict[tuple[int, str], str]]:
    tp = plan.tp
    # The writer's slot `tp` holds the common files; a common tensor is produced once, by rank 0's
    # producer (its split has one piece, so every rank's producer would yield the same bytes).
    writer = ShardSetWriter(directory, layout.shards + [layout.common], layout.plan.outputs(), on_bytes=progress)
    try:
        for group in layout.plan.groups:
            log.debug("%s: converting", group.key)
            for rank in range(tp):
                cache: dict[str, Any] = {}
                for out in group.outputs:
                    if plan.is_common(out):
                        if rank == 0:
                            writer.write(tp, out, out.produce(0, cache))
                        continue
                    writer.write(rank, out, out.produce(rank, cache))
            # Wait for the writes of this group: queued buffers may be views of source pages,
            # and the next group must start with none of them alive (bounded working set).
            writer.drain()
            src.release()  # unmap this group's source pages
        files = writer.close()
    except BaseException:
        writer.abort()
        raise
    where = dict(writer.tensor_file)
    for (slot, name), f in writer.tensor_file.items():
        if slot == tp:  # every rank reads a common tensor from the same file
            for r in range(tp):
                where[(r, name)] = f
    return files, where


def _copy_side_files(src: Path, dst: Path) -> dict[str, dict[str, Any]]:
    """Config, generation config and tokenizer files, with their sizes and hashes."""
    copied = {}
    for p in sorted(src.iterdir()):
        if p.is_file() and (p.name in COPY_FILES or p.name.endswith(COPY_SUFFIXES)):
            shutil.copy2(p, dst / p.name)
            copied[p.name] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    return copied


@contextlib.contextmanager
def _staging(dst: Path) -> Iterator[Path]:
    """A temporary directory beside DST, renamed to DST on success, removed on failure."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        yield tmp
        old = None
        if dst.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.rename(dst, old / "x")
        try:
            os.rename(tmp, dst)
        except BaseException:
            if old is not None:  # put the previous DST back before reporting the failure
                os.rename(old / "x", dst)
                shutil.rmtree(old, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], target: str = "gfx950", *, tp: int = 1,
            shard_size: int | str = DEFAULT_SHARD_SIZE, mtp: bool = True, force: bool = False,
            progress: bool = False, profile: str = "atom", mla_bmm: str = "fp8", ep: bool = False,
            dp_attention: bool = False, shared_experts: str = "fused", mori: bool = False,
            revision: str | None = None, hub_cache: str | None = None) -> dict[str, Any]:
    """Convert a Hugging Face DeepSeek/Kimi checkpoint into ATOM's post-load layout.

    Args:
        src: checkpoint folder (config.json plus model.safetensors or an index and shards), or a Hugging
            Face repo id `org/name[@revision]`: downloaded while converting (`hub.py`).
        dst: output folder; must not exist unless `force`.
        target: "gfx950" (MI355, e4m3fn) or "gfx942" (MI300/MI325, e4m3fnuz).
        tp: ATOM's `-tp`: the number of GPUs; one set of shards per rank.
        ep: ATOM's `--enable-expert-parallel` (spec atom-parallel.md §1): whole experts per rank.
        dp_attention: ATOM's `--enable-dp-attention` (§2): attention, dense MLPs, embeddings and
            lm_head whole on every rank (stored once), routed experts split by EP or MoE-TP.
        shared_experts: "fused" (ATOM_FUSE_SHARED_EXPERT=1, default) or "separate" (=0, with
            dp_attention and mori only, spec §3.2).
        mori: whether the serving host can import `mori` (decides the shared-expert mode, §3.2-3.3).
        shard_size: upper bound per shard file (bytes, or text like "5GB").
        mtp: convert the DeepSeek-V3/R1 MTP layer into `dst/mtp/` (False drops it).
        force: replace an existing `dst`.
        progress: show a tqdm bar in bytes.
        mla_bmm: "fp8" (default) or "mxfp4" (gfx950, ATOM_USE_TRITON_MXFP4_BMM=1): the format of the
            MLA operands W_K/W_V.

    Returns:
        The manifest (also written to `dst/atom_manifest.json`); when pulled from `hub_cache`, the
        repo's manifest plus `pulled_from` (the repo id).

    Example:
        >>> import atom_convert
        >>> m = atom_convert.convert("DeepSeek-V3", "DeepSeek-V3-atom-gfx950", target="gfx950", tp=8)
    """
    t0 = time.perf_counter()
    dst = Path(dst)
    _large_allocations_via_mmap()
    if dst.exists() and not force:
        raise DestinationExistsError(f"destination {dst} already exists; pass --force (force=True) to replace it")
    from .hub import conversion_options, conversion_record, open_source, pull_converted

    source = open_source(src, revision)
    bar = None
    try:
        plan = make_plan(source, target=target, tp=tp, mtp=mtp, profile=profile, mla_bmm=mla_bmm, ep=ep,
                         dp_attention=dp_attention, shared_experts=shared_experts, mori=mori)
        main, mtp_layout = layout_shards(plan, parse_size(shard_size))
        record = conversion_record(source, conversion_options(
            target=target, tp=tp, mtp=mtp, mla_bmm=mla_bmm, profile=profile, ep=ep, dp_attention=dp_attention,
            shared_experts=shared_experts, mori=mori))
        if hub_cache is not None:
            pulled = pull_converted(hub_cache, record["content_key"], dst)
            if pulled is not None:
                return {**pulled, "pulled_from": hub_cache}
        source.begin(_read_order(plan, source))  # a Hub source starts its downloads in this order
        total = sum(s.nbytes for ls in ([main] + ([mtp_layout] if mtp_layout else [])) for r in ls.shards + [ls.common]
                    for s in r)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="atom-convert", disable=not progress)
        with _staging(dst) as tmp:
            # The main set first: it reads the shards in file order, so a source still downloading
            # is converted as it arrives; the MTP layer lives in the last shards.
            files, where = _write_set(main, tmp, plan, bar.update, source)
            copied = _copy_side_files(source.path, tmp)
            mtp_manifest = None
            if mtp_layout is not None:
                mfiles, mwhere = _write_set(mtp_layout, tmp / MTP_DIR, plan, bar.update, source)
                mcopied = _copy_side_files(source.path, tmp / MTP_DIR)
                mtp_manifest = build_manifest(plan, mtp_layout.plan, source, mfiles, mwhere, mcopied, role="mtp")
                write_manifest(tmp / MTP_DIR / MANIFEST_NAME, mtp_manifest)
            manifest = build_manifest(plan, main.plan, source, files, where, copied, role="main",
                                      mtp_dir=tmp / MTP_DIR if mtp_manifest else None,
                                      seconds=time.perf_counter() - t0)
            manifest["conversion"] = record
            write_manifest(tmp / MANIFEST_NAME, manifest)  # last: its presence means complete
    finally:
        if bar is not None:
            bar.close()
        source.close()
    return manifest


def _read_order(plan: ConversionPlan, source: SourceCheckpoint) -> list[str]:
    """Source files in the order the conversion first reads them."""
    order: dict[str, None] = {}
    for mp in (plan.main, plan.mtp):
        for o in mp.outputs() if mp is not None else []:
            for name in o.sources:
                if name in source:
                    order.setdefault(source.info(name).file, None)
    return list(order)


def plan_summary(src: str | os.PathLike[str] | SourceCheckpoint, target: str = "gfx950", *, tp: int = 1,
                 shard_size: int | str = DEFAULT_SHARD_SIZE, mtp: bool = True, mla_bmm: str = "fp8",
                 profile: str = "atom", ep: bool = False, dp_attention: bool = False, shared_experts: str = "fused",
                 mori: bool = False, revision: str | None = None) -> dict[str, Any]:
    """The dry-run plan: every output tensor with dtype, shape, bytes and file per rank (a common
    tensor appears once, as rank "common"), and the parallel block; reads no tensor data (for a Hub
    repo: its configs, index and shard headers only). `src` may be an open SourceCheckpoint (its
    header index is then reused, and it stays open)."""
    from .hub import open_source

    source = src if isinstance(src, SourceCheckpoint) else open_source(src, revision)
    try:
        plan = make_plan(source, target=target, tp=tp, mtp=mtp, mla_bmm=mla_bmm, profile=profile, ep=ep,
                         dp_attention=dp_attention, shared_experts=shared_experts, mori=mori)
    finally:
        if source is not src:
            source.close()
    main, mtp_layout = layout_shards(plan, parse_size(shard_size))
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
            "source_format": plan.source_format, "target": target, "tp": tp, "profile": plan.profile.name,
            "parallel": plan.parallel_layout().as_dict(), "sets": sets,
            "dropped": plan.dropped, "total_bytes": sum(s["bytes"] for st in sets for s in st["shards"])}
