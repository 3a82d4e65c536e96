"""gfx942 fp8: e4m3fn bytes normalised to e4m3fnuz, scales doubled (spec §3.0.2, §8.1).

Not idempotent: applied exactly once per weight, by the conversion pipeline.
"""

from __future__ import annotations

import torch

from .formats import FNUZ_NAN_BYTE, FNUZ_SCALE_FACTOR, FP8_DTYPE_BY_TARGET


def fnuz_normalize(w: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes -> e4m3fnuz tensor (spec §3.0.2): clear 0x80, reinterpret.

    The caller doubles every scale of the same weight exactly once. The result
    holds half the e4m3fn value per element; with the doubled scale the
    dequantised value is unchanged.
    """
    if w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fnuz_normalize expects float8_e4m3fn, got {w.dtype}")
    b = w.view(torch.int8)
    return b.masked_fill(b == FNUZ_NAN_BYTE, 0).view(torch.float8_e4m3fnuz)


def fnuz_normalize_(w: torch.Tensor) -> torch.Tensor:
    """`fnuz_normalize` in place on a fresh e4m3fn tensor the caller owns (a shuffled output:
    the normalisation is per byte, so it commutes with the shuffle); returns the e4m3fnuz view."""
    if w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fnuz_normalize_ expects float8_e4m3fn, got {w.dtype}")
    b = w.view(torch.int8)
    b.masked_fill_(b == FNUZ_NAN_BYTE, 0)
    return b.view(torch.float8_e4m3fnuz)


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
