"""Checks of source values as they stream: NaN and Inf in float tensors, fp8 NaN codes,
non-positive or non-finite scales, the e8m0 NaN code.

Why: one NaN block scale of kv_b_proj turns every W_K/W_V element of its layer into NaN
(the per-tensor re-quantisation takes the amax), and an e4m3fn NaN code (0x7F/0xFF) becomes
a finite value under gfx942's e4m3fnuz reinterpretation, so the runtime would compute with
garbage silently. The checks run on every byte read, so each is one or two vectorised
reductions over the tensor (no temporary of its size) and only a failing tensor pays for
locating its first bad element. Measured overhead: BENCHMARKS.md, "Value checks".

`ValueGuard` holds the policy: by default a bad value is a `BadInputError` naming the file,
the tensor, the first bad index and value, and the count; with `allow_nonfinite` it becomes a
warning, one per tensor and problem, that the manifest records.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import BadInputError
from .dtypes import E8M0_NAN

# e4m3fn: exponent and mantissa all ones (S.1111.111) is NaN; there is no Inf (OCP FP8 spec).
_FP8_NAN_POS = 0x7F  # as int8: the largest value
_FP8_NAN_NEG = 0xFF  # as uint8: the largest value
_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
# IEEE-style floats are NaN or Inf exactly when every exponent bit is set. Read as a signed
# integer, a positive such value is >= the first pattern; read as unsigned, a negative one is
# >= the second (the sign bit on top). So two integer max reductions find one, and numpy's
# integer max runs at 2-3x the speed of torch's float aminmax (8 against 4.7 GB/s for bf16 on
# one core of the 2-core box, 4.6 against 1.8 on a strided slice).
_NONFINITE_BITS: dict[torch.dtype, tuple[torch.dtype, str, int, int]] = {
    torch.bfloat16: (torch.int16, "uint16", 0x7F80, 0xFF80),
    torch.float16: (torch.int16, "uint16", 0x7C00, 0xFC00),
    torch.float32: (torch.int32, "uint32", 0x7F800000, 0xFF800000),
}


def has_fp8_nan_code(t: torch.Tensor) -> bool:
    """True when an e4m3fn tensor's bytes (any strides) hold a NaN code: the two codes are the largest
    byte as uint8 (0xFF) and as int8 (0x7F), so two reductions and no temporary. (`amax`, not `max`:
    torch's uint8 `max()` is ~50x slower.)"""
    b = t.view(torch.uint8)
    return int(b.amax()) == _FP8_NAN_NEG or int(b.view(torch.int8).amax()) == _FP8_NAN_POS


# The two reductions of a large tensor run piece by piece: the second then reads the piece from the
# cache, not from memory (a 463 MB bf16 tensor on one core of the 2-core box: 12 GB/s per CPU-second
# whole, 18 in pieces; BENCHMARKS.md, seventeenth round).
CHECK_PIECE_BYTES = 1 << 20


def _has_nonfinite(t: torch.Tensor) -> bool:
    """True when `t` (a dtype of _NONFINITE_BITS, any strides) holds a NaN or an infinity."""
    signed, unsigned, pos, neg = _NONFINITE_BITS[t.dtype]
    a = t.view(signed).numpy()  # numpy is imported here, by torch, not when atom_convert is
    if a.ndim == 0 or a.nbytes <= 2 * CHECK_PIECE_BYTES:
        return int(a.max()) >= pos or int(a.view(unsigned).max()) >= neg
    if a.flags.c_contiguous:
        a = a.reshape(-1)
    step = max(1, CHECK_PIECE_BYTES // max(1, a[0].nbytes))  # leading-dim entries per piece
    for i in range(0, a.shape[0], step):
        piece = a[i:i + step]
        if int(piece.max()) >= pos or int(piece.view(unsigned).max()) >= neg:
            return True
    return False


@dataclass
class ValueGuard:
    allow_nonfinite: bool = False
    warnings: list[dict[str, Any]] = field(default_factory=list)
    # (tensor, problem) -> its record: one per tensor and problem, the one with the smallest first
    # index. Why the smallest: slices of one tensor are checked by several ranks and workers in any
    # order, and the manifest must not depend on it (under allow_nonfinite every slice is checked,
    # so this is the tensor's first bad element).
    _seen: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    # Worker threads (workers.py) report concurrently: one lock keeps one record per tensor and problem.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # -- checks -----------------------------------------------------------------------------
    def check(self, name: str, file: str, t: torch.Tensor, origin: tuple[int, ...] = ()) -> None:
        """What the dtype alone says: NaN/Inf in floats, NaN codes in e4m3fn. `origin` is the
        slice's position in the stored tensor, so the index reported is the stored one."""
        if t.numel() == 0:
            return
        if t.dtype == torch.float8_e4m3fn:
            if has_fp8_nan_code(t):
                self._report(name, file, t, origin, (t.view(torch.uint8) & 0x7F) == 0x7F,
                             "fp8 NaN code (e4m3fn 0x7F/0xFF; gfx942's e4m3fnuz would read it as a finite value)")
        elif t.dtype in _NONFINITE_BITS:
            if _has_nonfinite(t):
                self._report(name, file, t, origin, ~torch.isfinite(t), "NaN or Inf")
        elif t.dtype in _FLOATS:
            # aminmax propagates NaN and returns an infinity when there is one: one reduction.
            lo, hi = torch.aminmax(t)
            if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
                self._report(name, file, t, origin, ~torch.isfinite(t), "NaN or Inf")

    def scales(self, name: str, file: str, s: torch.Tensor, origin: tuple[int, ...] = ()) -> None:
        """fp32 dequantisation scales must be > 0. NaN and Inf are `check`'s, when the scale is
        read (NaN <= 0 is False, so a NaN scale is reported once, as NaN). A scale tensor is
        1/16384 of its weight's elements: a mask costs nothing here."""
        if s.numel() and bool((s <= 0).any()):
            self._report(name, file, s, origin, s <= 0, "scale that is zero or negative (scales must be > 0)")

    def e8m0(self, name: str, file: str, s: torch.Tensor, origin: tuple[int, ...] = ()) -> None:
        """e8m0 scale bytes: 0xFF is NaN (OCP MX spec §5.4.1)."""
        if s.numel() and int(s.amax()) == E8M0_NAN:
            self._report(name, file, s, origin, s == E8M0_NAN, "e8m0 NaN scale code 0xFF")

    # -- reporting ----------------------------------------------------------------------------
    def _report(self, name: str, file: str, t: torch.Tensor, origin: tuple[int, ...], bad: torch.Tensor,
                problem: str) -> None:
        flat = int(bad.reshape(-1).nonzero()[0, 0])
        idx = [int(i) for i in torch.unravel_index(torch.tensor(flat), t.shape)] if t.dim() else []
        idx = [i + (origin[k] if k < len(origin) else 0) for k, i in enumerate(idx)]
        v = t.reshape(-1)[flat]
        if v.dtype == torch.float8_e4m3fn:
            value = f"byte 0x{int(v.view(torch.uint8)):02X}"
        elif v.dtype == torch.uint8:
            value = f"byte 0x{int(v):02X}"
        else:
            value = repr(float(v))
        count = int(bad.sum())
        where = f"{file}: tensor {name}"
        if self.allow_nonfinite:
            with self._lock:
                self._keep({"file": file, "tensor": name, "problem": problem, "first_index": idx,
                            "value": value, "count_in_first_slice": count})
            return
        raise BadInputError(
            f"{where}: {problem}: first at index {idx}, value {value} ({count} such element(s) in the part read, "
            f"shape {list(t.shape)} from index {list(origin) or [0] * t.dim()}). The checkpoint is damaged: "
            f"re-download the file. To convert anyway (the bad values are carried over as they are), pass "
            f"--allow-nonfinite (allow_nonfinite=True); the manifest then records each such tensor."
        )

    # -- worker processes (procs.py) ----------------------------------------------------------
    def _keep(self, w: dict[str, Any]) -> None:
        """Under the lock: `w` becomes the record of its tensor and problem unless one with an index
        as small is kept already (see `_seen`)."""
        key = (w["tensor"], w["problem"])
        old = self._seen.get(key)
        if old is not None and old["first_index"] <= w["first_index"]:
            return
        self._seen[key] = w
        self.warnings = [x for x in self.warnings if x is not old]
        self.warnings.append(w)

    def after_fork(self) -> None:
        """In a worker process: a fresh lock, and only this process's own records from now on
        (the converting process holds the earlier ones and merges what `take` hands it)."""
        self._lock = threading.Lock()
        self.warnings = []
        self._seen = {}

    def take(self) -> list[dict[str, Any]]:
        """The records made since the last call (a worker process sends them with each item)."""
        with self._lock:
            out, self.warnings = self.warnings, []
        return out

    def merge(self, records: list[dict[str, Any]]) -> None:
        """Records from a worker process, kept as `_report` keeps them (one per tensor and problem)."""
        with self._lock:
            for w in records:
                self._keep(w)

    def summary(self) -> dict[str, Any]:
        # Sorted: the order in which worker threads met the tensors is not part of the result.
        with self._lock:
            warnings = sorted(self.warnings, key=lambda w: (w["tensor"], w["problem"]))
        return {"allow_nonfinite": self.allow_nonfinite, "warnings": warnings}

