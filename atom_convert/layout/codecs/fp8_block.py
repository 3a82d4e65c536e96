"""DeepSeek fp8 block format: e4m3fn weights with fp32 `weight_scale_inv`
per 128x128 block (partial edge blocks allowed), spec §3.2.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from ...errors import UnsupportedError
from .base import LinearCodec, LinearData, SourceFormat, is_excluded, string_list
from .bf16 import FLOAT_DTYPES, Bf16Linear
from ...files.dtypes import FP8_BLOCK

if TYPE_CHECKING:
    from ...files.source import SourceCheckpoint


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_grid(shape: tuple[int, int] | list[int], block: int = FP8_BLOCK) -> tuple[int, int]:
    """[ceil(out/128), ceil(in/128)]: DeepSeek's weight_scale_inv grid, partial edge blocks allowed."""
    return cdiv(shape[0], block), cdiv(shape[1], block)


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)


@functools.lru_cache(maxsize=None)
def _fp8_table(dtype: torch.dtype) -> Any:
    """fp32 value of each of the 256 codes of an fp8 dtype, by torch's own conversion (numpy array)."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).float().numpy()


def fp8_float(w: torch.Tensor) -> torch.Tensor:
    """`w.float()` of an fp8 tensor (any strides), bit for bit, as a new contiguous fp32 tensor: each
    byte looked up in `_fp8_table`. Why: torch's fp8 to fp32 conversion on a CPU decodes about 170 M
    elements per second on one core of the 2-core box, the lookup about 400 M. Any other dtype: a
    copy of `w` in fp32 (never `w` itself: the callers write into the result)."""
    if w.dtype not in _FP8_DTYPES:
        return w.to(torch.float32, copy=True, memory_format=torch.contiguous_format)
    import numpy as np  # comes with torch; not imported with atom_convert

    return torch.from_numpy(np.take(_fp8_table(w.dtype), w.view(torch.uint8).numpy()))


def _times_blocks(x: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """`x` [N, K] (fp32, contiguous, written into) times `scale`'s element of each block of it, the
    product in fp32 as `x * scale.repeat_interleave(...)` computes it. Whole blocks in place through a
    blocked view (no expanded copy of the scales); with partial edge blocks, the expanded scales."""
    n, k = x.shape
    gn, gk = scale_grid((n, k), block)
    if n % block == 0 and k % block == 0:
        x.view(gn, block, gk, block).mul_(scale[:gn, :gk].reshape(gn, 1, gk, 1))
        return x
    return x.mul_(scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k])


def block_dequant(w: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """fp32 value of a block-scaled fp8 weight [N, K] with scale [ceil(N/b), ceil(K/b)].

    DeepSeek's `weight_scale_inv` is already the dequant multiplier (spec §8.4).
    Works for e4m3fn and e4m3fnuz bytes alike (the dtype carries the decoding).
    """
    return _times_blocks(fp8_float(w), scale.float(), block)


def identity_readback(w: torch.Tensor, scale: torch.Tensor, target_fp8: torch.dtype,
                      block: int = FP8_BLOCK) -> torch.Tensor:
    """bf16 [N, K]: what ATOM reads back from a processed per_1x128 fp8 linear by its forward on an
    identity matrix (`get_and_maybe_dequant_weights`, atom/model_ops/utils.py 175-185; spec
    atom-layout.md §4.1 step 1, §6.4), with the arithmetic of aiter's kernels at e4m3fn/fnuz:
    the identity's rows are quantised per 1x128 (amax 1: scale fl32(1/max), code max), the
    blockscale GEMM's epilogue multiplies the fp32 partial sum max·w by the fp32 product of the
    two scales and accumulates from +0 (so -0 reads back as +0), then rounds to nearest-even bf16.
    On gfx942 the layer holds w/2 with a doubled scale and max is 240: the powers of two cancel,
    so the value is computed here from the source's e4m3fn `w` and `scale` with the target's max.
    """
    fmax = float(torch.finfo(target_fp8).max)
    a_scale = torch.tensor(1.0 / fmax, dtype=torch.float32)
    # ((w · max) · (a_scale · scale) + 0) in fp32, each product rounded as the epilogue rounds it
    return _times_blocks(fp8_float(w).mul_(fmax), a_scale * scale.float(), block).add_(0.0).to(torch.bfloat16)


def block_quant(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style 128x128 fp8 quantisation (used to synthesise fp8 checkpoints).

    scale = block amax / 448; partial edge blocks use their own amax.
    Returns (fp8 e4m3fn weight, fp32 scale_inv).
    """
    n, k = w.shape
    gn, gk = scale_grid((n, k), block)
    wp = torch.zeros(gn * block, gk * block, dtype=torch.float32)
    wp[:n, :k] = w.float()
    blocks = wp.view(gn, block, gk, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    fmax = torch.finfo(torch.float8_e4m3fn).max
    scale = (amax / fmax).float()
    q = (blocks / scale[:, None, :, None]).clamp(-fmax, fmax).view(gn * block, gk * block)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


# The dtypes a `weight_scale_inv` may be stored in: the float dtypes read anywhere (codecs/bf16.py). DeepSeek's
# are fp32; a bf16 or fp16 one converts to fp32 exactly, as ATOM's fp32 scale parameters take it in their copy_
# (under ATOM's own loader, a source with bf16 scales holds the same bytes as one with those values in fp32:
# VERIFICATION.md). Read with `.float()` below.
SCALE_DTYPES = FLOAT_DTYPES


class Fp8BlockLinear(LinearCodec, codec="fp8-block"):
    """`{m}.weight` float8_e4m3fn [N, K] + `{m}.weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)]."""

    quantized = True

    def source_names(self, module: str) -> list[str]:
        return [f"{module}.weight", f"{module}.weight_scale_inv"]

    def check(self, src: "SourceCheckpoint", module: str, out_f: int, in_f: int) -> list[str]:
        w, s = self.source_names(module)
        grid = list(scale_grid((out_f, in_f)))
        problems = []
        if w not in src:
            problems.append(f"missing tensor {w} (expected float8_e4m3fn [{out_f}, {in_f}])")
        else:
            info = src.info(w)
            if info.dtype != torch.float8_e4m3fn:
                problems.append(
                    f"{info.file}: tensor {w} has dtype {info.dtype}, expected float8_e4m3fn "
                    f"(quantization_config says fp8 block and the layer is not in its ignore list)"
                )
            if info.shape != (out_f, in_f):
                problems.append(f"{info.file}: tensor {w} has shape {list(info.shape)}, expected [{out_f}, {in_f}]")
        if s not in src:
            problems.append(f"missing tensor {s} (expected float32 scale grid {grid} for {w})")
        else:
            info = src.info(s)
            if info.dtype not in SCALE_DTYPES:
                problems.append(f"{info.file}: tensor {s} has dtype {info.dtype}, expected float32 (bfloat16 and "
                                f"float16 scales are read too)")
            if list(info.shape) != grid:
                problems.append(
                    f"{info.file}: scale grid mismatch: {s} has shape {list(info.shape)}, expected {grid} "
                    f"= [ceil({out_f}/128), ceil({in_f}/128)] for 128x128 blocks"
                )
        return problems

    def read(self, src: "SourceCheckpoint", module: str, axis: int | None = None, start: int = 0, stop: int = 0,
             defer_check: bool = False) -> LinearData:
        w, s = self.source_names(module)
        check = not defer_check
        if axis is None:
            d, origin, worigin = LinearData(src.get(w, check), src.get(s).float()), (), ()
        else:
            # Callers slice on 128-row/column boundaries (checked at planning, spec §3.2).
            b0, b1 = start // FP8_BLOCK, cdiv(stop, FP8_BLOCK)
            if axis == 0:
                d, origin = LinearData(src.get_rows(w, start, stop, check), src.get_rows(s, b0, b1).float()), (b0,)
                worigin = (start,)
            else:
                # The weight as a strided view: every consumer (fnuz, shuffle16, dequant) copies it anyway.
                d, origin = LinearData(src.get_cols(w, start, stop, contiguous=False, check=check),
                                       src.get_cols(s, b0, b1).float()), (0, b0)
                worigin = (0, start)
        if defer_check:
            d.recheck = src.recheck(w, d.weight, worigin)
        assert d.scale is not None
        src.values.scales(s, src.info(s).file, d.scale, origin)  # a zero or negative scale is finite but wrong
        return d

    def dequant(self, data: LinearData) -> torch.Tensor:
        assert data.scale is not None
        return block_dequant(data.weight, data.scale)


# The keys under which ATOM's GenericParser finds excluded modules (spec §1.4).
_EXCLUDE_KEYS = ("ignore", "modules_to_not_convert", "exclude", "ignored_layers")


class Fp8BlockFormat(SourceFormat, fmt="fp8-block"):
    description = "DeepSeek fp8: quant_method 'fp8', e4m3, weight_block_size [128, 128]"

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        q = config["quantization_config"]
        self.excluded: list[str] = [p for k in _EXCLUDE_KEYS for p in string_list(q, k, "config.json")]

    @classmethod
    def matches(cls, qcfg: dict[str, Any] | None) -> bool:
        if not qcfg or qcfg.get("quant_method") != "fp8":
            return False
        bs = qcfg.get("weight_block_size")
        fmt = qcfg.get("fmt", "e4m3")
        if not isinstance(bs, list) or bs != [FP8_BLOCK, FP8_BLOCK] or fmt != "e4m3":
            raise UnsupportedError(
                f"config.json: fp8 quantization_config with fmt={fmt!r}, weight_block_size={bs!r} is not supported; "
                f"atom-convert reads DeepSeek's fp8 format (fmt 'e4m3', weight_block_size [128, 128])"
            )
        # ATOM's quant_spec reads activation_scheme 'static' (or is_dynamic false) as activations scaled by
        # per-tensor input_scale tensors loaded from the checkpoint; DeepSeek's block fp8 has none.
        scheme, dynamic = qcfg.get("activation_scheme"), qcfg.get("is_dynamic", True)
        if not (scheme is None or (isinstance(scheme, str) and scheme.lower() == "dynamic")) or dynamic is not True:
            raise UnsupportedError(
                f"config.json: fp8 quantization_config with activation_scheme={scheme!r}"
                + (f", is_dynamic={dynamic!r}" if dynamic is not True else "") + " is not supported: ATOM then "
                "scales activations by input_scale tensors loaded from the checkpoint, which DeepSeek's fp8 format "
                "does not have; atom-convert reads activation_scheme 'dynamic' (or none), as DeepSeek's releases "
                "write it"
            )
        return True

    def codec_for(self, module: str) -> LinearCodec:
        return Bf16Linear() if is_excluded(module, self.excluded) else Fp8BlockLinear()

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "block": [FP8_BLOCK, FP8_BLOCK], "excluded": self.excluded}
