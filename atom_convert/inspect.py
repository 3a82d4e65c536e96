"""`atom-convert inspect`: what a folder holds, source or converted, from headers only."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

from .manifest import MANIFEST_NAME, read_manifest
from .model import ModelSpec
from .quant import detect_format
from .source import SourceCheckpoint

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def describe(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if (path / MANIFEST_NAME).is_file():
        return _describe_converted(path)
    return _describe_source(path)


def _describe_source(path: Path) -> dict[str, Any]:
    src = SourceCheckpoint(path)
    spec = ModelSpec.from_config(src.config, where=str(path / "config.json"))
    fmt = detect_format(src.config, where=str(path / "config.json"))
    dtypes = Counter(str(i.dtype).removeprefix("torch.") for i in src.tensors.values())
    layers = {int(m.group(1)) for n in src.names() if (m := _LAYER.match(n))}
    moe = [i for i in range(spec.n_layers) if spec.is_moe_layer(i)]
    return {
        "kind": "source checkpoint",
        "path": str(path),
        "architecture": spec.architecture,
        "model_type": spec.model_type,
        "quant_format": fmt.name,
        "files": len(src.files),
        "tensors": len(src.tensors),
        "bytes": sum(i.nbytes for i in src.tensors.values()),
        "tensor dtypes": dict(dtypes),
        "layers": {"decoder": spec.n_layers, "dense": spec.n_layers - len(moe), "moe": len(moe),
                   "mtp": spec.n_mtp, "present in files": len(layers)},
        "dims": {"hidden": spec.H, "heads": spec.Nh, "q_lora_rank": spec.Q, "kv_lora_rank": spec.L,
                 "experts": spec.E, "shared_experts": spec.S, "moe_intermediate": spec.I, "vocab": spec.vocab},
        "layer formats": layer_formats(spec, fmt),
    }


def layer_formats(spec: ModelSpec, fmt: Any) -> dict[str, str]:
    """Per layer, the format each group of linears resolves to in the source's quant config,
    e.g. 'self_attn: bf16; mlp.experts: mxfp4; mlp.shared_experts: bf16'."""
    out = {}
    for i in range(spec.n_layers + spec.n_mtp):
        p = f"model.layers.{i}."
        groups: dict[str, list[str]] = {
            "self_attn": (["q_a_proj", "q_b_proj"] if spec.Q else ["q_proj"])
            + ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
        }
        if spec.is_moe_layer(i):
            groups["mlp.experts"] = [f"{e}.{n}" for e in range(spec.E) for n in ("gate_proj", "up_proj", "down_proj")]
            if spec.S:
                groups["mlp.shared_experts"] = ["gate_proj", "up_proj", "down_proj"]
        else:
            groups["mlp"] = ["gate_proj", "up_proj", "down_proj"]
        parts = []
        for g, mods in groups.items():
            names = sorted({fmt.codec_for(f"{p}{g}.{m}").name for m in mods})
            parts.append(f"{g}: {'/'.join(names)}")
        out[p.rstrip(".")] = "; ".join(parts)
    return out


def _describe_converted(path: Path) -> dict[str, Any]:
    m = read_manifest(path)
    dtypes = Counter(e["dtype"] for e in m["tensors"].values())
    return {
        "kind": "atom-convert output",
        "path": str(path),
        "format_version": m["format_version"],
        "tool_version": m["tool_version"],
        "architecture": m["source"]["architecture"],
        "model_type": m["source"]["model_type"],
        "source quant_format": m["source"]["quant_format"],
        "target": f"{m['target']} ({m['fp8_dtype']})",
        "tp_size": m["tp_size"],
        "layout": {"atom_revision": m["layout"]["atom_revision"], "profile": m["layout"]["profile"],
                   **m["layout"]["flags"]},
        "tensors per rank": len(m["tensors"]),
        "shuffled tensors": sum(1 for e in m["tensors"].values() if e["is_shuffled"]),
        "tensor dtypes": dict(dtypes),
        "files": len(m["files"]),
        "bytes": sum(f["bytes"] for f in m["files"].values()),
        "moe layers": m["model"]["moe_layers"],
        "mtp": m.get("mtp", {}).get("status"),
        "dropped source tensors": len(m.get("dropped", {})),
    }
