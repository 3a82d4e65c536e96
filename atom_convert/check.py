"""Checks of a converted directory.

`check_files`: every file's size and sha256 against the manifest, every
tensor's name, dtype and shape in the shard headers against its entry.
`check_values`: decodes the converted tensors back into source space (undo the
shuffle, decode fp8 incl. fnuz, apply scales, undo the fusion/stacking and the
rank split) and compares them with the dequantised source tensors: exactly
for layout steps, within fp8 rounding for the re-quantised MLA operands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import ConvertedCheckError
from .manifest import read_manifest, sha256_file
from .quant.formats import ST_DTYPE, dtype_from_name
from .quant.fp8_block import block_dequant
from .quant.shuffle import unshuffle16
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


def _decode(ck: ConvertedCheckpoint, name: str) -> torch.Tensor:
    """fp32 values of a converted weight in plain [.., N, K] order (shuffle undone, scales applied)."""
    e = ck.entry(name)
    w = ck.get(name)
    if e["is_shuffled"]:
        w = unshuffle16(w)
    base = name.removesuffix("_weight").removesuffix(".weight")
    sname = name + "_scale" if name.endswith("_weight") else base + ".weight_scale"
    if sname in ck.manifest["tensors"]:
        s = ck.get(sname)
        if w.dim() == 3:
            return torch.stack([block_dequant(w[i], s[i]) for i in range(w.shape[0])])
        return block_dequant(w, s)
    return w.float()


def _src_value(src: SourceCheckpoint, weight_name: str) -> torch.Tensor:
    w = src.get(weight_name)
    sname = weight_name.removesuffix(".weight") + ".weight_scale_inv"
    if w.dtype == torch.float8_e4m3fn and sname in src:
        return block_dequant(w, src.get(sname))
    return w.float()


def _split(full: torch.Tensor, have: tuple[int, ...], rank: int, tp: int) -> torch.Tensor:
    """The rank's slice of `full`, on whichever dim the converted shape is 1/tp of."""
    if tuple(full.shape) == have:
        return full
    for d in range(full.dim()):
        if full.shape[d] == have[d] * tp:
            n = have[d]
            return full.narrow(d, rank * n, n)
    raise ConvertedCheckError(f"cannot relate source shape {list(full.shape)} to converted {list(have)} at tp={tp}")


_MLA = re.compile(r"(.*)\.self_attn\.mla_attn\.impl\.W_K$")


def check_values(path: str | Path, source: str | Path, report: CheckReport | None = None) -> CheckReport:
    report = report or CheckReport()
    src = SourceCheckpoint(source)
    for root, m in _sets(Path(path)):
        tp = int(m["tp_size"])
        for rank in range(tp):
            ck = ConvertedCheckpoint(root, rank)
            for name, e in m["tensors"].items():
                if name.endswith(("_scale", "W_V")) or "mla_attn" in name and not name.endswith("W_K"):
                    continue
                got = None
                mm = _MLA.match(name)
                if mm:
                    _check_mla(ck, src, mm.group(1), e["sources"], rank, tp, report)
                    continue
                weights = [s for s in e["sources"] if not s.endswith("_scale_inv")]
                got = _decode(ck, name)
                if got.dim() == 3:  # stacked experts: per expert [gate; up] or down
                    per = len(weights) // got.shape[0]
                    parts = [weights[i * per:(i + 1) * per] for i in range(got.shape[0])]
                    if name.endswith("w13_weight"):
                        exp = torch.stack([torch.cat([_split(_src_value(src, n), (got.shape[1] // 2, got.shape[2]), rank, tp)
                                                      for n in p if "down_proj" not in n]) for p in parts])
                    else:
                        exp = torch.stack([_split(_src_value(src, [n for n in p if "down_proj" in n][0]),
                                                  tuple(got.shape[1:]), rank, tp) for p in parts])
                else:
                    vals = [_src_value(src, n) for n in weights]
                    if len(vals) > 1 and got.shape[0] != sum(v.shape[0] for v in vals):
                        exp = torch.cat([_split(v, (v.shape[0] // tp, *v.shape[1:]), rank, tp) for v in vals])
                    else:
                        exp = _split(torch.cat(vals) if len(vals) > 1 else vals[0], tuple(got.shape), rank, tp)
                    exp = exp.to(dtype_from_name(e["dtype"])).float() if e["dtype"] == "bfloat16" else exp
                if not torch.equal(got, exp):
                    bad = (got != exp).sum().item()
                    report.problems.append(f"{root.name}/rank{rank}: {name} differs from its sources in {bad} element(s)")
                report.values_checked += 1
            ck.close()
    src.release()
    return report


def _check_mla(ck: ConvertedCheckpoint, src: SourceCheckpoint, prefix: str, sources: list[str], rank: int, tp: int,
               report: CheckReport) -> None:
    """W_K/W_V decode to the rank's kv_b heads within fp8 rounding (they are re-quantised, spec §4.1)."""
    kvb = _src_value(src, [s for s in sources if s.endswith(".weight")][0]).to(torch.bfloat16).float()
    owner = f"{prefix}.self_attn.mla_attn.impl"
    wk = ck.get(f"{owner}.W_K").float() * ck.get(f"{owner}.W_K_scale")
    wv = ck.get(f"{owner}.W_V").float() * ck.get(f"{owner}.W_V_scale")
    nr, L, P = wk.shape
    V = wv.shape[1]
    x = kvb.view(-1, P + V, L)[rank * nr:(rank + 1) * nr]
    for label, got, exp in (("W_K", wk, x[:, :P, :].transpose(1, 2)), ("W_V", wv, x[:, P:, :])):
        amax = float(exp.abs().max())
        # fp8 e4m3 keeps 3 mantissa bits: rounding error <= 2^-4 relative to each value, and
        # values below the smallest normal lose more; bound by amax * 2^-4 overall.
        err = float((got - exp).abs().max()) / max(amax, 1e-30)
        report.max_mla_rel_err = max(report.max_mla_rel_err, err)
        if err > 2.0**-4:
            report.problems.append(f"rank{rank}: {owner}.{label} decodes {err:.3g} (relative to amax) away from kv_b")
        report.values_checked += 1
