"""gfx942 fp8: e4m3fn bytes normalised to e4m3fnuz, scales doubled (spec §3.0.2, §8.1).

Not idempotent: applied exactly once per weight, by the conversion pipeline.
"""

from __future__ import annotations

import torch

from ...files.dtypes import FNUZ_NAN_BYTE, FNUZ_SCALE_FACTOR, FP8_DTYPE_BY_TARGET


def fnuz_normalize(w: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes -> e4m3fnuz tensor (spec §3.0.2): clear 0x80, reinterpret.

    The caller doubles every scale of the same weight exactly once. The result
    holds half the e4m3fn value per element; with the doubled scale the
    dequantised value is unchanged.
    """
    if w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fnuz_normalize expects float8_e4m3fn, got {w.dtype}")
    return fnuz_normalize_(w.clone(memory_format=torch.contiguous_format))


_LOW7 = 0x7F7F7F7F7F7F7F7F  # per byte lane of an int64: 0x7F
# int64 words per step (256 KB): the four passes of a step then run in the core's L2 cache, where
# over a whole chunk they would stream it four times from L3 or memory. On one core of the 2-core box,
# for a chunk just shuffled (as the pipeline leaves it): [512, 7168] 3.3 -> 4.7 GB/s, [7168, 256]
# 3.4 -> 4.5, [3072, 7168] 2.6 -> 4.1 against 8 MB steps (512 KB steps: 4.6, 4.3, 4.1; 128 KB: 3.9,
# 3.9, 3.4, the per-call cost showing). In worker processes each call holds no lock another worker needs.
_BLOCK = 1 << 15


def _clear_0x80_bytes_(words: torch.Tensor, find_nan: bool = False) -> bool:
    """Every byte 0x80 of an int64 tensor's bytes set to 0x00, others unchanged, 8 bytes per lane
    op. Per byte x: t = (x & 0x7F) + 0x7F has bit 7 set exactly when x & 0x7F != 0 (at most
    0xFE: no carry into the next byte); x & (t | 0x7F) then clears bit 7 only when the low
    seven bits are zero, i.e. 0x80 -> 0x00 (and 0x00 stays 0x00). Four passes over the words
    (a fifth, t & 0x80 before the |, changed nothing: 10.5 against 14.8 GB/s on one core of the
    2-core box for a [512, 7168] chunk just written, as the shuffle leaves it). masked_fill_ with a
    comparison mask does the same at a tenth of the speed or less (1.6 against 15 GB/s on one
    core of the 2-core box for a [512, 7168] chunk in cache; 0.41 against 2.4-2.9 GB/s in an
    earlier measurement); tests hold the two equal on every byte value in every lane.

    find_nan: also say whether a byte was an e4m3fn NaN code (0x7F or 0xFF: low seven bits all
    ones), read off t, whose byte is 0xFE exactly then (a fifth pass, a reduction in L2). Returns
    that (False when not asked)."""
    t = torch.empty((min(_BLOCK, words.numel()),), dtype=torch.int64)  # 256 KB: from the heap, cheap
    nan = False
    for i in range(0, words.numel(), _BLOCK):
        w = words[i:i + _BLOCK]
        tt = t[:w.numel()]
        torch.bitwise_and(w, _LOW7, out=tt)
        tt += _LOW7
        if find_nan and not nan:
            nan = int(tt.view(torch.uint8).amax()) == 0xFE
        tt |= _LOW7
        w &= tt
    return nan


def fnuz_normalize_(w: torch.Tensor) -> torch.Tensor:
    """`fnuz_normalize` in place on a fresh e4m3fn tensor the caller owns (a shuffled output:
    the normalisation is per byte, so it commutes with the shuffle); returns the e4m3fnuz view."""
    return fnuz_normalize_scan_(w, find_nan=False)[0]


def fnuz_normalize_scan_(w: torch.Tensor, find_nan: bool = True) -> tuple[torch.Tensor, bool]:
    """`fnuz_normalize_`, and whether an e4m3fn NaN code (0x7F/0xFF) was among w's bytes, found in
    the same pass. Why: the value check of an fp8 expert weight (values.py) would otherwise read the
    source twice more; on gfx942 the pipeline defers it to here (postload.py)."""
    if w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fnuz_normalize_ expects float8_e4m3fn, got {w.dtype}")
    b = w.view(torch.int8)
    nan = False
    if b.is_contiguous() and b.numel() % 8 == 0 and b.data_ptr() % 8 == 0 and b.numel():
        nan = _clear_0x80_bytes_(b.reshape(-1).view(torch.int64), find_nan)
    else:
        if find_nan and b.numel():
            nan = bool(((b & 0x7F) == 0x7F).any())
        b.masked_fill_(b == FNUZ_NAN_BYTE, 0)
    return b.view(torch.float8_e4m3fnuz), nan


def fnuz_scale(scale: torch.Tensor) -> torch.Tensor:
    """Doubled fp32 scale that goes with `fnuz_normalize` (spec §3.0.2 step 3)."""
    return scale.float() * FNUZ_SCALE_FACTOR


def target_scale(scale: torch.Tensor, target: str) -> torch.Tensor:
    """The fp32 scale as the target holds it: doubled on gfx942, unchanged on gfx950."""
    if FP8_DTYPE_BY_TARGET[target] == torch.float8_e4m3fnuz:
        return fnuz_scale(scale)
    return scale.float()


def to_target_fp8(w: torch.Tensor, scale: torch.Tensor, target: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Bring an e4m3fn weight and its fp32 scale to the target GPU's fp8 (spec §8.1)."""
    if FP8_DTYPE_BY_TARGET[target] == torch.float8_e4m3fnuz:
        return fnuz_normalize(w), fnuz_scale(scale)
    return w, scale.float()
