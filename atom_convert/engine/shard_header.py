"""Where every byte of a planned shard goes: its safetensors header and each tensor's offset.

The plan fixes every shard's names, dtypes and shapes before any data is read, hence its header
(`shard_header`) and every tensor's absolute byte offset in the file (`shard_layout`): the data starts
at a multiple of 64 and the tensors lie back to back in `data_order` (64-aligned where the sizes
allow). The sha256 of the header (`header_digest`) identifies the shard's plan in the staging journal,
so a resume keeps only shards planned the same way.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import torch

from ..layout.plan import OutTensor, ShardPlan
from ..files.dtypes import ST_DTYPE

_ALIGN = 64  # tensor data starts 64-byte aligned where the no-gaps rule allows (`data_order`)
_VIEW_ALIGN = 16  # serve/transfer.py CPU_VIEW_ALIGN: a CPU load maps a tensor at a multiple of this


def data_order(sizes: list[int]) -> list[int]:
    """The order (indexes into `sizes`) in which tensors of these byte sizes lie in the data section.

    safetensors stores tensors back to back (its loader refuses a gap, and so does files/safetensors.py),
    so padding can go only before the data (the header's JSON is padded with spaces to end at a multiple
    of `_ALIGN`), and a tensor starts aligned when the tensors before it add up to a multiple. So:
    first every tensor whose size is a multiple of 64, in the given (plan) order: each starts at a
    multiple of 64; then those whose size is a multiple of 16 (largest first: each starts at a multiple
    of 16, the first at one of 64); then the rest (largest first; the first starts at a multiple of 16).
    At DeepSeek-V3 width (fp8, tp 8) that leaves a rank's 4-byte W_K/W_V scales and a few KB of
    fused_qkv_a_proj scales off 64 (the scalars off 16), against 54% of the bytes off 64 back to back in
    plan order. No tensor's bytes change, only where they lie.
    """
    full = [i for i, n in enumerate(sizes) if n % _ALIGN == 0]
    rest = sorted((i for i, n in enumerate(sizes) if n % _ALIGN),
                  key=lambda i: (sizes[i] % _VIEW_ALIGN != 0, -sizes[i], i))
    return full + rest


def _spans(entries: list[tuple[str, torch.dtype, tuple[int, ...], int]]) -> dict[str, tuple[int, int]]:
    """name -> [begin, end) in the data section, in `data_order`."""
    spans, off = {}, 0
    for i in data_order([e[3] for e in entries]):
        spans[entries[i][0]] = (off, off + entries[i][3])
        off += entries[i][3]
    return spans


def safetensors_header(entries: list[tuple[str, torch.dtype, tuple[int, ...], int]],
                       metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length plus the JSON header (entries in the given order) for tensors laid out back to
    back in `data_order`, padded with spaces so that the data starts at a multiple of `_ALIGN`."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    spans = _spans(entries)
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": ST_DTYPE[dtype], "shape": list(shape), "data_offsets": list(spans[name])}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def _entries(plan: ShardPlan, outputs: dict[str, OutTensor]) -> list[tuple[str, torch.dtype, tuple[int, ...], int]]:
    return [(n, outputs[n].dtype, outputs[n].shape, outputs[n].nbytes) for n in plan.names]


def shard_header(plan: ShardPlan, outputs: dict[str, OutTensor]) -> bytes:
    """The exact first bytes of a planned shard; their sha256 identifies the shard's plan in the journal."""
    return safetensors_header(_entries(plan, outputs), metadata={"format": "pt"})


def header_digest(plan: ShardPlan, outputs: dict[str, OutTensor]) -> str:
    return hashlib.sha256(shard_header(plan, outputs)).hexdigest()


def shard_layout(plan: ShardPlan, outputs: dict[str, OutTensor]) -> tuple[bytes, dict[str, int], int]:
    """A planned shard's header, each tensor's absolute byte offset, and the file's size."""
    header = shard_header(plan, outputs)
    spans = _spans(_entries(plan, outputs))
    offsets = {n: len(header) + b for n, (b, _) in spans.items()}
    return header, offsets, len(header) + max((e for _, e in spans.values()), default=0)
