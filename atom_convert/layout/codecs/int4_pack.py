"""compressed-tensors int4 `pack-quantized` (W4A16, symmetric, group 32): Kimi-K2-Thinking's and
Kimi-K2.5's routed experts (atom-layout-next.md §4.1).

Per linear `{m}`: `{m}.weight_packed` int32 [N, K/8] (eight 4-bit codes per word, offset-binary
q + 8, element k in bits 4*(k % 8) .. +3 of word k // 8: on a little-endian view byte b holds
element 2b in its low nibble, 2b+1 in its high nibble), `{m}.weight_scale` in the model dtype
[N, K/32] (one per 32 consecutive inputs) and `{m}.weight_shape` [2] = [N, K] (int32 in Kimi's
files, int64 when compressed-tensors 0.20 writes it: both accepted). No zero point (symmetric).

Dequantisation is `q * scale` with the scale broadcast over its group. compressed-tensors computes
it in the scale's dtype, which rounds the product to bf16 (q*s needs up to 11 significant bits);
here the scale is upcast to fp32 first, so the value is the exact q*s, as amd-quark recovers it
before requantising (§4.1, §4.4). ATOM has no int4 MoE (§4.2): such a source converts only with
--quantize (codecs/requant.py).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

from ...errors import CheckpointError, ConfigError, UnsupportedError, json_kind
from .base import LinearCodec, LinearData, SourceFormat, is_excluded, string_list
from .bf16 import FLOAT_DTYPES, Bf16Linear

if TYPE_CHECKING:
    from ...files.source import SourceCheckpoint

INT4_GROUP = 32  # inputs per scale
PER_WORD = 8  # int4 codes per int32 word
_SHAPE_DTYPES = (torch.int32, torch.int64)
# Where ATOM's MoE takes a routed expert's linears (the modules an int4 source may hold as int4).
ROUTED_EXPERT = re.compile(r"^(?:.*\.)?mlp\.experts\.\d+\.(?:gate|up|down)_proj$")


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., K/8] -> int8 codes q in [-8, 7] [..., K]: nibble j of word w is element 8w + j,
    stored as q + 8 (compressed-tensors `pack_to_int32`, offset-binary)."""
    b = packed.contiguous().view(torch.uint8)  # little-endian: byte b = elements 2b (low), 2b+1 (high)
    lo, hi = b & 0x0F, b >> 4
    return (torch.stack([lo, hi], -1).flatten(-2).to(torch.int8) - 8)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Inverse of `unpack_int4`: int codes in [-8, 7] [..., K] (K % 8 == 0) -> int32 [..., K/8]."""
    u = (q.to(torch.int16) + 8).to(torch.uint8).unflatten(-1, (-1, 2))
    return (u[..., 0] | (u[..., 1] << 4)).contiguous().view(torch.int32)


def int4_dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Exact fp32 q * s: codes of `packed` [..., K/8] times fp32(scale) [..., K/32] per group."""
    q = unpack_int4(packed).float()
    return q * scale.float().repeat_interleave(INT4_GROUP, -1)


