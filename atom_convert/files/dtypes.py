"""Format constants, each with the place it comes from.

spec = ../shared/spec/atom-layout.md (ATOM ffdf3bb5d, aiter e4048607a).
"""

from __future__ import annotations

import torch

# DeepSeek fp8 checkpoints: `quantization_config.weight_block_size` = [128, 128];
# ATOM maps it to per_1x128 (spec §1.4) and asserts 128 (spec §3.2).
FP8_BLOCK = 128

# e4m3fn on gfx950, e4m3fnuz on gfx942 (aiter dtypes.fp8, spec §3.0.1); one entry per targets.TARGETS.
FP8_DTYPE_BY_TARGET: dict[str, torch.dtype] = {
    "gfx950": torch.float8_e4m3fn,
    "gfx942": torch.float8_e4m3fnuz,
}

# The byte 0x80 is -0 in e4m3fn and NaN in e4m3fnuz; ATOM clears it to 0x00
# (normalize_e4m3fn_to_e4m3fnuz, spec §3.0.2).
FNUZ_NAN_BYTE = -128  # as int8
# The same bit pattern means half the e4m3fn value in e4m3fnuz (exponent bias 8
# instead of 7), so every scale is doubled (spec §3.0.2 step 3).
FNUZ_SCALE_FACTOR = 2.0

# Kernel shuffle tile (aiter shuffle_weight layout=(16, 16), spec §3.0.3).
SHUFFLE_ROWS = 16
SHUFFLE_K_ELEMS = 32  # columns per tile, in storage elements
SHUFFLE_K_BYTES = 16  # Ke = 16 / element size

# e8m0 (OCP MX spec §5.4.1): value 2^(b - 127); 0xFF is NaN.
E8M0_BIAS = 127
E8M0_NAN = 0xFF

# e2m1 code -> value, codes 8..15 are the negated set (spec §3.0.6).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# safetensors dtype codes (safetensors format; F8_E4M3FNUZ since 0.4.x).
ST_DTYPE: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2: "F8_E5M2",
}
DTYPE_FROM_ST: dict[str, torch.dtype] = {v: k for k, v in ST_DTYPE.items()}
_e8m0 = getattr(torch, "float8_e8m0fnu", None)
if _e8m0 is not None:
    ST_DTYPE[_e8m0] = "F8_E8M0"
    DTYPE_FROM_ST["F8_E8M0"] = _e8m0


def dtype_name(dtype: torch.dtype) -> str:
    """'torch.float8_e4m3fn' -> 'float8_e4m3fn' (the manifest's spelling)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dt
