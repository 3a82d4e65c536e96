"""`open_converted`: the converted tensors of one rank by name, memory-mapped.

What a runtime-side loader needs: the tensor (same bytes, dtype, shape as the
runtime holds after post-load processing), its manifest entry (is_shuffled,
sources), and the aliases to re-create.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from .errors import ConvertedCheckError
from .manifest import read_manifest


class ConvertedCheckpoint:
    """One rank's view of a converted directory (or of its `mtp/` set)."""

    def __init__(self, path: str | os.PathLike[str], rank: int = 0):
        self.path = Path(path)
        self.manifest: dict[str, Any] = read_manifest(self.path)
        tp = int(self.manifest["tp_size"])
        if not 0 <= rank < tp:
            raise ConvertedCheckError(f"{self.path}: rank {rank} out of range; converted for tp={tp}")
        self.rank = rank
        self._handles: dict[str, Any] = {}

    def __enter__(self) -> "ConvertedCheckpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._handles.clear()

    def keys(self) -> list[str]:
        """Tensor names in load order."""
        return list(self.manifest["tensors"])

    def __contains__(self, name: str) -> bool:
        return name in self.manifest["tensors"] or name in self.manifest.get("aliases", {})

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    @property
    def aliases(self) -> dict[str, str]:
        return dict(self.manifest.get("aliases", {}))

    def entry(self, name: str) -> dict[str, Any]:
        """The manifest entry: file, dtype, shape, is_shuffled, sources."""
        name = self.manifest.get("aliases", {}).get(name, name)
        try:
            e = dict(self.manifest["tensors"][name])
        except KeyError:
            raise KeyError(f"{name} is not in {self.path} (see atom-convert inspect {self.path})") from None
        e["file"] = e["rank_files"][self.rank]
        return e

    def get(self, name: str) -> torch.Tensor:
        """The tensor, memory-mapped from its shard."""
        e = self.entry(name)
        h = self._handles.get(e["file"])
        if h is None:
            h = safe_open(str(self.path / e["file"]), framework="pt", device="cpu")
            self._handles[e["file"]] = h
        return h.get_tensor(self.manifest.get("aliases", {}).get(name, name))

    def mtp(self) -> "ConvertedCheckpoint | None":
        """The MTP drafter's converted set, if it was converted."""
        m = self.manifest.get("mtp") or {}
        if m.get("status") != "converted":
            return None
        return ConvertedCheckpoint(self.path / m["path"], self.rank)


def open_converted(path: str | os.PathLike[str], rank: int = 0) -> ConvertedCheckpoint:
    """Open a converted directory for one tensor-parallel rank.

    Example:
        >>> with open_converted("DeepSeek-V3-atom", rank=0) as ck:
        ...     w = ck.get("model.layers.0.self_attn.fused_qkv_a_proj.weight")
        ...     ck.entry("model.layers.0.self_attn.fused_qkv_a_proj.weight")["is_shuffled"]
        True
    """
    return ConvertedCheckpoint(path, rank)
