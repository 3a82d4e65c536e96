"""The per-tensor fp8 quantisation of the MLA batched-GEMM operands W_K/W_V (spec §4.1)."""

from __future__ import annotations

import torch


def per_tensor_quant(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """ATOM's `dynamic_per_batched_tensor_quant` (spec §4.1 step 5), bit for bit.

    One scale for the whole tensor; every step in bf16 as the runtime does it
    (amax, DTYPE_MAX / amax and x * s are bf16 tensors), the cast to fp8 rounds
    to nearest even. Returns (fp8 tensor, 0-dim fp32 dequant scale = 1 / float(s)).
    On gfx942 the target dtype is e4m3fnuz with max 240 and the scale is *not*
    doubled (spec §10).
    """
    if x.dtype != torch.bfloat16:
        raise TypeError(f"per_tensor_quant expects bf16 input, got {x.dtype}")
    fmax = torch.finfo(dtype).max
    lo, hi = x.aminmax()
    amax = torch.maximum(lo.abs(), hi.abs()).clamp(min=1e-10)
    s = fmax / amax
    q = (x * s).clamp(min=-fmax, max=fmax).to(dtype).contiguous()
    return q, s.float().reciprocal()
