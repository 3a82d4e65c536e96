"""`atom-convert inspect`: what a folder holds, source or converted, from headers only."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

from ..store.manifest import MANIFEST_NAME, Manifest, read_manifest
from ..files.dtypes import dtype_from_name
from ..layout.model import ModelSpec
from ..layout.codecs import detect_format
from ..files.source import SourceCheckpoint

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
    root = spec.text_prefix  # Kimi-K2.5: language_model.* (atom-layout-next.md §3.1)
    layers = {int(m.group(1)) for n in src.names() if n.startswith(root) and (m := _LAYER.match(n[len(root):]))}
    moe = [i for i in range(spec.n_layers) if spec.is_moe_layer(i)]
    extra = {}
    if root:
        outside = [n for n in src.names() if not n.startswith(root)]
        extra = {"outside the text model": {"tensors": len(outside),
                                            "bytes": sum(src.info(n).nbytes for n in outside),
                                            "prefixes": sorted({n.split(".")[0] + "." for n in outside})}}
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
        **extra,
    }


def layer_formats(spec: ModelSpec, fmt: Any) -> dict[str, str]:
    """Per layer, the format each group of linears resolves to in the source's quant config,
    e.g. 'self_attn: bf16; mlp.experts: mxfp4; mlp.shared_experts: bf16'."""
    out = {}
    for i in range(spec.n_layers + spec.n_mtp):
        p = f"{spec.text_prefix}model.layers.{i}."
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


def _nbytes(dtype: str, shape: list[int]) -> int:
    n = dtype_from_name(dtype).itemsize
    for d in shape:
        n *= d
    return n


def rank_bytes(path: Path) -> dict[str, Any]:
    """Per rank: the tensor bytes it needs, the tensor bytes of the files it maps (its own and the
    common ones, each file counted once), and their ratio: 1.0 when no file a rank maps holds
    another rank's tensors. Main and MTP sets together; from the manifests only."""
    sets = [Manifest.read(path)]
    if sets[0].mtp.get("status") == "converted":
        sets.append(Manifest.read(path / sets[0].mtp["path"]))
    world = sets[0].parallel.world
    out: dict[str, Any] = {}
    common = 0
    for r in range(world):
        need = read = own = 0
        for m in sets:
            in_file: dict[str, int] = {}
            for e in m.tensors.values():
                for f in set(e.rank_files):
                    in_file[f] = in_file.get(f, 0) + _nbytes(e.dtype, e.shape)
            for e in m.tensors.values():
                b = _nbytes(e.dtype, e.shape)
                need += b
                if e.placement != "common":
                    own += b
                elif r == 0:
                    common += b
            read += sum(in_file[f] for f in m.rank_files(r))
        out[f"rank {r}"] = {"own bytes": own, "needs": need, "reads": read, "read/need": round(read / need, 6)}
    return {"common bytes": common, **out}


def _describe_converted(path: Path) -> dict[str, Any]:
    m = read_manifest(path)
    typed = Manifest.read(path)
    par = typed.parallel
    dtypes = Counter(e["dtype"] for e in m["tensors"].values())
    placement = Counter(e.placement for e in typed.tensors.values())
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
        "parallel": {"mode": _mode(par), "tp": par.tp, "dp": par.dp, "ep": par.ep, "dp_attention": par.dp_attention,
                     "attention tp": par.attn_tp, "moe tp": par.moe_tp, "shared experts": par.shared_experts,
                     "shared expert mode": par.shared_expert_mode, "mori importable": par.mori_importable,
                     "expert slots per rank": {f"rank {r.rank}": _slots(r.slots, m["model"]["n_routed_experts"])
                                               for r in par.ranks} if m["model"]["n_routed_experts"] else {}},
        "tensors common / per rank": f"{placement.get('common', 0)} / {placement.get('per_rank', 0)}",
        "bytes per rank": rank_bytes(path),
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
        **_dropped_why(m.get("dropped", {})),
    }


def _dropped_why(dropped: dict[str, str]) -> dict[str, Any]:
    """The reasons source tensors were dropped, each with how many (e.g. Kimi-K2.5's vision tower
    natively), when there are any."""
    if not dropped:
        return {}
    return {"dropped because": dict(Counter(dropped.values()))}


def _mode(par: Any) -> str:
    if par.world == 1:
        return "single GPU"
    parts = ["DP-attention" if par.dp_attention else f"TP {par.tp}"]
    parts.append(f"EP {par.ep}" if par.ep > 1 else f"MoE-TP {par.moe_tp}")
    return " + ".join(parts)


def _slots(slots: list[int], E: int) -> str:
    """'0-31 + shared' for a contiguous block of routed ids."""
    routed = [i for i in slots if i < E]
    text = f"{routed[0]}-{routed[-1]}" if routed and routed == list(range(routed[0], routed[-1] + 1)) else str(routed)
    return text + (" + shared" if E in slots else "")
