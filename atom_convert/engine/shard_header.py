"""Where every byte of a planned shard goes: its safetensors header and each tensor's offset.

The plan fixes every shard's names, dtypes and shapes before any data is read, hence its header
(`shard_header`) and every tensor's absolute byte offset in the file (`shard_layout`). The
sha256 of the header (`header_digest`) identifies the shard's plan in the staging journal, so a
resume keeps only shards planned the same way.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import torch

from ..layout.plan import OutTensor, ShardPlan
from ..files.dtypes import ST_DTYPE

_ALIGN = 8  # header padded so that tensor data starts 8-byte aligned (as safetensors does)


def safetensors_header(entries: list[tuple[str, torch.dtype, tuple[int, ...], int]],
                       metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length plus the JSON header for tensors laid out back to back in order."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    off = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def shard_header(plan: ShardPlan, outputs: dict[str, OutTensor]) -> bytes:
    """The exact first bytes of a planned shard; their sha256 identifies the shard's plan in the journal."""
    return safetensors_header([(n, outputs[n].dtype, outputs[n].shape, outputs[n].nbytes) for n in plan.names],
                              metadata={"format": "pt"})


def header_digest(plan: ShardPlan, outputs: dict[str, OutTensor]) -> str:
    return hashlib.sha256(shard_header(plan, outputs)).hexdigest()


def shard_layout(plan: ShardPlan, outputs: dict[str, OutTensor]) -> tuple[bytes, dict[str, int], int]:
    """A planned shard's header, each tensor's absolute byte offset, and the file's size."""
    header = shard_header(plan, outputs)
    offsets, off = {}, len(header)
    for n in plan.names:
        offsets[n] = off
        off += outputs[n].nbytes
    return header, offsets, off
