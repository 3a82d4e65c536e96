"""`atom_manifest.json`: what a converted directory holds and what it assumes.

Written last; a directory without it is not a finished conversion. The layout
block records the ATOM revision and flag values the bytes follow (spec §6.2,
§8.10), so that a runtime with other settings can refuse the files.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import __version__
from .quant.formats import FP8_DTYPE_BY_TARGET, dtype_name

if TYPE_CHECKING:
    from .plan import ConversionPlan, ModelPlan
    from .source import SourceCheckpoint
    from .writer import WrittenFile

MANIFEST_NAME = "atom_manifest.json"
FORMAT_VERSION = 1
ATOM_REVISION = "ffdf3bb5d"  # spec §0: the ATOM commit the layout follows
AITER_REVISION = "e4048607a"


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def build_manifest(plan: "ConversionPlan", mplan: "ModelPlan", src: "SourceCheckpoint", files: list["WrittenFile"],
                   where: dict[tuple[int, str], str], copied: dict[str, dict[str, Any]], *, role: str,
                   mtp_dir: Path | None = None, seconds: float | None = None) -> dict[str, Any]:
    spec = plan.spec
    tensors: dict[str, Any] = {}
    for o in mplan.outputs():
        rank_files = [where[(r, o.name)] for r in range(plan.tp)]
        tensors[o.name] = {
            "file": rank_files[0],
            "rank_files": rank_files,
            "dtype": dtype_name(o.dtype),
            "shape": list(o.shape),
            "is_shuffled": o.is_shuffled,
            "sources": list(o.sources),
        }
        if o.runtime_dtype:
            tensors[o.name]["runtime_dtype"] = o.runtime_dtype
        if o.meta:
            tensors[o.name]["layout"] = o.meta
    index_files = {}
    for name in ("config.json", src.index_file):
        if name:
            p = src.path / name
            index_files[name] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    out_files = {f.name: {"bytes": f.nbytes, "sha256": f.sha256} for f in sorted(files, key=lambda f: f.name)}
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "tool_version": __version__,
        "role": role,
        "target": plan.target,
        "fp8_dtype": dtype_name(FP8_DTYPE_BY_TARGET[plan.target]),
        "tp_size": plan.tp,
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
        },
        "model": {
            "num_hidden_layers": spec.n_layers,
            "num_nextn_predict_layers": spec.n_mtp,
            "q_lora_rank": spec.Q,
            "n_routed_experts": spec.E,
            "n_shared_experts": spec.S,
            "moe_layers": mplan.moe_layers,
        },
        "tensors": tensors,
        "aliases": mplan.aliases,
        "dropped": plan.dropped if role == "main" else {},
        "copied_files": sorted(copied),
        "files": {**out_files, **copied},
    }
    if role == "main":
        if plan.mtp is not None and mtp_dir is not None:
            sub = json.loads((mtp_dir / MANIFEST_NAME).read_text())
            manifest["mtp"] = {"status": "converted", "path": mtp_dir.name, "manifest": f"{mtp_dir.name}/{MANIFEST_NAME}",
                               "tensors": len(sub["tensors"])}
            for f, meta in sub["files"].items():
                manifest["files"][f"{mtp_dir.name}/{f}"] = meta
            mp = mtp_dir / MANIFEST_NAME
            manifest["files"][f"{mtp_dir.name}/{MANIFEST_NAME}"] = {"bytes": mp.stat().st_size, "sha256": sha256_file(mp)}
        elif plan.mtp_status == "dropped by --no-mtp":
            manifest["mtp"] = {"status": "dropped", "reason": "--no-mtp"}
        elif plan.mtp_status == "not in the checkpoint":
            manifest["mtp"] = {"status": "absent", "reason": f"config.json has num_nextn_predict_layers="
                               f"{spec.n_mtp} but the checkpoint holds no model.layers.{spec.n_layers}.* tensor"}
        else:
            manifest["mtp"] = {"status": "absent"}
    if seconds is not None:
        manifest["conversion_seconds"] = round(seconds, 3)
    return manifest


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(directory: Path) -> dict[str, Any]:
    from .errors import ConvertedCheckError

    p = directory / MANIFEST_NAME
    if not p.is_file():
        raise ConvertedCheckError(
            f"{directory}: no {MANIFEST_NAME}; this is not a finished atom-convert output (the manifest is written last)"
        )
    try:
        m = json.loads(p.read_text())
    except ValueError as e:
        raise ConvertedCheckError(f"{p}: not valid JSON ({e})") from None
    if m.get("format_version") != FORMAT_VERSION:
        raise ConvertedCheckError(
            f"{p}: format_version {m.get('format_version')!r}, this atom-convert reads {FORMAT_VERSION}"
        )
    return m
