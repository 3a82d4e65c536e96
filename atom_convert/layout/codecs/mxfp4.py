"""OCP MXFP4: e2m1 codes, two per byte (element 2i in the low nibble), with one
e8m0 scale byte per 32 elements (spec §3.0.6); the e8m0 scale shuffle
(spec §3.0.4); and the runtime's dynamic MXFP4 quantiser for the MLA operands
under ATOM_USE_TRITON_MXFP4_BMM=1 (spec §4.2, §10.1).
"""

from __future__ import annotations

import torch

from ...files.dtypes import E2M1_VALUES, E8M0_BIAS

MXFP4_BLOCK = 32  # elements per e8m0 scale
E8M0_SHUFFLE_ROWS = 256  # e8m0shuf pads rows to a multiple of 256 ...
E8M0_SHUFFLE_COLS = 8  # ... and columns to a multiple of 8 (spec §3.0.4)

_E2M1 = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float32)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> e2m1 codes uint8 [..., K]; low nibble first."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack([lo, hi], -1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes [..., K] -> uint8 [..., K/2]; element 2i in the low nibble."""
    c = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return c[..., 0] | (c[..., 1] << 4)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 byte b -> 2^(b-127) as fp32; b=0 is 2^-127 (a subnormal), 0xFF is NaN."""
    b = scale.to(torch.int32)
    out = torch.where(b == 0, torch.tensor(2.0**-127), torch.exp2((b - E8M0_BIAS).float()))
    return torch.where(b == 0xFF, torch.tensor(float("nan")), out)


def mxfp4_dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of packed e2m1 [..., K/2] with e8m0 scales [..., K/32]."""
    vals = _E2M1.to(packed.device)[unpack_codes(packed).long()]
    return vals * e8m0_to_float(scale).repeat_interleave(MXFP4_BLOCK, -1)


def e8m0_shuffle(scale: torch.Tensor) -> torch.Tensor:
    """aiter `e8m0_shuffle` (spec §3.0.4): zero-pad [m, n] to [ceil(m/256)*256, ceil(n/8)*8]
    (the runtime leaves the pad uninitialised; zeros are what a loader can rely on), then
    view [sm/32, 2, 16, sn/8, 2, 4] and permute (0, 3, 5, 2, 4, 1). Keeps the padded shape."""
    m, n = scale.shape
    sm = -(-m // E8M0_SHUFFLE_ROWS) * E8M0_SHUFFLE_ROWS
    sn = -(-n // E8M0_SHUFFLE_COLS) * E8M0_SHUFFLE_COLS
    p = torch.zeros(sm, sn, dtype=scale.dtype, device=scale.device)
    p[:m, :n] = scale
    return p.view(sm // 32, 2, 16, sn // 8, 2, 4).permute(0, 3, 5, 2, 4, 1).contiguous().view(sm, sn)


def e8m0_unshuffle(shuffled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `e8m0_shuffle`, cropped back to [rows, cols]."""
    sm, sn = shuffled.shape
    v = shuffled.view(sm // 32, sn // 8, 4, 16, 2, 2).permute(0, 5, 3, 1, 4, 2).contiguous().view(sm, sn)
    return v[:rows, :cols]


# Midpoints between adjacent e2m1 magnitudes; at a tie the even code wins (round half to even):
# 0.25 -> 0, 0.75 -> 1.0 (code 2), 1.25 -> 1.0, 1.75 -> 2.0 (code 4), 2.5 -> 2.0, 3.5 -> 4.0 (code 6), 5 -> 4.0.
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_TIE_UP = torch.tensor([False, True, False, True, False, True, False])  # upper neighbour's code is even


def dynamic_mxfp4_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """aiter's triton `dynamic_mxfp4_quant` at aiter e4048607a (the revision ATOM ffdf3bb5d
    pairs with), along the last dim in groups of 32 (spec §3.0.6, §10.1):

    1. amax of the block, rounded up: fp32 bits + 0x200000, mantissa cleared;
    2. e = floor(log2(amax_r)) - 2, clamped to [-127, 127]; scale byte e + 127;
    3. q = x * 2^-e, e2m1 by round half to even, saturating at 6; the sign bit is kept
       on values that round to zero (a small negative value is code 8, "-0").
    Quark's OCP MXFP4 quantiser gives the same scales and values but writes +0.
    Returns (packed uint8 [..., K/2], e8m0 uint8 [..., K/32]).
    """
    *lead, k = x.shape
    if k % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 quantisation needs the last dim to be a multiple of 32, got {k}")
    xb = x.float().reshape(*lead, k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = xb.abs().amax(-1)
    bits = (amax.view(torch.int32) + 0x200000) & 0x7F800000
    e = torch.floor(torch.log2(bits.view(torch.float32))) - 2
    e = e.clamp(-127, 127)
    q = xb * torch.exp2(-e)[..., None]
    mag = q.abs()
    mids, ties = _MIDPOINTS.to(x.device), _TIE_UP.to(x.device)
    code = (mag[..., None] > mids).sum(-1) + ((mag[..., None] == mids) & ties).sum(-1)
    code = code.clamp(max=7).to(torch.uint8)
    code = code | (torch.signbit(q).to(torch.uint8) << 3)
    scale = (e + E8M0_BIAS).to(torch.uint8)
    return pack_codes(code.reshape(*lead, k)), scale
