"""Checks of a converted directory.

`check_files`: every file's size and digest (store/digest.py) against the manifest, every
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

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from ..store import digest
from ..store.manifest import Manifest, read_manifest
from ..layout.parallel import Split
from ..files.dtypes import ST_DTYPE, dtype_from_name
from .decode import decode_mla, decode_weight, scale_name, source_value, unpad_moe
from ..store.reader import ConvertedCheckpoint
from ..errors import BadInputError
from ..layout.codecs.fp8_block import block_dequant
from ..layout.codecs.mxfp4 import mxfp4_dequant
from ..layout.codecs.requant import fp8_block_quant, quark_mxfp4_quant
from ..files.safetensors import read_header
from ..files.source import SourceCheckpoint


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


_FIX_HEADER = "The file or the manifest was edited or replaced: convert again (atom-convert convert SRC DST --force)"


def check_files(path: str | Path, report: CheckReport | None = None) -> CheckReport:
    """Every file the manifest lists: size and digest; every shard's safetensors header (read and
    validated: files/safetensors.read_header) against the manifest's entries for that file: each
    tensor of the header listed exactly once, with the header's dtype and shape, and each entry
    naming the file present in it. Problems are collected in the report (the manifests
    themselves are checked when read: store/manifest.check_manifest)."""
    path = Path(path)
    report = report or CheckReport()
    sets = _sets(path)
    main = sets[0][1]
    for rel, meta in main["files"].items():
        p = path / rel
        if not p.is_file():
            report.problems.append(f"{rel}: missing (the manifest lists {meta['bytes']} bytes)")
            continue
        size = p.stat().st_size
        if size != meta["bytes"]:
            report.problems.append(f"{rel}: {size} bytes, the manifest says {meta['bytes']} (truncated or replaced)")
            continue
        differs = digest.mismatch(p, meta)
        if differs:
            report.problems.append(f"{rel}: {differs} (corrupted)")
        report.files_checked += 1
    for root, m in sets:
        _check_headers(path, root, m, report)
    _note_unlisted(path, sets, report)
    return report


def _note_unlisted(path: Path, sets: list[tuple[Path, dict[str, Any]]], report: CheckReport) -> None:
    """A `.safetensors` file in the directory that no manifest lists (a stray copy, a shard of another
    conversion): no loader reads it, so it is a note, not a problem. Directories are walked without
    following symlinks."""
    listed = {(root / rel).relative_to(path).as_posix() for root, m in sets for rel in m["files"]}
    stray = []
    for top, dirs, files in os.walk(path, followlinks=False):
        dirs.sort()
        for f in sorted(files):
            rel = (Path(top) / f).relative_to(path).as_posix()
            if f.endswith(".safetensors") and rel not in listed:
                stray.append(rel)
    if stray:
        shown = ", ".join(stray[:5]) + (f" and {len(stray) - 5} more" if len(stray) > 5 else "")
        _note(report, f"{len(stray)} .safetensors file(s) here that the manifest does not list, so no loader "
                      f"reads them: {shown}")


def _check_headers(path: Path, root: Path, m: dict[str, Any], report: CheckReport) -> None:
    """One set's shards (the main set or its mtp/): each header against the manifest's entries."""
    prefix = "" if root == path else f"{root.relative_to(path).as_posix()}/"
    listed: dict[str, dict[str, dict[str, Any]]] = {}  # file -> tensor name -> entry naming that file
    reads: dict[str, int] = {}  # file -> how many (tensor, rank) reads name it
    for name, e in m["tensors"].items():
        for f in e["rank_files"]:
            listed.setdefault(f, {})[name] = e
            reads[f] = reads.get(f, 0) + 1
    mtp = m.get("mtp") or {}
    sub = f"{mtp['path']}/" if mtp.get("status") == "converted" else None
    for rel in m["files"]:  # a shard no entry names still holds tensors the manifest omits
        if rel.endswith(".safetensors") and not (sub and rel.startswith(sub)):
            listed.setdefault(rel, {})
    for f, entries in listed.items():
        shown = prefix + f
        try:
            h = read_header(root / f, name=shown, fix=_FIX_HEADER, error=_collect)
        except _Problems as ex:
            report.problems.extend(ex.problems)
            continue
        except BadInputError as ex:
            report.problems.append(f"{shown}: unreadable header ({ex})")
            continue
        held = h.tensors
        for name in held.keys() - entries.keys():
            v = held[name]
            elsewhere = [prefix + g for g, other in listed.items() if name in other]
            why = f"names {', '.join(elsewhere)} for it" if elsewhere else "does not list it at all"
            report.problems.append(f"{shown}: tensor {name} ({v['dtype']} {v['shape']}) is in the file, but the manifest "
                                   f"{why}: the file and the manifest disagree, convert again")
        for name, e in entries.items():
            v = held.get(name)
            if v is None:
                report.problems.append(f"{shown}: tensor {name} missing from the file (the manifest names this file "
                                       f"for it)")
                continue
            want = ST_DTYPE[dtype_from_name(e["dtype"])]
            if v["dtype"] != want or list(v["shape"]) != e["shape"]:
                report.problems.append(f"{shown}: tensor {name} is {v['dtype']} {v['shape']}, the manifest says "
                                       f"{e['dtype']} ({want}) {e['shape']}")
        report.tensors_checked += reads.get(f, 0)


class _Problems(BadInputError):
    def __init__(self, problems: list[str], fix: str):
        super().__init__("\n".join(problems))
        self.problems = problems


def _collect(problems: list[str], fix: str) -> BadInputError:
    """read_header's error factory here: the problems go into the report as they are."""
    return _Problems(problems, fix)


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
        requantized = man.raw.get("requantization") is not None  # --quantize: check/verify.check_requant
        # --quantize fp8 of a bf16 source re-encodes kv_b too: W_K/W_V are then bounded against the
        # re-encoded kv_b (what ATOM computes them from); kv_b's own error is check_requant's row.
        kvb_requant = requantized and man.raw["requantization"].get("modules") != "routed experts"
        for rank in range(par.world):
            ck = ConvertedCheckpoint(root, rank)
            for name, e in man.tensors.items():
                if name.endswith("_scale") or name.endswith(".W_V"):
                    continue
                if e.placement == "common" and rank > 0:
                    continue
                if requantized and scale_name(name) in man.tensors:
                    continue  # re-encoded from its source: compared within the spec's bound by check_requant
                if name.endswith(".W_K"):
                    if flagged.intersection(e.sources):
                        # The per-tensor re-quantisation takes the amax: one NaN spreads over the operand.
                        _note(report, f"{name.removesuffix('.W_K')}.W_K/W_V not compared: their kv_b source holds "
                                      f"values the conversion's checks flagged (converted with --allow-nonfinite)")
                        continue
                    _check_mla(ck, src, name.removesuffix(".W_K"), e.sources, e.split, rank, report,
                               man.raw["requantization"]["to"] if kvb_requant else None)
                    continue
                weights = [s for s in e.sources if not s.endswith(("_scale_inv", ".weight_scale"))]
                got = decode_weight(ck, name)
                if e.split.kind == "experts":  # stacked experts: per expert [gate; up] or down
                    which = "w13" if name.endswith("w13_weight") else "w2"
                    got = unpad_moe(got, ck.entry(name), which)
                    exp = _expected_experts(src, name, weights, got, e.split, par.ranks[rank].slots, n_routed, rank)
                else:
                    exp = torch.cat([_cut(source_value(src, n), e.split, rank) for n in weights])
                if e.dtype == "bfloat16":  # bf16 outputs of fp32 or fp16 sources (the router bias, any
                    exp = exp.to(torch.bfloat16).float()  # weight stored wider) are rounded, as the runtime holds them
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
               rank: int, report: CheckReport, requant: str | None = None) -> None:
    """W_K/W_V decode to the rank's kv_b heads within their format's rounding (they are
    re-quantised, spec §4.1/§4.2): fp8 e4m3 moves a value by at most 2^-4 of the tensor's amax;
    MXFP4 e2m1 (1 mantissa bit, one scale per 32) by at most 2^-2 of its block's amax."""
    kvb = source_value(src, [s for s in sources if s.endswith(".weight")][0])
    if requant is not None:  # kv_b re-encoded by --quantize (codecs/requant.py): ATOM's W_K/W_V start from that
        kvb = block_dequant(*fp8_block_quant(kvb)) if requant == "fp8-block" else mxfp4_dequant(*quark_mxfp4_quant(kvb))
    kvb = kvb.to(torch.bfloat16).float()
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
