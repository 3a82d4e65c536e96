"""`--quantize mxfp4|fp8`: re-encode a source ATOM cannot serve as shipped (compressed-tensors int4,
atom-layout-next.md §4), or a bf16 one, into a format ATOM's MoE serves, while converting.

How it works: `served_format(fmt, quantize, target)` wraps the source's format. For each linear
module the wrapper says whether it is re-encoded; a re-encoded module gets a codec that reads the
source's slice through the source's own codec, dequantises it exactly (int4: q * fp32(s), no bf16
round trip; bf16: the bf16 values) and quantises it:
- mxfp4 (gfx950; routed experts): Quark's OCP MXFP4 rule (§4.4, `quark_mxfp4_quant`), so the
  bytes equal what amd-quark exports from the same values;
- fp8 (gfx942, gfx950): DeepSeek's 128x128 block rule (§4.5, fp8_block.block_quant: fp32 scale
  = block amax / 448, w / scale rounded to e4m3fn, partial edge blocks with their own amax); for an
  int4 source the routed experts, for a bf16 source every linear DeepSeek's fp8 release quantises.
The codec then carries the target format's name ("mxfp4", "fp8-block"), so the rest of the
conversion is the ordinary MXFP4 / fp8 one (stacking, padding, fnuz, shuffles). The slices a rank
reads start on whole groups (32 inputs) and blocks (128 rows/columns, planning checks), so the
slice quantises to the same bytes as the whole tensor cut afterwards.

`served_quantization_config` is the `quantization_config` the converted directory's config.json
carries, so that a runtime reading it builds the served format (ATOM's Quark parser for MXFP4, its
GenericParser for fp8, spec §1.4), with every module that is not re-encoded excluded.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

from ...errors import BadInputError, UnsupportedError
from ...files.dtypes import E8M0_BIAS, FP8_BLOCK
from .base import LinearCodec, LinearData, SourceFormat
from .fp8_block import block_dequant, block_quant
from .int4_pack import ROUTED_EXPERT
from .mxfp4 import MXFP4_BLOCK, mxfp4_dequant, pack_codes

if TYPE_CHECKING:
    from ...files.source import SourceCheckpoint

QUANTIZE_CHOICES = ("mxfp4", "fp8")
QUANTIZE_TARGETS = {"mxfp4": ("gfx950",), "fp8": ("gfx942", "gfx950")}

# --------------------------------------------------------------------------------------------
# The two quantisers
# --------------------------------------------------------------------------------------------

def mxfp4_exponent(x: torch.Tensor) -> torch.Tensor:
    """Quark's "even" e8m0 exponent per 32 along the last dim of fp32 x [..., K/32, 32] (spec §4.4 step 1,
    quark `even_round`): amax's fp32 bits + (1 << 21), mantissa cleared (so [1.75, 2)·2^k rounds up to
    2^(k+1)), exponent floor(log2) - 2, clamped to [-127, 127]; an all-zero group gets -127 (its
    stored byte is 1, see `quark_mxfp4_quant`)."""
    amax = x.abs().amax(-1)
    bits = (amax.view(torch.int32) + (1 << 21)) & 0x7F800000
    return (torch.floor(torch.log2(bits.view(torch.float32))) - 2).clamp(-127, 127)


_ROWS = 16  # rows quantised at a time: the fp32 temporaries of 16 rows of 7168 stay in the core's cache


def _e2m1_codes(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e2m1 codes uint8 [..., G, 32], exponent [..., G]) of fp32 groups xb [..., G, 32], Quark's rounding."""
    e = mxfp4_exponent(xb)
    q = xb * torch.exp2(-e)[..., None]  # exact: a power of two (e >= -127 keeps 2^-e finite); |q| < 8
    m = q.abs()
    small = m < 1
    # [0, 1): spacing 0.5 (e2m1's subnormals 0, 0.5): one fp32 addition rounds m to that grid, half to even.
    sub = ((m + 4194304.0) - 4194304.0).mul_(2).to(torch.int32)
    # [1, 8): one mantissa bit, half to even on the fp32 bits (add half an ulp minus one, plus the kept
    # bit), then (exponent field << 1 | mantissa bit) - 252 is the code: 1.0 -> 2, 1.5 -> 3, ..., 6 -> 7;
    # 7 and above round to 8 or more and saturate at code 7 (6.0).
    b = m.view(torch.int32)
    nrm = ((b + 0x1FFFFF + ((b >> 22) & 1)) >> 22) - 252
    code = torch.where(small, sub, nrm).clamp_(0, 7).to(torch.uint8)
    code |= (torch.signbit(q) & (code != 0)).to(torch.uint8) << 3  # a value rounded to zero stays +0
    return code, e