class Int4PackLinear(LinearCodec, codec="int4-pack"):
    """`{m}.weight_packed` int32 [N, K/8], `{m}.weight_scale` bf16 [N, K/32], `{m}.weight_shape` [2]."""

    quantized = True

    def source_names(self, module: str) -> list[str]:
        return [f"{module}.weight_packed", f"{module}.weight_scale", f"{module}.weight_shape"]

    def check(self, src: "SourceCheckpoint", module: str, out_f: int, in_f: int) -> list[str]:
        p, s, sh = self.source_names(module)
        if in_f % INT4_GROUP:
            return [f"{module}: {in_f} input features are not a multiple of the int4 group of {INT4_GROUP}"]
        problems = []
        for name, dtypes, shape, what in (
                (p, (torch.int32,), (out_f, in_f // PER_WORD), f"int32, eight int4 codes per word, K/8 = {in_f}/8"),
                (s, FLOAT_DTYPES, (out_f, in_f // INT4_GROUP), f"one scale per {INT4_GROUP} inputs, K/32 = {in_f}/32"),
                (sh, _SHAPE_DTYPES, (2,), f"the unpacked shape [{out_f}, {in_f}]")):
            if name not in src:
                problems.append(f"missing tensor {name} (expected {list(shape)}: {what}; compressed-tensors "
                                f"pack-quantized)")
                continue
            info = src.info(name)
            if info.dtype not in dtypes:
                problems.append(f"{info.file}: tensor {name} has dtype {info.dtype}, expected "
                                f"{' or '.join(str(d) for d in dtypes)} ({what})")
            elif info.shape != shape:
                problems.append(f"{info.file}: tensor {name} has shape {list(info.shape)}, expected {list(shape)} "
                                f"({what})")
        return problems

    def _check_shape_value(self, src: "SourceCheckpoint", module: str) -> None:
        """weight_shape's stored value against the packed tensor's header (8-16 bytes, read with the
        expert's data, never at planning: a dry run reads headers only)."""
        p, _, sh = self.source_names(module)
        info = src.info(p)
        want = [info.shape[0], info.shape[1] * PER_WORD]
        got = [int(v) for v in src.get(sh).tolist()]
        if got != want:
            raise CheckpointError([f"{src.info(sh).file}: tensor {sh} holds {got}, expected {want} (the unpacked "
                                   f"shape of {p}, {list(info.shape)} int32 words)"],
                                  hint="The source does not match its config.json; fix or re-download it.")

    def read(self, src: "SourceCheckpoint", module: str, axis: int | None = None, start: int = 0, stop: int = 0,
             defer_check: bool = False) -> LinearData:  # checked as read (defer_check ignored)
        p, s, _ = self.source_names(module)
        self._check_shape_value(src, module)
        if axis is None:
            d, origin = LinearData(src.get(p), src.get(s)), ()
        elif axis == 0:
            d, origin = LinearData(src.get_rows(p, start, stop), src.get_rows(s, start, stop)), (start,)
        else:
            if start % INT4_GROUP or stop % INT4_GROUP:
                raise UnsupportedError(f"{module}: columns [{start}, {stop}) do not fall on {INT4_GROUP}-input int4 "
                                       f"groups")
            d = LinearData(src.get_cols(p, start // PER_WORD, stop // PER_WORD),
                           src.get_cols(s, start // INT4_GROUP, stop // INT4_GROUP))
            origin = (0, start // INT4_GROUP)
        assert d.scale is not None
        # NaN/Inf are refused by the read; a zero or negative scale is finite but no symmetric int4 scale.
        src.values.scales(s, src.info(s).file, d.scale.float(), origin)
        return d

    def dequant(self, data: LinearData) -> torch.Tensor:
        assert data.scale is not None
        return int4_dequant(data.weight, data.scale)


_WEIGHTS_WANTED = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": INT4_GROUP}


def _check_group(where: str, name: str, group: Any) -> list[str]:
    if not isinstance(group, dict):
        raise ConfigError(f"{where}: quantization_config.config_groups[{name!r}] is {json_kind(group)}, expected an "
                          f"object (targets, weights, input_activations)")
    w = group.get("weights")
    if not isinstance(w, dict):
        return [f"config_groups[{name!r}].weights is {json_kind(w)} (expected an int4 weight scheme)"]
    problems = [f"config_groups[{name!r}].weights.{k} is {w.get(k)!r} (expected {v!r})"
                for k, v in _WEIGHTS_WANTED.items() if w.get(k) != v]
    if w.get("actorder") not in (None, "static"):
        problems.append(f"config_groups[{name!r}].weights.actorder is {w.get('actorder')!r} (a g_idx reordering)")
    for k in ("input_activations", "output_activations"):
        if group.get(k) is not None:
            problems.append(f"config_groups[{name!r}].{k} is set (atom-convert reads weight-only W4A16)")
    return problems


class CompressedTensorsInt4Format(SourceFormat, fmt="ct-int4-pack"):
    description = ("compressed-tensors 'pack-quantized' int4 W4A16 (symmetric, group 32; Kimi-K2-Thinking), "
                   "with --quantize mxfp4 or fp8")
    # ATOM serves no int4 MoE (atom-layout-next.md §4.2): engine/planning refuses it without --quantize.
    needs_requant = True

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        q = config["quantization_config"]
        where = "config.json"
        self.ignore: list[str] = list(string_list(q, "ignore", where))
        groups = q.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ConfigError(f"{where}: quantization_config.config_groups is {json_kind(groups)}, expected an object "
                              f"with one int4 weight group (compressed-tensors pack-quantized)")
        problems = [p for n, g in groups.items() for p in _check_group(where, n, g)]
        if q.get("quantization_status", "compressed") != "compressed":
            problems.append(f"quantization_status is {q.get('quantization_status')!r} (expected 'compressed')")
        if problems:
            raise UnsupportedError(f"{where}: compressed-tensors pack-quantized config not supported: "
                                   f"{'; '.join(problems)}. atom-convert reads int4 W4A16 symmetric group-32 weights "
                                   f"(Kimi-K2-Thinking's format, atom-layout-next.md §4.1)")
        for n, g in groups.items():
            targets = g.get("targets")
            if not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
                raise ConfigError(f"{where}: quantization_config.config_groups[{n!r}].targets is {json_kind(targets)}, "
                                  f"expected a list of module types or patterns")
            if [t for t in targets if t not in ("Linear", "nn.Linear", "torch.nn.Linear")]:
                raise UnsupportedError(f"{where}: config_groups[{n!r}].targets {targets!r}: atom-convert reads groups "
                                       f"that target every Linear (the ignore list picks the unquantized ones)")

    @classmethod
    def matches(cls, qcfg: dict[str, Any] | None) -> bool:
        return bool(qcfg) and qcfg.get("quant_method") == "compressed-tensors" \
            and qcfg.get("format") == "pack-quantized"  # type: ignore[union-attr]

    def codec_for(self, module: str) -> LinearCodec:
        return Bf16Linear() if is_excluded(module, self.ignore) else Int4PackLinear()

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "group_size": INT4_GROUP, "ignore": self.ignore}
