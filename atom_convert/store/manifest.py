"""`atom_manifest.json`: what a converted directory holds and what it assumes.

Written last; a directory without it is not a finished conversion. The layout
block records the ATOM revision and flag values the bytes follow (spec §6.2,
§8.10), so that a runtime with other settings can refuse the files.

The API (for loaders; format_version 2, version 1 still read):
- `Manifest.read(directory)` -> a typed `Manifest`; `.tensors` maps names to `TensorEntry`
  (dtype, shape, is_shuffled, sources, `placement` "common" or "per_rank", `split`, and
  `rank_files`: the file each rank reads, `entry.file_for(rank)`); `.parallel` is the
  `ParallelLayout` (tp, dp, ep, dp_attention, each rank's expert range and slot map,
  the shared-expert mode; atom_convert.layout.parallel); `.aliases`, `.moe_layers`, `.raw` (the JSON).
- `Manifest.differences(rank=None, **declared)` names every way the manifest differs from the
  layout a caller declares (e.g. `tp=8, ep=8, dp_attention=False, expert_map=[...]`, spec
  atom-parallel.md §5); an empty list means it matches.
- `read_manifest(directory)` returns the same as a JSON dict (version 1 upgraded in memory).

Both check the manifest first (`check_manifest`), so that every reader (verify, inspect, load_into,
open_converted, upload, the cache) gets it once: a JSON object with no key twice, a format_version
this atom-convert reads (a newer or unknown one is refused naming both versions: upgrade, or convert
again), every key a reader uses present with its type, no tensor named twice (an alias is no tensor
name), and every file name it gives (tensors' file and rank_files, the files list, the MTP set's
path) a plain relative path inside the directory: no `..`, not absolute, not resolving out of it
through a symlink (the blobs/ of a Hugging Face cache snapshot excepted: files/safetensors.py's one
symlink policy). Anything else is a ConvertedCheckError naming the manifest, the entry and the value.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._version import __version__
from ..errors import ConvertedCheckError
from ..layout.parallel import REPLICATED, ParallelLayout, Split
from ..files.dtypes import FP8_DTYPE_BY_TARGET, dtype_name
from ..files.reading import loads, no_duplicates, read_regular
from . import digest
from .lock import refuse_foreign
from .manifest_checks import (_FIX_AGAIN, _FIX_PATHS, FORMAT_VERSION, READABLE_VERSIONS,  # noqa: F401 (re-exported)
                              _confined, _own_root, _refuse, _resolved, _v1_split, check_manifest,
                              converted_error, path_problem)

if TYPE_CHECKING:
    from ..layout.plan import ConversionPlan, ModelPlan
    from ..files.source import SourceCheckpoint


@dataclass
class WrittenFile:
    """A file of the converted set as the manifest lists it: path relative to the set, size, and its
    digest (store/digest.py's WRITTEN algorithm, hex)."""

    name: str
    nbytes: int
    digest: str


MANIFEST_NAME = "atom_manifest.json"
ATOM_REVISION = "ffdf3bb5d"  # spec §0: the ATOM commit the layout follows
AITER_REVISION = "e4048607a"
# Bumped whenever a change alters the bytes written for the same source and options, so that
# a partial conversion staged by an older build is not resumed by a newer one (fingerprint.py).
LAYOUT_REVISION = 1


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    """sha256 of a file: a source's identity (config.json, the index; the Hub's LFS oids); a converted
    set's files carry store/digest.py's digest."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


@dataclass
class TensorEntry:
    """One tensor of a converted set. `rank_files[r]` is the file rank r reads it from (the same
    common file for every rank when `placement` is "common")."""

    name: str
    dtype: str
    shape: list[int]  # per rank (every rank holds the same shape)
    is_shuffled: bool
    sources: list[str]
    rank_files: list[str]
    placement: str = "per_rank"  # per_rank | common
    split: Split = REPLICATED
    runtime_dtype: str | None = None
    layout: dict[str, Any] | None = None

    @property
    def file(self) -> str:
        return self.rank_files[0]

    def file_for(self, rank: int) -> str:
        return self.rank_files[rank]

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"file": self.rank_files[0], "rank_files": list(self.rank_files), "dtype": self.dtype,
                             "shape": list(self.shape), "is_shuffled": self.is_shuffled, "sources": list(self.sources),
                             "placement": self.placement, "split": self.split.as_dict()}
        if self.runtime_dtype:
            d["runtime_dtype"] = self.runtime_dtype
        if self.layout:
            d["layout"] = self.layout
        return d

    @classmethod
    def from_dict(cls, name: str, d: dict[str, Any], tp: int) -> "TensorEntry":
        split = Split.from_dict(d["split"]) if "split" in d else _v1_split(name, tp)
        return cls(name=name, dtype=d["dtype"], shape=list(d["shape"]), is_shuffled=bool(d["is_shuffled"]),
                   sources=list(d["sources"]), rank_files=list(d.get("rank_files") or [d["file"]] * tp),
                   placement=d.get("placement", "per_rank"), split=split, runtime_dtype=d.get("runtime_dtype"),
                   layout=d.get("layout"))


@dataclass
class Manifest:
    """A converted set's manifest, typed. `raw` keeps the JSON (version 1 upgraded in memory)."""

    path: Path
    format_version: int
    role: str
    target: str
    tp_size: int
    parallel: ParallelLayout
    profile: str
    flags: dict[str, Any]
    tensors: dict[str, TensorEntry]
    aliases: dict[str, str]
    moe_layers: dict[str, str]
    files: dict[str, dict[str, Any]]
    mtp: dict[str, Any]
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    @classmethod
    def read(cls, directory: str | os.PathLike[str]) -> "Manifest":
        directory = Path(directory)
        m = read_manifest(directory)
        tp = int(m["tp_size"])
        try:
            return cls._of(directory, m, tp)
        except (KeyError, TypeError, ValueError, IndexError) as e:  # check_manifest should have said so first
            raise _refuse(directory / MANIFEST_NAME, [f"cannot be read ({type(e).__name__}: {e})"], _FIX_AGAIN) from None

    @classmethod
    def _of(cls, directory: Path, m: dict[str, Any], tp: int) -> "Manifest":
        return cls(path=directory, format_version=int(m["format_version"]), role=m.get("role", "main"),
                   target=m["target"], tp_size=tp, parallel=ParallelLayout.from_dict(m["parallel"]),
                   profile=m["layout"].get("profile", "atom"), flags=dict(m["layout"].get("flags", {})),
                   tensors={n: TensorEntry.from_dict(n, e, tp) for n, e in m["tensors"].items()},
                   aliases=dict(m.get("aliases", {})), moe_layers=dict(m.get("model", {}).get("moe_layers", {})),
                   files=dict(m.get("files", {})), mtp=dict(m.get("mtp") or {}), raw=m)

    def entry(self, name: str) -> TensorEntry:
        return self.tensors[self.aliases.get(name, name)]

    def rank_files(self, rank: int) -> list[str]:
        """The files rank `rank` maps (its own and the common ones), in first-use order."""
        seen: dict[str, None] = {}
        for e in self.tensors.values():
            seen.setdefault(e.rank_files[rank])
        return list(seen)

    def differences(self, rank: int | None = None, **declared: Any) -> list[str]:
        """Every way this manifest differs from the layout a caller declares.

        Keys: target, profile, tp (= world), dp, ep, dp_attention, attn_tp, moe_tp, shared_experts,
        shared_expert_mode, mori_importable, atom_revision, flags (a dict: each flag compared), and
        per rank (needs `rank`): routed, slots, expert_map, attn_tp_rank, moe_tp_rank, ep_rank.
        An unknown key is itself reported, so that a typo cannot pass silently.
        """
        par = self.parallel
        have: dict[str, Any] = {
            "target": self.target, "profile": self.profile, "tp": par.world, "dp": par.dp, "ep": par.ep,
            "dp_attention": par.dp_attention, "attn_tp": par.attn_tp, "moe_tp": par.moe_tp,
            "shared_experts": par.shared_experts, "shared_expert_mode": par.shared_expert_mode,
            "mori_importable": par.mori_importable, "atom_revision": self.raw.get("layout", {}).get("atom_revision"),
        }
        out: list[str] = []
        per_rank = ("routed", "slots", "expert_map", "attn_tp_rank", "moe_tp_rank", "ep_rank")
        for key, want in declared.items():
            if key == "flags":
                for flag, v in want.items():
                    if self.flags.get(flag) != v:
                        out.append(f"flag {flag}: the manifest says {self.flags.get(flag)!r}, declared {v!r}")
                continue
            if key in per_rank:
                if rank is None or not 0 <= rank < len(par.ranks):
                    out.append(f"{key}: needs a rank in [0, {len(par.ranks)}), got {rank!r}")
                    continue
                got = getattr(par.ranks[rank], key)
                got = list(got) if isinstance(got, tuple) else got
                want = list(want) if isinstance(want, tuple) else want
            elif key in have:
                got = have[key]
            else:
                out.append(f"{key}: not a layout key this manifest records (layout keys: "
                           f"{', '.join(sorted([*have, *per_rank, 'flags']))})")
                continue
            if got != want:
                where = f"rank {rank} " if key in per_rank else ""
                out.append(f"{where}{key}: the manifest says {got!r}, declared {want!r}")
        return out


def build_manifest(plan: "ConversionPlan", mplan: "ModelPlan", src: "SourceCheckpoint", files: list[WrittenFile],
                   where: dict[tuple[int, str], str], copied: dict[str, dict[str, Any]], *, role: str,
                   mtp_dir: Path | None = None, seconds: float | None = None) -> dict[str, Any]:
    spec = plan.spec
    tensors: dict[str, Any] = {}
    for o in mplan.outputs():
        tensors[o.name] = TensorEntry(
            name=o.name, dtype=dtype_name(o.dtype), shape=list(o.shape), is_shuffled=o.is_shuffled,
            sources=list(o.sources), rank_files=[where[(r, o.name)] for r in range(plan.tp)],
            placement="common" if plan.is_common(o) else "per_rank", split=o.split,
            runtime_dtype=o.runtime_dtype, layout=o.meta or None,
        ).as_dict()
    index_files = {}
    for name in ("config.json", src.index_file):
        if name:
            p = src.path / name
            index_files[name] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    out_files = {f.name: {"bytes": f.nbytes, digest.WRITTEN: f.digest} for f in sorted(files, key=lambda f: f.name)}
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "tool_version": __version__,
        "role": role,
        "target": plan.target,
        "fp8_dtype": dtype_name(FP8_DTYPE_BY_TARGET[plan.target]),
        "tp_size": plan.tp,
        "parallel": plan.parallel_layout().as_dict(),
        "layout": {
            "runtime": "atom",
            "profile": plan.profile.name,
            "atom_revision": ATOM_REVISION,
            "aiter_revision": AITER_REVISION,
            "flags": plan.layout_flags,
            "post_load_processed": True,  # never run process_weights_after_loading again (spec §6.3)
        },
        "source": {
            "path": str(src.path.resolve()),
            "architecture": spec.architecture,
            "model_type": spec.model_type,
            "quant_format": plan.source_format,
            "config_sha256": index_files["config.json"]["sha256"],
            "index_files": index_files,
            "files": src.file_sizes(),
            **({"hub": dict(src.hub)} if src.hub else {}),  # repo_id, revision asked, commit resolved
        },
        "model": {
            "num_hidden_layers": spec.n_layers,
            "num_nextn_predict_layers": spec.n_mtp,
            "q_lora_rank": spec.Q,
            "n_routed_experts": spec.E,
            "n_shared_experts": spec.S,
            "moe_layers": mplan.moe_layers,
            # the layers that carry the sparse-attention indexer (DeepSeek-V3.2, GLM-5; GLM-5.2's
            # "shared" layers carry none: atom-layout-next.md §2.2, §6)
            **({"indexer_layers": [i for i in range(spec.n_layers + spec.n_mtp) if spec.has_indexer_at(i)]}
               if spec.has_indexer else {}),
        },
        "tensors": tensors,
        "aliases": mplan.aliases,
        "dropped": plan.dropped if role == "main" else {},
        "copied_files": sorted(copied),
        "files": {**out_files, **copied},
        # bad source values converted under --allow-nonfinite (quant/values.py); empty otherwise
        "value_checks": src.values.summary(),
    }
    if role == "main":
        if plan.mtp is not None and mtp_dir is not None:
            sub = json.loads((mtp_dir / MANIFEST_NAME).read_text())
            manifest["mtp"] = {"status": "converted", "path": mtp_dir.name, "manifest": f"{mtp_dir.name}/{MANIFEST_NAME}",
                               "tensors": len(sub["tensors"])}
            for f, meta in sub["files"].items():
                manifest["files"][f"{mtp_dir.name}/{f}"] = meta
            mp = mtp_dir / MANIFEST_NAME
            manifest["files"][f"{mtp_dir.name}/{MANIFEST_NAME}"] = {"bytes": mp.stat().st_size,
                                                                     digest.WRITTEN: digest.file_digest(mp)}
        elif plan.mtp_status == "dropped by --no-mtp":
            manifest["mtp"] = {"status": "dropped", "reason": "--no-mtp"}
        elif plan.mtp_status == "not in the checkpoint":
            manifest["mtp"] = {"status": "absent", "reason": f"config.json has num_nextn_predict_layers="
                               f"{spec.n_mtp} but the checkpoint holds no model.layers.{spec.n_layers}.* tensor"}
        else:
            manifest["mtp"] = {"status": "absent"}
    if plan.requant is not None:  # --quantize: from, to, rounding rule (atom-layout-next.md §6)
        manifest["requantization"] = plan.requant
    if seconds is not None:
        manifest["conversion_seconds"] = round(seconds, 3)
    return manifest