def quark_mxfp4_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """amd-quark 0.13's OCP MXFP4 weight quantisation along the last dim (spec §4.4): e8m0 scale
    2^e by `mxfp4_exponent`, elements x / 2^e in fp32 rounded to e2m1 half-to-even, saturating at
    6, and a value that rounds to zero written +0 (code 0, never 8: Quark's packer). Returns
    (packed uint8 [..., K/2], element 2i in the low nibble; e8m0 uint8 [..., K/32]). Byte-equal to
    amd-quark's own quantiser (tests/test_int4.py)."""
    *lead, k = x.shape
    if k % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 quantisation needs the last dim to be a multiple of 32, got {k}")
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    packed = torch.empty(rows, k // 2, dtype=torch.uint8, device=x.device)
    scale = torch.empty(rows, k // MXFP4_BLOCK, dtype=torch.uint8, device=x.device)
    for a in range(0, rows, _ROWS):
        code, e = _e2m1_codes(x2[a:a + _ROWS].float().reshape(-1, k // MXFP4_BLOCK, MXFP4_BLOCK))
        packed[a:a + _ROWS] = pack_codes(code.reshape(-1, k))
        # Quark's exporter writes the byte of max(scale, 2^-126) (`to_e8m0_uint8` takes a log2 clamped at
        # the smallest normal fp32), while its codes use the 2^-127 scale: an all-zero group (or one with
        # amax < 2^-124, which no real weight reaches) gets byte 1, not 0 (checked against amd-quark 0.13).
        scale[a:a + _ROWS] = (e + E8M0_BIAS).clamp_(min=1).to(torch.uint8)
    return packed.reshape(*lead, k // 2), scale.reshape(*lead, k // MXFP4_BLOCK)


def fp8_block_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's fp8 block-128 rule (spec §4.5): (e4m3fn [N, K], fp32 scale_inv [ceil(N/128), ceil(K/128)])."""
    return block_quant(w, FP8_BLOCK)


# --------------------------------------------------------------------------------------------
# Codecs and the wrapping format
# --------------------------------------------------------------------------------------------


class _Requant(LinearCodec):
    """A module re-encoded while reading: the source codec's exact values, quantised."""

    quantized = True

    def __init__(self, inner: LinearCodec):
        self.inner = inner

    def source_names(self, module: str) -> list[str]:
        return self.inner.source_names(module)

    def check(self, src: "SourceCheckpoint", module: str, out_f: int, in_f: int) -> list[str]:
        return self.inner.check(src, module, out_f, in_f)

    # fp32 copies of one linear that the re-encoding holds at its peak (values, and the quantiser's own)
    _FP32_COPIES = 1

    def scratch_bytes(self, rows: int, cols: int) -> int:
        """Peak bytes beyond the output while re-encoding one [rows, cols] linear (sizes the workers'
        memory budget with the output chunk, engine/workers.working_set)."""
        return self._FP32_COPIES * 4 * rows * cols

    def _values(self, src: "SourceCheckpoint", module: str, axis: int | None, start: int, stop: int) -> torch.Tensor:
        return self.inner.dequant(self.inner.read(src, module, axis, start, stop))


class ToMxfp4(_Requant):
    name = "mxfp4"

    def check(self, src: "SourceCheckpoint", module: str, out_f: int, in_f: int) -> list[str]:
        if in_f % MXFP4_BLOCK:
            return [f"{module}: {in_f} input features are not a multiple of the MXFP4 group of 32 (--quantize mxfp4)"]
        return super().check(src, module, out_f, in_f)

    def read(self, src: "SourceCheckpoint", module: str, axis: int | None = None, start: int = 0, stop: int = 0,
             defer_check: bool = False) -> LinearData:
        if axis == 1 and (start % MXFP4_BLOCK or stop % MXFP4_BLOCK):
            raise UnsupportedError(f"{module}: columns [{start}, {stop}) do not fall on 32-input MXFP4 groups")
        packed, scale = quark_mxfp4_quant(self._values(src, module, axis, start, stop))
        return LinearData(packed, scale)

    def dequant(self, data: LinearData) -> torch.Tensor:
        assert data.scale is not None
        return mxfp4_dequant(data.weight, data.scale)


class ToFp8Block(_Requant):
    name = "fp8-block"
    _FP32_COPIES = 3  # the values, block_quant's padded copy and its quotient

    def read(self, src: "SourceCheckpoint", module: str, axis: int | None = None, start: int = 0, stop: int = 0,
             defer_check: bool = False) -> LinearData:
        if axis is not None and (start % FP8_BLOCK or (stop % FP8_BLOCK and stop != _extent(self, src, module, axis))):
            raise UnsupportedError(f"{module}: a slice [{start}, {stop}) of dim {axis} does not start on a 128 fp8 "
                                   f"block (--quantize fp8)")
        w, s = fp8_block_quant(self._values(src, module, axis, start, stop))
        return LinearData(w, s)

    def dequant(self, data: LinearData) -> torch.Tensor:
        assert data.scale is not None
        return block_dequant(data.weight, data.scale)


def _extent(codec: _Requant, src: "SourceCheckpoint", module: str, axis: int) -> int:
    """The full size of dim `axis` of the module's weight (the last block of a slice may be partial)."""
    first = codec.source_names(module)[0]
    shape = src.info(first).shape
    return shape[axis] * (8 if first.endswith(".weight_packed") and axis == 1 else 1)


# DeepSeek's fp8 release keeps these bf16 (the router, embeddings, heads, norms are no codec's; the
# MTP eh_proj is stored bf16 without a scale, synth._NOT_QUANTIZED, and deepseek.py then plans it bf16).
_FP8_KEPT_BF16 = re.compile(r"^(?:.*\.)?eh_proj$")


class RequantFormat(SourceFormat):
    """The source's format, with the modules `quantize` re-encodes given a re-encoding codec."""

    def __init__(self, inner: SourceFormat, quantize: str):
        super().__init__(inner.config)
        self.inner, self.quantize = inner, quantize
        self.name = inner.name  # type: ignore[misc]  (the manifest's source quant_format stays the source's)
        self.description = inner.description  # type: ignore[misc]
        self._cache: dict[str, LinearCodec] = {}

    @classmethod
    def matches(cls, qcfg: dict[str, Any] | None) -> bool:  # never detected: built by served_format
        return False

    def reencodes(self, module: str) -> bool:
        c = self.inner.codec_for(module)
        if c.name == "int4-pack":
            if not ROUTED_EXPERT.match(module):
                raise UnsupportedError(
                    f"config.json: the compressed-tensors config makes {module} int4, but atom-convert re-encodes "
                    f"int4 routed experts only (Kimi-K2-Thinking's layout, atom-layout-next.md §4.1); add it to "
                    f"quantization_config.ignore if the checkpoint stores it unquantized")
            return True
        if c.name != "bf16":
            return False
        if self.quantize == "mxfp4" or self.inner.name != "bf16":
            return bool(ROUTED_EXPERT.match(module))  # int4 source: its bf16 modules stay bf16
        return not _FP8_KEPT_BF16.match(module)  # bf16 source, fp8: every linear DeepSeek's release quantises

    def codec_for(self, module: str) -> LinearCodec:
        c = self._cache.get(module)
        if c is None:
            inner = self.inner.codec_for(module)
            if self.reencodes(module):
                c = ToMxfp4(inner) if self.quantize == "mxfp4" else ToFp8Block(inner)
            else:
                c = inner
            self._cache[module] = c
        return c

    def summary(self) -> dict[str, Any]:
        return {**self.inner.summary(), "requantized_to": self.quantize}

    def record(self) -> dict[str, Any]:
        """The manifest's `requantization` block (spec atom-layout-next.md §6: the route changes bytes)."""
        int4 = self.inner.name == "ct-int4-pack"
        src_what = ("compressed-tensors int4 pack-quantized (W4A16, symmetric, group 32)" if int4
                    else "bf16 weights")
        value = ("exact fp32 q * scale (the bf16 int4 scale upcast to fp32, no bf16 round trip)" if int4
                 else "the bf16 values")
        if self.quantize == "mxfp4":
            to = "mxfp4"
            rounding = ("amd-quark 0.13 OCP MXFP4: e8m0 'even' scale per 32 inputs (amax fp32 bits + 2^21, mantissa "
                        "cleared, floor(log2) - 2), e2m1 round half to even, saturating at 6, zero as +0 "
                        "(atom-layout-next.md §4.4)")
            bound = ("per element |err| <= 2^e (the group's e8m0 scale, <= amax/4)"
                     + ("; <= 1.6 int4 steps (1.6 * the group's int4 scale)" if int4 else ""))
            modules = "routed experts"
        else:
            to = "fp8-block"
            rounding = ("DeepSeek fp8 block 128x128: fp32 scale_inv = block amax / 448 (partial edge blocks with their "
                        "own amax), w / scale rounded to e4m3fn (atom-layout-next.md §4.5)")
            bound = "per element |err| <= max(2^-4 |w|, 2^-10 * block scale)"
            modules = "routed experts" if int4 else "every linear DeepSeek's fp8 release quantises (eh_proj kept bf16)"
        return {"from": self.inner.name, "from_description": src_what, "to": to, "quantize": self.quantize,
                "input": value, "rounding": rounding, "modules": modules, "bound": bound,
                "quantization_config": served_quantization_config(self.inner, self.quantize)}


def served_format(fmt: SourceFormat, quantize: str | None, target: str, where: str = "config.json") -> SourceFormat:
    """The format a conversion reads `fmt` through for `quantize` (None: as stored). Refuses an
    int4 source without --quantize (ATOM has no int4 MoE), --quantize mxfp4 off gfx950, and
    --quantize for a source that is already quantized in a format ATOM serves."""
    if quantize is None:
        if getattr(fmt, "needs_requant", False):
            raise UnsupportedError(
                f"{where}: a compressed-tensors int4 'pack-quantized' (W4A16) checkpoint: ATOM has no int4 MoE method "
                f"(its fused MoE serves bf16, fp8 and MXFP4 experts only, atom-layout-next.md §4.2), so its experts "
                f"cannot be converted as stored. Re-encode them while converting: --quantize mxfp4 (gfx950, amd-quark's "
                f"MXFP4 rounding) or --quantize fp8 (gfx942 or gfx950, DeepSeek's fp8 block-128)")
        return fmt
    if quantize not in QUANTIZE_CHOICES:
        raise BadInputError(f"--quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")
    if target not in QUANTIZE_TARGETS[quantize]:
        raise UnsupportedError(
            f"--quantize {quantize} --target {target}: ATOM serves MXFP4 MoE on gfx950 only (on gfx942 it forces its "
            f"triton path, atom-layout-next.md §4.3); use --quantize fp8 for {target}")
    if fmt.name not in ("bf16", "ct-int4-pack"):
        raise UnsupportedError(
            f"{where}: --quantize {quantize} with a {fmt.name} source ({fmt.description}): atom-convert re-encodes "
            f"compressed-tensors int4 and bf16 sources; this one is already in a format ATOM serves, convert it "
            f"without --quantize")
    return RequantFormat(fmt, quantize)


# --------------------------------------------------------------------------------------------
# The converted directory's quantization_config
# --------------------------------------------------------------------------------------------

# Every module but the routed experts, in ATOM's exclusion syntax (spec §1.4: `re:` full-match regexes
# and dotted prefixes), for sources whose config has no list of its own (bf16). Kimi's int4 release
# uses the same patterns (atom-layout-next.md §4.1); eh_proj is the MTP layer's.
NON_EXPERT_PATTERNS = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*eh_proj.*"]
FP8_SERVED = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def _mxfp4_spec(dynamic: bool) -> dict[str, Any]:
    return {"dtype": "fp4", "qscheme": "per_group", "group_size": MXFP4_BLOCK, "ch_axis": -1, "is_dynamic": dynamic,
            "scale_format": "e8m0", "scale_calculation_mode": "even", "round_method": "half_even",
            "observer_cls": "PerBlockMXObserver", "scale_type": "float", "symmetric": None, "mx_element_dtype": None}


def quark_mxfp4_served(exclude: list[str]) -> dict[str, Any]:
    """Quark 0.13's export config for OCP MXFP4 weights (static) with dynamic MXFP4 inputs, as amd-quark
    writes it for its MXFP4 Kimi/DeepSeek exports."""
    return {"quant_method": "quark", "version": "0.13", "quant_mode": "eager_mode",
            "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                       "weight_format": "real_quantized", "weight_merge_groups": None},
            "exclude": list(exclude),
            "global_quant_config": {"weight": _mxfp4_spec(False), "input_tensors": _mxfp4_spec(True),
                                    "output_tensors": None, "bias": None},
            "layer_quant_config": {}, "layer_type_quant_config": {}, "kv_cache_quant_config": {},
            "algo_config": None, "softmax_quant_spec": None}


def served_quantization_config(inner: SourceFormat, quantize: str) -> dict[str, Any]:
    """The config.json `quantization_config` of a conversion of `inner` with --quantize `quantize`."""
    int4 = inner.name == "ct-int4-pack"
    exclude = list(getattr(inner, "ignore", [])) if int4 else list(NON_EXPERT_PATTERNS)
    if int4:  # the source's own list, plus the MTP layer's eh_proj when a DeepSeek-like int4 source has one
        exclude += [p for p in NON_EXPERT_PATTERNS if p not in exclude and p == "re:.*eh_proj.*"]
    if quantize == "mxfp4":
        return quark_mxfp4_served(exclude)
    if int4:
        return dict(FP8_SERVED, ignore=exclude)
    return dict(FP8_SERVED)  # DeepSeek's own fp8 release config (eh_proj is bf16 without a scale there too)
