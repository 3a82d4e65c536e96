"""Checks of a converted directory.

`check_files`: every file's size and sha256 against the manifest, every
tensor's name, dtype and shape in the shard headers against its entry.
`check_values`: decodes the converted tensors back into source space (undo the
shuffle, decode fp8 incl. fnuz, apply scales, undo the fusion/stacking and the
rank split) and compares them with the dequantised source tensors: exactly
for layout steps, within fp8 rounding for the re-quantised MLA operands.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import ConvertedCheckError
from .manifest import read_manifest, sha256_file
from .quant.formats import ST_DTYPE, dtype_from_name
from .decode import decode_mla, decode_weight, source_value, unpad_moe
from .reader import ConvertedCheckpoint
from .source import SourceCheckpoint, read_safetensors_header


@dataclass
class CheckReport:
    files_checked: int = 0
    tensors_checked: int = 0
    values_checked: int = 0
    problems: list[str] = field(default_factory=list)
    max_mla_rel_err: float = 0.0

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


def _split(full: torch.Tensor, have: tuple[int, ...], rank: int, tp: int) -> torch.Tensor:
    """The rank's slice of `full`, on whichever dim the converted shape is 1/tp of."""
    if tuple(full.shape) == have:
        return full
    for d in range(full.dim()):
        if full.shape[d] == have[d] * tp:
            n = have[d]
            return full.narrow(d, rank * n, n)
    raise ConvertedCheckError(f"cannot relate source shape {list(full.shape)} to converted {list(have)} at tp={tp}")


def _expected_experts(src: SourceCheckpoint, name: str, weights: list[str], got: torch.Tensor, rank: int,
                      tp: int) -> torch.Tensor:
    per = len(weights) // got.shape[0]
    parts = [weights[i * per:(i + 1) * per] for i in range(got.shape[0])]
    if name.endswith("w13_weight"):
        half = (got.shape[1] // 2, got.shape[2])
        return torch.stack([torch.cat([_split(source_value(src, n), half, rank, tp) for n in p if "down_proj" not in n])
                            for p in parts])
    return torch.stack([_split(source_value(src, [n for n in p if "down_proj" in n][0]), tuple(got.shape[1:]), rank, tp)
                        for p in parts])


def check_values(path: str | Path, source: str | Path, report: CheckReport | None = None) -> CheckReport:
    """Decode every converted tensor and compare it with the source tensors it came from."""
    report = report or CheckReport()
    src = SourceCheckpoint(source)
    for root, m in _sets(Path(path)):
        tp = int(m["tp_size"])
        for rank in range(tp):
            ck = ConvertedCheckpoint(root, rank)
            for name, e in m["tensors"].items():
                if name.endswith("_scale") or name.endswith(".W_V"):
                    continue
                if name.endswith(".W_K"):
                    _check_mla(ck, src, name.removesuffix(".W_K"), e["sources"], rank, tp, report)
                    continue
                weights = [s for s in e["sources"] if not s.endswith(("_scale_inv", ".weight_scale"))]
                got = decode_weight(ck, name)
                if got.dim() == 3:  # stacked experts: per expert [gate; up] or down
                    which = "w13" if name.endswith("w13_weight") else "w2"
                    got = unpad_moe(got, e, which)
                    exp = _expected_experts(src, name, weights, got, rank, tp)
                else:
                    vals = [source_value(src, n) for n in weights]
                    if len(vals) > 1 and got.shape[0] != sum(v.shape[0] for v in vals):
                        exp = torch.cat([_split(v, (v.shape[0] // tp, *v.shape[1:]), rank, tp) for v in vals])
                    else:
                        exp = _split(torch.cat(vals) if len(vals) > 1 else vals[0], tuple(got.shape), rank, tp)
                    if e["dtype"] == "bfloat16":  # bf16 outputs of fp32 sources (router) are rounded
                        exp = exp.to(torch.bfloat16).float()
                if not torch.equal(got, exp):
                    bad = int((got != exp).sum())
                    report.problems.append(f"{root.name}/rank{rank}: {name} differs from its sources in {bad} element(s)")
                report.values_checked += 1
            ck.close()
    src.release()
    return report


def _check_mla(ck: ConvertedCheckpoint, src: SourceCheckpoint, owner: str, sources: list[str], rank: int, tp: int,
               report: CheckReport) -> None:
    """W_K/W_V decode to the rank's kv_b heads within their format's rounding (they are
    re-quantised, spec §4.1/§4.2): fp8 e4m3 moves a value by at most 2^-4 of the tensor's amax;
    MXFP4 e2m1 (1 mantissa bit, one scale per 32) by at most 2^-2 of its block's amax."""
    kvb = source_value(src, [s for s in sources if s.endswith(".weight")][0]).to(torch.bfloat16).float()
    wk, wv = decode_mla(ck, owner)
    mxfp4 = ck.entry(f"{owner}.W_K").get("runtime_dtype") is not None
    nr, L, P = wk.shape
    V = wv.shape[1]
    x = kvb.view(-1, P + V, L)[rank * nr:(rank + 1) * nr]
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