VERIFY_NAME = "atom_verify.json"  # `atom-convert verify DST --json > DST/atom_verify.json`: shown on the Hub card


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Write `path` (in the staging directory the tool made) through `path.tmp`, fsynced and
    renamed; the temporary file is created exclusively, never through a symlink at its name."""
    tmp = path.with_suffix(".json.tmp")
    if os.path.lexists(tmp):
        if os.path.islink(tmp) or not os.path.isfile(tmp):
            raise refuse_foreign(tmp, f"a symbolic link (to {os.readlink(tmp)})" if os.path.islink(tmp)
                                 else "no regular file", "atom-convert's manifest being written (a regular file)")
        os.unlink(tmp)  # an interrupted run's own leftover
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    with os.fdopen(fd, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of `directory` as a JSON dict (version 1 upgraded in memory), checked
    (`check_manifest`): a ConvertedCheckError naming the manifest, the entry and what is wrong
    for anything a reader could trip over."""
    directory = Path(directory)
    p = directory / MANIFEST_NAME
    root = _own_root(directory)
    if os.path.islink(p):
        real = _resolved(p)
        if real is None or not _confined(real, root):
            raise converted_error([f"{p}: is a symbolic link to {os.readlink(p)}, which resolves outside {root}; "
                                   f"nothing outside a converted directory is read"], _FIX_PATHS)
    if not p.is_file():
        raise ConvertedCheckError(
            f"{directory}: no {MANIFEST_NAME}; this is not a finished atom-convert output (the manifest is written last)"
        )
    try:
        text = read_regular(p)
    except OSError as e:
        raise ConvertedCheckError(f"{p}: cannot be read ({e.strerror or e}); check the file and its permissions") from None
    try:
        m = loads(text, object_pairs_hook=no_duplicates(str(p), converted_error, _FIX_AGAIN))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, nesting
        raise ConvertedCheckError(f"{p}: not valid JSON ({e}); {_FIX_AGAIN}") from None
    check_manifest(p, m, directory)
    return m


