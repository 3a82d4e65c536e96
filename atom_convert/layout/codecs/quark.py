"""AMD Quark exports (`quant_method: quark`) with OCP MXFP4 weights.

Per module, the spec is resolved the way ATOM HEAD's QuarkParser and
`_is_excluded` do it (spec §1.4): the exclude list first (`re:` regexes, globs,
exact names or dotted prefixes), then `layer_quant_config` patterns (first
match wins; a pattern with `*` is an fnmatch glob, one without matches when the
module name is a substring of it), then `layer_type_quant_config` (by module
type: every converted module is a Linear), then `global_quant_config`.
Only MXFP4 (fp4 e2m1, per_group 32, e8m0 scales, static weights) and unquantized
modules can be converted; anything else Quark can express is refused with the
module and the reason.
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Any

import torch

from ...errors import ConfigError, UnsupportedError, json_kind
from .base import LinearCodec, LinearData, SourceFormat, is_excluded, optional_object, string_list
from .bf16 import Bf16Linear
from .mxfp4 import MXFP4_BLOCK, mxfp4_dequant

if TYPE_CHECKING:
    from ...files.source import SourceCheckpoint


class Mxfp4Linear(LinearCodec, codec="mxfp4"):
    """`{m}.weight` uint8 [N, K/2] (two e2m1 codes per byte, low nibble first) and
    `{m}.weight_scale` uint8 [N, K/32] (e8m0), as Quark exports them."""

    quantized = True

    def source_names(self, module: str) -> list[str]:
        return [f"{module}.weight", f"{module}.weight_scale"]

    def check(self, src: "SourceCheckpoint", module: str, out_f: int, in_f: int) -> list[str]:
        w, s = self.source_names(module)
        problems = []
        if in_f % MXFP4_BLOCK:
            return [f"{module}: {in_f} input features are not a multiple of the MXFP4 group of 32"]
        for name, shape, what in ((w, (out_f, in_f // 2), f"packed e2m1, K/2 = {in_f}/2"),
                                  (s, (out_f, in_f // MXFP4_BLOCK), f"e8m0 scales, K/32 = {in_f}/32")):
            if name not in src:
                problems.append(f"missing tensor {name} (expected uint8 {list(shape)}: {what})")
                continue
            info = src.info(name)
            if info.dtype != torch.uint8:
                problems.append(
                    f"{info.file}: tensor {name} has dtype {info.dtype}, expected uint8 ({what}); the Quark config "
                    f"resolves {module} to MXFP4"
                )
            elif info.shape != shape:
                problems.append(f"{info.file}: tensor {name} has shape {list(info.shape)}, expected {list(shape)} ({what})")
        return problems

    def read(self, src: "SourceCheckpoint", module: str, axis: int | None = None, start: int = 0, stop: int = 0,
             defer_check: bool = False) -> LinearData:  # checked as read (defer_check ignored)
        w, s = self.source_names(module)
        if axis is None:
            d, origin = LinearData(src.get(w), src.get(s)), ()
        elif axis == 0:
            d, origin = LinearData(src.get_rows(w, start, stop), src.get_rows(s, start, stop)), (start,)
        else:
            # Row-parallel: bytes along dim 1 (two values per byte), scale columns per 32 (spec §3.3.1).
            d = LinearData(src.get_cols(w, start // 2, stop // 2),
                           src.get_cols(s, start // MXFP4_BLOCK, stop // MXFP4_BLOCK))
            origin = (0, start // MXFP4_BLOCK)
        assert d.scale is not None
        src.values.e8m0(s, src.info(s).file, d.scale, origin)  # e2m1 codes have no NaN; the scale byte 0xFF is one
        return d

    def dequant(self, data: LinearData) -> torch.Tensor:
        assert data.scale is not None
        return mxfp4_dequant(data.weight, data.scale)


_SUPPORTED = "OCP MXFP4 (weight dtype fp4, qscheme per_group, group_size 32, scale_format e8m0, static)"


def _codec_for_spec(module: str, spec: dict[str, Any] | None, where: str) -> LinearCodec:
    w = (spec or {}).get("weight")
    if not w:
        return Bf16Linear()
    if not isinstance(w, dict):
        raise ConfigError(f"config.json quantization_config ({where}): weight is {json_kind(w)} {w!r}, expected a "
                          f"Quark quantization spec object (dtype, qscheme, group_size, ...) or null")
    dtype = str(w.get("dtype", "")).lower()
    problems = []
    if dtype not in ("fp4", "fp4_e2m1"):
        problems.append(f"weight dtype {w.get('dtype')!r}")
    if w.get("qscheme") != "per_group":
        problems.append(f"qscheme {w.get('qscheme')!r}")
    if w.get("group_size") != MXFP4_BLOCK:
        problems.append(f"group_size {w.get('group_size')!r}")
    if w.get("scale_format", "e8m0") != "e8m0":
        problems.append(f"scale_format {w.get('scale_format')!r}")
    if w.get("is_dynamic"):
        problems.append("dynamic weight quantisation")
    if problems:
        raise UnsupportedError(
            f"config.json quantization_config ({where}) gives {module} a Quark spec with {', '.join(problems)}; "
            f"atom-convert converts {_SUPPORTED} and unquantized layers"
        )
    return Mxfp4Linear()


class QuarkFormat(SourceFormat, fmt="quark-mxfp4"):
    description = "AMD Quark export, quant_method 'quark', OCP MXFP4 weights"

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        q = config["quantization_config"]
        where = "config.json"
        self.exclude: list[str] = list(string_list(q, "exclude", where))
        self.layer: dict[str, Any] = dict(optional_object(q, "layer_quant_config", where) or {})
        self.layer_type: dict[str, Any] = dict(optional_object(q, "layer_type_quant_config", where) or {})
        self.glob: dict[str, Any] | None = optional_object(q, "global_quant_config", where)
        for key, table in (("layer_quant_config", self.layer), ("layer_type_quant_config", self.layer_type)):
            for k, v in table.items():
                if v is not None and not isinstance(v, dict):
                    raise ConfigError(f"{where}: quantization_config.{key}[{k!r}] is {json_kind(v)} {v!r}, "
                                      f"expected a Quark spec object (with weight)")
        export = optional_object(q, "export", where) or {}
        if export.get("weight_format", "real_quantized") != "real_quantized":
            raise UnsupportedError(
                f"config.json: Quark export weight_format {export.get('weight_format')!r}; atom-convert reads "
                f"'real_quantized' exports (packed uint8 weights)"
            )
        self._cache: dict[str, LinearCodec] = {}

    @classmethod
    def matches(cls, qcfg: dict[str, Any] | None) -> bool:
        return bool(qcfg) and qcfg.get("quant_method") == "quark"  # type: ignore[union-attr]

    def resolve(self, module: str) -> tuple[dict[str, Any] | None, str]:
        """(spec, where it came from) for one module (spec §1.4, HEAD order)."""
        if is_excluded(module, self.exclude):
            return None, "exclude"
        for pattern, spec in self.layer.items():
            if ("*" in pattern and fnmatch.fnmatchcase(module, pattern)) or ("*" not in pattern and module in pattern):
                return spec, f"layer_quant_config[{pattern!r}]"
        for typ in ("Linear", "nn.Linear", "torch.nn.Linear"):
            if typ in self.layer_type:
                return self.layer_type[typ], f"layer_type_quant_config[{typ!r}]"
        return self.glob, "global_quant_config"

    def codec_for(self, module: str) -> LinearCodec:
        c = self._cache.get(module)
        if c is None:
            spec, where = self.resolve(module)
            c = self._cache[module] = _codec_for_spec(module, spec, where)
        return c

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "exclude": len(self.exclude), "layer_quant_config": list(self.layer)}
