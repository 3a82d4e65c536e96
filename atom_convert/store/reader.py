"""`open_converted`: the converted tensors of one rank by name, memory-mapped.

What a runtime-side loader needs: the tensor (same bytes, dtype, shape as the
runtime holds after post-load processing), its manifest entry (is_shuffled,
sources, placement, split), and the aliases to re-create. Every parallel mode
is served the same way: the manifest names, per tensor, the file each rank
reads (its own file, or a common file every rank maps; spec atom-parallel.md §3.1).
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import torch
from safetensors import safe_open

from ..errors import ConvertedCheckError
from ..files import safetensors as safetensors_file
from ..files.dtypes import ST_DTYPE, dtype_from_name
from ..layout.options import check_count, check_path
from .manifest import MANIFEST_NAME, Manifest, converted_error

_FIX = "The converted directory is damaged or was edited: convert again (atom-convert convert SRC DST --force)"


class ConvertedCheckpoint:
    """One rank's view of a converted directory (or of its `mtp/` set)."""

    def __init__(self, path: str | os.PathLike[str], rank: int = 0):
        self.path = check_path("path", path)
        rank = check_count("rank", rank, minimum=0)
        self.typed = Manifest.read(self.path)
        self.manifest: dict[str, Any] = self.typed.raw  # the JSON form (version 1 upgraded)
        world = self.typed.parallel.world
        if not 0 <= rank < world:
            p = self.typed.parallel
            raise ConvertedCheckError(f"{self.path}: rank {rank} out of range; converted for tp={world} "
                                      f"(ep={p.ep}, dp_attention={p.dp_attention}): ranks 0..{world - 1}")
        self.rank = rank
        self._handles: dict[str, Any] = {}
        self._headers: dict[str, dict[str, dict[str, Any]]] = {}

    def __enter__(self) -> "ConvertedCheckpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._handles.clear()
        self._headers.clear()

    def keys(self) -> list[str]:
        """Tensor names in load order."""
        return list(self.typed.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.typed.tensors or name in self.typed.aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    @property
    def aliases(self) -> dict[str, str]:
        return dict(self.typed.aliases)

    @property
    def layout(self) -> Any:
        """This rank's `RankLayout` (expert range, slot map, expert_map), atom_convert.layout.parallel."""
        return self.typed.parallel.ranks[self.rank]

    def files(self) -> list[str]:
        """The files this rank maps: its own and the common ones."""
        return self.typed.rank_files(self.rank)

    def entry(self, name: str) -> dict[str, Any]:
        """The manifest entry, `file` being the one this rank reads: dtype, shape, is_shuffled,
        sources, placement, split, rank_files."""
        target = self.typed.aliases.get(name, name)
        try:
            e = dict(self.manifest["tensors"][target])
        except KeyError:
            raise KeyError(f"{name} is not in {self.path} (see atom-convert inspect {self.path})") from None
        e["file"] = e["rank_files"][self.rank]
        return e

    def get(self, name: str) -> torch.Tensor:
        """The tensor, memory-mapped from its shard. The shard's header is validated when the file
        is first opened (files/safetensors.read_header) and the tensor's header dtype and shape
        compared with the manifest's: ConvertedCheckError naming both when they differ."""
        e = self.entry(name)
        target = self.typed.aliases.get(name, name)
        rel = e["file"]
        held = self._header(rel).get(target)
        where = f"{self.path / rel}: tensor {target}"
        if held is None:
            raise converted_error([f"{where} is not in the file, but {self.path / MANIFEST_NAME} names the file for "
                                   f"it"], _FIX)
        want = ST_DTYPE[dtype_from_name(e["dtype"])]
        if held["dtype"] != want or list(held["shape"]) != list(e["shape"]):
            raise converted_error([f"{where}: the file's header says {held['dtype']} {held['shape']}, "
                                   f"{self.path / MANIFEST_NAME} says {e['dtype']} ({want}) {e['shape']}"], _FIX)
        h = self._handles.get(rel)
        if h is None:
            h = safe_open(str(self.path / rel), framework="pt", device="cpu")
            self._handles[rel] = h
        return h.get_tensor(target)

    def _header(self, rel: str) -> dict[str, dict[str, Any]]:
        """The validated header's tensors of file `rel` (read once per file)."""
        got = self._headers.get(rel)
        if got is None:
            got = safetensors_file.read_header(self.path / rel, name=str(self.path / rel), fix=_FIX,
                                               error=converted_error).tensors
            self._headers[rel] = got
        return got

    def mtp(self) -> "ConvertedCheckpoint | None":
        """The MTP drafter's converted set, if it was converted."""
        m = self.typed.mtp
        if m.get("status") != "converted":
            return None
        return ConvertedCheckpoint(self.path / m["path"], self.rank)


def open_converted(path: str | os.PathLike[str], rank: int = 0) -> ConvertedCheckpoint:
    """Open a converted directory for one rank (0 .. tp-1, in every parallel mode).

    Example:
        >>> with open_converted("DeepSeek-V3-atom", rank=0) as ck:
        ...     w = ck.get("model.layers.0.self_attn.fused_qkv_a_proj.weight")
        ...     ck.entry("model.layers.0.self_attn.fused_qkv_a_proj.weight")["is_shuffled"]
        True
    """
    return ConvertedCheckpoint(path, rank)
