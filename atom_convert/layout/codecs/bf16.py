"""Unquantized source tensors (bf16 checkpoints, and excluded layers of quantized ones)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .base import LinearCodec, LinearData, SourceFormat

if TYPE_CHECKING:
    from ...files.source import SourceCheckpoint

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Bf16Linear(LinearCodec, codec="bf16"):
    quantized = False

    def source_names(self, module: str) -> list[str]:
        return [f"{module}.weight"]

    def check(self, src: "SourceCheckpoint", module: str, out_f: int, in_f: int) -> list[str]:
        name = f"{module}.weight"
        if name not in src:
            return [f"missing tensor {name} (expected a bf16 [{out_f}, {in_f}] weight)"]
        info = src.info(name)
        problems = []
        if info.dtype not in FLOAT_DTYPES:
            problems.append(
                f"{info.file}: tensor {name} has dtype {info.dtype}, expected bfloat16 "
                f"(this layer is unquantized in the source's quantization_config)"
            )
        if info.shape != (out_f, in_f):
            problems.append(f"{info.file}: tensor {name} has shape {list(info.shape)}, expected [{out_f}, {in_f}]")
        return problems

    def read(self, src: "SourceCheckpoint", module: str, axis: int | None = None, start: int = 0, stop: int = 0,
             defer_check: bool = False) -> LinearData:  # checked as read (defer_check ignored)
        name = f"{module}.weight"
        if axis is None:
            w = src.get(name)
        elif axis == 0:
            w = src.get_rows(name, start, stop)
        else:
            w = src.get_cols(name, start, stop)
        return LinearData(w.to(torch.bfloat16))

    def dequant(self, data: LinearData) -> torch.Tensor:
        return data.weight.float()


class Bf16Format(SourceFormat, fmt="bf16"):
    description = "no quantization_config: bf16 weights"

    @classmethod
    def matches(cls, qcfg: dict[str, Any] | None) -> bool:
        return not qcfg

    def codec_for(self, module: str) -> LinearCodec:
        return Bf16Linear()
