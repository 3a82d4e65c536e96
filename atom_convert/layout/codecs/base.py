"""Registries of source formats and of per-linear codecs.

A `SourceFormat` is chosen once from config.json's `quantization_config`; it
says, per linear module, which `LinearCodec` reads it. A codec knows the source
tensor names of one linear, checks their dtypes and shapes, reads (slices of)
them and dequantises them. Adding a format = one module that subclasses these
with `fmt=`/`codec=` keywords.
"""

from __future__ import annotations

import fnmatch
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from ...errors import ConfigError, UnsupportedError, json_found, json_kind

if TYPE_CHECKING:
    from ...files.source import SourceCheckpoint

_FORMATS: dict[str, type["SourceFormat"]] = {}
_CODECS: dict[str, type["LinearCodec"]] = {}


@dataclass
class LinearData:
    """One linear's weight (per-rank slice) and, for quantized codecs, its scale."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    # Set when the read left the weight's value check to the caller (`read(defer_check=True)`): run
    # it when the caller finds a bad value in what it made of the weight, for the report the read
    # would have made (file, tensor, first index in the stored tensor).
    recheck: Callable[[], None] | None = None


class LinearCodec(ABC):
    """How one linear module's weight is stored in the source checkpoint."""

    name: ClassVar[str]
    quantized: ClassVar[bool]

    def __init_subclass__(cls, codec: str | None = None, **kw: Any):
        super().__init_subclass__(**kw)
        if codec is not None:
            if codec in _CODECS:
                raise TypeError(f"codec {codec!r} registered twice ({_CODECS[codec].__name__}, {cls.__name__})")
            cls.name = codec
            _CODECS[codec] = cls

    @abstractmethod
    def source_names(self, module: str) -> list[str]:
        """Every source tensor this codec consumes for `module`."""

    @abstractmethod
    def check(self, src: "SourceCheckpoint", module: str, out_f: int, in_f: int) -> list[str]:
        """Problems (missing tensor, wrong dtype/shape, scale grid) as messages naming file and tensor."""

    @abstractmethod
    def read(self, src: "SourceCheckpoint", module: str, axis: int | None = None, start: int = 0, stop: int = 0,
             defer_check: bool = False) -> LinearData:
        """The whole linear (axis None) or rows (axis 0) / columns (axis 1) [start, stop).
        defer_check: the caller scans every byte of the weight for bad values itself (postload.py,
        gfx942 fp8 experts), so the read may skip its check and set `recheck`; a codec may ignore it
        and check as it reads."""

    @abstractmethod
    def dequant(self, data: LinearData) -> torch.Tensor:
        """fp32 values of `data`."""


class SourceFormat(ABC):
    """A checkpoint-wide quantisation format, detected from config.json."""

    name: ClassVar[str]
    description: ClassVar[str]

    def __init_subclass__(cls, fmt: str | None = None, **kw: Any):
        super().__init_subclass__(**kw)
        if fmt is not None:
            if fmt in _FORMATS:
                raise TypeError(f"format {fmt!r} registered twice ({_FORMATS[fmt].__name__}, {cls.__name__})")
            cls.name = fmt
            _FORMATS[fmt] = cls

    def __init__(self, config: dict[str, Any]):
        self.config = config

    @classmethod
    @abstractmethod
    def matches(cls, qcfg: dict[str, Any] | None) -> bool:
        """Whether config.json's quantization_config (None if absent) is this format."""

    @abstractmethod
    def codec_for(self, module: str) -> LinearCodec:
        """The codec of one linear module (full checkpoint name without `.weight`)."""

    def summary(self) -> dict[str, Any]:
        return {"name": self.name}


def available_formats() -> list[str]:
    return sorted(_FORMATS)


def detect_format(config: dict[str, Any], where: str = "config.json") -> SourceFormat:
    qcfg = config.get("quantization_config")
    if qcfg is not None and not isinstance(qcfg, dict):
        raise ConfigError(f"{where}: quantization_config is {json_kind(qcfg)} {_clip(qcfg)}, expected an object "
                          f"(with quant_method) or no quantization_config for bf16")
    if qcfg and not isinstance(qcfg.get("quant_method"), str):
        raise ConfigError(f"{where}: quantization_config.quant_method is {json_found(qcfg, 'quant_method')}, "
                          f"expected a string such as 'fp8' or 'quark'")
    for cls in _FORMATS.values():
        if cls.matches(qcfg):
            return cls(config)
    method = (qcfg or {}).get("quant_method")
    supported = "; ".join(f"{c.name} ({c.description})" for c in _FORMATS.values())
    raise UnsupportedError(
        f"{where}: quantization_config.quant_method {method!r} ({_short(qcfg)}) is not supported. "
        f"Supported source formats: {supported}."
    )


def _clip(v: Any, n: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


def string_list(q: dict[str, Any], key: str, where: str) -> list[str]:
    """An optional list-of-patterns key of a quantization_config (null or absent: empty)."""
    v = q.get(key)
    if v is None:
        return []
    if not (isinstance(v, list) and all(isinstance(p, str) for p in v)):
        raise ConfigError(f"{where}: quantization_config.{key} is {json_kind(v)} {_clip(v)}, expected a list of "
                          f"module names or patterns (strings)")
    return v


def optional_object(q: dict[str, Any], key: str, where: str) -> dict[str, Any] | None:
    v = q.get(key)
    if v is not None and not isinstance(v, dict):
        raise ConfigError(f"{where}: quantization_config.{key} is {json_kind(v)} {_clip(v)}, expected an object")
    return v


def _short(qcfg: dict[str, Any] | None) -> str:
    if not qcfg:
        return "none"
    keys = ("quant_method", "fmt", "weight_block_size", "format")
    return ", ".join(f"{k}={qcfg[k]!r}" for k in keys if k in qcfg)


def is_excluded(module: str, patterns: list[str]) -> bool:
    """ATOM HEAD's exclusion match (spec §1.4): `re:` regex, glob (exact or as a
    prefix of deeper modules), else an exact name or a dotted prefix."""
    for p in patterns:
        if p.startswith("re:"):
            if re.fullmatch(p[3:], module):
                return True
        elif any(c in p for c in "*?"):
            if fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(module, p + ".*"):
                return True
        elif module == p or module.startswith(p + "."):
            return True
    return False
