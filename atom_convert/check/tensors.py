"""Checks of a converted directory.

`check_files`: every file's size and sha256 against the manifest, every
tensor's name, dtype and shape in the shard headers against its entry.
`check_values`: decodes the converted tensors back into source space (undo the
shuffle, decode fp8 incl. fnuz, apply scales, undo the fusion/stacking) and
compares them with the dequantised source tensors cut for the rank by the
manifest's split record (never inferred from shapes): exactly for layout
steps, within fp8 rounding for the re-quantised MLA operands. A conversion made
with --allow-nonfinite carried the source's NaN/Inf values over as they were (on
gfx942 an e4m3fn NaN code reads as a finite fnuz value): the elements whose source
value is not finite are left out of the comparison, the rest compared as always,
and each tensor concerned is named in the report's notes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from ..store.manifest import Manifest, read_manifest, sha256_file
from ..layout.parallel import Split
from ..files.dtypes import ST_DTYPE, dtype_from_name
from .decode import decode_mla, decode_weight, source_value, unpad_moe
from ..store.reader import ConvertedCheckpoint
from ..files.source import SourceCheckpoint, read_safetensors_header


@dataclass
class CheckReport:
    files_checked: int = 0
    tensors_checked: int = 0
    values_checked: int = 0
    problems: list[str] = field(default_factory=list)
    max_mla_rel_err: float = 0.0
    notes: list[str] = field(default_factory=list)  # what was not compared, and why
    flagged_sources: set[str] = field(default_factory=set)  # check_values: what --allow-nonfinite let through

    @property
    def ok(self) -> bool:
        return not self.problems


def _sets(path: Path) -> list[tuple[Path, dict[str, Any]]]:
    m = read_manifest(path)
    out = [(path, m)]
    if (m.get("mtp") or {}).get("status") == "converted":
        out.append((path / m["mtp"]["path"], read_manifest(path / m["mtp"]["path"])))
    return out


def check_files(path: str | Path, report: CheckReport | None = None) -> CheckReport:
    path = Path(path)
    report = report or CheckReport()
    main = read_manifest(path)
    for rel, meta in main["files"].items():
        p = path / rel
        if not p.is_file():
            report.problems.append(f"{rel}: missing (the manifest lists {meta['bytes']} bytes)")
            continue
        size = p.stat().st_size
        if size != meta["bytes"]:
            report.problems.append(f"{rel}: {size} bytes, the manifest says {meta['bytes']} (truncated or replaced)")
            continue
        digest = sha256_file(p)
        if digest != meta["sha256"]:
            report.problems.append(f"{rel}: sha256 {digest[:16]}..., the manifest says {meta['sha256'][:16]}... (corrupted)")
        report.files_checked += 1
    for root, m in _sets(path):
        headers: dict[str, dict[str, Any]] = {}
        for name, e in m["tensors"].items():
            for f in e["rank_files"]:
                if f not in headers:
                    try:
                        headers[f] = read_safetensors_header(root / f)[0]
                    except Exception as ex:  # noqa: BLE001  reported, not raised
                        report.problems.append(f"{f}: unreadable header ({ex})")
                        headers[f] = {}
                h = headers[f].get(name)
                if h is None:
                    if headers[f]:
                        report.problems.append(f"{f}: tensor {name} missing from the file")
                    continue
                want = dtype_from_name(e["dtype"])
                if h["dtype"] != ST_DTYPE[want] or list(h["shape"]) != e["shape"]:
                    report.problems.append(
                        f"{f}: tensor {name} is {h['dtype']} {h['shape']}, the manifest says {e['dtype']} {e['shape']}"
                    )
                report.tensors_checked += 1
    return report


# ------------------------------------------------------------------------------------------------


def _cut(full: torch.Tensor, split: Split, rank: int, dim: int | None = None) -> torch.Tensor:
    """The rank's piece of a source tensor, as the manifest's split record says (parallel.py)."""
    if split.ways == 1:
        return full
    d = split.dim if dim is None else dim
    n = full.shape[d] // split.ways
    return full.narrow(d, split.piece(rank) * n, n)


def _expected_experts(src: SourceCheckpoint, name: str, weights: list[str], got: torch.Tensor, split: Split,
                      slots: list[int], n_routed: int, rank: int) -> torch.Tensor:
    """Stacked experts of this rank: slot k holds expert `slots[k]` (the shared expert as id E),
    each cut on I into `split.ways` pieces (spec atom-parallel.md §1.2, §2.2)."""
    total = n_routed + (1 if any(".shared_experts." in w for w in weights) else 0)
    per = len(weights) // total
    ids = slots[:got.shape[0]]
    parts = [weights[i * per:(i + 1) * per] for i in ids]
    if name.endswith("w13_weight"):
        return torch.stack([torch.cat([_cut(source_value(src, n), split, rank, 0) for n in p if "down_proj" not in n])
                            for p in parts])
    return torch.stack([_cut(source_value(src, [n for n in p if "down_proj" in n][0]), split, rank, 1) for p in parts])


def check_values(path: str | Path, source: str | Path, report: CheckReport | None = None) -> CheckReport:
    """Decode every converted tensor and compare it with the source tensors it came from, cut for
    each rank as the manifest's split record says (a common tensor is checked once: every rank
    reads the same file)."""
    report = report or CheckReport()
    sets = _sets(Path(path))
    flagged = report.flagged_sources = _flagged(m for _, m in sets)
    src = SourceCheckpoint(source, allow_nonfinite=bool(flagged))
    for root, _ in sets:
        man = Manifest.read(root)
        par = man.parallel
        n_routed = int(man.raw.get("model", {}).get("n_routed_experts") or 0)
        for rank in range(par.world):
            ck = ConvertedCheckpoint(root, rank)
            for name, e in man.tensors.items():
                if name.endswith("_scale") or name.endswith(".W_V"):
                    continue
                if e.placement == "common" and rank > 0:
                    continue
                if name.endswith(".W_K"):
                    if flagged.intersection(e.sources):
                        # The per-tensor re-quantisation takes the amax: one NaN spreads over the operand.
                        _note(report, f"{name.removesuffix('.W_K')}.W_K/W_V not compared: their kv_b source holds "
                                      f"values the conversion's checks flagged (converted with --allow-nonfinite)")
                        continue
                    _check_mla(ck, src, name.removesuffix(".W_K"), e.sources, e.split, rank, report)
                    continue
                weights = [s for s in e.sources if not s.endswith(("_scale_inv", ".weight_scale"))]
                got = decode_weight(ck, name)
                if e.split.kind == "experts":  # stacked experts: per expert [gate; up] or down
                    which = "w13" if name.endswith("w13_weight") else "w2"
                    got = unpad_moe(got, ck.entry(name), which)
                    exp = _expected_experts(src, name, weights, got, e.split, par.ranks[rank].slots, n_routed, rank)
                else:
                    exp = torch.cat([_cut(source_value(src, n), e.split, rank) for n in weights])
                    if e.dtype == "bfloat16":  # bf16 outputs of fp32 sources (router) are rounded
                        exp = exp.to(torch.bfloat16).float()
                if got.shape == exp.shape and flagged.intersection(e.sources):
                    keep = torch.isfinite(exp)
                    if not bool(keep.all()):
                        _note(report, f"{name}: {int((~keep).sum())} element(s) not compared on rank {rank}: their "
                                      f"source values are non-finite (converted with --allow-nonfinite)")
                        got, exp = got[keep], exp[keep]
                if got.shape != exp.shape or not torch.equal(got, exp):
                    bad = int((got != exp).sum()) if got.shape == exp.shape else f"shape {list(got.shape)} vs"
                    report.problems.append(f"{root.name}/rank{rank}: {name} differs from its sources in {bad} element(s)"
                                           + (f" {list(exp.shape)}" if got.shape != exp.shape else ""))
                report.values_checked += 1
            ck.close()
    unrecorded = sorted({w["tensor"] for w in src.values.warnings} - flagged)
    if unrecorded:
        report.problems.append(f"source tensor(s) {', '.join(unrecorded)} hold non-finite values that the conversion's "
                               f"manifest does not record: the source changed after the conversion")
    return report


def _flagged(manifests: Iterable[dict[str, Any]]) -> set[str]:
    """The source tensors a conversion with --allow-nonfinite recorded as holding NaN/Inf, fp8
    NaN codes, scales <= 0 or e8m0 NaN (manifest `value_checks`); empty for any other conversion."""
    out: set[str] = set()
    for m in manifests:  # the main set and the MTP set each record what they read
        vc = m.get("value_checks") or {}
        if vc.get("allow_nonfinite"):
            out.update(w["tensor"] for w in vc.get("warnings", []))
    return out


def _note(report: CheckReport, text: str) -> None:
    if text not in report.notes:
        report.notes.append(text)


def _check_mla(ck: ConvertedCheckpoint, src: SourceCheckpoint, owner: str, sources: list[str], split: Split,
               rank: int, report: CheckReport) -> None:
    """W_K/W_V decode to the rank's kv_b heads within their format's rounding (they are
    re-quantised, spec §4.1/§4.2): fp8 e4m3 moves a value by at most 2^-4 of the tensor's amax;
    MXFP4 e2m1 (1 mantissa bit, one scale per 32) by at most 2^-2 of its block's amax."""
    kvb = source_value(src, [s for s in sources if s.endswith(".weight")][0]).to(torch.bfloat16).float()
    wk, wv = decode_mla(ck, owner)
    mxfp4 = ck.entry(f"{owner}.W_K").get("runtime_dtype") is not None
    nr, L, P = wk.shape
    V = wv.shape[1]
    piece = split.piece(rank)  # the rank's kv_b heads (all of them when the split has one piece)
    x = kvb.view(-1, P + V, L)[piece * nr:(piece + 1) * nr]
    for label, got, exp in ((f"{owner}.W_K", wk, x[:, :P, :].transpose(1, 2)), (f"{owner}.W_V", wv, x[:, P:, :])):
        if mxfp4:  # relative to each 32-block's amax along the last dim
            blocks = exp.reshape(*exp.shape[:-1], -1, 32).abs().amax(-1, keepdim=True).clamp(min=1e-30)
            err = float(((got - exp).reshape(blocks.shape[:-1] + (32,)).abs() / blocks).max())
            bound = 2.0**-2
        else:
            err = float((got - exp).abs().max()) / max(float(exp.abs().max()), 1e-30)
            bound = 2.0**-4
        report.max_mla_rel_err = max(report.max_mla_rel_err, err)
        if err > bound:
            report.problems.append(f"rank{rank}: {label} decodes {err:.3g} (relative to amax) away from kv_b")
        report.values_checked += 1
