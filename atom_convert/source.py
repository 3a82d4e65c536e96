"""A lazy index of the tensors of a Hugging Face checkpoint directory.

Only headers are read up front (a few KB per file); tensor data is read on
demand through `safe_open` (mmap), a slice at a time. `release()` drops the
handles, which unmaps the files, so the resident set stays bounded by what the
current step holds.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .errors import BadInputError, CheckpointError
from .quant.formats import DTYPE_FROM_ST

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """Parse a safetensors header; returns (header dict, data start offset).

    Raises CheckpointError naming the file for a malformed or truncated file.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path.name}: not a safetensors file ({size} bytes, expected at least 8)")
        (hlen,) = struct.unpack("<Q", raw)
        if hlen > _MAX_HEADER or 8 + hlen > size:
            raise CheckpointError(
                f"{path.name}: truncated or not a safetensors file: header length {hlen} bytes, file size {size} bytes",
                hint="Re-download the file; compare its size with the one on the Hub.",
            )
        try:
            header = json.loads(f.read(hlen))
        except ValueError as e:
            raise CheckpointError(f"{path.name}: safetensors header is not valid JSON ({e})") from None
    data_end = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        data_end = max(data_end, int(meta["data_offsets"][1]))
    start = 8 + hlen
    if start + data_end > size:
        raise CheckpointError(
            f"{path.name}: truncated: its header says the data ends at byte {start + data_end}, "
            f"but the file has {size} bytes",
            hint="Re-download the file; compare its size with the one on the Hub.",
        )
    return header, start


class SourceCheckpoint:
    """The tensors of one checkpoint directory, indexed by name, read lazily."""

    hub: dict[str, str] | None = None  # repo_id, revision, commit when the folder is a Hub snapshot

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.is_dir():
            raise BadInputError(f"source {self.path} is not a directory (expected a Hugging Face checkpoint folder)")
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise BadInputError(f"{cfg}: missing; a Hugging Face checkpoint folder needs config.json")
        try:
            self.config: dict[str, Any] = json.loads(cfg.read_text())
        except ValueError as e:
            raise BadInputError(f"{cfg}: not valid JSON ({e})") from None
        self.tensors: dict[str, TensorInfo] = {}
        self.files: list[str] = []
        self.index_file: str | None = None
        self._handles: dict[str, Any] = {}
        self._scan()

    # -- indexing --------------------------------------------------------------------
    def _scan(self) -> None:
        problems: list[str] = []
        index = self.path / INDEX_NAME
        weight_map: dict[str, str] | None = None
        if index.is_file():
            self.index_file = INDEX_NAME
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{INDEX_NAME}: unreadable or has no weight_map ({e})") from None
            files = sorted(set(weight_map.values()))
            for f in files:
                if not self._file_present(f):
                    n = sum(1 for v in weight_map.values() if v == f)
                    problems.append(f"{INDEX_NAME} names {f} ({n} tensors), but the file does not exist")
        elif self._file_present(SINGLE_NAME):
            files = [SINGLE_NAME]
        else:
            raise CheckpointError(
                f"{self.path}: no {SINGLE_NAME} and no {INDEX_NAME}",
                hint="Point SRC at the folder holding the checkpoint's safetensors files.",
            )
        if problems:
            raise CheckpointError(problems, hint="Download the missing files, or fix the index.")
        self.files = files
        for f in files:
            try:
                header = self._read_header(f)
            except CheckpointError as e:
                problems.extend(e.problems)
                continue
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                dt = DTYPE_FROM_ST.get(meta["dtype"])
                if dt is None:
                    problems.append(f"{f}: tensor {name} has dtype {meta['dtype']}, which atom-convert does not read")
                    continue
                if name in self.tensors:
                    problems.append(f"tensor {name} is stored twice: in {self.tensors[name].file} and in {f}")
                    continue
                b, e = meta["data_offsets"]
                shape = tuple(int(d) for d in meta["shape"])
                self.tensors[name] = TensorInfo(name, f, dt, shape, int(e) - int(b))
        if weight_map is not None:
            for name, f in weight_map.items():
                info = self.tensors.get(name)
                if info is None and f in files and not any(f in p for p in problems):
                    problems.append(f"{INDEX_NAME} maps {name} to {f}, but {f} does not contain it")
                elif info is not None and info.file != f:
                    problems.append(f"{INDEX_NAME} maps {name} to {f}, but it is stored in {info.file}")
            for name, info in self.tensors.items():
                if name not in weight_map:
                    problems.append(f"{info.file} holds {name}, which {INDEX_NAME} does not list")
        if problems:
            raise CheckpointError(problems)

    # Hooks for a source whose files are still arriving (hub.HubSource): where the headers come
    # from, whether a file exists, and the wait before a file's data is first read.
    def _file_present(self, file: str) -> bool:
        return (self.path / file).is_file()

    def _read_header(self, file: str) -> dict[str, Any]:
        return read_safetensors_header(self.path / file)[0]

    def begin(self, file_order: list[str]) -> None:
        """Called once the plan is known, with the files in the order conversion reads them."""

    def close(self) -> None:
        self.release()

    # -- access ------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def _handle(self, file: str) -> Any:
        h = self._handles.get(file)
        if h is None:
            h = safe_open(str(self.path / file), framework="pt", device="cpu")
            self._handles[file] = h
        return h

    def get(self, name: str) -> torch.Tensor:
        return self._handle(self.tensors[name].file).get_tensor(name)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0, reading only those bytes."""
        info = self.tensors[name]
        if start == 0 and stop == info.shape[0]:
            return self.get(name)
        return self._handle(info.file).get_slice(name)[start:stop]

    def get_cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Columns [start, stop) of dim 1 of a 2-D tensor."""
        info = self.tensors[name]
        if start == 0 and stop == info.shape[1]:
            return self.get(name)
        return self._handle(info.file).get_slice(name)[:, start:stop].contiguous()

    def release(self) -> None:
        """Close every open file (unmaps them; pages read so far leave the resident set)."""
        self._handles.clear()

    def file_sizes(self) -> dict[str, int]:
        return {f: (self.path / f).stat().st_size for f in self.files}
